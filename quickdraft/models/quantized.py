"""GGUF-quantized weights kept as stored: decoding, the kernels' packed layout, QuantizedWeight.

A weight [N, K] in one of the GGUF block formats is decoded once at load time into its parts
(unsigned quants and per-block scales, `QuantParts`) and repacked into tiles of 16 weight rows,
the layout `kernels/csrc/quant_linear.cpp` reads.  Nothing is expanded to floats: the packed
bytes per weight equal the stored ones for the 32-block formats, Q2_K and Q6_K, and are 1.5-3.5%
more for Q3_K, Q4_K, Q5_K and IQ4_XS (their 6-bit sub-block scales are kept one per byte).

Packed layout, per group of 16 weight rows (rows padded with zeros to a multiple of 16), tiles
in K order, groups one after the other.  A "step" s holds k = 4s..4s+3 of the 16 rows as 64
bytes, lane j (bytes 4j..4j+3) for row j: the vpdpbusd operand layout.
- 8-bit quants: 8 steps (512 bytes).  4-bit: 4 x 64 bytes, the low nibble of step s < 4 and
  the high nibble for step s + 4 (k = 16 + 4s..).  2-bit ("crumbs"): 2 x 64 bytes, step s at
  bits 2 (s % 4) of vector s // 4.  A high bit: per step a little-endian uint64 whose bit
  4j + t belongs to row j, k = 4s + t (8 x 8 bytes).
- Q8_0 (32 k a tile): quants + 128 as uint8 (512), d fp16 [16] (32): 544 bytes.
- Q4_0: nibbles (256), d [16]: 288.  Q5_0: nibbles, bit-4 masks (64), d: 352.
- Q4_K (256 k a tile): d [16], dmin [16] fp16, sc [8 sub-blocks][16] u8, m [8][16] u8 (320),
  then 8 sub-blocks of nibbles (256 each): 2368.  Q5_K: the same with bit-4 masks after each
  sub-block's nibbles (320 each): 2880.
- Q6_K: d [16] fp16, sc [16 sub-blocks of 16][16] int8 (288), then 8 sub-blocks of 32: nibbles,
  bit-4 masks, bit-5 masks (384 each): 3360.
- IQ4_XS (256 k a tile): d [16] fp16, sc [8 sub-blocks of 32][16] int8 (160), then 8 sub-blocks of
  nibbles (256 each), each an index into the 16-value table LEVELS["IQ4_XS"]: 2208.
- IQ4_NL: nibbles (indices into LEVELS["IQ4_NL"]), d: 288 (Q4_0's layout).  MXFP4 (gpt-oss; llama.cpp's
  MXFP4_MOE mixes): the same, indices into LEVELS["MXFP4"] (OCP's FP4 E2M1 values, doubled) and d =
  2^(e - 128) from the block's E8M0 exponent e, exact in float16 for e in 104..143.
- Q4_1: nibbles, d, dmin [16] fp16 (minus each block's min): 320.  Q5_1: nibbles, bit-4 masks,
  d, dmin: 384.
- Q2_K (256 k a tile): d, dmin [16] fp16, per 16-wide sub-block a byte sc | m << 4 [16][16] (320),
  then 8 sub-blocks of 32 crumbs (128 each): 1344 (2.625 bits a weight, as stored).
- Q3_K: d [16] fp16, sc [16 sub-blocks of 16][16] int8 (288), then 8 sub-blocks of 32: the low
  two bits as crumbs (below), bit-2 masks (192 each): 1824 (3.56 bits a weight; the file's 3.44).
- F16, BF16 (16-bit floats, kept as they are): 32 k a tile, k-major: per k the 16 rows' values
  (32 bytes): 1024.  The kernels multiply them with x's float rows, not its int8 quants.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class QuantFormat:
    """One GGUF type as the kernels keep it (the packed layouts above)."""

    kernel_id: int  # enum Format in quant_linear.cpp
    bits: int  # bits of one quant as packed
    tile_k: int  # values of a row one tile holds: a GGUF block's (32) or super-block's (256)
    tile_bytes: int  # one packed tile: 16 rows x tile_k values with their scales
    gguf_block: tuple[int, int]  # bytes of one GGUF block and the values it holds
    # Added to the signed quants so that the kernel multiplies unsigned weights (and subtracts
    # offset * sum(activation quants) instead); None: stored unsigned with a min, or as level indices.
    offset: int | None = None
    scales_of_16: bool = False  # one int8 scale per 16 values (the rest: one scale per 32)
    block_mins: bool = False  # a scale and a min per 32-block (w = d * q - dmin; dmin is minus the stored min)
    int8_scales: bool = False  # 256-wide tiles whose header is d [16] then int8 sub-block scales
    # 4-bit indices into these signed levels (IQ4_NL, IQ4_XS, MXFP4) instead of quants
    level_table: tuple[int, ...] | None = None

    @property
    def int8_scale_header(self) -> int:
        """Bytes of such a header: d, then one int8 per sub-block (of 16 or 32) and row."""
        return 32 + 16 * (self.tile_k // (16 if self.scales_of_16 else 32))


# ggml's non-linear 4-bit levels (kvalues_iq4nl), shared by IQ4_NL and IQ4_XS.
_IQ4_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
# FP4 E2M1's values (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives) times 2, as ggml keeps them
# (its scale is then half the block's E8M0 power of two).
_MXFP4_LEVELS = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)

FORMATS = {
    "Q8_0": QuantFormat(kernel_id=0, bits=8, tile_k=32, tile_bytes=544, gguf_block=(34, 32), offset=128),
    "Q4_0": QuantFormat(kernel_id=1, bits=4, tile_k=32, tile_bytes=288, gguf_block=(18, 32), offset=8),
    "Q5_0": QuantFormat(kernel_id=2, bits=5, tile_k=32, tile_bytes=352, gguf_block=(22, 32), offset=16),
    "Q4_K": QuantFormat(kernel_id=3, bits=4, tile_k=256, tile_bytes=2368, gguf_block=(144, 256)),
    "Q5_K": QuantFormat(kernel_id=4, bits=5, tile_k=256, tile_bytes=2880, gguf_block=(176, 256)),
    "Q6_K": QuantFormat(
        kernel_id=5,
        bits=6,
        tile_k=256,
        tile_bytes=3360,
        gguf_block=(210, 256),
        offset=32,
        scales_of_16=True,
        int8_scales=True,
    ),
    "IQ4_XS": QuantFormat(
        kernel_id=6,
        bits=4,
        tile_k=256,
        tile_bytes=2208,
        gguf_block=(136, 256),
        int8_scales=True,
        level_table=_IQ4_LEVELS,
    ),
    "IQ4_NL": QuantFormat(kernel_id=7, bits=4, tile_k=32, tile_bytes=288, gguf_block=(18, 32), level_table=_IQ4_LEVELS),
    "Q3_K": QuantFormat(
        kernel_id=8,
        bits=3,
        tile_k=256,
        tile_bytes=1824,
        gguf_block=(110, 256),
        offset=4,
        scales_of_16=True,
        int8_scales=True,
    ),
    "Q4_1": QuantFormat(kernel_id=9, bits=4, tile_k=32, tile_bytes=320, gguf_block=(20, 32), block_mins=True),
    "Q5_1": QuantFormat(kernel_id=10, bits=5, tile_k=32, tile_bytes=384, gguf_block=(24, 32), block_mins=True),
    "Q2_K": QuantFormat(kernel_id=11, bits=2, tile_k=256, tile_bytes=1344, gguf_block=(84, 256)),
    "MXFP4": QuantFormat(
        kernel_id=12, bits=4, tile_k=32, tile_bytes=288, gguf_block=(17, 32), level_table=_MXFP4_LEVELS
    ),
    "F16": QuantFormat(kernel_id=13, bits=16, tile_k=32, tile_bytes=1024, gguf_block=(2, 1)),
    "BF16": QuantFormat(kernel_id=14, bits=16, tile_k=32, tile_bytes=1024, gguf_block=(2, 1)),
}
# Views of FORMATS by field, as the loaders, kernels and tests index them.
FORMAT_IDS = {name: f.kernel_id for name, f in FORMATS.items()}
TILE_K = {name: f.tile_k for name, f in FORMATS.items()}
TILE_BYTES = {name: f.tile_bytes for name, f in FORMATS.items()}
GGUF_BLOCK = {name: f.gguf_block for name, f in FORMATS.items()}
QUANT_BITS = {name: f.bits for name, f in FORMATS.items()}
OFFSETS = {name: f.offset for name, f in FORMATS.items() if f.offset is not None}
SCALES_OF_16 = tuple(name for name, f in FORMATS.items() if f.scales_of_16)
BLOCK_MINS = tuple(name for name, f in FORMATS.items() if f.block_mins)
# Per format with levels: index -> signed level.
LEVELS = {name: np.array(f.level_table, dtype=np.int16) for name, f in FORMATS.items() if f.level_table}
SUPPORTED_FORMATS = tuple(FORMAT_IDS)
# Kept as 16-bit floats: QuantParts.q holds the values' bits (uint16), no scales.
FLOAT16_FORMATS = ("F16", "BF16")
ROWS_PER_GROUP = 16


@dataclass
class QuantParts:
    """One weight's decoded parts: w = d * (q - offset) (Q8_0/Q4_0/Q5_0),
    d * sc * q - dmin * m (Q4_K/Q5_K, per 32-wide sub-block), d * sc * (q - offset) (Q6_K: 32,
    Q3_K: 4; per 16), d * sc * LEVELS[format][q] (IQ4_XS, per 32), d * LEVELS[format][q] (IQ4_NL, MXFP4),
    d * q - dmin (Q4_1/Q5_1: ggml's d * q + m, stored as dmin = -m, exact), d * sc * q - dmin * m
    (Q2_K, per 16); F16 and BF16: the values themselves, their bits in q (uint16), d empty."""

    format: str
    q: np.ndarray  # [N, K] uint8, unsigned quants (uint16 bits for F16 / BF16)
    d: np.ndarray  # [N, K/32] (32-block formats) or [N, K/256] float16; [N, 0] for F16 / BF16
    dmin: np.ndarray | None = None  # [N, K/256] float16 (Q4_K, Q5_K), [N, K/32] (Q4_1, Q5_1)
    # [N, K/32] uint8 (Q4_K, Q5_K), [N, K/16] int8 (Q6_K, Q3_K), [N, K/32] int8 (IQ4_XS), [N, K/16] uint8 (Q2_K)
    sc: np.ndarray | None = None
    m: np.ndarray | None = None  # [N, K/32] uint8 (Q4_K, Q5_K), [N, K/16] uint8 (Q2_K)

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape

    def dequantize(self) -> np.ndarray:  # -> [N, K] float32, the same values as ggml / gguf-py
        if self.format in FLOAT16_FORMATS:
            return float16_values(self.format, self.q)
        n, k = self.q.shape
        q = self.q.astype(np.float32)
        if self.format in SCALES_OF_16:
            scale = np.repeat(self.d.astype(np.float32), 16, axis=1) * self.sc.astype(np.float32)  # [N, K/16]
            return (scale[:, :, None] * (q - OFFSETS[self.format]).reshape(n, k // 16, 16)).reshape(n, k)
        if self.format in OFFSETS:
            blocks = (q - OFFSETS[self.format]).reshape(n, k // 32, 32)
            return (self.d.astype(np.float32)[:, :, None] * blocks).reshape(n, k)
        if self.format == "Q2_K":
            scale = np.repeat(self.d.astype(np.float32), 16, axis=1) * self.sc.astype(np.float32)  # [N, K/16]
            low = np.repeat(self.dmin.astype(np.float32), 16, axis=1) * self.m.astype(np.float32)
            return (scale[:, :, None] * q.reshape(n, k // 16, 16) - low[:, :, None]).reshape(n, k)
        if self.format in BLOCK_MINS:
            blocks = self.d.astype(np.float32)[:, :, None] * q.reshape(n, k // 32, 32)
            return (blocks - self.dmin.astype(np.float32)[:, :, None]).reshape(n, k)
        if self.format in ("IQ4_NL", "MXFP4"):
            levels = LEVELS[self.format][self.q].astype(np.float32).reshape(n, k // 32, 32)
            return (self.d.astype(np.float32)[:, :, None] * levels).reshape(n, k)
        if self.format == "IQ4_XS":
            scale = np.repeat(self.d.astype(np.float32), 8, axis=1) * self.sc.astype(np.float32)  # [N, K/32]
            levels = LEVELS["IQ4_XS"][self.q].astype(np.float32)
            return (scale[:, :, None] * levels.reshape(n, k // 32, 32)).reshape(n, k)
        ds = np.repeat(self.d.astype(np.float32), 8, axis=1) * self.sc.astype(np.float32)  # [N, K/32]
        dm = np.repeat(self.dmin.astype(np.float32), 8, axis=1) * self.m.astype(np.float32)
        return (ds[:, :, None] * q.reshape(n, k // 32, 32) - dm[:, :, None]).reshape(n, k)


# --------------------------------------------------------------------------------------------------
# GGUF blocks -> parts
# --------------------------------------------------------------------------------------------------


def decode_gguf(format: str, raw: np.ndarray, *, rows: int, cols: int) -> QuantParts:
    """The parts of a GGUF tensor [rows, cols] stored as `raw` bytes (any shape, C order)."""
    if format not in GGUF_BLOCK:
        raise ValueError(f"unsupported GGUF format {format}: supported {', '.join(SUPPORTED_FORMATS)}")
    block_bytes, block_values = GGUF_BLOCK[format]
    if cols % block_values:
        raise ValueError(f"{format} rows of {cols} values are not whole blocks of {block_values}")
    raw = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    if raw.size != rows * cols // block_values * block_bytes:
        raise ValueError(
            f"{format} [{rows}, {cols}] needs {rows * cols // block_values * block_bytes} bytes, got {raw.size}"
        )
    if format in FLOAT16_FORMATS:
        return QuantParts(format=format, q=raw.view(np.uint16).reshape(rows, cols), d=_no_scales(rows))
    blocks = raw.reshape(rows * cols // block_values, block_bytes)
    parts = _DECODERS[format](blocks)
    return QuantParts(
        format=format,
        q=parts["q"].reshape(rows, cols),
        **{name: value.reshape(rows, -1) for name, value in parts.items() if name != "q"},
    )


def _no_scales(rows: int) -> np.ndarray:  # QuantParts.d of F16 / BF16 parts: [rows, 0]
    return np.zeros((rows, 0), np.float16)


def float16_values(format: str, bits: np.ndarray) -> np.ndarray:  # uint16 [...] -> float32 [...], exactly
    if format == "F16":
        return bits.view(np.float16).astype(np.float32)
    return (bits.astype(np.uint32) << 16).view(np.float32)


def float16_parts(weight: torch.Tensor) -> QuantParts:
    """A float16 / bfloat16 weight [N, K] as it is (F16 / BF16 parts: its bits, nothing rounded)."""
    formats = {torch.float16: "F16", torch.bfloat16: "BF16"}
    if weight.dtype not in formats or weight.dim() != 2:
        raise ValueError(f"F16 / BF16 parts need a 2-D float16 or bfloat16 weight, got {weight.dtype} {weight.dim()}-D")
    bits = weight.detach().to("cpu").contiguous().view(torch.int16).numpy().view(np.uint16)
    return QuantParts(format=formats[weight.dtype], q=bits, d=_no_scales(bits.shape[0]))


def _half(blocks: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(blocks).view(np.float16)


def _decode_q8_0(blocks: np.ndarray) -> dict:
    q = (blocks[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return {"d": _half(blocks[:, :2]), "q": q}


def _nibble_halves(qs: np.ndarray) -> np.ndarray:
    # 16 bytes -> 32 values: low nibbles are values 0..15, high nibbles 16..31.
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _decode_q4_0(blocks: np.ndarray) -> dict:
    return {"d": _half(blocks[:, :2]), "q": _nibble_halves(blocks[:, 2:])}


def _decode_q5_0(blocks: np.ndarray) -> dict:
    qh = np.ascontiguousarray(blocks[:, 2:6]).view(np.uint32)  # bit i: high bit of value i
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    return {"d": _half(blocks[:, :2]), "q": _nibble_halves(blocks[:, 6:]) | (high << 4)}


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # The 12 bytes of 6-bit scales and mins of 8 sub-blocks (ggml's get_scale_min_k4).
    low, mid, top = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([low & 0x3F, (top & 0x0F) | ((low >> 2) & 0x30)], axis=1)
    m = np.concatenate([mid & 0x3F, (top >> 4) | ((mid >> 2) & 0x30)], axis=1)
    return sc, m


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    # 128 bytes -> 256 values: 32-byte chunk c holds sub-block 2c (low) and 2c + 1 (high).
    chunks = qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (chunks & 0x0F).reshape(-1, 256)


def _decode_q4_k(blocks: np.ndarray) -> dict:
    sc, m = _k_scales(blocks[:, 4:16])
    return {
        "d": _half(blocks[:, 0:2]),
        "dmin": _half(blocks[:, 2:4]),
        "sc": sc,
        "m": m,
        "q": _k_nibbles(blocks[:, 16:]),
    }


def _decode_q5_k(blocks: np.ndarray) -> dict:
    sc, m = _k_scales(blocks[:, 4:16])
    qh = blocks[:, 16:48]  # bit j of byte l: high bit of value l of sub-block j
    high = (qh.reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    return {
        "d": _half(blocks[:, 0:2]),
        "dmin": _half(blocks[:, 2:4]),
        "sc": sc,
        "m": m,
        "q": _k_nibbles(blocks[:, 48:]) | (high.reshape(-1, 256) << 4),
    }


def _decode_q6_k(blocks: np.ndarray) -> dict:
    ql, qh = blocks[:, :128], blocks[:, 128:192]
    low = (ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    high = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 0x03
    q = low.reshape(-1, 256) | (high.reshape(-1, 256) << 4)
    return {"sc": blocks[:, 192:208].view(np.int8), "d": _half(blocks[:, 208:210]), "q": q}


def _decode_q2_k(blocks: np.ndarray) -> dict:
    scales, qs = blocks[:, :16], blocks[:, 16:80]
    # value 128c + 32s + l: bits 2s..2s+1 of qs byte 32c + l (as Q3_K's low bits)
    q = (qs.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 0x03
    return {
        "d": _half(blocks[:, 80:82]),
        "dmin": _half(blocks[:, 82:84]),
        "sc": scales & 0x0F,
        "m": scales >> 4,
        "q": q.reshape(-1, 256),
    }


def _decode_q3_k(blocks: np.ndarray) -> dict:
    # ggml's w = d * (sc6 - 32) * (q2 - 4 * (1 - hbit)) per 16 values: sc = sc6 - 32, q = q2 + 4 * hbit
    # (0..7, offset 4).
    hmask, qs, scales, d = blocks[:, :32], blocks[:, 32:96], blocks[:, 96:108], blocks[:, 108:110]
    low = (scales[:, :8].reshape(-1, 1, 8) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)) & 0x0F
    high = (scales[:, 8:].reshape(-1, 1, 4) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)) & 0x03
    sc = (low.reshape(-1, 16) | (high.reshape(-1, 16) << 4)).astype(np.int16) - 32
    # value 128c + 32s + l: bits 2s..2s+1 of qs byte 32c + l; its high bit: bit (4c + s) of hmask byte l
    q2 = (qs.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 0x03
    hbit = (hmask.reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    q = q2.reshape(-1, 256) + 4 * hbit.reshape(-1, 256)
    return {"sc": sc.astype(np.int8), "d": _half(d), "q": q.astype(np.uint8)}


def _decode_q4_1(blocks: np.ndarray) -> dict:
    return {"d": _half(blocks[:, :2]), "dmin": -_half(blocks[:, 2:4]), "q": _nibble_halves(blocks[:, 4:])}


def _decode_q5_1(blocks: np.ndarray) -> dict:
    parts = _decode_q5_0(np.concatenate([blocks[:, :2], blocks[:, 4:]], axis=1))  # Q5_0's layout after d
    return parts | {"dmin": -_half(blocks[:, 2:4])}


def _decode_iq4_nl(blocks: np.ndarray) -> dict:
    return {"d": _half(blocks[:, :2]), "q": _nibble_halves(blocks[:, 2:])}


class InexactBlocks(ValueError):
    """Blocks the kernels' layout cannot hold exactly (the tensor is then loaded as floats)."""


def _decode_mxfp4(blocks: np.ndarray) -> dict:
    # e (E8M0), then 16 bytes of indices laid out as Q4_0's quants; w = 2^(e - 128) * level
    exponents = blocks[:, :1].astype(np.int32) - 128
    if exponents.size and (exponents.min() < -24 or exponents.max() > 15):
        raise InexactBlocks(
            f"MXFP4 block scales 2^{exponents.min()}..2^{exponents.max()} lie outside float16's exact powers of two"
        )
    return {"d": np.ldexp(np.float32(1), exponents).astype(np.float16), "q": _nibble_halves(blocks[:, 1:])}


def _decode_iq4_xs(blocks: np.ndarray) -> dict:
    # d fp16, scales_h (2 bytes: 2 high bits per sub-block), scales_l (4 bytes: 4 low bits), 128
    # bytes of indices: sub-block j's 32 values are the low then the high nibbles of bytes 16j..16j+15.
    scales_h = np.ascontiguousarray(blocks[:, 2:4]).view(np.uint16)  # [n, 1]
    low = (blocks[:, 4:8].reshape(-1, 4, 1) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2)) & 0x0F
    high = (scales_h >> (2 * np.arange(8, dtype=np.uint16)).reshape(1, 8)) & 0x03
    sc = (low.reshape(-1, 8).astype(np.int16) | (high.astype(np.int16) << 4)) - 32
    q = _nibble_halves(blocks[:, 8:].reshape(-1, 8, 16)).reshape(-1, 256)
    return {"d": _half(blocks[:, :2]), "sc": sc.astype(np.int8), "q": q}


