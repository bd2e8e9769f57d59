"""Position-keyed draws from rows of logits in C++ (``csrc/keyed_draw.cpp``): temperature, top_k,
top_p, min_p and the exponential race in one pass per row, with the bits of the torch reference
(``verify.sampler.sampling_weights`` then ``sample_keyed``).  None where it cannot run (not a CPU
float32 tensor, no AVX2, no compiler): the caller runs the reference."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from quickdraft.kernels.build import LazyKernel

__all__ = ["keyed_draw_rows", "row_logprobs", "sampling_weights_rows"]

# Top lists longer than this go to torch.topk: the kernel keeps its top list by insertion.
MAX_KERNEL_TOP = 64

# -ffp-contract=off: the exp polynomial's multiplies and adds round one by one, as torch's do.
_KERNEL = LazyKernel(
    "keyed_draw_v2", source="keyed_draw.cpp", extra_cflags=("-ffp-contract=off",), what="the torch keyed draw"
)


def kernel_available() -> bool:
    """Whether the C++ kernel runs here (building it on first use)."""
    return _KERNEL.get() is not None


def keyed_draw_rows(
    logits: torch.Tensor,  # [N, V]
    *,
    temperature: Sequence[float],  # [N] > 0
    top_k: Sequence[int],  # [N] in [1, V]; V is off
    top_p: Sequence[float],  # [N] in (0, 1]
    min_p: Sequence[float],  # [N] in [0, 1]
    keys: Sequence[int],  # [N] in [0, 2^64)
) -> torch.Tensor | None:  # [N] int64: a token id, -1 for a row with a NaN, -2 for one with no finite logit
    ext = _extension(logits)
    if ext is None:
        return None
    keys_bits = torch.tensor([key - (1 << 64) if key >= 1 << 63 else key for key in keys], dtype=torch.long)
    return ext.keyed_draw_rows(*_row_tensors(logits, temperature, top_k, top_p, min_p), keys_bits)


def sampling_weights_rows(
    logits: torch.Tensor,  # [N, V]
    *,
    temperature: Sequence[float],
    top_k: Sequence[int],
    top_p: Sequence[float],
    min_p: Sequence[float],
) -> torch.Tensor | None:  # [N, V] float32: the weights keyed_draw_rows races (for tests)
    ext = _extension(logits)
    return None if ext is None else ext.sampling_weights_rows(*_row_tensors(logits, temperature, top_k, top_p, min_p))


def row_logprobs(
    values: torch.Tensor,  # [R, V] raw or processed logits
    token_ids: torch.Tensor,  # [R] int64
    num_top: int,
    *,
    normalize: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(chosen token's value [R], top ids [R, k], top values [R, k], rank [R]) in one read of each
    row (values less the row's logsumexp when `normalize`); None where the kernel cannot run."""
    ext = _extension(values)
    if ext is None or num_top > MAX_KERNEL_TOP:
        return None
    chosen, top_ids, top_values, ranks = ext.row_logprobs(
        values.contiguous(), token_ids.to(torch.long).contiguous(), num_top, normalize
    )
    return chosen, top_ids, top_values, ranks


def _extension(logits: torch.Tensor):
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2:
        return None
    return _KERNEL.get()


def _row_tensors(logits, temperature, top_k, top_p, min_p) -> tuple[torch.Tensor, ...]:
    vocab = logits.shape[1]
    return (
        logits.contiguous(),
        torch.tensor(temperature, dtype=torch.float32),
        torch.tensor([0 if k >= vocab else k for k in top_k], dtype=torch.long),
        torch.tensor(top_p, dtype=torch.float64),
        torch.tensor(min_p, dtype=torch.float32),
    )
