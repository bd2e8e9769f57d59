"""Plain-decoding speed of quickdraft vs transformers, in one run, on the same weights.

Prints batch-1 decode tokens/s (medians over prompts x repeats) for quickdraft and for
transformers `generate` at the same dtype and on the same prompts, quickdraft's batch-8
aggregate throughput, and the weight bandwidth a decode step achieves against the
machine's measured read bandwidth (the roofline of batch-1 decoding).

    python benchmarks/bench_decode.py --dtype float32 bfloat16 --new-tokens 64 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

PROMPTS = [
    "The capital of France is",
    "Write a short story about a robot who learns to paint.",
    "def quicksort(arr):\n",
    "Explain why the sky is blue in simple terms.",
    "List three benefits of regular exercise:",
    "Translate to French: The weather is nice today.",
    "Summarize the plot of Romeo and Juliet.",
    "What is the derivative of x^3 + 2x?",
]


def read_bandwidth_gbs(size_mb: int = 1024, repeats: int = 10) -> float:
    """Median GB/s of summing a tensor far larger than the caches (what a matvec must stream)."""
    data = torch.ones(size_mb * 1024 * 1024 // 4)
    data.sum()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        times.append(time.perf_counter() - start)
    return data.numel() * 4 / statistics.median(times) / 1e9


def weight_bytes_per_step(model) -> int:
    """Bytes of weights a decode step reads: every layer matrix, the norms and the LM head once.

    The embedding lookup reads one row, so a tied embedding counts once (as the LM head).
    """
    total = 0
    for name, tensor in model.state_dict().items():
        if name.startswith("rotary"):
            continue
        total += tensor.numel() * tensor.element_size()
    return total


def quickdraft_decode(llm, prompts, new_tokens, repeats) -> list[float]:
    from quickdraft import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    rates = []
    for _ in range(repeats):
        for prompt in prompts:
            m = llm.generate([prompt], params)[0].metrics
            rates.append((m.num_generation_tokens - 1) / (m.e2e - m.ttft))
    return rates


def quickdraft_batch(llm, prompts, new_tokens, repeats) -> list[float]:
    """Aggregate generated tokens/s with all prompts decoded together (prefill excluded)."""
    from quickdraft import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    rates = []
    for _ in range(repeats):
        outs = llm.generate(prompts, params)
        first = max(o.metrics.first_token_time for o in outs)
        last = max(o.metrics.finished_time for o in outs)
        tokens_after_first = sum(o.metrics.num_generation_tokens - 1 for o in outs)
        rates.append(tokens_after_first / (last - first))
    return rates


def transformers_decode(model_dir, dtype, prompts, new_tokens, repeats) -> list[float]:
    """transformers generate: decode rate = (N - 1) / (time(N tokens) - time(1 token))."""
    import transformers

    tokenizer_ids = _encode_with_quickdraft(model_dir, prompts)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()

    def run(ids, n):
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        return time.perf_counter() - start

    run(tokenizer_ids[0], 4)
    rates = []
    for _ in range(repeats):
        for ids in tokenizer_ids:
            rates.append((new_tokens - 1) / (run(ids, new_tokens) - run(ids, 1)))
    return rates


def _encode_with_quickdraft(model_dir, prompts):
    from quickdraft.models.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(model_dir)
    return [tokenizer.encode(p) for p in prompts]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: embedded Gemma 3 270M")
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args()

    from quickdraft import LLM
    from quickdraft.models.loader import resolve_model_dir

    model_dir = resolve_model_dir(args.model)
    prompts = PROMPTS[: args.num_prompts]
    bandwidth = read_bandwidth_gbs()
    print(
        f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}; measured read bandwidth {bandwidth:.1f} GB/s"
    )
    print(
        f"model: {model_dir}; greedy, {args.new_tokens} new tokens, {len(prompts)} prompts x "
        f"{args.repeats} repeats, medians"
    )
    results = {"bandwidth_gbs": bandwidth, "runs": []}
    for dtype in args.dtype:
        llm = LLM(str(model_dir), dtype=dtype, max_model_len=1024, max_num_seqs=8)
        step_bytes = weight_bytes_per_step(llm.engine.model)
        ours = statistics.median(quickdraft_decode(llm, prompts, args.new_tokens, args.repeats))
        batch8 = statistics.median(quickdraft_batch(llm, PROMPTS[:8], args.new_tokens, args.repeats))
        del llm
        peer = None
        if not args.no_transformers:
            peer = statistics.median(
                transformers_decode(model_dir, getattr(torch, dtype), prompts, args.new_tokens, args.repeats)
            )
        achieved = ours * step_bytes / 1e9
        row = dict(
            dtype=dtype,
            quickdraft_tps=ours,
            transformers_tps=peer,
            batch8_tps=batch8,
            step_weight_mb=step_bytes / 1e6,
            achieved_gbs=achieved,
        )
        results["runs"].append(row)
        print(f"\n[{dtype}] weights read per step {step_bytes / 1e6:.0f} MB")
        print(
            f"  quickdraft  batch 1: {ours:7.1f} tokens/s  -> {achieved:5.1f} GB/s of weights "
            f"({100 * achieved / bandwidth:.0f}% of measured bandwidth)"
        )
        if peer is not None:
            print(f"  transformers batch 1: {peer:7.1f} tokens/s   ratio quickdraft/transformers {ours / peer:.2f}x")
        print(f"  quickdraft  batch 8: {batch8:7.1f} tokens/s aggregate = {batch8 / ours:.2f}x batch 1")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
