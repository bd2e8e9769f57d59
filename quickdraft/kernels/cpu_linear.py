"""Fast CPU linear layer for small batches (decoding, speculative verification).

``skinny_linear(x, weight, bias)`` computes ``F.linear(x, weight, bias)`` with
an AVX-512 C++ kernel (``csrc/skinny_linear.cpp``; on CPUs with only AVX2 and FMA an 8-lane
build of the same contract) that streams every weight
row once per call, keeps the x rows in cache, accumulates in float32 and
software-prefetches the weights.  For the skinny shapes of batch-1 decoding
(M = 1..64 rows) it runs close to the memory read bandwidth, several times
faster than PyTorch's CPU GEMM on AMD CPUs (see benchmarks/bench_linear.py).

The extension is built lazily on first use with
``torch.utils.cpp_extension.load`` (~15 s with ninja, ~30 s without) and
cached in torch's extensions directory (``TORCH_EXTENSIONS_DIR`` if set).
A row's result does not depend on the other rows of the call (batch invariance): the
kernel computes every row with the same operations whatever M is, and above the rows where
it beats PyTorch's GEMM it runs over chunks of rows rather than handing over to that GEMM,
whose rounding depends on the shape.  Whenever the kernel cannot be used -- tensors not on
the CPU, dtype other than float32/bfloat16 or mismatched, non-contiguous weight, autograd
needed, CPU without AVX-512 or AVX2, build failure -- the call falls back to
``torch.nn.functional.linear`` (not batch-invariant).  A failed
build or an unsupported CPU is logged once (``logging``, this module's logger).

Set ``QUICKDRAFT_DISABLE_CPU_KERNEL=1`` to always use the fallback.
"""

from __future__ import annotations

import functools
import logging
import threading
from types import ModuleType

import torch
import torch.nn.functional as F

from quickdraft.kernels.build import load_kernel

__all__ = ["kernel_available", "max_rows", "skinny_linear"]

logger = logging.getLogger(__name__)

# Bump the version when the C++ interface changes (build_name adds the torch and ninja that build it).
_EXT_NAME = "skinny_linear_v2"

# Rows of x per kernel call; above, the kernel runs over chunks of this many rows.  PyTorch's
# GEMM (MKL / oneDNN) would be about as fast or faster there, but not batch-invariant.
# Measured on Zen 4 (2 threads) with benchmarks/bench_linear.py --force-kernel for the
# Gemma 3 270M shapes: fp32
# is 1.5-1.9x ahead of MKL at M=128 and ~1.1x at 256 (MKL wins from ~512);
# bf16 is 1.1-1.3x ahead of oneDNN at M=64, ~1.1x at 96, about even at 128.
_MAX_ROWS = {torch.float32: 128, torch.bfloat16: 96}

_AVX512_CPU_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "avx2"})
_AVX2_CPU_FLAGS = frozenset({"avx2", "fma"})  # the 8-lane build

# functools.cache alone would let two threads build at the same time.
_LOAD_LOCK = threading.Lock()


def _cpu_has(flags: frozenset[str]) -> bool:
    """Whether the CPU has every one of `flags`."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return flags <= set(line.split(":", 1)[1].split())
    except OSError:
        pass
    # No /proc/cpuinfo: ask what PyTorch itself dispatches to.
    try:
        capabilities = ("AVX512",) if "avx512f" in flags else ("AVX512", "AVX2")
        return torch.backends.cpu.get_cpu_capability() in capabilities
    except Exception:  # pragma: no cover - very old torch
        return False


@functools.cache
def _load_extension() -> ModuleType | None:
    """Build (or load the cached build of) the C++ kernel; None if unusable.

    The only mutable module state of this file is this function's cache.
    """
    if not (_cpu_has(_AVX512_CPU_FLAGS) or _cpu_has(_AVX2_CPU_FLAGS)):
        logger.warning("skinny_linear: CPU lacks AVX-512 and AVX2, using torch.nn.functional.linear")
        return None
    # The translation unit is built for the baseline ISA; the kernels carry their own
    # `#pragma GCC target("avx512...")` and check CPUID at run time, so the module imports (and
    # fails cleanly) on any x86-64 CPU.  load_kernel holds the build lock that survives a process
    # killed mid-build (a server stopped while starting), which torch's own lock file does not.
    return load_kernel(_EXT_NAME, source="skinny_linear.cpp", what="torch.nn.functional.linear")


def _extension() -> ModuleType | None:
    with _LOAD_LOCK:
        return _load_extension()


def kernel_available(dtype: torch.dtype = torch.float32) -> bool:
    """True when a compiled kernel is loaded (builds it on first call) and takes `dtype`."""
    return _extension() is not None and dtype in _MAX_ROWS


def max_rows(dtype: torch.dtype) -> int:
    """Largest number of rows of x for which skinny_linear uses the kernel."""
    return _MAX_ROWS.get(dtype, 0)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, fast on CPU for few rows of x.

    x: [..., K]; weight: [N, K] (nn.Linear layout); bias: [N] or None.
    Returns [..., N] in x's dtype.  float32 and bfloat16 (x, weight and bias
    all of the same dtype) use the kernel, with float32 accumulation; anything
    else goes to ``F.linear``.  Safe to call from several threads (the GIL is
    released while the kernel runs).  No autograd support: with grad enabled
    and a tensor requiring grad, F.linear is used.
    """
    dtype = weight.dtype
    max_m = _MAX_ROWS.get(dtype)
    if (
        max_m is None
        or x.dtype is not dtype
        or not (x.is_cpu and weight.is_cpu)
        or weight.dim() != 2
        or not weight.is_contiguous()
        or (bias is not None and (bias.dtype is not dtype or not bias.is_cpu or bias.dim() != 1))
    ):
        return F.linear(x, weight, bias)
    nd = x.dim()
    if nd == 2:
        M, K = x.shape
    elif nd == 0:
        return F.linear(x, weight, bias)
    else:
        K = x.shape[-1]
        M = x.numel() // K if K else 0
    if M < 1 or K != weight.shape[1] or weight.shape[0] == 0:
        return F.linear(x, weight, bias)
    if torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    ):
        return F.linear(x, weight, bias)
    ext = _extension()
    if ext is None:
        return F.linear(x, weight, bias)
    if M <= max_m:
        return ext.skinny_linear(x, weight, bias)
    # More rows than the kernel's sweet spot: still the kernel, over chunks of rows, because a
    # row's bits must not depend on how many rows share the call (batch invariance; torch's GEMM
    # picks its blocking, and so its rounding, by shape).
    rows = x.reshape(M, K)
    chunks = [ext.skinny_linear(rows[start : start + max_m], weight, bias) for start in range(0, M, max_m)]
    return torch.cat(chunks).view(*x.shape[:-1], weight.shape[0])
