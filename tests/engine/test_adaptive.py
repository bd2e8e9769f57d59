"""Adaptive speculation: the estimates, the cost fit, the choice of draft lengths, and the engine
keeping greedy output exact while it drafts less for garbage and more for good drafts."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import astuple

import pytest

from quickdraft import LLM, SamplingParams
from quickdraft.config import SpeculativeConfig
from quickdraft.drafters.base import Proposal
from quickdraft.engine.adaptive import (
    AcceptanceEstimate,
    DraftValue,
    ForwardTiming,
    PathCalibration,
    ProbeSchedule,
    StepCost,
    StepCostModel,
    _best_length,
    _DecayedFit,
    choose_draft_lengths,
    choose_drafting,
    expected_tokens,
    worth_probing,
)
from tests.engine.test_speculative import GREEDY, GarbageDrafter, OracleDrafter, repetitive_prompts

COSTS = StepCost(fixed=1.0, per_request=0.0, per_token=0.05, draft_per_request=0.0, draft_per_token=0.01)


@pytest.mark.parametrize(
    "rate, depth, tokens", [(0.5, 0, 1.0), (0.5, 1, 1.5), (0.5, 2, 1.75), (0.0, 4, 1.0), (1.0, 4, 5.0), (0.9, 3, 3.439)]
)
def test_expected_tokens_of_a_chain(rate, depth, tokens):
    assert expected_tokens(rate, depth) == pytest.approx(tokens)


def test_a_requests_best_length_is_what_trying_every_length_gives():
    """The early stop (past k = 1 a token pays only while rate^k beats its cost) finds what
    trying every length finds."""
    for rate in (0.0, 0.1, 0.35, 0.6, 0.8, 0.93, 0.99, 1.0):
        for throughput in (0.5, 2.0, 10.0, 40.0):
            for per_token, per_request in ((0.001, 0.0), (0.01, 0.02), (0.03, 0.0), (0.2, 0.1)):
                gains = [0.0] + [
                    expected_tokens(rate, k) - 1.0 - throughput * (per_token * k + per_request) for k in range(1, 9)
                ]
                assert gains[_best_length(rate, 8, throughput, per_token, per_request)] == pytest.approx(max(gains))


def test_good_drafts_get_long_chains_and_garbage_none():
    assert choose_draft_lengths(rates=[0.95], max_lengths=[8], cost=COSTS) == [8]
    assert choose_draft_lengths(rates=[0.02], max_lengths=[8], cost=COSTS) == [0]
    assert choose_draft_lengths(rates=[0.95, 0.02], max_lengths=[8, 8], cost=COSTS) == [8, 0]
    assert choose_draft_lengths(rates=[0.9], max_lengths=[3], cost=COSTS) == [3]  # capped


def test_busier_batches_draft_less():
    """The same acceptance with more requests: each verified token is a larger share of the step."""
    lengths = [
        choose_draft_lengths(rates=[0.6] * batch, max_lengths=[8] * batch, cost=COSTS)[0] for batch in (1, 4, 16, 32)
    ]
    assert lengths == sorted(lengths, reverse=True) and lengths[0] > lengths[-1]
    costly = StepCost(fixed=1.0, per_request=0.0, per_token=0.5, draft_per_request=0.0, draft_per_token=0.1)
    assert choose_draft_lengths(rates=[0.6] * 32, max_lengths=[8] * 32, cost=costly) == [0] * 32


def test_choice_beats_every_uniform_length():
    rates = [0.3, 0.7, 0.9]
    cost = StepCost(fixed=1.0, per_request=0.2, per_token=0.1, draft_per_request=0.05, draft_per_token=0.02)

    def throughput(lengths):
        seconds = (
            1.0
            + 0.2 * 3
            + 0.1 * sum(1 + k for k in lengths)
            + 0.05 * sum(1 for k in lengths if k)
            + 0.02 * sum(lengths)
        )
        return sum(expected_tokens(a, k) for a, k in zip(rates, lengths)) / seconds

    assert cost.seconds([0, 2, 5]) == pytest.approx(1.0 + 0.6 + 0.1 * 10 + 0.05 * 2 + 0.02 * 7)
    chosen = choose_draft_lengths(rates=rates, max_lengths=[8] * 3, cost=cost)
    assert all(throughput(chosen) >= throughput([k] * 3) for k in range(9))


def test_path_calibration_learns_how_often_a_path_of_a_probability_is_accepted():
    """Before any data a path of probability p is taken at its word; an underconfident drafter
    (eagle3's shipped head: nodes it gave 0.3-0.4 were accepted 48% of the time) earns a lower
    floor, an overconfident one a higher floor, and the floor never lets in a bin below one
    that fails (bins are read from the top down)."""
    calibration = PathCalibration()
    assert calibration.path_floor(0.5) == pytest.approx(0.5)  # bins from 0.5 up: centers >= 0.55
    assert calibration.path_floor(0.99) == pytest.approx(0.99)  # not even the top bin: the drafter's word
    under = PathCalibration()
    for b in range(2, 10):  # accepted 0.25 more often than the path's probability says
        for i in range(40):
            under.record(path_prob=(b + 0.5) / 10, accepted=i < 40 * min(1.0, (b + 0.5) / 10 + 0.25))
    assert under.path_floor(0.5) == pytest.approx(0.3)
    over = PathCalibration()
    for b in range(10):
        for i in range(40):
            over.record(path_prob=(b + 0.5) / 10, accepted=i < 40 * (b + 0.5) / 10 / 2)
    assert over.path_floor(0.4) == pytest.approx(0.7)
    holed = PathCalibration(prior_weight=0.0)
    for b, rate in enumerate([0.0, 0.0, 0.9, 0.1, 0.9, 0.9, 0.9, 0.9, 0.9, 1.0]):
        for i in range(10):
            holed.record(path_prob=(b + 0.5) / 10, accepted=i < 10 * rate)
    assert holed.path_floor(0.5) == pytest.approx(0.4)  # 0.2-0.3 passes, but 0.3-0.4 below it fails


def test_drafting_is_chosen_from_what_drafts_brought():
    """A drafter that sizes its own drafts: a request drafts where its drafts' accepted tokens
    pay for their verified nodes and drafting at the step's throughput; a busy step drafts only
    the requests whose drafts bring most; a request not allowed to draft never does."""
    cost = StepCost(fixed=0.008, per_request=0.0003, per_token=0.0008, draft_per_request=0.0018, draft_per_token=0.0002)
    good, poor = (3.3, 4.5), (0.4, 2.0)
    drafting, throughput = choose_drafting(values=[good, poor, good], allowed=[True, True, False], cost=cost)
    assert drafting == [True, False, False]
    plain = 3 / (0.008 + 3 * 0.0011)
    assert throughput > plain
    busy = StepCost(fixed=0.008, per_request=0.0003, per_token=0.0012, draft_per_request=0.0018, draft_per_token=0.0015)
    assert choose_drafting(values=[good] * 32, allowed=[True] * 32, cost=busy)[0] == [False] * 32
    value = DraftValue(prior=(1.0, 2.0))
    assert value.per_draft == (1.0, 2.0)
    for _ in range(20):
        value.record(num_nodes=5, num_accepted=4)
    weight = sum(0.85**i for i in range(20))  # the decayed drafts, beside the prior's 2
    assert value.per_draft == pytest.approx(((4 * weight + 2) / (weight + 2), (5 * weight + 4) / (weight + 2)))
    for _ in range(300):
        value.idle()
    assert value.per_draft == pytest.approx((1.0, 2.0), rel=0.01)  # drifts back to the prior: tried again


def test_acceptance_estimate_follows_recent_drafts():
    estimate = AcceptanceEstimate(prior=0.5)
    assert estimate.rate == pytest.approx(0.5)
    for _ in range(20):
        estimate.record(drafted_depth=4, num_accepted=4)
    assert estimate.rate > 0.9
    for _ in range(20):
        estimate.record(drafted_depth=4, num_accepted=0)
    assert estimate.rate < 0.25
    low = estimate.rate
    for _ in range(200):
        estimate.idle()
    assert low < estimate.rate == pytest.approx(0.5, abs=0.01)  # drifts back: it gets tried again


def test_cost_fit_recovers_the_step_costs_and_falls_back_to_the_prior_split():
    fit = _DecayedFit(decay=1.0, num_features=3)
    for requests, tokens in ((1, 1), (1, 5), (4, 4), (4, 20), (16, 16), (16, 70), (32, 32), (32, 150)):
        fit.add((1.0, float(requests), float(tokens)), 0.038 + 0.0044 * requests + 0.0063 * tokens)
    assert fit.solve(prior=(1.0, 0.05, 0.05)) == pytest.approx((0.038, 0.0044, 0.0063), rel=1e-2)
    plain = _DecayedFit(decay=1.0, num_features=3)
    for requests in (1, 4, 16, 32):  # plain decoding: one token per request, the two costs move together
        plain.add((1.0, float(requests), float(requests)), 0.04 + 0.01 * requests)
    fixed, per_request, per_token = plain.solve(prior=(1.0, 0.05, 0.05))
    assert fixed == pytest.approx(0.04, rel=0.02) and per_request + per_token == pytest.approx(0.01, rel=0.02)
    assert per_request == pytest.approx(per_token, rel=0.02)  # the prior's split
    assert _DecayedFit(decay=1.0, num_features=2).solve(prior=(1.0, 0.05)) is None
    model = StepCostModel()
    assert model.cost() == StepCost(
        fixed=1.0,
        per_request=0.05,
        per_token=0.05,
        draft_per_request=0.0,
        draft_per_token=pytest.approx(0.011),
        draft_per_catch_up_row=pytest.approx(0.011),
    )
    model.observe_step(forward=ForwardTiming(2, 2, 0.5))
    assert model.cost().seconds([0, 0]) == pytest.approx(0.5)


def test_cost_fit_holds_a_coefficient_at_its_floor_and_fits_the_others():
    """Where the free least squares goes negative (sampled steps with logprobs: a verified token
    costs more than a request, whose coefficient the data puts slightly below 0), the fit is the
    best one with that coefficient at its floor.  Falling back to the prior's direction instead
    priced a verified token at half its cost, and adaptive suffix drafted on in GRPO-like
    rollouts at 0.81x plain (benchmarks/rl_rollouts.py)."""
    fit = _DecayedFit(decay=1.0, num_features=3)
    steps = ((16, 16), (16, 40), (16, 60), (12, 12), (12, 30), (8, 8), (8, 24), (4, 4), (4, 20))
    for requests, tokens in steps:
        fit.add((1.0, float(requests), float(tokens)), 0.010 - 0.0002 * requests + 0.0025 * tokens)
    fixed, per_request, per_token = fit.solve(prior=(1.0, 0.05, 0.05))
    assert per_token == pytest.approx(0.0025, rel=0.05)
    assert 0.0 < per_request < 0.0005  # at its floor: a tenth of the prior's share
    for requests, tokens in steps:
        truth = 0.010 - 0.0002 * requests + 0.0025 * tokens
        assert fixed + per_request * requests + per_token * tokens == pytest.approx(truth, rel=0.1)


def test_the_drafting_fit_prices_catch_up_rows_apart_from_the_drafts():
    """A head's first draft of a request first feeds the request's whole prompt (its features):
    fitted as a cost per drafting request, such steps priced every request's draft at several
    ms, and adaptive eagle3 decoded plainly in 39% of its steps at one client, 1.75x off where
    always-on was 2.45x.  The rows are a regressor of their own."""
    model = StepCostModel()
    for requests in (1, 4, 8, 16):
        model.observe_step(forward=ForwardTiming(requests, requests, 0.01 + 0.001 * requests))
    model.observe_step(num_drafted_requests=1, num_draft_tokens=1, draft_seconds=0.020)  # the first call: not fed
    for i in range(48):
        requests, tokens = 1 + i % 2, 2 + 2 * (i % 4)
        rows = 300 if i % 6 == 0 else 3 * requests  # a prompt caught up, else the last step's tokens
        seconds = 0.001 * requests + 0.0002 * tokens + 0.00005 * rows
        model.observe_step(
            num_drafted_requests=requests, num_draft_tokens=tokens, num_catch_up_rows=rows, draft_seconds=seconds
        )
    cost = model.cost()
    assert (cost.draft_per_request, cost.draft_per_token) == pytest.approx((0.001, 0.0002), rel=0.05)
    assert cost.draft_per_catch_up_row == pytest.approx(0.00005, rel=0.05)
    assert cost.seconds([4]) - cost.seconds([0]) == pytest.approx(0.001 + 4 * (0.0002 + cost.per_token), rel=0.01)
    assert cost.draft_start(300) == pytest.approx(0.001 + 300 * 0.00005, rel=0.05)  # what a probe pays first


def test_the_forward_of_the_drafters_first_call_is_not_fed_either():
    """At one request every plain step is one row wide, so the first verification of drafts is
    the only forward that prices a verified token.  A fresh eagle3 speculator's first one took
    46-52 ms in the server (first-call costs) against ~11: fed to the fit, it priced a verified
    token at 3.5 ms instead of ~0.6, no draft or probe paid, and a request decoded plainly to
    its end (127 plain steps of 127)."""
    model = StepCostModel()
    for _ in range(20):  # batch 1, plain: one row a step
        model.observe_step(forward=ForwardTiming(1, 1, 0.010))
    before = model.cost()
    drafting = dict(num_drafted_requests=1, num_draft_tokens=4, draft_seconds=0.003)
    model.observe_step(**drafting, forward=ForwardTiming(1, 5, 0.050))  # the drafter's first call
    assert model.cost() == before  # neither half of the warm-up step is fed
    for _ in range(3):
        model.observe_step(**drafting, forward=ForwardTiming(1, 5, 0.012))
        model.observe_step(forward=ForwardTiming(1, 1, 0.010))
    cost = model.cost()
    assert cost.seconds([4]) - cost.draft_per_request - 4 * cost.draft_per_token == pytest.approx(0.012, rel=0.05)
    assert cost.seconds([0]) == pytest.approx(0.010, rel=0.05)
    assert cost.per_token < 0.001  # with the warm-up forward fed: ~0.01


def test_the_drafters_catch_up_rows_reach_the_drafting_fit(tiny_checkpoints, plain):
    """What Drafter.catch_up_rows says of this step's drafting requests is what the fit hears."""

    class CatchingUp(OracleDrafter):
        def catch_up_rows(self, request):
            return 5

    continuations = {tuple(p): out for p, out in zip(repetitive_prompts(), plain)}
    llm = _adaptive_llm(tiny_checkpoints, CatchingUp(continuations=continuations, corrupt=0.0))
    heard = []
    model = llm.engine.speculator.step_costs
    observe = model.observe_step
    model.observe_step = lambda **kw: (heard.append(kw), observe(**kw))[1]
    outs = llm.generate(repetitive_prompts(), SamplingParams(max_tokens=30, **GREEDY))
    assert [o.outputs[0].token_ids for o in outs] == [p[:30] for p in plain]
    drafting = [kw for kw in heard if kw["num_drafted_requests"]]
    assert drafting and all(kw["num_catch_up_rows"] == 5 * kw["num_drafted_requests"] for kw in drafting)
    assert all(kw.get("num_catch_up_rows", 0) == 0 for kw in heard if not kw["num_drafted_requests"])


def test_the_drafting_fit_skips_the_drafters_first_call_and_forgets_data_that_aged_away():
    """A drafter's first call costs what later ones do not (caches allocated, memory first
    touched).  Fed to the fit, one such observation priced every drafted token at 20 ms, so no
    draft or probe paid again and nothing could correct it; and a fit whose data has aged away
    gives way to the prior, so that a probe can measure the drafter afresh."""
    model = StepCostModel()
    for requests in (1, 4, 8, 16):
        model.observe_step(forward=ForwardTiming(requests, requests, 0.01 + 0.001 * requests))
    prior = model.cost()
    assert prior.draft_per_token == pytest.approx(0.01 * prior.seconds([0]))  # 1% of a one-token step
    model.observe_step(num_drafted_requests=1, num_draft_tokens=1, draft_seconds=0.020)  # the first call: not fed
    assert model.cost() == prior
    for requests, tokens in ((1, 2), (2, 6), (4, 8), (3, 12)) * 3:
        model.observe_step(
            num_drafted_requests=requests, num_draft_tokens=tokens, draft_seconds=0.001 * requests + 0.0002 * tokens
        )
    fitted = model.cost()
    assert (fitted.draft_per_request, fitted.draft_per_token) == pytest.approx((0.001, 0.0002), rel=0.05)
    for _ in range(100):  # steps without drafts: the data ages, the fit stays while it is recent
        model.observe_step()
    assert astuple(model.cost()) == pytest.approx(astuple(fitted))
    for _ in range(300):
        model.observe_step()
    assert model.cost() == prior
    model.observe_step(num_drafted_requests=2, num_draft_tokens=4, draft_seconds=0.004)  # fresh data counts at once
    assert model.cost() != prior


def test_at_most_two_requests_probe_in_a_step():
    """Requests fall due for a probe together (a batch that stopped drafting); a probe of a head
    first feeds each request's pending features, so 22 probing at once made a 113 ms drafting
    phase beside a 60 ms step.  Two a step, the others kept due for the next."""
    from types import SimpleNamespace

    from quickdraft.engine.speculation import Speculator
    from quickdraft.outputs import RequestMetrics

    config = SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 6, "adaptive": True, "adaptive_probe_every": 3}
    )
    speculator = Speculator(config=config, drafter=GarbageDrafter(vocab_size=320, tree=False), max_tree_nodes=64)
    speculator._all_acceptance = AcceptanceEstimate(prior=0.05, prior_weight=1e6)  # drafts do not pay...
    speculator.step_costs.cost = lambda: COSTS  # ...but probes, accepted at PROBE_RATE, would
    requests = [
        SimpleNamespace(
            request_id=f"r{i}",
            prompt_token_ids=[1, 2, 3],
            output_token_ids=[4],
            params=SamplingParams(),
            slot=i,
            seed=0,
            grammar=None,
            metrics=RequestMetrics(arrival_time=0.0),
        )
        for i in range(8)
    ]
    limits = {r.request_id: (63, 6) for r in requests}
    probing = []
    for _ in range(10):
        chosen, _ = speculator._adaptive_limits(requests, limits)
        probing.append(sorted(rid for rid, (k, _) in chosen.items() if k > 0))
    assert probing[:3] == [[], [], []]
    assert probing[3:7] == [["r0", "r1"], ["r2", "r3"], ["r4", "r5"], ["r6", "r7"]]
    assert probing[7] == ["r0", "r1"]  # their 3 plain steps since


