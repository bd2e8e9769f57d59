"""Linear layers on GGUF-quantized weights, batch-invariant by construction.

``quant_linear(x, weight)`` computes ``x @ weight.T`` for a ``QuantizedWeight``.  Every row of x
is quantized to int8 per 32 values, each 32-wide block's dot product is an exact integer, and
one float32 accumulator per output adds the blocks in K order with the formula written in
``csrc/quant_linear.cpp``.  A row's result therefore never depends on how many rows share the
call, nor on the threads: the value of a token verified inside a 16-node tree is bit-identical to
the value of that token decoded alone.

Three implementations of the same numerics, bit for bit, the first that runs here is used:
- the AVX-512 VNNI build of ``csrc/quant_linear.cpp`` (also the one-call decoder layer);
- its AVX2 build (the same source with ``-DQD_ISA_AVX2``: AMD Zen 2/3, older Intel, laptops);
- ``reference_quant_linear``, portable torch code, used where neither kernel can run (other
  CPUs, ``QUICKDRAFT_DISABLE_CPU_KERNEL=1``) and as the tests' oracle.  It is slow (it decodes
  the weight on every call), so the loader warns when a quantized model has to use it.
``QUICKDRAFT_CPU_ISA=avx512|avx2|reference`` forces one (``auto``, the default, picks as above);
a forced kernel this CPU cannot run leaves the reference (logged once when its build is tried).
The variable is read at every call, so tests can switch it with monkeypatch.

Activation quants have 127 levels a side, or 63 where a caller asks for them
(``activation_levels``): a Q8_0 LM head does under ``QUICKDRAFT_LM_HEAD_NARROW=1``
(``lm_head_activation_levels``), and the AVX2 build then multiplies its weights without a sign
flip (faster, less precise: off by default).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch

from quickdraft.kernels.build import LazyKernel
from quickdraft.models.lora import SITES as LORA_SITES
from quickdraft.models.lora import LoRABatch
from quickdraft.models.quantized import (
    BLOCK_MINS,
    FLOAT16_FORMATS,
    FORMAT_IDS,
    LEVELS,
    OFFSETS,
    SCALES_OF_16,
    PackedPart,
    QuantizedWeight,
    unpack_rows,
)

__all__ = [
    "AMX_ENV",
    "ISAS",
    "ISA_ENV",
    "NARROW_LM_HEAD_ENV",
    "active_isa",
    "amx_min_rows",
    "draft_chain",
    "fused_layer_available",
    "isa_extension",
    "kernel_available",
    "lm_head_activation_levels",
    "norm_matmul",
    "quant_linear",
    "quantize_activations",
    "reference_quant_linear",
    "rows_kernel",
]

ISA_ENV = "QUICKDRAFT_CPU_ISA"
# The compiled builds, preferred first.
ISAS = ("avx512", "avx2")

# -ffp-contract=off: no fused multiply-adds, so the kernel's float operations are the
# reference's, one rounding each.
_KERNELS = {
    "avx512": LazyKernel(
        "quant_linear_v4",
        source="quant_linear.cpp",
        extra_cflags=("-ffp-contract=off",),
        what="the AVX2 kernel (the torch reference if forced)",
    ),
    "avx2": LazyKernel(
        "quant_linear_avx2_v4",
        source="quant_linear.cpp",
        extra_cflags=("-ffp-contract=off", "-DQD_ISA_AVX2"),
        what="the torch reference (slow)",
    ),
}


# AMX tiles (Sapphire Rapids and later) take the integer block dots of wide matmuls (prefill,
# verification trees, the LM head of a tree) in the AVX-512 build: the same bits (csrc/
# quant_linear.cpp says why), so the row count that picks them changes no result.
# QUICKDRAFT_CPU_AMX=0 turns them off.
AMX_ENV = "QUICKDRAFT_CPU_AMX"
# A block of 16 rows (the last one: the rows left) runs on the tiles, always 16 rows high, when
# it has at least this many rows, else on VNNI: with the weights prefetched into L2, VNNI is as
# fast up to 12 rows and within noise at 13-15 (measured in docs/performance-log.md).
AMX_MIN_ROWS = 16


def amx_min_rows() -> int:
    """The row count from which a 16-row block of a matmul runs on AMX tiles; 0 where none
    does (no AMX, not the AVX-512 build, or turned off)."""
    return _amx_min_rows(_extension())


def _amx_min_rows(ext: ModuleType | None) -> int:
    """amx_min_rows() for the kernel `ext` a caller already holds (one lookup per call)."""
    if ext is None or ext.isa != "avx512" or os.environ.get(AMX_ENV, "1").strip() in ("0", "false", "no"):
        return 0
    return AMX_MIN_ROWS if ext.amx_usable() else 0


def isa_extension(isa: str) -> ModuleType | None:
    """The compiled kernel of `isa` (one of ISAS), built on first use; None where it cannot run."""
    return _KERNELS[isa].get()


def _choice() -> str:
    choice = os.environ.get(ISA_ENV, "").strip().lower() or "auto"
    if choice not in ("auto", "reference", *ISAS):
        raise ValueError(f"{ISA_ENV}={choice!r}: expected auto, {', '.join(ISAS)} or reference")
    return choice


def _extension() -> ModuleType | None:
    """The kernel that quant_linear runs (None: the torch reference)."""
    choice = _choice()
    if choice == "reference":
        return None
    if choice != "auto":
        return isa_extension(choice)
    for isa in ISAS:
        ext = isa_extension(isa)
        if ext is not None:
            return ext
    return None


def active_isa() -> str:
    """What quant_linear runs now: "avx512", "avx2" or "reference"."""
    ext = _extension()
    return "reference" if ext is None else ext.isa


def kernel_available() -> bool:
    """True when quant_linear runs a compiled kernel, AVX-512 VNNI or AVX2 (builds it on first call)."""
    return _extension() is not None


def rows_kernel() -> ModuleType | None:
    """The compiled kernel whose ``dequantize_rows`` reads rows of a packed Q8_0, F16 or BF16
    weight (QuantizedWeight.rows), or None: the torch reference is forced, or nothing is built."""
    return _extension()


def fused_layer_available() -> bool:
    """True when the one-call decoder layer can run (both compiled builds have it)."""
    ext = _extension()
    return ext is not None and hasattr(ext, "decoder_layer")


# Activation quant levels: the default, and the narrow quants of lm_head_activation_levels.
ACTIVATION_LEVELS = 127
NARROW_ACTIVATION_LEVELS = 63
NARROW_LM_HEAD_ENV = "QUICKDRAFT_LM_HEAD_NARROW"


def lm_head_activation_levels(weight: QuantizedWeight) -> int:
    """How many levels a side the LM head's activation quants take: 127, or 63 for a Q8_0 head
    where QUICKDRAFT_LM_HEAD_NARROW=1 asks for narrow quants.  The AVX2 build multiplies those
    by the stored unsigned Q8_0 quants without a sign flip: the head 16-19% faster at 8-16 rows
    (a verification, a batch), forwards of 8-32 tokens ~5-10% faster, Spec-Bench first turns
    ~2% (within the runs' spread); nothing on AVX-512 VNNI.  Off by default for what it costs
    in fidelity, measured on the embedded model (docs/performance-log.md, session 59): the head's
    top-1 differs from unquantized activations' on 0.61% of rows instead of 0.30%, and greedy
    answers identical to the float32 dequantized model's fell from 45% to 37% (common prefix 68
    -> 58 of 128 tokens).  Read at every call, like QUICKDRAFT_CPU_ISA: set it before loading.
    Every path to the target's logits takes its levels from here, so plain and speculative
    decoding stay bit-identical whichever it is."""
    narrow = os.environ.get(NARROW_LM_HEAD_ENV, "0").strip().lower() not in ("", "0", "false", "no")
    if narrow and all(part.format == "Q8_0" for part in weight.parts):
        return NARROW_ACTIVATION_LEVELS
    return ACTIVATION_LEVELS


def quantize_activations(
    x: torch.Tensor, levels: int = ACTIVATION_LEVELS
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] float32 -> q [M, K] int8 within +-levels, dx [M, K/32] float32, bsum [M, K/16]
    int32 (torch)."""
    _check_levels(levels)
    m, k = x.shape
    blocks = x.reshape(m, k // 32, 32)
    amax = blocks.abs().amax(dim=-1)  # [M, K/32]
    dx = amax / float(levels)
    # A tensor numerator: `127.0 / amax` runs as reciprocal-then-multiply, off by an ulp for a
    # quarter of the scales, which flips a product sitting at a rounding tie (x * inv = 63.5)
    # away from the kernel's one IEEE division.
    inv = torch.where(amax > 0, torch.full_like(amax, float(levels)) / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inv[:, :, None]).clamp_(-levels, levels)
    bsum = q.reshape(m, k // 16, 16).sum(dim=-1).to(torch.int32)
    return q.to(torch.int8).reshape(m, k), dx, bsum


def _part_reference(
    part: PackedPart, q: torch.Tensor, dx: torch.Tensor, bsum: torch.Tensor, cols: int
) -> torch.Tensor:  # -> [M, rows]
    parts = unpack_rows(part.format, part.packed.numpy(), rows=np.arange(part.rows), cols=cols)
    # [N, K], exact small integers (IQ4_XS / IQ4_NL / MXFP4: their indices' signed levels, offset-free)
    levels = LEVELS.get(part.format)
    wq = torch.from_numpy((parts.q if levels is None else levels[parts.q]).astype(np.float64))
    xq = q.to(torch.float64)
    m, n = q.shape[0], part.rows

    def block_dot(start: int, width: int) -> torch.Tensor:  # [M, N] exact integer dot products
        return (xq[:, start : start + width] @ wq[:, start : start + width].T).round().to(torch.int64)

    bsum64 = bsum.to(torch.int64)
    acc = torch.zeros(m, n, dtype=torch.float32)
    for b in range(cols // 32):
        bsum32 = (bsum64[:, 2 * b] + bsum64[:, 2 * b + 1])[:, None]  # [M, 1]
        dxb = dx[:, b][:, None]  # [M, 1]
        if part.format in SCALES_OF_16:
            d = torch.from_numpy(parts.d[:, b // 8].astype(np.float32))[None, :]
            sc = torch.from_numpy(parts.sc.astype(np.int64))
            offset = OFFSETS[part.format]
            lo = block_dot(32 * b, 16) - offset * bsum64[:, 2 * b][:, None]
            hi = block_dot(32 * b + 16, 16) - offset * bsum64[:, 2 * b + 1][:, None]
            idot = sc[:, 2 * b][None, :] * lo + sc[:, 2 * b + 1][None, :] * hi
            term = (d * dxb) * idot.to(torch.float32)
        elif part.format == "IQ4_XS":
            d = torch.from_numpy(parts.d[:, b // 8].astype(np.float32))[None, :]
            sc = torch.from_numpy(parts.sc[:, b].astype(np.int64))[None, :]
            term = (d * dxb) * (sc * block_dot(32 * b, 32)).to(torch.float32)
        elif part.format == "Q2_K":
            d = torch.from_numpy(parts.d[:, b // 8].astype(np.float32))[None, :]
            dm = torch.from_numpy(parts.dmin[:, b // 8].astype(np.float32))[None, :]
            sc, mins = (torch.from_numpy(v.astype(np.int64)) for v in (parts.sc, parts.m))
            idot = sc[:, 2 * b][None, :] * block_dot(32 * b, 16) + sc[:, 2 * b + 1][None, :] * block_dot(
                32 * b + 16, 16
            )
            low = (
                mins[:, 2 * b][None, :] * bsum64[:, 2 * b][:, None]
                + mins[:, 2 * b + 1][None, :] * bsum64[:, 2 * b + 1][:, None]
            )
            term = (d * dxb) * idot.to(torch.float32) - (dm * dxb) * low.to(torch.float32)
        elif part.format in BLOCK_MINS:
            d = torch.from_numpy(parts.d[:, b].astype(np.float32))[None, :]
            dm = torch.from_numpy(parts.dmin[:, b].astype(np.float32))[None, :]
            term = (d * dxb) * block_dot(32 * b, 32).to(torch.float32) - (dm * dxb) * bsum32.to(torch.float32)
        elif part.format in OFFSETS or part.format in LEVELS:  # IQ4_NL, MXFP4: signed levels, no offset
            d = torch.from_numpy(parts.d[:, b].astype(np.float32))[None, :]
            idot = block_dot(32 * b, 32) - OFFSETS.get(part.format, 0) * bsum32
            term = (d * dxb) * idot.to(torch.float32)
        else:  # Q4_K, Q5_K
            ds = torch.from_numpy(parts.d[:, b // 8].astype(np.float32) * parts.sc[:, b].astype(np.float32))[None, :]
            dm = torch.from_numpy(parts.dmin[:, b // 8].astype(np.float32) * parts.m[:, b].astype(np.float32))[None, :]
            term = (ds * dxb) * block_dot(32 * b, 32).to(torch.float32) - (dm * dxb) * bsum32.to(torch.float32)
        acc = acc + term
    return acc


def _float16_part_reference(part: PackedPart, x: torch.Tensor, cols: int) -> torch.Tensor:  # [M, K] -> [M, rows]
    """float16_tile's operations: per 32-k tile, four chains of float32 products (k = j, j + 4,
    ... in k order), (c0 + c1) + (c2 + c3) added to the accumulator tile after tile."""
    parts = unpack_rows(part.format, part.packed.numpy(), rows=np.arange(part.rows), cols=cols)
    w = torch.from_numpy(parts.dequantize())  # [N, K], exactly the stored values
    acc = torch.zeros(x.shape[0], part.rows, dtype=torch.float32)
    for start in range(0, cols, 32):
        products = x[:, None, start : start + 32] * w[None, :, start : start + 32]  # [M, N, 32]
        steps = products.view(*products.shape[:2], 8, 4)  # [M, N, k // 4, chain]
        chains = steps[:, :, 0]
        for i in range(1, 8):
            chains = chains + steps[:, :, i]
        acc = acc + ((chains[..., 0] + chains[..., 1]) + (chains[..., 2] + chains[..., 3]))
    return acc


def _check_levels(levels: int) -> None:
    if levels not in (ACTIVATION_LEVELS, NARROW_ACTIVATION_LEVELS):
        raise ValueError(f"activation_levels must be {ACTIVATION_LEVELS} or {NARROW_ACTIVATION_LEVELS}, got {levels!r}")


def reference_quant_linear(
    x: torch.Tensor, weight: QuantizedWeight, *, activation_levels: int = ACTIVATION_LEVELS
) -> torch.Tensor:
    """The kernel's numerics in plain torch: x [..., K] -> [..., N] float32."""
    k = weight.shape[1]
    x2 = x.reshape(-1, k).to(torch.float32)
    q, dx, bsum = quantize_activations(x2, activation_levels)
    out = torch.empty(x2.shape[0], weight.shape[0], dtype=torch.float32)
    for part in weight.parts:
        if part.format in FLOAT16_FORMATS:
            value = _float16_part_reference(part, x2, k)
        else:
            value = _part_reference(part, q, dx, bsum, k)
        out[:, part.row_start : part.row_start + part.rows] = value
    return out.view(*x.shape[:-1], weight.shape[0])


def quant_linear(
    x: torch.Tensor,
    weight: QuantizedWeight,
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,  # [M, N] float32, contiguous: written instead of a new tensor
    activation_levels: int = ACTIVATION_LEVELS,
) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for x [..., K] float32 (other dtypes are cast) -> [..., N] float32.

    `out` (x 2-D, no bias) lets a caller reuse one buffer across calls: a fresh LM-head output
    of M x 262k floats is M MiB of pages the kernel first-touches, a page fault per 4 KiB.
    `activation_levels`: 127, or 63 (narrow quants: see lm_head_activation_levels)."""
    _check_levels(activation_levels)
    k = weight.shape[1]
    if x.shape[-1] != k:
        raise ValueError(f"quant_linear: x has {x.shape[-1]} features, the weight {k}")
    if out is not None:
        _check_out(out, x=x, cols=weight.shape[0], has_bias=bias is not None)
    ext = _extension() if x.device.type == "cpu" else None
    if ext is None:
        result = reference_quant_linear(x.cpu(), weight, activation_levels=activation_levels).to(x.device)
        out = result if out is None else out.copy_(result)
    else:
        x2 = x.reshape(-1, k).to(torch.float32).contiguous()
        # F16 / BF16 parts read x as it is: its int8 quants only where another format needs them
        if any(part.format not in FLOAT16_FORMATS for part in weight.parts):
            q, dx, bsum = ext.quantize_rows(x2, activation_levels)
        if out is None:
            out = torch.empty(x2.shape[0], weight.shape[0], dtype=torch.float32)
        amx_rows = _amx_min_rows(ext)
        for part in weight.parts:
            fmt = FORMAT_IDS[part.format]
            if part.format in FLOAT16_FORMATS:
                ext.float16_matmul(x2, part.packed, fmt, part.rows, k, out, part.row_start)
            else:
                ext.quant_matmul(
                    q, dx, bsum, part.packed, fmt, part.rows, k, out, part.row_start, amx_rows, activation_levels
                )
        out = out.view(*x.shape[:-1], weight.shape[0])
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out


def _check_out(out: torch.Tensor, *, x: torch.Tensor, cols: int, has_bias: bool) -> None:
    if has_bias or x.dim() != 2:
        raise ValueError("quant_linear: out= needs a 2-D x and no bias")
    rows = x.shape[0]
    if out.shape != (rows, cols) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(
            f"quant_linear: out must be a contiguous float32 [{rows}, {cols}] tensor, "
            f"got {out.dtype} {tuple(out.shape)}{'' if out.is_contiguous() else ' (not contiguous)'}"
        )


def _parts(weight: QuantizedWeight) -> list[tuple[int, torch.Tensor, int, int]]:
    return [(FORMAT_IDS[p.format], p.packed, p.rows, p.row_start) for p in weight.parts]


def norm_matmul(
    x: torch.Tensor, *, norm: torch.Tensor, weight: QuantizedWeight, eps: float, segment: int | None = None
) -> torch.Tensor:
    """rms_norm(x) @ weight.T in one call (``norm_matmul`` in csrc/quant_linear.cpp): x [M, K]
    float32, each row normalized per run of `segment` values (default K) with its slice of
    `norm` [K] -> [M, N].  Needs ``fused_layer_available()``; its normalization rounds like
    the decoder layer's, not like torch's (for drafting, where precision only moves guesses)."""
    ext = _extension()
    return ext.norm_matmul(x, norm, segment or x.shape[-1], eps, _parts(weight), weight.shape[0], _amx_min_rows(ext))


@dataclass(frozen=True)
class MixtureWeights:
    """A mixture-of-experts layer's MLP as the one-call layer takes it (``Mixture`` in
    csrc/quant_linear.cpp): the float router, each expert's quantized matmuls, and a shared
    expert's where the architecture has one."""

    router: torch.Tensor  # [E, D] float32
    experts: list[tuple[QuantizedWeight, QuantizedWeight]]  # per expert: gate_up [2 I, D], down [D, I]
    experts_per_token: int
    renormalize: bool
    shared: tuple[QuantizedWeight, QuantizedWeight] | None = None  # the shared expert: [2 S, D], [D, S]
    shared_gate: torch.Tensor | None = None  # [1, D] float32: the shared expert's sigmoid gate
    router_bias: torch.Tensor | None = None  # [E] float32 (gpt-oss)
    expert_biases: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per expert: [2 I], [D] (gpt-oss)
    swiglu_oai: tuple[float, float] | None = None  # gpt-oss's activation: (limit, alpha); None: the layer's

    def kernel_object(self) -> object:
        return _extension().Mixture(
            self.router.contiguous(),
            [_parts(gate_up) for gate_up, _ in self.experts],
            [_parts(down) for _, down in self.experts],
            self.experts_per_token,
            self.renormalize,
            [] if self.shared is None else _parts(self.shared[0]),
            [] if self.shared is None else _parts(self.shared[1]),
            0 if self.shared is None else self.shared[1].shape[1],
            self.shared_gate,
            self.router_bias,
            [] if self.expert_biases is None else [(gu.contiguous(), d.contiguous()) for gu, d in self.expert_biases],
            *(self.swiglu_oai or (0.0, 0.0)),
        )


@dataclass(frozen=True)
class FusedLayerWeights:
    """What a fused decoder layer hands the kernel unchanged from one call to the next, gathered
    once (`FusedLayerWeights.of`): rebuilding the part lists and norm lookups at every call cost
    ~60 us of Python per layer, a quarter of a batch-1 decode's layer time, with the other core
    idle meanwhile."""

    qkv: list[tuple[int, torch.Tensor, int, int]]
    o_proj: list[tuple[int, torch.Tensor, int, int]]
    gate_up: list[tuple[int, torch.Tensor, int, int]]
    down: list[tuple[int, torch.Tensor, int, int]]
    input_norm: torch.Tensor  # [D]
    post_attention_norm: torch.Tensor  # [D]
    pre_feedforward_norm: torch.Tensor | None  # [D] Gemma's sandwich norms, or None
    post_feedforward_norm: torch.Tensor | None  # [D]
    qk_norm: torch.Tensor | None  # [H + Hkv, hd]
    eps: float
    gelu: bool
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    scale: float
    softcap: float = 0.0  # Gemma 2's attention score cap (0: none)
    mixture: object | None = None  # the kernel's Mixture where experts replace the dense MLP
    extras: object | None = None  # the kernel's LayerExtras where a matmul has a bias or attention sinks

    def weight_args(self) -> tuple:
        """The kernels' layer arguments before the per-call ones (decoder_layer, DecoderStack)."""
        return (
            self.qkv,
            self.o_proj,
            self.gate_up,
            self.down,
            self.input_norm,
            self.post_attention_norm,
            self.pre_feedforward_norm,
            self.post_feedforward_norm,
            self.qk_norm,
            self.eps,
            self.gelu,
        )

    def size_args(self) -> tuple:
        """The kernels' head and width arguments (after the per-call ones in decoder_layer)."""
        return (self.num_heads, self.num_kv_heads, self.head_dim, self.intermediate_size, self.scale, self.softcap)

    def tail_args(self) -> tuple:
        """The kernels' last arguments: the mixture (None: the dense MLP), the extras (None: none)."""
        return (self.mixture, self.extras)

    @classmethod
    def of(
        cls,
        *,
        weights: dict[str, QuantizedWeight],
        norms: dict[str, torch.Tensor | None],
        eps: float,
        gelu: bool,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        softcap: float | None = None,
        mixture: MixtureWeights | None = None,
        extras: dict[str, torch.Tensor | None] | None = None,
    ) -> FusedLayerWeights:
        """`weights`: qkv_proj, o_proj, and gate_up_proj, down_proj unless `mixture` replaces them;
        `extras`: float32 biases [out] by the same names, and "sinks" [H] (None or absent: none)."""
        dense = mixture is None
        extras = {name: value for name, value in (extras or {}).items() if value is not None}
        return cls(
            qkv=_parts(weights["qkv_proj"]),
            o_proj=_parts(weights["o_proj"]),
            gate_up=_parts(weights["gate_up_proj"]) if dense else [],
            down=_parts(weights["down_proj"]) if dense else [],
            input_norm=norms["input"],
            post_attention_norm=norms["post_attention"],
            pre_feedforward_norm=norms["pre_feedforward"],
            post_feedforward_norm=norms["post_feedforward"],
            qk_norm=norms["qk"],
            eps=eps,
            gelu=gelu,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            intermediate_size=(weights["down_proj"] if dense else mixture.experts[0][1]).shape[1],
            scale=scale,
            softcap=softcap or 0.0,
            mixture=None if dense else mixture.kernel_object(),
            extras=(
                _extension().LayerExtras(
                    *(extras.get(site) for site in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "sinks"))
                )
                if extras
                else None
            ),
        )


@dataclass(frozen=True)
class FusedSequences:
    """The sequences of one fused layer call, flattened as the kernel reads them; the same for
    every layer of one attention type in a forward, so built once per forward and type."""

    seqs: list[int]  # per sequence (table_start, row_start, row_end, kv_start, kv_end)
    tables: list[int]  # the sequences' block tables, one after the other
    masks: list[torch.Tensor | None]  # per sequence [rows, kv_end - kv_start] bool, or None

    @classmethod
    def of(
        cls,
        *,
        sequences: list[tuple[int, int, int, int]],
        block_tables: list[list[int]],
        masks: list[torch.Tensor | None],
    ) -> FusedSequences:
        """sequences: per sequence (row_start, row_end, kv_start, kv_end), its new rows' KV
        written at storage indices kv_end - rows .. kv_end - 1 of its block table."""
        seqs: list[int] = []
        tables: list[int] = []
        for (row_start, row_end, kv_start, kv_end), table in zip(sequences, block_tables, strict=True):
            seqs += [len(tables), row_start, row_end, kv_start, kv_end]
            tables += table
        return cls(seqs=seqs, tables=tables, masks=masks)


class FusedStack:
    """A decoder's layers for one C++ call per forward (``DecoderStack`` in csrc/quant_linear.cpp):
    each layer's FusedLayerWeights handed to the kernel once, at construction.  `layers` are kept
    (`built_from` compares them by identity: a layer whose weights or norms were replaced gives
    a new FusedLayerWeights, and its owner builds a new stack)."""

    def __init__(self, layers: list[FusedLayerWeights]):
        self.layers = tuple(layers)
        self._ext = _extension()
        self._stack = self._ext.DecoderStack()
        for layer in layers:
            self._stack.add_layer(*layer.weight_args(), *layer.size_args(), *layer.tail_args())
        self._lora_keys: dict[int, str] = {}  # slot -> the key of the adapter the kernel holds there

    def built_from(self, layers: list[FusedLayerWeights]) -> bool:
        """Whether this stack holds exactly these layers, with the kernel build in use now."""
        return (
            len(layers) == len(self.layers)
            and all(a is b for a, b in zip(layers, self.layers))
            and _extension() is self._ext
        )

    def forward(
        self,
        hidden: torch.Tensor,  # [N, D]
        *,
        start: int,
        end: int,
        rotary_kind: list[int],  # per layer: its index into rotary
        sequence_kind: list[int],  # per layer: its index into sequences
        rotary: list[tuple[torch.Tensor, torch.Tensor]],  # cos, sin [N, 1, hd] per kind
        sequences: list[FusedSequences],
        cache_keys: list[torch.Tensor],  # per layer [blocks, Hkv, block_size, hd]
        cache_values: list[torch.Tensor],
        capture: list[int],
        lora: LoRABatch | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Layers start..end-1 over `hidden` -> (the last one's output [N, D], the outputs of the
        layers in `capture`, in its order); `lora`: the adapters of its rows."""
        if lora is not None:
            self._hold_adapters(lora)
        out = self._stack.forward(
            hidden.contiguous(),
            start,
            end,
            rotary_kind,
            sequence_kind,
            [cos.reshape(cos.shape[0], -1) for cos, _ in rotary],
            [sin.reshape(sin.shape[0], -1) for _, sin in rotary],
            cache_keys,
            cache_values,
            [s.seqs for s in sequences],
            [s.tables for s in sequences],
            [s.masks for s in sequences],
            capture,
            _amx_min_rows(self._ext),
            lora.row_slots if lora is not None else [],
        )
        return out[0], out[1:]

    def _hold_adapters(self, lora: LoRABatch) -> None:
        """The kernel gets each slot's adapter (transposed for its loops) when the slot changed hands."""
        for slot, adapter in lora.adapters.items():
            if self._lora_keys.get(slot) == adapter.key:
                continue
            self._stack.clear_lora(slot)
            for index, sites in enumerate(adapter.layers):
                for site, parts in sites.items():
                    self._stack.set_lora(
                        slot,
                        index,
                        LORA_SITES.index(site),
                        [(part.a.t().contiguous(), part.b.t().contiguous(), part.col0) for part in parts],
                    )
            self._lora_keys[slot] = adapter.key


def fused_decoder_layer(
    hidden: torch.Tensor,
    *,
    layer: FusedLayerWeights,
    rotary: tuple[torch.Tensor, torch.Tensor],
    cache_keys: torch.Tensor,
    cache_values: torch.Tensor,
    sequences: FusedSequences,
) -> torch.Tensor:  # hidden [N, D] -> [N, D]
    """One decoder layer in one call (``decoder_layer`` in csrc/quant_linear.cpp); needs a
    compiled kernel (``fused_layer_available()``).  cache_keys / cache_values [num_blocks, Hkv,
    block_size, hd]; rotary: cos, sin [N, 1, hd]."""
    cos, sin = rotary
    ext = _extension()
    return ext.decoder_layer(
        hidden,
        *layer.weight_args(),
        cos.reshape(cos.shape[0], -1),
        sin.reshape(sin.shape[0], -1),
        cache_keys,
        cache_values,
        sequences.seqs,
        sequences.tables,
        sequences.masks,
        *layer.size_args(),
        _amx_min_rows(ext),
        *layer.tail_args(),
    )


def draft_chain(
    root: torch.Tensor,  # [1, D] the head's output after the root pair
    *,
    embed: QuantizedWeight,  # [V, D] the target's token embedding, Q8_0 in one part
    embed_scale: float | None,
    input_norm: torch.Tensor,  # [2 D] the token's then the feature's norm weights
    in_proj: QuantizedWeight,  # [D, 2 D]
    input_eps: float,
    layer: FusedLayerWeights,  # the head's block
    rotary_tables: tuple[torch.Tensor, torch.Tensor],  # cos, signed sin [max_len, hd]
    cache_keys: torch.Tensor,  # [blocks, Hkv, block_size, hd] the head's cache
    cache_values: torch.Tensor,
    block_table: list[int],
    first_true: int,
    num_true: int,
    final_norm: torch.Tensor,  # [D]
    final_eps: float,
    lm_rows: QuantizedWeight,  # [Vd, D] the draft vocabulary's LM rows
    mixture_address: int,  # draft_mixture.top_k_address()
    mixture_tensors: list[torch.Tensor],  # as csrc/quant_linear.cpp's draft_chain lists them
    mixture_eps: float,
    floors: list[float],  # per depth, the path log-probability a pick must keep
) -> tuple[list[int], list[float]]:
    """A copy-path head's top-1 chain grown in one call (``draft_chain`` in
    csrc/quant_linear.cpp, which says what it computes): the picks' target ids and
    log-probabilities, at most len(floors), as the depth-by-depth path picks them."""
    ext = _extension()
    cos, sin = rotary_tables
    ids, log_probs = ext.draft_chain(
        root,
        embed.parts[0].packed,
        embed.shape[0],
        0.0 if embed_scale is None else float(embed_scale),
        input_norm,
        _parts(in_proj),
        input_eps,
        layer.qkv,
        layer.o_proj,
        layer.gate_up,
        layer.down,
        layer.input_norm,
        layer.post_attention_norm,
        layer.eps,
        layer.gelu,
        cos,
        sin,
        cache_keys,
        cache_values,
        block_table,
        first_true,
        num_true,
        layer.num_heads,
        layer.num_kv_heads,
        layer.head_dim,
        layer.intermediate_size,
        layer.scale,
        final_norm,
        final_eps,
        _parts(lm_rows),
        lm_rows.shape[0],
        mixture_address,
        mixture_tensors,
        mixture_eps,
        floors,
        _amx_min_rows(ext),
    )
    return ids.tolist(), log_probs.tolist()
