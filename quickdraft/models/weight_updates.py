"""New weights for a loaded target, under the checkpoint's own (HF) tensor names.

What an RL trainer does between rollouts (vLLM's ``model.load_weights``): it sends the policy's
tensors, all of them or a bucket at a time, by the names of its ``state_dict``.  Each tensor lands
where loading the checkpoint would have put it: a piece of a fused matrix (q/k/v, gate/up) goes
to its rows, Gemma's norms get their folded 1, q/k rows of a partial-rotary model are reordered.

Every name, shape and format is checked before anything is written, so a bad batch changes
nothing.  Float weights are written in place.  A quantized weight is rebuilt in its own format:
F16 / BF16 take the new values as they are (exactly, given in that dtype), Q8_0 / Q5_0 / Q4_0 are
re-rounded as at load, and rows the update does not touch keep their bytes.  Formats quickdraft
cannot quantize to (the K-quants, IQ4, MXFP4) are refused, naming the tensor.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from quickdraft.models.config import ModelConfig
from quickdraft.models.loader import (
    STACKED_EXPERTS,
    decoder_plan,
    fused_piece_rows,
    normalised_name,
    owning_module,
    reordered,
    safetensors_files,
    unstacked_experts,
)
from quickdraft.models.quantized import (
    FLOAT16_FORMATS,
    LOAD_TIME_FORMATS,
    PackedPart,
    QuantizedWeight,
    float16_parts,
    pack,
    quantize_legacy,
    unpack_rows,
)

UPDATABLE_FORMATS = (*FLOAT16_FORMATS, *LOAD_TIME_FORMATS)
_FLOAT16_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16}


@dataclass(frozen=True)
class _Piece:
    """Where one checkpoint tensor goes: rows [start, stop) of our tensor `ours`."""

    ours: str
    start: int
    stop: int


def load_hf_weights(
    model: torch.nn.Module, config: ModelConfig, weights: Iterable[tuple[str, torch.Tensor]]
) -> set[str]:
    """Writes `weights` (checkpoint name, tensor) into `model` (a Decoder); returns the names of
    our tensors it changed.  Raises ValueError, having changed nothing, on an unknown name, a
    wrong shape, or a quantized weight in a format that cannot be rebuilt."""
    plan = decoder_plan(config)
    pieces = _piece_table(config, plan, model)
    updates: dict[str, list[tuple[_Piece, str, torch.Tensor]]] = {}
    unknown: list[str] = []
    for name, tensor in _normalised(weights):
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # the head is the embedding, which comes under its own name (vLLM skips it too)
        if name.endswith("rotary_emb.inv_freq"):
            continue  # computed from the config, not a weight
        piece = pieces.get(name)
        if piece is None:
            unknown.append(name)
            continue
        updates.setdefault(piece.ours, []).append((piece, name, tensor))
    if unknown:
        shown = ", ".join(unknown[:5]) + (" ..." if len(unknown) > 5 else "")
        raise ValueError(f"load_weights: {len(unknown)} tensors this model does not have: {shown}")
    prepared = {ours: _prepared_rows(config, model, ours, entries) for ours, entries in updates.items()}
    for ours, rows in prepared.items():
        _write(model, ours, rows)
    return set(prepared)


def read_checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a local checkpoint directory's safetensors files (a trainer's save), under
    their own names; a ValueError naming what is wrong."""
    from safetensors import safe_open

    if not path.is_dir():
        raise ValueError(f"model_path: {str(path)!r} is not a directory")
    try:
        files = safetensors_files(path)
    except FileNotFoundError as err:
        raise ValueError(f"model_path: {err}") from err
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(str(file), "pt") as reader:
                tensors.update((name, reader.get_tensor(name)) for name in reader.keys())
        except Exception as err:  # safetensors raises several types for a missing or corrupt file
            raise ValueError(f"model_path: cannot read {file}: {err}") from err
    return tensors


def _normalised(weights: Iterable[tuple[str, torch.Tensor]]):
    for name, tensor in weights:
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"load_weights: {name!r} is a {type(tensor).__name__}, not a tensor")
        name = normalised_name(name)
        if STACKED_EXPERTS.search(name):  # gpt-oss's stacked experts: one tensor per expert
            yield from unstacked_experts(name, tensor)
        else:
            yield name, tensor