def test_adaptive_config_is_validated():
    assert SpeculativeConfig.from_dict({"method": "ngram", "adaptive": True}).adaptive
    with pytest.raises(ValueError, match="adaptive must be true or false"):
        SpeculativeConfig.from_dict({"method": "ngram", "adaptive": "yes"})
    with pytest.raises(ValueError, match="choose one"):
        SpeculativeConfig.from_dict({"method": "ngram", "adaptive": True, "dynamic_draft_length": True})
    with pytest.raises(ValueError, match="adaptive_prior"):
        SpeculativeConfig.from_dict({"method": "ngram", "adaptive": True, "adaptive_prior": 1.5})
    with pytest.raises(ValueError, match="adaptive_probe_every"):
        SpeculativeConfig.from_dict({"method": "ngram", "adaptive": True, "adaptive_probe_every": 0})
    for limit in (1, 2.5, True):
        with pytest.raises(ValueError, match="disable_by_batch_size must be an integer >= 2"):
            SpeculativeConfig.from_dict({"method": "ngram", "disable_by_batch_size": limit})


def test_steps_draft_only_while_fewer_than_disable_by_batch_size_run(tiny_checkpoints, plain):
    llm = LLM(
        str(tiny_checkpoints["gemma3"]),
        max_model_len=256,
        max_num_seqs=4,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 2},
    )
    prompts = repetitive_prompts()[:2]
    outs = llm.generate(prompts, [SamplingParams(max_tokens=12, **GREEDY), SamplingParams(max_tokens=60, **GREEDY)])
    assert [o.outputs[0].token_ids for o in outs] == [plain[0][:12], plain[1]]
    assert outs[0].metrics.num_drafts == 0  # it ran beside the other all along
    assert outs[1].metrics.num_drafts > 0  # alone once the first finished
    assert llm.engine.scheduler.draft_reserve > 0  # one running: drafts get their room again
    alone = llm.generate(prompts[0], SamplingParams(max_tokens=60, **GREEDY))[0]
    assert alone.outputs[0].token_ids == plain[0] and alone.metrics.num_drafts > 0


