"""Hybrid drafting: trees merged by prefix within a budget, children told their own paths, exact."""

from __future__ import annotations

import time

import pytest

from quickdraft import LLM, SamplingParams
from quickdraft.drafters.base import AcceptedPath, DraftRequest, Proposal
from quickdraft.drafters.hybrid import ArmThroughput, LaterDrafterPolicy, merge_proposals, path_in_child
from tests.drafters.test_eagle import random_head
from tests.engine.test_speculative import repetitive_prompts

GREEDY = dict(temperature=0.0, ignore_eos=True)


def test_merge_by_prefix_exact_table():
    a = Proposal.chain(9, [1, 2, 3])
    b = Proposal(token_ids=[9, 1, 5, 4], parents=[-1, 0, 1, 0])
    merged = merge_proposals([a, b], budget=10)
    assert merged.token_ids == [9, 1, 2, 3, 5, 4] and merged.parents == [-1, 0, 1, 2, 1, 0]
    assert merged.child_nodes[0] == {0: 0, 1: 1, 2: 2, 3: 3}
    assert merged.child_nodes[1] == {0: 0, 1: 1, 4: 2, 5: 3}
    Proposal(token_ids=merged.token_ids, parents=merged.parents)


def test_merge_respects_the_budget_and_drops_orphans():
    a = Proposal.chain(9, [1, 2, 3])
    b = Proposal(token_ids=[9, 4, 6, 1, 7], parents=[-1, 0, 1, 0, 3])
    merged = merge_proposals([a, b], budget=4)
    # a fills 3 nodes; b adds 4 under the root; 6 (under 4) no longer fits; 1 is shared, 7 does not fit
    assert merged.token_ids == [9, 1, 2, 3, 4] and merged.parents == [-1, 0, 1, 2, 0]
    assert merged.child_nodes[1] == {0: 0, 4: 1, 1: 3}
    assert merge_proposals([None, Proposal.chain(9, [])], budget=4) is None
    only_second = merge_proposals([None, a], budget=2)
    assert only_second.token_ids == [9, 1, 2] and only_second.child_nodes[0] == {}


def test_accepted_path_in_each_child():
    accepted = AcceptedPath(nodes=[0, 1, 4], num_accepted=2, committed_token_ids=[1, 5, 8], bonus=True)
    first = path_in_child(accepted, {0: 0, 1: 1, 2: 2, 3: 3})
    assert first.nodes == [0, 1] and first.num_accepted == 1 and not first.bonus
    second = path_in_child(accepted, {0: 0, 1: 1, 4: 2, 5: 3})
    assert second.nodes == [0, 1, 2] and second.num_accepted == 2 and second.bonus
    assert path_in_child(accepted, {}).nodes == [0]


@pytest.fixture(scope="module")
def plain(tiny_checkpoints):
    llm = LLM(str(tiny_checkpoints["gemma3"]), max_model_len=256, max_num_seqs=4)
    return [o.outputs[0].token_ids for o in llm.generate(repetitive_prompts(), SamplingParams(max_tokens=30, **GREEDY))]


def hybrid_llm(target: str, drafters: list[dict], **options) -> LLM:
    """The tiny target with a hybrid of `drafters`, 4 draft tokens per child; `options` go to the hybrid."""
    config = {"method": "hybrid", "drafters": drafters, "num_speculative_tokens": 4, **options}
    return LLM(target, max_model_len=256, max_num_seqs=4, speculative_config=config)


@pytest.mark.parametrize(
    "children",
    [
        [{"method": "suffix"}, {"method": "eagle3", "top_k": 2}],
        [{"method": "ngram", "num_speculative_tokens": 3}, {"method": "draft_model"}],
    ],
)
def test_hybrid_greedy_equals_plain(tiny_checkpoints, tmp_path, plain, children):
    target = str(tiny_checkpoints["gemma3"])
    head = random_head(tmp_path / "head")
    for child in children:
        if child["method"] == "eagle3":
            child["head"] = str(head)
        if child["method"] == "draft_model":
            child["model"] = target
    llm = hybrid_llm(target, children, max_draft_tokens=8)
    outs = llm.generate(repetitive_prompts(), SamplingParams(max_tokens=30, **GREEDY))
    assert [o.outputs[0].token_ids for o in outs] == plain
    metrics = llm.get_metrics()
    assert metrics.num_drafts > 0 and metrics.num_accepted_tokens > 0


