"""Greedy token choice: the argmax of each row of logits, as ``torch.argmax`` answers it.

On the CPU, float32 rows go to ``csrc/argmax.cpp`` (every thread on every row, at memory
speed); elsewhere, and where the kernel cannot be built, ``torch.argmax``.  Same answer either
way: the first index of the maximum, or of the first NaN.
"""

from __future__ import annotations

import torch

from quickdraft.kernels.build import LazyKernel

__all__ = ["argmax_rows"]

_KERNEL = LazyKernel("argmax_v2", source="argmax.cpp", what="torch.argmax")


def kernel_available() -> bool:
    """Whether the C++ kernel runs here (building it on first use)."""
    return _KERNEL.get() is not None


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:  # logits [M, V] -> [M] int64
    if logits.dim() != 2:
        raise ValueError(f"argmax_rows needs [M, V] logits, got shape {tuple(logits.shape)}")
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.shape[1] > 0:
        ext = _KERNEL.get()
        if ext is not None:
            return ext.argmax_rows(logits.contiguous())
    return logits.argmax(dim=-1)
