"""Drafter features of prefix-cached blocks (engine/feature_cache.py): kept per block key, handed
back on a hit, so a feature-reading drafter drafts after a hit exactly as without the cache."""

from __future__ import annotations

import pytest
import torch

from quickdraft import LLM, SamplingParams
from quickdraft.engine.feature_cache import FeatureBlockCache
from tests.drafters.test_eagle import head_dir  # noqa: F401  (fixture)
from tests.drafters.test_layer_skip import random_self_head
from tests.models.test_decoder import prompt


def rows(start: int, stop: int) -> torch.Tensor:  # [stop - start, 2]: row i holds (i, -i)
    return torch.tensor([[float(i), -float(i)] for i in range(start, stop)])


def test_blocks_are_stored_as_committed_features_complete_them():
    cache = FeatureBlockCache(block_size=4, max_blocks=8)
    cache.add("r", rows(0, 3), keys=[])  # a prefill chunk under one block
    assert len(cache) == 0
    cache.add("r", rows(3, 6), keys=[b"k0"])  # completes block 0; block 1's key is not known yet
    assert b"k0" in cache and len(cache) == 1
    cache.add("r", rows(6, 9), keys=[b"k0", b"k1", b"k2"])  # block 1 completes; block 2 is one short
    assert len(cache) == 2
    cache.add("r", rows(9, 12), keys=[b"k0", b"k1", b"k2"])
    restored = cache.restore("s", [b"k0", b"k1", b"k2"])
    assert torch.equal(restored, rows(0, 12))
    assert cache.restore("t", [b"k0", b"k9"]) is None  # all or nothing


def test_a_restored_request_keys_its_later_blocks_from_the_end_of_the_hit():
    cache = FeatureBlockCache(block_size=2, max_blocks=8)
    cache.add("a", rows(0, 4), keys=[b"k0", b"k1"])
    assert torch.equal(cache.restore("b", [b"k0"]), rows(0, 2))
    cache.add("b", rows(2, 4), keys=[b"k0", b"x1"])  # b's second block differs from a's
    assert torch.equal(cache.restore("c", [b"k0", b"x1"]), rows(0, 4))


def test_least_recently_used_blocks_go_first():
    cache = FeatureBlockCache(block_size=1, max_blocks=2)
    cache.add("a", rows(0, 2), keys=[b"k0", b"k1"])
    cache.restore("b", [b"k0"])  # k0 is now newer than k1
    cache.add("c", rows(5, 6), keys=[b"k5"])
    assert b"k0" in cache and b"k5" in cache and b"k1" not in cache


def test_blocks_keep_the_pieces_handed_over_without_copies():
    """The engine hands over tensors of their own rows (Drafter.observe's contract), which the
    drafter keeps too: a block keeps those pieces, sliced at its boundaries, and a hit joins them."""
    cache = FeatureBlockCache(block_size=2, max_blocks=4)
    first, second = rows(0, 3), rows(3, 4)
    cache.add("a", first, keys=[b"k0"])
    cache.add("a", second, keys=[b"k0", b"k1"])
    stored = [piece for key in (b"k0", b"k1") for piece in cache._blocks[key]]
    assert {piece.untyped_storage().data_ptr() for piece in stored} == {
        first.untyped_storage().data_ptr(),
        second.untyped_storage().data_ptr(),
    }
    assert torch.equal(cache.restore("b", [b"k0", b"k1"]), rows(0, 4))


def test_a_piece_over_several_blocks_fills_them_all():
    cache = FeatureBlockCache(block_size=2, max_blocks=8)
    cache.add("a", rows(0, 1), keys=[])
    cache.add("a", rows(1, 8), keys=[b"k0", b"k1", b"k2"])  # a prefill chunk: three blocks and a row
    assert len(cache) == 3
    cache.add("a", rows(8, 9), keys=[b"k0", b"k1", b"k2", b"k3"])
    assert torch.equal(cache.restore("b", [b"k0", b"k1", b"k2", b"k3"]), rows(0, 8))


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="block_size"):
        FeatureBlockCache(block_size=0, max_blocks=4)


PROMPT = prompt(65, seed=31)  # 8 full blocks of 8 before its last token
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def observing(llm: LLM) -> list[torch.Tensor]:
    """Every features tensor the engine hands the drafter, in order."""
    seen, drafter = [], llm.engine.speculator.drafter
    observe = drafter.observe

    def spy(request, features):
        seen.append(features.clone())
        observe(request, features)

    drafter.observe = spy
    return seen


def context_features(llm: LLM, seen: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """The prompt asked again: the features its drafter got for the prompt's first 64 tokens
    (restored on a hit, computed otherwise), and its output."""
    seen.clear()
    (out,) = llm.generate([{"prompt_token_ids": PROMPT}], GREEDY)
    return torch.cat(seen)[:64], list(out.outputs[0].token_ids)


@pytest.fixture(scope="module")
def copy_self_head(tmp_path_factory):
    return random_self_head(tmp_path_factory.mktemp("self-copy-fc") / "head", copy_dim=8)


@pytest.mark.parametrize("method", ["eagle3", "self"])
def test_a_hit_hands_the_drafter_the_features_a_recompute_would(tiny_checkpoints, head_dir, copy_self_head, method):  # noqa: F811
    """The second request for a prompt hits the first one's 64 cached tokens: its drafter gets the
    stored features of those tokens, the very values an engine without prefix caching computes
    for them (and the tokens are the same)."""
    head = head_dir if method == "eagle3" else copy_self_head
    spec = {"method": method, "head": str(head), "num_speculative_tokens": 3}
    path = str(tiny_checkpoints["gemma3"])
    got = {}
    for caching in (True, False):
        llm = LLM(path, max_model_len=256, block_size=8, enable_prefix_caching=caching, speculative_config=spec)
        seen = observing(llm)
        context_features(llm, seen)
        got[caching] = context_features(llm, seen)
        assert llm.get_metrics().num_cached_tokens == (64 if caching else 0)
        if caching:
            assert len(llm.engine.speculator.feature_blocks) >= 8
            assert seen[0].shape[0] == 64  # restored in one piece, before the last prompt token's forward
    assert torch.equal(got[True][0], got[False][0])
    assert got[True][1] == got[False][1]


def test_blocks_computed_without_the_drafter_are_recomputed_for_it(tiny_checkpoints, head_dir):  # noqa: F811
    """Plain decoding caches the prompt's blocks; eagle3 then has no features for them, so its
    first request recomputes them (no hit), and its second one hits what the first stored."""
    path = str(tiny_checkpoints["gemma3"])
    llm = LLM(path, max_model_len=256, block_size=8)
    llm.generate([{"prompt_token_ids": PROMPT}], GREEDY)
    assert llm.engine.cache.find_prefix(PROMPT).num_tokens == 64
    llm.engine.set_speculative_config({"method": "eagle3", "head": str(head_dir), "num_speculative_tokens": 3})
    seen = observing(llm)
    computed, first = context_features(llm, seen)
    assert llm.get_metrics().num_cached_tokens == 0
    restored, second = context_features(llm, seen)
    assert llm.get_metrics().num_cached_tokens == 64
    assert torch.equal(restored, computed) and first == second
