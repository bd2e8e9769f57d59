"""EAGLE-3 heads trained elsewhere: the vLLM project's `speculators` format and SpecForge's.

Both hold the same network (the EAGLE-3 paper's, as SpecForge trains it and vLLM serves it):

- ``fc`` [D, n * D] fuses the target's hidden states at n layers (``eagle_aux_hidden_state_layer_ids``:
  hidden-state indices, 0 = the embeddings, i = the output of layer i - 1);
- one decoder layer (Llama's, or Qwen3's with q/k norms) whose q/k/v projections read
  ``cat([input_layernorm(embedding), hidden_norm(feature)])`` [2D]; the residual is the feature
  (or, with ``norm_before_residual``, its normed form); then o_proj, post_attention_layernorm
  and the SiLU MLP as usual;
- ``norm`` and its own ``lm_head`` [Vd, D] over a draft vocabulary, ``d2t`` [Vd] the offsets
  to target ids (target id = draft id + d2t[draft id]);
- the token embedding: the checkpoint's ``embed_tokens`` when it has one, else the target's
  (unscaled, as those heads were trained, also beside Gemma).

Files: `speculators` writes ``config.json`` with ``speculators_model_type: "eagle3"``, the
layer's config under ``transformer_layer_config`` and weights named ``layers.0.*``; SpecForge
writes a flat Llama config with ``architectures: ["LlamaForCausalLMEagle3"]`` and ``midlayer.*``.
Heads with more than one layer, or the variants that norm the fused input (``norm_before_fc``,
``fc_norm``) or feed normed outputs back (``norm_output``), are refused with a clear error.

`Eagle3Head` offers the pieces every feature head offers (quickdraft.models.heads.FeatureHead),
so the eagle drafter drives it as it drives our own heads.  Its ``input_hidden`` returns
``[normed embedding, normed feature, residual]`` side by side [3D]: the attention reads the
first 2D, the block's residual the last D.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from quickdraft.models.config import RopeConfig, _rope_from_params
from quickdraft.models.heads import FeatureHead, HeadConfig
from quickdraft.models.layers import RMSNorm, RotaryTable, apply_rotary
from quickdraft.models.loader import read_hf_config, read_hf_tensors
from quickdraft.models.quantized import QuantizedWeight, embedding_rows, quantize_legacy

SPECFORGE_ARCHITECTURE = "LlamaForCausalLMEagle3"
LAYER_TYPES = ("llama", "qwen3")
UNSUPPORTED_FLAGS = ("norm_before_fc", "fc_norm", "norm_output")
DRAFT_MATRICES = ("fc", "qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")


@dataclass(frozen=True)
class Eagle3Format:
    """What an EAGLE-3 checkpoint's config says, in one shape for both formats."""

    layer_type: str  # "llama" | "qwen3" (Qwen3 adds q/k norms)
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope: RopeConfig
    draft_vocab_size: int
    target_vocab_size: int
    aux_layer_ids: tuple[int, ...] | None  # hidden-state indices; None: the default for the target
    norm_before_residual: bool
    weight_prefix: str  # "layers.0." (speculators) or "midlayer." (SpecForge)

    def feature_layers(self, target_num_layers: int) -> tuple[int, ...]:
        """Our feature layers (layer outputs) for the hidden-state indices the head reads."""
        ids = self.aux_layer_ids or (2, target_num_layers // 2, target_num_layers - 3)
        bad = [i for i in ids if not 1 <= i <= target_num_layers]
        if bad:
            raise ValueError(
                f"EAGLE-3 head reads hidden states {list(ids)}: {bad} outside 1..{target_num_layers} "
                f"(the target's layer outputs; 0, the embeddings, is not supported)"
            )
        return tuple(i - 1 for i in ids)


def detect_eagle3_format(directory: Path) -> Eagle3Format | None:
    """The checkpoint's EAGLE-3 config when `directory` holds one in either format, else None."""
    if not (directory / "config.json").is_file():
        return None
    hf = read_hf_config(directory)
    if hf.get("speculators_model_type") == "eagle3":
        layer = dict(hf.get("transformer_layer_config") or {})
        _check_supported(hf, layer, directory)
        return _format(layer, hf, prefix="layers.0.", layer_type=layer.get("model_type", "llama"))
    if SPECFORGE_ARCHITECTURE in (hf.get("architectures") or []):
        _check_supported(hf, hf, directory)
        return _format(hf, hf, prefix="midlayer.", layer_type="llama")
    return None


def _check_supported(hf: dict, layer: dict, directory: Path) -> None:
    used = [flag for flag in UNSUPPORTED_FLAGS if hf.get(flag)]
    if used:
        raise ValueError(f"EAGLE-3 head in {directory} uses {used}: not supported (plain EAGLE-3 heads only)")
    if int(layer.get("num_hidden_layers", 1)) != 1:
        raise ValueError(
            f"EAGLE-3 head in {directory} has {layer.get('num_hidden_layers')} layers: "
            "only one-layer heads are supported"
        )
    if layer.get("model_type", "llama") not in LAYER_TYPES:
        raise ValueError(
            f"EAGLE-3 head in {directory}: layer type {layer.get('model_type')!r} is not one of {LAYER_TYPES}"
        )
    if layer.get("attention_bias") or layer.get("mlp_bias"):
        raise ValueError(f"EAGLE-3 head in {directory} has biases: not supported")
    if layer.get("hidden_act", "silu") != "silu":
        raise ValueError(f"EAGLE-3 head in {directory}: hidden_act {layer.get('hidden_act')!r} is not silu")
    if hf.get("target_hidden_size") not in (None, layer.get("hidden_size")):
        raise ValueError(f"EAGLE-3 head in {directory}: a draft hidden size other than the target's is not supported")


def _format(layer: dict, hf: dict, *, prefix: str, layer_type: str) -> Eagle3Format:
    num_heads = int(layer["num_attention_heads"])
    hidden = int(layer["hidden_size"])
    rope_params = layer.get("rope_parameters")
    if rope_params is None:  # transformers 4.x spelling
        rope_params = {**(layer.get("rope_scaling") or {}), "rope_theta": layer.get("rope_theta", 10_000.0)}
    aux = hf.get("eagle_aux_hidden_state_layer_ids")
    return Eagle3Format(
        layer_type=layer_type,
        hidden_size=hidden,
        num_heads=num_heads,
        num_kv_heads=int(layer.get("num_key_value_heads") or num_heads),
        head_dim=int(layer.get("head_dim") or hidden // num_heads),
        intermediate_size=int(layer["intermediate_size"]),
        rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
        rope=_rope_from_params(rope_params, 10_000.0),
        draft_vocab_size=int(hf.get("draft_vocab_size") or layer["vocab_size"]),
        target_vocab_size=int(layer.get("vocab_size") or hf.get("vocab_size")),
        aux_layer_ids=None if aux is None else tuple(int(i) for i in aux),
        norm_before_residual=bool(hf.get("norm_before_residual", False)),
        weight_prefix=prefix,
    )


class Eagle3Head(FeatureHead):
    def __init__(
        self,
        fmt: Eagle3Format,
        *,
        feature_layers: tuple[int, ...],
        dtype: torch.dtype = torch.float32,
        max_len: int = 4096,
    ):
        super().__init__()
        self.format = f = fmt
        D = f.hidden_size
        self.config = HeadConfig(
            hidden_size=D,
            num_heads=f.num_heads,
            num_kv_heads=f.num_kv_heads,
            head_dim=f.head_dim,
            intermediate_size=f.intermediate_size,
            feature_layers=feature_layers,
            draft_vocab_size=f.draft_vocab_size,
            rope_theta=f.rope.theta,
            rms_norm_eps=f.rms_norm_eps,
            activation="silu",
        )

        def matrix(rows: int, cols: int) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.zeros(rows, cols, dtype=dtype), requires_grad=False)

        def norm(width: int = D) -> RMSNorm:
            return RMSNorm((width,), eps=f.rms_norm_eps, unit_offset=False, dtype=dtype)

        self.fc = matrix(D, len(feature_layers) * D)
        self.input_layernorm, self.hidden_norm = norm(), norm()
        self.qkv_proj = matrix((f.num_heads + 2 * f.num_kv_heads) * f.head_dim, 2 * D)
        # Qwen3's q_norm and k_norm as one norm over the q and k heads (a weight row per head).
        self.qk_norm = (
            RMSNorm((f.num_heads + f.num_kv_heads, f.head_dim), eps=f.rms_norm_eps, unit_offset=False, dtype=dtype)
            if f.layer_type == "qwen3"
            else None
        )
        self.o_proj = matrix(D, f.num_heads * f.head_dim)
        self.post_attention_layernorm = norm()
        self.gate_up_proj = matrix(2 * f.intermediate_size, D)
        self.down_proj = matrix(D, f.intermediate_size)
        self.norm = norm()
        self.lm_head = matrix(f.draft_vocab_size, D)
        self.register_buffer("d2t", torch.zeros(f.draft_vocab_size, dtype=torch.long))  # [Vd] target ids
        self.register_buffer("own_embedding", torch.zeros(0, D, dtype=dtype))  # [V, D] when the head has one
        self.max_len = max_len
        self.rotary = RotaryTable(f.rope, head_dim=f.head_dim, max_len=max_len, dtype=dtype)
        self.embed_tokens: torch.Tensor | QuantizedWeight | None = None  # [V, D], set by attach_target
        self.t2d = None
        self.draft_weights: dict[str, QuantizedWeight] = {}

    @property
    def attn_scale(self) -> float:
        return self.format.head_dim**-0.5

    def attach_target(self, target) -> None:
        """The token embedding: the head's own, else the target's (unscaled, as EAGLE-3 reads it)."""
        if self.own_embedding.shape[0]:
            self.embed_tokens = self.own_embedding
        else:
            if self.format.target_vocab_size != target.config.vocab_size:
                raise ValueError(
                    f"EAGLE-3 head was trained for a {self.format.target_vocab_size}-token vocabulary; "
                    f"the target has {target.config.vocab_size}"
                )
            self.embed_tokens = target.embed_tokens.detach()

    def quantize_for_drafting(self, format: str = "Q8_0") -> None:
        """Draft with `format` (Q8_0, Q5_0, Q4_0) copies of the head's matrices (float32 elsewhere)."""
        self.draft_weights = {
            name: QuantizedWeight.from_parts([quantize_legacy(getattr(self, name), format)]) for name in DRAFT_MATRICES
        }

    def _matrix(self, name: str):
        return self.draft_weights.get(name, getattr(self, name))

    def weights_per_draft_token(self) -> int:
        return sum(getattr(self, name).numel() for name in DRAFT_MATRICES if name != "fc")

    # ---- the pieces the eagle drafter drives ---------------------------------------------------
    def fuse_features(self, features: torch.Tensor) -> torch.Tensor:  # [..., n * D] -> [..., D]
        return self.linear(features, self._matrix("fc"), None)

    def input_hidden(self, token_ids: torch.Tensor, feature: torch.Tensor) -> torch.Tensor:
        # token_ids [...], feature [..., D] -> [..., 3D]: normed embedding, normed feature, residual
        embedded = embedding_rows(self.embed_tokens, token_ids).to(feature.dtype)
        normed = self.hidden_norm(feature)
        residual = normed if self.format.norm_before_residual else feature
        return torch.cat([self.input_layernorm(embedded), normed, residual], dim=-1)

    def attention_inputs(self, hidden: torch.Tensor, positions: torch.Tensor):
        # hidden [N, 3D], positions [N] -> q [N, H, hd], k and v [N, Hkv, hd]
        f = self.format
        qkv = self.linear(hidden[:, : 2 * f.hidden_size].contiguous(), self._matrix("qkv_proj"), None)
        qkv = qkv.view(hidden.shape[0], f.num_heads + 2 * f.num_kv_heads, f.head_dim)
        qk, v = qkv.split([f.num_heads + f.num_kv_heads, f.num_kv_heads], dim=1)
        if self.qk_norm is not None:
            qk = self.qk_norm(qk)
        q, k = apply_rotary(qk, *self.rotary.lookup(positions)).split([f.num_heads, f.num_kv_heads], dim=1)
        return q, k, v

    def block_output(self, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        # hidden [N, 3D] (from input_hidden), attended [N, H * hd] -> [N, D]
        hidden = hidden[:, 2 * self.format.hidden_size :] + self.linear(attended, self._matrix("o_proj"), None)
        x = self.post_attention_layernorm(hidden)
        gate, up = self.linear(x, self._matrix("gate_up_proj"), None).chunk(2, dim=-1)
        return hidden + self.linear(F.silu(gate) * up, self._matrix("down_proj"), None)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., D] -> [..., Vd]
        return self.linear(self.norm(hidden), self._matrix("lm_head"), None)

    # ---- files -------------------------------------------------------------------------------
    @classmethod
    def load(
        cls,
        directory: str | Path,
        *,
        target_num_layers: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        max_len: int = 4096,
    ) -> Eagle3Head:
        directory = Path(directory)
        fmt = detect_eagle3_format(directory)
        if fmt is None:
            raise ValueError(f"{directory} holds no EAGLE-3 head in the speculators or SpecForge format")
        head = cls(fmt, feature_layers=fmt.feature_layers(target_num_layers), dtype=dtype, max_len=max_len)
        tensors = read_hf_tensors(directory)
        state = _head_state(fmt, tensors, directory)
        own = head.state_dict()
        for name, tensor in state.items():
            if name == "own_embedding":
                head.own_embedding = tensor.to(dtype)
                continue
            if own[name].shape != tensor.shape:
                raise ValueError(
                    f"EAGLE-3 tensor for {name} in {directory} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(own[name].shape)}"
                )
            own[name].copy_(tensor)
        return head.to(device).eval()


def _head_state(fmt: Eagle3Format, tensors: dict[str, torch.Tensor], directory: Path) -> dict[str, torch.Tensor]:
    """Our parameter names -> the checkpoint's tensors (q/k/v and gate/up fused)."""
    p = fmt.weight_prefix

    def take(name: str) -> torch.Tensor:
        if name not in tensors:
            raise ValueError(f"EAGLE-3 head in {directory} lacks the tensor {name!r}")
        return tensors[name]

    state = {
        "fc": take("fc.weight"),
        "input_layernorm.weight": take(p + "input_layernorm.weight"),
        "hidden_norm.weight": take(p + "hidden_norm.weight"),
        "qkv_proj": torch.cat([take(p + f"self_attn.{x}_proj.weight") for x in "qkv"]),
        "o_proj": take(p + "self_attn.o_proj.weight"),
        "post_attention_layernorm.weight": take(p + "post_attention_layernorm.weight"),
        "gate_up_proj": torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]),
        "down_proj": take(p + "mlp.down_proj.weight"),
        "norm.weight": take("norm.weight"),
        "lm_head": take("lm_head.weight"),
    }
    if fmt.layer_type == "qwen3":
        q_norm, k_norm = take(p + "self_attn.q_norm.weight"), take(p + "self_attn.k_norm.weight")
        state["qk_norm.weight"] = torch.cat(
            [q_norm.expand(fmt.num_heads, fmt.head_dim), k_norm.expand(fmt.num_kv_heads, fmt.head_dim)]
        )
    offsets = tensors.get("d2t")
    size = fmt.draft_vocab_size
    if offsets is None:
        if size != fmt.target_vocab_size:
            raise ValueError(f"EAGLE-3 head in {directory} drafts over {size} ids but has no d2t map")
        offsets = torch.zeros(size, dtype=torch.long)
    state["d2t"] = torch.arange(size) + offsets.long()
    if "embed_tokens.weight" in tensors:
        state["own_embedding"] = tensors["embed_tokens.weight"]
    return state
