"""Speculative decoding with a per-request logits processor: what the processor costs and what
speculation still gives (vLLM refuses custom logits processors with speculative decoding).

The processor is a typical filter: a word list banned (its tokens' logits set to -inf), written
as a Python callable, so every verified row pays one Python call. Spec-Bench first turns
(`--per-task` of each task of questions.dev.jsonl), the model's chat-less prompt as in
`quickdraft bench specbench`, greedy, batch 1, the embedded model, configurations interleaved per
question in one process: plain, plain with the processor, suffix, suffix with the processor.
Outputs with the processor are compared with plain decoding's with the processor.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from results_files import save_results

BANNED_WORDS = ["very", " very", "really", " really", "basically", " basically", "!", " !"]
CONFIGS = {
    "plain": (None, False),
    "plain + processor": (None, True),
    "suffix": ({"method": "suffix"}, False),
    "suffix + processor": ({"method": "suffix"}, True),
}


class BanTokens:
    """A logits processor: the given tokens never come."""

    def __init__(self, token_ids: list[int]):
        self.token_ids = sorted(set(token_ids))

    def __call__(self, output_token_ids: list[int], logits):
        logits[self.token_ids] = float("-inf")
        return logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=Path, default=Path("../shared/data/specbench/questions.dev.jsonl"))
    parser.add_argument("--per-task", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from quickdraft import LLM, SamplingParams
    from quickdraft.bench.specbench import load_questions

    llm = LLM(max_model_len=4096)
    banned = BanTokens([t for word in BANNED_WORDS for t in llm.tokenizer.encode(word, add_special_tokens=False)])
    llm.generate(["Warm up"], SamplingParams(max_tokens=4, temperature=0.0))
    questions = load_questions(args.questions, per_task=args.per_task)
    rows: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    for question in questions:
        prompt = f"Question: {question.turns[0]}\nAnswer:"
        for config, (speculative, processed) in CONFIGS.items():
            llm.engine.set_speculative_config(speculative)
            llm.engine.reset_prefix_cache()
            params = SamplingParams(
                temperature=0.0, max_tokens=args.max_tokens, logits_processors=[banned] if processed else None
            )
            start = time.perf_counter()
            out = llm.generate([prompt], params)[0]
            seconds = time.perf_counter() - start
            completion, metrics = out.outputs[0], out.metrics
            rows[config].append(
                {
                    "question_id": question.question_id,
                    "category": question.category,
                    "tokens": len(completion.token_ids),
                    "seconds": seconds,
                    "decode_seconds": metrics.finished_time - metrics.first_token_time,
                    "forwards": metrics.num_target_forwards,
                    "token_ids": completion.token_ids,
                    "banned_seen": sum(t in banned.token_ids for t in completion.token_ids),
                }
            )
            print(
                f"{question.question_id:4d} {question.category:14s} {config:20s} {len(completion.token_ids):4d} tok "
                f"{seconds:6.2f} s {metrics.num_target_forwards:4d} fwd",
                flush=True,
            )
    report = summary(rows) + f"\n{len(questions)} questions, {args.max_tokens} tokens, greedy, batch 1.\n"
    print(report)
    save_results(args.out, rows=rows, report=report)


def summary(rows: dict[str, list[dict]]) -> str:
    lines = [
        "| config | tok/s | vs plain | vs plain + processor | tokens/forward | identical to its plain "
        "| banned tokens out |",
        "|---|---|---|---|---|---|---|",
    ]
    total = {config: sum(r["seconds"] for r in runs) for config, runs in rows.items()}
    for config, runs in rows.items():
        tokens = sum(r["tokens"] for r in runs)
        reference = rows["plain + processor" if "processor" in config else "plain"]
        identical = sum(r["token_ids"] == p["token_ids"] for r, p in zip(runs, reference))
        lines.append(
            f"| {config} | {tokens / total[config]:.1f} | {total['plain'] / total[config]:.2f}x | "
            f"{total['plain + processor'] / total[config]:.2f}x | "
            f"{tokens / max(1, sum(r['forwards'] for r in runs)):.2f} | {identical}/{len(runs)} | "
            f"{sum(r['banned_seen'] for r in runs)} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
