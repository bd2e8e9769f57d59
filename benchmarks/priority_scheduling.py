"""Priority scheduling under a busy engine: how soon urgent requests start and finish.

A batch of background requests (priority 1) fills the engine's slots and its waiting line, then
urgent requests (priority 0) arrive. Under "fcfs" they wait behind the whole line; under
"priority" each takes the next free slot. One process, the embedded model, greedy; the same
requests under both policies, each run twice alternating. Prints the urgent requests' time to
first token and end-to-end latency (medians, seconds) and the background ones' end-to-end.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from results_files import save_results


def run(llm, *, prompts: list[str], background: int, urgent: int, max_tokens: int, prioritized: bool) -> dict:
    from quickdraft import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    started = time.perf_counter()
    ids = {}
    for index in range(background):
        rank = 1 if prioritized else 0
        ids[engine.add_request(prompt=prompts[index % len(prompts)], params=params, priority=rank)] = "background"
    engine.step()  # the background line is in: the engine is busy when the urgent ones come
    for index in range(urgent):
        ids[engine.add_request(prompt=prompts[-1 - index % len(prompts)], params=params, priority=0)] = "urgent"
    arrived = time.perf_counter()
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            now = time.perf_counter()
            if delta.token_ids and delta.request_id not in first:
                first[delta.request_id] = now
            if delta.finished:
                done[delta.request_id] = now
    urgent_ids = [request_id for request_id, kind in ids.items() if kind == "urgent"]
    background_ids = [request_id for request_id, kind in ids.items() if kind == "background"]
    for request_id in ids:
        engine.release(request_id)
    return {
        "urgent_ttft": statistics.median(first[i] - arrived for i in urgent_ids),
        "urgent_e2e": statistics.median(done[i] - arrived for i in urgent_ids),
        "background_e2e": statistics.median(done[i] - started for i in background_ids),
        "total": max(done.values()) - started,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--background", type=int, default=12)
    parser.add_argument("--urgent", type=int, default=2)
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from quickdraft import LLM

    prompts = [
        "Write a short story about a lighthouse keeper.",
        "Explain how a bicycle stays upright.",
        "List the planets of the solar system and one fact about each.",
        "Describe the water cycle to a child.",
    ]
    llms = {
        policy: LLM(max_model_len=512, max_num_seqs=args.max_num_seqs, scheduling_policy=policy)
        for policy in ("fcfs", "priority")
    }
    rows: dict[str, list[dict]] = {policy: [] for policy in llms}
    for _ in range(args.rounds):
        for policy, llm in llms.items():
            llm.engine.reset_prefix_cache()
            result = run(
                llm,
                prompts=prompts,
                background=args.background,
                urgent=args.urgent,
                max_tokens=args.max_tokens,
                prioritized=policy == "priority",
            )
            rows[policy].append(result)
            print(policy, {key: round(value, 2) for key, value in result.items()}, flush=True)
    lines = [
        f"{args.background} background + {args.urgent} urgent requests, {args.max_num_seqs} slots, "
        f"{args.max_tokens} tokens each, greedy, medians over {args.rounds} rounds (seconds)",
        "",
        "| policy | urgent TTFT | urgent end-to-end | background end-to-end | all done |",
        "|---|---|---|---|---|",
    ]
    for policy, results in rows.items():

        def median(key: str, results: list[dict] = results) -> float:
            return statistics.median(result[key] for result in results)

        lines.append(
            f"| {policy} | {median('urgent_ttft'):.2f} | {median('urgent_e2e'):.2f} | "
            f"{median('background_e2e'):.2f} | {median('total'):.2f} |"
        )
    report = "\n".join(lines) + "\n"
    print(report)
    save_results(args.out, rows=rows, report=report)


if __name__ == "__main__":
    main()
