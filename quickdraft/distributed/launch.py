"""Starting and stopping the ranks of a tensor-parallel target.

This process is rank 0: it runs the whole engine (scheduler, drafter, sampling, verification)
and its slice of the target.  Ranks 1..tp-1 are child processes started here
(``python -m quickdraft.distributed.worker``, so a user script needs no ``__main__`` guard
and no torchrun); each loads its slice of the same checkpoint, then replays rank 0's
forwards until rank 0 stops them.  A follower ends when rank 0 dies (rank 0's sockets close,
so the follower's pending collective fails), and rank 0's next collective fails at once when
a follower dies.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from quickdraft.distributed.cache import TensorParallelKVCache
from quickdraft.distributed.decoder import SHUTDOWN, TensorParallelDecoder, load_sharded_decoder
from quickdraft.distributed.group import STARTUP_TIMEOUT, ParallelGroup, collective_device, join_group, open_store
from quickdraft.distributed.sharding import ShardLayout, check_tensor_parallel
from quickdraft.models.config import ModelConfig
from quickdraft.models.loader import read_model_config


@dataclass
class CacheOptions:
    """The engine's KV cache arguments (the same on every rank, so block ids agree)."""

    num_slots: int
    max_len: int
    block_size: int
    max_step_tokens: int
    memory_bytes: int | None = None


@dataclass
class WorkerSpec:
    """What a follower needs to build its slice: everything rank 0 resolved already."""

    rank: int
    size: int
    port: int
    model_dir: str
    dtype: str  # "float32" / "bfloat16"
    quantization: str | None  # None (float weights), "gguf", "gguf+q8_0" or "q8_0": as rank 0 resolved it
    gguf_path: str | None
    device_type: str  # "cpu" / "cuda"
    max_len: int  # the rotary tables' length (the cache's)
    context_len: int | None  # the longest sequence served (LongRoPE picks its factors by it)
    cache: CacheOptions
    num_threads: int


def build_cache(
    config: ModelConfig, layout: ShardLayout, options: CacheOptions, *, dtype: torch.dtype, device: torch.device
) -> TensorParallelKVCache:
    """A rank's cache: its KV heads, the engine's geometry."""
    return TensorParallelKVCache(
        num_layers=config.num_layers,
        num_slots=options.num_slots,
        num_kv_heads=layout.num_kv_heads,
        head_dim=config.head_dim,
        max_len=options.max_len,
        dtype=dtype,
        device=device,
        block_size=options.block_size,
        layer_windows=config.layer_windows,
        max_step_tokens=options.max_step_tokens,
        memory_bytes=options.memory_bytes,
    )


def threads_per_rank(size: int) -> int:
    """The CPU cores shared out between the ranks of this machine."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // size)


@dataclass
class TensorParallelWorkers:
    """Rank 0's handle on the followers: stop them with `shutdown` (idempotent)."""

    group: ParallelGroup
    processes: list[subprocess.Popen] = field(default_factory=list)
    closed: bool = False

    def shutdown(self, *, timeout: float = 30.0) -> None:
        if self.closed:
            return
        self.closed = True
        if any(p.poll() is not None for p in self.processes):
            _kill(self.processes)  # a follower is gone: the others would wait for rank 0 forever
            return
        try:
            self.group.send_object(SHUTDOWN, None)
        except RuntimeError:  # a follower went away meanwhile: the others are stopped below
            pass
        deadline = time.monotonic() + timeout
        for process in self.processes:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)

    def describe_exits(self) -> str:
        """Which followers have exited, for an error message."""
        exited = [f"rank {rank} exited with code {p.returncode}" for rank, p in self._ranked() if p.poll() is not None]
        return "; ".join(exited) or "all followers are still running"

    def _ranked(self) -> list[tuple[int, subprocess.Popen]]:
        return list(enumerate(self.processes, start=1))


@dataclass
class TensorParallelTarget:
    """Rank 0's slice of the target, its cache, and the followers."""

    decoder: TensorParallelDecoder
    config: ModelConfig
    cache: TensorParallelKVCache
    workers: TensorParallelWorkers