def _adaptive_llm(tiny_checkpoints, drafter) -> LLM:
    llm = LLM(
        str(tiny_checkpoints["gemma3"]),
        max_model_len=256,
        max_num_seqs=4,
        speculative_config={"method": "ngram", "num_speculative_tokens": 6, "adaptive": True},
    )
    llm.engine.speculator.drafter = drafter
    return llm


@pytest.fixture(scope="module")
def plain(tiny_checkpoints):
    llm = LLM(str(tiny_checkpoints["gemma3"]), max_model_len=256, max_num_seqs=4)
    return [o.outputs[0].token_ids for o in llm.generate(repetitive_prompts(), SamplingParams(max_tokens=60, **GREEDY))]


def test_garbage_drafts_fade_out_and_output_stays_exact(tiny_checkpoints, plain):
    llm = _adaptive_llm(tiny_checkpoints, GarbageDrafter(vocab_size=320, tree=False))
    outs = llm.generate(repetitive_prompts(), SamplingParams(max_tokens=60, **GREEDY))
    assert [o.outputs[0].token_ids for o in outs] == plain
    choices = llm.get_metrics().draft_length_choices
    assert sum(choices) > 100 and choices[0] > 0.6 * sum(choices)  # mostly plain decoding (and probes)
    assert max(k for k, count in enumerate(choices) if count) <= 2 or choices[0] > 0.8 * sum(choices)


