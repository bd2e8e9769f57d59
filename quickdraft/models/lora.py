"""LoRA adapters in PEFT's format, applied per request to the target's projections.

An adapter adds ``scale * B (A x)`` to the output of each projection it targets (q, k, v, o,
gate, up, down; ``scale = lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA).  Our decoder keeps q, k
and v in one matrix and gate and up in another, so an adapter's module becomes a *part* of one
of four sites, at the output columns that module fills.  The scale is folded into B at load.

Rows of one forward may run different adapters (or none): ``LoRABatch`` says which, and every
row's delta is computed from that row alone, in the same operations whatever shares the
forward, so batch invariance (and with it speculation's exactness) holds with adapters too.
The C++ layer (csrc/quant_linear.cpp) takes the adapters once per slot of ``LoRASlots`` and a
slot per row per forward; the Python layer computes the same deltas with the decoder's linear.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from quickdraft.models.config import ModelConfig
from quickdraft.models.layers import LinearFn

SITES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")

# PEFT's module name -> our site (its output columns there: _site_shapes)
_MODULE_SITES = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "o_proj": "o_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
    "down_proj": "down_proj",
    # Phi-3's own fused projections
    "qkv_proj": "qkv_proj",
    "gate_up_proj": "gate_up_proj",
}

_KEY = re.compile(
    r"^(?P<module>.*\blayers\.(?P<layer>\d+)\.(?:self_attn|mlp)\.(?P<proj>[a-z_]+_proj))"
    r"\.lora_(?P<ab>[AB])(?:\.[A-Za-z0-9_]+)?\.weight$"
)

# adapter_config.json settings that change what the adapter computes, and the value that keeps
# plain LoRA: anything else is refused by name rather than applied wrongly.
_PLAIN_SETTINGS = {
    "bias": "none",
    "lora_bias": False,
    "use_dora": False,
    "fan_in_fan_out": False,
    "modules_to_save": None,
    "target_parameters": None,
    "layer_replication": None,
    "trainable_token_indices": None,
    "alora_invocation_tokens": None,
}


class LoRAError(ValueError):
    """An adapter that cannot be loaded or run on this target; the message names the adapter."""


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's LoRARequest: which adapter a request runs.  `lora_int_id` (>= 1) identifies it: a
    second request with the same id reuses the loaded adapter; `lora_path` is a local PEFT
    directory (adapter_config.json and adapter_model.safetensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise LoRAError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise LoRAError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise LoRAError(f"lora_path must be a non-empty path, got {self.lora_path!r}")


@dataclass
class LoRAPart:
    """One targeted module: out[:, col0 : col0 + n] += (x @ a.T) @ b.T."""

    a: torch.Tensor  # [r, K] float32
    b: torch.Tensor  # [n, r] float32, the adapter's scale folded in
    col0: int  # the module's first output column in its site

    @property
    def num_outputs(self) -> int:
        return self.b.shape[0]


@dataclass
class LoRAWeights:
    """A loaded adapter: per layer, its parts at each site it targets."""

    name: str
    int_id: int
    path: str
    key: str  # a hash of the adapter's files: what prefix-cache blocks computed under it are keyed by
    rank: int  # the largest r of its modules
    layers: list[dict[str, list[LoRAPart]]]  # [num_layers] site -> parts

    def parts(self, layer: int, site: str) -> list[LoRAPart]:
        return self.layers[layer].get(site, [])


def _site_shapes(config: ModelConfig) -> dict[str, tuple[int, int, int]]:
    """The target's modules, as PEFT names them -> (input width, output width, first output
    column in its site)."""
    c = config
    if c.fused_projections:
        attention = {"qkv_proj": (c.hidden_size, c.q_size + 2 * c.kv_size, 0)}
        mlp = {"gate_up_proj": (c.hidden_size, 2 * c.intermediate_size, 0)}
    else:
        attention = {
            "q_proj": (c.hidden_size, c.q_size, 0),
            "k_proj": (c.hidden_size, c.kv_size, c.q_size),
            "v_proj": (c.hidden_size, c.kv_size, c.q_size + c.kv_size),
        }
        mlp = {
            "gate_proj": (c.hidden_size, c.intermediate_size, 0),
            "up_proj": (c.hidden_size, c.intermediate_size, c.intermediate_size),
        }
    return (
        attention
        | {"o_proj": (c.q_size, c.hidden_size, 0)}
        | mlp
        | {"down_proj": (c.intermediate_size, c.hidden_size, 0)}
    )


def _read_adapter_files(path: Path, name: str) -> tuple[dict, dict[str, torch.Tensor], str]:
    """(adapter_config.json, the tensors, a hash of both files)."""
    if not path.is_dir():
        raise LoRAError(f"LoRA adapter {name!r}: {str(path)!r} is not a directory")
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise LoRAError(f"LoRA adapter {name!r}: no adapter_config.json in {str(path)!r}")
    config_bytes = config_file.read_bytes()
    try:
        settings = json.loads(config_bytes)
    except json.JSONDecodeError as err:
        raise LoRAError(f"LoRA adapter {name!r}: adapter_config.json is not valid JSON ({err})") from err
    if not isinstance(settings, dict):
        raise LoRAError(f"LoRA adapter {name!r}: adapter_config.json must hold an object")
    digest = hashlib.sha256(config_bytes)
    weights_file = path / "adapter_model.safetensors"
    if weights_file.is_file():
        from safetensors.torch import load as load_bytes

        data = weights_file.read_bytes()  # read once: hashed and parsed
        digest.update(data)
        try:
            tensors = load_bytes(data)
        except Exception as err:  # a truncated or foreign file: safetensors' own message says what
            raise LoRAError(f"LoRA adapter {name!r}: cannot read adapter_model.safetensors ({err})") from err
    elif (path / "adapter_model.bin").is_file():
        binary = path / "adapter_model.bin"
        digest.update(binary.read_bytes())
        try:  # weights only: a pickle may not run code
            tensors = torch.load(binary, map_location="cpu", weights_only=True)
        except Exception as err:
            raise LoRAError(f"LoRA adapter {name!r}: cannot read adapter_model.bin ({err})") from err
    else:
        raise LoRAError(f"LoRA adapter {name!r}: no adapter_model.safetensors (or .bin) in {str(path)!r}")
    return settings, tensors, digest.hexdigest()[:32]


def _check_settings(settings: dict, name: str) -> None:
    peft_type = settings.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoRAError(f"LoRA adapter {name!r}: peft_type {peft_type!r} is not LORA")
    for key, plain in _PLAIN_SETTINGS.items():
        value = settings.get(key, plain)
        if value != plain and not (plain is None and value in ([], {}, "")):
            raise LoRAError(
                f"LoRA adapter {name!r}: adapter_config.json sets {key}={value!r}; only plain LoRA "
                f"({key}={plain!r}) is supported"
            )
    alpha = settings.get("lora_alpha", settings.get("r", 8))
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise LoRAError(f"LoRA adapter {name!r}: lora_alpha must be a positive number, got {alpha!r}")


def _pattern_value(patterns: dict, module: str, default: float) -> float:
    """PEFT's per-module override (rank_pattern / alpha_pattern): the first key that matches the
    end of the module's name, as a regex."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


