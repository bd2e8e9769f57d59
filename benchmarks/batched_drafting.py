"""Drafting batched across requests vs one request at a time, paired in one process.

The same engine, the same prompts (first turns of Spec-Bench, interleaved across tasks), greedy,
B requests at once (offline continuous batching with max_num_seqs = B).  "per-request" wraps the
drafter's `propose` so that it is called once per request (what eagle3 / mtp did before they
drafted every request together); "batched" is the drafter as it is.  Runs alternate, so machine
noise hits both alike; the outputs must be identical (greedy, batch-invariant kernels).

    python benchmarks/batched_drafting.py --batch 1 4 8 --spec '{"method": "eagle3", "top_k": 1, "min_draft_prob": 0.2}'
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from sampled_acceptance import QUESTIONS, first_questions

from quickdraft import LLM, SamplingParams


def one_run(llm: LLM, prompts: list[str], *, max_tokens: int, per_request: bool) -> dict:
    drafter = llm.engine.speculator.drafter
    batched = type(drafter).propose.__get__(drafter)
    drafter.propose = (lambda requests: [batched([r])[0] for r in requests]) if per_request else batched
    before = llm.engine.metrics.draft_seconds, llm.engine.metrics.verify_seconds
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "tok_s": tokens / seconds,
        "draft_s": llm.engine.metrics.draft_seconds - before[0],
        "verify_s": llm.engine.metrics.verify_seconds - before[1],
        "outputs": [o.outputs[0].token_ids for o in outputs],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", default='{"method": "eagle3", "top_k": 1, "min_draft_prob": 0.2}')
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    prompts_all = first_questions(QUESTIONS, 2)
    print(f"spec {args.spec}, greedy, {args.max_tokens} tokens, medians of {args.repeats} alternating runs")
    print("| batch | per-request tok/s | batched tok/s | ratio | drafting s per-request -> batched | same outputs |")
    print("|---|---|---|---|---|---|")
    for batch in args.batch:
        llm = LLM(max_model_len=1024, max_num_seqs=batch, speculative_config=json.loads(args.spec))
        prompts = prompts_all[: 2 * batch]  # two waves of requests
        one_run(llm, prompts[:batch], max_tokens=8, per_request=False)  # warm-up
        runs: dict[bool, list[dict]] = {True: [], False: []}
        for _ in range(args.repeats):
            for per_request in (True, False):
                runs[per_request].append(one_run(llm, prompts, max_tokens=args.max_tokens, per_request=per_request))
        med = {k: statistics.median(r["tok_s"] for r in v) for k, v in runs.items()}
        draft = {k: statistics.median(r["draft_s"] for r in v) for k, v in runs.items()}
        same = all(r["outputs"] == runs[True][0]["outputs"] for v in runs.values() for r in v)
        print(
            f"| {batch} | {med[True]:.1f} | {med[False]:.1f} | {med[False] / med[True]:.2f}x "
            f"| {draft[True]:.2f} -> {draft[False]:.2f} | {same} |"
        )


if __name__ == "__main__":
    main()
