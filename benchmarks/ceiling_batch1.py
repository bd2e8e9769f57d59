"""The ceiling of batch-1 speculation on Spec-Bench: a drafter that is always right, beside ours.

For each question (first turns of the first `--per-task` questions per task of
questions.dev.jsonl), greedy and sampled (temperature 0.7, top-p 0.95, seed 1000 + question
number), plain decoding runs first, then each configuration in turn (interleaved, one process):
"ceiling, chain of N" drafts plain's own answer token for token (answer_drafter.py), the most any
drafter proposing chains of N can reach at this engine's step costs; the others are our drafters
as issue 14/17's bars measure them.  Every output is compared with plain decoding's (sampled:
position-keyed draws make the seeded answer the same with or without drafts).

    .venv/bin/python benchmarks/ceiling_batch1.py --out benchmarks/ceiling-batch1-DATE
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from answer_drafter import AnswerDrafter
from results_files import save_results, totals

QUESTIONS = Path(__file__).resolve().parents[2] / "shared/data/specbench/questions.dev.jsonl"
CEILING_CHAINS = (16, 8)  # 8: the shipped eagle3 head's recommended chain
DRAFTERS = {
    "suffix": {"method": "suffix"},
    "eagle3 (chain of 8, p >= 0.2)": {"method": "eagle3"},
}
MODES = {"greedy": {"temperature": 0.0}, "sampled": {"temperature": 0.7, "top_p": 0.95}}


def first_turns(per_task: int) -> list[str]:
    from quickdraft.bench.specbench import conversation_prompt, load_questions, task_of

    taken: dict[str, int] = {}
    prompts = []
    for question in load_questions(QUESTIONS):
        task = task_of(question.category)
        if taken.get(task, 0) < per_task:
            taken[task] = taken.get(task, 0) + 1
            prompts.append(conversation_prompt(question.turns[:1], []))
    return prompts


def timed(llm, prompt: str, params) -> dict:
    start = time.perf_counter()
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    seconds = time.perf_counter() - start
    metrics = out.metrics
    return {
        "seconds": seconds,
        "decode_seconds": metrics.finished_time - metrics.first_token_time,
        "tokens": len(out.outputs[0].token_ids),
        "forwards": metrics.num_target_forwards,
        "token_ids": list(out.outputs[0].token_ids),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-task", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--modes", nargs="*", default=list(MODES))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from quickdraft import LLM, SamplingParams

    llm = LLM(max_model_len=2048)
    engine = llm.engine
    speculators = {}
    for name, config in DRAFTERS.items():  # one speculator per config, kept across questions (suffix's cache)
        engine.set_speculative_config(config)
        speculators[name] = engine.speculator
    prompts = first_turns(args.per_task)
    ceilings = {f"ceiling, chain of {n}": n for n in CEILING_CHAINS}
    configs = ["plain", *ceilings, *DRAFTERS]
    rows = {mode: {name: [] for name in configs} for mode in args.modes}
    warm = SamplingParams(max_tokens=8, temperature=0.0)
    for name in DRAFTERS:
        engine.set_speculator(speculators[name])
        llm.generate([prompts[0]], warm, use_tqdm=False)
    for index, prompt in enumerate(prompts):
        for mode in args.modes:
            params = SamplingParams(max_tokens=args.max_tokens, seed=1000 + index, **MODES[mode])
            for name in configs:
                if name == "plain":
                    engine.set_speculator(None)
                elif name in ceilings:  # chains of up to ceilings[name] tokens (num_speculative_tokens)
                    answer = rows[mode]["plain"][-1]["token_ids"]
                    engine.set_drafter(AnswerDrafter(answer), num_speculative_tokens=ceilings[name])
                else:
                    engine.set_speculator(speculators[name])
                engine.reset_prefix_cache()
                row = timed(llm, prompt, params)
                row["identical"] = row["token_ids"] == rows[mode]["plain"][-1]["token_ids"] if name != "plain" else True
                rows[mode][name].append(row)
        print(f"question {index + 1}/{len(prompts)} done", flush=True)
    report = "\n".join(summary(mode, rows[mode]) for mode in args.modes)
    print(report)
    save_results(args.out, rows=rows, report=report)


def summary(mode: str, runs: dict[str, list[dict]]) -> str:
    plain = runs["plain"]
    plain_seconds, plain_decode = totals(plain, "seconds", "decode_seconds")
    lines = [
        f"### {mode}, {len(plain)} questions, batch 1",
        "",
        "| config | tok/s | vs plain (whole requests) | vs plain (after the first token) | tokens/forward | "
        "identical to plain |",
        "|---|---|---|---|---|---|",
    ]
    for name, rows in runs.items():
        tokens, seconds, decode, forwards = totals(rows, "tokens", "seconds", "decode_seconds", "forwards")
        lines.append(
            f"| {name} | {tokens / seconds:.1f} | {plain_seconds / seconds:.2f}x | {plain_decode / decode:.2f}x | "
            f"{tokens / max(forwards, 1):.2f} | {sum(r['identical'] for r in rows)}/{len(rows)} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
