"""ModelConfig: the one description the config-driven decoder is built from.

It is parsed from a HuggingFace ``config.json`` dict.  Every architecture we support is a
set of switches on the same decoder (norm style, activation, biases, q/k norm, sandwich
norms, embedding scale, sliding-window layers, rope flavour), so adding an architecture
means adding a parser branch here, never a new model file.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace

SUPPORTED_MODEL_TYPES = (
    "gemma2",
    "gpt_oss",
    "gemma3_text",
    "gemma3",
    "llama",
    "mistral",
    "phi3",
    "qwen2",
    "qwen3",
    "qwen2_moe",
    "qwen3_moe",
    "mixtral",
    "smollm3",
)

# Llama-shaped models whose `sliding_window` (when set) applies to every layer, as transformers
# reads them; Qwen2/3 gate theirs behind `use_sliding_window`.
_WINDOW_WHEN_SET = ("mistral", "mixtral", "phi3")
ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn", "none")


def moe_router_name(model_type: str) -> str:
    """A mixture's router under its MLP block: gpt-oss's `router` (with a bias), the others' `gate`."""
    return "router" if model_type == "gpt_oss" else "gate"


def moe_hf_names(model_type: str) -> tuple[str, tuple[str, str, str]]:
    """A mixture-of-experts checkpoint's names: (the MLP block, its experts' gate/up/down), Mixtral's
    (block_sparse_moe, w1/w3/w2) or Qwen2/3-MoE's (mlp, gate_proj/up_proj/down_proj)."""
    if model_type == "mixtral":
        return "block_sparse_moe", ("w1", "w3", "w2")
    return "mlp", ("gate_proj", "up_proj", "down_proj")


# A checkpoint tensor holding query/key rows: `hf_row_order` may reorder them.
_HEAD_ROWS = re.compile(r"layers\.(?P<layer>\d+)\.self_attn\.(?P<proj>q|k|qkv)_proj\.(?:weight|bias)$")

