"""What an embedding model does after its transformer, as a sentence-transformers directory
declares it (EmbeddingGemma, most HF embedding models): `modules.json` lists the modules in
order -- the Transformer (this directory's own weights), a Pooling (`1_Pooling/config.json`: which
tokens are pooled), Dense layers (`2_Dense/`: a linear map and its activation) and Normalize.

vLLM reads the same files for its pooling models; llama.cpp's GGUF conversion of EmbeddingGemma
keeps the two Dense layers as `dense_2` / `dense_3` (quickdraft/models/gguf.py writes them back
here in a converted directory).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

MODULES_FILE = "modules.json"
_MODULE_PREFIX = "sentence_transformers.models."
# 1_Pooling/config.json's switches -> our pooling types
_POOLING_MODES = {"pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS", "pooling_mode_lasttoken": "LAST"}
_UNSUPPORTED_POOLING_MODES = (
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
)
ACTIVATIONS = {
    "torch.nn.modules.linear.Identity": "identity",
    "torch.nn.modules.activation.Tanh": "tanh",
}


@dataclass(frozen=True)
class DenseLayer:
    """sentence-transformers' Dense: activation(x @ weight.T + bias)."""

    weight: torch.Tensor  # [out, in] float32
    bias: torch.Tensor | None  # [out] float32
    activation: str  # "identity" | "tanh"

    def __call__(self, vector: torch.Tensor) -> torch.Tensor:  # [in] -> [out]
        out = torch.nn.functional.linear(vector, self.weight, self.bias)
        return torch.tanh(out) if self.activation == "tanh" else out


@dataclass(frozen=True)
class EmbeddingHead:
    """The pooled vector's way to the embedding: the pooling the model was trained with, its
    Dense layers in order, and whether its last module normalises."""

    pooling_type: str | None  # None: the directory names none
    dense: tuple[DenseLayer, ...] = ()
    normalize: bool = False

    def project(self, vector: torch.Tensor) -> torch.Tensor:  # [hidden] -> [output_size]
        for layer in self.dense:
            vector = layer(vector)
        return vector

    def output_size(self, hidden_size: int) -> int:
        return self.dense[-1].weight.shape[0] if self.dense else hidden_size


def read_embedding_head(model_dir: Path) -> EmbeddingHead | None:
    """The modules after the transformer of a sentence-transformers directory (None without
    `modules.json`); ValueError naming the module or setting it cannot run."""
    path = model_dir / MODULES_FILE
    if not path.is_file():
        return None
    try:
        modules = json.loads(path.read_text())
        if not isinstance(modules, list):
            raise ValueError("expected a list of modules")
        entries = [(str(m["type"]), str(m.get("path", ""))) for m in modules]
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path}: not a sentence-transformers module list ({err})") from err
    pooling_type, dense, normalize = None, [], False
    for index, (kind, sub) in enumerate(entries):
        name = kind.removeprefix(_MODULE_PREFIX)
        if name == "Transformer":
            if index != 0 or sub not in ("", "."):
                raise ValueError(
                    f"{path}: the Transformer module must come first with this directory's own weights "
                    f"(path '' ), got position {index}, path {sub!r}"
                )
        elif name == "Pooling":
            pooling_type = _pooling_type(model_dir / sub / "config.json")
        elif name == "Dense":
            dense.append(_dense_layer(model_dir / sub))
        elif name == "Normalize":
            normalize = True
        else:
            raise ValueError(f"{path}: module {kind!r} is not supported (Transformer, Pooling, Dense, Normalize are)")
    return EmbeddingHead(pooling_type=pooling_type, dense=tuple(dense), normalize=normalize)


def _pooling_type(config_path: Path) -> str:
    config = _read_json(config_path)
    chosen = [ours for key, ours in _POOLING_MODES.items() if config.get(key)]
    unsupported = [key for key in _UNSUPPORTED_POOLING_MODES if config.get(key)]
    if unsupported or len(chosen) != 1:
        raise ValueError(
            f"{config_path}: one of {', '.join(_POOLING_MODES)} must be set "
            f"(set: {', '.join(k for k in list(_POOLING_MODES) + list(_UNSUPPORTED_POOLING_MODES) if config.get(k))})"
        )
    return chosen[0]


