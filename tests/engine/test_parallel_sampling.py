"""n completions of one prompt (SamplingParams.n): children seeded seed + i, merged outputs."""

from __future__ import annotations

import pytest

from quickdraft import LLM, SamplingParams
from quickdraft.engine.parallel_sampling import (
    best_outputs,
    child_params,
    child_request_ids,
    merged_batch_output,
    merged_metrics,
    merged_output,
)
from quickdraft.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprobs
from tests.engine.test_speculative import GREEDY, repetitive_prompts
from tests.stats_checks import same_distribution_p_value

SAMPLED = dict(temperature=1.0, top_k=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_checkpoints):
    return LLM(str(tiny_checkpoints["gemma3"]), max_model_len=128, max_num_seqs=4)


def test_children_get_one_completion_each_seeded_from_the_request():
    params = SamplingParams(n=3, seed=10, temperature=0.5, max_tokens=4)
    children = child_params(params, seed=10)
    assert [(c.n, c.seed, c.temperature, c.max_tokens) for c in children] == [
        (1, 10, 0.5, 4),
        (1, 11, 0.5, 4),
        (1, 12, 0.5, 4),
    ]
    assert child_params(SamplingParams(seed=None), seed=None) == [SamplingParams(seed=None)]  # n = 1 unchanged
    with pytest.raises(ValueError, match="several completions need the request's seed"):
        child_params(params, seed=None)
    assert child_request_ids("7", 1) == ["7"]
    assert child_request_ids("7", 3) == ["7-0", "7-1", "7-2"]


def test_merged_metrics_sum_counts_and_span_times():
    first = RequestMetrics(arrival_time=1.0, first_token_time=2.0, finished_time=5.0, num_prompt_tokens=9)
    first.num_cached_tokens, first.num_generation_tokens, first.num_target_forwards = 0, 6, 3
    first.num_drafts, first.num_draft_tokens, first.num_accepted_tokens = 2, 8, 4
    first.accepted_per_position, first.drafted_per_position = [2, 2], [2, 2, 2, 2]
    first.draft_seconds, first.verify_seconds, first.draft_length_choices = 0.5, 1.0, [1, 0, 2]
    second = RequestMetrics(arrival_time=1.5, first_token_time=1.8, finished_time=6.0, num_prompt_tokens=9)
    second.num_cached_tokens, second.num_generation_tokens, second.num_target_forwards = 8, 6, 6
    second.num_drafts, second.num_draft_tokens, second.num_accepted_tokens = 1, 3, 0
    second.accepted_per_position, second.drafted_per_position = [], [1, 1, 1]
    second.draft_seconds, second.verify_seconds, second.draft_length_choices = 0.7, 0.9, [5]
    second.num_preemptions = 1
    merged = merged_metrics([first, second])
    assert (merged.arrival_time, merged.first_token_time, merged.finished_time) == (1.0, 1.8, 6.0)
    assert (merged.num_prompt_tokens, merged.num_cached_tokens, merged.num_preemptions) == (9, 0, 1)
    assert (merged.num_generation_tokens, merged.num_target_forwards, merged.acceptance_length) == (12, 9, 12 / 9)
    assert (merged.num_drafts, merged.num_draft_tokens, merged.num_accepted_tokens) == (3, 11, 4)
    assert merged.accepted_per_position == [2, 2]
    assert merged.drafted_per_position == [3, 3, 3, 2]
    assert merged.draft_length_choices == [6, 0, 2]
    assert (merged.draft_seconds, merged.verify_seconds) == (0.7, 1.0)
    second.finished_time = None  # a child still running: the request has not finished
    assert merged_metrics([first, second]).finished_time is None


def test_merged_output_indexes_the_completions():
    def output(request_id: str, tokens: list[int]) -> RequestOutput:
        completion = CompletionOutput(index=0, text="t", token_ids=tokens, finish_reason="length")
        metrics = RequestMetrics(arrival_time=0.0, num_generation_tokens=len(tokens))
        return RequestOutput(request_id, "p", [1, 2], [completion], finished=True, metrics=metrics, seed=3)

    lone = output("5", [7])
    assert merged_output("5", [lone], seed=3) is lone
    merged = merged_output("5", [output("5-0", [7]), output("5-1", [8, 9])], seed=3)
    assert merged.request_id == "5" and merged.seed == 3 and merged.prompt_token_ids == [1, 2]
    assert [(c.index, c.token_ids) for c in merged.outputs] == [(0, [7]), (1, [8, 9])]
    assert merged.metrics.num_generation_tokens == 3


