"""all_reduce and all_gather between the CPU ranks of one machine through shared memory.

Why not gloo alone: on the 2-core machines we run on, one gloo all_reduce of a [1, 640] hidden
state takes ~2.3 ms (loopback TCP and its threads' wake-ups), and a decoder forward makes two per
layer: 36 of them cost Gemma 3 270M more than the whole forward does on one process.  Through a
shared segment the same exchange takes ~12 us (`benchmarks/tensor_parallel.py`).  vLLM's CPU
backend ships a shared-memory all-reduce for the same reason; this one is ours, in Python.

Layout of the segment (a file in /dev/shm, unlinked once every rank has mapped it, so nothing is
left behind when a process dies): a header of one 64-byte line per rank (its call counter, then
its pid), then two buffers of `size` slots of `slot_bytes` each.  A call copies this rank's tensor
into its slot of buffer `n % 2`, publishes `n + 1` in its counter, waits until every counter
reaches `n + 1`, then reads the slots.  Two buffers suffice: a rank can write buffer `n % 2`
again only at call n + 2, after every rank published n + 1, i.e. after all of them finished
reading call n.  The order of the stores (data, then counter) is what x86-64's memory model
keeps for the readers, so the segment is used on x86-64 only (gloo elsewhere).

Sums add the slots in rank order on every rank: each rank gets the same bits, and the order does
not depend on the tensor's size (so a row's value does not depend on how many rows share the
call, for any number of ranks; gloo's ring splits large tensors into per-rank chunks).
"""

from __future__ import annotations

import os
import platform
import tempfile
import time
from pathlib import Path

import torch

SHM_DIR = Path("/dev/shm")
LINE = 64  # bytes of one rank's header line
DEFAULT_SLOT_BYTES = 4 << 20  # a [1638, 640] float32 hidden state, or 8 rows of a 131072-row logits slice
LIVENESS_CHECK_SECONDS = 0.05  # how often a waiting rank checks that its peers are alive
# A wait spins (yielding) this long, then sleeps in short naps: a peer that is far behind (or
# descheduled on a busy machine) must not cost a whole core of spinning.
SPIN_SECONDS = 2e-4
SLEEP_SECONDS = 5e-5


def shared_memory_supported(total_bytes: int) -> bool:
    """x86-64 Linux with room in /dev/shm for `total_bytes` (a segment larger than the free space
    would fault on first touch instead of failing cleanly)."""
    if platform.machine().lower() not in ("x86_64", "amd64") or not SHM_DIR.is_dir():
        return False
    stats = os.statvfs(SHM_DIR)
    return stats.f_bavail * stats.f_frsize >= 2 * total_bytes


def segment_bytes(size: int, slot_bytes: int) -> int:
    return size * LINE + 2 * size * slot_bytes


def create_segment(size: int, slot_bytes: int) -> str:
    """Rank 0: a zeroed file of the segment's size in /dev/shm; returns its path."""
    fd, path = tempfile.mkstemp(dir=SHM_DIR, prefix="quickdraft-tp-")
    try:
        os.ftruncate(fd, segment_bytes(size, slot_bytes))
    finally:
        os.close(fd)
    return path


class SharedMemoryCollectives:
    """One rank's view of the segment; every rank must make the same calls in the same order."""

    def __init__(self, path: str, *, rank: int, size: int, slot_bytes: int = DEFAULT_SLOT_BYTES):
        if slot_bytes % LINE:
            raise ValueError(f"slot_bytes must be a multiple of {LINE}, got {slot_bytes}")
        self.rank, self.size, self.slot_bytes = rank, size, slot_bytes
        self.memory = torch.from_file(path, shared=True, size=segment_bytes(size, slot_bytes), dtype=torch.uint8)
        header = self.memory[: size * LINE].view(torch.int64).view(size, LINE // 8).numpy()  # [ranks, 8]
        self.counters = header[:, 0]  # [ranks] calls each rank has published
        self.pids = header[:, 1]  # [ranks]
        self.pids[rank] = os.getpid()
        self.calls = 0

    def fits(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu" and tensor.numel() * tensor.element_size() <= self.slot_bytes

    def _slot(self, buffer: int, rank: int, like: torch.Tensor) -> torch.Tensor:  # like's shape and dtype
        start = self.size * LINE + (buffer * self.size + rank) * self.slot_bytes
        nbytes = like.numel() * like.element_size()
        return self.memory[start : start + nbytes].view(like.dtype).view(like.shape)

    def _exchange(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `tensor`, as views of this call's buffer (valid until the call after next)."""
        buffer = self.calls % 2
        self.calls += 1
        self._slot(buffer, self.rank, tensor).copy_(tensor)
        self.counters[self.rank] = self.calls
        self._wait_for(self.calls)
        return [self._slot(buffer, rank, tensor) for rank in range(self.size)]

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place, the slots added in rank order."""
        slots = self._exchange(tensor)
        tensor.copy_(slots[0])
        for slot in slots[1:]:
            tensor.add_(slot)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return [slot.clone() for slot in self._exchange(tensor.contiguous())]

    def _wait_for(self, calls: int) -> None:
        counters = self.counters
        started = time.monotonic()
        next_check = started + LIVENESS_CHECK_SECONDS
        spins = 0
        while counters.min() < calls:
            spins += 1
            if spins <= 64:
                continue  # the peer is usually a few microseconds behind
            now = time.monotonic()
            if now - started < SPIN_SECONDS:
                os.sched_yield()  # a peer sharing this core gets it
            else:
                time.sleep(SLEEP_SECONDS)  # a long wait: give the core to other work
            if now > next_check:
                self._check_peers(calls)
                next_check = now + LIVENESS_CHECK_SECONDS

    def _check_peers(self, calls: int) -> None:
        for rank in range(self.size):
            if rank != self.rank and self.counters[rank] < calls and not _alive(int(self.pids[rank])):
                raise RuntimeError(
                    f"tensor-parallel rank {rank} (pid {int(self.pids[rank])}) exited during a collective"
                )


def _alive(pid: int) -> bool:
    """False for an exited process, a zombie included (a follower not yet reaped by rank 0)."""
    if pid <= 0:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    except OSError:
        return True  # unreadable, not known to be dead
    return state not in ("Z", "X")
