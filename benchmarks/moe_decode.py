"""A mixture-of-experts forward's cost at real layer widths: a random Qwen3-MoE checkpoint with
Qwen3-30B-A3B's layer shapes (hidden 2048, experts of 768, top 8, 32 query / 4 key heads of 128)
but few layers and experts, quantized to Q8_0 at load, timed per decode forward (median over
repeats, one sequence with `--context` cached tokens, `--rows` new tokens).  Run it once per code
version (PYTHONPATH=<other checkout>) to compare the per-expert work around the kernels.

    python benchmarks/moe_decode.py --checkpoint /tmp/moe-ckpt --rows 1 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.conftest's tokenizer helper


def qwen3_30b_a3b_layers(*, layers: int, experts: int, vocab_size: int, **extra):
    """A Qwen3MoeConfig with Qwen3-30B-A3B's layer shapes, `layers` layers of `experts` experts."""
    import transformers

    return transformers.Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=experts,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        **extra,
    )


def build_checkpoint(path: Path, *, layers: int, experts: int) -> None:
    import transformers

    from tests.conftest import write_tiny_tokenizer

    config = qwen3_30b_a3b_layers(layers=layers, experts=experts, vocab_size=4096)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).float().eval().save_pretrained(path)
    write_tiny_tokenizer(path, bos="<s>", eos="</s>", chat=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, required=True, help="built here when missing")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    if not (args.checkpoint / "config.json").is_file():
        build_checkpoint(args.checkpoint, layers=args.layers, experts=args.experts)
    from quickdraft import LLM
    from quickdraft.engine.runner import SequenceWork

    llm = LLM(str(args.checkpoint), quantization="q8_0", max_model_len=args.context + 64, max_num_seqs=1)
    runner = llm.engine.runner
    runner.forward([SequenceWork(slot=0, cache_len=0, token_ids=list(range(10, 10 + args.context)), logits_nodes=[0])])
    result = {}
    for rows in args.rows:
        work = [
            SequenceWork(
                slot=0, cache_len=args.context, token_ids=list(range(100, 100 + rows)), logits_nodes=list(range(rows))
            )
        ]
        runner.forward(work)
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            runner.forward(work)
            times.append(time.perf_counter() - start)
        result[rows] = round(statistics.median(times) * 1e3, 2)
    print(json.dumps({"ms_per_forward_by_rows": result, "layers": llm.engine.model_config.num_layers}))


if __name__ == "__main__":
    main()
