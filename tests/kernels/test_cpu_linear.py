"""Tests for quickdraft.kernels.cpu_linear (AVX-512 skinny linear, its float32 AVX2 build, fallback)."""

from __future__ import annotations

import functools
import logging
import threading

import pytest
import torch
import torch.nn.functional as F

from quickdraft.kernels import cpu_linear
from quickdraft.kernels.cpu_linear import kernel_available, skinny_linear


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


HAS_AVX512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"} <= _cpu_flags()
HAS_AVX512_BF16 = HAS_AVX512 and "avx512_bf16" in _cpu_flags()
HAS_AVX2 = {"avx2", "fma"} <= _cpu_flags()  # the 8-lane build

# Tolerances are relative to the magnitude |x| @ |W|^T + |b| of each output.
# fp32: the kernel and F.linear only differ in summation order.
# bf16: both round the fp32 accumulator to bf16 (2^-9 relative each), and
# PyTorch may round once more before adding the bias.
TOL = {torch.float32: 1e-5, torch.bfloat16: 2.0**-7}


@functools.cache
def _weights(n: int, k: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n * 7919 + k)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    return w, b


def _x(m: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + m * 31 + k)
    return torch.randn(m, k, generator=g).to(dtype)


def _assert_close(got, x, w, b, expected=None):
    """got vs F.linear (and vs a float64 reference), magnitude-relative."""
    if expected is None:
        expected = F.linear(x, w, b)
    assert got.dtype == expected.dtype == x.dtype
    assert got.shape == expected.shape
    tol = TOL[w.dtype]
    xf, wf, bf = x.float(), w.float(), None if b is None else b.float()
    mag = F.linear(xf.abs(), wf.abs(), None if bf is None else bf.abs()).double() + 1e-30
    err_ref = ((got.double() - expected.double()).abs() / mag).max().item()
    assert err_ref <= tol, f"vs F.linear: max rel err {err_ref:.3g} > {tol:.3g}"
    if x.numel() * w.shape[0] <= 50_000_000:  # float64 GEMMs are slow on big shapes
        ref64 = F.linear(xf.double(), wf.double(), None if bf is None else bf.double())
        err_64 = ((got.double() - ref64).abs() / mag).max().item()
        assert err_64 <= tol, f"vs float64: max rel err {err_64:.3g} > {tol:.3g}"


needs_kernel = pytest.mark.skipif(not (HAS_AVX512 or HAS_AVX2), reason="CPU lacks AVX-512 and AVX2")


def test_kernel_available():
    if not (HAS_AVX512 or HAS_AVX2):
        pytest.skip("CPU lacks AVX-512 and AVX2")
    assert kernel_available()
    assert kernel_available(torch.bfloat16)


DTYPES = [torch.float32, torch.bfloat16]
MS = [1, 2, 3, 7, 8, 9, 17, 64]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("k", [16, 640, 1000, 2048])
@pytest.mark.parametrize("n", [1, 5, 640, 4096])
def test_matches_f_linear(dtype, k, n):
    w, b = _weights(n, k, dtype)
    for i, m in enumerate(MS):
        x = _x(m, k, dtype)
        bias = b if i % 2 == 0 else None
        _assert_close(skinny_linear(x, w, bias), x, w, bias)
        # the same M with the other bias setting
        other = None if bias is not None else b
        _assert_close(skinny_linear(x, w, other), x, w, other)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("k", [16, 640, 1000, 2048])
def test_large_n_with_tail(dtype, k):
    # 33000 is not a multiple of the 6- or 8-row register blocks.
    n = 33000
    w, b = _weights(n, k, dtype)
    ms = MS if k in (640, 1000) else [1, 3, 9]
    for i, m in enumerate(ms):
        x = _x(m, k, dtype)
        bias = b if i % 2 else None
        _assert_close(skinny_linear(x, w, bias), x, w, bias)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("k", [1, 2, 15, 17, 31, 33, 47, 63, 65])