_DECODERS = {
    "Q3_K": _decode_q3_k,
    "IQ4_NL": _decode_iq4_nl,
    "MXFP4": _decode_mxfp4,
    "Q4_1": _decode_q4_1,
    "Q5_1": _decode_q5_1,
    "Q2_K": _decode_q2_k,
    "IQ4_XS": _decode_iq4_xs,
    "Q8_0": _decode_q8_0,
    "Q4_0": _decode_q4_0,
    "Q5_0": _decode_q5_0,
    "Q4_K": _decode_q4_k,
    "Q5_K": _decode_q5_k,
    "Q6_K": _decode_q6_k,
}


# Formats a float weight can be quantized to at load time: 32-value blocks with one scale each.
LOAD_TIME_FORMATS = ("Q8_0", "Q5_0", "Q4_0")


def _float_blocks(weight: torch.Tensor, format: str) -> np.ndarray:  # [N, K] -> [N, K / 32, 32] float32
    w = weight.detach().to("cpu", torch.float32).numpy()
    n, k = w.shape
    if k % 32:
        raise ValueError(f"{format} needs rows of a multiple of 32 values, got {k}")
    return w.reshape(n, k // 32, 32)


def _reciprocal(d: np.ndarray) -> np.ndarray:  # 1 / d, 0 where d is 0 (an all-zero block)
    with np.errstate(divide="ignore"):
        return np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)


