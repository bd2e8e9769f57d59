"""n completions of one prompt, with and without in-batch prefix sharing.

`SamplingParams(n=...)` runs n requests of the same prompt (engine/parallel_sampling.py).  With
prefix caching, the scheduler makes the children wait while the first computes the prompt's full
blocks, then they skip them ("shared"); without that wait every child computes the whole prompt
beside the others ("unshared", the scheduler's check switched off).  One process, one LLM per
setting, alternating per prompt: long Spec-Bench first turns (summarization and rag), sampled,
every completion's tokens compared between the settings (they must be identical).  Prints per
setting the median time to the first token (earliest child), the time to the whole answer, the
prompt tokens computed, and the tokens per second over all children.

    python benchmarks/parallel_sampling.py --per-category 4 --n 4 --out benchmarks/parallel-sampling-2026-12-05-zen2
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time
from pathlib import Path

from quickdraft import LLM, SamplingParams
from quickdraft.engine.scheduler import Scheduler

QUESTIONS = Path(__file__).resolve().parents[2] / "shared/data/specbench/questions.dev.jsonl"
CATEGORIES = ("summarization", "rag")


def long_first_turns(per_category: int) -> list[str]:
    by_category = collections.defaultdict(list)
    for line in QUESTIONS.read_text().splitlines():
        item = json.loads(line)
        if item["category"] in CATEGORIES:
            by_category[item["category"]].append(item["turns"][0] + "\n\n")
    return [prompt for category in CATEGORIES for prompt in by_category[category][:per_category]]


def unshared_llm(**options) -> LLM:
    """An LLM whose scheduler admits a request beside a prefill computing its blocks (as before)."""
    llm = LLM(**options)
    scheduler = llm.engine.scheduler
    scheduler._prefill_computing_blocks_of = lambda token_ids, *, cached: False  # type: ignore[method-assign]
    assert isinstance(scheduler, Scheduler)
    return llm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--per-category", type=int, default=4)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    options = dict(max_model_len=2048, max_num_seqs=args.max_num_seqs)
    llms = {"shared": LLM(**options), "unshared": unshared_llm(**options)}
    for llm in llms.values():
        llm.generate(["Hello there, how are"], SamplingParams(temperature=0, max_tokens=8))
    prompts = long_first_turns(args.per_category)
    figures: dict[str, dict[str, list[float]]] = {tag: collections.defaultdict(list) for tag in llms}
    completions: dict[int, set] = collections.defaultdict(set)
    cached_before = dict.fromkeys(llms, 0)
    for i, prompt in enumerate(prompts):
        params = SamplingParams(n=args.n, temperature=0.8, top_p=0.95, seed=i, max_tokens=args.max_tokens)
        for tag in llms if i % 2 == 0 else reversed(llms):
            llm = llms[tag]
            started = time.perf_counter()
            output = llm.generate([prompt], params)[0]
            seconds = time.perf_counter() - started
            cached = llm.engine.metrics.num_cached_tokens - cached_before[tag]  # engine-wide counter
            cached_before[tag] += cached
            completions[i].add(tuple(tuple(c.token_ids) for c in output.outputs))
            prompt_tokens = len(output.prompt_token_ids)
            figure = figures[tag]
            figure["prompt tokens"].append(prompt_tokens)
            figure["ttft s"].append(output.metrics.ttft)
            figure["whole answer s"].append(seconds)
            figure["tok/s"].append(output.metrics.num_generation_tokens / seconds)
            figure["prompt tokens computed"].append(args.n * prompt_tokens - cached)
            llm.engine.reset_prefix_cache()  # the next prompt starts cold, as a new one would
    report = {
        "n": args.n,
        "prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "identical": all(len(v) == 1 for v in completions.values()),
        "medians": {tag: {k: statistics.median(v) for k, v in figure.items()} for tag, figure in figures.items()},
    }
    print(json.dumps(report, indent=2))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