def test_good_drafts_keep_long_chains_and_output_stays_exact(tiny_checkpoints, plain):
    continuations = {tuple(p): out for p, out in zip(repetitive_prompts(), plain)}
    llm = _adaptive_llm(tiny_checkpoints, OracleDrafter(continuations=continuations, corrupt=0.02))
    # costs fixed: the choice is what is tested (timings measured beside a parallel test run drift)
    llm.engine.speculator.step_costs.cost = lambda: COSTS
    outs = llm.generate(repetitive_prompts(), SamplingParams(max_tokens=60, **GREEDY))
    assert [o.outputs[0].token_ids for o in outs] == plain
    choices = llm.get_metrics().draft_length_choices
    long = sum(choices[4:])
    assert long > 0.5 * sum(choices) and all(o.metrics.acceptance_length > 3 for o in outs)
    assert llm.engine.cache.num_free_slots == 4


def test_probes_back_off_after_misses_and_skip_drafters_that_cannot_pay():
    schedule = ProbeSchedule(every=4)
    for _ in range(3):
        schedule.step(drafted=False)
    assert not schedule.due
    schedule.step(drafted=False)
    assert schedule.due
    schedule.step(drafted=True, probe=True)
    schedule.result(num_accepted=0)
    for _ in range(7):
        schedule.step(drafted=False)
    assert not schedule.due  # one missed probe: twice as long
    schedule.step(drafted=False)
    assert schedule.due
    schedule.result(num_accepted=2)
    assert schedule.due  # an accept resets the back-off
    # A request's own drafts that miss (not probes) leave the schedule alone: its estimate
    # weighs them, and a backed-off first probe came 64 plain steps after a few early misses.
    for _ in range(3):
        schedule.step(drafted=True)
        schedule.result(num_accepted=0)
    for _ in range(4):
        schedule.step(drafted=False)
    assert schedule.due and schedule.misses == 0
    cheap = StepCost(fixed=0.04, per_request=0.004, per_token=0.006, draft_per_request=0.0005, draft_per_token=0.0001)
    costly = StepCost(fixed=0.04, per_request=0.004, per_token=0.006, draft_per_request=0.02, draft_per_token=0.003)
    assert worth_probing(cost=cheap, throughput=90.0, max_length=5)
    assert not worth_probing(cost=costly, throughput=90.0, max_length=5)  # even 0.9 acceptance would not pay
    # a head that owes many rows (a long plain stretch): catching up is most of what a probe costs
    owing = dataclasses.replace(cheap, draft_per_catch_up_row=0.0005)
    assert worth_probing(cost=owing, throughput=90.0, max_length=5, catch_up_rows=2)
    assert not worth_probing(cost=owing, throughput=90.0, max_length=5, catch_up_rows=64)


