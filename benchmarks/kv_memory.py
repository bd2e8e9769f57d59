"""KV cache memory of the embedded Gemma 3 270M at a long context: what one request holds, and
what the engine's pool reserves, with sliding-window layers giving back blocks behind their window
(this code) against every layer keeping every position (before it).

One request with a prompt of --context tokens (Spec-Bench questions, concatenated) decodes
--max-tokens greedy tokens; after each step the blocks its slot holds in each layer group are
read from the cache.  "Before" is what the full-attention group holds (every position) times all
layers: the cache then had one table for every layer.

    python benchmarks/kv_memory.py --context 4000
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from quickdraft import LLM, SamplingParams

QUESTIONS = Path(__file__).resolve().parents[2] / "shared/data/specbench/questions.dev.jsonl"


def long_prompt(llm: LLM, num_tokens: int) -> list[int]:
    ids: list[int] = []
    for line in QUESTIONS.read_text().splitlines():
        for turn in json.loads(line)["turns"]:
            ids += llm.tokenizer.encode(turn, add_special_tokens=not ids)
            if len(ids) >= num_tokens:
                return ids[:num_tokens]
    raise SystemExit(f"the questions hold fewer than {num_tokens} tokens")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=4000, help="prompt tokens")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=8, help="slots of the pool figure")
    parser.add_argument("--output", type=Path, help="write the figures as JSON here")
    args = parser.parse_args()
    llm = LLM(max_model_len=args.context + args.max_tokens + 8, max_num_seqs=args.max_num_seqs)
    engine, cache = llm.engine, llm.engine.cache
    config = engine.model_config
    token_bytes = 2 * config.num_kv_heads * config.head_dim * cache.keys[0].element_size()  # per layer
    block_bytes = [len(group.layers) * token_bytes * cache.block_size for group in cache.groups]
    engine.add_request(
        prompt_token_ids=long_prompt(llm, args.context),
        params=SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True),
    )
    held, context = [0] * len(cache.groups), 0
    while engine.has_unfinished_requests():
        engine.step()
        for request in engine.scheduler.running:
            held = cache.held_blocks(request.scheduled_slot)
            context = request.num_computed_tokens
    full_group = next(i for i, group in enumerate(cache.groups) if group.window is None)
    after = sum(n * b for n, b in zip(held, block_bytes))
    before = held[full_group] * cache.block_size * config.num_layers * token_bytes
    pool_before = args.max_num_seqs * cache.blocks_per_slot * cache.block_size * config.num_layers * token_bytes
    figures = {
        "model": "embedded Gemma 3 270M (KV float32)",
        "context_tokens": context,
        "groups": [
            {"window": g.window, "layers": len(g.layers), "blocks_held": n, "pool_blocks": g.num_blocks}
            for g, n in zip(cache.groups, held)
        ],
        "request_bytes_before": before,
        "request_bytes_after": after,
        "bytes_per_token_before": before / context,
        "bytes_per_token_after": after / context,
        "ratio": after / before,
        "pool_slots": args.max_num_seqs,
        "pool_bytes_before": pool_before,
        "pool_bytes_after": cache.memory_bytes,
        "pool_ratio": cache.memory_bytes / pool_before,
    }
    print(json.dumps(figures, indent=2))
    if args.output:
        args.output.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
