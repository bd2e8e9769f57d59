"""The decoder's state with linear weights kept quantized: read from a GGUF file as stored, or
quantized to Q8_0 at load from float weights (an HF checkpoint)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch

from quickdraft.models.config import ModelConfig
from quickdraft.models.quantized import (
    FLOAT16_FORMATS,
    SUPPORTED_FORMATS,
    InexactBlocks,
    QuantizedWeight,
    QuantParts,
    decode_gguf,
    float16_parts,
    quantize_q8_0,
)

logger = logging.getLogger(__name__)

# Our fused weights (rows of several HF tensors) that the kernels may run quantized.
QUANTIZABLE_SUFFIXES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "embed_tokens", "lm_head")
QUANTIZATION_MODES = ("gguf", "gguf+q8_0", "q8_0", "stored")


def _is_linear_weight(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in QUANTIZABLE_SUFFIXES


def _permuted(parts: QuantParts, order: np.ndarray) -> QuantParts:
    fields = {name: getattr(parts, name) for name in ("q", "d", "dmin", "sc", "m")}
    return QuantParts(
        format=parts.format, **{name: None if value is None else value[order] for name, value in fields.items()}
    )


def _in_our_row_order(config: ModelConfig, hf_name: str, parts: QuantParts) -> QuantParts:
    """Rows of a quantized HF tensor reordered as the float path reorders them (whole rows move,
    so the blocks of each row, and their bits, stay as stored)."""
    order = config.hf_row_order(hf_name)
    return parts if order is None else _permuted(parts, np.array(order))


def _unpermute_order(rows: int, n_head: int) -> np.ndarray:
    """Row order undoing llama.cpp's Q/K permutation (as gguf._unpermute_rows does to values)."""
    from quickdraft.models.gguf import _unpermute_rows

    return _unpermute_rows(np.arange(rows), n_head=n_head)


FLOAT_FORMATS = ("F32", "F16", "BF16", "F64")


def _as_floats(as_floats: dict[str, int], fmt: str, shape: tuple, name: str, reason: Exception) -> None:
    """Count a tensor whose blocks the kernels cannot hold exactly among those loaded as floats."""
    logger.info("%s stays a float weight: %s", name, reason)
    as_floats[fmt] = as_floats.get(fmt, 0) + 4 * int(np.prod(shape))


def read_gguf_parts(gguf_path: Path, config: ModelConfig) -> dict[str, QuantParts]:
    """HF tensor name -> decoded parts, for every 2-D tensor the file stores in a supported
    quantized format (everything else is read as floats: loader.read_hf_tensors)."""
    from quickdraft.models.gguf import (
        PERMUTED_QK_ARCHITECTURES,
        SUPPORTED_ARCHITECTURES,
        expert_tensor_names,
        hf_tensor_name,
        read_gguf_tensors,
    )

    architecture, tensors = read_gguf_tensors(gguf_path)
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{gguf_path}: unsupported GGUF architecture {architecture!r}")
    parts: dict[str, QuantParts] = {}
    as_floats: dict[str, int] = {}  # quantized formats without kernels -> float32 bytes they take
    for tensor in tensors:
        fmt, shape = tensor.format, tensor.shape
        if fmt not in SUPPORTED_FORMATS and fmt not in FLOAT_FORMATS and len(shape) >= 2:
            as_floats[fmt] = as_floats.get(fmt, 0) + 4 * int(np.prod(shape))
        experts = expert_tensor_names(tensor.name, architecture=architecture, num_experts=shape[0])
        if experts is not None and fmt in SUPPORTED_FORMATS and len(shape) == 3:
            # the experts' matrices lie one after the other: each is whole rows of its own
            per_expert = tensor.data.size // shape[0]
            decoded_experts = {}
            for expert, name in enumerate(experts):
                data = tensor.data[expert * per_expert : (expert + 1) * per_expert]
                try:
                    decoded_experts[name] = decode_gguf(fmt, data, rows=shape[1], cols=shape[2])
                except InexactBlocks as err:  # the whole stacked tensor then loads as floats
                    _as_floats(as_floats, fmt, shape, tensor.name, err)
                    break
                except ValueError as err:
                    raise ValueError(f"{gguf_path}: tensor {tensor.name!r}, expert {expert}: {err}") from err
            else:
                parts.update(decoded_experts)
            continue
        if fmt not in SUPPORTED_FORMATS or len(shape) != 2:
            continue
        name = hf_tensor_name(tensor.name, architecture=architecture)
        if name is None:
            continue
        try:
            decoded = decode_gguf(fmt, tensor.data, rows=shape[0], cols=shape[1])
        except InexactBlocks as err:
            _as_floats(as_floats, fmt, shape, tensor.name, err)
            continue
        except ValueError as err:
            raise ValueError(f"{gguf_path}: tensor {tensor.name!r}: {err}") from err
        if architecture in PERMUTED_QK_ARCHITECTURES and ".attn_q." in tensor.name:
            decoded = _permuted(decoded, _unpermute_order(shape[0], config.num_heads))
        if architecture in PERMUTED_QK_ARCHITECTURES and ".attn_k." in tensor.name:
            decoded = _permuted(decoded, _unpermute_order(shape[0], config.num_kv_heads))
        parts[name] = decoded
    if as_floats:
        logger.warning(
            "%s: no quantized kernel for %s (or blocks it cannot hold exactly); those tensors are dequantized "
            "to float32 (%s MB)",
            gguf_path,
            ", ".join(sorted(as_floats)),
            " + ".join(f"{fmt} {nbytes / 1e6:.0f}" for fmt, nbytes in sorted(as_floats.items())),
        )
    return parts


