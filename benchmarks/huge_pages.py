"""Quantized weights in huge pages against the same weights mapped from the packed-weight file.

One process, one LLM per setting and config (`weights_in_huge_pages` True / False), the two
alternating per prompt: Spec-Bench first turns (`--per-category` of each category), greedy,
plain and speculative configs; then the forward curve (300 tokens of context verifying T
tokens, logits for all) and prompt prefill, alternated per round.  Outputs must be identical:
where the bytes lie changes no bit.  Prints each ratio huge / mapped (time) or (tok/s).

    python benchmarks/huge_pages.py --per-category 2 --out benchmarks/huge-pages-2026-12-04-zen2
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time
from pathlib import Path

from forward_curve import time_forward, time_prefill  # run from benchmarks/: its folder is on the path

from quickdraft import LLM, SamplingParams

QUESTIONS = Path(__file__).resolve().parents[2] / "shared/data/specbench/questions.dev.jsonl"
CONFIGS = {"plain": None, "suffix": {"method": "suffix"}, "eagle3": {"method": "eagle3"}}
SETTINGS = {"mapped": False, "huge": True}


def first_turns(per_category: int) -> list[str]:
    by_category = collections.defaultdict(list)
    for line in QUESTIONS.read_text().splitlines():
        item = json.loads(line)
        by_category[item["category"]].append(item["turns"][0])
    return [p for questions in by_category.values() for p in questions[:per_category]]


def end_to_end(prompts: list[str], max_tokens: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    seconds, tokens, outputs = collections.Counter(), collections.Counter(), collections.defaultdict(set)
    for name, config in CONFIGS.items():
        llms = {tag: LLM(speculative_config=config, weights_in_huge_pages=huge) for tag, huge in SETTINGS.items()}
        for llm in llms.values():
            llm.generate(["Hello there, how are"], SamplingParams(temperature=0, max_tokens=8))
        for i, prompt in enumerate(prompts):
            for tag in SETTINGS if i % 2 == 0 else reversed(SETTINGS):
                started = time.perf_counter()
                ids = llms[tag].generate([prompt], params)[0].outputs[0].token_ids
                seconds[name, tag] += time.perf_counter() - started
                tokens[name, tag] += len(ids)
                outputs[name, i].add(tuple(ids))
        del llms
    return {
        "prompts": len(prompts),
        "identical": all(len(v) == 1 for v in outputs.values()),
        "tok/s": {f"{name} {tag}": tokens[name, tag] / seconds[name, tag] for name in CONFIGS for tag in SETTINGS},
    }


def forward_curve(rounds: int) -> dict:
    engines = {
        tag: LLM(max_model_len=1100, max_num_seqs=1, weights_in_huge_pages=huge).engine
        for tag, huge in SETTINGS.items()
    }
    times = collections.defaultdict(list)
    for _ in range(rounds):
        for tag, engine in engines.items():
            for width in (1, 2, 4, 8, 16):
                times[f"T={width} {tag}"].append(time_forward(engine, context=300, width=width, repeats=5))
            times[f"prefill 300 {tag}"].append(time_prefill(engine, prompt=300, repeats=2))
    return {key: statistics.median(values) * 1e3 for key, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    e2e = end_to_end(first_turns(args.per_category), args.max_tokens)
    curve = forward_curve(args.rounds)
    lines = [f"end to end: {e2e['prompts']} prompts, {args.max_tokens} tokens, outputs identical: {e2e['identical']}"]
    for name in CONFIGS:
        mapped, huge = e2e["tok/s"][f"{name} mapped"], e2e["tok/s"][f"{name} huge"]
        lines.append(f"{name:8s} mapped {mapped:6.1f} tok/s  huge {huge:6.1f} tok/s  huge/mapped {huge / mapped:.3f}")
    for key in dict.fromkeys(k.rsplit(" ", 1)[0] for k in curve):
        mapped, huge = curve[f"{key} mapped"], curve[f"{key} huge"]
        lines.append(f"{key:12s} mapped {mapped:8.2f} ms  huge {huge:8.2f} ms  huge/mapped {huge / mapped:.3f}")
    print("\n".join(lines))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "summary.txt").write_text("\n".join(lines) + "\n")
        (args.out / "results.json").write_text(json.dumps({"end_to_end": e2e, "curve_ms": curve}, indent=2))


if __name__ == "__main__":
    main()
