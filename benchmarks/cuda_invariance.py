"""Which of the torch operations the float path runs on CUDA keep a row's bits whatever the
number of rows beside it (batch invariance), and a Gemma-3-270M-shaped forward's cost there.

For each operation and dtype: the row counts M at which row 0 of an M-row call differs from the
same row computed alone.  Run where a GPU is lent (scripts/cuda-check.sh); prints one JSON line
per probe.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

ROWS = (2, 3, 4, 5, 8, 9, 16, 17, 32, 63, 64, 128, 512)


def differing_rows(op, x: torch.Tensor, *, reference_rows: int = 1) -> list[int]:  # x [max(ROWS), ...]
    """The row counts at which row 0 differs from row 0 of a `reference_rows`-row call."""
    reference = op(x[:reference_rows])[:1]
    return [m for m in ROWS if not torch.equal(op(x[:m])[:1], reference)]


def probe_linear(dtype: torch.dtype, *, n: int, k: int) -> dict:
    generator = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(n, k, device="cuda", generator=generator).to(dtype)
    x = torch.randn(max(ROWS), k, device="cuda", generator=generator).to(dtype)

    def linear(rows: torch.Tensor) -> torch.Tensor:
        return F.linear(rows, weight)

    return {
        "op": f"linear {n}x{k}",
        "differs_at_rows": differing_rows(linear, x),
        "differs_from_two_rows_at": differing_rows(linear, x, reference_rows=2),
    }


def probe_fixed_rows(dtype: torch.dtype, *, n: int = 2048, k: int = 640, heads: int = 4, head_dim: int = 256) -> dict:
    """The float path's calls on CUDA (kernels/fixed_rows.py): rows at every count and offset,
    and attention over extra masked keys (a tree's siblings) as well."""
    from quickdraft.kernels.fixed_rows import fixed_rows_attention, fixed_rows_linear

    generator = torch.Generator(device="cuda").manual_seed(3)
    weight = torch.randn(n, k, device="cuda", generator=generator).to(dtype)
    x = torch.randn(max(ROWS), k, device="cuda", generator=generator).to(dtype)
    alone = torch.cat([fixed_rows_linear(x[i : i + 1], weight, None) for i in range(8)])
    linear_bad = [
        m for m in ROWS if not torch.equal(fixed_rows_linear(x[:m], weight, None)[: min(m, 8)], alone[: min(m, 8)])
    ]
    offset_bad = [
        s
        for s in (1, 5, 63, 64, 100)
        if not torch.equal(fixed_rows_linear(x[s:], weight, None)[:1], fixed_rows_linear(x[s : s + 1], weight, None))
    ]
    keys = torch.randn(1, 310, head_dim, device="cuda", generator=generator).to(dtype)
    values = torch.randn(1, 310, head_dim, device="cuda", generator=generator).to(dtype)
    q = torch.randn(max(ROWS), heads, head_dim, device="cuda", generator=generator).to(dtype)
    single = fixed_rows_attention(q[:1], keys[:, :300], values[:, :300], mask=None, scale=head_dim**-0.5)
    attention_bad = []
    for m in ROWS:
        mask = torch.ones(m, 310, dtype=torch.bool, device="cuda")
        mask[:, 300:] = False  # keys of other tree nodes, not this row's ancestors
        out = fixed_rows_attention(q[:m], keys, values, mask=mask, scale=head_dim**-0.5)
        if not torch.equal(out[:1], single):
            attention_bad.append(m)
    return {
        "op": "fixed_rows",
        "linear_differs_at_rows": linear_bad,
        "linear_differs_at_offsets": offset_bad,
        "attention_differs_at_rows": attention_bad,
    }


def probe_attention(dtype: torch.dtype, *, heads: int = 4, kv_heads: int = 1, head_dim: int = 256, keys: int = 300):
    generator = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(max(ROWS), heads, head_dim, device="cuda", generator=generator).to(dtype)
    k = torch.randn(kv_heads, keys, head_dim, device="cuda", generator=generator).to(dtype)
    v = torch.randn(kv_heads, keys, head_dim, device="cuda", generator=generator).to(dtype)

    def attend(rows: torch.Tensor) -> torch.Tensor:
        mask = torch.ones(rows.shape[0], keys, dtype=torch.bool, device="cuda")
        out = F.scaled_dot_product_attention(
            rows.transpose(0, 1)[None], k[None], v[None], attn_mask=mask, scale=head_dim**-0.5, enable_gqa=True
        )
        return out[0].transpose(0, 1)

    return {"op": f"sdpa H{heads}/{kv_heads} D{head_dim} S{keys}", "differs_at_rows": differing_rows(attend, q)}


def probe_rms_norm(dtype: torch.dtype, *, width: int = 640) -> dict:
    generator = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(max(ROWS), width, device="cuda", generator=generator).to(dtype)
    weight = torch.randn(width, device="cuda", generator=generator)

    def norm(rows: torch.Tensor) -> torch.Tensor:
        wide = rows.float()
        return (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + 1e-6) * weight).to(dtype)

    return {"op": f"rms_norm {width}", "differs_at_rows": differing_rows(norm, x)}


