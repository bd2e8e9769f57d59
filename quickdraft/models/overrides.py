"""vLLM's `hf_overrides`: keys that replace those of a model directory's config.json, and the way
vLLM loads a language model as a classifier or reranker read at a few tokens' logits.

The official Qwen3-Reranker is a causal LM asked "yes" or "no": its score is softmax over the
logits of "no" and "yes", read at the last token.  vLLM serves it with

    hf_overrides={"architectures": ["Qwen3ForSequenceClassification"],
                  "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": True}

which turns the two LM-head rows into a one-label `score` head: sigmoid((w_yes - w_no) . h) is
that softmax's "yes" ("from_2_way_softmax").  "no_post_processing" keeps the named rows as they
are, one label each (BAAI/bge-reranker-v2-gemma: its "Yes" logit).

The engine reads directories, so the overrides are applied as one: a cached directory beside the
GGUF conversions holding the merged config.json, a `score.safetensors` where a head is built, and
links to every other file of the model.  Nothing is copied, and the model runs through the
engine's ordinary classifier path (pooling.Classifier)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch

CLASSIFIER_METHODS = ("from_2_way_softmax", "no_post_processing")
# keys of ours that configure the conversion and are not written to config.json
_CONVERSION_KEYS = ("classifier_from_token", "method", "is_original_qwen3_reranker")
SCORE_FILE = "score.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def check_hf_overrides(overrides: object) -> dict:
    """The overrides as a dict, or a ValueError naming what is wrong with them."""
    if not isinstance(overrides, dict) or not all(isinstance(key, str) for key in overrides):
        raise ValueError(f"hf_overrides must be a JSON object of config.json keys, got {overrides!r}")
    try:
        json.dumps(overrides)
    except (TypeError, ValueError) as err:
        raise ValueError(f"hf_overrides must hold JSON values only: {err}") from err
    tokens = overrides.get("classifier_from_token")
    method = _classifier_method(overrides)
    if tokens is None:
        if method is not None:
            raise ValueError(
                "hf_overrides: method needs classifier_from_token (the tokens whose LM-head rows it reads)"
            )
        return overrides
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) and t for t in tokens):
        raise ValueError(f"hf_overrides: classifier_from_token must be a list of token strings, got {tokens!r}")
    if method is None:
        raise ValueError(
            f"hf_overrides: classifier_from_token needs a method, one of {list(CLASSIFIER_METHODS)} "
            f"(or is_original_qwen3_reranker: true)"
        )
    if method not in CLASSIFIER_METHODS:
        raise ValueError(f"hf_overrides: method must be one of {list(CLASSIFIER_METHODS)}, got {method!r}")
    if method == "from_2_way_softmax" and len(tokens) != 2:
        raise ValueError(f"hf_overrides: from_2_way_softmax reads two tokens (negative, positive), got {tokens!r}")
    architectures = overrides.get("architectures")
    if architectures is not None and not (
        isinstance(architectures, list)
        and architectures
        and all(isinstance(a, str) and a.endswith("ForSequenceClassification") for a in architectures)
    ):
        raise ValueError(
            f"hf_overrides: classifier_from_token makes a *ForSequenceClassification model, but architectures "
            f"is {architectures!r}"
        )
    return overrides


def _classifier_method(overrides: dict) -> str | None:
    if overrides.get("is_original_qwen3_reranker"):
        method = overrides.get("method", "from_2_way_softmax")
        if method != "from_2_way_softmax":
            raise ValueError(
                f"hf_overrides: is_original_qwen3_reranker reads from_2_way_softmax, got method {method!r}"
            )
        return method
    return overrides.get("method")


def apply_hf_overrides(model_dir: Path, overrides: dict, *, cache_root: Path) -> Path:
    """A directory that is `model_dir` with `overrides` applied (made once, cached under
    `cache_root`, keyed by the model's files and the overrides)."""
    overrides = check_hf_overrides(overrides)
    model_dir = Path(model_dir).resolve()
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} does not exist: hf_overrides need a HF model directory")
    out_dir = cache_root / f"{model_dir.name}-{_key(model_dir, overrides)}"
    if (out_dir / "config.json").is_file():
        return out_dir
    from quickdraft.models.gguf import staging_dir

    cache_root.mkdir(parents=True, exist_ok=True)
    prune_stale_overrides(cache_root)
    with staging_dir(out_dir) as staging:
        _write_overridden(model_dir, staging, overrides)
    return out_dir


def prune_stale_overrides(cache_root: Path) -> int:
    """Remove the directories whose model is gone (a link of theirs leads nowhere); returns how many.
    A changed model gets a directory of its own (the key covers its files), so without this the
    old ones would stay."""
    removed = 0
    for directory in sorted(cache_root.iterdir()):
        if directory.name.startswith(".") or not directory.is_dir():
            continue  # another process's staging directory
        if any(entry.is_symlink() and not entry.exists() for entry in directory.iterdir()):
            shutil.rmtree(directory, ignore_errors=True)
            removed += 1
    return removed


