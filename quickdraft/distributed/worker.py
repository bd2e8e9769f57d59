"""A follower rank's process: ``python -m quickdraft.distributed.worker`` with a pickled
WorkerSpec on stdin (started by quickdraft.distributed.launch, never by hand)."""

from __future__ import annotations

import pickle
import sys

import torch

from quickdraft.distributed.decoder import load_sharded_decoder, serve_forwards
from quickdraft.distributed.group import collective_device, join_group, open_store
from quickdraft.distributed.launch import WorkerSpec, build_cache
from quickdraft.distributed.sharding import ShardLayout


def run_follower(spec: WorkerSpec) -> None:
    torch.set_num_threads(spec.num_threads)
    device = collective_device(torch.device(spec.device_type), spec.rank)
    store = open_store(rank=spec.rank, size=spec.size, port=spec.port)
    # Join first, load after: rank 0 sees a failed load as this process exiting (its barrier fails).
    group = join_group(store=store, rank=spec.rank, size=spec.size, device=device)
    dtype = getattr(torch, spec.dtype)
    decoder, config = load_sharded_decoder(
        spec.model_dir,
        group=group,
        dtype=dtype,
        device=device,
        max_len=spec.max_len,
        context_len=spec.context_len,
        quantization=spec.quantization,
        gguf_path=spec.gguf_path,
    )
    layout = ShardLayout(config=config, rank=spec.rank, size=spec.size)
    cache = build_cache(config, layout, spec.cache, dtype=dtype, device=device)
    group.all_reduce(torch.ones(1, device=device))  # ready (pairs with rank 0's barrier)
    serve_forwards(decoder, cache=cache, group=group)


def main() -> None:
    # No parent-death signal (Linux sends it when the *thread* that started us ends, which would
    # kill the followers of an engine built in a worker thread): when rank 0 dies, for any
    # reason, the kernel closes its sockets and this process's next collective fails, ending it.
    spec = pickle.loads(sys.stdin.buffer.read())
    if not isinstance(spec, WorkerSpec):
        raise SystemExit("quickdraft.distributed.worker expects a pickled WorkerSpec on stdin")
    run_follower(spec)


if __name__ == "__main__":
    main()
