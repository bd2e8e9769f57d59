"""Draft heads shipped inside the package, found by name for the model they were trained on.

``manifest.json`` lists each head: its name (the method it serves, e.g. ``eagle3``), the
signature of the target it drafts for (``target_signature``: architecture, shape and a
checksum of embedding rows, the same wherever and in whichever dtype the model is loaded),
its folder here, and how it was made (command, data, seed, measured figures).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

HEADS_ROOT = Path(__file__).resolve().parent
MANIFEST = HEADS_ROOT / "manifest.json"


def shipped_heads() -> list[dict]:
    if not MANIFEST.is_file():
        return []
    return json.loads(MANIFEST.read_text()).get("heads", [])


def target_signature(model) -> str:
    """Identifies a target Decoder's weights: bf16-rounded embedding rows hashed with its shape."""
    c = model.config
    rows = model.embed_tokens.detach()[:64].to("cpu", torch.bfloat16).view(torch.int16)
    digest = hashlib.sha256(rows.numpy().tobytes()).hexdigest()[:12]
    return f"{c.model_type}-{c.num_layers}x{c.hidden_size}-v{c.vocab_size}-{digest}"


def shipped_head_dir(name: str, *, model) -> Path | None:
    """The shipped head called `name` for the target Decoder `model`, or None."""
    signature = target_signature(model)
    for entry in shipped_heads():
        if entry["name"] == name and entry["target"] == signature:
            return HEADS_ROOT / entry["dir"]
    return None


def resolve_head_dir(head: str | None, *, method: str, model) -> Path:
    """A head folder: `head` itself when it is a directory, else the head shipped for `model`
    under the name `head` (default: the method's name)."""
    if head:
        path = Path(head).expanduser()
        if path.is_dir():
            return path
    name = head or method
    shipped = shipped_head_dir(str(name), model=model)
    if shipped is not None:
        return shipped
    if head:
        raise FileNotFoundError(
            f"draft head {head!r} not found: give a directory written by "
            f"`quickdraft train-head` or the name of a head shipped for this model"
        )
    raise ValueError(
        f"no {method} head is shipped for this target: train one with `quickdraft train-head "
        f'--method {method}` and pass {{"head": DIR}}'
    )


# head_dtype values that draft on quantized copies of a head's matrices, and their GGUF formats.
HEAD_QUANTIZATIONS = {"q8_0": "Q8_0", "q5_0": "Q5_0", "q4_0": "Q4_0"}


def head_quantization(head_dtype: str | None, *, model) -> str | None:
    """The format (Q8_0, Q5_0, Q4_0) of the copies of its matrices an EAGLE-style head drafts on,
    or None (float).  Asked for with ``head_dtype="q8_0"``, "q5_0" or "q4_0"; Q4_0 is the default
    when the target itself runs quantized weights on the CPU kernels (a float32 head would read
    eight times the bytes): a draft depth of the shipped eagle3 head reads ~12 MB in Q8_0, and on
    30 Spec-Bench questions Q4_0 drafted as well (1.85 vs 1.84 tokens accepted per draft) and
    ran 1.74x plain vs 1.64x for Q8_0 (docs/performance-log.md, "Heads draft on Q4_0 copies")."""
    if head_dtype in HEAD_QUANTIZATIONS:
        return HEAD_QUANTIZATIONS[head_dtype]
    if head_dtype is not None:
        return None
    from quickdraft.kernels.quant_linear import kernel_available
    from quickdraft.models.quantized import QuantizedWeight

    quantized_target = isinstance(getattr(model, "lm_head_weight", None), QuantizedWeight)
    return "Q4_0" if quantized_target and kernel_available() else None


def head_compute_dtype(head_dtype: str | None, *, default: torch.dtype) -> torch.dtype:
    """A drafter's `head_dtype` option: None keeps the target's dtype.  Drafting precision never
    changes the output (verification decides), only how well the head guesses and how fast."""
    if head_dtype is None:
        return default
    if head_dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(
            f"head_dtype must be float32, bfloat16, float16, {', '.join(HEAD_QUANTIZATIONS)}, got {head_dtype!r}"
        )
    return getattr(torch, head_dtype)


def head_precision(head_dtype: str | None, *, target) -> tuple[torch.dtype, str | None]:
    """How a drafter loads its head (TargetInfo `target`): the dtype its float weights load in,
    and the format of the quantized copies of its matrices it drafts on (`head_quantization`;
    then the float weights are float32 and the copies are made after attach_target), or None."""
    quantization = head_quantization(head_dtype, model=target.model)
    if quantization and target.device.type != "cpu":  # before loading anything
        raise ValueError(f"head_dtype={head_dtype!r} runs on the CPU kernels; the target is on {target.device}")
    dtype = torch.float32 if quantization else head_compute_dtype(head_dtype, default=target.dtype)
    return dtype, quantization


def recommended_length(*, method: str, target, options: dict) -> int | None:
    """The draft length (num_speculative_tokens) the manifest of the head a drafter config would
    load recommends, or None: no head folder of our own, no recommendation, or no model to
    look a shipped head up for (the drafter then reports what is missing)."""
    if target.model is None:
        return None
    head = options.get("head")
    try:
        directory = resolve_head_dir(head, method=method, model=target.model)
    except (FileNotFoundError, ValueError):
        return None  # creating the drafter raises the same error, with its context
    length = _recommended(directory).get("num_speculative_tokens")
    return length if isinstance(length, int) and not isinstance(length, bool) and length >= 1 else None


def _recommended(directory: Path) -> dict:
    """The drafting settings a head folder's manifest recommends (``"drafting"``), or none."""
    manifest = Path(directory) / "manifest.json"
    return json.loads(manifest.read_text()).get("drafting", {}) if manifest.is_file() else {}


def inherited_drafting(method: str, *, init_head: Path | None, depths: int) -> tuple[dict, str]:
    """The drafting settings a newly trained head's manifest recommends, and where they come
    from: its init head's (a fine-tune drafts like the head it started from), else those measured
    best for the head of the same method shipped here (on a CPU target a drafter's own defaults,
    a wide dynamic tree, cost more to verify than they return).  Neither was measured for the
    new head itself, and its manifest says so.  A static tree deeper than the new head's `depths`
    (Medusa heads) is not inherited.  ({}, "") when there is nothing to inherit."""
    sources = [(Path(init_head), f"inherited from the init head {init_head}")] if init_head is not None else []
    sources += [
        (HEADS_ROOT / entry["dir"], f"those measured best for the shipped {method} head ({entry['dir']})")
        for entry in shipped_heads()
        if entry["name"] == method and entry["method"] == method
    ]
    for directory, source in sources:
        drafting = _recommended(directory)
        tree = drafting.get("tree")
        if drafting and not (isinstance(tree, list) and max(map(len, tree), default=0) > depths):
            return drafting, f"{source}; not measured for this head"
    return {}, ""


def drafting_options(directory: Path, **given) -> dict:
    """A drafter's options: each given value, or where it is None the one the head's manifest
    recommends (``"drafting"``: the settings measured best for that head, see its manifest),
    or the drafter's own default.  `given` maps a name to (value, default)."""
    recommended = _recommended(directory)
    return {
        name: value if value is not None else recommended.get(name, default) for name, (value, default) in given.items()
    }
