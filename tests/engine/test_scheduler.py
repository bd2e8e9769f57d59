"""The scheduler under a KV cache that runs out of blocks, and sliding-window layers that hold
only their window: requests wait or are preempted (and recompute), never fail a step, and every
output stays what an unconstrained engine decodes."""

from __future__ import annotations

import pytest

from quickdraft import LLM, SamplingParams
from quickdraft.kv.cache import RELEASED
from tests.drafters.test_eagle import head_dir  # noqa: F401  (fixture)
from tests.drafters.test_layer_skip import self_head  # noqa: F401  (fixture)
from tests.engine.test_speculative import GarbageDrafter
from tests.models.test_decoder import prompt

PROMPTS = [prompt(30, seed=40 + i) for i in range(4)]


def _generate(llm: LLM, params: SamplingParams) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    return [o.outputs[0].token_ids for o in outputs]


def test_sliding_layers_hold_only_their_window_while_decoding(tiny_checkpoints):
    llm = LLM(str(tiny_checkpoints["gemma3"]), max_model_len=256, block_size=4, max_num_batched_tokens=16)
    engine, cache = llm.engine, llm.engine.cache
    assert [group.window for group in cache.groups] == [8, None]  # tiny gemma: layers 0, 2 slide over 8
    engine.add_request(prompt_token_ids=PROMPTS[0], params=SamplingParams(max_tokens=60, ignore_eos=True))
    most_held = 0
    while engine.has_unfinished_requests():
        engine.step()
        for request in engine.scheduler.running:
            window_held, full_held = cache.held_blocks(request.scheduled_slot)
            most_held = max(most_held, window_held)
            assert full_held == -(-cache.room(request.scheduled_slot) // 4)  # full attention keeps all
    # At most the 7 positions behind the committed length plus a 16-token chunk, in blocks of 4, + 1.
    assert 2 <= most_held <= 7
    assert cache.num_free_blocks == cache.num_blocks


def test_a_window_prefix_hit_decodes_what_it_would_compute(tiny_checkpoints):
    """The second turn shares blocks with the first; the window group gives it only the blocks
    its window needs, and the answer equals an engine without prefix caching."""
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    results = []
    for caching in (True, False):
        llm = LLM(str(tiny_checkpoints["gemma3"]), max_model_len=256, block_size=4, enable_prefix_caching=caching)
        (first,) = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": PROMPTS[0]}], params)]
        second = PROMPTS[0] + first + [7, 8]
        if caching:
            hit = llm.engine.cache.find_prefix(second)
            assert hit.num_tokens == 48 and hit.blocks[0][0] == RELEASED  # 12 blocks, the window's only
        outputs = llm.generate([{"prompt_token_ids": second}], params)
        results.append(outputs[0].outputs[0].token_ids)
    assert results[0] == results[1]


def _tight_llm(path: str, *, share: float, drafter: GarbageDrafter | None = None) -> LLM:
    """An engine whose KV cache holds `share` of what its 4 slots can need at once."""
    settings = dict(max_model_len=128, max_num_seqs=4, block_size=4)
    roomy = LLM(path, **settings).engine.cache.memory_bytes
    llm = LLM(path, **settings, kv_cache_memory_bytes=int(roomy * share))
    if drafter is not None:
        llm.engine.set_drafter(drafter, num_speculative_tokens=4)
    return llm


@pytest.mark.parametrize("share", [0.26, 0.5])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("drafted", [False, True])
def test_a_full_cache_preempts_and_every_output_stays_exact(tiny_checkpoints, share, temperature, drafted):
    path = str(tiny_checkpoints["gemma3"])
    params = SamplingParams(temperature=temperature, max_tokens=80, seed=5, ignore_eos=True)
    expected = _generate(LLM(path, max_model_len=128, max_num_seqs=4, block_size=4), params)
    drafter = GarbageDrafter(vocab_size=320, tree=True, seed=2) if drafted else None
    llm = _tight_llm(path, share=share, drafter=drafter)
    assert _generate(llm, params) == expected
    metrics = llm.get_metrics()
    assert metrics.num_preemptions > 0  # 4 x 110 tokens do not fit: someone recomputed
    assert llm.engine.cache.num_free_blocks == llm.engine.cache.num_blocks


@pytest.mark.parametrize("method", ["eagle3", "self"])
def test_head_drafters_keep_exact_through_preemption(tiny_checkpoints, head_dir, self_head, method):  # noqa: F811
    """Drafters with state per request (eagle3's head context fed by the target's features;
    [self] drafting inside the target's own cache slot, which changes on readmission) keep the
    output plain decoding's through preemptions and recomputation."""
    path = str(tiny_checkpoints["gemma3"])
    params = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
    expected = _generate(LLM(path, max_model_len=128, max_num_seqs=4, block_size=4), params)
    head = head_dir if method == "eagle3" else self_head
    llm = _tight_llm(path, share=0.3)
    llm.engine.set_speculative_config({"method": method, "head": str(head), "num_speculative_tokens": 3})
    assert _generate(llm, params) == expected
    metrics = llm.get_metrics()
    assert metrics.num_preemptions > 0 and metrics.num_drafts > 0


def test_a_cache_smaller_than_one_request_is_refused(tiny_checkpoints):
    with pytest.raises(ValueError, match="cannot hold one request"):
        LLM(str(tiny_checkpoints["gemma3"]), max_model_len=128, kv_cache_memory_bytes=1000)
    with pytest.raises(ValueError, match="kv_cache_memory_bytes must be a positive integer"):
        LLM(str(tiny_checkpoints["gemma3"]), kv_cache_memory_bytes=-1)


def _finish_order(llm: LLM, priorities: list[int]) -> list[str]:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    ids = [
        llm.engine.add_request(prompt_token_ids=PROMPTS[i], params=params, priority=rank)
        for i, rank in enumerate(priorities)
    ]
    order = []
    while llm.engine.has_unfinished_requests():
        order += [delta.request_id for delta in llm.engine.step() if delta.finished]
    return [f"r{ids.index(request_id)}" for request_id in order]


def test_the_priority_policy_serves_lower_values_first_then_arrival(tiny_checkpoints):
    path = str(tiny_checkpoints["gemma3"])
    ordered = LLM(path, max_model_len=128, max_num_seqs=1, scheduling_policy="priority")
    assert _finish_order(ordered, [5, 0, 5, -1]) == ["r3", "r1", "r0", "r2"]  # ties: the earlier arrival
    fcfs = LLM(path, max_model_len=128, max_num_seqs=1)
    assert _finish_order(fcfs, [0, 0, 0, 0]) == ["r0", "r1", "r2", "r3"]


def test_the_priority_policy_preempts_the_last_in_its_order(tiny_checkpoints):
    path = str(tiny_checkpoints["gemma3"])
    settings = dict(max_model_len=128, max_num_seqs=2, block_size=4)
    roomy = LLM(path, **settings).engine.cache.memory_bytes
    params = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
    expected = _generate(LLM(path, **settings), params)[:2]
    preemptions = {}
    for policy in ("fcfs", "priority"):
        llm = LLM(path, **settings, kv_cache_memory_bytes=int(roomy * 0.5), scheduling_policy=policy)
        ranks = [1, 0] if policy == "priority" else None  # the newer request matters more
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], params, priority=ranks)
        assert [o.outputs[0].token_ids for o in outputs] == expected
        preemptions[policy] = [o.metrics.num_preemptions for o in outputs]
    assert preemptions["fcfs"][0] == 0 and preemptions["fcfs"][1] > 0  # the newest gives its blocks back
    assert preemptions["priority"][0] > 0 and preemptions["priority"][1] == 0  # the less important one does


def test_priority_needs_the_priority_policy(tiny_checkpoints):
    llm = LLM(str(tiny_checkpoints["gemma3"]), max_model_len=128)
    with pytest.raises(ValueError, match="set scheduling_policy='priority'") as caught:
        llm.engine.add_request(prompt_token_ids=PROMPTS[0], priority=1)
    assert caught.value.param == "priority"
    with pytest.raises(ValueError, match="priority must be an int"):
        llm.engine.add_request(prompt_token_ids=PROMPTS[0], priority=1.5)
    with pytest.raises(ValueError, match="2 values for 1 prompts"):
        llm.generate([PROMPTS[0]], priority=[0, 0])
    with pytest.raises(ValueError, match="scheduling_policy must be"):
        LLM(str(tiny_checkpoints["gemma3"]), scheduling_policy="lifo")
    assert not llm.engine._requests
