"""Rollback and compaction leave the cache as if the rejected tokens were never written."""

from __future__ import annotations

import pytest
import torch

from quickdraft.bench.memory import current_rss_bytes
from quickdraft.engine.runner import SequenceWork
from quickdraft.kv.cache import RELEASED, CacheFullError, KVCache
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
    table = cache.block_table(a)
    assert len(table) == 3 and len(cache.block_table(b)) == 1 and not set(table) & set(cache.block_table(b))
    assert cache.locate(a, [0, 3, 4, 8, 9]) == ([table[0], table[0], table[1], table[2], table[2]], [0, 3, 0, 0, 1])
    with pytest.raises(ValueError, match="exceed the cache length"):
        cache.reserve(a, 11)
    assert cache.num_free_blocks == 2
    cache.free(a)
    assert cache.block_table(a) == [] and cache.num_free_blocks == 5


def test_reads_across_blocks_are_the_range_and_one_block_is_a_view():
    cache, slot = _positions_cache(max_len=12, block_size=4)
    assert _first_dim(cache, 1, slot, 2, 11) == (list(range(2, 11)), [-x for x in range(2, 11)])
    keys, _ = cache.read(0, slot=slot, start=5, end=8)  # inside the second block
    assert keys.data_ptr() == cache.keys[0][cache.block_table(slot)[1], :, 1].data_ptr()


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


def _window_cache(**options) -> KVCache:
    """Layer 0 sees everything, layer 1 a window of 6 positions; blocks of 4, 40 positions."""
    settings = dict(
        num_layers=2, num_slots=2, num_kv_heads=1, head_dim=2, max_len=40, block_size=4, max_step_tokens=8,
        layer_windows=[None, 6],
    )  # fmt: skip
    return KVCache(**{**settings, **options}, dtype=torch.float32)


def test_a_sliding_window_group_gives_back_the_blocks_behind_every_future_window():
    cache = _window_cache()
    # Per slot: full attention all 10 blocks; the window 5 (5 positions behind + 8 new, in blocks, + 1).
    assert [g.num_blocks for g in cache.groups] == [20, 10] and cache.group_of_layer == [0, 1]
    slot = cache.allocate()
    cache.reserve(slot, 8)
    cache.commit(slot, 8)
    cache.reserve(slot, 16)  # a query at 8 sees keys from 3: block 0 is still needed
    assert cache.held_blocks(slot) == [4, 4]
    cache.commit(slot, 16)
    cache.reserve(slot, 20)  # queries from 16 see keys from 11: blocks 0 and 1 go back
    assert cache.block_table(slot, layer=1)[:2] == [RELEASED, RELEASED]
    assert cache.held_blocks(slot) == [5, 3] and cache.num_free_blocks == 15 + 7
    assert cache.block_table(slot, layer=0) == cache.block_table(slot)  # layer 0: all its blocks
    cache.read(1, slot=slot, start=11, end=20)  # the window reads fine
    with pytest.raises(ValueError, match="given back"):
        cache.read(1, slot=slot, start=7, end=20)
    with pytest.raises(ValueError, match="cannot roll back to 12"):
        cache.commit(slot, 12)  # a query at 12 would need key 7, in a block given back
    cache.commit(slot, 14)  # a rollback that stays inside the kept blocks is fine
    cache.free(slot)
    assert cache.num_free_blocks == 30 and cache.held_blocks(slot) == [0, 0]


def test_window_blocks_stay_exact_across_writes_compaction_and_reads():
    """Each round writes 8 new tokens (value = a running count), keeps 3 of them by a compaction,
    and both groups read back what a plain list says, over the window."""
    cache = _window_cache(num_slots=1)
    slot = cache.allocate()
    truth: list[float] = []  # what storage index i holds, committed indices only
    written = 0.0
    while len(truth) + 8 <= 40:
        length = len(truth)
        cache.reserve(slot, length + 8)
        new = [written + i for i in range(8)]
        written += 8
        blocks, rows = cache.locate_all(slot, list(range(length, length + 8)))
        keys = torch.tensor(new)[:, None, None].expand(8, 1, 2)
        for layer in range(2):
            group_blocks = torch.tensor(blocks[cache.group_of_layer[layer]])
            cache.write(layer, keys=keys, values=-keys, block_index=group_blocks, block_offset=torch.tensor(rows))
        kept = [0, 3, 5]  # an accepted path: nodes 0, 3, 5 move to length, +1, +2
        cache.compact(slot, source=[length + k for k in kept], destination_start=length)
        truth += [new[k] for k in kept]
        cache.commit(slot, len(truth))
        start = max(0, len(truth) - 5)  # the keys a query at len(truth) sees
        for layer in range(2):
            assert _first_dim(cache, layer, slot, start, len(truth))[0] == truth[start:]
    assert _first_dim(cache, 0, slot, 0, len(truth))[0] == truth  # full attention kept everything
    assert cache.block_table(slot, layer=1)[0] == RELEASED


def test_a_small_memory_budget_sizes_the_pools_and_refuses_less_than_one_request():
    full = _window_cache()
    half = _window_cache(memory_bytes=full.memory_bytes // 2)
    assert [g.num_blocks for g in half.groups] == [10, 5]
    with pytest.raises(ValueError, match="cannot hold one request"):
        _window_cache(memory_bytes=full.memory_bytes // 3)
    slot, other = half.allocate(), half.allocate()
    for length in range(0, 40, 8):  # one forward of at most max_step_tokens at a time
        assert half.try_reserve(slot, length + 8)
        half.commit(slot, length + 8)
    assert not half.can_reserve(other, 1)
    assert not half.try_reserve(other, 4) and half.held_blocks(other) == [0, 0]  # nothing taken
    with pytest.raises(CacheFullError, match="no free KV cache blocks"):
        half.reserve(other, 4)


def test_a_fresh_pool_is_zeros_and_costs_resident_memory_only_where_written():
    # 2 layers x keys and values x 64 blocks x 16 rows x 1024 floats = 32 MiB of pools
    before = current_rss_bytes()
    cache = KVCache(
        num_layers=2, num_slots=4, num_kv_heads=4, head_dim=256, max_len=256, dtype=torch.float32, block_size=16
    )
    assert current_rss_bytes() - before < 8 * 2**20  # torch.zeros would make all 32 MiB resident
    assert not any(pool.any() for pool in cache.keys + cache.values)  # reading maps the zero page
    slot = cache.allocate()
    cache.reserve(slot, 16)
    blocks, rows = cache.locate(slot, list(range(16)))
    keys = torch.randn(16, 4, 256)
    cache.write(0, keys=keys, values=-keys, block_index=torch.tensor(blocks), block_offset=torch.tensor(rows))
    stored_keys, stored_values = cache.read(0, slot=slot, start=0, end=16)
    assert torch.equal(stored_keys, keys.transpose(0, 1)) and torch.equal(stored_values, -keys.transpose(0, 1))
    assert current_rss_bytes() - before < 8 * 2**20
