"""Which slice of each weight a rank holds (Megatron-style tensor parallelism, our own code).

Per decoder layer, with tp ranks:

- column-parallel (split by output rows): q/k/v by heads, gate/up by intermediate units.  A
  rank computes its own heads' attention and its own MLP units with no communication;
- row-parallel (split by input columns): o_proj and down_proj.  Each rank's product is a
  partial sum of the full output; one all_reduce per matmul adds them (2 per layer);
- the LM head by vocabulary rows: each rank computes its slice of the logits, one all_gather
  assembles them;
- embeddings and norms are replicated (every rank holds the full hidden state).

KV heads split like q heads when tp divides them; when the model has fewer KV heads than
ranks (Gemma 3 270M has one), each rank keeps the one KV head its q heads attend to
(replicated), so grouped-query attention stays the same computation.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TypeVar

import torch

from quickdraft.models.config import ModelConfig
from quickdraft.models.quantized import QuantizedWeight

Weight = TypeVar("Weight", torch.Tensor, QuantizedWeight)  # a state dict holds one kind


def check_tensor_parallel(config: ModelConfig, size: int) -> None:
    """ValueError naming the field when `config` cannot be split over `size` ranks."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {size!r}")
    if size > 1 and config.moe_layers:
        raise ValueError(
            f"tensor_parallel_size {size}: a mixture-of-experts model ({config.model_type}) runs in one "
            "process; its experts are not split over ranks"
        )
    if config.num_heads % size:
        raise ValueError(
            f"tensor_parallel_size {size} must divide num_attention_heads ({config.num_heads}): "
            f"each rank computes whole attention heads"
        )
    if config.num_kv_heads % size and size % config.num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size {size} and num_key_value_heads ({config.num_kv_heads}) must divide "
            f"one another: KV heads are split over the ranks, or replicated when there are fewer"
        )
    if config.intermediate_size % size:
        raise ValueError(
            f"tensor_parallel_size {size} must divide intermediate_size ({config.intermediate_size}): "
            f"each rank computes an equal slice of the MLP"
        )