def _dense_layer(directory: Path) -> DenseLayer:
    config = _read_json(directory / "config.json")
    activation_name = config.get("activation_function", "torch.nn.modules.activation.Tanh")
    if activation_name not in ACTIVATIONS:
        raise ValueError(
            f"{directory}: Dense activation {activation_name!r} is not supported ({', '.join(ACTIVATIONS)} are)"
        )
    tensors = _dense_tensors(directory)
    weight = tensors.get("linear.weight")
    if weight is None:
        raise ValueError(f"{directory}: no linear.weight in the Dense layer's weights")
    expected = (int(config["out_features"]), int(config["in_features"]))
    if tuple(weight.shape) != expected:
        raise ValueError(f"{directory}: linear.weight has shape {tuple(weight.shape)}, its config says {expected}")
    bias = tensors.get("linear.bias") if config.get("bias", True) else None
    if config.get("bias", True) and bias is None:
        raise ValueError(f"{directory}: the config asks for a bias and the weights hold no linear.bias")
    return DenseLayer(
        weight=weight.float(), bias=None if bias is None else bias.float(), activation=ACTIVATIONS[activation_name]
    )


def _dense_tensors(directory: Path) -> dict[str, torch.Tensor]:
    safetensors_path = directory / "model.safetensors"
    if safetensors_path.is_file():
        from safetensors.torch import load_file

        return load_file(str(safetensors_path))
    torch_path = directory / "pytorch_model.bin"
    if torch_path.is_file():
        return torch.load(torch_path, map_location="cpu", weights_only=True)
    raise ValueError(f"{directory}: no model.safetensors or pytorch_model.bin for the Dense layer")


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot read {path}: {err}") from err
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return value


def write_dense_layer(directory: Path, *, weight: torch.Tensor, bias: torch.Tensor | None, activation: str) -> None:
    """A Dense module as sentence-transformers saves it (GGUF conversions, tests)."""
    from safetensors.torch import save_file

    names = {ours: theirs for theirs, ours in ACTIVATIONS.items()}
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "in_features": int(weight.shape[1]),
        "out_features": int(weight.shape[0]),
        "bias": bias is not None,
        "activation_function": names[activation],
    }
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    tensors = {"linear.weight": weight.contiguous()} | ({} if bias is None else {"linear.bias": bias.contiguous()})
    save_file(tensors, str(directory / "model.safetensors"))


def write_modules(model_dir: Path, *, hidden_size: int, pooling_type: str, dense: list[str], normalize: bool) -> None:
    """modules.json and 1_Pooling/config.json for a directory whose Dense modules are (or will
    be) in the subdirectories `dense`, in order (a directory sentence-transformers loads too)."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": _MODULE_PREFIX + "Transformer"}]
    pooling_dir = "1_Pooling"
    modules.append({"idx": 1, "name": "1", "path": pooling_dir, "type": _MODULE_PREFIX + "Pooling"})
    for sub in dense:
        modules.append({"idx": len(modules), "name": str(len(modules)), "path": sub, "type": _MODULE_PREFIX + "Dense"})
    if normalize:
        modules.append(
            {
                "idx": len(modules),
                "name": str(len(modules)),
                "path": f"{len(modules)}_Normalize",
                "type": _MODULE_PREFIX + "Normalize",
            }
        )
    (model_dir / pooling_dir).mkdir(parents=True, exist_ok=True)
    switches = {key: ours == pooling_type for key, ours in _POOLING_MODES.items()}
    switches |= {key: False for key in _UNSUPPORTED_POOLING_MODES}
    pooling = {"word_embedding_dimension": hidden_size, **switches, "include_prompt": True}
    (model_dir / pooling_dir / "config.json").write_text(json.dumps(pooling, indent=1))
    (model_dir / MODULES_FILE).write_text(json.dumps(modules, indent=1))