def quantize_q8_0(weight: torch.Tensor) -> QuantParts:
    """Q8_0 parts of a float weight [N, K] (K a multiple of 32), rounded as ggml does."""
    blocks = _float_blocks(weight, "Q8_0")
    d = np.abs(blocks).max(axis=2) / np.float32(127)
    # ggml rounds half away from zero.
    q = np.trunc(blocks * _reciprocal(d)[:, :, None] + np.copysign(np.float32(0.5), blocks))
    q = (np.clip(q, -127, 127).astype(np.int16) + 128).astype(np.uint8)
    return QuantParts(format="Q8_0", q=q.reshape(weight.shape), d=d.astype(np.float16))


def quantize_legacy(weight: torch.Tensor, format: str) -> QuantParts:
    """`format` (one of LOAD_TIME_FORMATS) parts of a float weight [N, K] (K a multiple of 32),
    rounded as ggml's reference quantizers do."""
    if format not in LOAD_TIME_FORMATS:
        raise ValueError(f"can quantize to {', '.join(LOAD_TIME_FORMATS)}, not {format!r}")
    if format == "Q8_0":
        return quantize_q8_0(weight)
    blocks = _float_blocks(weight, format)
    offset = OFFSETS[format]  # Q4_0: 8, Q5_0: 16 (half the levels)
    # The block's value of largest magnitude, with its sign, maps to quant 0: d = max / -offset.
    extreme = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=2)[:, :, None], axis=2)[:, :, 0]
    d = (extreme / np.float32(-offset)).astype(np.float32)
    # x * inv lies in [-offset, offset]: + offset + 0.5, truncated, is round-half-up to 0..2 * offset.
    q = np.trunc(blocks * _reciprocal(d)[:, :, None] + np.float32(offset + 0.5))
    q = np.minimum(q, 2 * offset - 1).astype(np.uint8)
    return QuantParts(format=format, q=q.reshape(weight.shape), d=d.astype(np.float16))