def read_hf_mxfp4_parts(model_dir: Path) -> dict[str, QuantParts]:
    """HF tensor name -> MXFP4 parts, for gpt-oss checkpoints' experts stored as MXFP4 blocks and
    scales (`...mlp.experts.gate_up_proj_blocks` [E, 2I, D / 32, 16], gate and up rows in turn;
    `down_proj_blocks` [E, D, I / 32, 16]), kept as stored: an FP4 code is our MXFP4 level index
    (the same order), a byte's low nibble the even value, and the scale 2^(s - 127) of FP4's
    values is 2^(s - 128) of the doubled levels.  A tensor with a scale float16 cannot hold exactly
    is left out (read as floats)."""
    from safetensors import safe_open

    from quickdraft.models.loader import normalised_name, safetensors_files, unstacked_names

    parts: dict[str, QuantParts] = {}
    for file in safetensors_files(model_dir):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                if not name.endswith(("gate_up_proj_blocks", "down_proj_blocks")):
                    continue
                blocks = f.get_tensor(name).numpy()  # [E, rows, cols / 32, 16] uint8
                scales = f.get_tensor(name.removesuffix("_blocks") + "_scales").numpy()  # [E, rows, cols / 32]
                exponents = scales.astype(np.int32) - 128
                if exponents.min() < -24 or exponents.max() > 15:
                    logger.info("%s: MXFP4 scales beyond float16's exact powers of two; read as floats", name)
                    continue
                # [E, rows, cols]: a byte's low nibble is the even value
                codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:2], -1)
                d = np.ldexp(np.float32(1), exponents).astype(np.float16)  # [E, rows, cols / 32]
                names = unstacked_names(normalised_name(name.removesuffix("_blocks")), blocks.shape[0])
                if name.endswith("down_proj_blocks"):
                    per_expert = [(codes[e], d[e]) for e in range(blocks.shape[0])]
                else:  # gate rows, then up rows, of each expert
                    per_expert = [(c[start::2], s_[start::2]) for c, s_ in zip(codes, d) for start in (0, 1)]
                for hf_name, (q, scale) in zip(names, per_expert):
                    parts[hf_name] = QuantParts(
                        format="MXFP4", q=np.ascontiguousarray(q), d=np.ascontiguousarray(scale)
                    )
    return parts


