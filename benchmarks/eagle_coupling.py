"""Sampled requests with eagle3: each node's first child drawn with the target's own keyed noise
("keyed", the default) against the head's most likely ids only ("top_k"), on the first questions
per task of Spec-Bench, one interleaved run (plain, then each configuration, question by question).

    python benchmarks/eagle_coupling.py --per-task 2 --max-tokens 128 --temperature 0.7

Every configuration must return plain decoding's tokens (same seed per question): checked.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

from quickdraft import LLM, SamplingParams

QUESTIONS = Path(__file__).resolve().parents[2] / "shared/data/specbench/questions.dev.jsonl"
SHAPES = {
    "tree": {},
    "chain p>=0.2": {"top_k": 1, "min_draft_prob": 0.2, "num_speculative_tokens": 6},
}


def questions(per_task: int) -> list[str]:
    by_task: dict[str, list[str]] = defaultdict(list)
    for line in QUESTIONS.read_text().splitlines():
        item = json.loads(line)
        if len(by_task[item["category"]]) < per_task:
            by_task[item["category"]].append(item["turns"][0])
    return [q for qs in by_task.values() for q in qs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-task", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    configs = {"plain": None}
    for shape, options in SHAPES.items():
        for coupling in ("keyed", "top_k"):
            configs[f"eagle3 {shape} {coupling}"] = {"method": "eagle3", **options, "coupling": coupling}
    engines = {name: LLM(speculative_config=spec) for name, spec in configs.items()}
    totals: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for index, question in enumerate(questions(args.per_task)):
        params = SamplingParams(
            temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=1000 + index
        )
        expected = None
        for name, llm in engines.items():
            before = llm.get_metrics()
            drafts, drafted, accepted = before.num_drafts, before.num_draft_tokens, before.num_accepted_tokens
            forwards = before.num_target_forwards
            started = time.perf_counter()
            out = llm.generate([question], params)[0].outputs[0]
            seconds = time.perf_counter() - started
            if expected is None:
                expected = out.token_ids
            elif out.token_ids != expected:
                raise SystemExit(f"{name} differs from plain decoding on question {index}")
            after = llm.get_metrics()
            t = totals[name]
            t["seconds"] += seconds
            t["tokens"] += len(out.token_ids)
            t["forwards"] += after.num_target_forwards - forwards
            t["drafts"] += after.num_drafts - drafts
            t["drafted"] += after.num_draft_tokens - drafted
            t["accepted"] += after.num_accepted_tokens - accepted
    plain_rate = totals["plain"]["tokens"] / totals["plain"]["seconds"]
    report = {}
    for name, t in totals.items():
        rate = t["tokens"] / t["seconds"]
        report[name] = {
            "tok_s": round(rate, 1),
            "vs_plain": round(rate / plain_rate, 2),
            "tokens_per_forward": round(t["tokens"] / t["forwards"], 2),
            "accepted_per_drafted": round(t["accepted"] / t["drafted"], 3) if t["drafted"] else None,
            "accepted_per_draft": round(t["accepted"] / t["drafts"], 2) if t["drafts"] else None,
        }
    setting = dict(vars(args), output=None, questions=len(questions(args.per_task)))
    print(json.dumps({"setting": setting, "runs": report}, indent=1))
    if args.output:
        args.output.write_text(json.dumps({"setting": setting, "runs": report}, indent=1) + "\n")


if __name__ == "__main__":
    main()