class PathScoringOracle(OracleDrafter):
    """An oracle that may say it scores its paths: records what adaptive speculation offers it
    and drafts the known continuation to the deepest it may (sure paths pass any floor)."""

    def __init__(self, *, scores_paths: bool, **options):
        super().__init__(**options)
        self.scores_paths = scores_paths
        self.offers: list[tuple[int, int, float]] = []  # (max_depth, extend_depth, min_path_prob)

    def propose(self, requests):
        self.offers += [(r.max_depth, r.extend_depth, r.min_path_prob) for r in requests]
        proposals = []
        for req in requests:
            future = self.continuations[tuple(req.prompt_token_ids)][len(req.output_token_ids) :]
            draft = future[: min(req.budget, req.depth_limit)]
            if not draft:
                proposals.append(None)
                continue
            proposal = Proposal.chain(req.token_ids[-1], draft)
            if self.scores_paths:  # it says 0.45 for every path, and is always right
                proposal.path_log_probs = [0.0] + [math.log(0.45)] * len(draft)
            proposals.append(proposal)
        return proposals


@pytest.mark.parametrize("scores_paths", [False, True])
def test_drafters_that_score_paths_may_extend_them_past_the_chosen_length(tiny_checkpoints, plain, scores_paths):
    """A drafting request of a drafter that scores its paths is offered an extension past the
    chain model's length (to its limits) for paths at least as probable as the step's
    break-even; other drafters are held to the length.  Greedy output stays exact."""
    continuations = {tuple(p): out for p, out in zip(repetitive_prompts(), plain)}
    drafter = PathScoringOracle(continuations=continuations, corrupt=0.0, scores_paths=scores_paths)
    llm = _adaptive_llm(tiny_checkpoints, drafter)
    outs = llm.generate(repetitive_prompts(), SamplingParams(max_tokens=60, **GREEDY))
    assert [o.outputs[0].token_ids for o in outs] == plain
    extended = [offer for offer in drafter.offers if offer[1] > 0]
    if not scores_paths:
        assert not extended and all(p == 0.0 for _, _, p in drafter.offers)
        return
    assert len(extended) > 0.5 * len(drafter.offers)
    for max_depth, extend_depth, min_path_prob in extended:
        assert 1 <= max_depth <= extend_depth <= 6 and 0.0 < min_path_prob < 1.0
    calibration = llm.engine.speculator._path_calibration  # its paths' acceptance, learned
    assert sum(calibration.nodes) > 20 and calibration.acceptance(4) > 0.9