# --------------------------------------------------------------------------------------------------
# Parts <-> packed tiles
# --------------------------------------------------------------------------------------------------


def _pad_rows(array: np.ndarray, rows: int) -> np.ndarray:
    if array.shape[0] == rows:
        return array
    pad = np.zeros((rows - array.shape[0],) + array.shape[1:], dtype=array.dtype)
    return np.concatenate([array, pad])


def _steps(q: np.ndarray, groups: int, blocks: int) -> np.ndarray:
    # [G*16, K] -> [G, blocks, 8 steps, 16 rows, 4]
    return q.reshape(groups, ROWS_PER_GROUP, blocks, 8, 4).transpose(0, 2, 3, 1, 4)


def _pack_quants(steps: np.ndarray, bits: int) -> np.ndarray:
    # steps [G, B, 8, 16, 4] -> [G, B, bytes]: nibbles (or bytes) then one mask set per high bit
    g, b = steps.shape[:2]
    if bits == 8:
        return steps.reshape(g, b, 512)
    if bits <= 3:  # crumbs: the low two bits of step 4v + r at bits 2r of vector v
        shifts = (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 1, 4, 1)
        crumbs = (steps.reshape(g, b, 2, 4, 64) & 0x03) << shifts
        sections, low_bits = [np.bitwise_or.reduce(crumbs, axis=3).reshape(g, b, 128)], 2
    else:
        nibbles = (steps[:, :, :4] & 0x0F) | ((steps[:, :, 4:] & 0x0F) << 4)
        sections, low_bits = [nibbles.reshape(g, b, 256)], 4
    for bit in range(low_bits, bits):
        flags = ((steps >> bit) & 1).reshape(g, b, 8, 64)
        sections.append(np.packbits(flags, axis=-1, bitorder="little").reshape(g, b, 64))
    return np.concatenate(sections, axis=-1)


