"""Preallocated KV cache: one slot per running request, written by storage index.

Layout per layer: keys and values ``[num_slots, num_kv_heads, max_len, head_dim]``.  A
committed token's KV lives at storage index == its absolute position, so

- rollback of rejected draft tokens moves a length counter and copies nothing;
- an accepted tree path whose nodes were stored at ``cache_len + node`` is compacted to
  ``cache_len + depth`` (a copy of the accepted tokens only);
- sliding-window layers keep every position too, and read only the window they need, so
  rollback past the window is as exact as anywhere else.

Bookkeeping (free slots, lengths) is plain Python ints and lists.
"""

from __future__ import annotations

import torch


class CacheFullError(RuntimeError):
    """No free slot is left; the scheduler keeps the request waiting."""


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
    ):
        if num_slots < 1 or max_len < 1:
            raise ValueError(f"need at least one slot and one position, got {num_slots=} {max_len=}")
        self.num_slots = num_slots
        self.max_len = max_len
        shape = (num_slots, num_kv_heads, max_len, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.lengths = [0] * num_slots  # committed tokens whose KV is stored, per slot
        self._free_slots = list(range(num_slots - 1, -1, -1))

    # ---- bookkeeping -------------------------------------------------------------------
    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def allocate(self) -> int:
        if not self._free_slots:
            raise CacheFullError("all KV cache slots are in use")
        slot = self._free_slots.pop()
        self.lengths[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        if slot in self._free_slots:
            raise ValueError(f"slot {slot} is already free")
        self.lengths[slot] = 0
        self._free_slots.append(slot)

    def commit(self, slot: int, length: int) -> None:
        """Set the committed length; shorter than before is a rollback."""
        if not 0 <= length <= self.max_len:
            raise ValueError(f"length {length} outside [0, {self.max_len}]")
        self.lengths[slot] = length

    def compact(self, slot: int, *, source: list[int], destination_start: int) -> None:
        """Move the KV at storage indices `source` to destination_start, +1, ...

        Used after a tree verification: the accepted path's nodes were stored in node order
        and must end up at the positions of their depths.
        """
        destination = list(range(destination_start, destination_start + len(source)))
        if source == destination:
            return
        src = torch.tensor(source, device=self.keys[0].device)
        dst = torch.tensor(destination, device=self.keys[0].device)
        for layer_keys, layer_values in zip(self.keys, self.values):
            # Advanced indexing on the right copies first, so overlapping ranges are safe.
            layer_keys[slot, :, dst] = layer_keys[slot, :, src]
            layer_values[slot, :, dst] = layer_values[slot, :, src]

    # ---- tensor access (called by the model) -------------------------------------------
    def write(
        self,
        layer: int,
        *,
        keys: torch.Tensor,  # [N, Hkv, hd]
        values: torch.Tensor,  # [N, Hkv, hd]
        slot_index: torch.Tensor,  # [N]
        store_index: torch.Tensor,  # [N]
    ) -> None:
        self.keys[layer][slot_index, :, store_index] = keys
        self.values[layer][slot_index, :, store_index] = values

    def read(self, layer: int, *, slot: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        # -> keys, values [Hkv, end - start, hd]: views, no copy
        return self.keys[layer][slot, :, start:end], self.values[layer][slot, :, start:end]