def start_tensor_parallel(
    *,
    size: int,
    model_dir: Path,
    dtype: torch.dtype,
    device: torch.device,
    max_len: int,
    cache: CacheOptions,
    context_len: int | None = None,
    quantization: str | None = None,
    gguf_path: Path | None = None,
) -> TensorParallelTarget:
    """Check the split, start the followers, load rank 0's slice; returns once every rank is ready."""
    config = read_model_config(model_dir)
    check_tensor_parallel(config, size)  # before any process starts: a clear error, nothing to clean up
    if size < 2:
        raise ValueError(f"tensor parallelism needs at least 2 ranks, got {size}")
    if device.type == "cuda" and torch.cuda.device_count() < size:
        raise ValueError(
            f"tensor_parallel_size {size} needs {size} CUDA devices, torch sees {torch.cuda.device_count()}"
        )
    num_threads = threads_per_rank(size)
    torch.set_num_threads(num_threads)  # rank 0 shares the cores with the followers
    store = open_store(rank=0, size=size, port=0)
    processes = [
        _spawn(
            WorkerSpec(
                rank=rank,
                size=size,
                port=int(store.port),
                model_dir=str(model_dir),
                dtype=str(dtype).removeprefix("torch."),
                quantization=quantization,
                gguf_path=None if gguf_path is None else str(gguf_path),
                device_type=device.type,
                max_len=max_len,
                context_len=context_len,
                cache=cache,
                num_threads=num_threads,
            )
        )
        for rank in range(1, size)
    ]
    try:
        group = _join_watching(processes, store=store, size=size, device=collective_device(device, 0))
        workers = TensorParallelWorkers(group=group, processes=processes)
    except BaseException:
        _kill(processes)
        raise
    try:
        decoder, _ = load_sharded_decoder(
            model_dir,
            group=group,
            dtype=dtype,
            device=device,
            max_len=max_len,
            quantization=quantization,
            gguf_path=gguf_path,
            context_len=context_len,
        )
        layout = ShardLayout(config=config, rank=0, size=size)
        kv = build_cache(config, layout, cache, dtype=dtype, device=device)
        _ready(group, workers)
    except BaseException:
        workers.shutdown(timeout=5.0)
        raise
    return TensorParallelTarget(decoder=decoder, config=config, cache=kv, workers=workers)


def _ready(group: ParallelGroup, workers: TensorParallelWorkers) -> None:
    """A barrier after loading: fails at once when a follower could not load its slice."""
    try:
        group.all_reduce(torch.ones(1, device=group.device))
    except RuntimeError as err:
        time.sleep(0.5)  # let the failed follower's exit code arrive
        raise RuntimeError(f"a tensor-parallel follower failed to start ({workers.describe_exits()})") from err


def _spawn(spec: WorkerSpec) -> subprocess.Popen:
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parents[2])  # the follower imports the same quickdraft
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    process = subprocess.Popen([sys.executable, "-m", "quickdraft.distributed.worker"], stdin=subprocess.PIPE, env=env)
    assert process.stdin is not None
    process.stdin.write(pickle.dumps(spec))
    process.stdin.close()
    return process


def _join_watching(processes: list[subprocess.Popen], *, store, size: int, device: torch.device) -> ParallelGroup:
    """join_group, failing as soon as a follower exits before joining (not after the timeout)."""
    result: dict[str, object] = {}

    def join() -> None:
        try:
            result["group"] = join_group(store=store, rank=0, size=size, device=device)
        except BaseException as err:  # reported by the waiting thread below
            result["error"] = err

    thread = threading.Thread(target=join, daemon=True)
    thread.start()
    deadline = time.monotonic() + STARTUP_TIMEOUT.total_seconds()
    while thread.is_alive():
        thread.join(timeout=0.1)
        exited = [(rank, p.returncode) for rank, p in enumerate(processes, start=1) if p.poll() is not None]
        if exited and thread.is_alive():
            raise RuntimeError(f"tensor-parallel followers exited before joining: {exited} (rank, exit code)")
        if time.monotonic() > deadline:
            raise RuntimeError("tensor-parallel followers did not join in time")
    error = result.get("error")
    if isinstance(error, BaseException):
        raise RuntimeError("tensor-parallel group setup failed") from error
    group = result["group"]
    assert isinstance(group, ParallelGroup)
    return group


def _kill(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
