"""Automatic prefix caching: keyed full blocks, shared by reference, evicted least recently freed
first, never written once shared; a prompt that hits decodes exactly what it would compute."""

from __future__ import annotations

import pytest
import torch

from quickdraft import LLM, SamplingParams
from quickdraft.kv.cache import RELEASED, CachedPrefix, KVCache
from tests.drafters.test_eagle import head_dir  # noqa: F401  (fixture)
from tests.engine.test_speculative import GarbageDrafter, OracleDrafter
from tests.models.test_decoder import prompt


def hit(cache: KVCache, token_ids: list[int]) -> list[int]:
    """The cached blocks (of the one group) a prompt starts with."""
    return list(cache.find_prefix(token_ids).blocks[0])


def committed_slot(cache: KVCache, tokens: list[int], *, prefix: CachedPrefix | None = None) -> int:
    """A slot that committed `tokens` (starting from cached `prefix` blocks) and keyed its blocks."""
    slot = cache.allocate(prefix=prefix)
    cache.reserve(slot, len(tokens))
    cache.commit(slot, len(tokens))
    cache.cache_full_blocks(slot, tokens)
    return slot


def small_cache(**options) -> KVCache:
    settings = dict(num_layers=1, num_slots=3, num_kv_heads=1, head_dim=2, max_len=12, block_size=4)
    return KVCache(**{**settings, **options}, dtype=torch.float32)


def test_full_blocks_are_found_by_every_token_up_to_their_end():
    cache = small_cache()
    tokens = list(range(100, 110))
    a = committed_slot(cache, tokens)  # 10 tokens: blocks 0 and 1 are full, block 2 is not
    assert cache.num_cached_blocks == 2
    first, second = cache.block_table(a)[:2]
    assert hit(cache, tokens + [7]) == [first, second]
    assert hit(cache, tokens[:9]) == [first, second]
    assert hit(cache, tokens[:8]) == [first]  # the last token is always computed
    assert hit(cache, tokens[:5] + [0] + tokens[6:]) == [first]  # a change in block 1
    assert hit(cache, [0] + tokens[1:]) == []  # a change in block 0 changes every key after it
    other = small_cache()
    committed_slot(other, [1, 2, 3, 4] + tokens[4:])  # the same block 1 tokens after other ones
    assert hit(other, tokens) == []


def test_shared_blocks_outlive_their_first_slot_and_are_evicted_least_recently_freed_first():
    cache = small_cache()
    tokens = list(range(100, 112))
    a = committed_slot(cache, tokens)  # three full blocks keyed
    prefix = cache.find_prefix(tokens + [1])
    b = cache.allocate(prefix=prefix)
    assert cache.block_table(b) == cache.block_table(a) and cache.num_free_blocks == 6
    cache.free(a)
    assert cache.num_free_blocks == 6  # b still holds them
    cache.free(b)
    assert cache.num_free_blocks == 9 and hit(cache, tokens + [1]) == list(prefix.blocks[0])  # unused, still cached
    # Fill the pool: the 6 blocks that hold nothing go first, then the least recently freed
    # keyed one, which is the prefix's last block (a slot frees its blocks from the end).
    c = cache.allocate()
    cache.reserve(c, 12)
    d = cache.allocate()
    cache.reserve(d, 8)
    assert hit(cache, tokens + [1]) == list(prefix.blocks[0]) and cache.num_free_blocks == 4
    cache.reserve(d, 12)  # the last block that held nothing
    assert hit(cache, tokens + [1]) == list(prefix.blocks[0])
    e = cache.allocate()
    cache.reserve(e, 1)
    assert hit(cache, tokens + [1]) == list(prefix.blocks[0][:2]) and cache.num_cached_blocks == 2


def test_reset_forgets_every_prefix_and_frees_the_blocks_that_held_them():
    cache = small_cache()
    tokens = list(range(100, 112))
    cache.free(committed_slot(cache, tokens))
    in_use = committed_slot(cache, tokens[:8] + [1, 2, 3, 4], prefix=cache.find_prefix(tokens[:9]))
    cache.reset_prefix_cache()
    assert hit(cache, tokens + [1]) == [] and cache.num_cached_blocks == 0
    assert cache.num_free_blocks == 9 - len(cache.block_table(in_use))
    cache.free(in_use)
    assert cache.num_free_blocks == 9


