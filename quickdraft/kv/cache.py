"""Paged KV cache: fixed-size blocks, a block table per sequence (slot), written by storage index.

Layout per layer: keys and values ``[num_blocks, num_kv_heads, block_size, head_dim]``.  A slot's
storage index p lives in block ``block_tables[slot][p // block_size]`` at row
``p % block_size``, and a committed token's storage index is its absolute position, so

- rollback of rejected draft tokens moves a length counter and copies nothing;
- an accepted tree path whose nodes were stored at ``cache_len + node`` is compacted to
  ``cache_len + depth`` (a copy of the accepted tokens only);
- sliding-window layers read only the window they need.

Blocks are taken from a shared pool as a slot grows (``reserve``) and go back when it is freed.
The pool holds ``blocks_per_slot`` blocks for every slot, so a running request can always
grow to ``max_len``: reserving never fails for want of blocks.  A cache of one block per slot
(``block_size = max_len``, the default) is the drafters' slot cache.

Automatic prefix caching (``cache_full_blocks`` / ``prefix_blocks``): a block whose
``block_size`` tokens are all committed is keyed by a hash of every token up to its end
(SHA-256, chained block by block), and a new slot whose prompt starts with those tokens
starts with those blocks in its table (shared, reference-counted) instead of computing them.
Shared blocks are never written: a slot writes only at storage indices at or past its
committed length, and a block is keyed only once all its rows are committed (draft nodes,
rejected branches and compaction all land past the committed length).  A freed block keeps
its key and content while unused and is reused least-recently-freed first (LRU eviction).
Exactness: the key covers the whole prefix, so a hit holds the KV those very tokens produce
(bit-identical on the batch-invariant kernels, however the prefix was computed).

Bookkeeping (free blocks, tables, lengths) is plain Python ints and lists.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict

import torch


class CacheFullError(RuntimeError):
    """No free slot is left (the scheduler admits a request only when one is free)."""


class KVCache:
    def __init__(
        self,
        *,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        block_size: int | None = None,
    ):
        if num_slots < 1 or max_len < 1:
            raise ValueError(f"need at least one slot and one position, got {num_slots=} {max_len=}")
        block_size = max_len if block_size is None else block_size
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_slots = num_slots
        self.max_len = max_len
        self.block_size = block_size
        self.blocks_per_slot = -(-max_len // block_size)
        num_blocks = num_slots * self.blocks_per_slot
        shape = (num_blocks, num_kv_heads, block_size, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.lengths = [0] * num_slots  # committed tokens whose KV is stored, per slot
        self.block_tables: list[list[int]] = [[] for _ in range(num_slots)]  # per slot: its blocks in order
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self._free_blocks = list(range(num_blocks - 1, -1, -1))  # free, holding nothing worth keeping
        # Prefix caching: every keyed block by key, and back; unused keyed blocks in LRU order.
        self._refs = [0] * num_blocks  # slots whose table holds the block
        self._block_by_key: dict[bytes, int] = {}
        self._key_of_block: dict[int, bytes] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # free keyed blocks, oldest first
        self._slot_keys: list[list[bytes]] = [[] for _ in range(num_slots)]  # keys of a slot's full blocks

    # ---- bookkeeping -------------------------------------------------------------------
    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def num_blocks(self) -> int:
        return self.keys[0].shape[0] if self.keys else 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks no slot holds (some keep cached prefixes until they are reused)."""
        return len(self._free_blocks) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks keyed for prefix caching, in use or not."""
        return len(self._block_by_key)

    def allocate(self, prefix: list[int] | None = None) -> int:
        """A free slot; `prefix`: cached blocks (from `prefix_blocks`) its table starts with."""
        if not self._free_slots:
            raise CacheFullError("all KV cache slots are in use")
        slot = self._free_slots.pop()
        self.lengths[slot] = 0
        for block in prefix or ():
            self._evictable.pop(block, None)
            self._refs[block] += 1
            self.block_tables[slot].append(block)
            self._slot_keys[slot].append(self._key_of_block[block])
        return slot

    def free(self, slot: int) -> None:
        if slot in self._free_slots:
            raise ValueError(f"slot {slot} is already free")
        self.lengths[slot] = 0
        for block in reversed(self.block_tables[slot]):  # the prefix's head is evicted last
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._key_of_block:
                    self._evictable[block] = None
                else:
                    self._free_blocks.append(block)
        self.block_tables[slot] = []
        self._slot_keys[slot] = []
        self._free_slots.append(slot)

    def reserve(self, slot: int, num_tokens: int) -> None:
        """Make storage indices 0..num_tokens-1 of `slot` writable (blocks taken as needed)."""
        if num_tokens > self.max_len:
            raise ValueError(f"slot {slot}: {num_tokens} tokens exceed the cache length {self.max_len}")
        table = self.block_tables[slot]
        while len(table) * self.block_size < num_tokens:
            table.append(self._take_block())

    def _take_block(self) -> int:
        # Never without one: the pool holds max_len for every slot, and free keyed blocks count.
        if self._free_blocks:
            block = self._free_blocks.pop()
        else:
            block, _ = self._evictable.popitem(last=False)  # the least recently freed
            del self._block_by_key[self._key_of_block.pop(block)]
        self._refs[block] = 1
        return block

    # ---- prefix caching ------------------------------------------------------------------
    def prefix_blocks(self, token_ids: list[int]) -> list[int]:
        """The cached blocks holding the longest run of full blocks `token_ids` starts with,
        leaving at least its last token to compute (its logits are needed)."""
        blocks: list[int] = []
        key = b""
        size = self.block_size
        for start in range(0, len(token_ids) - size, size):  # full blocks before the last token
            key = _block_key(key, token_ids[start : start + size])
            block = self._block_by_key.get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def reset_prefix_cache(self) -> None:
        """Forget every key: free cached blocks hold nothing worth keeping any more."""
        self._free_blocks.extend(self._evictable)
        self._evictable.clear()
        self._block_by_key.clear()
        self._key_of_block.clear()

    def cache_full_blocks(self, slot: int, token_ids: list[int]) -> None:
        """Key the slot's blocks that its committed length now fills (token_ids: the slot's
        tokens, at least the committed ones), so that later prompts can share them."""
        keys, table, size = self._slot_keys[slot], self.block_tables[slot], self.block_size
        for index in range(len(keys), self.lengths[slot] // size):
            key = _block_key(keys[-1] if keys else b"", token_ids[index * size : (index + 1) * size])
            keys.append(key)
            block = table[index]
            if key not in self._block_by_key and block not in self._key_of_block:
                self._block_by_key[key] = block
                self._key_of_block[block] = key

    def commit(self, slot: int, length: int) -> None:
        """Set the committed length; shorter than before is a rollback."""
        if not 0 <= length <= self.max_len:
            raise ValueError(f"length {length} outside [0, {self.max_len}]")
        self.lengths[slot] = length

    def locate(self, slot: int, storage_indices: list[int]) -> tuple[list[int], list[int]]:
        """(block, row in the block) of each storage index of `slot` (reserved beforehand)."""
        table, size = self.block_tables[slot], self.block_size
        return [table[i // size] for i in storage_indices], [i % size for i in storage_indices]

    def compact(self, slot: int, *, source: list[int], destination_start: int) -> None:
        """Move the KV at storage indices `source` to destination_start, +1, ...

        Used after a tree verification: the accepted path's nodes were stored in node order
        and must end up at the positions of their depths.
        """
        destination = list(range(destination_start, destination_start + len(source)))
        if source == destination:
            return
        device = self.keys[0].device
        src_blocks, src_rows = (torch.tensor(x, device=device) for x in self.locate(slot, source))
        dst_blocks, dst_rows = (torch.tensor(x, device=device) for x in self.locate(slot, destination))
        for layer_keys, layer_values in zip(self.keys, self.values):
            # Advanced indexing on the right copies first, so overlapping ranges are safe.
            layer_keys[dst_blocks, :, dst_rows] = layer_keys[src_blocks, :, src_rows]
            layer_values[dst_blocks, :, dst_rows] = layer_values[src_blocks, :, src_rows]

    # ---- tensor access (called by the model) -------------------------------------------
    def write(
        self,
        layer: int,
        *,
        keys: torch.Tensor,  # [N, Hkv, hd]
        values: torch.Tensor,  # [N, Hkv, hd]
        block_index: torch.Tensor,  # [N]
        block_offset: torch.Tensor,  # [N]
    ) -> None:
        self.keys[layer][block_index, :, block_offset] = keys
        self.values[layer][block_index, :, block_offset] = values

    def read(self, layer: int, *, slot: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """-> keys, values [Hkv, end - start, hd]: views when the range lies in one block, else
        the range's blocks gathered (a copy)."""
        size = self.block_size
        first, last = start // size, (end - 1) // size if end > start else start // size
        table = self.block_tables[slot]
        if first == last:
            block, row = table[first], start - first * size
            return (
                self.keys[layer][block, :, row : row + end - start],
                self.values[layer][block, :, row : row + end - start],
            )
        blocks = torch.tensor(table[first : last + 1], device=self.keys[layer].device)
        row = start - first * size

        def gathered(pool: torch.Tensor) -> torch.Tensor:  # [nb, Hkv, bs, hd] -> [Hkv, nb * bs, hd]
            picked = pool[blocks]
            return picked.transpose(0, 1).reshape(picked.shape[1], -1, picked.shape[3])[:, row : row + end - start]

        return gathered(self.keys[layer]), gathered(self.values[layer])


def _block_key(previous: bytes, token_ids: list[int]) -> bytes:
    """The key of a block: SHA-256 of the previous block's key and this block's tokens, so it
    stands for every token up to the block's end."""
    return hashlib.sha256(previous + struct.pack(f"<{len(token_ids)}q", *token_ids)).digest()
