"""The k best tokens of a copy-path draft head's mixture in one C++ call per draft depth
(``csrc/draft_mixture.cpp``), instead of ~25 torch ops.  None where it cannot run (not CPU
float32 tensors, no compiler): the caller runs the torch version."""

from __future__ import annotations

import torch

from quickdraft.kernels.build import LazyKernel

__all__ = ["available", "draft_top_k", "top_k_address"]

# Drafting precision never changes the output: the compiler may reorder the float sums.
_KERNEL = LazyKernel(
    "draft_mixture_v1",
    source="draft_mixture.cpp",
    extra_cflags=("-ffast-math", "-mavx2", "-mfma"),
    what="the torch mixture",
)


def available() -> bool:
    """Whether the kernel is built and runs on this CPU (builds it on first call)."""
    return _KERNEL.get() is not None


def draft_top_k(
    features: torch.Tensor,  # [m, D] the head's outputs
    logits: torch.Tensor,  # [m, Vd] their draft-vocabulary logits
    *,
    query_weight: torch.Tensor,  # [C, D]
    gate_weight: torch.Tensor,  # [1, D]
    gate_bias: torch.Tensor,  # [1]
    keys: torch.Tensor,  # [n, C] the sources' copy keys
    inverse: torch.Tensor,  # [n] index of each source's token in distinct
    distinct: torch.Tensor,  # [U] target ids copied
    distinct_draft_ids: torch.Tensor,  # [U] their draft ids (meaningless outside the vocabulary)
    distinct_in_vocab: torch.Tensor,  # [U] float: 1 inside the draft vocabulary
    copied_draft_id: torch.Tensor,  # [Vd] bool
    d2t: torch.Tensor,  # [Vd] target id of each draft id
    k: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor] | None:  # ids [m, k] int64, log-probabilities [m, k] float32
    floats = (features, logits, query_weight, gate_weight, gate_bias, keys, distinct_in_vocab)
    if any(t.device.type != "cpu" or t.dtype != torch.float32 for t in floats) or keys.shape[0] == 0:
        return None
    ext = _KERNEL.get()
    if ext is None:
        return None
    ids, log_probs = ext.draft_top_k(
        *(t.contiguous() for t in floats[:6]),
        inverse.contiguous(),
        distinct.contiguous(),
        distinct_draft_ids.contiguous(),
        distinct_in_vocab.contiguous(),
        copied_draft_id.contiguous(),
        d2t.contiguous(),
        k,
        eps,
    )
    return ids, log_probs


def top_k_address() -> int | None:
    """Where the kernel's mixture function starts, for a chain grown in one call by the quantized
    kernels' module (``draft_chain`` in csrc/quant_linear.cpp), or None where it is not built."""
    ext = _KERNEL.get()
    return None if ext is None else int(ext.mixture_top_k_address())