def test_a_block_is_keyed_once_all_its_rows_are_committed():
    cache = small_cache()
    slot = cache.allocate()
    cache.reserve(slot, 12)
    tokens = list(range(50, 62))
    cache.commit(slot, 7)  # drafts may sit at 7.. : block 1 is not full of committed tokens
    cache.cache_full_blocks(slot, tokens)
    assert cache.num_cached_blocks == 1
    cache.commit(slot, 8)
    cache.cache_full_blocks(slot, tokens)
    assert cache.num_cached_blocks == 2


def test_a_window_group_shares_only_the_blocks_before_the_hit_that_its_window_sees():
    cache = small_cache(num_layers=2, max_len=40, layer_windows=[None, 6], max_step_tokens=8)
    tokens = list(range(100, 124))
    slot = cache.allocate()
    for length in range(0, 24, 4):  # grows as a request does: the window group gives blocks back
        cache.reserve(slot, length + 4)
        cache.commit(slot, length + 4)
        cache.cache_full_blocks(slot, tokens)
    cache.reserve(slot, 28)
    full_table, window_table = cache.block_table(slot, layer=0), cache.block_table(slot, layer=1)
    assert window_table[:4] == [RELEASED] * 4  # queries from 24 see keys from 19: block 4 on
    hit = cache.find_prefix(tokens + [1])
    assert hit.num_tokens == 24 and hit.blocks == (tuple(full_table[:6]), (RELEASED,) * 4 + tuple(window_table[4:6]))
    shorter = cache.find_prefix(tokens[:21])  # 5 blocks: the window of a query at 20 starts at 15, block 3
    assert shorter.num_tokens == 20 and shorter.blocks[1][:3] == (RELEASED,) * 3
    assert shorter.blocks[1][3] != RELEASED  # given back by the slot, still cached (LRU)
    other = cache.allocate(prefix=hit)
    assert cache.held_blocks(other) == [6, 2] and cache.block_table(other, layer=1)[4:] == window_table[4:6]
    cache.free(slot)
    cache.free(other)
    assert cache.num_free_blocks == cache.num_blocks


PROMPT = prompt(40, seed=21)