@dataclass
class _Module:
    """One targeted module as a file holds it."""

    layer: int
    proj: str  # PEFT's module name (q_proj, ...)
    a: torch.Tensor  # [r, K]
    b: torch.Tensor  # [n, r]
    alpha: float  # scale = alpha / r (alpha / sqrt(r) with rsLoRA); 0: scale 1 (llama.cpp's)


def _check_layer(tensor_name: str, *, layer: int, num_layers: int, adapter: str) -> None:
    if layer >= num_layers:
        raise LoRAError(f"LoRA adapter {adapter!r}: {tensor_name!r} is for layer {layer}; the target has {num_layers}")


def _peft_modules(path: Path, name: str, config: ModelConfig) -> tuple[list[_Module], bool, str]:
    """A PEFT directory's modules, whether it is rsLoRA, and the hash of its files."""
    settings, tensors, key = _read_adapter_files(path, name)
    _check_settings(settings, name)
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    module_names: dict[tuple[int, str], str] = {}
    for tensor_name, tensor in tensors.items():
        match = _KEY.match(tensor_name)
        if match is None or match["proj"] not in _MODULE_SITES:
            raise LoRAError(
                f"LoRA adapter {name!r}: tensor {tensor_name!r} is not a LoRA A/B weight of a supported "
                f"module ({', '.join(_MODULE_SITES)} of the decoder layers; embeddings and the LM head are not)"
            )
        layer, proj = int(match["layer"]), match["proj"]
        _check_layer(tensor_name, layer=layer, num_layers=config.num_layers, adapter=name)
        found.setdefault((layer, proj), {})[match["ab"]] = tensor
        module_names[layer, proj] = match["module"]
    alpha = float(settings.get("lora_alpha", settings.get("r", 8)))
    alpha_pattern = settings.get("alpha_pattern") or {}
    modules = [
        _paired(name, layer, proj, pair, alpha=float(_pattern_value(alpha_pattern, module_names[layer, proj], alpha)))
        for (layer, proj), pair in sorted(found.items())
    ]
    return modules, bool(settings.get("use_rslora", False)), key


