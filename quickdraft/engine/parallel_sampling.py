"""n completions of one prompt (`SamplingParams.n` > 1), as vLLM's parallel sampling does it.

A request asking for n completions runs as n ordinary requests of the same prompt (its
children), child i seeded `seed + i` from the request's seed (drawn by the engine when it has
none), so the n answers are independent draws and the request's one seed replays all of them.
Each child is decoded, drafted for and verified like any request, so speculation keeps every
answer exact; the prefix cache lets children that start after the first's prompt blocks are
cached skip that prefill.  Their outputs merge into one RequestOutput with completions indexed
0..n-1 (a server request with a batch of prompts: choice k is completion k % n of prompt k // n).
With `best_of` above n, best_of children are sampled and the n with the highest mean logprob per
token are returned (their acceptance figures count every child: all were decoded).
The Python API (`LLM`) and the server's engine loop both fan out with these helpers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from quickdraft.config import check_ranks_by_logprobs
from quickdraft.outputs import RequestMetrics, RequestOutput
from quickdraft.sampling_params import SamplingParams


def child_request_ids(request_id: str, count: int) -> list[str]:
    """The engine request ids of a request's `count` children: the request's own id for one."""
    return [request_id] if count == 1 else [f"{request_id}-{index}" for index in range(count)]


def children_seed(params: SamplingParams, *, draw_seed: Callable[[], int]) -> int | None:
    """The seed a request's children are seeded from: its own, or for several one drawn (the
    request's output returns it); None for a lone unseeded request (the engine draws its seed)."""
    return params.seed if params.seed is not None or params.num_samples == 1 else draw_seed()


def child_params(
    params: SamplingParams,
    *,
    seed: int | None,
    prompt_logprobs_for_all: bool = False,
    logprobs_mode: str = "raw_logprobs",  # the engine's (EngineConfig.logprobs_mode)
) -> list[SamplingParams]:
    """Each child's parameters (params.num_samples children): n = 1, child i seeded seed + i.
    `seed` is needed for several (the request's seed, or one the engine drew) so that the
    request's output names one seed for all.  Prompt logprobs are computed by the first child
    only, unless `prompt_logprobs_for_all` (a server streaming each choice after its echoed
    prompt).  Children ranked for best_of compute at least their sampled tokens' logprobs."""
    count = params.num_samples
    if count == 1:
        return [params]
    if seed is None:
        raise ValueError("several completions need the request's seed (or one the engine drew) to seed them")
    ranked = count > params.n
    if ranked:
        check_ranks_by_logprobs(logprobs_mode, what="best_of")
    logprobs = 0 if ranked and params.logprobs is None else params.logprobs
    # The prompt's logprobs are the same for every child: the first computes them, the others may
    # then take the prompt from the prefix cache.
    return [
        dataclasses.replace(
            params,
            n=1,
            best_of=None,
            seed=seed + index,
            logprobs=logprobs,
            prompt_logprobs=params.prompt_logprobs if index == 0 or prompt_logprobs_for_all else None,
        )
        for index in range(count)
    ]


def best_outputs(outputs: list[RequestOutput], *, n: int, keep_logprobs: bool) -> list[RequestOutput]:
    """The n of a prompt's best_of completions to return, best first: the highest mean logprob
    per token (OpenAI's "best"; vLLM's V0 engine ranked by the sum, which favours short answers),
    ties to the earlier child.  The per-token logprobs computed only to rank them are dropped
    unless the request asked for them (the cumulative logprob stays)."""
    if len(outputs) <= n:
        return outputs

    def mean_logprob(output: RequestOutput) -> float:
        completion = output.outputs[0]
        if completion.cumulative_logprob is None:
            raise ValueError("best_of ranks completions by their logprobs, and a child has none")
        return completion.cumulative_logprob / max(1, len(completion.token_ids))

    best = sorted(outputs, key=mean_logprob, reverse=True)[:n]  # sorted() is stable: ties keep child order
    if keep_logprobs:
        return best
    return [
        dataclasses.replace(output, outputs=[dataclasses.replace(output.outputs[0], logprobs=None)]) for output in best
    ]


