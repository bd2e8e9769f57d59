"""Spec-Bench on this machine: plain decoding vs speculative methods, in one run.

    python benchmarks/bench_specbench.py --per-task 8 --max-new-tokens 128 \\
        --method '{"method": "ngram", "num_speculative_tokens": 5}' --method '{"method": "suffix"}'
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from quickdraft.bench.specbench import format_table, load_questions, results_to_json, run_method, summarize

DEFAULT_QUESTIONS = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "specbench" / "questions.dev.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--questions", default=str(DEFAULT_QUESTIONS))
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--per-task", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--method", action="append", default=None, help="speculative config JSON (repeatable)")
    parser.add_argument("--out", default=None, help="write per-question figures to this JSON file")
    args = parser.parse_args()
    methods = [json.loads(m) for m in (args.method or ['{"method": "ngram"}', '{"method": "suffix"}'])]

    from quickdraft import LLM

    questions = load_questions(args.questions, per_task=args.per_task)
    print(f"{len(questions)} questions, greedy, {args.max_new_tokens} new tokens, {args.dtype}, batch 1, "
          f"{platform.machine()} {torch.get_num_threads()} threads, {time.strftime('%Y-%m-%d')}")
    results = {}
    llm = LLM(args.model, dtype=args.dtype, max_model_len=2048, max_num_seqs=1)
    run_method(llm, questions[:2], max_new_tokens=8)  # warm-up
    start = time.perf_counter()
    results["plain"] = run_method(llm, questions, max_new_tokens=args.max_new_tokens)
    print(f"plain: {time.perf_counter() - start:.0f} s")
    for spec in methods:
        name = json.dumps(spec)
        llm.engine.set_speculative_config(spec)
        run_method(llm, questions[:2], max_new_tokens=8)
        results[name] = run_method(llm, questions, max_new_tokens=args.max_new_tokens)
        print(format_table(name, summarize(results["plain"], results[name])), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results_to_json(results)))


if __name__ == "__main__":
    main()
