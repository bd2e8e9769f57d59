"""A process group of our own: the ranks of one engine and the three collectives they use.

Each engine builds its own store and backend (gloo on the CPU, NCCL on CUDA) instead of
torch.distributed's default group, so that several engines (tests, a benchmark that compares
sizes) can live in one process one after the other, and nothing is module-global.  CPU ranks
also map one shared-memory segment (shm.py) for the all_reduce and all_gather of a forward,
~200x faster than gloo's loopback TCP here; gloo carries rank 0's messages, the start-up
barrier, tensors larger than a slot, and everything when QUICKDRAFT_TP_SHARED_MEMORY=0.
"""

from __future__ import annotations

import datetime
import os
import pickle
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from quickdraft.distributed.shm import (
    DEFAULT_SLOT_BYTES,
    SharedMemoryCollectives,
    create_segment,
    segment_bytes,
    shared_memory_supported,
)

# How long a collective may wait.  Followers wait for rank 0's next forward between requests,
# which can be a long idle time; a dead peer is noticed at once anyway (its sockets close).
DEFAULT_TIMEOUT = datetime.timedelta(days=7)
# How long rank 0 waits for the followers to start and join the group.
STARTUP_TIMEOUT = datetime.timedelta(seconds=300)
LOCALHOST = "127.0.0.1"
SHARED_MEMORY_KEY = "quickdraft/shared-memory-segment"
SHARED_MEMORY_SWITCH = "QUICKDRAFT_TP_SHARED_MEMORY"  # "0": gloo for every collective (to compare)


@dataclass
class ParallelGroup:
    rank: int
    size: int
    device: torch.device  # where the collectives' tensors live (cuda:rank for NCCL)
    backend: Any  # a torch.distributed ProcessGroupGloo / ProcessGroupNCCL
    store: Any  # the TCPStore the backend rendezvoused through (kept alive with it)
    shared: SharedMemoryCollectives | None = None  # CPU ranks of one machine

    @property
    def port(self) -> int:
        return int(self.store.port)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place; every rank gets the same bits (the sum is computed once
        per element and shared), so replicated activations stay identical across ranks."""
        if self.shared is not None and self.shared.fits(tensor):
            return self.shared.all_reduce(tensor)
        self.backend.allreduce([tensor]).wait()
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `tensor` (same shape on all ranks), in rank order."""
        if self.shared is not None and self.shared.fits(tensor):
            return self.shared.all_gather(tensor)
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        self.backend.allgather([parts], [tensor]).wait()
        return parts

    def broadcast(self, tensor: torch.Tensor, *, root: int = 0) -> torch.Tensor:
        self.backend.broadcast(tensor, root).wait()
        return tensor

    def send_object(self, kind: int, obj: object) -> None:
        """Rank 0: a message to every follower, as a header [kind, nbytes] then the pickled bytes."""
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if obj is not None else b""
        header = torch.tensor([kind, len(payload)], dtype=torch.long, device=self.device)
        self.broadcast(header)
        if payload:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device)
            self.broadcast(data)

    def receive_object(self) -> tuple[int, Any]:
        """A follower: the next message of rank 0 (kind, the unpickled object or None)."""
        header = self.broadcast(torch.zeros(2, dtype=torch.long, device=self.device))
        kind, nbytes = (int(x) for x in header.tolist())
        if nbytes == 0:
            return kind, None
        data = self.broadcast(torch.empty(nbytes, dtype=torch.uint8, device=self.device))
        return kind, pickle.loads(data.cpu().numpy().tobytes())


def collective_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: cuda:r on CUDA (one GPU per rank), the CPU otherwise."""
    return torch.device("cuda", rank) if device.type == "cuda" else torch.device("cpu")


def open_store(*, rank: int, size: int, port: int) -> Any:
    """Rank 0 opens the rendezvous on `port` (0: any free port, read back from `store.port`)
    without waiting; the others connect to it."""
    return dist.TCPStore(LOCALHOST, port, size, rank == 0, timeout=STARTUP_TIMEOUT, wait_for_workers=False)


def join_group(
    *, store: Any, rank: int, size: int, device: torch.device, timeout: datetime.timedelta = DEFAULT_TIMEOUT
) -> ParallelGroup:
    """The backend for `device` over `store`; returns once every rank has joined."""
    backend: Any
    if device.type == "cuda":
        torch.cuda.set_device(device)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        backend = dist.ProcessGroupNCCL(store, rank, size, options)
    else:
        backend = dist.ProcessGroupGloo(store, rank, size, timeout)
    group = ParallelGroup(rank=rank, size=size, device=device, backend=backend, store=store)
    if device.type == "cpu" and size > 1 and os.environ.get(SHARED_MEMORY_SWITCH, "1") != "0":
        group.shared = _map_shared_memory(group, slot_bytes=DEFAULT_SLOT_BYTES)
    return group


def _map_shared_memory(group: ParallelGroup, *, slot_bytes: int) -> SharedMemoryCollectives | None:
    """Every rank maps rank 0's segment, or none does (then gloo carries every collective)."""
    if group.rank == 0:
        fits = shared_memory_supported(segment_bytes(group.size, slot_bytes))
        group.store.set(SHARED_MEMORY_KEY, create_segment(group.size, slot_bytes) if fits else "")
    path = group.store.get(SHARED_MEMORY_KEY).decode()
    shared = None
    if path:
        try:
            shared = SharedMemoryCollectives(path, rank=group.rank, size=group.size, slot_bytes=slot_bytes)
        except (OSError, RuntimeError):  # e.g. a follower in another mount namespace
            shared = None
    mapped = torch.tensor([0 if shared is None else 1])
    group.backend.allreduce([mapped]).wait()  # every rank mapped it (and wrote its pid), or not
    if group.rank == 0 and path:
        os.unlink(path)  # the mappings stay; nothing is left in /dev/shm whatever happens next
    return shared if int(mapped) == group.size else None
