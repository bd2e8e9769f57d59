"""What a target forward of T tokens costs (T = 1, 2, 4, ... 64), next to the roofline.

One sequence with a committed context (300 tokens by default) verifies a chain of T new tokens
and needs logits for all of them, as a speculative step does.  Printed per T: the median wall
time over repeats, the weight bytes read once per forward divided by the measured read
bandwidth (the memory roofline), and the multiply-accumulates of the linear layers and the LM
head divided by the best rate the same kernels reach (the compute roofline).  Then prompt
prefill: one forward of P prompt tokens into an empty cache with logits for the last one, as
a request's first step (its TTFT without the scheduling around it).

    python benchmarks/forward_curve.py --dtype auto float32 --repeats 7
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
from bench_decode import read_bandwidth_gbs  # run from benchmarks/ as a script: its folder is on the path

WIDTHS = (1, 2, 4, 8, 16, 32, 64)
PROMPTS = (64, 300, 1000)


def linear_weights(model) -> list:
    weights = [model.lm_head_weight]
    for layer in model.layers:
        weights += [layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj]
    return weights


def weight_nbytes(weight) -> int:
    return weight.nbytes if hasattr(weight, "parts") else weight.numel() * weight.element_size()


def time_forward(engine, *, context: int, width: int, repeats: int) -> float:
    from quickdraft.engine.runner import SequenceWork

    runner = engine.runner
    prefix = [(7 * i) % 1000 + 10 for i in range(context)]
    runner.forward([SequenceWork(slot=0, cache_len=0, token_ids=prefix, logits_nodes=[0])])
    chain = [(13 * i) % 1000 + 10 for i in range(width)]
    work = [SequenceWork(slot=0, cache_len=context, token_ids=chain, logits_nodes=list(range(width)))]
    runner.forward(work)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        runner.forward(work)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_prefill(engine, *, prompt: int, repeats: int) -> float:
    from quickdraft.engine.runner import SequenceWork

    tokens = [(7 * i) % 1000 + 10 for i in range(prompt)]
    work = [SequenceWork(slot=0, cache_len=0, token_ids=tokens, logits_nodes=[prompt - 1])]
    engine.runner.forward(work)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        engine.runner.forward(work)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", nargs="+", default=["auto"], help="auto = GGUF weights as stored")
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--widths", type=int, nargs="+", default=list(WIDTHS), help="tokens per forward")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from quickdraft import LLM

    bandwidth = read_bandwidth_gbs()
    print(
        f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}; read bandwidth {bandwidth:.1f} GB/s (sum of 1 GiB)"
    )
    results = {"bandwidth_gbs": bandwidth, "context": args.context, "runs": []}
    for dtype in args.dtype:
        longest = max(args.context + max(args.widths), max(PROMPTS)) + 8
        llm = LLM(args.model, dtype=dtype, max_model_len=longest, max_num_seqs=1)
        model = llm.engine.model
        weights = linear_weights(model)
        nbytes = sum(weight_nbytes(w) for w in weights)
        macs_per_token = sum(w.shape[0] * w.shape[1] for w in weights)
        times = {
            width: time_forward(llm.engine, context=args.context, width=width, repeats=args.repeats)
            for width in args.widths
        }
        best_rate = max(width * macs_per_token / t for width, t in times.items())
        label = f"{dtype} ({llm.engine.quantization or 'float weights'})"
        print(
            f"\n[{label}] linear weights {nbytes / 1e6:.0f} MB, {macs_per_token / 1e6:.0f} M MAC per token; "
            f"best linear rate seen {best_rate / 1e9:.0f} GMAC/s"
        )
        print(f"{'T':>4}{'ms/forward':>12}{'ms/token':>10}{'memory roof':>13}{'compute roof':>14}")
        rows = []
        for width, seconds in times.items():
            memory_roof = nbytes / bandwidth / 1e9
            compute_roof = width * macs_per_token / best_rate
            rows.append(
                dict(
                    width=width, ms=1e3 * seconds, memory_roof_ms=1e3 * memory_roof, compute_roof_ms=1e3 * compute_roof
                )
            )
            print(
                f"{width:4d}{1e3 * seconds:12.2f}{1e3 * seconds / width:10.2f}{1e3 * memory_roof:13.2f}"
                f"{1e3 * compute_roof:14.2f}"
            )
        prefill = {p: time_prefill(llm.engine, prompt=p, repeats=max(3, args.repeats // 2)) for p in PROMPTS}
        shown = ", ".join(f"{p} tokens {1e3 * t:.1f} ({p / t:.0f})" for p, t in prefill.items())
        print(f"prefill (ms, tokens/s): {shown}")
        results["runs"].append(
            dict(
                dtype=dtype,
                quantization=llm.engine.quantization,
                weight_mb=nbytes / 1e6,
                macs_per_token=macs_per_token,
                rows=rows,
                prefill_ms={str(p): 1e3 * t for p, t in prefill.items()},
            )
        )
        del llm
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
