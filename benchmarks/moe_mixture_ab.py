"""In-process A/B of one mixture-of-experts layer's `_mixture` against the previous version (the
per-expert mask / nonzero / argmax lookups, kept below as `previous_mixture`), on the checkpoint
`moe_decode.py` builds (Qwen3-30B-A3B's layer widths, Q8_0 at load): medians of alternated calls,
and the two outputs compared bit for bit.

    python benchmarks/moe_mixture_ab.py --checkpoint /tmp/moe-ckpt
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def previous_mixture(layer, x: torch.Tensor, linear) -> torch.Tensor:  # [N, D] -> [N, D]
    k = layer.experts_per_token
    probs = torch.softmax(linear(x, layer.router, None).float(), dim=-1)
    weights, chosen = probs.topk(k, dim=-1)
    if layer.moe_renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights.to(x.dtype)
    by_rank = x.new_zeros(k, x.shape[0], x.shape[1])
    for expert in chosen.unique().tolist():
        picked = chosen == expert
        rows = picked.any(dim=-1).nonzero().squeeze(1)
        rank = picked.index_select(0, rows).int().argmax(dim=-1)
        out = layer.experts[expert](x.index_select(0, rows), linear=linear, gelu=layer.gelu)
        by_rank[rank, rows] = out * weights[rows, rank][:, None]
    total = by_rank[0]
    for rank in range(1, k):
        total = total + by_rank[rank]
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    from quickdraft import LLM
    from quickdraft.models.layers import default_linear_fn

    llm = LLM(str(args.checkpoint), quantization="q8_0", max_model_len=128, max_num_seqs=1)
    layer = llm.engine.model.layers[0]
    linear = default_linear_fn(torch.device("cpu"))
    for rows in args.rows:
        x = torch.randn(rows, llm.engine.model_config.hidden_size)
        same = torch.equal(layer._mixture(x, linear), previous_mixture(layer, x, linear))
        now, before = [], []
        for _ in range(args.calls):
            start = time.perf_counter()
            layer._mixture(x, linear)
            now.append(time.perf_counter() - start)
            start = time.perf_counter()
            previous_mixture(layer, x, linear)
            before.append(time.perf_counter() - start)
        print(
            f"rows {rows}: now {statistics.median(now) * 1e3:.3f} ms, before {statistics.median(before) * 1e3:.3f} ms,"
            f" bits {'equal' if same else 'DIFFER'}"
        )


if __name__ == "__main__":
    main()