def _paired(name: str, layer: int, proj: str, pair: dict[str, torch.Tensor], *, alpha: float) -> _Module:
    if set(pair) != {"A", "B"}:
        missing = "B" if "A" in pair else "A"
        raise LoRAError(f"LoRA adapter {name!r}, layer {layer} {proj}: has lora_{''.join(pair)} without lora_{missing}")
    return _Module(layer=layer, proj=proj, a=pair["A"], b=pair["B"], alpha=alpha)


_GGUF_KEY = re.compile(r"^blk\.(?P<layer>\d+)\.(?P<leaf>\w+)\.weight\.lora_(?P<ab>[ab])$")


def _gguf_modules(path: Path, name: str, config: ModelConfig) -> tuple[list[_Module], bool, str]:
    """A llama.cpp LoRA adapter (GGUF, general.type "adapter") as modules: its B rows of q and k
    put back in HF's order for Llama, as the loader does for the base weights."""
    import numpy as np

    from quickdraft.models.gguf import (
        _ARCH_BLOCK_NAMES,
        _BLOCK_NAMES,
        _HF_CLASSES,
        PERMUTED_QK_ARCHITECTURES,
        _unpermute_rows,
        open_gguf,
        read_field,
        tensor_values,
    )

    # the target's model_type (as its config.json or the GGUF conversion names it) -> GGUF architecture
    causal = {
        arch: hf for arch, hf in _HF_CLASSES.items() if arch != "gemma-embedding"
    }  # its own model_type is Gemma 3's
    architectures = {arch: arch for arch in causal} | {hf[0]: arch for arch, hf in causal.items()}
    architectures["mixtral"] = "llama"  # llama.cpp converts Mixtral as llama

    try:
        reader = open_gguf(path)
    except Exception as err:
        raise LoRAError(f"LoRA adapter {name!r}: cannot read {str(path)!r} as GGUF ({err})") from err
    kind, adapter_type = read_field(reader, "general.type"), read_field(reader, "adapter.type")
    if kind != "adapter" or adapter_type != "lora":
        raise LoRAError(
            f"LoRA adapter {name!r}: {str(path)!r} is not a LoRA adapter GGUF (general.type {kind!r}, "
            f"adapter.type {adapter_type!r}); a model file cannot be an adapter"
        )
    architecture = read_field(reader, "general.architecture")
    expected = "gemma-embedding" if config.bidirectional_attention else architectures.get(config.model_type)
    if architecture != expected:
        raise LoRAError(f"LoRA adapter {name!r}: an adapter of {architecture!r} models; the target is {expected!r}")
    # the loader's GGUF leaf names of the projections (attn_q -> self_attn.q_proj) -> PEFT's module names
    leaves = _BLOCK_NAMES | _ARCH_BLOCK_NAMES[architecture]
    projections = {leaf: hf.rpartition(".")[2] for leaf, hf in leaves.items() if hf.endswith("_proj")}
    alpha = float(read_field(reader, "adapter.lora.alpha", 0.0) or 0.0)
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for tensor in reader.tensors:
        match = _GGUF_KEY.match(tensor.name)
        if match is None or match["leaf"] not in projections:
            raise LoRAError(
                f"LoRA adapter {name!r}: tensor {tensor.name!r} is not a LoRA A/B weight of a supported "
                f"projection ({', '.join(projections)}; embeddings and the output are not)"
            )
        layer, proj = int(match["layer"]), projections[match["leaf"]]
        _check_layer(tensor.name, layer=layer, num_layers=config.num_layers, adapter=name)
        try:
            values = tensor_values(tensor)
        except Exception as err:
            raise LoRAError(f"LoRA adapter {name!r}: cannot read tensor {tensor.name!r} ({err})") from err
        if architecture in PERMUTED_QK_ARCHITECTURES and match["ab"] == "b" and proj in ("q_proj", "k_proj"):
            values = _unpermute_rows(values, n_head=config.num_heads if proj == "q_proj" else config.num_kv_heads)
        found.setdefault((layer, proj), {})[match["ab"].upper()] = torch.from_numpy(np.ascontiguousarray(values))
    modules = [_paired(name, layer, proj, pair, alpha=alpha) for (layer, proj), pair in sorted(found.items())]
    return modules, False, hashlib.sha256(Path(path).read_bytes()).hexdigest()[:32]  # the file's bytes


