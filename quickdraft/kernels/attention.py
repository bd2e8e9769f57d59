"""Batch-invariant attention on the CPU (``csrc/attention.cpp``).

``attention(q, keys, values, mask=..., scale=...)`` gives every (query, head) the same bits
whatever else is in the call: how many tree nodes, which mask, which threads.  Built for
AVX-512, else for AVX2 and FMA; bfloat16 and float16 inputs are widened to float32 for it.
On CUDA it is torch's scaled_dot_product_attention over fixed-size chunks of query rows
(kernels/fixed_rows.py); where neither can run (an older CPU, a head_dim that is not a multiple
of 16, other devices) plain SDPA, which is exact to rounding but not batch-invariant.
"""

from __future__ import annotations

from types import ModuleType

import torch

from quickdraft.kernels.build import LazyKernel
from quickdraft.kernels.fixed_rows import fixed_rows_attention, sdpa_rows

__all__ = ["attention", "kernel_available"]

_WIDENED = (torch.bfloat16, torch.float16)

# -ffp-contract=off: the same bits as the copy of attend_row inside the fused decoder layer.
# The AVX-512 build first; CPUs without it (AMD Zen 2/3, older Intel) take the AVX2 build,
# batch-invariant too (with bits of its own).
_KERNELS = (
    LazyKernel("attention_v2", source="attention.cpp", extra_cflags=("-ffp-contract=off",), what="the AVX2 build"),
    LazyKernel(
        "attention_avx2_v2",
        source="attention.cpp",
        extra_cflags=("-ffp-contract=off", "-DQD_ISA_AVX2"),
        what="scaled_dot_product_attention",
    ),
)


def _extension() -> ModuleType | None:
    for kernel in _KERNELS:
        module = kernel.get()
        if module is not None:
            return module
    return None


def kernel_available() -> bool:
    return _extension() is not None


def attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    *,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [H]
) -> torch.Tensor:
    """q [T, H, D], keys / values [Hkv, S, D], mask [T, S] bool (True = may attend) or None
    (all) -> [T, H, D].  softcap: scores become softcap * tanh(score / softcap) (Gemma 2).
    sinks: per head a logit joining each softmax's denominator, its weight going nowhere (gpt-oss)."""
    if q.is_cpu and q.dtype in _WIDENED and keys.dtype == q.dtype and q.shape[-1] % 16 == 0 and kernel_available():
        # bfloat16 / float16 layers on the CPU: widened exactly and run by the float32 kernel, so
        # they are batch-invariant too (torch's attention is not), and rounded once at the end.
        widened = attention(
            q.float(),
            keys.float().contiguous(),
            values.float().contiguous(),
            mask=mask,
            scale=scale,
            softcap=softcap,
            sinks=None if sinks is None else sinks.float(),
        )
        return widened.to(q.dtype)
    usable = (
        q.dtype == torch.float32
        and q.is_cpu
        and keys.dtype == torch.float32
        and q.shape[-1] % 16 == 0
        and keys.stride(-1) == 1
        and keys.stride(1) == q.shape[-1]
        and values.stride() == keys.stride()
    )
    ext = _extension() if usable else None
    if ext is not None:
        return ext.attention(q, keys, values, mask, scale, softcap or 0.0, None if sinks is None else sinks.float())
    if q.is_cuda:  # SDPA picks its kernel by row count: fixed-size calls keep rows' bits
        return fixed_rows_attention(q, keys, values, mask=mask, scale=scale, softcap=softcap, sinks=sinks)
    return sdpa_rows(q, keys, values, mask=mask, scale=scale, softcap=softcap, sinks=sinks)
