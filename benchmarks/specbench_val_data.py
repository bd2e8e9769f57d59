"""Validation data for draft heads from Spec-Bench questions that no benchmark here measures on.

A head's own validation split comes from the same generated prompts it trains on, and flatters
it: the shipped eagle3 head guesses 0.94 of those first draft tokens right but 0.87 of the
target's answers to Spec-Bench questions (docs/performance-log.md, session 56).  This writes the target's greedy
answers (and its hidden states at the feature layers, as `train-head` records them) to the first
turns of Spec-Bench questions `--start` .. `--start + --per-task - 1` of every task, in file
order: by default the 15th to the 20th, past the first 10 that `quickdraft bench specbench
--questions-per-task 10` measures and the 11th-14th used as a dev subset.  Then

    quickdraft train-head --method eagle3 --init-head HEAD --epochs 0 --num-prompts 0 \\
        --feature-layers 1 9 17 --dtype auto --max-seq-len 2048 --val-data OUT/data --out OUT/val

validates HEAD on them (or `--val-data` beside a training run reports both figures).

    .venv/bin/python benchmarks/specbench_val_data.py --out results/specbench-val
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

from quickdraft.bench.specbench import conversation_prompt, load_questions, task_of


def held_out_first_turns(path: Path, *, start: int, per_task: int) -> list[str]:
    """First-turn prompts of questions start..start+per_task-1 of each task (0-based, file order)."""
    by_task: dict[str, list] = defaultdict(list)
    for question in load_questions(path):
        by_task[task_of(question.category)].append(question)
    return [
        conversation_prompt(question.turns[:1], [])
        for questions in by_task.values()
        for question in questions[start : start + per_task]
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--questions", type=Path, default=Path("../shared/data/specbench/questions.dev.jsonl"))
    parser.add_argument("--start", type=int, default=14, help="0-based index of the first question per task (14)")
    parser.add_argument("--per-task", type=int, default=6)
    parser.add_argument("--feature-layers", type=int, nargs="+", default=[1, 9, 17])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.start < 14:
        parser.error("--start below 14 would take questions the benchmarks measure on (the first 10, then 11-14)")

    from quickdraft import LLM
    from quickdraft.train.data import generate_shard

    prompts = held_out_first_turns(args.questions, start=args.start, per_task=args.per_task)
    llm = LLM(dtype=args.dtype, max_model_len=2048)
    shard = generate_shard(
        llm,
        prompts,
        feature_layers=tuple(args.feature_layers),
        max_new_tokens=args.max_new_tokens,
        temperature=0.0,
        seed=0,
    )
    (args.out / "data").mkdir(parents=True, exist_ok=True)
    shard.save(args.out / "data" / "shard-0000.safetensors")
    tokens = sum(s.num_answer_tokens for s in shard.sequences)
    print(f"{len(shard.sequences)} answers, {tokens} answer tokens -> {args.out / 'data'}")


if __name__ == "__main__":
    main()
