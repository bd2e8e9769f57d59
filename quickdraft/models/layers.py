"""Building blocks of the decoder: RMSNorm, rotary embeddings, the linear kernel hook."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from quickdraft.models.config import RopeConfig

LinearFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def default_linear_fn(device: torch.device) -> LinearFn:
    """The fastest batch-invariant linear for the device: the quantized kernels for quantized
    weights, our skinny kernel for float weights on CPU, torch in fixed-size calls on CUDA
    (kernels/fixed_rows.py), torch elsewhere."""
    from quickdraft.kernels.quant_linear import quant_linear
    from quickdraft.models.quantized import QuantizedWeight

    float_linear: LinearFn = F.linear
    if device.type == "cpu":
        from quickdraft.kernels.cpu_linear import skinny_linear

        float_linear = skinny_linear
    elif device.type == "cuda":  # cuBLAS picks its kernel by row count: fixed-size calls keep rows' bits
        from quickdraft.kernels.fixed_rows import fixed_rows_linear

        float_linear = fixed_rows_linear

    def linear(x: torch.Tensor, weight, bias: torch.Tensor | None) -> torch.Tensor:
        if isinstance(weight, QuantizedWeight):
            return quant_linear(x, weight, bias)
        return float_linear(x, weight, bias)

    return linear


class RMSNorm(torch.nn.Module):
    """RMSNorm in float32, with the two conventions the supported models use.

    Gemma multiplies by ``1 + weight`` in float32 and then casts; Llama/Qwen cast the
    normalised activations back first and multiply by the weight in the model dtype.  The
    difference only shows in bfloat16, where we follow each reference exactly.  With
    ``unit_offset`` the loader stores ``1 + weight`` (float32) here, computed once.

    ``shape`` may have a leading dimension: one weight row per head, so that the q and k
    heads are normalised together in one call (each row over the last dimension).
    """

    def __init__(self, shape: tuple[int, ...], *, eps: float, unit_offset: bool, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.dim = shape[-1]
        param_dtype = torch.float32 if unit_offset else dtype
        self.weight = torch.nn.Parameter(torch.ones(shape, dtype=param_dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., *shape] -> same
        if x.dtype == torch.float32:
            # Fused ops, bit-identical to the reference formula in float32 (where both
            # conventions coincide); decode calls this ~60 times a step.
            if self.weight.dim() == 1:
                return F.rms_norm(x, (self.dim,), self.weight, self.eps)
            return F.rms_norm(x, (self.dim,), None, self.eps) * self.weight
        normed = F.rms_norm(x.float(), (self.dim,), None, self.eps)
        if self.unit_offset:
            return (normed * self.weight).to(x.dtype)
        return self.weight * normed.to(x.dtype)


def rope_inv_freq(rope: RopeConfig, head_dim: int, *, long_context: bool = False) -> torch.Tensor:  # -> [D // 2]
    """The rotation frequency of each dimension pair (i, i + D/2) of a head.

    With partial rotary (rotary_dim < D) the pairs past rotary_dim / 2 get frequency 0: cos 1,
    sin 0, an exact identity; `RopeConfig.dim_order` lays the pass-through dimensions there.
    long_context: LongRoPE's long factors (the context runs past the original length).
    """
    if rope.rope_type == "none":
        return torch.zeros(head_dim // 2, device="cpu")
    rotary_dim = rope.rotary_dim(head_dim)
    # On the CPU even under a meta-device context: a meta arange imports torch's symbolic-shape
    # machinery (sympy and ~800 modules, 68 MB resident) for a table that is rebuilt anyway.
    positions = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu")
    inv_freq = 1.0 / (rope.theta ** (positions.float() / rotary_dim))
    if rope.rope_type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, rope)
    elif rope.rope_type == "longrope":
        factors = rope.long_factor if long_context else rope.short_factor  # one a pair (ModelConfig checks)
        # as transformers computes it: 1 / (factor * theta ** (2i / d)), not inv_freq / factor
        inv_freq = 1.0 / (
            torch.tensor(factors, dtype=torch.float32, device="cpu") * rope.theta ** (positions.float() / rotary_dim)
        )
    elif rope.rope_type == "yarn":
        inv_freq = _yarn_inv_freq(rope, rotary_dim=rotary_dim)
    return torch.cat([inv_freq, inv_freq.new_zeros(head_dim // 2 - rotary_dim // 2)])


def _yarn_inv_freq(rope: RopeConfig, *, rotary_dim: int) -> torch.Tensor:  # -> [rotary_dim // 2]
    """YaRN: pair i keeps its frequency below the ramp, is slowed by `factor` above it (the pairs
    whose wavelengths the original context did not fit `beta_slow` times), linearly between, with
    the ramp's ends where `beta_fast` and `beta_slow` rotations fit the original context."""

    def pair_of(rotations: float) -> float:  # the (fractional) pair index with this many rotations
        wavelengths = rope.original_max_position_embeddings / (rotations * 2 * math.pi)
        return rotary_dim * math.log(wavelengths) / (2 * math.log(rope.theta))

    low, high = pair_of(rope.beta_fast), pair_of(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    # the same two frequencies transformers blends: 1 / (factor * theta^(2i/d)) and 1 / theta^(2i/d)
    pos_freqs = rope.theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / rotary_dim)
    interpolated, extrapolated = 1.0 / (rope.factor * pos_freqs), 1.0 / pos_freqs
    keep = 1 - ramp
    return interpolated * (1 - keep) + extrapolated * keep


