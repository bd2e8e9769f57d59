"""The one place where the scheduler's plain-Python plan becomes tensors for the model."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from quickdraft.kv.cache import KVCache
from quickdraft.models.attention import AttentionBatch, build_sequence_attention
from quickdraft.models.decoder import Decoder, ForwardOutput, LogitsBuffer
from quickdraft.models.lora import LoRABatch, LoRASlots, LoRAWeights
from quickdraft.verify.tree import Tree


@dataclass
class SequenceWork:
    """New tokens of one sequence for one forward: a prefill chunk, one decode token, or a tree."""

    slot: int
    cache_len: int  # KV already stored for this slot (committed tokens)
    token_ids: list[int]  # node 0 first; for a tree node 0 is the root
    tree: Tree | None = None  # the draft tree's shape (node 0 = the root); None = a chain
    logits_nodes: list[int] = field(default_factory=list)  # nodes whose logits are needed
    lora: LoRAWeights | None = None  # the LoRA adapter its tokens run, if any


@dataclass
class RunnerOutput:
    logits: torch.Tensor | None  # [M, V] rows in the order of (sequence, logits_nodes)
    logits_offsets: list[int]  # sequence b's logits are rows logits_offsets[b]:logits_offsets[b+1]
    forward: ForwardOutput


# A runner that reuses its logits memory keeps at most this much (128 rows of a 262k vocabulary:
# 32 decodes with trees of 4 nodes, or 8 of 16) and takes fresh memory for wider forwards.
REUSED_LOGITS_BYTES = 128 * 1024 * 1024


class ModelRunner:
    def __init__(self, *, model: Decoder, cache: KVCache, device: torch.device):
        self.model = model
        self.cache = cache
        self.device = device
        self.logits_buffer = LogitsBuffer(vocab_size=model.config.vocab_size, max_bytes=REUSED_LOGITS_BYTES)
        self.lora_slots: LoRASlots | None = None  # set where requests may run LoRA adapters

    def forward(
        self,
        work: list[SequenceWork],
        *,
        capture_layers: tuple[int, ...] = (),
        end_layer: int | None = None,
        reuse_logits: bool = False,
    ) -> RunnerOutput:
        """One forward over `work`; `end_layer` stops after that many layers (no logits then:
        the output's hidden_states are that layer's).  `reuse_logits`: the logits go into this
        runner's buffer, valid only until its next forward that reuses it (the engine's step,
        which uses them within the step); otherwise they are a tensor of their own."""
        if not work:
            raise ValueError("forward needs at least one sequence")
        token_ids: list[int] = []
        positions: list[int] = []
        block_index: list[list[int]] = [[] for _ in self.cache.groups]  # per cache group
        block_offset: list[int] = []
        logits_rows: list[int] = []
        logits_offsets = [0]
        sequences = []
        window = self.model.config.sliding_window
        for item in work:
            num_new = len(item.token_ids)
            if item.cache_len + num_new > self.cache.max_len:
                raise ValueError(
                    f"slot {item.slot}: {item.cache_len} cached + {num_new} new tokens exceed the "
                    f"cache length {self.cache.max_len}"
                )
            seq, seq_positions = build_sequence_attention(
                slot=item.slot,
                row_start=len(token_ids),
                cache_len=item.cache_len,
                tree=item.tree,
                num_new=num_new,
                sliding_window=window,
                bidirectional=self.model.config.bidirectional_attention,
            )
            sequences.append(seq)
            logits_rows.extend(seq.row_start + node for node in item.logits_nodes)
            logits_offsets.append(len(logits_rows))
            token_ids.extend(item.token_ids)
            positions.extend(seq_positions)
            self.cache.reserve(item.slot, item.cache_len + num_new)
            blocks, offsets = self.cache.locate_all(item.slot, list(range(item.cache_len, item.cache_len + num_new)))
            for group_index, group_blocks in zip(block_index, blocks):
                group_index.extend(group_blocks)
            block_offset.extend(offsets)
        for seq in sequences:
            seq.full_mask = self._to_device(seq.full_mask)
            seq.sliding_mask = self._to_device(seq.sliding_mask)
        attn = AttentionBatch(
            sequences=sequences,
            block_index=torch.tensor(block_index, dtype=torch.long, device=self.device),
            block_offset=self._long(block_offset),
        )
        out = self.model(
            self._long(token_ids),
            self._long(positions),
            attn=attn,
            cache=self.cache,
            capture_layers=capture_layers,
            end_layer=end_layer,
            logits_rows=self._long(logits_rows) if logits_rows else None,
            logits_buffer=self.logits_buffer if reuse_logits else None,
            lora=self._lora_batch(work, sequences),
        )
        return RunnerOutput(logits=out.logits, logits_offsets=logits_offsets, forward=out)

    def _lora_batch(self, work: list[SequenceWork], sequences: list) -> LoRABatch | None:
        """Each row's adapter slot, or None where no row runs an adapter."""
        adapters = [item.lora for item in work if item.lora is not None]
        if not adapters:
            return None
        if self.lora_slots is None:
            raise RuntimeError("a forward with LoRA adapters on a runner without LoRA slots (enable_lora)")
        slots = self.lora_slots.assign(adapters)
        row_slots = [-1] * sequences[-1].row_end
        by_slot: dict[int, LoRAWeights] = {}
        for item, seq in zip(work, sequences):
            if item.lora is not None:
                slot = slots[item.lora.key]
                by_slot[slot] = item.lora
                row_slots[seq.row_start : seq.row_end] = [slot] * (seq.row_end - seq.row_start)
        rows = {slot: self._long([row for row, held in enumerate(row_slots) if held == slot]) for slot in by_slot}
        return LoRABatch(row_slots=row_slots, rows=rows, adapters=by_slot)

    def _long(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _to_device(self, mask: torch.Tensor | None) -> torch.Tensor | None:
        return None if mask is None else mask.to(self.device, non_blocking=True)
