"""Paged KV cache: fixed-size blocks, a block table per sequence (slot), written by storage index.

Layout per layer: keys and values ``[num_blocks, num_kv_heads, block_size, head_dim]``.  A slot's
storage index p lives in block ``table[p // block_size]`` at row ``p % block_size``, and a
committed token's storage index is its absolute position, so

- rollback of rejected draft tokens moves a length counter and copies nothing;
- an accepted tree path whose nodes were stored at ``cache_len + node`` is compacted to
  ``cache_len + depth`` (a copy of the accepted tokens only);
- sliding-window layers read only the window they need.

Layers are grouped by attention type (``layer_windows``): each group has its own pool of blocks
and its own table per slot.  A sliding-window group gives back the blocks that fell out of every
future query's window (their table entries become ``RELEASED``), so a long request holds only
about one window of blocks in those layers (Gemma 3: 15 of 18 layers see 512 positions).

Blocks are taken from a group's pool as a slot grows (``reserve`` / ``try_reserve``) and go back
when it is freed.  By default a pool holds the most blocks every slot can need at once, so
reserving never fails; a memory budget (``memory_bytes``) makes it smaller, and then
``try_reserve`` says when a slot cannot grow (the scheduler makes requests wait or preempts).
A cache of one block per slot (``block_size = max_len``, the default) is the drafters' slot cache.

Automatic prefix caching (``cache_full_blocks`` / ``find_prefix``): a block whose ``block_size``
tokens are all committed is keyed by a hash of every token up to its end (SHA-256, chained block
by block), and a new slot whose prompt starts with those tokens starts with those blocks in its
tables (shared, reference-counted) instead of computing them; a sliding-window group only needs
the blocks of the window before the first computed token.  Shared blocks are never written: a
slot writes only at storage indices at or past its committed length, and a block is keyed only
once all its rows are committed (draft nodes, rejected branches and compaction all land past the
committed length).  A freed block keeps its key and content while unused and is reused
least-recently-freed first (LRU eviction).  Exactness: the key covers the whole prefix, so a hit
holds the KV those very tokens produce (bit-identical on the batch-invariant kernels, however
the prefix was computed).

Bookkeeping (free blocks, tables, lengths) is plain Python ints and lists.
"""

from __future__ import annotations

import hashlib
import math
import mmap
import struct
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

RELEASED = -1  # a table entry whose block a sliding-window group gave back


class CacheFullError(RuntimeError):
    """No free slot, or no free block for a slot to grow into."""


@dataclass(frozen=True)
class CachedPrefix:
    """Cached blocks a prompt starts with (``KVCache.find_prefix``), for ``KVCache.allocate``."""

    num_tokens: int  # tokens whose KV the blocks hold (whole blocks)
    blocks: tuple[tuple[int, ...], ...]  # per group, per block index (RELEASED: a window group needs none)
    keys: tuple[bytes, ...]  # the blocks' keys

    @classmethod
    def empty(cls, num_groups: int) -> CachedPrefix:
        return cls(num_tokens=0, blocks=((),) * num_groups, keys=())


