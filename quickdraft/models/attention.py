"""Attention metadata for one forward pass over a ragged batch of sequences.

The forward works on a flat list of new tokens ``[N]``: sequence ``b`` owns rows
``row_start:row_end``.  Its new tokens are written into its cache slot at storage indices
``cache_len + node`` (node = index in the tree, 0..T-1), and each new token attends to the
sequence's committed prefix plus its own tree ancestors (a chain is a tree of width 1).

For committed tokens storage index == absolute position, so a sliding-window layer can
read only the storage range it needs, and rollback is just a shorter length.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from quickdraft.kernels.quant_linear import FusedSequences
from quickdraft.verify.tree import Tree

if TYPE_CHECKING:
    from quickdraft.kv.cache import KVCache


@dataclass
class SequenceAttention:
    """One sequence's view of the cache for this forward."""

    slot: int
    row_start: int  # first row of this sequence in the flat batch
    row_end: int
    cache_len: int  # committed tokens whose KV is already stored
    # Key range [kv_start, kv_end) of the slot's storage read by each layer type, and the
    # boolean masks over it (True = may attend).  A mask of None means "attend to the whole
    # range", which is exact for single-token decode and keeps that path mask-free.
    full_kv_start: int
    sliding_kv_start: int
    full_mask: torch.Tensor | None  # [T, kv_end - full_kv_start]
    sliding_mask: torch.Tensor | None  # [T, kv_end - sliding_kv_start]

    @property
    def kv_end(self) -> int:
        return self.cache_len + (self.row_end - self.row_start)


@dataclass
class AttentionBatch:
    sequences: list[SequenceAttention]
    block_index: torch.Tensor  # [G, N] int64, per cache group the block each new token's KV is written to
    block_offset: torch.Tensor  # [N] int64, its row in that block
    # Per (cache group, sliding) the sequences as the fused layer kernel reads them: the same for
    # every layer of that kind, so built by its first layer of the forward.
    _fused: dict[tuple[int, bool], FusedSequences] = field(default_factory=dict, repr=False, compare=False)

    def fused_sequences(self, cache: KVCache, *, layer: int, sliding: bool) -> FusedSequences:
        """The sequences of this forward as layer `layer` (sliding-window or full attention)
        reads them: key ranges, masks and block tables of its cache group."""
        group = cache.group_of_layer[layer]
        key = (group, sliding)
        built = self._fused.get(key)
        if built is None:
            sequences, masks = [], []
            for seq in self.sequences:
                kv_start = seq.sliding_kv_start if sliding else seq.full_kv_start
                sequences.append((seq.row_start, seq.row_end, kv_start, seq.kv_end))
                masks.append(seq.sliding_mask if sliding else seq.full_mask)
            block_tables = [cache.block_table(seq.slot, layer=layer) for seq in self.sequences]
            built = self._fused[key] = FusedSequences.of(sequences=sequences, block_tables=block_tables, masks=masks)
        return built


def build_sequence_attention(
    *,
    slot: int,
    row_start: int,
    cache_len: int,
    tree: Tree | None,
    num_new: int,
    sliding_window: int | None,
    bidirectional: bool = False,
) -> tuple[SequenceAttention, list[int]]:
    """Masks and key ranges for one sequence; returns it with the new tokens' positions.

    ``tree=None`` means the new tokens form a chain (prefill chunk or plain decode).
    ``bidirectional``: an encoder's forward (EmbeddingGemma): the whole sequence at once, each
    token seeing every other (within |query - key| < sliding_window on sliding layers).
    """
    if bidirectional:
        return _bidirectional_attention(
            slot=slot, row_start=row_start, cache_len=cache_len, tree=tree, num_new=num_new, window=sliding_window
        )
    if tree is None:
        depths = list(range(num_new))
        new_mask = torch.ones(num_new, num_new, dtype=torch.bool).tril_() if num_new > 1 else None
    else:
        if tree.num_nodes != num_new:
            raise ValueError(f"a tree of {tree.num_nodes} nodes for {num_new} new tokens")
        depths = tree.depths
        new_mask = tree.ancestor_mask() if num_new > 1 else None
    positions = [cache_len + depth for depth in depths]
    kv_end = cache_len + num_new

    full_mask = None
    if new_mask is not None:
        full_mask = torch.ones(num_new, kv_end, dtype=torch.bool)
        full_mask[:, cache_len:] = new_mask

    sliding_kv_start = 0
    sliding_mask = full_mask
    if sliding_window is not None:
        # The oldest key any new token may see: key_pos > query_pos - window.
        sliding_kv_start = max(0, min(positions) - sliding_window + 1)
        needs_window_mask = max(positions) - sliding_window + 1 > sliding_kv_start
        if full_mask is not None or needs_window_mask:
            key_pos = torch.arange(sliding_kv_start, kv_end)
            key_pos[cache_len - sliding_kv_start :] = torch.tensor(positions)
            query_pos = torch.tensor(positions)[:, None]
            window = key_pos[None, :] > query_pos - sliding_window  # [T, S]
            base = full_mask[:, sliding_kv_start:] if full_mask is not None else True
            sliding_mask = window & base
        else:
            sliding_mask = None
    seq = SequenceAttention(
        slot=slot,
        row_start=row_start,
        row_end=row_start + num_new,
        cache_len=cache_len,
        full_kv_start=0,
        sliding_kv_start=sliding_kv_start,
        full_mask=full_mask,
        sliding_mask=sliding_mask,
    )
    return seq, positions


def _bidirectional_attention(
    *, slot: int, row_start: int, cache_len: int, tree: Tree | None, num_new: int, window: int | None
) -> tuple[SequenceAttention, list[int]]:
    # a later token changes every earlier one's state: nothing may be cached or drafted
    if cache_len or tree is not None:
        raise ValueError(
            "a model with bidirectional attention runs each sequence whole in one forward "
            f"(got {cache_len} cached tokens{' and a draft tree' if tree is not None else ''})"
        )
    sliding_mask = None  # None: every key of the range, both ways
    if window is not None and num_new > window:
        positions = torch.arange(num_new)
        sliding_mask = (positions[:, None] - positions[None, :]).abs() < window  # [T, T]
    seq = SequenceAttention(
        slot=slot,
        row_start=row_start,
        row_end=row_start + num_new,
        cache_len=0,
        full_kv_start=0,
        sliding_kv_start=0,
        full_mask=None,
        sliding_mask=sliding_mask,
    )
    return seq, list(range(num_new))