def _key(model_dir: Path, overrides: dict) -> str:
    """What the directory depends on: the model's files (path, size, mtime) and the overrides, not
    the caches the engine writes beside a GGUF conversion (packed weights, a float copy): one
    written later must not make a second directory (it would pack the weights again)."""
    from quickdraft.models.gguf import FLOAT_COPY_DIR
    from quickdraft.models.quantized_loader import PACKED_CACHE_PREFIX

    parts = [str(model_dir), json.dumps(overrides, sort_keys=True)]
    for entry in sorted(model_dir.iterdir()):
        if entry.name.startswith(PACKED_CACHE_PREFIX) or entry.name == FLOAT_COPY_DIR:
            continue
        stat = entry.stat()
        parts.append(f"{entry.name}:{stat.st_size}:{stat.st_mtime_ns}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _write_overridden(model_dir: Path, out_dir: Path, overrides: dict) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    config = _merged(config, {k: v for k, v in overrides.items() if k not in _CONVERSION_KEYS})
    tokens = overrides.get("classifier_from_token")
    rewritten = {"config.json"}
    if tokens is not None:
        method = _classifier_method(overrides)
        score = _score_rows(model_dir, config, tokens=tokens, method=method)  # [num_labels, D]
        labels = [tokens[1]] if method == "from_2_way_softmax" else list(tokens)
        config = classifier_config(config, labels=labels, architectures=overrides.get("architectures"))
        write_score_head(out_dir, weight=score)
        rewritten.add(SCORE_FILE)
        index_path = model_dir / INDEX_FILE
        if index_path.is_file():  # sharded: the index must name the head's file too
            index = json.loads(index_path.read_text())
            index["weight_map"]["score.weight"] = SCORE_FILE
            (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=1))
            rewritten.add(INDEX_FILE)
    for entry in model_dir.iterdir():
        if entry.name not in rewritten:
            (out_dir / entry.name).symlink_to(entry)
    (out_dir / "config.json").write_text(json.dumps(config, indent=1))


def _merged(base: dict, overrides: dict) -> dict:
    """base with overrides' keys replaced; nested objects (text_config, rope_scaling) key by key."""
    merged = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merged(merged[key], value)
        else:
            merged[key] = value
    return merged


def classifier_config(config: dict, *, labels: list[str], architectures: list[str] | None = None) -> dict:
    """A causal LM's config.json as its *ForSequenceClassification's (a `score` head of one row per
    label), as vLLM's conversion and llama.cpp's rank-pooling GGUFs make one."""
    if architectures is None:
        causal = config.get("architectures") or []
        stem = next((a.removesuffix("ForCausalLM") for a in causal if a.endswith("ForCausalLM")), None)
        if stem is None:
            raise ValueError(
                f"a classifier head needs a causal LM's (architectures {causal!r}): name the classifier in "
                f"hf_overrides' architectures"
            )
        architectures = [stem + "ForSequenceClassification"]
    return config | {
        "architectures": architectures,
        "num_labels": len(labels),
        "id2label": {str(i): label for i, label in enumerate(labels)},
        "label2id": {label: i for i, label in enumerate(labels)},
    }


def write_score_head(model_dir: Path, *, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """The classifier's `score` head ([num_labels, D], [num_labels]) as SCORE_FILE in `model_dir`."""
    from safetensors.torch import save_file

    tensors = {"score.weight": weight.float().contiguous()}
    if bias is not None:
        tensors["score.bias"] = bias.float().contiguous()
    save_file(tensors, str(model_dir / SCORE_FILE))


def _score_rows(model_dir: Path, config: dict, *, tokens: list[str], method: str | None) -> torch.Tensor:
    """The `score` head from the LM head's rows of `tokens`: their difference (positive minus
    negative) for from_2_way_softmax, the rows themselves otherwise."""
    from quickdraft.models.loader import read_hf_tensors
    from quickdraft.models.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(model_dir)
    ids = []
    for token in tokens:
        encoded = tokenizer.encode(token, add_special_tokens=False)
        if len(encoded) != 1:
            raise ValueError(
                f"hf_overrides: classifier_from_token {token!r} is {len(encoded)} tokens {encoded} in this "
                f"tokenizer; each must be one token"
            )
        ids.append(encoded[0])
    text_config = config.get("text_config") or config
    tied = text_config.get("tie_word_embeddings", config.get("tie_word_embeddings", True))
    names = ["model.embed_tokens.weight"] if tied else ["lm_head.weight", "model.embed_tokens.weight"]
    tensors = read_hf_tensors(model_dir, names=set(names))
    head = next((tensors[name] for name in names if name in tensors), None)
    if head is None:
        raise ValueError(f"hf_overrides: {model_dir} has no LM head ({' or '.join(names)}) to read tokens from")
    rows = head[ids].float()  # [len(tokens), D]
    return (rows[1] - rows[0]).unsqueeze(0) if method == "from_2_way_softmax" else rows