def load_lora_adapter(request: LoRARequest, *, config: ModelConfig, max_rank: int, device: torch.device) -> LoRAWeights:
    """Read and check a LoRA adapter for this target: a PEFT directory, or llama.cpp's GGUF adapter
    file; errors name the adapter and the problem."""
    name, path = request.lora_name, Path(request.lora_path)
    if path.suffix == ".gguf" and path.is_file():
        modules, rslora, key = _gguf_modules(path, name, config)
    else:
        modules, rslora, key = _peft_modules(path, name, config)
    if not modules:
        raise LoRAError(f"LoRA adapter {name!r}: its weights file holds no LoRA tensors")
    shapes = _site_shapes(config)
    layers: list[dict[str, list[LoRAPart]]] = [{} for _ in range(config.num_layers)]
    max_found = 0
    for module in modules:
        where = f"LoRA adapter {name!r}, layer {module.layer} {module.proj}"
        a, b = module.a, module.b
        if module.proj not in shapes:
            raise LoRAError(f"{where}: this target has no {module.proj} (its projections: {', '.join(shapes)})")
        width_in, width_out, col0 = shapes[module.proj]
        if module.layer in config.moe_layers and _MODULE_SITES[module.proj] in ("gate_up_proj", "down_proj"):
            raise LoRAError(
                f"{where}: layer {module.layer} is a mixture of experts; adapters on experts are not supported"
            )
        if (
            a.dim() != 2
            or b.dim() != 2
            or a.shape[1] != width_in
            or b.shape[0] != width_out
            or a.shape[0] != b.shape[1]
        ):
            raise LoRAError(
                f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit this target "
                f"(expected [r, {width_in}] and [{width_out}, r]): an adapter for another model?"
            )
        rank = a.shape[0]
        if rank > max_rank:
            raise LoRAError(f"{where}: rank {rank} exceeds max_lora_rank {max_rank}")
        max_found = max(max_found, rank)
        scale = module.alpha / (math.sqrt(rank) if rslora else rank) if module.alpha else 1.0
        order = config.hf_row_order(f"layers.{module.layer}.self_attn.{module.proj}.weight")
        if order is not None:  # output rows in the order the loader gave the base weight's
            b = b.index_select(0, torch.tensor(order))
        part = LoRAPart(
            a=a.to(torch.float32).contiguous().to(device),
            b=(b.to(torch.float32) * scale).contiguous().to(device),
            col0=col0,
        )
        layers[module.layer].setdefault(_MODULE_SITES[module.proj], []).append(part)
    for sites in layers:
        for parts in sites.values():
            parts.sort(key=lambda part: part.col0)
    return LoRAWeights(
        name=name, int_id=request.lora_int_id, path=request.lora_path, key=key, rank=max_found, layers=layers
    )