class _BlockGroup:
    """Layers of one attention type: their pool of blocks, every slot's table into it, and the
    prefix-cache keys of its blocks."""

    def __init__(self, *, layers: list[int], window: int | None, num_blocks: int, num_slots: int, block_size: int):
        self.layers = layers
        self.window = window  # None: full attention, every block is kept
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.tables: list[list[int]] = [[] for _ in range(num_slots)]
        self.released = [0] * num_slots  # leading entries of a slot's table given back
        self.refs = [0] * num_blocks  # slots whose table holds the block
        self.free_blocks = list(range(num_blocks - 1, -1, -1))  # free, holding nothing worth keeping
        self.evictable: OrderedDict[int, None] = OrderedDict()  # free keyed blocks, least recently freed first
        self.block_by_key: dict[bytes, int] = {}
        self.key_of_block: dict[int, bytes] = {}

    @property
    def num_free(self) -> int:
        return len(self.free_blocks) + len(self.evictable)

    def first_needed(self, length: int) -> int:
        """The first block index a query at position >= length may read (key > query - window)."""
        return 0 if self.window is None else max(0, length - self.window + 1) // self.block_size

    def take(self) -> int:
        if self.free_blocks:
            block = self.free_blocks.pop()
        elif self.evictable:
            block, _ = self.evictable.popitem(last=False)  # the least recently freed
            del self.block_by_key[self.key_of_block.pop(block)]
        else:
            raise CacheFullError("no free KV cache block")
        self.refs[block] = 1
        return block

    def give_back(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if block in self.key_of_block:
                self.evictable[block] = None
            else:
                self.free_blocks.append(block)

    def hold(self, slot: int, block: int) -> None:
        """Put a cached block (or RELEASED) at the end of the slot's table."""
        table = self.tables[slot]
        if block == RELEASED:
            if len(table) != self.released[slot]:
                raise ValueError("a released block must not follow a held one")
            self.released[slot] += 1
        else:
            self.evictable.pop(block, None)
            self.refs[block] += 1
        table.append(block)

    def free_slot(self, slot: int) -> None:
        for block in reversed(self.tables[slot]):  # the prefix's head is evicted last
            if block != RELEASED:
                self.give_back(block)
        self.tables[slot] = []
        self.released[slot] = 0

    def growth(self, slot: int, length: int, num_tokens: int) -> tuple[int, int]:
        """(blocks to take, blocks that releasing behind `length` frees) for storage 0..num_tokens-1."""
        table = self.tables[slot]
        needed = max(0, -(-num_tokens // self.block_size) - len(table))
        behind = range(self.released[slot], min(self.first_needed(length), len(table)))
        return needed, sum(self.refs[table[i]] == 1 for i in behind)

    def grow(self, slot: int, length: int, num_tokens: int) -> None:
        table = self.tables[slot]
        for index in range(self.released[slot], min(self.first_needed(length), len(table))):
            self.give_back(table[index])
            table[index] = RELEASED
            self.released[slot] = index + 1
        while len(table) * self.block_size < num_tokens:
            table.append(self.take())

    def register(self, block: int, key: bytes) -> None:
        if block != RELEASED and key not in self.block_by_key and block not in self.key_of_block:
            self.block_by_key[key] = block
            self.key_of_block[block] = key

    def forget_keys(self) -> None:
        self.free_blocks.extend(self.evictable)
        self.evictable.clear()
        self.block_by_key.clear()
        self.key_of_block.clear()


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
        layer_windows: list[int | None] | None = None,  # per layer: its sliding window, None = full
        max_step_tokens: int | None = None,  # most tokens a slot writes in one forward (default max_len)
        memory_bytes: int | None = None,  # the pools' budget; default: what every slot can need at once
    ):
        if num_slots < 1 or max_len < 1:
            raise ValueError(f"need at least one slot and one position, got {num_slots=} {max_len=}")
        block_size = max_len if block_size is None else block_size
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        layer_windows = [None] * num_layers if layer_windows is None else list(layer_windows)
        if len(layer_windows) != num_layers:
            raise ValueError(f"layer_windows has {len(layer_windows)} entries for {num_layers} layers")
        if any(w is not None and w < 1 for w in layer_windows):
            raise ValueError(f"sliding windows must be positive, got {layer_windows}")
        self.num_slots = num_slots
        self.max_len = max_len
        self.block_size = block_size
        self.blocks_per_slot = -(-max_len // block_size)
        step = max_len if max_step_tokens is None else min(max_len, max_step_tokens)
        windows = list(dict.fromkeys(layer_windows))  # one group per window, in layer order
        self.group_of_layer = [windows.index(w) for w in layer_windows]
        per_slot = [self._blocks_per_slot(w, step) for w in windows]
        block_bytes = [
            layer_windows.count(w) * 2 * num_kv_heads * block_size * head_dim * dtype.itemsize for w in windows
        ]
        pool_sizes = _pool_sizes(
            per_slot=per_slot, block_bytes=block_bytes, num_slots=num_slots, memory_bytes=memory_bytes
        )
        self.groups = [
            _BlockGroup(
                layers=[i for i, g in enumerate(self.group_of_layer) if g == index],
                window=window,
                num_blocks=num_blocks,
                num_slots=num_slots,
                block_size=block_size,
            )
            for index, (window, num_blocks) in enumerate(zip(windows, pool_sizes))
        ]
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        for layer in range(num_layers):
            shape = (pool_sizes[self.group_of_layer[layer]], num_kv_heads, block_size, head_dim)
            self.keys.append(zeroed_pool(shape, dtype=dtype, device=device))
            self.values.append(zeroed_pool(shape, dtype=dtype, device=device))
        self.lengths = [0] * num_slots  # committed tokens whose KV is stored, per slot
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self._slot_keys: list[list[bytes]] = [[] for _ in range(num_slots)]  # keys of a slot's full blocks
        self._slot_roots: list[bytes] = [b""] * num_slots  # what a slot's first key chains from (its salt)

    def _blocks_per_slot(self, window: int | None, step: int) -> int:
        """The most blocks of a group one slot holds at once: everything for full attention; for a
        sliding window, the window behind the committed length plus one forward's new tokens."""
        if window is None:
            return self.blocks_per_slot
        return min(self.blocks_per_slot, -(-(window - 1 + step) // self.block_size) + 1)

    # ---- bookkeeping -------------------------------------------------------------------
    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def num_blocks(self) -> int:
        return sum(group.num_blocks for group in self.groups)

    @property
    def max_prefix_blocks(self) -> int:
        """The most blocks a prefix cache hit can find keyed at once: every block of a hit is in
        each full-attention group (window groups need only the last ones)."""
        full = [group.num_blocks for group in self.groups if group.window is None]
        return min(full or [group.num_blocks for group in self.groups])

    @property
    def num_free_blocks(self) -> int:
        """Blocks no slot holds (some keep cached prefixes until they are reused), all groups."""
        return sum(group.num_free for group in self.groups)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks keyed for prefix caching, in use or not, all groups."""
        return sum(len(group.block_by_key) for group in self.groups)

    @property
    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by slots (the fullest group)."""
        return max(1 - group.num_free / group.num_blocks for group in self.groups) if self.groups else 0.0

    def block_table(self, slot: int, *, layer: int = 0) -> list[int]:
        """The slot's blocks in order, in `layer`'s group (RELEASED where given back)."""
        return self.groups[self.group_of_layer[layer]].tables[slot]

    def held_blocks(self, slot: int) -> list[int]:
        """Per group, how many blocks the slot holds now."""
        return [len(g.tables[slot]) - g.released[slot] for g in self.groups]

    def allocate(self, prefix: CachedPrefix | None = None, *, salt: str | None = None) -> int:
        """A free slot; `prefix`: cached blocks (from `find_prefix`, with the same `salt`) its
        tables start with; `salt`: the request's cache_salt (its blocks are shared only with
        requests of the same salt)."""
        if not self._free_slots:
            raise CacheFullError("all KV cache slots are in use")
        slot = self._free_slots.pop()
        self.lengths[slot] = 0
        self._slot_roots[slot] = salt_root(salt)
        if prefix is not None:
            for group, blocks in zip(self.groups, prefix.blocks, strict=True):
                for block in blocks:
                    group.hold(slot, block)
            self._slot_keys[slot] = list(prefix.keys)
        return slot

    def free(self, slot: int) -> None:
        if slot in self._free_slots:
            raise ValueError(f"slot {slot} is already free")
        self.lengths[slot] = 0
        for group in self.groups:
            group.free_slot(slot)
        self._slot_keys[slot] = []
        self._slot_roots[slot] = b""
        self._free_slots.append(slot)

    def room(self, slot: int) -> int:
        """Storage indices 0..room-1 of `slot` are writable now (no block to take)."""
        return min([self.max_len] + [len(group.tables[slot]) * self.block_size for group in self.groups])

    def can_reserve(self, slot: int, num_tokens: int) -> bool:
        """Whether every group has the blocks `reserve(slot, num_tokens)` would take."""
        if num_tokens > self.max_len:
            return False
        for group in self.groups:
            needed, freed = group.growth(slot, self.lengths[slot], num_tokens)
            if needed > group.num_free + freed:
                return False
        return True

    def try_reserve(self, slot: int, num_tokens: int) -> bool:
        """`reserve` if every group has the blocks, else change nothing and return False."""
        if not self.can_reserve(slot, num_tokens):
            return False
        for group in self.groups:
            group.grow(slot, self.lengths[slot], num_tokens)
        return True

    def reserve(self, slot: int, num_tokens: int) -> None:
        """Make storage indices 0..num_tokens-1 of `slot` writable (blocks taken as needed;
        sliding-window groups first give back the blocks behind every future query's window)."""
        if num_tokens > self.max_len:
            raise ValueError(f"slot {slot}: {num_tokens} tokens exceed the cache length {self.max_len}")
        if not self.try_reserve(slot, num_tokens):
            raise CacheFullError(f"slot {slot}: no free KV cache blocks to grow to {num_tokens} tokens")

    # ---- prefix caching ------------------------------------------------------------------
    def find_prefix(
        self, token_ids: list[int], *, usable: Callable[[bytes], bool] | None = None, salt: str | None = None
    ) -> CachedPrefix:
        """The cached blocks holding the longest run of full blocks `token_ids` starts with,
        leaving at least its last token to compute (its logits are needed); `usable`: whether a
        block's key may be part of the run (the drafter holds what it needs of the block);
        `salt`: the request's cache_salt (only blocks cached under the same salt match)."""
        keys: list[bytes] = []
        size, root = self.block_size, salt_root(salt)
        for start in range(0, len(token_ids) - size, size):  # full blocks before the last token
            key = _block_key(keys[-1] if keys else root, token_ids[start : start + size])
            if not all(group.window is not None or key in group.block_by_key for group in self.groups):
                break
            if usable is not None and not usable(key):
                break
            keys.append(key)
        for num_blocks in range(len(keys), 0, -1):  # window groups need the blocks before the hit
            blocks = self._prefix_blocks(keys[:num_blocks])
            if blocks is not None:
                return CachedPrefix(num_tokens=num_blocks * size, blocks=blocks, keys=tuple(keys[:num_blocks]))
        return CachedPrefix.empty(len(self.groups))

    def _prefix_blocks(self, keys: list[bytes]) -> tuple[tuple[int, ...], ...] | None:
        blocks = []
        for group in self.groups:
            first = group.first_needed(len(keys) * self.block_size)
            found = [RELEASED] * first + [group.block_by_key.get(key, RELEASED) for key in keys[first:]]
            if RELEASED in found[first:]:
                return None
            blocks.append(tuple(found))
        return tuple(blocks)

    def block_keys(self, slot: int) -> list[bytes]:
        """The prefix-cache keys of the slot's full blocks so far (not a copy: read only)."""
        return self._slot_keys[slot]

    def reset_prefix_cache(self) -> None:
        """Forget every key: free cached blocks hold nothing worth keeping any more."""
        for group in self.groups:
            group.forget_keys()

    def cache_full_blocks(self, slot: int, token_ids: list[int]) -> None:
        """Key the slot's blocks that its committed length now fills and whose tokens are all in
        `token_ids` (the slot's tokens), so that later prompts can share them; a block whose
        tokens are not all known yet (a stop cut the request short of its computed rows) stays
        unkeyed: its key would be a hash of part of it."""
        keys, size = self._slot_keys[slot], self.block_size
        for index in range(len(keys), min(self.lengths[slot], len(token_ids)) // size):
            key = _block_key(keys[-1] if keys else self._slot_roots[slot], token_ids[index * size : (index + 1) * size])
            keys.append(key)
            for group in self.groups:
                group.register(group.tables[slot][index], key)

    def commit(self, slot: int, length: int) -> None:
        """Set the committed length; shorter than before is a rollback."""
        if not 0 <= length <= self.max_len:
            raise ValueError(f"length {length} outside [0, {self.max_len}]")
        for group in self.groups:
            if group.first_needed(length) < group.released[slot]:
                raise ValueError(f"slot {slot}: cannot roll back to {length}, its window's blocks were given back")
        self.lengths[slot] = length

    def locate(self, slot: int, storage_indices: list[int], *, layer: int = 0) -> tuple[list[int], list[int]]:
        """(block, row in the block) of each storage index of `slot` (reserved beforehand) in
        `layer`'s group."""
        return self._locate(self.groups[self.group_of_layer[layer]], slot, storage_indices)

    def locate_all(self, slot: int, storage_indices: list[int]) -> tuple[list[list[int]], list[int]]:
        """Per group the block of each storage index, and its row (the same in every group)."""
        located = [self._locate(group, slot, storage_indices) for group in self.groups]
        return [blocks for blocks, _ in located], [i % self.block_size for i in storage_indices]

    def _locate(self, group: _BlockGroup, slot: int, storage_indices: list[int]) -> tuple[list[int], list[int]]:
        table, size = group.tables[slot], self.block_size
        blocks = [table[i // size] for i in storage_indices]
        if RELEASED in blocks:
            raise ValueError(f"slot {slot}: storage indices behind the sliding window were given back")
        return blocks, [i % size for i in storage_indices]

    def compact(self, slot: int, *, source: list[int], destination_start: int) -> None:
        """Move the KV at storage indices `source` to destination_start, +1, ...

        Used after a tree verification: the accepted path's nodes were stored in node order
        and must end up at the positions of their depths.
        """
        destination = list(range(destination_start, destination_start + len(source)))
        if source == destination:
            return
        device = self.keys[0].device
        for group in self.groups:
            src_blocks, src_rows = (torch.tensor(x, device=device) for x in self._locate(group, slot, source))
            dst_blocks, dst_rows = (torch.tensor(x, device=device) for x in self._locate(group, slot, destination))
            for layer in group.layers:
                # Advanced indexing on the right copies first, so overlapping ranges are safe.
                self.keys[layer][dst_blocks, :, dst_rows] = self.keys[layer][src_blocks, :, src_rows]
                self.values[layer][dst_blocks, :, dst_rows] = self.values[layer][src_blocks, :, src_rows]

    # ---- tensor access (called by the model) -------------------------------------------
    def write(
        self,
        layer: int,
        *,
        keys: torch.Tensor,  # [N, Hkv, hd]
        values: torch.Tensor,  # [N, Hkv, hd]
        block_index: torch.Tensor,  # [N] blocks of this layer's group
        block_offset: torch.Tensor,  # [N]
    ) -> None:
        pool_dtype = self.keys[layer].dtype  # a float16 cache beside float compute rounds here
        self.keys[layer][block_index, :, block_offset] = keys.to(pool_dtype)
        self.values[layer][block_index, :, block_offset] = values.to(pool_dtype)

    def read(self, layer: int, *, slot: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """-> keys, values [Hkv, end - start, hd]: views when the range lies in one block, else
        the range's blocks gathered (a copy)."""
        size = self.block_size
        first, last = start // size, (end - 1) // size if end > start else start // size
        table = self.block_table(slot, layer=layer)
        if RELEASED in table[first : last + 1]:
            raise ValueError(f"slot {slot}: reading [{start}, {end}) behind the sliding window, given back")
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


def zeroed_pool(shape: tuple[int, ...], *, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A pool of zeros.  On the CPU its memory is fresh anonymous pages, which the OS backs only
    once written: the default pool is sized for every slot's worst case (458 MB for the embedded
    model), and torch.zeros writes every page of it, so resident memory would be that size from
    the start instead of growing with the blocks requests use."""
    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    # Private anonymous pages: zero-filled, and a read maps the shared zero page (a shared
    # mapping, mmap's default, would back every page read with memory of its own).
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # the tensor keeps it alive
    return torch.frombuffer(pages, dtype=dtype).view(shape)


def _pool_sizes(*, per_slot: list[int], block_bytes: list[int], num_slots: int, memory_bytes: int | None) -> list[int]:
    """Blocks per group: what every slot can need at once, or that scaled to `memory_bytes` (at
    least one slot's worst case, so one request of max_len always fits)."""
    worst = [num_slots * n for n in per_slot]
    if memory_bytes is None:
        return worst
    worst_bytes = sum(n * b for n, b in zip(worst, block_bytes))
    sizes = [max(1, int(n * memory_bytes / worst_bytes)) for n in worst]
    minimum = sum(n * b for n, b in zip(per_slot, block_bytes))
    if any(size < n for size, n in zip(sizes, per_slot)):
        raise ValueError(
            f"a KV cache of {memory_bytes} bytes cannot hold one request of the cache length "
            f"(needs {minimum} bytes); raise the memory or lower max_model_len"
        )
    return sizes


def salt_root(salt: str | None) -> bytes:
    """What the first block's key chains from: nothing, or a hash of the request's cache_salt
    (vLLM's: tenants with different salts never share blocks, so a cache hit's speed tells
    nobody what another tenant's prompt was)."""
    return b"" if salt is None else hashlib.sha256(b"cache_salt\0" + salt.encode("utf-8")).digest()


def _block_key(previous: bytes, token_ids: list[int]) -> bytes:
    """The key of a block: SHA-256 of the previous block's key and this block's tokens, so it
    stands for every token up to the block's end."""
    return hashlib.sha256(previous + struct.pack(f"<{len(token_ids)}q", *token_ids)).digest()
