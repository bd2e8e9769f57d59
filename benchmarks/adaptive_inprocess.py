"""Adaptive speculation against always-on and plain decoding, in one process, at batch sizes.

For each batch size B: three LLMs (plain, always-on, adaptive; the same speculative config),
2 * B first turns of Spec-Bench questions (interleaved across tasks) generated greedily with
max_num_seqs = B (two waves of continuous batching), the three modes alternating for `--repeats`
rounds after a warm-up; medians of tokens per second and the ratio to plain.  Outputs are
checked against plain decoding's (greedy, batch-invariant kernels: identical), and adaptive's
choices are counted (share of decoding steps without a draft).

    python benchmarks/adaptive_inprocess.py --batch 1 4 16 --max-tokens 64 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from sampled_acceptance import QUESTIONS, first_questions

from quickdraft import LLM, SamplingParams

DEFAULT_SPEC = '{"method": "eagle3", "top_k": 1, "num_speculative_tokens": 8, "min_draft_prob": 0.2}'


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", default=DEFAULT_SPEC)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    spec = json.loads(args.spec)
    configs = {"plain": None, "always-on": spec, "adaptive": dict(spec, adaptive=True)}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    print(f"spec {args.spec}, greedy, {args.max_tokens} tokens, medians of {args.repeats} alternating rounds")
    print("| batch | plain tok/s | always-on | adaptive | adaptive plain steps | outputs identical |")
    print("|---|---|---|---|---|---|")
    for batch in args.batch:
        prompts = first_questions(QUESTIONS, 4)[: 2 * batch]
        llms = {mode: LLM(max_model_len=1024, max_num_seqs=batch, speculative_config=c) for mode, c in configs.items()}
        for llm in llms.values():
            llm.generate(prompts[:batch], SamplingParams(temperature=0.0, max_tokens=8))  # warm-up
        rates: dict[str, list[float]] = {mode: [] for mode in configs}
        identical, plain_steps, steps = True, 0, 0
        for _ in range(args.repeats):
            reference = None
            for mode, llm in llms.items():
                start = time.perf_counter()
                outputs = llm.generate(prompts, params)
                seconds = time.perf_counter() - start
                rates[mode].append(sum(len(o.outputs[0].token_ids) for o in outputs) / seconds)
                tokens = [o.outputs[0].token_ids for o in outputs]
                reference = reference or tokens
                identical &= tokens == reference
                if mode == "adaptive":
                    for o in outputs:
                        choices = o.metrics.draft_length_choices
                        plain_steps += choices[0] if choices else 0
                        steps += sum(choices)
        plain = statistics.median(rates["plain"])
        ratio = {mode: statistics.median(r) / plain for mode, r in rates.items()}
        print(
            f"| {batch} | {plain:.1f} | {ratio['always-on']:.3f}x | {ratio['adaptive']:.3f}x "
            f"| {plain_steps / max(1, steps):.0%} | {'yes' if identical else 'NO'} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