def test_odd_k(dtype, k):
    w, b = _weights(37, k, dtype)
    for m in (1, 2, 4, 5):
        x = _x(m, k, dtype)
        _assert_close(skinny_linear(x, w, b), x, w, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_non_contiguous_and_nd_inputs(dtype):
    n, k = 640, 1000
    w, b = _weights(n, k, dtype)
    big = _x(6, 2 * k, dtype)
    x = big[:, ::2]  # strided columns
    assert not x.is_contiguous()
    _assert_close(skinny_linear(x, w, b), x, w, b)
    xt = _x(k, 5, dtype).t()  # transposed
    assert not xt.is_contiguous()
    _assert_close(skinny_linear(xt, w, None), xt, w, None)

    x3 = _x(12, k, dtype).view(3, 4, k)
    got = skinny_linear(x3, w, b)
    assert got.shape == (3, 4, n)
    _assert_close(got.reshape(12, n), x3.reshape(12, k), w, b, F.linear(x3, w, b).reshape(12, n))

    x1 = _x(1, k, dtype)[0]
    got1 = skinny_linear(x1, w, b)
    assert got1.shape == (n,)
    _assert_close(got1[None], x1[None], w, b, F.linear(x1, w, b)[None])

    # non-contiguous bias
    bias_nc = _x(1, 2 * n, dtype)[0, ::2]
    _assert_close(skinny_linear(x, w, bias_nc), x, w, bias_nc)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_nan_and_inf_propagate(dtype):
    w, b = _weights(70, 100, dtype)
    for m in (1, 3, 9):
        x = _x(m, 100, dtype).clone()
        x[0, 3] = float("nan")
        x[-1, 99] = float("inf")  # in the masked K tail
        got, ref = skinny_linear(x, w, b), F.linear(x, w, b)
        torch.testing.assert_close(got.isnan(), ref.isnan())
        torch.testing.assert_close(got.isinf(), ref.isinf())
        assert got[0].isnan().all()


@needs_kernel
@pytest.mark.skipif(not HAS_AVX512_BF16, reason="CPU lacks AVX512_BF16")
@pytest.mark.parametrize("mode", [1, 2], ids=["vdpbf16ps", "widen_fma"])
def test_bf16_both_code_paths(mode):
    ext = cpu_linear._extension()
    assert ext is not None
    for n, k in [(640, 1000), (33, 2048), (4096, 640)]:
        w, b = _weights(n, k, torch.bfloat16)
        for m in (1, 2, 3, 4, 7, 9, 64):
            x = _x(m, k, torch.bfloat16)
            _assert_close(ext.skinny_linear(x, w, b, mode), x, w, b)


@needs_kernel
def test_prefetch_setting_does_not_change_results():
    ext = cpu_linear._extension()
    w, b = _weights(4096, 640, torch.float32)
    x = _x(9, 640, torch.float32)
    ref = ext.skinny_linear(x, w, b)
    for pf in (0, 64, 100_000):
        torch.testing.assert_close(ext.skinny_linear(x, w, b, 0, pf), ref, rtol=0, atol=0)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize(("n", "k"), [(640, 640), (2048, 640), (640, 2048), (333, 77)])
def test_a_rows_bits_do_not_depend_on_the_other_rows(dtype, n, k):
    """Batch invariance: a row computed alone, among M rows (past the kernel's row chunk too) or
    at any offset gives the same bits; bfloat16 included (one instruction mode for every M)."""
    w, b = _weights(n, k, dtype)
    rows = 2 * cpu_linear.max_rows(dtype) + 5
    x = _x(rows, k, dtype)
    alone = torch.cat([skinny_linear(x[i : i + 1], w, b) for i in range(rows)])
    torch.testing.assert_close(alone.double(), F.linear(x.double(), w.double(), b.double()), rtol=2e-2, atol=1.0)
    for m in list(range(1, 12)) + [cpu_linear.max_rows(dtype), cpu_linear.max_rows(dtype) + 1, rows]:
        assert torch.equal(skinny_linear(x[:m], w, b), alone[:m]), m
    for start in (1, 3, 50):
        assert torch.equal(skinny_linear(x[start:], w, b), alone[start:]), start
    assert torch.equal(skinny_linear(x[:190].view(5, 38, k), w, b).view(190, n), alone[:190])


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_fallback_gives_same_answer(dtype, monkeypatch):
    w, b = _weights(640, 1000, dtype)
    x = _x(7, 1000, dtype)
    fast = skinny_linear(x, w, b)
    monkeypatch.setattr(cpu_linear, "_extension", lambda: None)
    slow = skinny_linear(x, w, b)
    torch.testing.assert_close(slow, F.linear(x, w, b), rtol=0, atol=0)
    _assert_close(fast, x, w, b, slow)


def test_fallback_cases():
    k, n = 640, 100
    w, b = _weights(n, k, torch.float32)
    x = _x(3, k, torch.float32)
    # non-contiguous weight
    wt = w.t().contiguous().t()
    assert not wt.is_contiguous()
    torch.testing.assert_close(skinny_linear(x, wt, b), F.linear(x, wt, b))
    # unsupported dtypes
    for dt in (torch.float64, torch.float16):
        torch.testing.assert_close(skinny_linear(x.to(dt), w.to(dt), b.to(dt)), F.linear(x.to(dt), w.to(dt), b.to(dt)))
    # mismatched dtypes behave like F.linear (raise)
    with pytest.raises(RuntimeError):
        F.linear(x, w.bfloat16())
    with pytest.raises(RuntimeError):
        skinny_linear(x, w.bfloat16())
    # empty inputs
    assert skinny_linear(x[:0], w, b).shape == (0, n)
    # autograd: falls back and keeps the graph
    xg = x.clone().requires_grad_(True)
    y = skinny_linear(xg, w, b)
    assert y.requires_grad
    y.sum().backward()
    torch.testing.assert_close(xg.grad, w.sum(0).expand(3, k))
    # under no_grad the kernel path is fine even for requires_grad inputs
    with torch.no_grad():
        _assert_close(skinny_linear(xg, w, b), x, w, b)


def test_build_failure_warns_once_and_falls_back(monkeypatch, caplog):
    import torch.utils.cpp_extension as cpp_extension

    def broken_load(*args, **kwargs):
        raise RuntimeError("simulated compiler failure")

    w, b = _weights(64, 32, torch.float32)
    x = _x(2, 32, torch.float32)
    monkeypatch.setattr(cpp_extension, "load", broken_load)
    monkeypatch.setattr(cpu_linear, "_cpu_has", lambda flags: True)
    cpu_linear._load_extension.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=cpu_linear.__name__):
            for _ in range(3):
                torch.testing.assert_close(skinny_linear(x, w, b), F.linear(x, w, b), rtol=0, atol=0)
            assert not kernel_available()
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1
        assert "simulated compiler failure" in warnings[0].getMessage()
    finally:
        monkeypatch.undo()
        cpu_linear._load_extension.cache_clear()


@needs_kernel
def test_thread_safety():
    dtype_cases = [(torch.float32, 1), (torch.bfloat16, 3), (torch.float32, 8), (torch.bfloat16, 17)]
    w32, b32 = _weights(4096, 640, torch.float32)
    w16, b16 = _weights(4096, 640, torch.bfloat16)
    assert kernel_available()  # build before the threads start
    errors: list[BaseException] = []

    def worker(tid: int) -> None:
        try:
            dtype, m = dtype_cases[tid % len(dtype_cases)]
            w, b = (w32, b32) if dtype == torch.float32 else (w16, b16)
            for it in range(20):
                x = _x(m, 640, dtype, seed=tid * 100 + it)
                _assert_close(skinny_linear(x, w, b), x, w, b)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_concurrent_first_use_builds_once(monkeypatch):
    calls = []
    real = cpu_linear._load_extension.__wrapped__

    def counting():
        calls.append(1)
        return real()

    cached = functools.cache(counting)
    monkeypatch.setattr(cpu_linear, "_load_extension", cached)
    threads = [threading.Thread(target=kernel_available) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