@dataclass(frozen=True)
class ShardLayout:
    """Rank `rank` of `size`: the heads, MLP units and vocabulary rows it holds."""

    config: ModelConfig
    rank: int
    size: int

    def __post_init__(self) -> None:
        check_tensor_parallel(self.config, self.size)
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} outside [0, {self.size})")

    @property
    def num_heads(self) -> int:
        return self.config.num_heads // self.size

    @property
    def num_kv_heads(self) -> int:
        return max(1, self.config.num_kv_heads // self.size)

    @property
    def first_head(self) -> int:
        return self.rank * self.num_heads

    @property
    def first_kv_head(self) -> int:
        c = self.config
        if c.num_kv_heads >= self.size:
            return self.rank * self.num_kv_heads
        return self.rank // (self.size // c.num_kv_heads)  # the KV head of this rank's q heads (replicated)

    @property
    def intermediate_size(self) -> int:
        return self.config.intermediate_size // self.size

    @property
    def vocab_rows(self) -> int:
        """Rows of each rank's LM-head slice: ceil(V / tp); the last slice is padded with zeros."""
        return -(-self.config.vocab_size // self.size)

    def local_config(self) -> ModelConfig:
        """The config a rank's decoder is built from: its heads and MLP units only."""
        return dataclasses.replace(
            self.config,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            intermediate_size=self.intermediate_size,
        )

    # ---- row ranges, in the full tensors --------------------------------------------------
    def _q_ranges(self) -> list[tuple[int, int]]:  # rows of the fused qkv weight (and bias) this rank keeps
        hd, c = self.config.head_dim, self.config
        kv_start, kv_end = self.first_kv_head * hd, (self.first_kv_head + self.num_kv_heads) * hd
        return [
            (self.first_head * hd, (self.first_head + self.num_heads) * hd),
            (c.q_size + kv_start, c.q_size + kv_end),
            (c.q_size + c.kv_size + kv_start, c.q_size + c.kv_size + kv_end),
        ]

    def _mlp_ranges(self) -> list[tuple[int, int]]:  # rows of the fused gate_up weight: gate slice, up slice
        n, start, full = self.intermediate_size, self.rank * self.intermediate_size, self.config.intermediate_size
        return [(start, start + n), (full + start, full + start + n)]

    def _column_range(self, leaf: str) -> tuple[int, int]:  # o_proj / down_proj: this rank's input columns
        if leaf == "o_proj":  # [D, H * hd]: the columns of this rank's heads
            hd = self.config.head_dim
            return self.first_head * hd, (self.first_head + self.num_heads) * hd
        start = self.rank * self.intermediate_size  # down_proj [D, I]: the columns of this rank's units
        return start, start + self.intermediate_size

    def shard_layer_tensor(self, leaf: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's slice of one layer tensor (`leaf`: its name within the layer)."""
        if leaf in ("qkv_proj", "qkv_bias"):
            return torch.cat([tensor[start:stop] for start, stop in self._q_ranges()])
        if leaf in ("gate_up_proj", "gate_up_bias"):
            return torch.cat([tensor[start:stop] for start, stop in self._mlp_ranges()])
        if leaf in ("o_proj", "down_proj"):
            start, stop = self._column_range(leaf)
            return tensor[:, start:stop]
        if leaf == "qk_norm.weight":  # [H + Hkv, hd]: one row per head, q heads then k heads
            H = self.config.num_heads
            q = tensor[self.first_head : self.first_head + self.num_heads]
            k = tensor[H + self.first_kv_head : H + self.first_kv_head + self.num_kv_heads]
            return torch.cat([q, k])
        return tensor  # norms and the row-parallel biases (added once, after the sum): replicated

    def shard_quantized_weight(self, leaf: str, weight: QuantizedWeight) -> QuantizedWeight:
        """This rank's slice of a layer weight kept quantized: the same quants and scales (whole
        blocks), so each rank's partial products are the kernels' usual exact block sums."""
        if leaf == "qkv_proj":
            return weight.take_rows(self._q_ranges())
        if leaf == "gate_up_proj":
            return weight.take_rows(self._mlp_ranges())
        if leaf in ("o_proj", "down_proj"):
            start, stop = self._column_range(leaf)
            try:
                return weight.take_columns(start, stop)
            except ValueError as err:
                raise ValueError(
                    f"tensor_parallel_size {self.size} splits {leaf} inside a quantized block ({err}); "
                    f"use dtype float32 or bfloat16 for this split"
                ) from err
        raise ValueError(f"no tensor-parallel split for the quantized layer weight {leaf!r}")

    def shard_state(self, state: dict[str, Weight]) -> dict[str, Weight]:
        """Our (fused) decoder weights, float or kept quantized -> this rank's, without the LM
        head (see `lm_head_slice`)."""
        out: dict[str, Weight] = {}
        for name, weight in state.items():
            if name == "lm_head":
                continue
            if not name.startswith("layers."):
                out[name] = weight  # embeddings, final norm
                continue
            leaf = name.split(".", 2)[2]
            if isinstance(weight, QuantizedWeight):
                out[name] = self.shard_quantized_weight(leaf, weight)
            else:
                out[name] = self.shard_layer_tensor(leaf, weight).contiguous()
        return out

    def lm_head_slice(self, weight: torch.Tensor | QuantizedWeight) -> torch.Tensor | QuantizedWeight:
        """This rank's vocabulary rows [ceil(V / tp), D] of the LM head [V, D]; the last rank's
        are padded with zero rows so that every rank's logits have one shape (the all_gather
        needs it; the padding is cut after)."""
        rows = self.vocab_rows
        start = self.rank * rows
        if isinstance(weight, QuantizedWeight):
            stop = min(start + rows, weight.shape[0])
            return weight.take_rows([(start, stop)], zero_rows=rows - (stop - start))
        piece = weight[start : start + rows]
        if piece.shape[0] == rows:
            return piece  # a view: a tied LM head shares the embedding's memory
        padding = weight.new_zeros(rows - piece.shape[0], weight.shape[1])
        return torch.cat([piece, padding])
