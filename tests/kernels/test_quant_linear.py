"""Quantized linear kernels: decoding against gguf-py, kernel == torch reference bit for bit,
accuracy against float64, and batch invariance (a row's bits never depend on the other rows).
The kernel tests run once per compiled build this CPU can run (AVX-512 VNNI, AVX2), chosen
with QUICKDRAFT_CPU_ISA."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType

from quickdraft.kernels.quant_linear import (
    AMX_ENV,
    AMX_MIN_ROWS,
    ISA_ENV,
    ISAS,
    NARROW_LM_HEAD_ENV,
    active_isa,
    amx_min_rows,
    fused_layer_available,
    isa_extension,
    lm_head_activation_levels,
    quant_linear,
    quantize_activations,
    reference_quant_linear,
    rows_kernel,
)
from quickdraft.models.quantized import (
    FLOAT16_FORMATS,
    FORMAT_IDS,
    GGUF_BLOCK,
    SUPPORTED_FORMATS,
    TILE_K,
    QuantizedWeight,
    decode_gguf,
    float16_parts,
    pack,
    quantize_legacy,
    quantize_q8_0,
    unpack_rows,
)

# Byte offsets of the fp16 scale fields in a GGUF block (d, and dmin for Q4_K / Q5_K).
_HALF_FIELDS = {
    "Q8_0": [0],
    "Q4_0": [0],
    "Q5_0": [0],
    "Q4_K": [0, 2],
    "Q5_K": [0, 2],
    "Q6_K": [208],
    "IQ4_XS": [0],
    "Q3_K": [108],
    "IQ4_NL": [0],
    "Q4_1": [0, 2],
    "Q5_1": [0, 2],
    "Q2_K": [80, 82],
    "IQ2_XXS": [0],  # no kernel: loaded as floats
    "MXFP4": [],  # its scale is a power of two: _E8M0_FIELD
}
# Byte offset of an E8M0 exponent (a power-of-two scale) in a GGUF block.
_E8M0_FIELD = {"MXFP4": 0}
# The formats with quants (F16 and BF16 hold the values themselves)
QUANT_FORMATS = tuple(fmt for fmt in SUPPORTED_FORMATS if fmt not in FLOAT16_FORMATS)


@pytest.fixture(params=ISAS)
def isa(request, monkeypatch) -> str:
    """Every test that takes it runs on each compiled build this CPU can run."""
    if isa_extension(request.param) is None:
        pytest.skip(f"no {request.param} kernel on this CPU")
    monkeypatch.setenv(ISA_ENV, request.param)
    return request.param


def random_gguf(fmt: str, rows: int, cols: int, *, seed: int, scale: float = 0.01) -> np.ndarray:
    """Random blocks of `fmt` (every quant and sub-scale bit pattern is valid), finite fp16 scales
    within a factor 5 of `scale`; F16 / BF16: normal values of about `scale` (some subnormal)."""
    rng = np.random.default_rng(seed)
    if fmt in FLOAT16_FORMATS:
        values = torch.from_numpy(rng.normal(0, 10 * scale, size=(rows, cols)).astype(np.float32))
        values[0, :3] = torch.tensor([1e-6, -3e-7, 0.0])  # F16 subnormals (BF16: normal)
        dtype = torch.float16 if fmt == "F16" else torch.bfloat16
        return values.to(dtype).view(torch.int16).numpy().view(np.uint8).reshape(rows, -1)
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[QType[fmt]]
    raw = rng.integers(0, 256, size=(rows * cols // block_values, block_bytes), dtype=np.uint8)
    for at in _HALF_FIELDS[fmt]:
        scales = rng.uniform(0.2 * scale, 2 * scale, size=raw.shape[0]).astype(np.float16)
        raw[:, at : at + 2] = scales.view(np.uint8).reshape(-1, 2)
    if fmt in _E8M0_FIELD:  # 2^(e - 128) times levels up to 12: around `scale`, within a factor 4
        center = 128 + round(np.log2(scale / 4))
        raw[:, _E8M0_FIELD[fmt]] = rng.integers(center - 2, center + 3, size=raw.shape[0], dtype=np.uint8)
    return raw.reshape(rows, -1)


def weight(fmt: str, rows: int, cols: int, *, seed: int = 0) -> tuple[QuantizedWeight, torch.Tensor]:
    raw = random_gguf(fmt, rows, cols, seed=seed)
    reference = torch.from_numpy(gguf.quants.dequantize(raw, QType[fmt]).reshape(rows, cols).copy())
    return QuantizedWeight.from_parts([decode_gguf(fmt, raw, rows=rows, cols=cols)]), reference


def cols_for(fmt: str) -> int:
    return 512 if GGUF_BLOCK[fmt][1] == 256 else 96


@pytest.mark.parametrize("fmt", SUPPORTED_FORMATS)
def test_decoded_parts_dequantize_like_gguf_py(fmt):
    """Random blocks reach every quant and sub-scale bit pattern: gguf-py's values bit for bit."""
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
    fused = QuantizedWeight.from_parts(
        [
            decode_gguf("Q5_0", random_gguf("Q5_0", 24, 64, seed=2), rows=24, cols=64),
            decode_gguf("Q8_0", random_gguf("Q8_0", 16, 64, seed=3), rows=16, cols=64),
        ]
    )
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


