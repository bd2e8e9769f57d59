"""Plain greedy decoding of Spec-Bench first turns on one model file: load time, resident memory,
float weights left in the model, and tokens per second (one process per call, so that an A/B of
two code versions runs each in its own: PYTHONPATH=<other checkout> picks the other version).

    python benchmarks/gguf_file_decode.py model.gguf --per-task 1 --max-num-seqs 1
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from lazy_logits import first_turns  # run from benchmarks/: its folder is on the path

from quickdraft import LLM, SamplingParams

QUESTIONS = Path(__file__).resolve().parents[2] / "shared" / "data" / "specbench" / "questions.dev.jsonl"


def resident_mb() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) / 1024 for line in status if line.startswith("VmRSS"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--questions", type=Path, default=QUESTIONS)
    parser.add_argument("--per-task", type=int, default=1)
    parser.add_argument("--max-num-seqs", type=int, default=1, help="1: batch 1; more: the prompts batched")
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    before = resident_mb()
    start = time.perf_counter()
    llm = LLM(args.model, max_model_len=2048, max_num_seqs=args.max_num_seqs)
    load_s = time.perf_counter() - start
    loaded_mb = resident_mb() - before
    prompts = first_turns(args.questions, args.per_task)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8))  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens))
    seconds = time.perf_counter() - start
    tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
    float_bytes = sum(p.numel() * p.element_size() for p in llm.engine.model.parameters())
    print(
        json.dumps(
            {
                "model": args.model,
                "quantization": llm.engine.quantization,
                "load_s": round(load_s, 1),
                "resident_after_load_mb": round(loaded_mb),
                "resident_after_decoding_mb": round(resident_mb() - before),
                "float_weights_mb": round(float_bytes / 2**20, 1),
                "prompts": len(prompts),
                "max_num_seqs": args.max_num_seqs,
                "tokens": tokens,
                "tok_s": round(tokens / seconds, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
