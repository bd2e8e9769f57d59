"""How closely two runs of Spec-Bench results agree token for token (e.g. the quantized path
against the float32 dequantized model, or llama.cpp against either), question by question.

    python benchmarks/token_agreement.py A/results.json "quickdraft plain" B/results.json "quickdraft plain"

Prints the share of first turns that are identical, and the mean length of the common prefix
of the first turn's tokens (of the 128 generated).
"""

from __future__ import annotations

import argparse
import json
import statistics


def first_turns(path: str, run_name: str) -> dict[int, list[int]]:
    runs = json.load(open(path))["runs"]
    run = next((r for r in runs if r["name"] == run_name), None)
    if run is None:
        raise SystemExit(f"{path}: no run named {run_name!r}; runs: {', '.join(r['name'] for r in runs)}")
    return {q["question_id"]: q["turns"][0]["token_ids"] for q in run["questions"]}


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results_a")
    parser.add_argument("run_a")
    parser.add_argument("results_b")
    parser.add_argument("run_b")
    args = parser.parse_args()
    a, b = first_turns(args.results_a, args.run_a), first_turns(args.results_b, args.run_b)
    shared = sorted(a.keys() & b.keys())
    prefixes = [common_prefix(a[q], b[q]) for q in shared]
    identical = sum(a[q] == b[q] for q in shared)
    print(
        f"{len(shared)} questions: first turn identical {identical / len(shared):.0%}; common prefix "
        f"mean {statistics.mean(prefixes):.1f} / median {statistics.median(prefixes):.0f} tokens"
    )


if __name__ == "__main__":
    main()
