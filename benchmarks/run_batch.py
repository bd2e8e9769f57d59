"""quickdraft run-batch on Spec-Bench first turns: the same batch file plain and with suffix
speculation (one run each, the embedded model, greedy), wall time and the outputs compared.

    python benchmarks/run_batch.py --per-task 4 --out benchmarks/run-batch-...
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from results_files import save_results  # run from the repository root: benchmarks/ is on the path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=Path, default=Path("../shared/data/specbench/questions.dev.jsonl"))
    parser.add_argument("--per-task", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from quickdraft.bench.specbench import load_questions
    from quickdraft.cli import main as cli

    root = Path(tempfile.mkdtemp(prefix="run-batch-"))
    questions = load_questions(args.questions, per_task=args.per_task)
    batch = root / "in.jsonl"
    batch.write_text(
        "".join(
            json.dumps(
                {
                    "custom_id": str(q.question_id),
                    "method": "POST",
                    "url": "/v1/completions",
                    "body": {
                        "prompt": f"Question: {q.turns[0]}\nAnswer:",
                        "max_tokens": args.max_tokens,
                        "temperature": 0,
                    },
                }
            )
            + "\n"
            for q in questions
        )
    )
    rows = {}
    for name, speculative in (("plain", None), ("suffix", {"method": "suffix"})):
        out = root / f"{name}.jsonl"
        argv = ["run-batch", "-i", str(batch), "-o", str(out), "--max-num-seqs", str(args.max_num_seqs)]
        argv += ["--max-model-len", "4096", "--log-level", "warning"]
        if speculative is not None:
            argv += ["--speculative-config", json.dumps(speculative)]
        start = time.perf_counter()
        assert cli(argv) == 0
        seconds = time.perf_counter() - start  # model load included
        results = [json.loads(line) for line in out.read_text().splitlines()]
        bodies = [r["response"]["body"] for r in results]
        rows[name] = {
            "seconds_with_load": seconds,
            "texts": [b["choices"][0]["text"] for b in bodies],
            "tokens": sum(b["usage"]["completion_tokens"] for b in bodies),
        }
    same = sum(a == b for a, b in zip(rows["plain"]["texts"], rows["suffix"]["texts"]))
    report = (
        f"{len(questions)} Spec-Bench first turns, {args.max_tokens} tokens, greedy, --max-num-seqs "
        f"{args.max_num_seqs}; wall time including the model load (see the run-batch summary lines "
        f"above for the batch alone): plain {rows['plain']['seconds_with_load']:.1f} s, suffix "
        f"{rows['suffix']['seconds_with_load']:.1f} s; identical outputs {same}/{len(questions)}.\n"
    )
    print(report)
    save_results(args.out, rows=rows, report=report)


if __name__ == "__main__":
    main()