def _outputs(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_prompts_that_hit_decode_what_they_would_compute(tiny_checkpoints, temperature):
    """A second turn (the first turn's prompt and answer, then more) reuses the cached blocks and
    decodes the same tokens as an engine without prefix caching, greedy and seeded sampled."""
    params = SamplingParams(temperature=temperature, max_tokens=12, seed=3, ignore_eos=True)
    path = str(tiny_checkpoints["gemma3"])
    results = {}
    for caching in (True, False):
        llm = LLM(path, max_model_len=256, block_size=8, enable_prefix_caching=caching)
        (first,) = _outputs(llm, [PROMPT], params)
        second_turn = PROMPT + first + [5, 6, 7]
        results[caching] = (first, _outputs(llm, [second_turn, PROMPT[:30] + [9, 9]], params))
        if caching:
            metrics = llm.get_metrics()
            # 40 + 12 tokens committed by the first turn: 6 full blocks; the second prompt shares
            # 3 of them (its first 30 tokens hold 3 full blocks of the first prompt).
            assert metrics.num_cached_tokens == 48 + 24
            assert 0 < metrics.prefix_cache_hit_rate < 1
    assert results[True] == results[False]


@pytest.mark.parametrize("block_size", [4, 8])
def test_a_second_turn_after_speculative_decoding_reuses_every_block_the_first_filled(tiny_checkpoints, block_size):
    """Verified paths commit several tokens a step, their KV computed before the tokens are the
    request's: the blocks they fill are keyed by their whole tokens all the same, so the next turn
    hits as many of them as after plain decoding (it used to hit only the blocks each step
    completed with tokens already known, recomputing the rest of the first turn's answer)."""
    path = str(tiny_checkpoints["gemma3"])
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    (answer,) = _outputs(LLM(path, max_model_len=256, enable_prefix_caching=False), [PROMPT], params)
    second_turn = PROMPT + answer + [5, 6, 7]
    llm = LLM(path, max_model_len=256, block_size=block_size)
    llm.engine.set_drafter(OracleDrafter(continuations={tuple(PROMPT): answer}, corrupt=0.2), num_speculative_tokens=6)
    first = llm.generate([{"prompt_token_ids": PROMPT}], params)[0]
    assert list(first.outputs[0].token_ids) == answer
    assert first.metrics.num_accepted_tokens > 12  # multi-token steps, crossing block boundaries
    llm.engine.set_speculative_config(None)
    second = llm.generate([{"prompt_token_ids": second_turn}], SamplingParams(temperature=0.0, max_tokens=1))[0]
    # Every full block of the first turn's computed rows (its last token's KV is never computed).
    assert second.metrics.num_cached_tokens == (40 + 24 - 1) // block_size * block_size


def test_rejected_branches_never_touch_shared_blocks(tiny_checkpoints):
    """Two requests share a cached prefix and verify garbage trees beside each other: the shared
    blocks' bytes are the same after every step, and the outputs are plain decoding's."""
    path = str(tiny_checkpoints["llama"])
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    plain = LLM(path, max_model_len=256, enable_prefix_caching=False)
    expected = _outputs(plain, [PROMPT + [3], PROMPT + [4]], params)
    llm = LLM(path, max_model_len=256, max_num_seqs=2, block_size=8)
    _outputs(llm, [PROMPT], SamplingParams(temperature=0.0, max_tokens=1))  # caches the prompt's blocks
    cache = llm.engine.cache
    shared = list(cache.find_prefix(PROMPT + [3]).blocks[0])
    assert len(shared) == 5
    llm.engine.set_drafter(GarbageDrafter(vocab_size=320, tree=True, seed=4), num_speculative_tokens=6)
    before = [(k[shared].clone(), v[shared].clone()) for k, v in zip(cache.keys, cache.values)]
    original_step = llm.engine.step

    def checked_step():
        deltas = original_step()
        for (keys, values), k, v in zip(before, cache.keys, cache.values):
            assert torch.equal(k[shared], keys) and torch.equal(v[shared], values)
        return deltas

    llm.engine.step = checked_step
    assert _outputs(llm, [PROMPT + [3], PROMPT + [4]], params) == expected
    assert llm.get_metrics().num_cached_tokens >= 2 * 40


def test_eagle_drafts_after_a_prefix_hit(tiny_checkpoints, head_dir):  # noqa: F811
    """The second time, the head gets the cached tokens' stored features (tests/engine/
    test_feature_cache.py), drafts, and the output stays plain decoding's."""
    path = str(tiny_checkpoints["gemma3"])
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    spec = {"method": "eagle3", "head": str(head_dir), "num_speculative_tokens": 3}
    expected = _outputs(LLM(path, max_model_len=256, enable_prefix_caching=False), [PROMPT], params)
    llm = LLM(path, max_model_len=256, block_size=8, speculative_config=spec)
    assert _outputs(llm, [PROMPT], params) == expected
    drafts_before = llm.get_metrics().num_drafts
    assert _outputs(llm, [PROMPT], params) == expected  # the second time, 32 tokens are cached
    metrics = llm.get_metrics()
    assert metrics.num_cached_tokens == 32 and metrics.num_drafts > drafts_before


def test_a_hit_can_span_no_more_blocks_than_a_full_attention_pool_holds():
    cache = small_cache(num_layers=3, num_slots=2, max_len=64, block_size=8, layer_windows=[16, None, 16])
    full = [g.num_blocks for g in cache.groups if g.window is None]
    assert cache.max_prefix_blocks == full[0] == 16 and cache.num_blocks > 16


@pytest.mark.parametrize("chunk", [256, 16], ids=["whole-prefill", "chunked-prefill"])
def test_requests_sharing_blocks_a_prefill_is_computing_wait_for_them(tiny_checkpoints, chunk):
    """The n completions of one prompt, and a prompt sharing its first blocks, admitted together:
    the first computes the shared blocks, the others wait until they are cached and skip them
    (the same tokens come out as with no prefix caching at all)."""
    params = SamplingParams(n=3, temperature=0.8, max_tokens=6, seed=3, ignore_eos=True)
    sharing = PROMPT[:34] + [7, 7, 7]  # 4 full blocks of 8 in common with PROMPT
    path = str(tiny_checkpoints["gemma3"])
    results = {}
    for caching in (True, False):
        llm = LLM(path, max_model_len=256, block_size=8, max_num_batched_tokens=chunk, enable_prefix_caching=caching)
        outputs = llm.generate([{"prompt_token_ids": PROMPT}, {"prompt_token_ids": sharing}], params)
        results[caching] = [[c.token_ids for c in output.outputs] for output in outputs]
        if caching:
            # PROMPT's 40 tokens: 4 full blocks before its last token (32 tokens), computed once.
            # (A request's merged metrics hold the fewest cached tokens of its children.)
            assert [outputs[0].metrics.num_cached_tokens, outputs[1].metrics.num_cached_tokens] == [0, 32]
            assert llm.get_metrics().num_cached_tokens == 32 * 2 + 32 * 3  # children 1, 2; every `sharing` child
    assert results[True] == results[False]


def test_a_request_waiting_for_a_computing_prefill_does_not_hold_back_the_others(tiny_checkpoints):
    """A's prefill computes blocks B shares, so B waits for them; C, behind B, shares nothing and
    starts at once. B keeps its place: it is admitted once A's blocks are cached."""
    path = str(tiny_checkpoints["gemma3"])
    llm = LLM(path, max_model_len=256, block_size=8, max_num_batched_tokens=16, max_num_seqs=4)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    unrelated = prompt(20, seed=77)
    ids = [
        engine.add_request(prompt_token_ids=tokens, params=params)
        for tokens in (PROMPT, PROMPT[:34] + [7, 7, 7], unrelated)
    ]
    engine.step()
    running = [request.request_id for request in engine.scheduler.running]
    waiting = [request.request_id for request in engine.scheduler.waiting]
    assert running == [ids[0], ids[2]] and waiting == [ids[1]]
    outputs = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            if delta.finished:
                outputs[delta.request_id] = delta.output
    assert outputs[ids[1]].metrics.num_cached_tokens == 32  # it waited for A's 4 blocks and took them
    alone = LLM(path, max_model_len=256, block_size=8, enable_prefix_caching=False)
    expected = alone.generate([{"prompt_token_ids": p} for p in (PROMPT, PROMPT[:34] + [7, 7, 7], unrelated)], params)
    assert [outputs[i].outputs[0].token_ids for i in ids] == [o.outputs[0].token_ids for o in expected]


def test_a_cache_salt_shares_blocks_only_under_the_same_salt():
    cache = small_cache()
    tokens = list(range(100, 110))
    slot = cache.allocate(salt="tenant-a")
    cache.reserve(slot, len(tokens))
    cache.commit(slot, len(tokens))
    cache.cache_full_blocks(slot, tokens)
    salted = cache.block_table(slot)[:2]
    assert list(cache.find_prefix(tokens + [7], salt="tenant-a").blocks[0]) == salted
    assert hit(cache, tokens + [7]) == []  # unsalted
    assert list(cache.find_prefix(tokens + [7], salt="tenant-b").blocks[0]) == []
    plain = committed_slot(cache, tokens)  # the same tokens without a salt: blocks of their own
    assert hit(cache, tokens + [7]) == cache.block_table(plain)[:2] != salted
    cache.free(slot)
    assert cache.allocate() == slot and not cache.block_keys(slot)  # a freed slot forgets its salt


def test_requests_of_other_salts_neither_hit_nor_wait_for_each_other(tiny_checkpoints):
    path = str(tiny_checkpoints["gemma3"])
    llm = LLM(path, max_model_len=256, block_size=8, max_num_seqs=4)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompts = [
        {"prompt_token_ids": PROMPT, "cache_salt": "a"},
        {"prompt_token_ids": PROMPT, "cache_salt": "b"},  # would wait for a's blocks if it could share them
    ]
    first = llm.generate(prompts, params)
    assert [o.metrics.num_cached_tokens for o in first] == [0, 0]
    again = llm.generate(prompts + [{"prompt_token_ids": PROMPT}], params)
    assert [o.metrics.num_cached_tokens for o in again] == [32, 32, 0]  # each salt its own blocks; none unsalted
    assert len({tuple(o.outputs[0].token_ids) for o in first + again}) == 1
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        llm.generate([{"prompt_token_ids": PROMPT, "cache_salt": ""}], params)
