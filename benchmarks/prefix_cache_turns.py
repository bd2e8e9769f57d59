"""Second turns of Spec-Bench's multi-turn questions: TTFT with automatic prefix caching vs without.

For each question with two turns: the first turn is answered (greedy, --max-tokens), then the
second turn's prompt is the first turn's tokens, the answer's tokens and the second question
(token ids appended, as a chat server's template would give the same prefix), and its time to
first token is measured.  The two engines (caching on / off) alternate question by question,
so machine noise hits both alike; answers must be identical.

    python benchmarks/prefix_cache_turns.py --questions 12
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from quickdraft import LLM, SamplingParams

QUESTIONS = Path(__file__).resolve().parents[2] / "shared/data/specbench/questions.dev.jsonl"


def second_turn_ttft(llm: LLM, first: str, second: str, *, max_tokens: int) -> tuple[float, list[int], int]:
    """(TTFT of the second turn in seconds, its first tokens, its prompt length)."""
    tokenizer = llm.tokenizer
    first_ids = tokenizer.encode(f"User: {first}\nAssistant:")
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    answer = llm.generate([first_ids], params)[0].outputs[0].token_ids
    follow = tokenizer.encode(f"\nUser: {second}\nAssistant:", add_special_tokens=False)
    prompt = first_ids + answer + follow
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4))[0]
    seconds = out.metrics.first_token_time - out.metrics.arrival_time if out.metrics.first_token_time else 0.0
    return seconds, out.outputs[0].token_ids, len(prompt)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--questions", type=int, default=12, help="multi-turn questions to run")
    parser.add_argument("--max-tokens", type=int, default=128, help="first-turn answer length")
    args = parser.parse_args()
    rows = [json.loads(line) for line in QUESTIONS.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if len(r["turns"]) > 1][: args.questions]
    engines = {on: LLM(max_model_len=2048, enable_prefix_caching=on) for on in (True, False)}
    ttft: dict[bool, list[float]] = {True: [], False: []}
    lengths, same = [], True
    for row in rows:
        answers = {}
        for on, llm in engines.items():
            seconds, tokens, length = second_turn_ttft(llm, *row["turns"][:2], max_tokens=args.max_tokens)
            ttft[on].append(seconds)
            answers[on] = tokens
        lengths.append(length)
        same = same and answers[True] == answers[False]
    cached = engines[True].get_metrics()
    on, off = statistics.median(ttft[True]), statistics.median(ttft[False])
    print(
        f"{len(rows)} second turns, prompts {min(lengths)}-{max(lengths)} tokens (median {statistics.median(lengths)})"
    )
    print(f"TTFT median: prefix caching {on * 1000:.0f} ms, without {off * 1000:.0f} ms, ratio {on / off:.2f}")
    print(f"prefix cache hit rate over every prompt (first turns too): {cached.prefix_cache_hit_rate:.2f}")
    print(f"second-turn answers identical: {same}")


if __name__ == "__main__":
    main()