def _llama3_inv_freq(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths slowed by `factor`, short kept, smooth between."""
    low_freq_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
    high_freq_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryTable(torch.nn.Module):
    """cos/sin for every position up to max_len, computed once like the reference does.

    The sine table carries the rotate-half sign (-sin on the first half), so applying the
    rotation is a roll and two products: exactly the reference's arithmetic, fewer ops.
    """

    def __init__(
        self, rope: RopeConfig, *, head_dim: int, max_len: int, dtype: torch.dtype, context_len: int | None = None
    ):
        """context_len: the longest sequence served (default max_len); past LongRoPE's original
        length the long factors rotate every position, a choice made once, as llama.cpp does, so
        that a token's rotation never depends on the other positions of its step."""
        super().__init__()
        long_context = (context_len or max_len) > rope.original_max_position_embeddings
        inv_freq = rope_inv_freq(rope, head_dim, long_context=long_context)  # [D/2]
        freqs = torch.arange(max_len, dtype=torch.float32, device="cpu")[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)  # [max_len, D]
        cos, sin = emb.cos(), emb.sin()
        if rope.attention_factor is not None:  # LongRoPE and YaRN scale the rotated dimensions' cos and sin
            rotated = torch.cat([inv_freq, inv_freq]) > 0  # [D]
            cos = torch.where(rotated, cos * rope.attention_factor, cos)
            sin = torch.where(rotated, sin * rope.attention_factor, sin)
        signed_sin = torch.cat([-sin[:, : head_dim // 2], sin[:, head_dim // 2 :]], dim=-1)
        self.register_buffer("cos", cos.to(dtype), persistent=False)
        self.register_buffer("signed_sin", signed_sin.to(dtype), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [N] -> cos, signed_sin [N, 1, D] (broadcast over heads); index_select, not
        # advanced indexing: the same gather at a third of the cost (~12 vs ~55 us at 17 rows)
        return self.cos.index_select(0, positions)[:, None, :], self.signed_sin.index_select(0, positions)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    # x [N, H, D], cos/signed_sin [N, 1, D]; rotate-half convention (HF / NeoX layout):
    # x * cos + cat(-x2, x1) * sin  ==  x * cos + roll(x, D/2) * signed_sin
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin
