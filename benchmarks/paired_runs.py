"""Compare two runs of one `quickdraft bench specbench` results.json question by question.

    python benchmarks/paired_runs.py benchmarks/specbench-.../results.json suffix hybrid

Prints, per task and overall, the time ratio of run A to run B over the same questions (above
1: B is faster), a 90% bootstrap interval over questions (how much the ratio depends on which
questions were asked; timing noise between runs is not in it), and on how many questions B
was faster.  Run names are matched by prefix after "quickdraft " ("suffix", "hybrid", ...).
"""

from __future__ import annotations

import argparse
import json
import random
from collections import defaultdict


def find_run(runs: list[dict], name: str) -> dict:
    matches = [r for r in runs if r["name"] == name or r["name"].removeprefix("quickdraft ").startswith(name)]
    if len(matches) != 1:
        raise SystemExit(f"run {name!r} matches {len(matches)} runs: {[r['name'] for r in runs]}")
    if matches[0]["error"] or not matches[0]["questions"]:
        raise SystemExit(f"run {matches[0]['name']!r} did not finish: {matches[0]['error']}")
    return matches[0]


def ratio_with_interval(pairs: list[tuple[float, float]], *, rng: random.Random, draws: int = 2000):
    ratio = sum(a for a, _ in pairs) / sum(b for _, b in pairs)
    boots = sorted(
        sum(a for a, _ in sample) / sum(b for _, b in sample)
        for sample in ([rng.choice(pairs) for _ in pairs] for _ in range(draws))
    )
    return ratio, boots[int(0.05 * draws)], boots[int(0.95 * draws) - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", help="a results.json written by quickdraft bench specbench")
    parser.add_argument("run_a")
    parser.add_argument("run_b")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    runs = json.load(open(args.results))["runs"]
    a, b = find_run(runs, args.run_a), find_run(runs, args.run_b)
    b_seconds = {q["question_id"]: q["seconds"] for q in b["questions"]}
    by_task = defaultdict(list)
    for question in a["questions"]:
        by_task[question["task"]].append((question["seconds"], b_seconds[question["question_id"]]))
    by_task["overall"] = [pair for pairs in list(by_task.values()) for pair in pairs]
    rng = random.Random(args.seed)
    print(f"time of {a['name']} / time of {b['name']} (above 1: the second is faster)")
    for task, pairs in by_task.items():
        ratio, low, high = ratio_with_interval(pairs, rng=rng)
        faster = sum(tb < ta for ta, tb in pairs)
        print(
            f"{task:15s} {ratio:.3f}  90% interval over questions [{low:.3f}, {high:.3f}]  "
            f"second faster on {faster}/{len(pairs)}"
        )


if __name__ == "__main__":
    main()