FULL_ATTENTION = "full_attention"
# The rotary kind of a layer that does not rotate (SmolLM3's NoPE layers): frequency 0, an identity.
NO_ROPE = "no_rope"
SLIDING_ATTENTION = "sliding_attention"


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"  # one of ROPE_TYPES
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # The fraction of each head's dimensions that rotate (Phi-4-mini: 0.75); the rest pass through.
    partial_rotary_factor: float = 1.0
    # LongRoPE (Phi-3/3.5/4): per-frequency divisors for contexts up to / past the original length,
    # and the factor cos and sin are scaled by (None: derived from `factor`, as transformers does).
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float | None = None
    # YaRN (Qwen2.5/Qwen3 long context, DeepSeek): frequencies past `beta_fast` rotations over the
    # original context keep their speed, those under `beta_slow` are slowed by `factor`, a linear
    # ramp between (its ends rounded outwards where `truncate`); cos and sin scaled by attention_factor.
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"unsupported rope_type {self.rope_type!r}: supported are {', '.join(ROPE_TYPES)}")
        if self.theta <= 0:
            raise ValueError(f"rope theta must be positive, got {self.theta}")
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise ValueError(f"partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor}")
        if self.rope_type == "longrope" and (not self.short_factor or len(self.short_factor) != len(self.long_factor)):
            raise ValueError(
                "longrope needs short_factor and long_factor lists of one length "
                f"(got {len(self.short_factor)} and {len(self.long_factor)})"
            )

    def rotary_dim(self, head_dim: int) -> int:
        """How many of a head's dimensions rotate (even, as transformers and llama.cpp take it)."""
        return int(head_dim * self.partial_rotary_factor) // 2 * 2

    def dim_order(self, head_dim: int) -> list[int] | None:
        """Our head dimension j holds the checkpoint's dimension order[j] (None: the same layout).

        A checkpoint with partial rotary rotates pairs (i, i + R/2) of its first R dimensions and
        passes the rest through; our kernels rotate pairs (j, j + D/2) of all D. Laying the rotated
        halves at [0, R/2) and [D/2, D/2 + R/2) and the pass-through dimensions in the remaining
        places (frequency 0 there: cos 1, sin 0) computes the same attention: q and k move alike,
        and a dot product does not depend on the order of its dimensions.
        """
        rotary_dim = self.rotary_dim(head_dim)
        if rotary_dim == head_dim:
            return None
        half, rotary_half = head_dim // 2, rotary_dim // 2
        passing = list(range(rotary_dim, head_dim))
        return (
            list(range(rotary_half))
            + passing[: half - rotary_half]
            + list(range(rotary_half, rotary_dim))
            + passing[half - rotary_half :]
        )


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    activation: str  # "gelu_tanh" | "silu" | "swiglu_oai" (gpt-oss: clamped, gate * sigmoid(alpha gate) * (up + 1))
    layer_types: tuple[str, ...]
    rope_by_layer_type: dict[str, RopeConfig]
    attn_scale: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sandwich_norms: bool = False  # Gemma: extra norms after attention and after the MLP
    norm_unit_offset: bool = False  # Gemma's RMSNorm multiplies by (1 + weight)
    embed_scale: float | None = None  # Gemma scales embeddings by sqrt(hidden_size)
    # Sliding layers see keys with key > query - sliding_window; under bidirectional attention
    # (EmbeddingGemma: an encoder, every token sees the whole prompt) |query - key| < sliding_window.
    sliding_window: int | None = None
    bidirectional_attention: bool = False
    # A base model saved without its LM head (its embeddings not tied): it embeds, it cannot generate;
    # the decoder ties a head to the embeddings that nothing reads.
    embedding_only: bool = False
    # A *ForSequenceClassification checkpoint (a reranker, a classifier): a `score` head of
    # num_labels rows reads the last token's final state; it classifies, it does not generate.
    num_labels: int = 0
    labels: tuple[str, ...] = ()  # id2label, in label order
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None  # Gemma 2: scores capped by c * tanh(score / c)
    # Phi-3 stores q/k/v as one qkv_proj and gate/up as one gate_up_proj (our fused layout already).
    fused_projections: bool = False
    no_rope_layers: tuple[int, ...] = ()  # layers whose attention has no rotary embedding (SmolLM3)
    # Mixture of experts (Qwen2/3-MoE, Mixtral): in `moe_layers` the MLP is `num_experts` experts of
    # width `moe_intermediate_size`, a router picking `experts_per_token` of them per token, their
    # weights renormalised to sum to 1 where `moe_renormalize` (Mixtral; Qwen-MoE's norm_topk_prob).
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    moe_layers: tuple[int, ...] = ()
    moe_renormalize: bool = True
    # Qwen2-MoE: beside the routed experts, a shared expert of this width that every row takes,
    # its output scaled by sigmoid(x . shared_expert_gate) where `shared_expert_gated` (0: none).
    shared_expert_intermediate_size: int = 0
    shared_expert_gated: bool = False
    # gpt-oss: a bias on the router's logits and on every expert's gate_up and down; the "swiglu_oai"
    # activation's clamp and sigmoid slope; a learned sink logit per query head in every softmax.
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    attention_sinks: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        for layer_type in self.layer_types:
            if layer_type not in (FULL_ATTENTION, SLIDING_ATTENTION):
                raise ValueError(f"unsupported layer type {layer_type!r}")
            if layer_type not in self.rope_by_layer_type:
                raise ValueError(f"no rope parameters for layer type {layer_type!r}")
        for rope in self.rope_by_layer_type.values():
            pairs = rope.rotary_dim(self.head_dim) // 2
            if rope.rope_type == "longrope" and len(rope.short_factor) != pairs:
                raise ValueError(
                    f"longrope has {len(rope.short_factor)} factors; {pairs} rotated dimension pairs need {pairs}"
                )
        if self.qk_norm and any(r.rotary_dim(self.head_dim) < self.head_dim for r in self.rope_by_layer_type.values()):
            raise ValueError("q/k norms with partial rotary embeddings are not supported")
        if any(not 0 <= layer < self.num_layers for layer in self.no_rope_layers):
            raise ValueError(f"no_rope_layers {self.no_rope_layers} name layers the model lacks ({self.num_layers})")
        if self.moe_layers:
            if not 1 <= self.experts_per_token <= self.num_experts or self.moe_intermediate_size <= 0:
                raise ValueError(
                    f"a mixture of experts needs 1 <= experts per token ({self.experts_per_token}) <= experts "
                    f"({self.num_experts}) and a positive expert width ({self.moe_intermediate_size})"
                )
            if any(not 0 <= layer < self.num_layers for layer in self.moe_layers):
                raise ValueError(f"moe_layers {self.moe_layers} name layers the model lacks ({self.num_layers})")
            if self.mlp_bias:
                raise ValueError("MLP biases with a mixture of experts are not supported")
            if self.shared_expert_intermediate_size < 0:
                raise ValueError(
                    f"shared_expert_intermediate_size must be >= 0, got {self.shared_expert_intermediate_size}"
                )
        if SLIDING_ATTENTION in self.layer_types and not self.sliding_window:
            raise ValueError("sliding_attention layers need a positive sliding_window")
        if self.activation not in ("gelu_tanh", "silu", "swiglu_oai"):
            raise ValueError(f"unsupported activation {self.activation!r}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def hf_row_order(self, hf_name: str) -> list[int] | None:
        """Which row of the checkpoint tensor `hf_name` each of our rows takes (None: the same).

        Only query and key rows of a partial-rotary model move (`RopeConfig.dim_order`, per
        head); every loader path (float, quantized, LoRA) reorders through here.
        """
        match = _HEAD_ROWS.search(hf_name)
        if match is None:
            return None
        layer = int(match["layer"])
        layer_type = self.layer_types[min(layer, self.num_layers - 1)]
        order = self.rope_by_layer_type[layer_type].dim_order(self.head_dim)
        if order is None:
            return None
        heads = {"q": self.num_heads, "k": self.num_kv_heads, "qkv": self.num_heads + self.num_kv_heads}
        rows = [head * self.head_dim + dim for head in range(heads[match["proj"]]) for dim in order]
        if match["proj"] == "qkv":  # the value rows keep their place
            rows += range(len(rows), len(rows) + self.kv_size)
        return rows

    def rotary_key(self, layer: int) -> str:
        """Which rotary table layer `layer` reads: its attention type's, or NO_ROPE's."""
        return NO_ROPE if layer in self.no_rope_layers else self.layer_types[layer]

    @property
    def rotary_keys(self) -> list[str]:
        """The rotary tables the layers read, in first-use order."""
        return list(dict.fromkeys(self.rotary_key(layer) for layer in range(self.num_layers)))

    def rope_for(self, rotary_key: str) -> RopeConfig:
        return RopeConfig(theta=1.0, rope_type="none") if rotary_key == NO_ROPE else self.rope_by_layer_type[rotary_key]

    @property
    def layer_windows(self) -> list[int | None]:
        """Per layer, the positions its attention sees (None: all), for the KV cache's groups."""
        return [self.sliding_window if t == SLIDING_ATTENTION else None for t in self.layer_types]

    @classmethod
    def from_hf_dict(cls, hf: dict) -> ModelConfig:
        model_type = hf.get("model_type")
        if model_type == "gemma3" and "text_config" in hf:
            # A multimodal Gemma 3 checkpoint: we serve its text decoder only.
            hf = {**hf["text_config"], "model_type": "gemma3_text"}
            model_type = "gemma3_text"
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported architecture model_type={model_type!r} "
                f"(architectures={hf.get('architectures')}); quickdraft supports "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        parser = _gemma_fields if model_type.startswith("gemma") else _llama_family_fields
        fields = {**_common_fields(hf), **parser(hf, model_type), **_classifier_fields(hf)}
        if hf.get("use_bidirectional_attention") and not fields.get("bidirectional_attention"):
            raise ValueError(
                f"use_bidirectional_attention is supported for Gemma 3 encoders (EmbeddingGemma), not {model_type}"
            )
        return cls(**fields)


def _classifier_fields(hf: dict) -> dict:
    """num_labels and labels of a *ForSequenceClassification config (none for a language model)."""
    architectures = hf.get("architectures") or []
    if not any(isinstance(a, str) and a.endswith("ForSequenceClassification") for a in architectures):
        return {}
    id2label = hf.get("id2label") or {}
    num_labels = len(id2label) or int(hf.get("num_labels", 2))
    labels = tuple(str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(num_labels))
    return {"num_labels": num_labels, "labels": labels}


def _require(hf: dict, key: str):
    if key not in hf or hf[key] is None:
        raise ValueError(f"config.json is missing the required field {key!r}")
    return hf[key]


def _common_fields(hf: dict) -> dict:
    num_heads = int(_require(hf, "num_attention_heads"))
    hidden = int(_require(hf, "hidden_size"))
    head_dim = hf.get("head_dim") or hidden // num_heads
    eos = hf.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    return dict(
        vocab_size=int(_require(hf, "vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(_require(hf, "intermediate_size")),
        num_layers=int(_require(hf, "num_hidden_layers")),
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 8192)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )


def _rope_from_params(params: dict | None, default_theta: float) -> RopeConfig:
    params = dict(params or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "su":  # the first Phi-3 128k checkpoints' name for longrope
        rope_type = "longrope"
    kwargs = dict(theta=float(params.get("rope_theta", default_theta)), rope_type=rope_type)
    for key in ("factor", "low_freq_factor", "high_freq_factor", "partial_rotary_factor", "beta_fast", "beta_slow"):
        if params.get(key) is not None:
            kwargs[key] = float(params[key])
    if params.get("attention_factor") is not None:
        kwargs["attention_factor"] = float(params["attention_factor"])
    for key in ("short_factor", "long_factor"):
        if params.get(key) is not None:
            kwargs[key] = tuple(float(value) for value in params[key])
    if params.get("truncate") is not None:
        kwargs["truncate"] = bool(params["truncate"])
    if "original_max_position_embeddings" in params:
        kwargs["original_max_position_embeddings"] = int(params["original_max_position_embeddings"])
    return RopeConfig(**kwargs)


def _gemma_fields(hf: dict, model_type: str) -> dict:
    """Gemma 2 and 3: sandwich norms, (1 + w) norms, scaled embeddings, a tied head. Gemma 3 adds
    q/k norms and a rope per layer type; Gemma 2 soft-caps its attention scores instead, and
    alternates sliding and global layers."""
    if model_type == "gemma2":
        return _gemma3_fields(hf, model_type) | dict(
            model_type="gemma2",
            qk_norm=False,
            attn_logit_softcapping=hf.get("attn_logit_softcapping"),
        )
    if hf.get("attn_logit_softcapping"):
        raise ValueError("attn_logit_softcapping is not supported for Gemma 3 (it does not use it)")
    return _gemma3_fields(hf, model_type)


def _gemma3_fields(hf: dict, model_type: str) -> dict:
    num_layers = int(hf["num_hidden_layers"])
    default_pattern = 2 if model_type == "gemma2" else 6
    pattern = int(hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", default_pattern)))
    layer_types = hf.get("layer_types") or [
        SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(num_layers)
    ]
    rope_params = hf.get("rope_parameters") or {}
    if FULL_ATTENTION in rope_params or SLIDING_ATTENTION in rope_params:
        full = _rope_from_params(rope_params.get(FULL_ATTENTION), 1_000_000.0)
        local = _rope_from_params(rope_params.get(SLIDING_ATTENTION), 10_000.0)
    elif rope_params:  # one rope for every layer (Gemma 2 as transformers >= 5 writes it)
        full = local = _rope_from_params(rope_params, 10_000.0)
    else:  # transformers 4.x spelling
        full = _rope_from_params(
            {**(hf.get("rope_scaling") or {}), "rope_theta": hf.get("rope_theta", 1_000_000.0)},
            1_000_000.0,
        )
        # Gemma 2 rotates every layer alike (rope_theta); Gemma 3's local layers have their own base
        default_local = hf.get("rope_theta", 10_000.0) if model_type == "gemma2" else 10_000.0
        local = RopeConfig(theta=float(hf.get("rope_local_base_freq", default_local)))
    hidden = int(hf["hidden_size"])
    bidirectional = bool(hf.get("use_bidirectional_attention"))
    window = hf.get("sliding_window")
    if bidirectional and window:
        # config.json holds the whole span; a token sees |query - key| <= span / 2 (transformers
        # and llama.cpp's symmetric window alike)
        window = int(window) // 2 + 1
    return dict(
        model_type="gemma3_text",
        activation="gelu_tanh",
        layer_types=tuple(layer_types),
        rope_by_layer_type={FULL_ATTENTION: full, SLIDING_ATTENTION: local},
        attn_scale=float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
        qkv_bias=bool(hf.get("attention_bias", False)),
        o_bias=bool(hf.get("attention_bias", False)),
        qk_norm=True,
        sandwich_norms=True,
        norm_unit_offset=True,
        embed_scale=math.sqrt(hidden),
        sliding_window=window,
        bidirectional_attention=bidirectional,
        final_logit_softcapping=hf.get("final_logit_softcapping"),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
    )


def _llama_family_fields(hf: dict, model_type: str) -> dict:
    num_layers = int(hf["num_hidden_layers"])
    if model_type == "gpt_oss":
        return _gpt_oss_fields(hf, num_layers)
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"unsupported hidden_act {act!r} for {model_type}")
    rope_params = hf.get("rope_parameters")
    if rope_params is None:  # transformers 4.x spelling
        rope_params = {**(hf.get("rope_scaling") or {}), "rope_theta": hf.get("rope_theta", 10_000.0)}
    # transformers 4.x kept these beside rope_scaling, at the top level (Phi-3, Phi-4-mini)
    rope_params = {
        key: hf[key] for key in ("partial_rotary_factor", "original_max_position_embeddings") if hf.get(key) is not None
    } | rope_params
    rope = _rope_from_params(rope_params, 10_000.0)
    if rope.rope_type == "longrope":
        rope = _longrope_resolved(rope, hf, factor_given=rope_params.get("factor") is not None)
    if rope.rope_type == "yarn":
        rope = _yarn_resolved(rope, rope_params, hf)
    windowed = hf.get("use_sliding_window", False) or (
        model_type in _WINDOW_WHEN_SET and bool(hf.get("sliding_window"))
    )
    layer_types = hf.get("layer_types") or [SLIDING_ATTENTION if windowed else FULL_ATTENTION] * num_layers
    if not windowed:
        layer_types = [FULL_ATTENTION] * num_layers
    attention_bias = bool(hf.get("attention_bias", False))
    head_dim = int(hf.get("head_dim") or int(hf["hidden_size"]) // int(hf["num_attention_heads"]))
    return dict(
        model_type=model_type,
        activation="silu",
        layer_types=tuple(layer_types),
        rope_by_layer_type={FULL_ATTENTION: rope, SLIDING_ATTENTION: rope},
        attn_scale=head_dim**-0.5,
        # Qwen2 always has q/k/v biases and no o_proj bias; Llama/Qwen3 follow attention_bias.
        qkv_bias=True if model_type in ("qwen2", "qwen2_moe") else attention_bias,
        o_bias=False if model_type in ("qwen2", "qwen2_moe") else attention_bias,
        mlp_bias=bool(hf.get("mlp_bias", False)),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        sliding_window=hf.get("sliding_window") if windowed else None,
        fused_projections=model_type == "phi3",
        no_rope_layers=_no_rope_layers(hf, num_layers) if model_type == "smollm3" else (),
        **_moe_fields(hf, model_type, num_layers),
    )


def _gpt_oss_fields(hf: dict, num_layers: int) -> dict:
    """gpt-oss: sliding-window and full layers in turn (its layer_types), q/k/v/o biases, a sink
    logit per head, YaRN, and in every layer a mixture whose router and experts have biases, the
    experts intermediate_size wide with the clamped "swiglu_oai" activation."""
    rope = _rope_from_params(
        hf.get("rope_parameters") or {**(hf.get("rope_scaling") or {}), "rope_theta": hf.get("rope_theta", 150000.0)},
        150000.0,
    )
    if rope.rope_type == "yarn":
        rope = _yarn_resolved(rope, hf.get("rope_parameters") or hf.get("rope_scaling") or {}, hf)
    layer_types = hf.get("layer_types") or [
        SLIDING_ATTENTION if i % 2 == 0 else FULL_ATTENTION for i in range(num_layers)
    ]
    head_dim = int(hf.get("head_dim") or int(hf["hidden_size"]) // int(hf["num_attention_heads"]))
    return dict(
        model_type="gpt_oss",
        activation="swiglu_oai",
        layer_types=tuple(layer_types),
        rope_by_layer_type={FULL_ATTENTION: rope, SLIDING_ATTENTION: rope},
        attn_scale=head_dim**-0.5,
        qkv_bias=bool(hf.get("attention_bias", True)),
        o_bias=bool(hf.get("attention_bias", True)),
        sliding_window=hf.get("sliding_window"),
        num_experts=int(_require(hf, "num_local_experts")),
        experts_per_token=int(_require(hf, "num_experts_per_tok")),
        moe_intermediate_size=int(_require(hf, "intermediate_size")),
        moe_layers=tuple(range(num_layers)),
        # top-k of the logits then their softmax: the top-k of the softmax, renormalised
        moe_renormalize=True,
        router_bias=True,
        expert_bias=True,
        swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
        swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
        attention_sinks=True,
    )


def _moe_fields(hf: dict, model_type: str, num_layers: int) -> dict:
    """The mixture-of-experts switches: Mixtral's experts in every layer (intermediate_size wide,
    weights renormalised); Qwen2/3-MoE's every decoder_sparse_step-th layer but mlp_only_layers,
    Qwen2-MoE's with a gated shared expert beside them."""
    if model_type == "mixtral":
        experts, width, layers, renormalize = (
            int(_require(hf, "num_local_experts")),
            hf["intermediate_size"],
            range(num_layers),
            True,
        )
    elif model_type in ("qwen2_moe", "qwen3_moe"):
        # published configs say num_experts; transformers >= 5 writes num_local_experts
        experts = int(hf.get("num_experts") or _require(hf, "num_local_experts"))
        width = _require(hf, "moe_intermediate_size")
        step, dense = int(hf.get("decoder_sparse_step") or 1), set(hf.get("mlp_only_layers") or ())
        layers = [i for i in range(num_layers) if i not in dense and experts > 0 and (i + 1) % step == 0]
        renormalize = bool(hf.get("norm_topk_prob", False))
    else:
        return {}
    shared = int(hf.get("shared_expert_intermediate_size") or 0) if model_type == "qwen2_moe" else 0
    return dict(
        shared_expert_intermediate_size=shared,
        shared_expert_gated=shared > 0,
        num_experts=experts,
        experts_per_token=int(_require(hf, "num_experts_per_tok")),
        moe_intermediate_size=int(width),
        moe_layers=tuple(layers),
        moe_renormalize=renormalize,
    )


def _no_rope_layers(hf: dict, num_layers: int) -> tuple[int, ...]:
    """SmolLM3's layers without rotary embeddings: `no_rope_layers` flags (0 = no rope), else
    every `no_rope_layer_interval`-th layer (4), as transformers and llama.cpp derive them."""
    flags = hf.get("no_rope_layers")
    if flags is None:
        interval = int(hf.get("no_rope_layer_interval", 4))
        flags = [int((layer + 1) % interval != 0) for layer in range(num_layers)]
    if len(flags) != num_layers:
        raise ValueError(f"no_rope_layers has {len(flags)} flags for {num_layers} layers")
    return tuple(layer for layer, uses_rope in enumerate(flags) if not uses_rope)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_resolved(rope: RopeConfig, params: dict, hf: dict) -> RopeConfig:
    """YaRN's `factor` (where absent: the ratio of the context lengths, as DeepSeek-V3 has it) and
    `attention_factor` (where absent: 0.1 ln(factor) + 1, or DeepSeek's ratio of two such terms
    with `mscale` and `mscale_all_dim`), as transformers derives them."""
    if "original_max_position_embeddings" not in params:
        raise ValueError("yarn rope scaling needs original_max_position_embeddings")
    factor = rope.factor
    if params.get("factor") is None:
        factor = int(_require(hf, "max_position_embeddings")) / rope.original_max_position_embeddings
    attention_factor = rope.attention_factor
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(mscale_all_dim))
        else:
            attention_factor = _yarn_mscale(factor)
    return replace(rope, factor=factor, attention_factor=attention_factor)


def _longrope_resolved(rope: RopeConfig, hf: dict, *, factor_given: bool) -> RopeConfig:
    """LongRoPE's `factor` and `attention_factor` filled in as transformers derives them (the
    ratio of the context lengths, and sqrt(1 + ln(factor) / ln(original)))."""
    factor = rope.factor
    if not factor_given:
        factor = int(_require(hf, "max_position_embeddings")) / rope.original_max_position_embeddings
    attention_factor = rope.attention_factor
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(rope.original_max_position_embeddings))
        )
    return replace(rope, factor=factor, attention_factor=attention_factor)