def merged_output(
    request_id: str, outputs: list[RequestOutput], *, seed: int | None, n: int | None = None, keep_logprobs: bool = True
) -> RequestOutput:
    """One RequestOutput of a request's children, completion i from child i; with `n` below the
    number of children (best_of), the n best (`best_outputs`).  A lone child is returned as it is."""
    chosen = best_outputs(outputs, n=n, keep_logprobs=keep_logprobs) if n is not None else outputs
    if len(outputs) == 1:
        return outputs[0]
    first = outputs[0]
    return RequestOutput(
        request_id=request_id,
        prompt=first.prompt,
        prompt_token_ids=list(first.prompt_token_ids),
        outputs=[dataclasses.replace(output.outputs[0], index=index) for index, output in enumerate(chosen)],
        finished=all(output.finished for output in outputs),
        metrics=merged_metrics([output.metrics for output in outputs]),
        seed=seed,
        prompt_logprobs=first.prompt_logprobs,
    )


def merged_batch_output(
    request_id: str,
    outputs: list[RequestOutput],
    *,
    n: int,
    seed: int | None,
    samples: int | None = None,
    keep_logprobs: bool = True,
) -> RequestOutput:
    """One RequestOutput of a batch of prompts' n completions each (`outputs` prompt by prompt,
    `samples` children each: best_of, else n): choice k is completion k % n of prompt k // n, as
    vLLM numbers a batch's choices.  Figures are summed over the prompts (prompt tokens and
    cached tokens included); `prompt_token_ids` is empty where there are several prompts."""
    samples = n if samples is None else samples
    if not outputs or len(outputs) % samples:
        raise ValueError(f"a batch needs {samples} outputs per prompt, got {len(outputs)}")
    per_prompt = [
        merged_output(request_id, outputs[i : i + samples], seed=seed, n=n, keep_logprobs=keep_logprobs)
        for i in range(0, len(outputs), samples)
    ]
    if len(per_prompt) == 1:
        return per_prompt[0]
    completions = [completion for output in per_prompt for completion in output.outputs]
    return RequestOutput(
        request_id=request_id,
        prompt=None,
        prompt_token_ids=[],
        outputs=[dataclasses.replace(completion, index=k) for k, completion in enumerate(completions)],
        finished=all(output.finished for output in per_prompt),
        metrics=merged_metrics([output.metrics for output in per_prompt], same_prompt=False),
        seed=seed,
    )


def merged_metrics(parts: list[RequestMetrics], *, same_prompt: bool = True) -> RequestMetrics:
    """A request's figures from its children's: counts summed (so tokens per target forward is
    over all of them), times from the earliest start to the last end.  Children of one prompt
    (`same_prompt`) count it once, and its cached tokens are the fewest any child had (the
    prompt was computed at least that much once: the first child's cache misses are the later
    ones' hits); different prompts add theirs up.  Seconds spent drafting and verifying are
    those of the child that spent the most (siblings share steps)."""
    if not parts:
        raise ValueError("no metrics to merge")

    def earliest(values: list[float | None]) -> float | None:
        known = [value for value in values if value is not None]
        return min(known) if known else None

    finished = [part.finished_time for part in parts]
    merged = RequestMetrics(
        arrival_time=min(part.arrival_time for part in parts),
        first_scheduled_time=earliest([part.first_scheduled_time for part in parts]),
        first_token_time=earliest([part.first_token_time for part in parts]),
        finished_time=None if None in finished else max(t for t in finished if t is not None),
        num_prompt_tokens=parts[0].num_prompt_tokens if same_prompt else sum(p.num_prompt_tokens for p in parts),
        num_cached_tokens=(min if same_prompt else sum)(part.num_cached_tokens for part in parts),
        draft_seconds=max(part.draft_seconds for part in parts),
        verify_seconds=max(part.verify_seconds for part in parts),
    )
    counts = ("num_generation_tokens", "num_preemptions", "num_target_forwards", "num_drafts", "num_draft_tokens")
    for name in (*counts, "num_accepted_tokens"):
        setattr(merged, name, sum(getattr(part, name) for part in parts))
    for name in ("accepted_per_position", "drafted_per_position", "draft_length_choices"):
        setattr(merged, name, _summed_lists([getattr(part, name) for part in parts]))
    return merged


def _summed_lists(lists: list[list[int]]) -> list[int]:
    """Element-wise sums of lists of different lengths (missing entries are 0)."""
    summed = [0] * max((len(values) for values in lists), default=0)
    for values in lists:
        for position, value in enumerate(values):
            summed[position] += value
    return summed