def ranked(request_id: str, tokens: list[int], cumulative: float | None) -> RequestOutput:
    mean = None if cumulative is None else cumulative / max(1, len(tokens))
    logprobs = None if mean is None else [TokenLogprobs(token_id=token, logprob=mean) for token in tokens]
    completion = CompletionOutput(0, "t", tokens, "length", logprobs=logprobs, cumulative_logprob=cumulative)
    metrics = RequestMetrics(arrival_time=0.0, num_generation_tokens=len(tokens))
    return RequestOutput(request_id, "p", [1], [completion], finished=True, metrics=metrics, seed=3)


def test_best_of_keeps_the_highest_mean_logprob_per_token():
    # mean logprobs: -1.0, -0.5 (the shortest sum is not the best mean), -0.5 (a tie: the earlier child
    # first), an empty completion counts its sum (0.0: nothing generated costs nothing)
    children = [ranked("0", [1, 2], -2.0), ranked("1", [3, 4, 5, 6], -2.0), ranked("2", [7, 8], -1.0)]
    assert [o.request_id for o in best_outputs(children, n=2, keep_logprobs=True)] == ["1", "2"]
    assert [o.request_id for o in best_outputs(children, n=3, keep_logprobs=True)] == ["0", "1", "2"]  # all: as sampled
    dropped = best_outputs(children, n=1, keep_logprobs=False)[0].outputs[0]
    assert dropped.logprobs is None and dropped.cumulative_logprob == -2.0
    assert children[1].outputs[0].logprobs is not None  # the child's own output is untouched
    empty = ranked("3", [], 0.0)
    assert best_outputs([*children, empty], n=1, keep_logprobs=True)[0] is empty
    with pytest.raises(ValueError, match="ranks completions by their logprobs"):
        best_outputs([ranked("4", [1], None), ranked("5", [2], -1.0)], n=1, keep_logprobs=True)
    merged = merged_batch_output(
        "9", [*children, ranked("a", [9], -3.0), ranked("b", [9], -0.1), ranked("c", [9], -9.0)], n=1, seed=3, samples=3
    )
    assert [(c.index, c.token_ids) for c in merged.outputs] == [(0, [3, 4, 5, 6]), (1, [9])]
    assert merged.outputs[1].cumulative_logprob == -0.1


def test_best_of_children_compute_the_logprobs_that_rank_them():
    params = SamplingParams(n=1, best_of=3, seed=5, temperature=0.8)
    assert [(c.n, c.best_of, c.seed, c.logprobs) for c in child_params(params, seed=5)] == [
        (1, None, 5, 0),
        (1, None, 6, 0),
        (1, None, 7, 0),
    ]
    asked = SamplingParams(n=2, best_of=2, seed=5, temperature=0.8)  # best_of = n: nothing to rank
    assert [c.logprobs for c in child_params(asked, seed=5)] == [None, None]
    assert [c.logprobs for c in child_params(SamplingParams(best_of=2, logprobs=3), seed=1)] == [3, 3]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"n": 3, "best_of": 2}, r"best_of must be >= n \(3\)"),
        ({"best_of": 0}, "best_of must be >= 1"),
        ({"best_of": 2, "temperature": 0.0}, "needs sampling"),
        ({"best_of": 1.5}, "best_of must be an int"),
    ],
)
def test_bad_best_of_is_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields)


def test_best_of_returns_the_best_of_the_completions_it_sampled(llm):
    prompt = repetitive_prompts()[1]
    sampled = llm.generate(prompt, SamplingParams(n=4, seed=70, logprobs=0, max_tokens=8, **SAMPLED))[0]
    means = [c.cumulative_logprob / len(c.token_ids) for c in sampled.outputs]
    order = sorted(range(4), key=lambda i: means[i], reverse=True)
    best = llm.generate(prompt, SamplingParams(n=2, best_of=4, seed=70, max_tokens=8, **SAMPLED))[0]
    assert [c.token_ids for c in best.outputs] == [sampled.outputs[i].token_ids for i in order[:2]]
    assert [c.index for c in best.outputs] == [0, 1] and best.seed == 70
    assert all(c.logprobs is None and c.cumulative_logprob is not None for c in best.outputs)
    assert best.metrics.num_generation_tokens == 32  # all four were decoded
    with pytest.raises(ValueError, match="cannot be streamed"):
        next(llm.stream(prompt, SamplingParams(best_of=2, seed=1, **SAMPLED)))
    assert not llm.engine.has_unfinished_requests() and not llm.engine._requests


