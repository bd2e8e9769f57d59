"""Building blocks of the decoder: RMSNorm, rotary embeddings, the linear kernel hook."""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

from quickdraft.models.config import RopeConfig

LinearFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def default_linear_fn(device: torch.device) -> LinearFn:
    """The fastest exact linear for the device: our skinny kernel on CPU, torch elsewhere."""
    if device.type != "cpu":
        return F.linear
    try:
        from quickdraft.kernels.cpu_linear import skinny_linear
    except ImportError:
        return F.linear
    return skinny_linear


class RMSNorm(torch.nn.Module):
    """RMSNorm in float32, with the two conventions the supported models use.

    Gemma multiplies by ``1 + weight`` in float32 and then casts; Llama/Qwen cast the
    normalised activations back first and multiply by the weight in the model dtype.  The
    difference only shows in bfloat16, where we follow each reference exactly.
    """

    def __init__(self, dim: int, *, eps: float, unit_offset: bool, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        param_dtype = torch.float32 if unit_offset else dtype
        self.weight = torch.nn.Parameter(torch.ones(dim, dtype=param_dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., D] -> [..., D]
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (normed * (1.0 + self.weight)).to(x.dtype)
        return self.weight * normed.to(x.dtype)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:  # -> [head_dim // 2]
    inv_freq = 1.0 / (
        rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    )
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope)
    return inv_freq


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
    """cos/sin for every position up to max_len, computed once like the reference does."""

    def __init__(self, rope: RopeConfig, *, head_dim: int, max_len: int, dtype: torch.dtype):
        super().__init__()
        inv_freq = rope_inv_freq(rope, head_dim)  # [D/2]
        freqs = torch.arange(max_len, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)  # [max_len, D]
        self.register_buffer("cos", emb.cos().to(dtype), persistent=False)
        self.register_buffer("sin", emb.sin().to(dtype), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [N] -> cos, sin [N, 1, D] (broadcast over heads)
        return self.cos[positions][:, None, :], self.sin[positions][:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [N, H, D], cos/sin [N, 1, D]; rotate-half convention (HF / NeoX layout)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