def quantized_state(
    config: ModelConfig,
    plan: dict[str, list[str]],
    *,
    mode: str,
    read_floats: Callable[[set[str]], dict[str, torch.Tensor]],
    gguf_path: Path | None,
    model_dir: Path | None = None,
) -> tuple[dict[str, QuantizedWeight], dict[str, list[str]]]:
    """(our name -> QuantizedWeight, the rest of `plan` to load as floats).

    mode "gguf": the weights the GGUF file stores quantized, as stored; "q8_0": every linear
    weight whose rows are whole Q8_0 blocks, quantized from its floats (`read_floats` of the
    checkpoint tensor names gives them), except gpt-oss's MXFP4 experts in `model_dir`, kept as
    stored (F16 and BF16 matrices too: the kernels multiply them as they are); "gguf+q8_0": the
    file's quantized weights as stored, and the linear weights it stores as floats (F16, BF16, F32,
    a format without a kernel) quantized to Q8_0; "stored": a HF checkpoint's float16 / bfloat16
    linear weights as they are (F16 / BF16 parts), its other weights floats.
    """
    if mode not in QUANTIZATION_MODES:
        raise ValueError(f"unknown quantization {mode!r}: choose one of {', '.join(QUANTIZATION_MODES)}")
    if mode.startswith("gguf"):
        stored = read_gguf_parts(gguf_path, config)
    else:
        stored = read_hf_mxfp4_parts(model_dir) if model_dir is not None else {}
    quantized: dict[str, QuantizedWeight] = {}
    rest: dict[str, list[str]] = {}
    to_quantize: dict[str, list[str]] = {}  # our name -> checkpoint names, quantized from floats
    float_matrices: list[str] = []  # linear weights the file stores as floats (mode "gguf")
    for ours, theirs in plan.items():
        if not _is_linear_weight(ours):
            rest[ours] = theirs
            continue
        stored_pieces = [stored.get(name) for name in theirs]
        if mode == "gguf+q8_0" and any(p is not None and p.format in FLOAT16_FORMATS for p in stored_pieces):
            to_quantize[ours] = theirs  # float-stored: Q8_0 in this mode
        elif all(piece is not None for piece in stored_pieces):
            pieces = [_in_our_row_order(config, name, piece) for name, piece in zip(theirs, stored_pieces)]
            quantized[ours] = QuantizedWeight.from_parts(pieces)
        elif mode == "gguf":
            rest[ours] = theirs  # stored as floats (or a format without a kernel): float path
            float_matrices.append(ours)
        else:
            to_quantize[ours] = theirs  # "stored": kept as they are where they are 16-bit floats
    if float_matrices:
        logger.warning(
            "%s: %d linear weights (%s, ...) are stored as float32 (or in a format without a kernel) and run "
            "on the float path, which keeps layers out of the one-call kernel; quantization='gguf+q8_0' "
            "quantizes them to Q8_0 at load",
            gguf_path,
            len(float_matrices),
            float_matrices[0],
        )
    floats = read_floats({name for names in to_quantize.values() for name in names}) if to_quantize else {}
    for ours, theirs in to_quantize.items():
        weights = [floats[name] for name in theirs]
        as_stored = mode == "stored"
        if weights[0].shape[-1] % 32 or (as_stored and not _one_float16_dtype(weights)):
            rest[ours] = theirs
            continue
        convert = float16_parts if as_stored else quantize_q8_0
        pieces = [_in_our_row_order(config, name, convert(weight)) for name, weight in zip(theirs, weights)]
        quantized[ours] = QuantizedWeight.from_parts(pieces)
    if not quantized:
        logger.warning("quantization %r: no weight of this checkpoint can be run quantized", mode)
    return quantized, rest


def _one_float16_dtype(weights: list[torch.Tensor]) -> bool:
    return weights[0].dtype in (torch.float16, torch.bfloat16) and all(w.dtype == weights[0].dtype for w in weights)


# Packed weights of a GGUF model, kept beside its converted directory so that a reload reads them
# instead of decoding and repacking the file (seconds for the embedded model's 262k-row embedding).
# The directory is rebuilt when its GGUF changes; bump the version when the packed layout does.
# (A file written by a version that knew other formats is rebuilt: load_packed.)
PACKED_CACHE_PREFIX = "quickdraft-packed-"  # not checkpoint shards: loader.safetensors_files skips them
PACKED_CACHE_FILE = f"{PACKED_CACHE_PREFIX}v1.safetensors"
# The same for quantization "gguf+q8_0" (its float-stored weights quantized too)
PACKED_CACHE_FILE_WITH_Q8_0 = f"{PACKED_CACHE_PREFIX}v1-floats-q8_0.safetensors"


def save_packed(path: Path, quantized: dict[str, QuantizedWeight]) -> None:
    """Write `quantized` to `path` (atomically; a failure to write only costs the next load time)."""
    import json
    import os

    from safetensors.torch import save_file

    layout = {
        name: {
            "shape": list(weight.shape),
            "parts": [[part.format, part.rows, part.row_start] for part in weight.parts],
        }
        for name, weight in quantized.items()
    }
    tensors = {
        f"{name}#{index}": part.packed for name, weight in quantized.items() for index, part in enumerate(weight.parts)
    }
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        # The formats this version keeps as stored: a file written by one that knew fewer left
        # the others as floats, so a later version rebuilds it (load_packed).
        metadata = {"layout": json.dumps(layout), "formats": json.dumps(list(SUPPORTED_FORMATS))}
        save_file(tensors, str(temporary), metadata=metadata)
        os.replace(temporary, path)
    except OSError as err:
        logger.warning("could not cache the packed weights in %s: %s", path, err)
        temporary.unlink(missing_ok=True)


