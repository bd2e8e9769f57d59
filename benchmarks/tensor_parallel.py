"""Plain greedy decode speed with the target split over 1 vs N processes, in one run.

Loads the same model once per tensor-parallel size (the embedded Gemma 3 270M by default: its
GGUF weights as stored with --dtype auto, dequantized with float32 / bfloat16), decodes each
prompt alone (batch 1) and all prompts together, and prints tokens/s, the ratio to 1 process,
and whether the greedy outputs agree.

    python benchmarks/tensor_parallel.py --sizes 1 2 --new-tokens 128 --dtype auto
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

from quickdraft import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "Write a short story about a robot who learns to paint.",
]


def measure(llm: LLM, prompts: list[str], new_tokens: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=8))  # warm up kernels and caches
    llm.engine.reset_prefix_cache()
    alone, outputs = [], []
    for prompt in prompts:
        start = time.perf_counter()
        out = llm.generate(prompt, params)[0]
        alone.append(new_tokens / (time.perf_counter() - start))
        outputs.append(out.outputs[0].token_ids)
    llm.engine.reset_prefix_cache()
    start = time.perf_counter()
    llm.generate(prompts, params)
    batched = len(prompts) * new_tokens / (time.perf_counter() - start)
    return {"batch1_tok_s": sorted(alone)[len(alone) // 2], "batched_tok_s": batched, "outputs": outputs}


def _median_run(runs: list[dict]) -> dict:
    def median(values: list[float]) -> float:
        return sorted(values)[len(values) // 2]

    return {
        "batch1_tok_s": median([r["batch1_tok_s"] for r in runs]),
        "batched_tok_s": median([r["batched_tok_s"] for r in runs]),
        "outputs": runs[0]["outputs"],
        "same_every_repeat": all(r["outputs"] == runs[0]["outputs"] for r in runs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF dir or .gguf (default: the embedded Gemma 3 270M)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    print(f"machine: {platform.processor() or platform.machine()}, {cores} cores; torch {torch.__version__}")
    print(f"load average before: {os.getloadavg()}")
    # Every size loaded at once (idle followers only wait), then measured in turns: a change in
    # the machine's load during the run hits every size alike.
    llms = {
        size: LLM(args.model, dtype=args.dtype, max_model_len=512, tensor_parallel_size=size) for size in args.sizes
    }
    runs: dict[int, list[dict]] = {size: [] for size in args.sizes}
    for _ in range(args.repeats):
        for size, llm in llms.items():
            # Rank 0's threads are a process-wide setting that the last engine loaded set: each
            # size measures with its own share (cores // size), as a lone engine of it would.
            torch.set_num_threads(max(1, cores // size))
            runs[size].append(measure(llm, PROMPTS, args.new_tokens))
    for llm in llms.values():
        llm.close()
    print(f"load average after: {os.getloadavg()}")
    results = {size: _median_run(r) for size, r in runs.items()}
    base = results[args.sizes[0]]
    for size, r in results.items():
        same = r["outputs"] == base["outputs"]
        print(
            f"tp={size}: batch-1 {r['batch1_tok_s']:.1f} tok/s ({r['batch1_tok_s'] / base['batch1_tok_s']:.2f}x), "
            f"batch-{len(PROMPTS)} {r['batched_tok_s']:.1f} tok/s ({r['batched_tok_s'] / base['batched_tok_s']:.2f}x), "
            f"greedy output equal to tp={args.sizes[0]}: {same}"
        )
    print(json.dumps({str(k): {n: v for n, v in r.items() if n != "outputs"} for k, r in results.items()}), flush=True)


if __name__ == "__main__":
    main()