def _unpack_quants(section: np.ndarray, bits: int) -> np.ndarray:
    # [R, B, bytes] for one lane's rows -> [R, B, 8, 16, 4] steps of every lane
    r, b = section.shape[:2]
    if bits == 8:
        return section[:, :, :512].reshape(r, b, 8, 16, 4)
    if bits <= 3:
        vectors = section[:, :, :128].reshape(r, b, 2, 1, 64)
        steps = ((vectors >> (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 1, 4, 1)) & 0x03).reshape(r, b, 8, 16, 4)
        low_bits, low_bytes = 2, 128
    else:
        nibbles = section[:, :, :256].reshape(r, b, 4, 16, 4)
        steps = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=2)
        low_bits, low_bytes = 4, 256
    for index, bit in enumerate(range(low_bits, bits)):
        masks = section[:, :, low_bytes + 64 * index : low_bytes + 64 + 64 * index].reshape(r, b, 8, 8)
        flags = np.unpackbits(masks, axis=-1, bitorder="little").reshape(r, b, 8, 16, 4)
        steps = steps | (flags << bit)
    return steps


def _lanes(values: np.ndarray, groups: int) -> np.ndarray:
    # [G*16, C] per-row values -> [G, C, 16] (lane-major within a group)
    return values.reshape(groups, ROWS_PER_GROUP, -1).transpose(0, 2, 1)


