"""The decoder of one tensor-parallel rank, and the forward messages rank 0 sends.

Every rank holds a `TensorParallelDecoder` built from its slice of the weights.  Rank 0's is
the engine's target: each call of its forward (the runner's, or a drafter's that runs the
target's first layers) is first sent to the followers, which run the same call on their
slices, so that the collectives inside (two all_reduces per layer, one all_gather of logits)
pair up.  Rank 0 alone samples and verifies, from the full logits the all_gather gives it:
speculation stays lossless because nothing downstream of the logits is split.

Numerics: the all_reduce adds the ranks' partial sums, which changes the summation order of
o_proj and down_proj against one process, so logits differ from tp=1 in the last bits (greedy
text agrees unless two tokens are near-tied).  Within one tp size the order is fixed, so batch
invariance (a row's logits do not depend on which rows share the forward) holds per tp size,
not across sizes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from quickdraft.distributed.cache import KVMove, TensorParallelKVCache
from quickdraft.distributed.group import ParallelGroup
from quickdraft.distributed.sharding import ShardLayout
from quickdraft.kv.cache import KVCache
from quickdraft.models.attention import AttentionBatch, SequenceAttention
from quickdraft.models.config import ModelConfig
from quickdraft.models.decoder import Decoder, DecoderLayer, ForwardOutput, LogitsBuffer
from quickdraft.models.loader import build_decoder, load_weights
from quickdraft.models.lora import LoRABatch
from quickdraft.models.quantized import QuantizedWeight

FORWARD, SHUTDOWN = 1, 2  # message kinds


@dataclass
class ForwardCall:
    """One forward, as rank 0 made it (CPU tensors; each follower moves them to its device)."""

    token_ids: torch.Tensor | None  # [N]
    positions: torch.Tensor  # [N]
    sequences: list[SequenceAttention]
    block_index: torch.Tensor  # [G, N]
    block_offset: torch.Tensor  # [N]
    block_tables: dict[int, list[list[int]]]  # slot -> its table per cache group
    moves: list[KVMove] = field(default_factory=list)  # KV compactions since the last forward
    hidden_states: torch.Tensor | None = None  # [N, D] when start_layer > 0
    start_layer: int = 0
    end_layer: int | None = None
    logits_rows: torch.Tensor | None = None  # [M]


def _cpu(tensor: torch.Tensor | None) -> torch.Tensor | None:
    # A copy: pickling a view would send the whole storage it views.
    return None if tensor is None else tensor.detach().to("cpu", copy=True)


def _on(tensor: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if tensor is None else tensor.to(device)


class TensorParallelDecoder(Decoder):
    """A Decoder over this rank's heads, MLP units and vocabulary rows (see sharding.py).

    `config` stays the full model's (what the runner and drafters read); the layers were built
    from the rank's local config.  Rank 0 also keeps the full LM head (tied: the embedding it
    holds anyway) for the drafters that borrow LM-head rows and for sparse grammar logits.
    """

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype, max_len: int):
        super().__init__(config, dtype=dtype, max_len=max_len)
        self.group: ParallelGroup | None = None
        # [ceil(V / tp), D] this rank's vocabulary rows
        self.lm_head_shard: torch.Tensor | QuantizedWeight | None = None

    def attach(
        self, *, group: ParallelGroup, config: ModelConfig, lm_head_shard: torch.Tensor | QuantizedWeight
    ) -> None:
        self.group = group
        self.config = config
        self.lm_head_shard = lm_head_shard
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            layer.reduce_output = group.all_reduce

    @property
    def lm_head_weight(self) -> torch.Tensor | QuantizedWeight:  # [V, D]
        if self.lm_head is None and not self.config.tie_word_embeddings:
            raise RuntimeError("only rank 0 keeps the full LM head of an untied model")
        return super().lm_head_weight

    def compute_logits(self, hidden: torch.Tensor, *, buffer: LogitsBuffer | None = None) -> torch.Tensor:
        """[M, D] -> [M, V]: every rank's shard gathered (a gathered result is fresh memory: `buffer` unused)."""
        assert self.group is not None and self.lm_head_shard is not None
        local = self.lm_head_matmul(self.norm(hidden), self.lm_head_shard)  # [M, ceil(V / tp)]
        logits = torch.cat(self.group.all_gather(local), dim=-1)[:, : self.config.vocab_size]
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def forward(
        self,
        token_ids: torch.Tensor | None,
        positions: torch.Tensor,
        *,
        attn: AttentionBatch,
        cache: KVCache,
        hidden_states: torch.Tensor | None = None,
        start_layer: int = 0,
        end_layer: int | None = None,
        capture_layers: tuple[int, ...] = (),
        logits_rows: torch.Tensor | None = None,
        logits_buffer: LogitsBuffer | None = None,
        lora: LoRABatch | None = None,  # always None: EngineConfig refuses LoRA with tensor parallelism
    ) -> ForwardOutput:
        assert self.group is not None
        if lora is not None:
            raise ValueError("LoRA adapters are not split over tensor-parallel ranks")
        if self.group.rank == 0:
            if not isinstance(cache, TensorParallelKVCache):
                raise TypeError("a tensor-parallel target runs over its TensorParallelKVCache")
            call = ForwardCall(
                token_ids=_cpu(token_ids),
                positions=positions.cpu(),
                sequences=[_seq_on(seq, torch.device("cpu")) for seq in attn.sequences],
                block_index=attn.block_index.cpu(),
                block_offset=attn.block_offset.cpu(),
                block_tables=cache.block_tables([seq.slot for seq in attn.sequences]),
                moves=cache.take_moves(),
                hidden_states=_cpu(hidden_states),
                start_layer=start_layer,
                end_layer=end_layer,
                logits_rows=_cpu(logits_rows),
            )
            self.group.send_object(FORWARD, call)
        return super().forward(
            token_ids,
            positions,
            attn=attn,
            cache=cache,
            hidden_states=hidden_states,
            start_layer=start_layer,
            end_layer=end_layer,
            capture_layers=capture_layers,
            logits_rows=logits_rows,
        )

    def replay(self, call: ForwardCall, *, cache: TensorParallelKVCache, device: torch.device) -> None:
        """A follower: rank 0's forward on this rank's slices (the outputs are rank 0's to use)."""
        cache.apply_moves(call.moves)
        cache.adopt_block_tables(call.block_tables)
        attn = AttentionBatch(
            sequences=[_seq_on(seq, device) for seq in call.sequences],
            block_index=call.block_index.to(device),
            block_offset=call.block_offset.to(device),
        )
        self.forward(
            _on(call.token_ids, device),
            call.positions.to(device),
            attn=attn,
            cache=cache,
            hidden_states=_on(call.hidden_states, device),
            start_layer=call.start_layer,
            end_layer=call.end_layer,
            logits_rows=_on(call.logits_rows, device),
        )


