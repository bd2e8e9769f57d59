"""The drafter's features of prefix-cached blocks.

A prefix cache hit puts a prompt's first blocks in the target's cache without a forward, so a
drafter that reads the target's hidden states (eagle3, mtp, medusa, ``[self]``'s copy path)
would get no features for them and draft from a context that starts after the hit: on a second
turn of a conversation the head could not copy from the first one, and acceptance fell (eagle3
on Spec-Bench multi-turn, 18 questions: 5.86 -> 3.19 tokens per forward once its prompts hit
the cache). Here the features of every full block a request commits are kept under the block's
prefix-cache key, and a hit is used only as far as its blocks' features are held: the drafter
observes them as if the target had just computed them.

That is exact, not an approximation: the target is batch-invariant, so a token's features do
not depend on which forward computed them (alone, in a prefill chunk, in a verified tree), and
the stored ones are the very bits a recompute would give. A drafter drafts the same after a hit
as without the prefix cache.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class _Unkeyed:
    """A request's features after its last stored block."""

    position: int  # the first pending token's position (a block boundary)
    # [n_i, F] pieces, in order: not stored yet (under a block, or its key not known yet)
    pending: list[torch.Tensor] = field(default_factory=list)
    count: int = 0  # rows in pending


class FeatureBlockCache:
    """Features [block_size, F] per prefix-cache block key, the least recently used dropped
    beyond `max_blocks` (a target's KV cache never keys more blocks than it holds).

    A block is kept as the pieces the engine handed over (rows of the request's commits, each a
    tensor of its own that the drafter keeps too: Drafter.observe), sliced at block boundaries,
    not copied or joined: a join and a copy per block and request were most of the bookkeeping a
    plain-decoding step of a feature-reading drafter added (adaptive eagle3 at 32 clients), and
    the copies doubled the memory its features take.  A hit joins its blocks' pieces once."""

    def __init__(self, *, block_size: int, max_blocks: int):
        if block_size < 1 or max_blocks < 1:
            raise ValueError(f"need a positive block_size and max_blocks, got {block_size=} {max_blocks=}")
        self.block_size = block_size
        self.max_blocks = max_blocks
        # key -> pieces [n_i, F] whose rows add up to block_size
        self._blocks: OrderedDict[bytes, list[torch.Tensor]] = OrderedDict()
        self._unkeyed: dict[str, _Unkeyed] = {}

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    def restore(self, request_id: str, keys: Sequence[bytes]) -> torch.Tensor | None:
        """The features [len(keys) * block_size, F] of a hit's blocks (None: one is not held), and
        the request's later features are kept from the end of the hit on."""
        if any(key not in self._blocks for key in keys):
            return None
        for key in keys:
            self._blocks.move_to_end(key)
        self._unkeyed[request_id] = _Unkeyed(position=len(keys) * self.block_size)
        return torch.cat([piece for key in keys for piece in self._blocks[key]]) if keys else None

    def add(self, request_id: str, features: torch.Tensor, keys: Sequence[bytes]) -> None:
        """features [n, F] of the request's next n cached tokens, a tensor of these rows alone that
        nothing changes later (kept as it is); keys: its slot's block keys so far (the blocks its
        committed tokens fill).  Stores every block the features complete."""
        unkeyed = self._unkeyed.setdefault(request_id, _Unkeyed(position=0))
        unkeyed.pending.append(features)
        unkeyed.count += features.shape[0]
        size = self.block_size
        while unkeyed.count >= size and unkeyed.position // size < len(keys):
            block = self._take_block(unkeyed)
            key = keys[unkeyed.position // size]
            if key in self._blocks:
                self._blocks.move_to_end(key)
            else:
                self._blocks[key] = block
                while len(self._blocks) > self.max_blocks:
                    self._blocks.popitem(last=False)
            unkeyed.position += size

    def _take_block(self, unkeyed: _Unkeyed) -> list[torch.Tensor]:
        """The first block_size rows of the pending pieces, as pieces (the last one maybe a
        slice of a piece whose rest stays pending)."""
        block, needed = [], self.block_size
        while needed:
            piece = unkeyed.pending[0]
            if piece.shape[0] <= needed:
                block.append(unkeyed.pending.pop(0))
                needed -= piece.shape[0]
            else:
                block.append(piece[:needed])
                unkeyed.pending[0] = piece[needed:]
                needed = 0
        unkeyed.count -= self.block_size
        return block

    def finish(self, request_id: str) -> None:
        self._unkeyed.pop(request_id, None)
