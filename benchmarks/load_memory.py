"""Resident memory of the loaded embedded model, by speculative config (issue 14: <= 450 MB).

Each config runs in a fresh process: RSS (VmRSS, and its anonymous / file-backed parts) after
`import quickdraft` and torch, after `LLM(...)`, and after generating --max-tokens greedy tokens
for the first turn of each of --questions Spec-Bench questions; the load's peak is sampled by a
thread (quickdraft.bench.memory.PeakMemory).  Figures are MiB above the process before the load.

    python benchmarks/load_memory.py --out benchmarks/load-memory-2026-12-03
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

QUESTIONS = Path(__file__).resolve().parents[2] / "shared/data/specbench/questions.dev.jsonl"
CONFIGS = {
    "plain": None,
    "suffix": {"method": "suffix"},
    "eagle3": {"method": "eagle3"},
    "hybrid suffix + eagle3": {"method": "hybrid", "drafters": [{"method": "suffix"}, {"method": "eagle3"}]},
}


def _status_mib() -> dict[str, float]:
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in ("VmRSS", "RssAnon", "RssFile"):
                fields[name] = int(rest.split()[0]) / 1024
    return fields


def measure_one(config: dict | None, *, kv_cache_dtype: str, questions: int, max_tokens: int) -> dict:
    """In this process: RSS before and after the load, and after the generations."""
    import torch  # noqa: F401  (imported before the baseline, as any user of the engine has it)

    from quickdraft import LLM, SamplingParams
    from quickdraft.bench.memory import PeakMemory

    before = _status_mib()
    with PeakMemory("cpu") as watch:
        llm = LLM(speculative_config=config, kv_cache_dtype=kv_cache_dtype)
    loaded = _status_mib()
    prompts = [json.loads(line)["turns"][0] for line in QUESTIONS.read_text().splitlines()[:questions]]
    for prompt in prompts:  # one at a time: batch 1, as the Spec-Bench runs
        llm.generate([prompt], SamplingParams(max_tokens=max_tokens))
    generated = _status_mib()
    return {
        "before_mib": before,
        "loaded_mib_above": {k: round(loaded[k] - before[k], 1) for k in before},
        "load_peak_mib_above": round(watch.peak_bytes / 2**20 - before["VmRSS"], 1),
        "after_generation_mib_above": {k: round(generated[k] - before[k], 1) for k in before},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child process: the config's name
    args = parser.parse_args()
    if args.one is not None:
        result = measure_one(
            CONFIGS[args.one], kv_cache_dtype=args.kv_cache_dtype, questions=args.questions, max_tokens=args.max_tokens
        )
        print(json.dumps(result))
        return
    results = {}
    for name in CONFIGS:
        child = subprocess.run(
            [sys.executable, __file__, "--one", name, "--questions", str(args.questions),
             "--max-tokens", str(args.max_tokens), "--kv-cache-dtype", args.kv_cache_dtype],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
        results[name] = json.loads(child.stdout.strip().splitlines()[-1])
        loaded, after = results[name]["loaded_mib_above"], results[name]["after_generation_mib_above"]
        print(
            f"{name:26s} loaded +{loaded['VmRSS']:6.1f} MiB (anon {loaded['RssAnon']:.1f})"
            f"  load peak +{results[name]['load_peak_mib_above']:6.1f}"
            f"  after {args.questions} x {args.max_tokens} tokens +{after['VmRSS']:6.1f}",
            flush=True,
        )
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        setting = {"questions": args.questions, "max_tokens": args.max_tokens, "kv_cache_dtype": args.kv_cache_dtype}
        (args.out / "results.json").write_text(json.dumps({"setting": setting, "results": results}, indent=2))


if __name__ == "__main__":
    main()
