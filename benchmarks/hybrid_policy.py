"""Modeled decode cost of speculative configs, to compare close configs without timing noise.

    python benchmarks/hybrid_policy.py --skip 10 --per-task 14 CONFIG_JSON [CONFIG_JSON ...]

Answers the first turn of Spec-Bench questions skip+1..per-task of each task (by default
questions the reported first 10 per task do not include), greedy, 128 new tokens, batch 1,
and counts per config: the target forward cost of every decode step from a cost curve
c(tokens verified) measured at the start of the run (median of repeated forwards), plus the
drafter's measured propose time.  Greedy outputs are identical for every config, so the
modeled figure differs between configs only by what they verify and draft, not by machine
drift; `bench specbench --interleave` is the measurement, this is for choosing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

SIZES = (1, 2, 4, 6, 8, 12, 16, 24, 32, 48)


def forward_cost_curve(llm, *, cache_len: int = 300, repeats: int = 10) -> dict[int, float]:
    """Seconds of one target forward verifying a chain of n tokens after cache_len cached ones."""
    from quickdraft.engine.runner import SequenceWork

    curve = {}
    for n in SIZES:
        times = []
        for _ in range(repeats):
            work = SequenceWork(
                slot=0,
                cache_len=cache_len,
                token_ids=list(range(100, 100 + n)),
                parents=[-1, *range(n - 1)],
                logits_nodes=list(range(n)),
            )
            start = time.perf_counter()
            llm.engine.runner.forward([work])
            times.append(time.perf_counter() - start)
        curve[n] = statistics.median(times[2:])
    return curve


def interpolate(curve: dict[int, float], n: int) -> float:
    sizes = sorted(curve)
    if n >= sizes[-1]:
        return curve[sizes[-1]] * n / sizes[-1]
    upper = next(s for s in sizes if s >= n)
    lower = max(s for s in sizes if s <= n)
    if upper == lower:
        return curve[n]
    return curve[lower] + (curve[upper] - curve[lower]) * (n - lower) / (upper - lower)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("configs", nargs="+", help="speculative configs as JSON objects")
    parser.add_argument("--questions", default="../shared/data/specbench/questions.dev.jsonl")
    parser.add_argument("--skip", type=int, default=10, help="questions of each task left out first")
    parser.add_argument("--per-task", type=int, default=14, help="last question of each task used")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()

    from quickdraft import LLM, SamplingParams
    from quickdraft.bench.specbench import conversation_prompt, load_questions, task_of

    taken = defaultdict(int)
    prompts = []
    for question in load_questions(Path(args.questions), per_task=args.per_task):
        task = task_of(question.category)
        taken[task] += 1
        if taken[task] > args.skip:
            prompts.append((task, conversation_prompt(question.turns[:1], [])))
    llm = LLM(None, dtype="float32", max_model_len=2048)
    curve = forward_cost_curve(llm)
    print("forward ms by tokens verified: " + ", ".join(f"{n}: {s * 1e3:.1f}" for n, s in curve.items()))
    engine, params = llm.engine, SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens)
    forward = engine.runner.forward
    for text in args.configs:
        engine.set_speculative_config(json.loads(text))
        engine.reset_prefix_cache()  # each configuration computes its own prompts
        totals = defaultdict(lambda: [0, 0.0])  # task -> [tokens, modeled seconds]
        task_now = ["warm-up"]

        def counted_forward(work, totals=totals, task_now=task_now, **options):
            if len(work) == 1 and (work[0].parents is not None or len(work[0].token_ids) == 1):  # a decode step
                totals[task_now[0]][1] += interpolate(curve, len(work[0].token_ids))
            return forward(work, **options)

        engine.runner.forward = counted_forward
        if engine.speculator is not None:
            drafter = engine.speculator.drafter
            propose = drafter.propose

            def timed_propose(requests, propose=propose, totals=totals, task_now=task_now):
                start = time.perf_counter()
                proposals = propose(requests)
                totals[task_now[0]][1] += time.perf_counter() - start
                return proposals

            drafter.propose = timed_propose
        llm.generate(["User: hi\nAssistant:"], SamplingParams(temperature=0.0, max_tokens=8))
        totals.clear()
        for task, prompt in prompts:
            task_now[0] = task
            totals[task][0] += len(llm.generate([prompt], params)[0].outputs[0].token_ids)
        engine.runner.forward = forward
        tokens, seconds = (sum(t[i] for t in totals.values()) for i in (0, 1))
        per_task = ", ".join(f"{task} {t[0] / t[1]:.1f}" for task, t in totals.items())
        print(f"{text}\n  modeled {tokens / seconds:.1f} tok/s ({per_task})", flush=True)


if __name__ == "__main__":
    main()
