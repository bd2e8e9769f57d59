"""Batch invariance on CUDA by fixed shapes.

torch's GPU matmul and attention choose their kernels, and with them the order in which a row's
products are added, by the number of rows: measured on an H200 (torch 2.11, cuBLAS 13), a float32
linear computes one row with other kernels than 2 rows and 2 rows with others than 5-16, and so
does float32 SDPA (``benchmarks/cuda_invariance.py``).  Called with the same number of rows every
time -- the rows split into chunks of ``FIXED_ROWS``, the last one padded with zeros -- every call
runs the kernel of that one shape, and a row's bits follow from its own inputs (measured there:
every row count 1..512 and offset, and attention over a tree's extra masked keys).  A decode row
then costs a 64-row matmul, which on a GPU reads the same weights in about the same time; the
padding's extra launches are what it costs.  bfloat16 and float16 take torch's calls as they are:
there they kept every row's bits as measured (and tested: tests/engine/test_cuda.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["FIXED_ROWS", "fixed_rows_attention", "fixed_rows_linear", "sdpa_rows"]

FIXED_ROWS = 64


def _padded(rows: torch.Tensor) -> torch.Tensor:  # [M, ...] -> [ceil(M / FIXED_ROWS) * FIXED_ROWS, ...]
    missing = -rows.shape[0] % FIXED_ROWS
    if not missing:
        return rows
    return torch.cat([rows, rows.new_zeros(missing, *rows.shape[1:])])


def fixed_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` (x [..., K], weight [N, K]); in float32 every matmul over
    FIXED_ROWS rows."""
    if x.dtype != torch.float32:
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    out = _by_chunks(lambda chunk, _: F.linear(chunk, weight, bias), _padded(rows), None)
    return out[: rows.shape[0]].view(*x.shape[:-1], weight.shape[0])


def fixed_rows_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    *,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [H]
) -> torch.Tensor:
    """q [T, H, D], keys / values [Hkv, S, D], mask [T, S] bool or None (all) -> [T, H, D]; in
    float32 every SDPA call over FIXED_ROWS query rows with a mask (padding rows attend to every
    key)."""
    count = q.shape[0]
    if q.dtype != torch.float32:
        return sdpa_rows(q, keys, values, mask=mask, scale=scale, softcap=softcap, sinks=sinks)
    if mask is None:
        mask = torch.ones(count, keys.shape[1], dtype=torch.bool, device=q.device)
    padded_q = _padded(q)
    padded_mask = torch.cat([mask, mask.new_ones(len(padded_q) - count, mask.shape[1])])

    def attend(chunk: torch.Tensor, chunk_mask: torch.Tensor) -> torch.Tensor:
        return sdpa_rows(chunk, keys, values, mask=chunk_mask, scale=scale, softcap=softcap, sinks=sinks)

    return _by_chunks(attend, padded_q, padded_mask)[:count]


def _by_chunks(call, rows: torch.Tensor, masks: torch.Tensor | None) -> torch.Tensor:
    """call(rows chunk, its masks or None) over each FIXED_ROWS chunk of padded `rows` [M, ...],
    the results concatenated in order."""
    chunks = [
        call(rows[start : start + FIXED_ROWS], None if masks is None else masks[start : start + FIXED_ROWS])
        for start in range(0, len(rows), FIXED_ROWS)
    ]
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks)


def sdpa_rows(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    *,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [H]
) -> torch.Tensor:  # q [T, H, D], keys / values [Hkv, S, D] -> [T, H, D]
    """torch's scaled_dot_product_attention in this layout (grouped query heads included); with a
    soft cap or sinks (which SDPA cannot apply) the same steps written out."""
    if softcap or sinks is not None:
        return _explicit_attention(q, keys, values, mask=mask, scale=scale, softcap=softcap, sinks=sinks)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        keys[None],
        values[None],
        attn_mask=mask,
        scale=scale,
        enable_gqa=keys.shape[0] != q.shape[1],
    )  # [1, H, T, D]
    return out[0].transpose(0, 1)


def _explicit_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    *,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None,  # [H]
) -> torch.Tensor:  # q [T, H, D], keys / values [Hkv, S, D] -> [T, H, D]
    group = q.shape[1] // keys.shape[0]
    k = keys.repeat_interleave(group, dim=0)  # [H, S, D]
    v = values.repeat_interleave(group, dim=0)
    scores = torch.matmul(q.transpose(0, 1).float(), k.transpose(1, 2).float()) * scale  # [H, T, S]
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if mask is not None:
        scores = scores.masked_fill(~mask[None], float("-inf"))
    if sinks is None:
        weights = torch.softmax(scores, dim=-1).to(v.dtype)
    else:  # a sink column in each head's softmax, dropped after it
        sink_column = sinks.float()[:, None, None].expand(-1, scores.shape[1], 1)  # [H, T, 1]
        weights = torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1)[..., :-1].to(v.dtype)
    return torch.matmul(weights, v).transpose(0, 1)  # [T, H, D]
