"""Rollback and compaction leave the cache as if the rejected tokens were never written."""

from __future__ import annotations

import pytest
import torch

from quickdraft.engine.runner import SequenceWork
from quickdraft.kv.cache import CacheFullError, KVCache
from quickdraft.verify.tree import Tree
from tests.models.test_decoder import make_runner, prompt, reference_logits


def test_slots_allocate_and_free():
    cache = KVCache(num_layers=1, num_slots=2, num_kv_heads=1, head_dim=4, max_len=8, dtype=torch.float32)
    a, b = cache.allocate(), cache.allocate()
    assert {a, b} == {0, 1} and cache.num_free_slots == 0
    with pytest.raises(CacheFullError):
        cache.allocate()
    cache.free(a)
    with pytest.raises(ValueError, match="already free"):
        cache.free(a)
    assert cache.allocate() == a


def _positions_cache(*, max_len: int, block_size: int | None) -> tuple[KVCache, int]:
    """A 2-layer cache whose slot holds key = position and value = -position at every index."""
    cache = KVCache(
        num_layers=2, num_slots=2, num_kv_heads=1, head_dim=2, max_len=max_len, dtype=torch.float32,
        block_size=block_size,
    )  # fmt: skip
    cache.allocate()
    slot = cache.allocate()
    cache.reserve(slot, max_len)
    blocks, rows = cache.locate(slot, list(range(max_len)))
    keys = torch.arange(float(max_len))[:, None, None].expand(max_len, 1, 2)
    for layer in range(2):
        cache.write(layer, keys=keys, values=-keys, block_index=torch.tensor(blocks), block_offset=torch.tensor(rows))
    return cache, slot


def _first_dim(cache: KVCache, layer: int, slot: int, start: int, end: int) -> tuple[list, list]:
    keys, values = cache.read(layer, slot=slot, start=start, end=end)
    return keys[0, :, 0].tolist(), values[0, :, 0].tolist()


@pytest.mark.parametrize("block_size", [None, 3])
def test_compact_moves_only_the_given_indices(block_size):
    cache, slot = _positions_cache(max_len=10, block_size=block_size)
    cache.compact(slot, source=[4, 6, 7], destination_start=4)
    for layer in range(2):
        keys, values = _first_dim(cache, layer, slot, 0, 10)
        assert keys == [0, 1, 2, 3, 4, 6, 7, 7, 8, 9]
        assert values == [0, -1, -2, -3, -4, -6, -7, -7, -8, -9]


def test_blocks_are_taken_as_a_slot_grows_and_given_back():
    cache = KVCache(
        num_layers=1, num_slots=2, num_kv_heads=1, head_dim=2, max_len=10, dtype=torch.float32, block_size=4
    )
    assert (cache.blocks_per_slot, cache.num_blocks) == (3, 6)
    a, b = cache.allocate(), cache.allocate()
    cache.reserve(a, 5)
    cache.reserve(b, 1)
    cache.reserve(a, 9)
    cache.reserve(a, 2)  # never shrinks
    table = cache.block_tables[a]
    assert len(table) == 3 and len(cache.block_tables[b]) == 1 and not set(table) & set(cache.block_tables[b])
    assert cache.locate(a, [0, 3, 4, 8, 9]) == ([table[0], table[0], table[1], table[2], table[2]], [0, 3, 0, 0, 1])
    with pytest.raises(ValueError, match="exceed the cache length"):
        cache.reserve(a, 11)
    assert cache.num_free_blocks == 2
    cache.free(a)
    assert cache.block_tables[a] == [] and cache.num_free_blocks == 5


def test_reads_across_blocks_are_the_range_and_one_block_is_a_view():
    cache, slot = _positions_cache(max_len=12, block_size=4)
    assert _first_dim(cache, 1, slot, 2, 11) == (list(range(2, 11)), [-x for x in range(2, 11)])
    keys, _ = cache.read(0, slot=slot, start=5, end=8)  # inside the second block
    assert keys.data_ptr() == cache.keys[0][cache.block_tables[slot][1], :, 1].data_ptr()


@pytest.mark.parametrize("arch", ["gemma3", "qwen3"])
def test_rollback_equals_never_writing(tiny_checkpoints, arch):
    """Write a garbage draft chain, roll it back, continue: logits match a clean run.

    The context (20 tokens) is past gemma's sliding window (8), so the sliding layers'
    window is exercised across the rollback too.
    """
    path = tiny_checkpoints[arch]
    context = prompt(20, seed=11)
    runner, cache = make_runner(path)
    runner.forward([SequenceWork(slot=0, cache_len=0, token_ids=context[:-1])])
    cache.commit(0, len(context) - 1)
    garbage = [context[-1], 5, 6, 7, 8, 9]
    runner.forward([SequenceWork(slot=0, cache_len=len(context) - 1, token_ids=garbage)])
    cache.commit(0, len(context))  # keep only the root: the 5 drafts were rejected
    follow = [42, 43, 44]
    out = runner.forward([SequenceWork(slot=0, cache_len=len(context), token_ids=follow, logits_nodes=[0, 1, 2])])
    expected = reference_logits(path, context + follow)[-3:]
    torch.testing.assert_close(out.logits, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["gemma3", "llama"])
def test_compacted_tree_path_equals_chain(tiny_checkpoints, arch):
    """Accept a path on a later branch of a tree, compact it, and decode on."""
    path = tiny_checkpoints[arch]
    context = prompt(15, seed=12)
    #          root a   b   c   b1  b2  b1x
    parents = [-1, 0, 0, 0, 2, 2, 4]
    nodes = [context[-1], 50, 51, 52, 53, 54, 55]
    accepted_nodes = [0, 2, 4, 6]  # root -> b -> b1 -> b1x
    runner, cache = make_runner(path)
    cache_len = len(context) - 1
    runner.forward([SequenceWork(slot=1, cache_len=0, token_ids=context[:-1])])
    cache.commit(1, cache_len)
    runner.forward([SequenceWork(slot=1, cache_len=cache_len, token_ids=nodes, tree=Tree(parents))])
    cache.compact(1, source=[cache_len + n for n in accepted_nodes], destination_start=cache_len)
    cache.commit(1, cache_len + len(accepted_nodes))
    accepted_tokens = [nodes[n] for n in accepted_nodes]
    follow = [60, 61]
    out = runner.forward(
        [SequenceWork(slot=1, cache_len=cache_len + len(accepted_nodes), token_ids=follow, logits_nodes=[0, 1])]
    )
    expected = reference_logits(path, context[:-1] + accepted_tokens + follow)[-2:]
    torch.testing.assert_close(out.logits, expected, rtol=1e-4, atol=1e-4)