def _piece_table(config: ModelConfig, plan: dict[str, list[str]], model: torch.nn.Module) -> dict[str, _Piece]:
    table: dict[str, _Piece] = {}
    for ours, theirs in plan.items():
        rows = _target(model, ours).shape[0]
        for name, (start, stop) in zip(theirs, fused_piece_rows(config, ours, theirs, rows=rows)):
            table[name] = _Piece(ours=ours, start=start, stop=stop)
    return table


def _target(model: torch.nn.Module, ours: str) -> torch.Tensor | QuantizedWeight:
    return getattr(*owning_module(model, ours))


def _prepared_rows(
    config: ModelConfig, model: torch.nn.Module, ours: str, entries: list[tuple[_Piece, str, torch.Tensor]]
) -> list[tuple[int, int, torch.Tensor]]:
    """(start, stop, the rows as our tensor holds them) of each entry, checked against its place."""
    target = _target(model, ours)
    if isinstance(target, QuantizedWeight):
        for part in target.parts:
            if part.format not in UPDATABLE_FORMATS and any(
                piece.start < part.row_start + part.rows and part.row_start < piece.stop for piece, _, _ in entries
            ):
                raise ValueError(
                    f"load_weights: {entries[0][1]} is held as {part.format}, which quickdraft cannot quantize to "
                    f"(it can: {', '.join(UPDATABLE_FORMATS)}); load the model with dtype='float32' or 'bfloat16' "
                    "to update its weights"
                )
    rows = []
    for piece, name, tensor in entries:
        values = reordered(config, name, tensor.detach())
        if ours.endswith("qk_norm.weight"):  # one row per head: the q norm H times, the k norm Hkv times
            values = values.expand(piece.stop - piece.start, -1)
        if config.norm_unit_offset and ours.endswith("norm.weight"):
            values = values.float() + 1.0  # Gemma's norms scale by (1 + weight): folded in as at load
        expected = (piece.stop - piece.start, *target.shape[1:])
        if tuple(values.shape) != expected:
            raise ValueError(
                f"load_weights: {name} has shape {tuple(tensor.shape)}, expected "
                f"{expected if not ours.endswith('qk_norm.weight') else tuple(target.shape[1:])}"
            )
        rows.append((piece.start, piece.stop, values))
    return rows


@torch.no_grad()
def _write(model: torch.nn.Module, ours: str, rows: list[tuple[int, int, torch.Tensor]]) -> None:
    target = _target(model, ours)
    if not isinstance(target, QuantizedWeight):
        for start, stop, values in rows:
            target[start:stop].copy_(values)
        return
    parts = [_rebuilt_part(part, rows, cols=target.shape[1]) for part in target.parts]
    # a new object: the one-call layers gather their arguments again when a weight is replaced
    setattr(*owning_module(model, ours), QuantizedWeight(parts, shape=target.shape))


def _rebuilt_part(part: PackedPart, rows: list[tuple[int, int, torch.Tensor]], *, cols: int) -> PackedPart:
    """The part with the rows of `rows` that fall in it re-rounded in its format; the rest as they were."""
    inside = [
        (max(start, part.row_start), min(stop, part.row_start + part.rows), start, values)
        for start, stop, values in rows
        if start < part.row_start + part.rows and part.row_start < stop
    ]
    if not inside:
        return part
    parts = unpack_rows(part.format, part.packed.numpy(), rows=np.arange(part.rows), cols=cols)
    for first, last, start, values in inside:
        chunk = values[first - start : last - start]
        if part.format in FLOAT16_FORMATS:
            new = float16_parts(chunk.to(_FLOAT16_DTYPES[part.format]))
        else:
            new = quantize_legacy(chunk, part.format)
        local = slice(first - part.row_start, last - part.row_start)
        for field in ("q", "d", "dmin", "sc", "m"):
            array = getattr(parts, field)
            if array is not None:
                array[local] = getattr(new, field)
    return PackedPart(
        format=part.format, packed=torch.from_numpy(pack(parts)), row_start=part.row_start, rows=part.rows
    )