@pytest.mark.parametrize("adaptive", [False, True])
def test_the_draft_reserve_follows_what_adaptive_decodes_draft(adaptive):
    """The scheduler holds back draft_reserve tokens of prefill per decode: the bound without
    adaptive speculation; under it, the drafted tokens per decode of the last steps, rounded up,
    from none (decodes that stopped drafting give prefill its whole budget back)."""
    from quickdraft.engine.speculation import Speculator

    config = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 6, "adaptive": adaptive})
    speculator = Speculator(config=config, drafter=GarbageDrafter(vocab_size=320, tree=False), max_tree_nodes=64)
    assert speculator.draft_reserve == (0 if adaptive else 6)  # adaptive: nothing drafted yet

    def steps(count: int, *, drafted_per_request: int, num_decodes: int = 4, num_prefills: int = 0) -> int:
        for _ in range(count):
            speculator.observe_step(
                num_requests=num_decodes + num_prefills,
                num_tokens=num_decodes * (1 + drafted_per_request) + 100 * num_prefills,
                forward_seconds=0.02,
                decode_only=num_prefills == 0,
                num_decodes=num_decodes,
                num_drafted_requests=num_decodes if drafted_per_request else 0,
                num_draft_tokens=num_decodes * drafted_per_request,
                draft_seconds=0.002,
            )
        return speculator.draft_reserve

    assert steps(60, drafted_per_request=0) == (0 if adaptive else 6)
    assert steps(60, drafted_per_request=3) == (3 if adaptive else 6)
    assert steps(60, drafted_per_request=0, num_decodes=0, num_prefills=2) == (3 if adaptive else 6)  # no decodes
    # decodes beside prefill chunks that draft less give prefill its budget back too; drafting
    # more there (the room may have cut it) does not raise the reserve, decodes alone do
    assert steps(60, drafted_per_request=1, num_decodes=3, num_prefills=1) == (1 if adaptive else 6)
    assert steps(60, drafted_per_request=4, num_decodes=3, num_prefills=1) == (1 if adaptive else 6)
    assert steps(60, drafted_per_request=4) == (4 if adaptive else 6)
    assert steps(60, drafted_per_request=0, num_decodes=3, num_prefills=1) == (0 if adaptive else 6)
