"""Grammar masks applied to logits in place: ``logits[r, t] = -inf`` where bit t of row r is 0.

On the CPU, float32 rows go to ``csrc/token_mask.cpp`` (reads the bitmask once, writes only
forbidden entries); elsewhere, and where the kernel cannot be built, the same result in torch
(the bits unpacked to a bool mask on the logits' device).
"""

from __future__ import annotations

import torch

from quickdraft.kernels.build import LazyKernel

__all__ = ["apply_token_bitmask"]

_KERNEL = LazyKernel("token_mask_v1", source="token_mask.cpp", what="torch bit unpacking")


def kernel_available() -> bool:
    """Whether the C++ kernel runs here (building it on first use)."""
    return _KERNEL.get() is not None


def apply_token_bitmask(
    logits: torch.Tensor,  # [N, V] any float dtype, modified in place
    bitmask: torch.Tensor,  # [N, ceil(V / 32)] int32 on the CPU: bit t of row r = token t allowed
) -> None:
    if logits.dim() != 2 or bitmask.dim() != 2 or bitmask.shape[0] != logits.shape[0]:
        raise ValueError(f"logits {tuple(logits.shape)} and bitmask {tuple(bitmask.shape)} do not fit")
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():
        ext = _KERNEL.get()
        if ext is not None:
            ext.apply_token_bitmask(logits, bitmask.contiguous())
            return
    vocab = logits.shape[1]
    bits = torch.arange(32, dtype=torch.int32, device=logits.device)
    words = bitmask.to(logits.device)
    allowed = ((words.unsqueeze(-1) >> bits) & 1).bool().view(words.shape[0], -1)[:, :vocab]  # [N, V]
    logits.masked_fill_(~allowed, float("-inf"))