def _seq_on(seq: SequenceAttention, device: torch.device) -> SequenceAttention:
    return SequenceAttention(
        slot=seq.slot,
        row_start=seq.row_start,
        row_end=seq.row_end,
        cache_len=seq.cache_len,
        full_kv_start=seq.full_kv_start,
        sliding_kv_start=seq.sliding_kv_start,
        full_mask=_on(seq.full_mask, device),
        sliding_mask=_on(seq.sliding_mask, device),
    )


def serve_forwards(decoder: TensorParallelDecoder, *, cache: TensorParallelKVCache, group: ParallelGroup) -> None:
    """A follower's loop: run every forward rank 0 sends until it says stop."""
    while True:
        kind, call = group.receive_object()
        if kind == SHUTDOWN:
            return
        if kind != FORWARD:
            raise RuntimeError(f"unknown message kind {kind} from rank 0")
        decoder.replay(call, cache=cache, device=group.device)


def shard_decoder(
    config: ModelConfig,
    state: dict[str, torch.Tensor],  # our full (fused) float state dict, as convert_hf_tensors makes it
    *,
    group: ParallelGroup,
    dtype: torch.dtype,
    device: torch.device,
    max_len: int,
    quantized: dict[str, QuantizedWeight] | None = None,  # the weights kept quantized (load_weights)
    context_len: int | None = None,
) -> TensorParallelDecoder:
    """This rank's decoder from the full weights (each rank keeps only its slices)."""
    layout = ShardLayout(config=config, rank=group.rank, size=group.size)
    quantized = quantized or {}
    head_name = "embed_tokens" if config.tie_word_embeddings else "lm_head"
    full_lm_head = quantized[head_name] if head_name in quantized else state[head_name]
    local = layout.shard_state(state)
    local_quantized = layout.shard_state(quantized)
    keep_full_head = group.rank == 0 and not config.tie_word_embeddings
    if keep_full_head:  # rank 0's drafters may borrow LM-head rows
        if isinstance(full_lm_head, QuantizedWeight):
            local_quantized["lm_head"] = full_lm_head
        else:
            local["lm_head"] = full_lm_head
    decoder = build_decoder(
        layout.local_config(),
        local,
        dtype=dtype,
        device=device,
        max_len=max_len,
        quantized=local_quantized,
        decoder_class=TensorParallelDecoder,
        context_len=context_len,
    )
    assert isinstance(decoder, TensorParallelDecoder)
    if not config.tie_word_embeddings and not keep_full_head:
        decoder.lm_head = None  # followers compute their slice only
    if isinstance(full_lm_head, QuantizedWeight):
        shard: torch.Tensor | QuantizedWeight = layout.lm_head_slice(full_lm_head)
    elif config.tie_word_embeddings:
        shard = layout.lm_head_slice(decoder.embed_tokens.detach())  # a view where no padding is needed
    else:
        rows = layout.lm_head_slice(full_lm_head)
        assert isinstance(rows, torch.Tensor)
        shard = rows.to(device=device, dtype=dtype).contiguous()
    decoder.attach(group=group, config=config, lm_head_shard=shard)
    return decoder


def load_sharded_decoder(
    model_dir,
    *,
    group: ParallelGroup,
    dtype: torch.dtype,
    device: torch.device,
    max_len: int,
    quantization: str | None = None,
    gguf_path=None,
    context_len: int | None = None,
) -> tuple[TensorParallelDecoder, ModelConfig]:
    """This rank's decoder of the checkpoint in `model_dir` (float weights of `dtype`, or
    quantized as `load_weights` reads them)."""
    from pathlib import Path

    model_dir = Path(model_dir)
    weights = load_weights(
        model_dir,
        dtype=dtype,
        device=device,
        quantization=quantization,
        gguf_path=None if gguf_path is None else Path(gguf_path),
    )
    decoder = shard_decoder(
        weights.config,
        weights.state,
        group=group,
        dtype=dtype,
        device=device,
        max_len=max_len,
        quantized=weights.quantized,
        context_len=context_len,
    )
    return decoder, weights.config