def load_packed(path: Path, *, huge_pages: bool = False) -> dict[str, QuantizedWeight] | None:
    """The weights `save_packed` wrote, or None when the file is missing or unreadable.  Mapped
    from the file, or with `huge_pages` read into one region of huge pages (heap.huge_page_buffer)."""
    import json

    from safetensors import safe_open

    from quickdraft.models.quantized import PackedPart

    if not path.is_file():
        return None
    try:
        with safe_open(str(path), "pt") as file:
            formats = json.loads(file.metadata().get("formats", "[]"))
        if formats != list(SUPPORTED_FORMATS):
            logger.info("rebuilding the packed-weight cache %s: written for the formats %s", path, formats)
            return None
        read = _read_packed_into_huge_pages(path) if huge_pages else None
        if read is not None:
            layout, packed = read
        else:
            with safe_open(str(path), "pt") as file:
                layout = json.loads(file.metadata()["layout"])
                # Left on the file's memory map, as llama.cpp maps a GGUF: the weights are page
                # cache, shared by the processes that serve the model (replicas; a tensor-parallel
                # rank copies its shard), and a load copies nothing (a copy doubled its peak).
                packed = {key: file.get_tensor(key) for key in file.keys()}
        return {
            name: QuantizedWeight(
                [
                    PackedPart(format=fmt, packed=packed[f"{name}#{index}"], row_start=start, rows=rows)
                    for index, (fmt, rows, start) in enumerate(entry["parts"])
                ],
                shape=tuple(entry["shape"]),
            )
            for name, entry in layout.items()
        }
    except Exception as err:  # a truncated or foreign file: rebuild it
        logger.warning("ignoring the packed-weight cache %s: %s", path, err)
        return None


def _read_packed_into_huge_pages(path: Path) -> tuple[dict, dict[str, torch.Tensor]] | None:
    """(layout, tensor name -> [bytes] uint8) of a save_packed file, its data read (not mapped:
    the file's pages never count in this process's memory) into one huge-page region; None where
    the kernel gave the region no huge page (then the weights are better mapped: as fast, and
    shared between processes)."""
    import json
    import struct

    from quickdraft.models.heap import HUGE_PAGE_BYTES, huge_page_buffer, huge_page_bytes_at

    with open(path, "rb") as file:
        (header_bytes,) = struct.unpack("<Q", file.read(8))
        header = json.loads(file.read(header_bytes))
        layout = json.loads(header.pop("__metadata__")["layout"])
        data_bytes = max((entry["data_offsets"][1] for entry in header.values()), default=0)
        buffer = huge_page_buffer(data_bytes)
        view = memoryview(buffer.numpy())
        # The first page is written (and so faulted in) before the rest is read: where the kernel
        # backs it with 4 KB pages the file is not read in vain.
        first = min(data_bytes, HUGE_PAGE_BYTES)
        _read_exactly(file, view[:first], path=path)
        if huge_page_bytes_at(buffer.data_ptr()) == 0:
            logger.warning("the kernel gave no transparent huge page: quantized weights mapped from %s", path)
            return None
        _read_exactly(file, view[first:], path=path)
    packed = {}
    for key, entry in header.items():
        if entry["dtype"] != "U8" or len(entry["shape"]) != 1:
            raise ValueError(f"{key}: expected [bytes] U8, got {entry['dtype']} {entry['shape']}")
        begin, end = entry["data_offsets"]
        packed[key] = buffer[begin:end]
    return layout, packed


def quantized_weights_in_huge_pages(model: torch.nn.Module) -> bool:
    """Whether a model's quantized weights lie in transparent huge pages (all are in one region
    where a load put them there, so the first one tells)."""
    from quickdraft.models.heap import huge_page_bytes_at
    from quickdraft.models.quantized import quantized_weights

    weights = quantized_weights(model)
    return bool(weights) and huge_page_bytes_at(weights[0].parts[0].packed.data_ptr()) > 0


def _read_exactly(file: BinaryIO, view: memoryview, *, path: Path) -> None:
    """Fill `view` from `file` (readinto may return less than asked)."""
    done = 0
    while done < len(view):
        got = file.readinto(view[done:])
        if not got:
            raise ValueError(f"{path} ends {len(view) - done} bytes early")
        done += got


def packed_into_huge_pages(quantized: dict[str, QuantizedWeight]) -> dict[str, QuantizedWeight]:
    """The same weights with their packed bytes copied into one huge-page region."""
    from quickdraft.models.heap import huge_page_buffer
    from quickdraft.models.quantized import PackedPart

    buffer = huge_page_buffer(sum(part.packed.numel() for weight in quantized.values() for part in weight.parts))
    moved, at = {}, 0
    for name, weight in quantized.items():
        parts = []
        for part in weight.parts:
            size = part.packed.numel()
            packed = buffer[at : at + size]
            packed.copy_(part.packed.reshape(-1))
            parts.append(PackedPart(format=part.format, packed=packed, row_start=part.row_start, rows=part.rows))
            at += size
        moved[name] = QuantizedWeight(parts, shape=tuple(weight.shape))
    return moved
