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


def test_compact_moves_only_the_given_indices():
    cache = KVCache(num_layers=2, num_slots=1, num_kv_heads=1, head_dim=2, max_len=10, dtype=torch.float32)
    for layer in range(2):
        cache.keys[layer][0, 0, :, 0] = torch.arange(10.0)
        cache.values[layer][0, 0, :, 0] = -torch.arange(10.0)
    cache.compact(0, source=[4, 6, 7], destination_start=4)
    for layer in range(2):
        assert cache.keys[layer][0, 0, :, 0].tolist() == [0, 1, 2, 3, 4, 6, 7, 7, 8, 9]
        assert cache.values[layer][0, 0, :, 0].tolist() == [0, -1, -2, -3, -4, -6, -7, -7, -8, -9]


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
