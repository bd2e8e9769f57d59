"""Quantized linear kernels: decoding against gguf-py, kernel == torch reference bit for bit,
accuracy against float64, and batch invariance (a row's bits never depend on the other rows)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType

from quickdraft.kernels.quant_linear import kernel_available, quant_linear, reference_quant_linear
from quickdraft.models.quantized import (
    GGUF_BLOCK,
    SUPPORTED_FORMATS,
    QuantizedWeight,
    decode_gguf,
    pack,
    quantize_q8_0,
    unpack_rows,
)

needs_kernel = pytest.mark.skipif(not kernel_available(), reason="no AVX-512 VNNI kernel on this CPU")

# Byte offsets of the fp16 scale fields in a GGUF block (d, and dmin for Q4_K / Q5_K).
_HALF_FIELDS = {"Q8_0": [0], "Q4_0": [0], "Q5_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def random_gguf(fmt: str, rows: int, cols: int, *, seed: int) -> np.ndarray:
    """Random blocks of `fmt` (every quant and sub-scale bit pattern is valid), finite scales."""
    rng = np.random.default_rng(seed)
    block_bytes, block_values = GGUF_BLOCK[fmt]
    raw = rng.integers(0, 256, size=(rows * cols // block_values, block_bytes), dtype=np.uint8)
    for at in _HALF_FIELDS[fmt]:
        scales = rng.uniform(0.002, 0.02, size=raw.shape[0]).astype(np.float16)
        raw[:, at:at + 2] = scales.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def weight(fmt: str, rows: int, cols: int, *, seed: int = 0) -> tuple[QuantizedWeight, torch.Tensor]:
    raw = random_gguf(fmt, rows, cols, seed=seed)
    reference = torch.from_numpy(gguf.quants.dequantize(raw, QType[fmt]).reshape(rows, cols).copy())
    return QuantizedWeight.from_parts([decode_gguf(fmt, raw, rows=rows, cols=cols)]), reference


def cols_for(fmt: str) -> int:
    return 512 if fmt.endswith("_K") else 96


@pytest.mark.parametrize("fmt", SUPPORTED_FORMATS)
def test_decoded_parts_dequantize_like_gguf_py(fmt):
    raw = random_gguf(fmt, 5, cols_for(fmt), seed=1)
    parts = decode_gguf(fmt, raw, rows=5, cols=cols_for(fmt))
    expected = gguf.quants.dequantize(raw, QType[fmt]).reshape(5, -1)
    assert np.array_equal(parts.dequantize(), expected)


@pytest.mark.parametrize("fmt", SUPPORTED_FORMATS)
@pytest.mark.parametrize("rows", [1, 16, 37])
def test_pack_round_trip(fmt, rows):
    cols = cols_for(fmt)
    parts = decode_gguf(fmt, random_gguf(fmt, rows, cols, seed=rows), rows=rows, cols=cols)
    back = unpack_rows(fmt, pack(parts), rows=np.arange(rows)[::-1], cols=cols)
    for name in ("q", "d", "dmin", "sc", "m"):
        if getattr(parts, name) is not None:
            assert np.array_equal(getattr(back, name), getattr(parts, name)[::-1]), name


def test_quantized_weight_rows_and_fused_parts():
    q5, ref5 = weight("Q5_0", 24, 64, seed=2)  # not whole groups: kept as its own part
    q8, ref8 = weight("Q8_0", 16, 64, seed=3)
    fused = QuantizedWeight.from_parts([decode_gguf("Q5_0", random_gguf("Q5_0", 24, 64, seed=2), rows=24, cols=64),
                                        decode_gguf("Q8_0", random_gguf("Q8_0", 16, 64, seed=3), rows=16, cols=64)])
    assert [p.format for p in fused.parts] == ["Q5_0", "Q8_0"]
    expected = torch.cat([ref5, ref8])
    assert torch.equal(fused.dequantize(), expected)
    index = torch.tensor([[39, 0], [23, 24]])
    assert torch.equal(fused[index], expected[index])
    assert torch.equal(fused[5:9], expected[5:9])
    x = torch.randn(3, 64)
    assert torch.equal(quant_linear(x, fused), torch.cat([quant_linear(x, q5), quant_linear(x, q8)], dim=1))
    with pytest.raises(IndexError):
        fused.rows(torch.tensor([40]))


@pytest.mark.parametrize("fmt", SUPPORTED_FORMATS)
def test_reference_is_close_to_float64(fmt):
    w, dense = weight(fmt, 40, cols_for(fmt), seed=4)
    x = torch.randn(6, cols_for(fmt))
    exact = x.double() @ dense.double().T
    got = reference_quant_linear(x, w).double()
    # int8 activations: ~0.4% of a block's largest value per element, mostly averaging out
    assert (got - exact).abs().max() <= 0.02 * exact.abs().max()
    assert torch.corrcoef(torch.stack([got.flatten(), exact.flatten()]))[0, 1] > 0.9999


@needs_kernel
@pytest.mark.parametrize("fmt", SUPPORTED_FORMATS)
@pytest.mark.parametrize("rows", [1, 16, 45])
def test_kernel_equals_reference_bits(fmt, rows):
    w, _ = weight(fmt, rows, cols_for(fmt), seed=5)
    x = torch.randn(11, cols_for(fmt)) * 3
    x[2] = 0.0  # an all-zero row: zero scales
    bias = torch.randn(rows)
    assert torch.equal(quant_linear(x, w, bias), reference_quant_linear(x, w) + bias)


@needs_kernel
@pytest.mark.parametrize("fmt", SUPPORTED_FORMATS)
def test_batch_invariance_every_width(fmt):
    """Row i computed with 0..63 other rows around it, at every offset: always the same bits."""
    w, _ = weight(fmt, 48, cols_for(fmt), seed=6)
    x = torch.randn(64, cols_for(fmt))
    alone = torch.cat([quant_linear(x[i:i + 1], w) for i in range(64)])
    for width in range(1, 65):
        start = (7 * width) % (65 - width)
        assert torch.equal(quant_linear(x[start:start + width], w), alone[start:start + width]), width
    # rows of other requests mixed in, in another order
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    assert torch.equal(quant_linear(x[perm], w), alone[perm])


def test_reference_batch_invariance():
    w, _ = weight("Q4_K", 20, 256, seed=7)
    x = torch.randn(9, 256)
    alone = torch.cat([reference_quant_linear(x[i:i + 1], w) for i in range(9)])
    assert torch.equal(reference_quant_linear(x, w), alone)


def test_quantize_q8_0_matches_gguf_py():
    w = torch.randn(8, 64) * 0.1
    w[3] = 0.0
    expected = gguf.quants.quantize(w.numpy(), QType.Q8_0)
    parts = quantize_q8_0(w)
    ours = decode_gguf("Q8_0", expected, rows=8, cols=64)
    assert np.array_equal(parts.q, ours.q) and np.array_equal(parts.d, ours.d)


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="not whole blocks"):
        decode_gguf("Q4_K", np.zeros(144, np.uint8), rows=1, cols=128)
    with pytest.raises(ValueError, match="needs 34 bytes"):
        decode_gguf("Q8_0", np.zeros(30, np.uint8), rows=1, cols=32)
    with pytest.raises(ValueError, match="unsupported GGUF format"):
        decode_gguf("Q2_K", np.zeros(84, np.uint8), rows=1, cols=256)
    w, _ = weight("Q8_0", 16, 64)
    with pytest.raises(ValueError, match="features"):
        quant_linear(torch.randn(2, 32), w)
