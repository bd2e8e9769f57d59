"""Closed-loop clients in one process: prefill and decodes mix as in a server, without HTTP.

C clients each send their next prompt (first turns of Spec-Bench questions, interleaved across
tasks) as soon as their previous request finishes, driving `Engine.step` directly; plain decoding
and the speculative modes alternate for `--rounds` rounds (each round from an empty prefix cache)
and the medians of output tokens per second are printed with the ratio to plain.  Reproduces the
serving benchmark's mix of prompt chunks and decodes, which `LLM.generate` (every prompt at once)
does not.  Each mode loads its own `LLM`, unless `--shared-engine`: one engine switched between
the modes before each of their rounds, as `quickdraft bench serve` does (the mode order then
rotates each round).

    python benchmarks/closed_loop_clients.py --clients 32 --modes plain adaptive [--shared-engine]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from sampled_acceptance import QUESTIONS, first_questions

from quickdraft import LLM, SamplingParams

DEFAULT_SPEC = '{"method": "eagle3", "top_k": 1, "num_speculative_tokens": 8, "min_draft_prob": 0.2}'


def run_clients(llm: LLM, prompts: list[str], *, clients: int, params: SamplingParams) -> float:
    """Output tokens per second of `clients` closed-loop clients working through `prompts`."""
    engine, queue, tokens = llm.engine, list(prompts), 0
    for _ in range(min(clients, len(queue))):
        engine.add_request(prompt=queue.pop(0), params=params)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for delta in engine.step():
            if delta.finished:
                tokens += len(engine.get_request(delta.request_id).output_token_ids)
                engine.release(delta.request_id)
                if queue:
                    engine.add_request(prompt=queue.pop(0), params=params)
    return tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", default=DEFAULT_SPEC, help="always-on config; adaptive adds adaptive: true")
    parser.add_argument("--modes", nargs="+", default=["plain", "always-on", "adaptive"])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--shared-engine", action="store_true", help="one engine switched between the modes")
    args = parser.parse_args()
    spec = json.loads(args.spec)
    configs = {"plain": None, "always-on": spec, "adaptive": dict(spec, adaptive=True)}
    modes = ["plain", *(m for m in args.modes if m != "plain")]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    if args.shared_engine:
        shared = LLM(max_model_len=args.max_model_len, max_num_seqs=args.clients)
        llms = dict.fromkeys(modes, shared)
    else:
        llms = {
            m: LLM(max_model_len=args.max_model_len, max_num_seqs=args.clients, speculative_config=configs[m])
            for m in modes
        }

    def switched(mode: str) -> LLM:
        if args.shared_engine:
            llms[mode].engine.set_speculative_config(configs[mode])
        return llms[mode]

    room = args.max_model_len - args.max_tokens
    questions = first_questions(QUESTIONS, 16)
    fitting = [q for q in questions if len(llms["plain"].engine.tokenizer.encode(q)) < room]
    prompts = fitting[: args.clients * args.requests_per_client]
    for mode in modes:  # warm-up
        run_clients(switched(mode), prompts[: args.clients], clients=args.clients, params=SamplingParams(max_tokens=8))
    rates: dict[str, list[float]] = {m: [] for m in modes}
    for round_index in range(args.rounds):
        shift = round_index % len(modes) if args.shared_engine else 0
        for mode in modes[shift:] + modes[:shift]:
            llm = switched(mode)
            llm.engine.reset_prefix_cache()
            rates[mode].append(run_clients(llm, prompts, clients=args.clients, params=params))
    plain = statistics.median(rates["plain"])
    print(f"{args.clients} clients x {args.requests_per_client} requests, {args.max_tokens} tokens, spec {args.spec}")
    for mode in modes:
        rounds = ", ".join(f"{r:.1f}" for r in rates[mode])
        median = statistics.median(rates[mode])
        by_round = ", ".join(f"{r / p:.3f}" for r, p in zip(rates[mode], rates["plain"]))
        print(f"{mode}: {median:.1f} tok/s ({rounds}), {median / plain:.3f}x (by round {by_round})")


if __name__ == "__main__":
    main()
