"""LM-head rows computed before the walks (``lazy_logits_rows``) against every row in the forward:
embedded Gemma 3 270M, greedy, Spec-Bench first turns (the first N questions of each of its 13 categories), one
drafter config, in process.  Each round runs plain decoding and the config under every setting
back to back (a fresh engine each); reports tok/s per round and the medians, the LM-head rows
computed per output token, and whether every output equals plain decoding's.

    .venv/bin/python benchmarks/lazy_logits.py --config '{"method": "suffix"}' --per-category 3 --rounds 3
    .venv/bin/python benchmarks/lazy_logits.py --config '{"method": "suffix"}' --batch 32 --per-category 8

``--batch B`` hands the questions to ``generate`` B at a time (B cache slots): continuous
batching at concurrency B, without the server.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time
from pathlib import Path

from quickdraft.bench.specbench import load_questions


def first_turns(path: Path, per_category: int) -> list[str]:
    """The first turns of the first `per_category` questions of each category, category by category."""
    by_category: dict[str, list[str]] = collections.defaultdict(list)
    for question in load_questions(path):
        if len(by_category[question.category]) < per_category:
            by_category[question.category].append(question.turns[0])
    return [prompt for prompts in by_category.values() for prompt in prompts]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="speculative config (JSON)")
    parser.add_argument("--settings", default="0,auto", help="lazy_logits_rows values to compare (auto = None)")
    parser.add_argument("--questions", type=Path, default=Path("../shared/data/specbench/questions.dev.jsonl"))
    parser.add_argument("--per-category", type=int, default=3)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()
    from quickdraft import LLM, SamplingParams

    prompts = first_turns(args.questions, args.per_category)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    spec = json.loads(args.config)
    settings: dict[str, int | None] = {
        value: None if value == "auto" else int(value) for value in args.settings.split(",")
    }
    common = dict(max_model_len=1024, max_num_seqs=args.batch)
    configs: dict[str, dict] = {"plain": {}}
    for name, lazy in settings.items():
        configs[f"lazy_logits_rows={name}"] = dict(speculative_config=spec, lazy_logits_rows=lazy)
    rates: dict[str, list[float]] = {name: [] for name in configs}
    rows_per_token: dict[str, list[float]] = {name: [] for name in configs}
    outputs: dict[str, list[list[int]]] = {}
    chosen: dict[str, int | None] = {}
    for _ in range(args.rounds):
        for name, options in configs.items():
            # A fresh engine each time: a suffix drafter (and the prefix cache) would remember the
            # answers of the round before and retrieve them whole.
            llm = LLM(**common, **options)
            llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))  # warm-up
            rows_before = llm.get_metrics().num_logits_rows
            started = time.perf_counter()
            tokens = []
            for start in range(0, len(prompts), args.batch):
                out = llm.generate(prompts[start : start + args.batch], params)
                tokens += [o.outputs[0].token_ids for o in out]
            seconds = time.perf_counter() - started
            num_tokens = sum(map(len, tokens))
            rates[name].append(num_tokens / seconds)
            rows_per_token[name].append((llm.get_metrics().num_logits_rows - rows_before) / num_tokens)
            outputs[name] = tokens
            chosen[name] = llm.engine.lazy_logits_rows
            llm.close()
    result = {
        "config": spec,
        "prompts": len(prompts),
        "per_category": args.per_category,
        "batch": args.batch,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "lazy_logits_rows_in_use": chosen,
        "tok_per_s": rates,
        "median_tok_per_s": {name: statistics.median(values) for name, values in rates.items()},
        "lm_head_rows_per_token": {name: statistics.median(values) for name, values in rows_per_token.items()},
        "same_as_plain": {name: outputs[name] == outputs["plain"] for name in configs},
    }
    plain = rates["plain"]
    for name, values in rates.items():
        ratios = [v / p for v, p in zip(values, plain)]
        print(
            f"{name}: {statistics.median(values):.1f} tok/s (rounds {', '.join(f'{v:.1f}' for v in values)}), "
            f"{statistics.median(ratios):.2f}x plain, {statistics.median(rows_per_token[name]):.2f} LM-head rows "
            "a token, "
            f"same as plain: {outputs[name] == outputs['plain']}"
        )
    print(f"lazy_logits_rows in use: {chosen}")
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
