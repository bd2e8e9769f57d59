"""Load a target model from a local HF directory, a GGUF file, or the embedded default."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from quickdraft.models.config import SUPPORTED_MODEL_TYPES, ModelConfig, moe_hf_names, moe_router_name
from quickdraft.models.decoder import Decoder
from quickdraft.models.heap import return_free_heap
from quickdraft.models.layers import RotaryTable, default_linear_fn
from quickdraft.models.quantized import QuantizedWeight
from quickdraft.models.quantized_loader import (
    PACKED_CACHE_FILE,
    PACKED_CACHE_FILE_WITH_Q8_0,
    PACKED_CACHE_PREFIX,
    load_packed,
    packed_into_huge_pages,
    quantized_state,
    save_packed,
)

logger = logging.getLogger(__name__)

DEFAULT_MODEL_ALIASES = ("default", "gemma-3-270m", "gemma3-270m")
SUPPORTED_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


QUANTIZATION_CHOICES = ("auto", "none", "gguf", "gguf+q8_0", "q8_0", "stored")


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """The compute dtype; "auto" is float32 (quantized weights, if any, compute in float32)."""
    if isinstance(dtype, torch.dtype):
        name = str(dtype).removeprefix("torch.")
    else:
        name = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "auto": "float32"}.get(dtype, dtype)
    if name not in SUPPORTED_DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}: choose one of {', '.join(SUPPORTED_DTYPES)}")
    return SUPPORTED_DTYPES[name]


def resolve_device(device: str | torch.device) -> torch.device:
    try:
        device = torch.device(device)
    except RuntimeError as err:
        raise ValueError(f"unsupported device {device!r}: use cpu or cuda") from err
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch sees no CUDA device")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {device}: use cpu or cuda")
    return device


def resolve_model_dir(model: str | os.PathLike | None, *, hf_overrides: dict | None = None) -> Path:
    """A local HF directory for `model`: converted and cached when it is a GGUF file; with
    `hf_overrides` (vLLM's), a cached directory that applies them (models/overrides.py)."""
    model_dir = _local_model_dir(model)
    if not hf_overrides:
        return model_dir
    from quickdraft.models import gguf
    from quickdraft.models.overrides import apply_hf_overrides

    return apply_hf_overrides(model_dir, hf_overrides, cache_root=gguf.cache_root() / "overrides")


def _local_model_dir(model: str | os.PathLike | None) -> Path:
    from quickdraft.models import gguf

    if model is None or str(model) in DEFAULT_MODEL_ALIASES:
        return gguf.default_model_dir()
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model {str(model)!r} not found: give a local HF directory (config.json + "
            f"safetensors), a .gguf file, or 'default' for the embedded Gemma 3 270M"
        )
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model file {path} is not a .gguf file")
        stat = path.stat()
        key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
        out_dir = gguf.cache_root() / "gguf" / f"{path.stem}-{key}"
        if not gguf.is_current_conversion(out_dir):
            removed = gguf.prune_stale_conversions(out_dir.parent)
            if removed:
                logger.info("removed %d converted copies of GGUF files that are gone or changed", removed)
            gguf.convert_gguf_to_hf_dir(path, out_dir)
        return out_dir
    return path


def resolve_gguf_path(model: str | os.PathLike | None) -> Path | None:
    """The GGUF file behind `model` (the embedded default's, or a .gguf path); None for HF dirs."""
    from quickdraft.models import gguf

    if model is None or str(model) in DEFAULT_MODEL_ALIASES:
        return gguf.default_gguf_path()  # without assembling it again at every start
    path = Path(model).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def resolve_quantization(
    quantization: str | None,
    *,
    dtype: str | torch.dtype,
    gguf_path: Path | None,
    device: torch.device,
    model_dir: Path | None = None,
) -> str | None:
    """How the target's weights are held: None (floats of the dtype), "gguf", "gguf+q8_0" (as
    stored, the file's float matrices quantized to Q8_0), "q8_0", or "stored" (a HF checkpoint's
    float16 / bfloat16 matrices as they are; the kernels compute in float32 all the same).

    "auto" (the default), with the dtype "auto" on the CPU: a GGUF model's weights as stored
    ("gguf"), a HF checkpoint whose linear weights are float16 / bfloat16 "stored" (half the
    bytes of float32 weights, the same values); an explicit float32 / bfloat16, a float32
    checkpoint or CUDA give float weights.
    """
    choice = "auto" if quantization is None else quantization
    if choice not in QUANTIZATION_CHOICES:
        raise ValueError(f"unknown quantization {quantization!r}: choose one of {', '.join(QUANTIZATION_CHOICES)}")
    if choice == "none":
        return None
    if choice == "auto":
        if dtype != "auto" or device.type != "cpu":
            return None
        if gguf_path is not None:
            return "gguf"
        return "stored" if model_dir is not None and stores_float16_matrices(model_dir) else None
    if device.type != "cpu":
        raise ValueError(
            f"quantization {choice!r} has CPU kernels only: on {device.type} use quantization "
            f"'none' (weights dequantized to the dtype)"
        )
    if resolve_dtype(dtype) != torch.float32:
        raise ValueError(f"quantization {choice!r} computes in float32: use dtype 'auto' or 'float32', not {dtype!r}")
    if choice == "stored" and gguf_path is not None:
        raise ValueError("quantization 'stored' is for HF checkpoints: a .gguf model's weights as stored are 'gguf'")
    if choice.startswith("gguf") and gguf_path is None:
        raise ValueError(
            f"quantization {choice!r} needs a .gguf model (or the embedded default); "
            "use 'q8_0' to quantize a HF checkpoint at load"
        )
    return choice


DRAFT_VOCAB_FILE = "draft_vocab.safetensors"  # d2t of a reduced-vocabulary draft model


def read_draft_vocab(model_dir: Path) -> torch.Tensor | None:
    """d2t [Vd] (target id of each draft id but the last, "any other token") of a
    reduced-vocabulary draft model directory; None for a model with the target's vocabulary."""
    path = Path(model_dir) / DRAFT_VOCAB_FILE
    if not path.is_file():
        return None
    from safetensors.torch import load_file

    return load_file(str(path))["d2t"].long()


def read_hf_config(model_dir: Path) -> dict:
    config_path = model_dir / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"{config_path} does not exist: not a HF model directory")
    try:
        return json.loads(config_path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{config_path} is not valid JSON: {err}") from err


def read_model_config(model_dir: Path) -> ModelConfig:
    """The target's ModelConfig from config.json, marked `embedding_only` (with a tied placeholder
    head) when it is a base model saved without the LM head its config asks for, or a classifier."""
    config = ModelConfig.from_hf_dict(read_hf_config(model_dir))
    if config.num_labels:  # a classifier's `score` head replaces the LM head (pooling.Classifier)
        return dataclasses.replace(config, tie_word_embeddings=True, embedding_only=True)
    if config.tie_word_embeddings or not saved_without_prefix(model_dir):
        return config
    if "lm_head.weight" in _checkpoint_names(model_dir):
        return config
    return dataclasses.replace(config, tie_word_embeddings=True, embedding_only=True)


def _checkpoint_names(model_dir: Path) -> set[str]:
    """Every tensor name of the checkpoint's safetensors, read from the index or the headers."""
    from safetensors import safe_open

    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        return set(json.loads(index.read_text())["weight_map"])
    names: set[str] = set()
    for file in safetensors_files(model_dir):
        with safe_open(str(file), "pt") as f:
            names.update(f.keys())
    return names


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    # not the packed-weight caches a quantized load writes beside a GGUF conversion's tensors
    files = sorted(f for f in model_dir.glob("*.safetensors") if not f.name.startswith(PACKED_CACHE_PREFIX))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {model_dir}")
    return files


def stores_float16_matrices(model_dir: Path) -> bool:
    """Whether a HF checkpoint's decoder-layer matrices are float16 / bfloat16 (the first 2-D
    `layers.*.weight` tensor's dtype, read from the safetensors header, no tensor loaded): its
    linear weights then run as stored by default."""
    from safetensors import safe_open

    try:
        for file in safetensors_files(model_dir):
            with safe_open(str(file), "pt") as f:
                for name in f.keys():
                    if "layers." in name and name.endswith(".weight") and len(f.get_slice(name).get_shape()) == 2:
                        return f.get_slice(name).get_dtype() in ("F16", "BF16")
    except Exception:  # missing or corrupt files: the load that follows names what is wrong
        return False
    return False


def read_hf_tensors(model_dir: Path, *, prefix: str = "", names: set[str] | None = None) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors (those whose normalised name starts with `prefix`, and is in
    `names` when given: only those are read)."""
    from safetensors import safe_open

    bare = saved_without_prefix(model_dir)
    tensors: dict[str, torch.Tensor] = {}
    for file in safetensors_files(model_dir):
        if not file.exists():
            raise FileNotFoundError(f"weight shard {file} listed in the index is missing")
        try:
            with safe_open(str(file), "pt") as f:
                keys = set(f.keys())
                for name in f.keys():
                    if name.endswith("_scales") and name.removesuffix("_scales") + "_blocks" in keys:
                        continue  # read with its blocks
                    # gpt-oss: every expert in one tensor, or its MXFP4 blocks (to floats in the model's layout)
                    mxfp4 = name.endswith("_blocks")
                    if STACKED_EXPERTS.search(name.removesuffix("_blocks")):
                        stem = normalised_name(name.removesuffix("_blocks"), bare=bare)
                        experts = f.get_slice(name).get_shape()[0]
                        wanted_names = {
                            n
                            for n in unstacked_names(stem, experts)
                            if (names is None or n in names) and n.startswith(prefix)
                        }
                        if not wanted_names:
                            continue  # not read (MXFP4 experts may be held as stored)
                        stacked = (
                            mxfp4_to_float(f.get_tensor(name), f.get_tensor(name.removesuffix("_blocks") + "_scales"))
                            if mxfp4
                            else f.get_tensor(name)
                        )
                        tensors.update((n, t) for n, t in unstacked_experts(stem, stacked) if n in wanted_names)
                        continue
                    ours = normalised_name(name, bare=bare)
                    if (names is None or ours in names) and ours.startswith(prefix):
                        tensors[ours] = f.get_tensor(name)
        except Exception as err:  # safetensors raises several types for a corrupt file
            raise ValueError(f"cannot read weights from {file}: {err}") from err
    if names is None or names - tensors.keys():
        from quickdraft.models import gguf

        # a GGUF conversion: the tensors its file does not store as float32 are read from the file
        found = gguf.tensors_from_gguf(model_dir, names=names, prefix=prefix, skip=tensors.keys())
        tensors.update((name, torch.from_numpy(array)) for name, array in found.items())
    return tensors


# gpt-oss's checkpoints hold a layer's experts stacked: gate_up_proj [E, D, 2I] with gate and up
# in alternate columns, down_proj [E, I, D] (inputs first), and their biases [E, 2I] / [E, D].
STACKED_EXPERTS = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?$")


# OCP FP4 E2M1's 16 values by code (gpt-oss's MXFP4 checkpoints)
_FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def mxfp4_to_float(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """gpt-oss's MXFP4 checkpoint tensors as the float tensor transformers makes of them.
    blocks [E, rows, cols / 32, 16] uint8: two FP4 codes a byte, the low nibble first; scales
    [E, rows, cols / 32] uint8, E8M0 (2^(s - 127)) -> [E, cols, rows] float32 (inputs first, as
    the model's stacked experts are held)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match")
    lut = torch.tensor(_FP4_VALUES, dtype=torch.float32)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).reshape(*blocks.shape[:-1], 32).long()
    values = torch.ldexp(lut[codes], scales.to(torch.int32)[..., None] - 127)  # [E, rows, cols / 32, 32]
    return values.reshape(*values.shape[:2], -1).transpose(1, 2).contiguous()


def unstacked_names(name: str, experts: int) -> list[str]:
    """The per-expert names a stacked experts tensor `name` is split into (see unstacked_experts)."""
    match = STACKED_EXPERTS.search(name)
    assert match is not None
    stem = name[: match.start()] + ".mlp.experts."
    kind = "bias" if match[2] else "weight"
    leaves = ("down_proj",) if match[1] == "down_proj" else ("gate_proj", "up_proj")
    return [f"{stem}{expert}.{leaf}.{kind}" for expert in range(experts) for leaf in leaves]


def unstacked_experts(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """A stacked experts tensor as the per-expert tensors of the usual layout (gate_proj, up_proj,
    down_proj weights [out, in] and biases), under the names of `unstacked_names`."""
    match = STACKED_EXPERTS.search(name)
    assert match is not None
    is_bias = bool(match[2])
    pieces = []
    for matrix in tensor:  # gate_up: gate and up in alternate columns; bias [2I], weight [D, 2I]
        halves = [matrix] if match[1] == "down_proj" else [matrix[..., 0::2], matrix[..., 1::2]]
        pieces += [half.contiguous() if is_bias else half.t().contiguous() for half in halves]
    return list(zip(unstacked_names(name, len(tensor)), pieces))


def normalised_name(name: str, *, bare: bool = False) -> str:
    """A checkpoint tensor's name as a causal LM's (`model.layers.0...`): multimodal Gemma 3 stores
    its text decoder under language_model; a base model saved alone (`bare`: Gemma3TextModel, as
    EmbeddingGemma) has no `model.` prefix."""
    if bare and not name.startswith(("model.", "lm_head.")):
        return "model." + name
    return name.replace("language_model.model.", "model.").replace("model.language_model.", "model.")


def saved_without_prefix(model_dir: Path) -> bool:
    """Whether `model_dir` is a base model saved alone (architectures such as Gemma3TextModel or
    LlamaModel, not ...ForCausalLM): its tensors are named without `model.`."""
    config_path = model_dir / "config.json"
    try:
        hf = json.loads(config_path.read_text())
    except (OSError, ValueError):
        return False
    architectures = hf.get("architectures") or []
    return (
        hf.get("model_type") in SUPPORTED_MODEL_TYPES
        and bool(architectures)
        and all(isinstance(a, str) and a.endswith("Model") for a in architectures)
    )


def hf_layer_tensors(config: ModelConfig, index: int) -> dict[str, list[str]]:
    """Our fused parameter -> the HF tensors concatenated (along rows) to make it."""
    p = f"model.layers.{index}."
    fused = config.fused_projections
    names = {
        "qkv_proj": [p + "self_attn.qkv_proj.weight"] if fused else [p + f"self_attn.{n}_proj.weight" for n in "qkv"],
        "o_proj": [p + "self_attn.o_proj.weight"],
        "gate_up_proj": [p + "mlp.gate_up_proj.weight"]
        if fused
        else [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
        "down_proj": [p + "mlp.down_proj.weight"],
        "input_layernorm.weight": [p + "input_layernorm.weight"],
        "post_attention_layernorm.weight": [p + "post_attention_layernorm.weight"],
    }
    if config.qkv_bias:
        names["qkv_bias"] = [p + f"self_attn.{n}_proj.bias" for n in "qkv"]
    if config.o_bias:
        names["o_bias"] = [p + "self_attn.o_proj.bias"]
    if config.mlp_bias:
        names["gate_up_bias"] = [p + "mlp.gate_proj.bias", p + "mlp.up_proj.bias"]
        names["down_bias"] = [p + "mlp.down_proj.bias"]
    if config.qk_norm:
        names["qk_norm.weight"] = [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
    if config.attention_sinks:
        names["sinks"] = [p + "self_attn.sinks"]
    if index in config.moe_layers:
        del names["gate_up_proj"], names["down_proj"]
        names.update(_expert_tensors(config, p))
    if config.sandwich_norms:
        names["pre_feedforward_layernorm.weight"] = [p + "pre_feedforward_layernorm.weight"]
        names["post_feedforward_layernorm.weight"] = [p + "post_feedforward_layernorm.weight"]
    return names


def _expert_tensors(config: ModelConfig, prefix: str) -> dict[str, list[str]]:
    """A mixture-of-experts layer's router and experts (and shared expert), under its checkpoint's names."""
    block, (gate, up, down) = moe_hf_names(config.model_type)
    router = prefix + f"{block}.{moe_router_name(config.model_type)}."
    names = {"router": [router + "weight"]}
    if config.router_bias:
        names["router_bias"] = [router + "bias"]
    for expert in range(config.num_experts):
        at = prefix + f"{block}.experts.{expert}."
        names[f"experts.{expert}.gate_up_proj"] = [at + f"{gate}.weight", at + f"{up}.weight"]
        names[f"experts.{expert}.down_proj"] = [at + f"{down}.weight"]
        if config.expert_bias:
            names[f"experts.{expert}.gate_up_bias"] = [at + f"{gate}.bias", at + f"{up}.bias"]
            names[f"experts.{expert}.down_bias"] = [at + f"{down}.bias"]
    if config.shared_expert_intermediate_size:
        at = prefix + f"{block}.shared_expert."
        names["shared_expert.gate_up_proj"] = [at + "gate_proj.weight", at + "up_proj.weight"]
        names["shared_expert.down_proj"] = [at + "down_proj.weight"]
        if config.shared_expert_gated:
            names["shared_expert_gate"] = [prefix + f"{block}.shared_expert_gate.weight"]
    return names


def decoder_plan(config: ModelConfig) -> dict[str, list[str]]:
    """Every Decoder tensor -> the HF tensors (fused along rows) it is made of."""
    plan: dict[str, list[str]] = {"embed_tokens": ["model.embed_tokens.weight"], "norm.weight": ["model.norm.weight"]}
    if not config.tie_word_embeddings:
        plan["lm_head"] = ["lm_head.weight"]
    for index in range(config.num_layers):
        for ours, theirs in hf_layer_tensors(config, index).items():
            plan[f"layers.{index}.{ours}"] = theirs
    return plan


def hf_to_decoder_state(config: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename (and fuse) HF tensors into the Decoder's state dict; strict about what is missing."""
    return convert_hf_tensors(config, decoder_plan(config), tensors)


def convert_hf_tensors(
    config: ModelConfig, plan: dict[str, list[str]], tensors: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Our state dict from `plan` (our name -> the HF tensors fused into it)."""
    missing = [name for names in plan.values() for name in names if name not in tensors]
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ValueError(f"checkpoint is missing {len(missing)} tensors the config needs: {shown}")
    state = {
        ours: torch.cat([reordered(config, n, tensors[n]) for n in theirs])
        if len(theirs) > 1
        else reordered(config, theirs[0], tensors[theirs[0]])
        for ours, theirs in plan.items()
        if not ours.endswith("qk_norm.weight")
    }
    for ours, (q_name, k_name) in ((o, t) for o, t in plan.items() if o.endswith("qk_norm.weight")):
        # One row per head: H copies of q_norm then Hkv copies of k_norm.
        state[ours] = torch.cat(
            [tensors[q_name].expand(config.num_heads, -1), tensors[k_name].expand(config.num_kv_heads, -1)]
        )
    if config.norm_unit_offset:
        # Gemma's norms scale by (1 + weight) in float32: fold the 1 in once, here.
        state = {name: t.float() + 1.0 if name.endswith("norm.weight") else t for name, t in state.items()}
    return state


def reordered(config: ModelConfig, hf_name: str, tensor: torch.Tensor) -> torch.Tensor:
    order = config.hf_row_order(hf_name)
    return tensor if order is None else tensor.index_select(0, torch.tensor(order))


def fused_piece_rows(config: ModelConfig, ours: str, theirs: list[str], *, rows: int) -> list[tuple[int, int]]:
    """Rows [start, stop) of our tensor `ours` (of `rows` rows) each of its checkpoint tensors
    `theirs` makes: q, k, v or gate, up stacked; a qk_norm's H rows of q_norm, then Hkv of k_norm."""
    if ours.endswith("qk_norm.weight"):
        sizes = [config.num_heads, config.num_kv_heads]
    elif len(theirs) == 3:
        sizes = [config.q_size, config.kv_size, config.kv_size]
    else:  # one tensor, or gate and up of equal halves
        sizes = [rows // len(theirs)] * len(theirs)
    bounds = [0, *itertools.accumulate(sizes)]
    return list(itertools.pairwise(bounds))


def hf_tensors_from_state(
    config: ModelConfig, plan: dict[str, list[str]], state: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The inverse of convert_hf_tensors: our tensors in `state` back under the HF names of `plan`
    (q/k/v and gate/up split, one q_norm and one k_norm row, Gemma norms without the folded 1)."""
    tensors: dict[str, torch.Tensor] = {}
    for ours, theirs in plan.items():
        tensor = state[ours].detach()
        if config.norm_unit_offset and ours.endswith("norm.weight"):
            tensor = tensor - 1.0
        rows = fused_piece_rows(config, ours, theirs, rows=tensor.shape[0])
        if ours.endswith("qk_norm.weight"):
            pieces = [tensor[start] for start, _ in rows]
        else:
            pieces = [tensor[start:stop] for start, stop in rows]
        for name, piece in zip(theirs, pieces):
            order = config.hf_row_order(name)
            if order is not None:  # back to the checkpoint's row order
                piece = piece.index_select(0, torch.argsort(torch.tensor(order)))
            tensors[name] = piece.contiguous()
    return tensors


def owning_module(model: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    """The module holding the tensor our state dict calls `name`, and its attribute name there."""
    module_name, _, leaf = name.rpartition(".")
    return (model.get_submodule(module_name) if module_name else model), leaf


def build_decoder(
    config: ModelConfig,
    state: dict[str, torch.Tensor],
    *,
    dtype: torch.dtype,
    device: torch.device,
    max_len: int,
    quantized: dict[str, QuantizedWeight] | None = None,
    decoder_class: type[Decoder] = Decoder,
    context_len: int | None = None,
) -> Decoder:
    """The decoder with `state`'s tensors; the weights in `quantized` stay quantized (CPU).
    `decoder_class`: a subclass taking the same arguments (a tensor-parallel shard's).
    context_len: the longest sequence served (max_len, the rotary tables' length, by default)."""
    with torch.device("meta"):
        decoder = decoder_class(config, dtype=dtype, max_len=max_len)
    for name in quantized or {}:
        # Removed before to_empty, which would otherwise allocate the float weight.
        delattr(*owning_module(decoder, name))
    decoder = decoder.to_empty(device=device)
    for name, weight in (quantized or {}).items():
        setattr(*owning_module(decoder, name), weight)
    own = decoder.state_dict()
    for name, tensor in state.items():
        if name not in own:
            raise ValueError(f"unexpected tensor {name} for this architecture")
        if own[name].shape != tensor.shape:
            raise ValueError(f"tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(own[name].shape)}")
        own[name].copy_(tensor)
    # Rotary tables are buffers computed from the config, not weights: rebuild them for real.
    for key in decoder.rotary:
        decoder.rotary[key] = RotaryTable(
            config.rope_for(key), head_dim=config.head_dim, max_len=max_len, dtype=dtype, context_len=context_len
        ).to(device)
    decoder.linear = default_linear_fn(device)
    decoder.eval()
    return decoder


@dataclass
class LoadedWeights:
    """A checkpoint's weights in our (fused) names: floats in `state`, the rest kept quantized."""

    config: ModelConfig
    state: dict[str, torch.Tensor]
    quantized: dict[str, QuantizedWeight] = field(default_factory=dict)


def load_weights(
    model_dir: Path,
    *,
    dtype: torch.dtype,
    device: torch.device,
    quantization: str | None = None,
    gguf_path: Path | None = None,
    huge_pages: bool = False,
) -> LoadedWeights:
    """The target's weights.  quantization None: float weights (converted to `dtype` when the
    decoder is built); "gguf": the weights `gguf_path` stores quantized, as stored; "gguf+q8_0":
    those, and its float-stored linear weights quantized to Q8_0; "q8_0": linear weights
    quantized to Q8_0 at load.  Quantized models compute in float32 on the CPU.
    huge_pages: the quantized weights in this process's own huge pages (heap.huge_page_buffer),
    not mapped from the packed-weight file."""
    config = read_model_config(model_dir)
    plan = decoder_plan(config)
    if quantization is None:
        return LoadedWeights(config, convert_hf_tensors(config, plan, read_hf_tensors(model_dir)))
    if device.type != "cpu" or dtype != torch.float32:
        raise ValueError(f"quantization {quantization!r} runs on the CPU in float32 (got {device.type}, {dtype})")
    from_gguf = quantization.startswith("gguf")
    if from_gguf and gguf_path is None:
        raise ValueError(f"quantization {quantization!r} needs a .gguf model (or the embedded default)")

    def read_floats(names: set[str]) -> dict[str, torch.Tensor]:
        return read_hf_tensors(model_dir, names=names)

    cache_file = model_dir / (PACKED_CACHE_FILE if quantization == "gguf" else PACKED_CACHE_FILE_WITH_Q8_0)
    quantized = load_packed(cache_file, huge_pages=huge_pages) if from_gguf else None
    if quantized is not None and set(quantized) <= set(plan):
        rest = {name: theirs for name, theirs in plan.items() if name not in quantized}
    else:
        quantized, rest = quantized_state(
            config, plan, mode=quantization, read_floats=read_floats, gguf_path=gguf_path, model_dir=model_dir
        )
        if from_gguf and quantized:
            save_packed(cache_file, quantized)
            # read back as every later load reads it
            quantized = load_packed(cache_file, huge_pages=huge_pages) or quantized
        elif huge_pages:
            quantized = packed_into_huge_pages(quantized)
    tensors = read_hf_tensors(model_dir, names={name for names in rest.values() for name in names})
    state = convert_hf_tensors(config, rest, tensors)
    del tensors
    return_free_heap()
    return LoadedWeights(config, state, quantized)


def load_decoder(
    model_dir: Path,
    *,
    dtype: torch.dtype,
    device: torch.device,
    max_len: int,
    quantization: str | None = None,
    gguf_path: Path | None = None,
    huge_pages: bool = False,
    context_len: int | None = None,
) -> tuple[Decoder, ModelConfig]:
    """The target decoder of `model_dir` (see `load_weights` for `quantization` and `huge_pages`)."""
    weights = load_weights(
        model_dir, dtype=dtype, device=device, quantization=quantization, gguf_path=gguf_path, huge_pages=huge_pages
    )
    decoder = build_decoder(
        weights.config,
        weights.state,
        dtype=dtype,
        device=device,
        max_len=max_len,
        quantized=weights.quantized,
        context_len=context_len,
    )
    del weights
    return_free_heap()
    return decoder, decoder.config