def test_completion_i_is_the_request_seeded_seed_plus_i(llm):
    prompts = repetitive_prompts()[:2]
    outputs = llm.generate(prompts, SamplingParams(n=3, seed=40, max_tokens=8, **SAMPLED))
    for prompt, output in zip(prompts, outputs):
        assert output.seed == 40 and [c.index for c in output.outputs] == [0, 1, 2]
        alone = llm.generate([prompt] * 3, [SamplingParams(seed=40 + i, max_tokens=8, **SAMPLED) for i in range(3)])
        assert [c.token_ids for c in output.outputs] == [a.outputs[0].token_ids for a in alone]
        assert len({tuple(c.token_ids) for c in output.outputs}) > 1  # independent draws, not copies
        assert output.metrics.num_generation_tokens == 24
    assert not llm.engine.has_unfinished_requests() and not llm.engine._requests


def test_unseeded_n_returns_the_seed_that_replays_every_completion(llm):
    prompt = repetitive_prompts()[1]
    first = llm.generate(prompt, SamplingParams(n=2, max_tokens=6, **SAMPLED))[0]
    replay = llm.generate(prompt, SamplingParams(n=2, seed=first.seed, max_tokens=6, **SAMPLED))[0]
    assert [c.token_ids for c in replay.outputs] == [c.token_ids for c in first.outputs]


def test_greedy_n_gives_n_copies_of_the_greedy_answer(llm):
    prompt = repetitive_prompts()[0]
    alone = llm.generate(prompt, SamplingParams(max_tokens=8, **GREEDY))[0].outputs[0].token_ids
    output = llm.generate(prompt, SamplingParams(n=3, max_tokens=8, **GREEDY))[0]
    assert [c.token_ids for c in output.outputs] == [alone] * 3


def test_speculation_keeps_every_completion(tiny_checkpoints, llm):
    spec = LLM(
        str(tiny_checkpoints["gemma3"]), max_model_len=128, max_num_seqs=4, speculative_config={"method": "suffix"}
    )
    params = SamplingParams(n=4, seed=3, max_tokens=16, **SAMPLED)
    prompts = repetitive_prompts()
    plain, drafted = llm.generate(prompts, params), spec.generate(prompts, params)
    assert [[c.token_ids for c in o.outputs] for o in drafted] == [[c.token_ids for c in o.outputs] for o in plain]
    assert spec.get_metrics().num_draft_tokens > 0


def test_the_completions_of_one_request_have_the_targets_distribution(llm):
    prompt = repetitive_prompts()[1]
    draws = 600
    single = llm.generate(
        [prompt] * draws, [SamplingParams(seed=10_000 + s, max_tokens=1, **SAMPLED) for s in range(draws)]
    )
    reference: dict[tuple[int, ...], int] = {}
    for output in single:
        key = tuple(output.outputs[0].token_ids)
        reference[key] = reference.get(key, 0) + 1
    together = llm.generate(prompt, SamplingParams(n=draws, seed=1, max_tokens=1, **SAMPLED))[0]
    observed: dict[tuple[int, ...], int] = {}
    for completion in together.outputs:
        observed[tuple(completion.token_ids)] = observed.get(tuple(completion.token_ids), 0) + 1
    assert len(reference) > 1
    assert same_distribution_p_value(reference, observed) > 1e-3


def test_a_failing_prompt_leaves_no_child_behind(llm):
    too_long = [5] * 200  # past max_model_len
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([repetitive_prompts()[0], too_long], SamplingParams(n=3, max_tokens=4, **SAMPLED))
    assert not llm.engine.has_unfinished_requests() and not llm.engine._requests


def test_n_is_refused_where_one_completion_is_all_there_is(llm):
    with pytest.raises(ValueError, match="n must be >= 1"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="the engine takes one completion per request"):
        llm.engine.add_request(prompt_token_ids=[1, 2, 3], params=SamplingParams(n=2))
    assert not llm.engine._requests


def test_streamed_completions_come_by_index_and_end_with_all_of_them(llm):
    prompt = repetitive_prompts()[1]
    params = SamplingParams(n=3, seed=8, max_tokens=7, **SAMPLED)
    whole = llm.generate(prompt, params)[0]
    deltas = list(llm.stream(prompt, params))
    for index in range(3):
        streamed = [t for d in deltas if d.index == index for t in d.token_ids]
        assert streamed == whole.outputs[index].token_ids
        assert "".join(d.text for d in deltas if d.index == index) == whole.outputs[index].text
        assert [d.finished for d in deltas if d.index == index][-1]
    assert [d.output is not None for d in deltas] == [False] * (len(deltas) - 1) + [True]
    final = deltas[-1].output
    assert [c.token_ids for c in final.outputs] == [c.token_ids for c in whole.outputs] and final.seed == 8
    early = llm.stream(prompt, SamplingParams(n=3, max_tokens=50, **SAMPLED))
    next(early)
    early.close()  # a consumer that stops early aborts every completion
    assert not llm.engine.has_unfinished_requests() and not llm.engine._requests
