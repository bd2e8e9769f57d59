"""What beam search costs on the embedded model: LLM.beam_search at several widths against greedy
decoding of the same length, on Spec-Bench first turns (`--per-task` of each task), batch of all
prompts at once, one process. Reports seconds, the summed logprob of the best beam against
greedy's (beam search finds likelier continuations, or says it did not), and the prefix cache's
share of each round's prompt tokens (the rounds re-send every beam)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from results_files import save_results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=Path, default=Path("../shared/data/specbench/questions.dev.jsonl"))
    parser.add_argument("--per-task", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from quickdraft import LLM, BeamSearchParams, SamplingParams
    from quickdraft.bench.specbench import load_questions

    llm = LLM(max_model_len=4096, max_num_seqs=32)
    prompts = [f"Question: {q.turns[0]}\nAnswer:" for q in load_questions(args.questions, per_task=args.per_task)]
    llm.generate(["Warm up"], SamplingParams(max_tokens=4, temperature=0.0))
    llm.engine.reset_prefix_cache()
    start = time.perf_counter()
    greedy = llm.generate(prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0.0, logprobs=0))
    greedy_seconds = time.perf_counter() - start
    greedy_logprob = [sum(lp.logprob for lp in out.outputs[0].logprobs) for out in greedy]
    rows = [{"config": "greedy", "seconds": greedy_seconds, "better_than_greedy": None, "cached_share": None}]
    for width in args.widths:
        llm.engine.reset_prefix_cache()
        before = llm.get_metrics()
        prompt_tokens, cached_tokens = before.num_prompt_tokens, before.num_cached_tokens
        start = time.perf_counter()
        results = llm.beam_search(
            [{"prompt": p} for p in prompts],
            BeamSearchParams(beam_width=width, max_tokens=args.max_tokens, length_penalty=0.0),
        )
        seconds = time.perf_counter() - start
        after = llm.get_metrics()
        best = [result.sequences[0].cum_logprob for result in results]
        rows.append(
            {
                "config": f"beam {width}",
                "seconds": seconds,
                "better_than_greedy": sum(b > g + 1e-4 for b, g in zip(best, greedy_logprob)),
                "worse_than_greedy": sum(b < g - 1e-4 for b, g in zip(best, greedy_logprob)),
                "cached_share": (after.num_cached_tokens - cached_tokens)
                / max(1, after.num_prompt_tokens - prompt_tokens),
            }
        )
        print(rows[-1], flush=True)
    lines = [
        f"{len(prompts)} prompts, {args.max_tokens} tokens, all prompts in one call; beams ranked by summed logprob",
        "",
        "| config | seconds | vs greedy | best beam likelier than greedy | less likely | prompt tokens cached |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        cached = "" if row["cached_share"] is None else f"{row['cached_share']:.0%}"
        better = "" if row["better_than_greedy"] is None else f"{row['better_than_greedy']}/{len(prompts)}"
        worse = "" if row["better_than_greedy"] is None else f"{row['worse_than_greedy']}/{len(prompts)}"
        lines.append(
            f"| {row['config']} | {row['seconds']:.2f} | {row['seconds'] / greedy_seconds:.2f}x | {better} | "
            f"{worse} | {cached} |"
        )
    report = "\n".join(lines) + "\n"
    print(report)
    save_results(args.out, rows=rows, report=report)


if __name__ == "__main__":
    main()