def test_q8_0_rows_from_the_kernel_are_the_gguf_values(monkeypatch):
    """QuantizedWeight.rows on a one-part Q8_0 weight (an embedding table) reads the packed bytes
    in C++: gguf-py's float32 values for every row asked, in any index shape, with scales of
    every fp16 kind (normal, subnormal, zero, negative, infinite); the numpy path agrees;
    an index out of range is an IndexError."""
    rows, cols = 37, 96
    raw = random_gguf("Q8_0", rows, cols, seed=9)
    blocks = raw.reshape(-1, GGUF_BLOCK["Q8_0"][0])
    special = np.array([6e-8, 3e-5, 0.0, -0.0, -0.013, 65504.0, np.inf, -np.inf], dtype=np.float16)
    blocks[: len(special), 0:2] = special.view(np.uint8).reshape(-1, 2)
    q8 = QuantizedWeight.from_parts([decode_gguf("Q8_0", raw, rows=rows, cols=cols)])
    with np.errstate(invalid="ignore", over="ignore"):
        expected = torch.from_numpy(gguf.quants.dequantize(raw, QType["Q8_0"]).reshape(rows, cols).copy())
    index = torch.tensor([[36, 0, 5], [16, 15, 0]])
    if rows_kernel() is not None:
        got = rows_kernel().dequantize_rows(q8.parts[0].packed, FORMAT_IDS["Q8_0"], rows, cols, index.reshape(-1))
        assert torch.equal(got.view(2, 3, cols).nan_to_num(), expected[index].nan_to_num())
    assert torch.equal(q8.rows(index).nan_to_num(), expected[index].nan_to_num())
    assert torch.equal(q8.dequantize().nan_to_num(), expected.nan_to_num())
    with pytest.raises(IndexError):
        q8.rows(torch.tensor([rows]))
    monkeypatch.setenv(ISA_ENV, "reference")  # the numpy path
    assert rows_kernel() is None
    assert torch.equal(q8.rows(index).nan_to_num(), expected[index].nan_to_num())


