"""The KV cache of one rank: its KV heads only, with rank 0's bookkeeping mirrored.

Rank 0 keeps the scheduler's bookkeeping (slots, block tables, prefix cache) as usual; every
rank's pools have the same number of blocks (same arguments, same local head count), so a
block id means the same place on every rank.  Followers never allocate: each forward carries
the block tables of its slots, and the KV moves rank 0 made since the last forward (the
compaction of an accepted tree path), which followers replay before the forward's writes, in
the order rank 0 made them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from quickdraft.kv.cache import KVCache


@dataclass
class KVMove:
    """Copy the KV of (block, row) pairs `source` to `destination`, in every layer of one group."""

    group: int
    source: tuple[list[int], list[int]]  # blocks, rows
    destination: tuple[list[int], list[int]]


class TensorParallelKVCache(KVCache):
    def __init__(self, **kwargs: Any) -> None:  # KVCache's arguments
        super().__init__(**kwargs)
        self.pending_moves: list[KVMove] = []  # rank 0: made since the last forward's message

    def compact(self, slot: int, *, source: list[int], destination_start: int) -> None:
        """KVCache.compact, recorded so that the followers make the same moves."""
        destination = list(range(destination_start, destination_start + len(source)))
        if source == destination:
            return
        moves = [
            KVMove(
                group=index,
                source=self._locate(group, slot, source),
                destination=self._locate(group, slot, destination),
            )
            for index, group in enumerate(self.groups)
        ]
        self.apply_moves(moves)
        self.pending_moves.extend(moves)

    def take_moves(self) -> list[KVMove]:
        moves, self.pending_moves = self.pending_moves, []
        return moves

    def apply_moves(self, moves: list[KVMove]) -> None:
        device = self.keys[0].device
        for move in moves:
            src_blocks, src_rows = (torch.tensor(x, device=device) for x in move.source)
            dst_blocks, dst_rows = (torch.tensor(x, device=device) for x in move.destination)
            for layer in self.groups[move.group].layers:
                # Advanced indexing on the right copies first, so overlapping ranges are safe.
                self.keys[layer][dst_blocks, :, dst_rows] = self.keys[layer][src_blocks, :, src_rows]
                self.values[layer][dst_blocks, :, dst_rows] = self.values[layer][src_blocks, :, src_rows]

    def block_tables(self, slots: list[int]) -> dict[int, list[list[int]]]:
        """slot -> its block table in each group (what a follower's reads need)."""
        return {slot: [list(group.tables[slot]) for group in self.groups] for slot in slots}

    def adopt_block_tables(self, tables: dict[int, list[list[int]]]) -> None:
        """A follower: take rank 0's tables for these slots."""
        for slot, per_group in tables.items():
            for group, table in zip(self.groups, per_group, strict=True):
                group.tables[slot] = table