def test_skip_after_asks_the_head_only_when_retrieval_is_short(tiny_checkpoints, tmp_path, plain):
    target = str(tiny_checkpoints["gemma3"])
    eagle = {"method": "eagle3", "head": str(random_head(tmp_path / "h")), "top_k": 1}
    children = [{"method": "ngram", "num_speculative_tokens": 4}, eagle]
    llm = hybrid_llm(target, children, skip_after=2, ask_later="always")  # skip_after alone decides here
    hybrid = llm.engine.speculator.drafter
    ngram, head = hybrid.children
    asked = {"ngram": 0, "head": 0, "long_matches": 0}
    ngram_propose, head_propose = ngram.propose, head.propose

    def count_ngram(requests):
        out = ngram_propose(requests)
        asked["ngram"] += len(requests)
        asked["long_matches"] += sum(1 for p in out if p is not None and p.num_draft_tokens >= 2)
        return out

    def count_head(requests):
        asked["head"] += len(requests)
        return head_propose(requests)

    ngram.propose, head.propose = count_ngram, count_head
    outs = llm.generate(repetitive_prompts(), SamplingParams(max_tokens=30, **GREEDY))
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert asked["long_matches"] > 0 and asked["head"] == asked["ngram"] - asked["long_matches"]
    assert llm.get_metrics().num_accepted_tokens > 0


def test_bad_hybrid_configs(tiny_checkpoints):
    path = str(tiny_checkpoints["gemma3"])
    with pytest.raises(ValueError, match="at least two"):
        LLM(path, speculative_config={"method": "hybrid", "drafters": [{"method": "ngram"}]})
    with pytest.raises(ValueError, match="other than hybrid"):
        LLM(path, speculative_config={"method": "hybrid", "drafters": [{"method": "ngram"}, {"method": "hybrid"}]})
    with pytest.raises(ValueError, match="unknown speculative method"):
        LLM(path, speculative_config={"method": "hybrid", "drafters": [{"method": "ngram"}, {"method": "nope"}]})
    with pytest.raises(ValueError, match="skip_after"):
        LLM(
            path,
            speculative_config={
                "method": "hybrid",
                "drafters": [{"method": "ngram"}, {"method": "suffix"}],
                "skip_after": 0,
            },
        )


def _request(sampled: bool = False) -> DraftRequest:
    params = SamplingParams(temperature=0.7 if sampled else 0.0)
    return DraftRequest(request_id="r", prompt_token_ids=[1, 2], output_token_ids=[], budget=8, params=params)


def _run_steps(policy: LaterDrafterPolicy, request: DraftRequest, steps: int, *, context, outcome) -> list[bool]:
    """`steps` steps of one request: outcome(asked) -> (tokens committed, seconds taken)."""
    clock = [0.0]
    policy.clock = lambda: clock[0]
    choices = []
    for _ in range(steps):
        now = policy.clock()
        policy.observe(request, now)
        asked = policy.choose(context)
        policy.started(request, now, context, asked)
        tokens, seconds = outcome(asked)
        request.output_token_ids.extend([7] * tokens)
        clock[0] += seconds
        choices.append(asked)
    return choices


def test_later_drafters_asked_by_measured_throughput():
    """Each arm once (asking first), then the faster one, the other after 8 steps of the context,
    then after 16 (the first exploration confirmed the choice)."""
    policy = LaterDrafterPolicy(explore_every=8)
    greedy = (False, True)
    # asking: 3 tokens in 30 ms (100 tok/s); not asking: 2 tokens in 10 ms (200 tok/s)
    choices = _run_steps(
        policy, _request(), 20, context=greedy, outcome=lambda asked: (3, 0.03) if asked else (2, 0.01)
    )
    assert choices == [True, False] + [False] * 7 + [True] + [False] * 10
    arms = policy.arms[greedy]
    assert arms[True].rate == pytest.approx(100.0) and arms[False].rate == pytest.approx(200.0)
    # the same costs the other way round: asking pays, skipping is explored
    policy = LaterDrafterPolicy(explore_every=8)
    choices = _run_steps(
        policy, _request(), 10, context=greedy, outcome=lambda asked: (5, 0.03) if asked else (1, 0.02)
    )
    assert choices == [True, False] + [True] * 7 + [False]


