"""Default sampling parameters from a model's `generation_config.json`, as vLLM applies them.

Model authors write their recommended sampling there (Gemma 3: top_k 64, top_p 0.95). vLLM
(`--generation-config auto`, its default) uses those values for every request field the client
leaves out, and `LLM.generate` without sampling params uses them too; "vllm" ignores the file.
The same keys as vLLM read: temperature, top_p, top_k, min_p, repetition_penalty and
max_new_tokens (the default max_tokens where a request sets none; `do_sample` is not read,
as in vLLM).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from quickdraft.sampling_params import SamplingParams

# generation_config.json key -> SamplingParams field
SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
GENERATION_CONFIG_SOURCES = ("auto", "vllm")  # or a directory holding generation_config.json


def default_sampling_fields(
    model: str | None, *, source: str = "auto", overrides: dict[str, Any] | None = None
) -> dict[str, Any]:
    """SamplingParams fields a request that leaves them out gets: from `source` ("auto": the HF
    model directory's generation_config.json, none for a GGUF file or the embedded model; "vllm":
    none; else a directory holding one), then `overrides` (generation_config keys).  A ValueError
    names the setting at fault."""
    if not isinstance(source, str) or not source:
        raise ValueError(f"generation_config must be 'auto', 'vllm' or a directory, got {source!r}")
    directory: Path | None = None
    if source == "auto":
        directory = Path(model) if model is not None and Path(model).is_dir() else None
    elif source != "vllm":
        directory = Path(source)
        if not directory.is_dir():
            raise ValueError(f"generation_config: {source!r} is not a directory (give 'auto', 'vllm' or a directory)")
    fields = _read_fields(directory / "generation_config.json") if directory is not None else {}
    if overrides:
        if not isinstance(overrides, dict):
            raise ValueError(f"override_generation_config must be a JSON object, got {overrides!r}")
        unknown = sorted(set(overrides) - set(SAMPLING_KEYS))
        if unknown:
            raise ValueError(f"override_generation_config: unknown keys {unknown} (known: {sorted(SAMPLING_KEYS)})")
        fields |= {SAMPLING_KEYS[key]: value for key, value in overrides.items()}
    try:
        SamplingParams(**fields)
    except ValueError as err:
        raise ValueError(f"generation config defaults {fields}: {err}") from err
    return fields


def _read_fields(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ValueError(f"generation_config: cannot read {path}: {err}") from err
    if not isinstance(config, dict):
        raise ValueError(f"generation_config: {path} does not hold a JSON object")
    return {field: config[key] for key, field in SAMPLING_KEYS.items() if config.get(key) is not None}
