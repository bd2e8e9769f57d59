"""LoRA adapters: what an adapter costs a decode step, and what speculation gives with one.

No LoRA adapter of Gemma 3 270M ships in a package here, so the benchmark writes random ones in
PEFT's layout (every projection of every layer, `--rank`, A ~ N(0, 1/K), B ~ N(0, `--b-std`):
small enough that the answers stay text, large enough to change them; the figures are about cost,
which does not depend on what the adapter learned). Spec-Bench first turns (`--per-task` of each
task of questions.dev.jsonl) as `quickdraft bench specbench` prompts them, greedy, the embedded
model, configurations interleaved per question in one process, prefix cache reset before each:

- batch 1: an engine without enable_lora; the LoRA engine on a base request; the same with an
  adapter; suffix speculation with the adapter and on a base request;
- batch 4 (adapter 1, adapter 2, base, adapter 1): plain vs suffix on the LoRA engine.

Each speculative output is compared with its plain counterpart, and the LoRA engine's base
requests with the engine without LoRA.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from results_files import save_results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=Path, default=Path("../shared/data/specbench/questions.dev.jsonl"))
    parser.add_argument("--per-task", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--b-std", type=float, default=0.02)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from quickdraft import LLM, LoRARequest, SamplingParams
    from quickdraft.bench.specbench import load_questions
    from quickdraft.models.lora import write_random_adapter

    without = LLM(max_model_len=4096)
    llm = LLM(max_model_len=4096, enable_lora=True, max_loras=2, max_lora_rank=args.rank)
    root = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    config = llm.engine.model_config
    paths = [
        write_random_adapter(root / f"a{i}", config=config, rank=args.rank, b_std=args.b_std, seed=i) for i in (1, 2)
    ]
    adapters = [LoRARequest(f"random-{i}", i, str(path)) for i, path in enumerate(paths, start=1)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    for engine in (without, llm):
        engine.generate(["Warm up"], SamplingParams(max_tokens=4, temperature=0.0))
    llm.generate(["Warm up"], SamplingParams(max_tokens=4, temperature=0.0), lora_request=adapters[0])
    suffix = {"method": "suffix"}
    single = {
        "no enable_lora, base": (without, None, None),
        "enable_lora, base": (llm, None, None),
        "enable_lora, adapter": (llm, None, adapters[0]),
        "suffix, adapter": (llm, suffix, adapters[0]),
        "suffix, base": (llm, suffix, None),
    }
    batch_loras = [adapters[0], adapters[1], None, adapters[0]]
    batched = {"batch of 4, plain": None, "batch of 4, suffix": suffix}
    rows: dict[str, list[dict]] = {name: [] for name in [*single, *batched]}
    questions = load_questions(args.questions, per_task=args.per_task)
    for question in questions:
        prompt = f"Question: {question.turns[0]}\nAnswer:"
        for config, (engine, speculative, adapter) in single.items():
            rows[config].append(
                _timed(engine, [prompt], params, speculative=speculative, loras=[adapter], question=question)
            )
        for config, speculative in batched.items():
            rows[config].append(
                _timed(llm, [prompt] * 4, params, speculative=speculative, loras=batch_loras, question=question)
            )
        for config in rows:
            last = rows[config][-1]
            print(
                f"{question.question_id:4d} {config:22s} {last['tokens']:4d} tok {last['seconds']:6.2f} s", flush=True
            )
    report = summary(rows) + (
        f"\n{len(questions)} questions, {args.max_tokens} tokens, greedy; adapters of rank {args.rank} on every "
        f"projection (B std {args.b_std}).\n"
    )
    print(report)
    save_results(args.out, rows=rows, report=report)


def _timed(llm, prompts, params, *, speculative, loras, question) -> dict:
    llm.engine.set_speculative_config(speculative)
    llm.engine.reset_prefix_cache()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, lora_request=loras)
    seconds = time.perf_counter() - start
    return {
        "question_id": question.question_id,
        "category": question.category,
        "tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
        "seconds": seconds,
        "forwards": max(o.metrics.num_target_forwards for o in outputs),
        "token_ids": [o.outputs[0].token_ids for o in outputs],
    }


def summary(rows: dict[str, list[dict]]) -> str:
    reference = {
        "no enable_lora, base": "no enable_lora, base",
        "enable_lora, base": "no enable_lora, base",
        "enable_lora, adapter": "enable_lora, adapter",
        "suffix, adapter": "enable_lora, adapter",
        "suffix, base": "enable_lora, base",
        "batch of 4, plain": "batch of 4, plain",
        "batch of 4, suffix": "batch of 4, plain",
    }
    lines = [
        "| config | tok/s | vs its plain | identical to | answers changed by the adapter |",
        "|---|---|---|---|---|",
    ]
    total = {config: sum(r["seconds"] for r in runs) for config, runs in rows.items()}
    base_answers = [r["token_ids"][0] for r in rows["enable_lora, base"]]
    for config, runs in rows.items():
        tokens = sum(r["tokens"] for r in runs)
        plain = reference[config]
        identical = sum(r["token_ids"] == p["token_ids"] for r, p in zip(runs, rows[plain]))
        changed = ""
        if config == "enable_lora, adapter":
            changed = f"{sum(r['token_ids'][0] != b for r, b in zip(runs, base_answers))}/{len(runs)}"
        lines.append(
            f"| {config} | {tokens / total[config]:.1f} | {total[plain] / total[config]:.2f}x | "
            f"{plain}: {identical}/{len(runs)} | {changed} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