@dataclass
class LoRABatch:
    """Which rows of one forward run which adapter (built by the runner)."""

    row_slots: list[int]  # [N] each row's adapter slot, -1 for none (the C++ layer reads it)
    rows: dict[int, torch.Tensor]  # slot -> [n] its rows
    adapters: dict[int, LoRAWeights]  # slot -> the adapter in it

    def add_deltas(
        self,
        out: torch.Tensor,  # [N, M] a site's output, changed in place
        x: torch.Tensor,  # [N, K] the site's input
        *,
        layer: int,
        site: str,
        linear: LinearFn,
    ) -> torch.Tensor:
        for slot, rows in self.rows.items():
            parts = self.adapters[slot].parts(layer, site)
            if not parts:
                continue
            inputs = x.index_select(0, rows).float()
            for part in parts:
                delta = linear(linear(inputs, part.a, None), part.b, None)  # [n, part.num_outputs]
                cols = slice(part.col0, part.col0 + part.num_outputs)
                out[rows, cols] = out[rows, cols] + delta.to(out.dtype)
        return out


class LoRASlots:
    """The adapters one forward may use, at most `max_loras` (vLLM's): each forward's adapters get
    slots, keeping the slots they had (the C++ layer holds an adapter per slot) and taking those
    of adapters absent from it."""

    def __init__(self, max_loras: int):
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}")
        self.max_loras = max_loras
        self._held: OrderedDict[str, int] = OrderedDict()  # adapter key -> slot, least recently used first

    def assign(self, adapters: list[LoRAWeights]) -> dict[str, int]:
        """Adapter key -> slot for the distinct adapters of one forward."""
        keys = list(dict.fromkeys(adapter.key for adapter in adapters))
        if len(keys) > self.max_loras:
            raise RuntimeError(f"a forward with {len(keys)} LoRA adapters exceeds max_loras {self.max_loras}")
        for key in keys:
            if key in self._held:
                self._held.move_to_end(key)
        free = sorted(set(range(self.max_loras)) - set(self._held.values()))
        for key in keys:
            if key in self._held:
                continue
            if free:
                slot = free.pop(0)
            else:
                oldest = next(k for k in self._held if k not in keys)
                slot = self._held.pop(oldest)
            self._held[key] = slot
        return {key: self._held[key] for key in keys}


@dataclass
class LoRARegistry:
    """The adapters an engine has loaded, by lora_int_id: at most `max_cpu_loras`, the least
    recently used dropped first (requests that run one keep it alive)."""

    config: ModelConfig
    max_rank: int
    capacity: int
    device: torch.device
    _loaded: OrderedDict[int, LoRAWeights] = field(default_factory=OrderedDict)

    def get(self, request: LoRARequest) -> LoRAWeights:
        if not isinstance(request, LoRARequest):
            raise LoRAError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
        loaded = self._loaded.get(request.lora_int_id)
        if loaded is not None:
            if (loaded.name, loaded.path) != (request.lora_name, request.lora_path):
                raise LoRAError(
                    f"lora_int_id {request.lora_int_id} is adapter {loaded.name!r} ({loaded.path}); "
                    f"got {request.lora_name!r} ({request.lora_path}): one id per adapter"
                )
            self._loaded.move_to_end(request.lora_int_id)
            return loaded
        for other in self._loaded.values():
            if other.name == request.lora_name:
                raise LoRAError(
                    f"LoRA adapter name {request.lora_name!r} is already lora_int_id {other.int_id}; "
                    f"got id {request.lora_int_id}"
                )
        weights = load_lora_adapter(request, config=self.config, max_rank=self.max_rank, device=self.device)
        self._loaded[request.lora_int_id] = weights
        while len(self._loaded) > self.capacity:
            self._loaded.popitem(last=False)
        return weights

    def remove(self, int_id: int) -> bool:
        return self._loaded.pop(int_id, None) is not None

    def ids(self) -> list[int]:
        return list(self._loaded)


def write_random_adapter(out: Path, *, config: ModelConfig, rank: int, b_std: float, seed: int) -> Path:
    """A PEFT LoRA directory of random weights on every projection of a target of `config`
    (A ~ N(0, 1/K), B ~ N(0, b_std)): what benchmarks and tests run where no trained adapter of
    the target is at hand.  Returns `out`."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for module, (width_in, width_out, _) in _site_shapes(config).items():
            block = "mlp" if _MODULE_SITES[module] in ("gate_up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, width_in, generator=generator) / width_in**0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(width_out, rank, generator=generator) * b_std
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    settings = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(_site_shapes(config))}
    (out / "adapter_config.json").write_text(json.dumps(settings))
    return out