def test_exploration_waits_double_while_confirmed_and_reset_when_the_choice_changes():
    policy = LaterDrafterPolicy(explore_every=2, max_explore_every=8)
    context = (False, True)
    policy.arms[context] = {
        True: ArmThroughput(tokens=1, seconds=1, steps=1),
        False: ArmThroughput(tokens=2, seconds=1, steps=1),
    }
    assert [policy.choose(context) for _ in range(6)] == [False, True, False, False, False, True]
    policy.arms[context][True] = ArmThroughput(tokens=3, seconds=1, steps=1)  # asking is faster now
    assert [policy.choose(context) for _ in range(3)] == [True, False, True]


def test_contexts_are_measured_apart_and_gaps_are_not_steps():
    policy = LaterDrafterPolicy(explore_every=4)
    sampled, greedy = (True, True), (False, True)
    _run_steps(
        policy, _request(sampled=True), 6, context=sampled, outcome=lambda asked: (1, 0.03) if asked else (1, 0.01)
    )
    assert set(policy.arms) == {sampled} and policy.arms[sampled][True].steps == 1
    # a new context starts afresh: asking first
    assert policy.choose(greedy) is True
    # a step 100 times longer than usual (the request waited) is left out
    request = _request()
    arm = policy.arms[sampled][False]
    before = arm.steps
    policy.started(request, 0.0, sampled, False)
    request.output_token_ids.append(5)
    policy.observe(request, 1.0)
    assert arm.steps == before
    policy.finish("r")
    policy.observe(request, 2.0)  # nothing pending for it: no record
    assert arm.steps == before


def test_adaptive_hybrid_greedy_equals_plain_and_skips_a_costly_head(tiny_checkpoints, tmp_path, plain):
    """A head that drafts garbage slowly: the hybrid stops asking it (exploring it now and then)
    and the output stays plain greedy."""
    target = str(tiny_checkpoints["gemma3"])
    eagle = {"method": "eagle3", "head": str(random_head(tmp_path / "h")), "top_k": 1}
    llm = hybrid_llm(target, [{"method": "ngram", "num_speculative_tokens": 4}, eagle])
    hybrid = llm.engine.speculator.drafter
    head = hybrid.children[1]
    asked = [0]
    head_propose = head.propose

    def slow_head(requests):
        asked[0] += len(requests)
        time.sleep(0.02)  # costs more than any token it could add on this tiny model
        return head_propose(requests)

    head.propose = slow_head
    outs = llm.generate(repetitive_prompts(), SamplingParams(max_tokens=30, **GREEDY))
    assert [o.outputs[0].token_ids for o in outs] == plain
    steps = sum(arm.steps for arms in hybrid.policy.arms.values() for arm in arms.values())
    assert steps > 20 and asked[0] < steps / 2


def test_draft_lengths_default_per_method(tiny_checkpoints, tmp_path):
    from quickdraft.drafters import default_registry

    registry = default_registry()
    assert registry.default_num_speculative_tokens("suffix") == 16
    assert registry.default_num_speculative_tokens("eagle3") == 5
    with pytest.raises(ValueError, match="unknown speculative method 'nope'"):
        registry.default_num_speculative_tokens("nope")
    target = str(tiny_checkpoints["gemma3"])
    suffix = LLM(target, max_model_len=256, speculative_config={"method": "suffix"}).engine.speculator
    assert suffix.config.num_speculative_tokens == 16 and suffix.drafter.num_speculative_tokens == 16
    chosen = LLM(target, max_model_len=256, speculative_config={"method": "suffix", "num_speculative_tokens": 7})
    assert chosen.engine.speculator.drafter.num_speculative_tokens == 7
    # A hybrid's children keep their own defaults within the hybrid's length, unless they set one.
    eagle = {"method": "eagle3", "head": str(random_head(tmp_path / "h")), "top_k": 1}
    config = {"method": "hybrid", "drafters": [{"method": "suffix"}, eagle]}
    hybrid = LLM(target, max_model_len=256, speculative_config=config).engine.speculator
    assert hybrid.config.num_speculative_tokens == 16
    assert [hybrid.drafter.children[0].num_speculative_tokens, hybrid.drafter.children[1].depth] == [16, 5]
    short = hybrid_llm(target, [{"method": "suffix"}, {**eagle, "num_speculative_tokens": 2}], num_speculative_tokens=4)
    assert [short.engine.speculator.drafter.children[0].num_speculative_tokens] == [4]
    assert short.engine.speculator.drafter.children[1].depth == 2