@pytest.mark.parametrize("fmt", SUPPORTED_FORMATS)
def test_row_and_column_slices_stay_quantized(fmt):
    """Tensor-parallel shards: row ranges (whole groups as byte slices, others repacked), zero
    padding rows, and column ranges of whole tiles keep every value; the kernel on a slice gives
    the same bits as the matching columns / rows of the kernel on the whole weight."""
    cols = cols_for(fmt) * 2
    _, ref5 = weight("Q5_0", 24, cols, seed=4)  # a part that does not end on a group
    _, ref = weight(fmt, 45, cols, seed=5)
    whole = QuantizedWeight.from_parts(
        [
            decode_gguf("Q5_0", random_gguf("Q5_0", 24, cols, seed=4), rows=24, cols=cols),
            decode_gguf(fmt, random_gguf(fmt, 45, cols, seed=5), rows=45, cols=cols),
        ]
    )
    expected = torch.cat([ref5, ref])
    ranges = [(0, 16), (20, 40), (48, 64), (64, 69)]  # aligned, across parts, mid-part, the tail
    rows = whole.take_rows(ranges, zero_rows=3)
    assert rows.shape == (16 + 20 + 16 + 5 + 3, cols)
    assert torch.equal(rows.dequantize(), torch.cat([expected[a:b] for a, b in ranges] + [torch.zeros(3, cols)]))
    x = torch.randn(5, cols)
    full_out = quant_linear(x, whole)
    sliced_out = quant_linear(x, rows)
    assert torch.equal(sliced_out[:, :-3], torch.cat([full_out[:, a:b] for a, b in ranges], dim=1))
    assert torch.equal(sliced_out[:, -3:], torch.zeros(5, 3))
    width = TILE_K[fmt]
    half = whole.take_columns(cols // 2, cols)  # a multiple of every part's tile width
    assert torch.equal(half.dequantize(), expected[:, cols // 2 :])
    assert torch.equal(quant_linear(x[:, cols // 2 :], half), reference_quant_linear(x[:, cols // 2 :], half))
    with pytest.raises(ValueError, match=f"multiples of {width} columns"):
        whole.take_columns(width // 2, cols)
    with pytest.raises(IndexError):
        whole.take_rows([(60, 70)])


@pytest.mark.parametrize("fmt", SUPPORTED_FORMATS)
def test_reference_is_close_to_float64(fmt):
    w, dense = weight(fmt, 40, cols_for(fmt), seed=4)
    x = torch.randn(6, cols_for(fmt))
    exact = x.double() @ dense.double().T
    got = reference_quant_linear(x, w).double()
    # int8 activations: ~0.4% of a block's largest value per element, mostly averaging out
    assert (got - exact).abs().max() <= 0.02 * exact.abs().max()
    assert torch.corrcoef(torch.stack([got.flatten(), exact.flatten()]))[0, 1] > 0.9999


@pytest.mark.parametrize("fmt", SUPPORTED_FORMATS)
@pytest.mark.parametrize("rows", [1, 16, 45])
@pytest.mark.parametrize("levels", [127, 63])
def test_kernel_equals_reference_bits(isa, fmt, rows, levels):
    """Every format, at both activation quant widths (63: the narrow quants of an AVX2 LM head;
    1 and 2 rows of x take Q8_0's both-halves tiles on AVX2, more rows its half tiles)."""
    assert active_isa() == isa
    w, _ = weight(fmt, rows, cols_for(fmt), seed=5)
    x = torch.randn(11, cols_for(fmt)) * 3
    x[2] = 0.0  # an all-zero row: zero scales
    bias = torch.randn(rows)
    expected = reference_quant_linear(x, w, activation_levels=levels) + bias
    assert torch.equal(quant_linear(x, w, bias, activation_levels=levels), expected)
    for m in (1, 2):
        got = quant_linear(x[:m], w, bias, activation_levels=levels)
        assert torch.equal(got, expected[:m]), m


def test_narrow_activations_are_a_coarser_quantization():
    """63 levels: the same formula with half the resolution (twice the error of 127 levels on
    average, far below the values), not another result; and nothing else is accepted."""
    w, dense = weight("Q8_0", 64, 256, seed=3)
    x = torch.randn(32, 256)
    exact = x.double() @ dense.double().T
    err = {
        levels: (reference_quant_linear(x, w, activation_levels=levels).double() - exact).abs().mean()
        for levels in (127, 63)
    }
    assert 1.5 < err[63] / err[127] < 2.5
    assert err[63] < 0.02 * exact.abs().mean()
    with pytest.raises(ValueError, match="activation_levels must be 127 or 63, got 100"):
        quant_linear(x, w, activation_levels=100)


@pytest.mark.parametrize("setting", [None, "0", "1", "true"])
def test_lm_head_levels_are_narrow_for_q8_0_only_when_asked(monkeypatch, setting):
    if setting is None:
        monkeypatch.delenv(NARROW_LM_HEAD_ENV, raising=False)
    else:
        monkeypatch.setenv(NARROW_LM_HEAD_ENV, setting)
    q8, _ = weight("Q8_0", 16, 64)
    q6, _ = weight("Q6_K", 16, 512)
    assert lm_head_activation_levels(q8) == (63 if setting in ("1", "true") else 127)
    assert lm_head_activation_levels(q6) == 127


@pytest.mark.parametrize("fmt", ["Q8_0", "Q6_K"])
def test_out_buffer_gets_the_same_bits(isa, fmt):
    w, _ = weight(fmt, 37, cols_for(fmt), seed=6)
    x = torch.randn(9, cols_for(fmt))
    memory = torch.full((12, 37), float("nan"))  # stale values must all be overwritten
    out = quant_linear(x, w, out=memory[:9])
    assert out.data_ptr() == memory.data_ptr()
    assert torch.equal(out, quant_linear(x, w))


def test_bad_out_buffer_is_named():
    w, _ = weight("Q8_0", 16, 64)
    x = torch.randn(3, 64)
    with pytest.raises(ValueError, match=r"contiguous float32 \[3, 16\].*\(4, 16\)"):
        quant_linear(x, w, out=torch.empty(4, 16))
    with pytest.raises(ValueError, match="float64"):
        quant_linear(x, w, out=torch.empty(3, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match="not contiguous"):
        quant_linear(x, w, out=torch.empty(16, 3).t())
    with pytest.raises(ValueError, match="no bias"):
        quant_linear(x, w, torch.zeros(16), out=torch.empty(3, 16))


def _cpu_has_amx() -> bool:
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return " amx_int8" in flags and " amx_tile" in flags


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
@pytest.mark.parametrize("m", [1, 5, 12, 16, 17, 20, 40])
@pytest.mark.parametrize("levels", [127, 63])
def test_amx_tiles_compute_the_vnni_bits(monkeypatch, fmt, m, levels):
    """Matmuls on AMX tiles (forced from one row on), on tiles for whole 16-row blocks with the
    rows after them on VNNI (blocks of at least 16 or 12 rows on tiles), and on VNNI alone: the
    reference's bits in every format, for row counts that fill, pad and overflow a 16-row tile,
    45 outputs (a partial group) written at a column offset of a wider output; through
    quant_linear with the tiles used and turned off."""
    ext = isa_extension("avx512")
    if ext is None or not ext.amx_usable():
        assert not _cpu_has_amx() or ext is None  # AMX here must be usable
        pytest.skip("no AMX on this CPU")
    cols = cols_for(fmt)
    w, _ = weight(fmt, 45, cols, seed=8)
    x = torch.randn(m, cols) * torch.rand(m, 1) * 4  # [m, K]
    x[0] = 0.0
    expected = reference_quant_linear(x, w, activation_levels=levels)  # [m, 45]
    q, dx, bsum = ext.quantize_rows(x, levels)
    for amx_rows in (1, 16, 12, 0):
        out = torch.full((m, 52), float("nan"))
        ext.quant_matmul(q, dx, bsum, w.parts[0].packed, FORMAT_IDS[fmt], 45, cols, out, 3, amx_rows, levels)
        assert torch.equal(out[:, 3:48], expected), amx_rows
        assert out[:, :3].isnan().all() and out[:, 48:].isnan().all()
    monkeypatch.setenv(ISA_ENV, "avx512")
    assert amx_min_rows() == AMX_MIN_ROWS
    assert torch.equal(quant_linear(x, w, activation_levels=levels), expected)
    monkeypatch.setenv(AMX_ENV, "0")
    assert amx_min_rows() == 0
    assert torch.equal(quant_linear(x, w, activation_levels=levels), expected)


@pytest.mark.parametrize(("fmt", "levels"), [(fmt, 127) for fmt in SUPPORTED_FORMATS] + [("Q8_0", 63)])
def test_batch_invariance_every_width(isa, fmt, levels):
    """Row i computed with 0..63 other rows around it, at every offset: always the same bits (the
    AVX-512 build switches to AMX tiles from AMX_MIN_ROWS rows on, where the CPU has them)."""
    w, _ = weight(fmt, 48, cols_for(fmt), seed=6)
    x = torch.randn(64, cols_for(fmt))

    def linear(rows: torch.Tensor) -> torch.Tensor:
        return quant_linear(rows, w, activation_levels=levels)

    alone = torch.cat([linear(x[i : i + 1]) for i in range(64)])
    for width in range(1, 65):
        start = (7 * width) % (65 - width)
        assert torch.equal(linear(x[start : start + width]), alone[start : start + width]), width
    # rows of other requests mixed in, in another order
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    assert torch.equal(linear(x[perm]), alone[perm])


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
@pytest.mark.parametrize("levels", [127, 63])
def test_kernel_exact_at_extreme_quants(isa, fmt, levels):
    """The largest integer products: every quant at its extreme (Q8_0: -128 and 127; the others
    all bits set), activations at +-levels with equal or alternating signs.  An int16 pair sum
    that saturated (vpmaddubsw) would change the bits."""
    cols = cols_for(fmt)
    raw = random_gguf(fmt, 32, cols, seed=8).reshape(32 * cols // GGUF_BLOCK[fmt][1], -1)
    keep = np.zeros(raw.shape[1], dtype=bool)
    for at in _HALF_FIELDS[fmt]:
        keep[at : at + 2] = True
    if fmt in _E8M0_FIELD:  # the scale stays a power of two the kernels hold
        keep[_E8M0_FIELD[fmt]] = True
    if fmt == "Q8_0":  # rows 0..15 all -128 (0x80), rows 16..31 all +127
        extreme = np.where(np.arange(raw.shape[0])[:, None] < raw.shape[0] // 2, 0x80, 0x7F).astype(np.uint8)
        raw[:, ~keep] = np.broadcast_to(extreme, (raw.shape[0], int((~keep).sum())))
    else:
        raw[:, ~keep] = 0xFF
    w = QuantizedWeight.from_parts([decode_gguf(fmt, raw, rows=32, cols=cols)])
    signs = torch.ones(4, cols)  # [4, K]: every activation quant +-127
    signs[1] = -1.0
    signs[2, 1::2] = -1.0
    signs[3, 2::4] = -1.0
    signs[3, 3::4] = -1.0
    x = signs * 0.75
    assert torch.equal(
        quant_linear(x, w, activation_levels=levels), reference_quant_linear(x, w, activation_levels=levels)
    )
    for m in (1, 2):  # Q8_0's both-halves tiles on AVX2
        got = quant_linear(x[m : m + m], w, activation_levels=levels)
        assert torch.equal(got, reference_quant_linear(x[m : m + m], w, activation_levels=levels)), m


def test_quantize_rows_equals_reference(isa):
    """int8 activations, scales and 16-sums as the reference: round half to even, clamping,
    zero rows, signs."""
    x = torch.randn(7, 256) * 5  # [7, 256]
    x[0] = 0.0
    x[1, :32] = torch.arange(-16, 16) + 0.5  # amax 15.5: a scale of exactly 127 / 15.5
    x[2, :32] = torch.tensor([127.0, -127.0, 2.5, -2.5, 0.5, -0.5, 1.5, 3.5] * 4)  # inv == 1: halves
    x[3, 32:64] = 1e-30  # tiny but not zero
    # 127 / 8.225171 rounds to a float32 inv with x * inv == -63.5 exactly: a tie, to -64.
    # (torch's `127.0 / amax` is reciprocal-then-multiply, an ulp off here: it gave -63.)
    x[4, :32] = 0.0
    x[4, :2] = torch.tensor([8.225171, -4.112585544586182])
    ext = isa_extension(isa)
    for got, expected in zip(ext.quantize_rows(x), quantize_activations(x)):
        assert got.dtype == expected.dtype and torch.equal(got, expected)
    assert ext.quantize_rows(x)[0][2, :8].tolist() == [127, -127, 2, -2, 0, 0, 2, 4]
    assert ext.quantize_rows(x)[0][4, :2].tolist() == [127, -64]
    # narrow quants (63 levels): the same rounding, within +-63
    x[5, :32] = torch.tensor([63.0, -63.0, 2.5, -2.5, 0.5, -0.5, 1.5, 3.5] * 4)  # inv == 1 again
    for got, expected in zip(ext.quantize_rows(x, 63), quantize_activations(x, 63)):
        assert got.dtype == expected.dtype and torch.equal(got, expected)
    q = ext.quantize_rows(x, 63)[0]
    assert q.abs().max() == 63 and q[5, :8].tolist() == [63, -63, 2, -2, 0, 0, 2, 4]
    with pytest.raises(RuntimeError, match="levels must be 127 or 63, got 64"):
        ext.quantize_rows(x, 64)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_float16_weights_are_kept_exactly_and_multiply_float_rows(isa, dtype):
    """A float16 / bfloat16 weight as F16 / BF16 parts: its values exactly (subnormals, signed
    zeros, the largest values), beside a Q8_0 part in one fused weight; the kernel multiplies
    x's float rows as they are (closer to float64 than the int8 activations of the quantized
    formats could be), the reference's bits, batch-invariant; quant_matmul, which has only the
    quants, refuses them by name."""
    generator = torch.Generator().manual_seed(5)
    w = torch.randn(37, 160, generator=generator) * 0.05
    w[0, :4] = torch.tensor([1e-6, -0.0, 6e4 if dtype == torch.float16 else 3e38, -2.5])
    stored = w.to(dtype)
    q8 = quantize_q8_0(torch.randn(16, 160, generator=generator))
    fused = QuantizedWeight.from_parts([float16_parts(stored), q8])
    assert [p.format for p in fused.parts] == ["F16" if dtype == torch.float16 else "BF16", "Q8_0"]
    assert torch.equal(fused[:37], stored.float()) and fused.dequantize().shape == (53, 160)
    table = QuantizedWeight.from_parts([float16_parts(stored)])  # one part: rows read in C++
    index = torch.tensor([[36, 0], [16, 15]])
    assert torch.equal(table.rows(index), stored.float()[index])
    x = torch.randn(9, 160, generator=generator)
    got = quant_linear(x, fused)
    assert torch.equal(got, reference_quant_linear(x, fused))
    exact = x.double() @ stored[1:].double().T  # (row 0's extremes would dominate any bound)
    assert (got[:, 1:37].double() - exact).abs().max() <= 1e-6 * exact.abs().max()
    alone = torch.cat([quant_linear(x[i : i + 1], fused) for i in range(9)])
    assert torch.equal(alone, got)
    ext = isa_extension(isa)
    q, dx, bsum = ext.quantize_rows(x)
    with pytest.raises(RuntimeError, match="float rows"):
        ext.quant_matmul(q, dx, bsum, fused.parts[0].packed, FORMAT_IDS["F16"], 37, 160, torch.empty(9, 37), 0, 0)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        float16_parts(w)


def test_isa_choice(monkeypatch):
    monkeypatch.setenv(ISA_ENV, "reference")
    assert active_isa() == "reference" and not fused_layer_available()
    w, _ = weight("Q4_0", 16, 64, seed=9)
    x = torch.randn(3, 64)
    assert torch.equal(quant_linear(x, w), reference_quant_linear(x, w))
    monkeypatch.setenv(ISA_ENV, "sse2")
    with pytest.raises(ValueError, match=ISA_ENV):
        quant_linear(x, w)
    monkeypatch.delenv(ISA_ENV)
    usable = [isa for isa in ISAS if isa_extension(isa) is not None]
    assert active_isa() == (usable[0] if usable else "reference")  # the first build that runs here
    for isa in usable:
        monkeypatch.setenv(ISA_ENV, isa)
        assert active_isa() == isa
        assert fused_layer_available()  # both builds have the one-call decoder layer


def test_reference_batch_invariance():
    w, _ = weight("Q4_K", 20, 256, seed=7)
    x = torch.randn(9, 256)
    alone = torch.cat([reference_quant_linear(x[i : i + 1], w) for i in range(9)])
    assert torch.equal(reference_quant_linear(x, w), alone)


def test_quantize_q8_0_matches_gguf_py():
    w = torch.randn(8, 64) * 0.1
    w[3] = 0.0
    expected = gguf.quants.quantize(w.numpy(), QType.Q8_0)
    parts = quantize_q8_0(w)
    ours = decode_gguf("Q8_0", expected, rows=8, cols=64)
    assert np.array_equal(parts.q, ours.q) and np.array_equal(parts.d, ours.d)


@pytest.mark.parametrize("fmt", ["Q8_0", "Q5_0", "Q4_0"])
def test_quantize_legacy_matches_gguf_py(fmt):
    """Heads draft on Q5_0 / Q4_0 copies made here: the quants and scales gguf-py's reference
    quantizers give (a block whose extreme is negative, a zero block, a block of one value)."""
    w = torch.randn(16, 128, generator=torch.Generator().manual_seed(3)) * torch.linspace(0.01, 4, 16)[:, None]
    w[3] = 0.0
    w[5, :32] = -2.5
    w[6, 32:64] = 0.75
    w[7, 7] = -9.0
    expected = decode_gguf(fmt, gguf.quants.quantize(w.numpy(), getattr(QType, fmt)), rows=16, cols=128)
    parts = quantize_legacy(w, fmt)
    assert parts.format == fmt
    assert np.array_equal(parts.q, expected.q) and np.array_equal(parts.d, expected.d)
    with pytest.raises(ValueError, match="Q4_K"):
        quantize_legacy(w, "Q4_K")


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="not whole blocks"):
        decode_gguf("Q4_K", np.zeros(144, np.uint8), rows=1, cols=128)
    with pytest.raises(ValueError, match="needs 34 bytes"):
        decode_gguf("Q8_0", np.zeros(30, np.uint8), rows=1, cols=32)
    with pytest.raises(ValueError, match="unsupported GGUF format"):
        decode_gguf("IQ2_XXS", np.zeros(66, np.uint8), rows=1, cols=256)
    w, _ = weight("Q8_0", 16, 64)
    with pytest.raises(ValueError, match="features"):
        quant_linear(torch.randn(2, 32), w)


@pytest.mark.parametrize("segment", [None, 64])
def test_norm_matmul_is_rms_norm_then_the_kernel(segment):
    """norm_matmul (a draft head's one-call input and logits): each row normalized per segment
    with its slice of the norm weight, then the quantized matmul; rows batch-invariant."""
    from quickdraft.kernels.quant_linear import norm_matmul

    if not fused_layer_available():
        pytest.skip("no compiled quantized kernel on this CPU")
    w, _ = weight("Q8_0", 48, 128, seed=9)
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(9, 128, generator=generator) * torch.rand(9, 1, generator=generator) * 5
    norm = torch.rand(128, generator=generator) + 0.5
    out = norm_matmul(x, norm=norm, weight=w, eps=1e-6, segment=segment)
    width = segment or 128
    pieces = x.view(9, -1, width)
    normed = (pieces * torch.rsqrt(pieces.pow(2).mean(-1, keepdim=True) + 1e-6)).view(9, 128) * norm
    torch.testing.assert_close(out, reference_quant_linear(normed, w), rtol=2e-2, atol=2e-2)
    alone = torch.cat([norm_matmul(x[i : i + 1], norm=norm, weight=w, eps=1e-6, segment=segment) for i in range(9)])
    assert torch.equal(out, alone)