def pack(parts: QuantParts) -> np.ndarray:
    """The kernel's packed bytes [groups * tiles * tile_bytes] uint8 of `parts`."""
    fmt = parts.format
    n, k = parts.shape
    if k % TILE_K[fmt]:
        raise ValueError(f"{fmt} needs K to be a multiple of {TILE_K[fmt]}, got {k}")
    rows = -(-n // ROWS_PER_GROUP) * ROWS_PER_GROUP
    groups = rows // ROWS_PER_GROUP
    q = _pad_rows(parts.q, rows)
    if fmt in FLOAT16_FORMATS:  # [G*16, K] -> [G, K/32 tiles, 32 k, 16 rows]
        tiles16 = q.reshape(groups, ROWS_PER_GROUP, k // 32, 32).transpose(0, 2, 3, 1)
        return np.ascontiguousarray(tiles16).view(np.uint8).reshape(-1)
    quants = _pack_quants(_steps(q, groups, k // 32), QUANT_BITS[fmt])  # [G, K/32, bytes]

    def lanes(values: np.ndarray) -> np.ndarray:  # -> [G, C, 16 * itemsize] bytes
        lane_values = np.ascontiguousarray(_lanes(_pad_rows(values, rows), groups))
        return lane_values.view(np.uint8).reshape(groups, lane_values.shape[1], -1)

    if TILE_K[fmt] == 32:
        scales = [lanes(parts.d)] + ([lanes(parts.dmin)] if fmt in BLOCK_MINS else [])
        tiles = np.concatenate([quants, *scales], axis=-1)
    else:
        supers = k // 256
        subs = quants.reshape(groups, supers, -1)
        if FORMATS[fmt].int8_scales:
            header = [lanes(parts.d), lanes(parts.sc).reshape(groups, supers, -1)]
        elif fmt == "Q2_K":
            scales_mins = lanes(parts.sc | (parts.m << 4)).reshape(groups, supers, -1)
            header = [lanes(parts.d), lanes(parts.dmin), scales_mins]
        else:
            header = [
                lanes(parts.d),
                lanes(parts.dmin),
                lanes(parts.sc).reshape(groups, supers, -1),
                lanes(parts.m).reshape(groups, supers, -1),
            ]
        tiles = np.concatenate(header + [subs], axis=-1)
    assert tiles.shape[-1] == TILE_BYTES[fmt], (fmt, tiles.shape)
    return np.ascontiguousarray(tiles).reshape(-1)


def unpack_rows(format: str, packed: np.ndarray, *, rows: np.ndarray, cols: int) -> QuantParts:
    """The parts of the weight rows `rows` [R] from packed bytes (the inverse of `pack`)."""
    tiles_per_group = cols // TILE_K[format]
    tiles = packed.reshape(-1, tiles_per_group, TILE_BYTES[format])
    rows = np.asarray(rows, dtype=np.int64)
    group, lane = rows // ROWS_PER_GROUP, rows % ROWS_PER_GROUP
    chosen = tiles[group]  # [R, T, tile]
    r = len(rows)
    pick = np.arange(r)

    def lane_values(section: np.ndarray, dtype: np.dtype, per_tile: int) -> np.ndarray:
        # section [R, T, per_tile * 16 * itemsize] -> [R, T * per_tile] values of each row's lane
        values = np.ascontiguousarray(section).view(dtype).reshape(r, -1, ROWS_PER_GROUP)
        return values[pick, :, lane]

    if format in FLOAT16_FORMATS:
        return QuantParts(format=format, q=lane_values(chosen, np.uint16, 32), d=_no_scales(r))

    if TILE_K[format] == 32:
        quant_bytes = TILE_BYTES[format] - (64 if format in BLOCK_MINS else 32)
        steps = _unpack_quants(chosen[:, :, :quant_bytes], QUANT_BITS[format])  # [R, T, 8, 16, 4]
        q = steps[pick, :, :, lane, :].reshape(r, cols)
        d = lane_values(chosen[:, :, quant_bytes : quant_bytes + 32], np.float16, 1)
        if format in BLOCK_MINS:
            dmin = lane_values(chosen[:, :, quant_bytes + 32 :], np.float16, 1)
            return QuantParts(format=format, q=q, d=d, dmin=dmin)
        return QuantParts(format=format, q=q, d=d)
    spec = FORMATS[format]
    # Q2_K, Q4_K, Q5_K: d, dmin, scales and mins in 320 bytes
    header = spec.int8_scale_header if spec.int8_scales else 320
    sub_bytes = (TILE_BYTES[format] - header) // 8
    subs = chosen[:, :, header:].reshape(r, tiles_per_group * 8, sub_bytes)
    steps = _unpack_quants(subs, QUANT_BITS[format])
    q = steps[pick, :, :, lane, :].reshape(r, cols)
    d = lane_values(chosen[:, :, 0:32], np.float16, 1)
    if format == "Q2_K":
        scales_mins = lane_values(chosen[:, :, 64:320], np.uint8, 16)
        dmin = lane_values(chosen[:, :, 32:64], np.float16, 1)
        return QuantParts(format=format, q=q, d=d, dmin=dmin, sc=scales_mins & 0x0F, m=scales_mins >> 4)
    if spec.int8_scales:
        return QuantParts(
            format=format, q=q, d=d, sc=lane_values(chosen[:, :, 32:header], np.int8, (header - 32) // 16)
        )
    return QuantParts(
        format=format,
        q=q,
        d=d,
        dmin=lane_values(chosen[:, :, 32:64], np.float16, 1),
        sc=lane_values(chosen[:, :, 64:192], np.uint8, 8),
        m=lane_values(chosen[:, :, 192:320], np.uint8, 8),
    )


def embedding_rows(weight: torch.Tensor | QuantizedWeight, token_ids: torch.Tensor) -> torch.Tensor:
    """Rows `token_ids` [...] of an embedding, float or quantized -> [..., D]."""
    if isinstance(weight, QuantizedWeight):
        return weight.rows(token_ids)
    return torch.nn.functional.embedding(token_ids, weight)


# --------------------------------------------------------------------------------------------------
# The weight object the decoder holds
# --------------------------------------------------------------------------------------------------


@dataclass
class PackedPart:
    """Rows [row_start, row_start + rows) of a QuantizedWeight, packed in one format."""

    format: str
    packed: torch.Tensor  # [bytes] uint8
    row_start: int
    rows: int


class QuantizedWeight:
    """A linear layer's weight [N, K] kept quantized: one or more row ranges (a fused q/k/v may
    mix formats), each packed for the kernels.  Looks enough like a weight tensor for the code
    that reads rows of it (embedding lookups, heads that copy rows of the LM head)."""

    def __init__(self, parts: list[PackedPart], *, shape: tuple[int, int]):
        expected = 0
        for part in parts:
            if part.row_start != expected:
                raise ValueError(f"packed parts leave a gap at row {expected}")
            expected += part.rows
        if expected != shape[0]:
            raise ValueError(f"packed parts cover {expected} rows of {shape[0]}")
        self.parts = parts
        self.shape = torch.Size(shape)
        self.dtype = torch.float32  # what rows read from it and the linear's output are
        self.device = torch.device("cpu")

    @classmethod
    def from_parts(cls, parts_list: list[QuantParts]) -> QuantizedWeight:
        """Rows of several decoded tensors stacked (q, k, v or gate, up), same K.  Neighbours of
        one format whose row counts are whole groups are packed together."""
        cols = parts_list[0].shape[1]
        if any(p.shape[1] != cols for p in parts_list):
            raise ValueError("stacked quantized tensors must have the same number of columns")
        merged: list[list[QuantParts]] = []
        for parts in parts_list:
            last = merged[-1] if merged else None
            if last and last[-1].format == parts.format and all(p.shape[0] % ROWS_PER_GROUP == 0 for p in last):
                last.append(parts)
            else:
                merged.append([parts])
        packed_parts, row = [], 0
        for run in merged:
            rows = sum(p.shape[0] for p in run)
            data = np.concatenate([pack(p) for p in run])
            packed_parts.append(
                PackedPart(format=run[0].format, packed=torch.from_numpy(data), row_start=row, rows=rows)
            )
            row += rows
        return cls(packed_parts, shape=(row, cols))

    @property
    def nbytes(self) -> int:
        return sum(part.packed.numel() for part in self.parts)

    def dim(self) -> int:
        return 2

    def detach(self) -> QuantizedWeight:
        return self

    def parts_of_rows(self, rows: torch.Tensor) -> list[tuple[PackedPart, np.ndarray, np.ndarray]]:
        """(part, positions in `rows`, rows within the part) for every part that `rows` touches."""
        index = rows.reshape(-1).to("cpu", torch.int64).numpy()
        if index.size and (index.min() < 0 or index.max() >= self.shape[0]):
            raise IndexError(f"row index out of range for a weight of {self.shape[0]} rows")
        out = []
        for part in self.parts:
            where = np.nonzero((index >= part.row_start) & (index < part.row_start + part.rows))[0]
            if where.size:
                out.append((part, where, index[where] - part.row_start))
        return out

    def rows(self, index: torch.Tensor) -> torch.Tensor:  # [...] int -> [..., K] float32
        """Dequantized rows (bit-identical to the float32 conversion of the GGUF file).  A Q8_0,
        F16 or BF16 weight in one part (an embedding table) is read by the C++ kernel where it is
        built: a token's row in ~1 us instead of ~30 us of numpy, once per forward and draft depth."""
        # Imported here: the kernels' module imports this one.
        from quickdraft.kernels.quant_linear import rows_kernel

        kernel = rows_kernel() if index.device.type == "cpu" else None
        part = self.parts[0]
        if kernel is not None and len(self.parts) == 1 and part.format in ("Q8_0", *FLOAT16_FORMATS):
            fmt = FORMATS[part.format].kernel_id
            flat = kernel.dequantize_rows(part.packed, fmt, self.shape[0], self.shape[1], index.reshape(-1))
            return flat.view(*index.shape, self.shape[1])
        flat = torch.empty(index.numel(), self.shape[1], dtype=torch.float32)
        for part, where, local in self.parts_of_rows(index):
            parts = unpack_rows(part.format, part.packed.numpy(), rows=local, cols=self.shape[1])
            flat[torch.from_numpy(where)] = torch.from_numpy(parts.dequantize())
        return flat.view(*index.shape, self.shape[1])

    def dequantize(self) -> torch.Tensor:  # -> [N, K] float32
        return self.rows(torch.arange(self.shape[0]))

    def __getitem__(self, key) -> torch.Tensor:
        if isinstance(key, torch.Tensor):
            return self.rows(key)
        return self.rows(torch.arange(self.shape[0])[key])

    # ---- slices that stay quantized (tensor-parallel shards) ----------------------------------
    def take_rows(self, ranges: list[tuple[int, int]], *, zero_rows: int = 0) -> QuantizedWeight:
        """Rows [start, stop) of each range, in order, then `zero_rows` rows of zeros; the same
        quants and scales, so the same bits out of the kernels.  A range that starts and ends
        on a group of 16 rows is a slice of the packed bytes; other rows are unpacked and packed
        again (small: heads and MLP units of a layer)."""
        pieces: list[PackedPart] = []
        for start, stop in ranges:
            if not 0 <= start <= stop <= self.shape[0]:
                raise IndexError(f"rows [{start}, {stop}) outside a weight of {self.shape[0]} rows")
            for part in self.parts:
                lo = max(start, part.row_start) - part.row_start
                hi = min(stop, part.row_start + part.rows) - part.row_start
                if lo < hi:
                    pieces.append(_part_rows(part, lo, hi, cols=self.shape[1]))
        if zero_rows:
            fmt = pieces[-1].format if pieces else self.parts[-1].format
            size = -(-zero_rows // ROWS_PER_GROUP) * (self.shape[1] // TILE_K[fmt]) * TILE_BYTES[fmt]
            zeros = torch.zeros(size, dtype=torch.uint8)  # d = 0: every value 0 in every format
            pieces.append(PackedPart(format=fmt, packed=zeros, row_start=0, rows=zero_rows))
        return QuantizedWeight(_stacked(pieces), shape=(sum(p.rows for p in pieces), self.shape[1]))

    def take_columns(self, start: int, stop: int) -> QuantizedWeight:
        """Columns [start, stop): whole tiles of every part (a slice of the packed bytes; the
        bounds must be multiples of the formats' tile width, 32 or 256)."""
        cols = self.shape[1]
        if not 0 <= start < stop <= cols:
            raise IndexError(f"columns [{start}, {stop}) outside a weight of {cols} columns")
        parts = []
        for part in self.parts:
            width = TILE_K[part.format]
            if start % width or stop % width:
                raise ValueError(
                    f"{part.format} weights split only at multiples of {width} columns, not at [{start}, {stop})"
                )
            tiles = part.packed.view(-1, cols // width, TILE_BYTES[part.format])[:, start // width : stop // width]
            parts.append(dataclasses.replace(part, packed=tiles.contiguous().view(-1)))
        return QuantizedWeight(parts, shape=(self.shape[0], stop - start))

    def __repr__(self) -> str:
        formats = "+".join(part.format for part in self.parts)
        return f"QuantizedWeight({formats}, shape={tuple(self.shape)}, {self.nbytes / 2**20:.1f} MiB)"


def _part_rows(part: PackedPart, start: int, stop: int, *, cols: int) -> PackedPart:
    """Rows [start, stop) of one packed part (row_start 0; `_stacked` numbers the parts)."""
    group_bytes = cols // TILE_K[part.format] * TILE_BYTES[part.format]
    if start % ROWS_PER_GROUP == 0 and (stop % ROWS_PER_GROUP == 0 or stop == part.rows):
        first, last = start // ROWS_PER_GROUP, -(-stop // ROWS_PER_GROUP)
        packed = part.packed[first * group_bytes : last * group_bytes].clone()
    else:
        parts = unpack_rows(part.format, part.packed.numpy(), rows=np.arange(start, stop), cols=cols)
        packed = torch.from_numpy(pack(parts))
    return PackedPart(format=part.format, packed=packed, row_start=0, rows=stop - start)


def _stacked(pieces: list[PackedPart]) -> list[PackedPart]:
    """Consecutive row pieces as parts of one weight: neighbours of one format are joined when
    the first ends on a whole group (its padding rows would otherwise sit between them)."""
    parts: list[PackedPart] = []
    row = 0
    for piece in pieces:
        last = parts[-1] if parts else None
        if last is not None and last.format == piece.format and last.rows % ROWS_PER_GROUP == 0:
            packed = torch.cat([last.packed, piece.packed])
            parts[-1] = dataclasses.replace(last, packed=packed, rows=last.rows + piece.rows)
        else:
            parts.append(dataclasses.replace(piece, row_start=row))
        row += piece.rows
    return parts


def quantized_weights(model: torch.nn.Module) -> list[QuantizedWeight]:
    """The QuantizedWeight attributes of a model's modules (outside its state dict)."""
    found = (value for module in model.modules() for value in vars(module).values())
    return [value for value in found if isinstance(value, QuantizedWeight)]


def matrix_weights(model: torch.nn.Module) -> int:
    """Elements of a model's weight matrices, float (in its state dict) or kept quantized (a
    GGUF target loaded as stored holds QuantizedWeight attributes, outside the state dict)."""
    floats = sum(t.numel() for name, t in model.state_dict().items() if t.dim() == 2 and not name.startswith("rotary"))
    return floats + sum(weight.shape.numel() for weight in quantized_weights(model))
