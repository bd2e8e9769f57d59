"""A process group of our own: the ranks of one engine and the three collectives they use.

Each engine builds its own store and backend (gloo on the CPU, NCCL on CUDA) instead of
torch.distributed's default group, so that several engines (tests, a benchmark that compares
sizes) can live in one process one after the other, and nothing is module-global.
"""

from __future__ import annotations

import datetime
import pickle
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# How long a collective may wait.  Followers wait for rank 0's next forward between requests,
# which can be a long idle time; a dead peer is noticed at once anyway (its sockets close).
DEFAULT_TIMEOUT = datetime.timedelta(days=7)
# How long rank 0 waits for the followers to start and join the group.
STARTUP_TIMEOUT = datetime.timedelta(seconds=300)
LOCALHOST = "127.0.0.1"


@dataclass
class ParallelGroup:
    rank: int
    size: int
    device: torch.device  # where the collectives' tensors live (cuda:rank for NCCL)
    backend: Any  # a torch.distributed ProcessGroupGloo / ProcessGroupNCCL
    store: Any  # the TCPStore the backend rendezvoused through (kept alive with it)

    @property
    def port(self) -> int:
        return int(self.store.port)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place; every rank gets the same bits (the sum is computed once
        per element and shared), so replicated activations stay identical across ranks."""
        self.backend.allreduce([tensor]).wait()
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `tensor` (same shape on all ranks), in rank order."""
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
    return ParallelGroup(rank=rank, size=size, device=device, backend=backend, store=store)
