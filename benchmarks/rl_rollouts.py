"""GRPO-like rollouts: n sampled completions of each prompt with the logprobs an RL trainer reads.

Spec-Bench first turns (every k-th question of `questions.dev.jsonl`), `n` completions each at
temperature 1, `max_tokens` tokens, `logprobs=0` under `logprobs_mode="processed_logprobs"`, one
`generate` call for all prompts (the engine runs `--max-num-seqs` sequences at a time).  One LLM
per configuration in one process, the configurations alternated round by round; the prefix cache
is reset before each round.  Every configuration's tokens and logprobs are compared with plain
decoding's (keyed draws: the same seeds give the same completions, whatever drafts).  Prints the
median tokens per second of each configuration and its ratio to plain decoding.

    python benchmarks/rl_rollouts.py --out benchmarks/rl-rollouts-2026-12-06-zen4
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from results_files import save_results  # run from benchmarks/: its folder is on the path

from quickdraft import LLM, SamplingParams

QUESTIONS = Path(__file__).resolve().parents[2] / "shared/data/specbench/questions.dev.jsonl"
CONFIGS = {
    "plain": None,
    "suffix": {"method": "suffix"},
    "suffix adaptive": {"method": "suffix", "adaptive": True},
    "eagle3 adaptive": {"method": "eagle3", "adaptive": True},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--every", type=int, default=7, help="take every k-th question")
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    questions = [json.loads(line) for line in QUESTIONS.read_text().splitlines()]
    prompts = [item["turns"][0] for item in questions[:: args.every][: args.prompts]]
    params = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.max_tokens, seed=11, logprobs=0)
    llms = {
        name: LLM(max_num_seqs=args.max_num_seqs, logprobs_mode="processed_logprobs", speculative_config=config)
        for name, config in CONFIGS.items()
    }
    seconds: dict[str, list[float]] = {name: [] for name in CONFIGS}
    same: dict[str, bool] = dict.fromkeys(CONFIGS, True)
    reference = None
    for _ in range(args.rounds):
        for name, llm in llms.items():
            llm.reset_prefix_cache()
            started = time.perf_counter()
            results = llm.generate(prompts, params)
            seconds[name].append(time.perf_counter() - started)
            answers = [[(c.token_ids, c.logprobs) for c in result.outputs] for result in results]
            if name == "plain":
                reference = answers
            same[name] &= answers == reference
    num_tokens = sum(len(tokens) for answer in reference or [] for tokens, _ in answer)
    plain = statistics.median(seconds["plain"])
    rows = [
        {
            "config": name,
            "tok_per_s": num_tokens / statistics.median(seconds[name]),
            "vs_plain": plain / statistics.median(seconds[name]),
            "seconds_by_round": seconds[name],
            "acceptance_length": llms[name].get_metrics().acceptance_length,
            "identical_to_plain": same[name],
        }
        for name in CONFIGS
    ]
    lines = [
        f"# GRPO-like rollouts: {len(prompts)} Spec-Bench first turns x n={args.n}, temperature 1, "
        f"{args.max_tokens} tokens, processed logprobs, {args.max_num_seqs} sequences at a time, "
        f"{args.rounds} rounds (median)",
        "",
        "| config | tok/s | vs plain | acceptance length | tokens and logprobs identical to plain |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['config']} | {r['tok_per_s']:.1f} | {r['vs_plain']:.2f}x | {r['acceptance_length'] or 1.0:.2f} "
        f"| {'yes' if r['identical_to_plain'] else 'NO'} |"
        for r in rows
    ]
    report = "\n".join(lines) + "\n"
    print(report)
    save_results(args.out, rows=rows, report=report)


if __name__ == "__main__":
    main()