def time_forward(dtype: str, *, widths: tuple[int, ...], repeats: int, device: str) -> list[dict]:
    """ms per forward of a random Gemma-3-270M-shaped model (18 layers, 262k vocabulary) on CUDA
    through the engine's runner: the per-forward cost on a GPU, most of it launch overhead."""
    import tempfile
    from pathlib import Path

    import transformers

    from quickdraft.engine.runner import SequenceWork
    from quickdraft.verify.tree import Tree
    from tests.models.test_decoder import make_runner

    config = transformers.Gemma3TextConfig(
        hidden_size=640,
        intermediate_size=2048,
        num_hidden_layers=18,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        vocab_size=262144,
        sliding_window=512,
        query_pre_attn_scalar=256,
        max_position_embeddings=4096,
    )
    results = []
    with tempfile.TemporaryDirectory() as directory:
        transformers.Gemma3ForCausalLM(config).save_pretrained(directory)
        runner, cache = make_runner(
            Path(directory), dtype=getattr(torch, dtype), max_len=1024, block_size=16, device=torch.device(device)
        )
        context = list(range(5, 405))
        runner.forward([SequenceWork(slot=0, cache_len=0, token_ids=context)])
        cache.commit(0, len(context))
        for width in widths:
            work = [
                SequenceWork(
                    slot=0,
                    cache_len=len(context),
                    token_ids=list(range(7, 7 + width)),
                    tree=Tree.chain(width),
                    logits_nodes=list(range(width)),
                )
            ]
            runner.forward(work)
            synchronize(device)
            start = time.perf_counter()
            for _ in range(repeats):
                runner.forward(work)
            synchronize(device)
            ms = 1000 * (time.perf_counter() - start) / repeats
            results.append({"forward": dtype, "device": device, "rows": width, "ms": round(ms, 3)})
    return results


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--widths", type=int, nargs="*", default=[1, 4, 16, 64], help="none: no forward timing")
    parser.add_argument("--device", default="cuda", help="cpu: only the forward timing, as a reference")
    args = parser.parse_args()
    if args.device == "cuda":
        tf32 = torch.backends.cuda.matmul.allow_tf32
        print(json.dumps({"torch": torch.__version__, "device": torch.cuda.get_device_name(), "tf32": tf32}))
    for dtype in (torch.float32, torch.bfloat16) if args.device == "cuda" else ():
        for probe in (
            probe_linear(dtype, n=2048, k=640),
            probe_linear(dtype, n=640, k=2048),
            probe_linear(dtype, n=262144, k=640),
            probe_attention(dtype),
            probe_rms_norm(dtype),
            probe_fixed_rows(dtype),
        ):
            print(json.dumps({"dtype": str(dtype).removeprefix("torch."), **probe}), flush=True)
    for dtype in ("float32", "bfloat16") if args.widths else ():
        for row in time_forward(dtype, widths=tuple(args.widths), repeats=args.repeats, device=args.device):
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
