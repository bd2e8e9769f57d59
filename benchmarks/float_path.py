"""The float path (dtype="float32" or "bfloat16": the embedded model dequantized) with the
skinny_linear kernel vs torch's GEMM (F.linear), plain and with suffix speculation, in one process.

The kernel is switched off by making cpu_linear's extension lookup return None, which is what a CPU
without a build gets; on an AVX2-only CPU that was every CPU float run before the kernel's AVX2
build. Spec-Bench first turns (`--per-task` of each task of questions.dev.jsonl), greedy, the four
configurations interleaved per question, prefix cache reset before each. Each speculative output
is compared with the plain output of the same linear path (exactness); the two plain paths round
differently, so their agreement is reported, not required.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from results_files import save_results  # run from benchmarks/: its folder is on the path

CONFIGS = ("kernel, plain", "kernel, suffix", "F.linear, plain", "F.linear, suffix")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=Path, default=Path("../shared/data/specbench/questions.dev.jsonl"))
    parser.add_argument("--per-task", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from quickdraft import LLM, SamplingParams
    from quickdraft.bench.specbench import load_questions
    from quickdraft.kernels import cpu_linear

    kernel_lookup = cpu_linear._extension
    llm = LLM(dtype=args.dtype, max_model_len=4096)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    llm.generate(["Warm up"], SamplingParams(max_tokens=4, temperature=0.0))
    rows: dict[str, list[dict]] = {config: [] for config in CONFIGS}
    for question in load_questions(args.questions, per_task=args.per_task):
        prompt = f"Question: {question.turns[0]}\nAnswer:"
        for config in CONFIGS:
            cpu_linear._extension = kernel_lookup if config.startswith("kernel") else (lambda: None)
            llm.engine.set_speculative_config({"method": "suffix"} if config.endswith("suffix") else None)
            llm.engine.reset_prefix_cache()
            start = time.perf_counter()
            output = llm.generate([prompt], params)[0]
            rows[config].append(
                {
                    "question_id": question.question_id,
                    "seconds": time.perf_counter() - start,
                    "tokens": len(output.outputs[0].token_ids),
                    "token_ids": output.outputs[0].token_ids,
                }
            )
            print(f"{question.question_id:4d} {config:18s} {rows[config][-1]['seconds']:6.2f} s", flush=True)
    cpu_linear._extension = kernel_lookup
    report = summary(rows) + f"\n{len(rows[CONFIGS[0]])} questions, {args.max_tokens} tokens, greedy, {args.dtype}.\n"
    print(report)
    save_results(args.out, rows=rows, report=report)


def summary(rows: dict[str, list[dict]]) -> str:
    plain_of = {config: config.split(",")[0] + ", plain" for config in CONFIGS}
    total = {config: sum(r["seconds"] for r in runs) for config, runs in rows.items()}
    lines = ["| config | tok/s | vs F.linear plain | identical to its plain |", "|---|---|---|---|"]
    for config, runs in rows.items():
        tokens = sum(r["tokens"] for r in runs)
        plain = rows[plain_of[config]]
        identical = sum(r["token_ids"] == p["token_ids"] for r, p in zip(runs, plain))
        lines.append(
            f"| {config} | {tokens / total[config]:.1f} | {total['F.linear, plain'] / total[config]:.2f}x | "
            f"{identical}/{len(runs)} |"
        )
    agree = sum(a["token_ids"] == b["token_ids"] for a, b in zip(rows["kernel, plain"], rows["F.linear, plain"]))
    return "\n".join(lines) + f"\n\nThe two plain paths gave the same tokens on {agree}/{len(rows[CONFIGS[0]])}.\n"


if __name__ == "__main__":
    main()
