"""A sharded decoder over 2 gloo ranks (two threads of this process: no spawn cost) against
the unsharded decoder: same logits to float tolerance, through prefill, decode, a tree and a
KV compaction that the follower must replay."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from quickdraft.distributed.decoder import SHUTDOWN, serve_forwards, shard_decoder
from quickdraft.distributed.group import ParallelGroup, join_group, open_store
from quickdraft.distributed.launch import CacheOptions, build_cache
from quickdraft.distributed.sharding import ShardLayout
from quickdraft.engine.runner import ModelRunner, SequenceWork
from quickdraft.models.loader import load_weights, resolve_model_dir
from quickdraft.verify.tree import Tree
from tests.models.test_decoder import make_runner, prompt
from tests.models.test_gguf import build_tiny_gguf
from tests.models.test_quantized_loader import half_checkpoint

CPU = torch.device("cpu")
OPTIONS = CacheOptions(num_slots=2, max_len=128, block_size=5, max_step_tokens=128)


def make_groups(size: int) -> list[ParallelGroup]:
    """`size` ranks in threads of this process, joined over one local store."""
    master = open_store(rank=0, size=size, port=0)
    stores = [master] + [open_store(rank=rank, size=size, port=int(master.port)) for rank in range(1, size)]
    with ThreadPoolExecutor(size) as pool:
        futures = [
            pool.submit(join_group, store=stores[rank], rank=rank, size=size, device=CPU) for rank in range(size)
        ]
        return [f.result(timeout=60) for f in futures]


def test_collectives_over_two_ranks():
    groups = make_groups(2)
    with ThreadPoolExecutor(2) as pool:
        sums = list(pool.map(lambda g: g.all_reduce(torch.full((3,), float(g.rank + 1))), groups))
        gathered = list(pool.map(lambda g: torch.cat(g.all_gather(torch.full((2,), float(g.rank)))), groups))
        received = pool.submit(groups[1].receive_object)
        groups[0].send_object(7, {"tokens": torch.arange(4)})
        kind, obj = received.result(timeout=30)
    assert all(torch.equal(s, torch.full((3,), 3.0)) for s in sums)
    assert all(torch.equal(g, torch.tensor([0.0, 0.0, 1.0, 1.0])) for g in gathered)
    assert kind == 7 and torch.equal(obj["tokens"], torch.arange(4))


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    """A tiny gemma3 GGUF: Q8_0 embedding (the tied LM head), Q5_0 attention, Q4_0 MLP."""
    return build_tiny_gguf(tmp_path_factory.mktemp("tp_gguf"), "gemma3-mixed").path


CASES = [
    ("gemma3", torch.float32, None),
    ("llama", torch.float32, None),
    ("llama", torch.bfloat16, None),
    ("llama", torch.float32, "q8_0"),  # HF weights quantized at load, untied LM head
    ("gemma3-gguf", torch.float32, "gguf"),  # GGUF weights as stored, mixed formats
    ("llama-bf16", torch.float32, "stored"),  # a bfloat16 checkpoint's matrices as stored (BF16 tiles)
]


@pytest.mark.parametrize(("arch", "dtype", "quantization"), CASES)
def test_sharded_forward_matches_unsharded(tiny_checkpoints, tiny_gguf, tmp_path, arch, dtype, quantization):
    """Rank 0 drives a runner as the engine does; rank 1 replays its forwards in a thread."""
    gguf_path = tiny_gguf if quantization == "gguf" else None
    if arch == "llama-bf16":
        path = half_checkpoint(tiny_checkpoints["llama"], tmp_path / "llama-bf16", torch.bfloat16)
    else:
        path = resolve_model_dir(gguf_path) if gguf_path else tiny_checkpoints[arch]
    # bfloat16: the all_reduce rounds each rank's partial sum to bfloat16 before adding them;
    # quantized: the int8 activations of the next layer may round a value the other way, and
    # one such flip moves this tiny random model's logits by about what its quantization does
    # (0.05-0.09 of logits up to ~5 against the float32 dequantized model; seen at 0.058 on an
    # Intel CPU whose torch float kernels round the shards' partial sums differently from an
    # AMD one's). A wrong shard or a missing all_reduce moves them by whole units.
    tolerance = {
        torch.float32: dict(atol=2e-5, rtol=1e-4)
        if quantization in (None, "stored")  # float32 arithmetic: only the shards' sums differ in order
        else dict(atol=0.1, rtol=0.02),
        torch.bfloat16: dict(atol=0.1, rtol=0.05),
    }[dtype]
    weights = load_weights(path, dtype=dtype, device=CPU, quantization=quantization, gguf_path=gguf_path)
    config, state = weights.config, weights.state
    assert bool(weights.quantized) == (quantization is not None)
    groups = make_groups(2)
    ranks = []
    for group in groups:
        decoder = shard_decoder(
            config, state, group=group, dtype=dtype, device=CPU, max_len=128, quantized=weights.quantized
        )
        layout = ShardLayout(config=config, rank=group.rank, size=2)
        ranks.append((decoder, build_cache(config, layout, OPTIONS, dtype=dtype, device=CPU)))
    follower = threading.Thread(
        target=serve_forwards, args=(ranks[1][0],), kwargs=dict(cache=ranks[1][1], group=groups[1]), daemon=True
    )
    follower.start()
    sharded = ModelRunner(model=ranks[0][0], cache=ranks[0][1], device=CPU)
    full, full_cache = make_runner(
        path, num_slots=2, max_len=128, block_size=5, dtype=dtype, quantization=quantization, gguf_path=gguf_path
    )
    try:
        for cache in (ranks[0][1], full_cache):
            for slot in (0, 1):
                assert cache.allocate() == slot
        tokens = [prompt(17, seed=3), prompt(9, seed=4)]
        steps = [
            # prefill of two sequences in one forward (several blocks, a sliding window)
            [SequenceWork(slot=s, cache_len=0, token_ids=t, logits_nodes=[len(t) - 1]) for s, t in enumerate(tokens)],
            # a tree on slot 0, a decode on slot 1
            [
                SequenceWork(
                    slot=0,
                    cache_len=17,
                    token_ids=[5, 6, 7, 8, 9],
                    tree=Tree([-1, 0, 0, 1, 2]),
                    logits_nodes=[0, 1, 2, 3, 4],
                ),
                SequenceWork(slot=1, cache_len=9, token_ids=[11], logits_nodes=[0]),
            ],
        ]
        for work in steps:
            got = sharded.forward(work).logits
            expected = full.forward(work).logits
            torch.testing.assert_close(got, expected, **tolerance)
        # Keep the tree's right branch (nodes 0, 2, 4): the KV moves that the follower replays.
        for cache in (ranks[0][1], full_cache):
            cache.compact(0, source=[17, 19, 21], destination_start=17)
            cache.commit(0, 20)
        assert ranks[0][1].pending_moves
        work = [SequenceWork(slot=0, cache_len=20, token_ids=[12, 13], logits_nodes=[0, 1])]
        torch.testing.assert_close(sharded.forward(work).logits, full.forward(work).logits, **tolerance)
        assert not ranks[0][1].pending_moves  # sent with that forward
        # The follower's cache holds its KV heads of the same tokens at the same places.
        layout = ShardLayout(config=config, rank=1, size=2)
        heads = slice(layout.first_kv_head, layout.first_kv_head + layout.num_kv_heads)
        for layer in (i for i, window in enumerate(config.layer_windows) if window is None):
            keys, _ = ranks[1][1].read(layer, slot=0, start=0, end=22)
            full_keys, _ = full_cache.read(layer, slot=0, start=0, end=22)
            torch.testing.assert_close(keys, full_keys[heads], **tolerance)
    finally:
        groups[0].send_object(SHUTDOWN, None)
        follower.join(timeout=30)
    assert not follower.is_alive()
