"""Plain decoding under a two-token ``allowed_token_ids`` (yes / no answers), embedded model:
every row through the whole LM head (``SPARSE_ROW_LIMIT`` patched to 0) against only the allowed
tokens' logits (the default for <= 256 allowed tokens). Rounds alternate; medians; greedy, 64
tokens, batch 1.

    .venv/bin/python benchmarks/allowed_tokens.py --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time

PROMPT = "Answer each question with yes or no.\nIs the sky blue? yes\nIs fire cold? no\nIs water wet?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    import quickdraft.engine.engine as engine_module
    from quickdraft import LLM, SamplingParams

    llm = LLM(max_model_len=512)
    tokenizer = llm.engine.tokenizer
    allowed = sorted({tokenizer.encode(" yes")[-1], tokenizer.encode(" no")[-1]})
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, allowed_token_ids=allowed, ignore_eos=True)
    limits = {"whole LM head": 0, "allowed tokens only": engine_module.SPARSE_ROW_LIMIT}
    rates: dict[str, list[float]] = {mode: [] for mode in limits}
    tokens: dict[str, list[int]] = {}
    for _ in range(args.rounds):
        for mode, limit in limits.items():
            engine_module.SPARSE_ROW_LIMIT = limit
            start = time.perf_counter()
            out = llm.generate([PROMPT], params)[0]
            rates[mode].append(args.max_tokens / (time.perf_counter() - start))
            tokens[mode] = out.outputs[0].token_ids
    for mode, values in rates.items():
        print(f"{mode}: {statistics.median(values):.1f} tok/s (rounds {', '.join(f'{v:.1f}' for v in values)})")
    print(f"allowed {allowed}; same tokens: {len(set(map(tuple, tokens.values()))) == 1}")


if __name__ == "__main__":
    main()
