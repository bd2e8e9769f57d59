"""A light draft head on the target's features (EAGLE-style), over a reduced draft vocabulary.

The head is one pre-norm transformer block.  Its input at head position i+1 is the pair
(feature of token i, token i+1): the target's hidden states of token i (one layer, or the
low/middle/high layers fused by a linear map, as EAGLE-3 does) and the embedding of the
next token.  Its output predicts token i+2 and is also the feature fed back at the next
draft depth, so drafting runs autoregressively at feature level.

It borrows two tensors from the target instead of storing them: the token embedding and
the LM-head rows of the draft vocabulary (``d2t`` maps draft ids to target ids), so a
shipped head holds only its block and the fusion map.

An optional copy path (``copy_dim`` > 0, pointer-generator style) lets the head copy from the
context: each true entry i offers the token that followed its input token (x_{i+2}) under a
key computed from its input; a row's output feature queries those keys, and a learned gate
mixes the copy distribution with the vocabulary distribution over *target* ids (so copying
can propose tokens outside the draft vocabulary).  ``CopyMixture`` holds that mixture; both
training and drafting read it.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from quickdraft.kernels import draft_mixture
from quickdraft.kernels.quant_linear import (
    FusedLayerWeights,
    FusedSequences,
    draft_chain,
    fused_decoder_layer,
    fused_layer_available,
    norm_matmul,
)
from quickdraft.models.config import RopeConfig
from quickdraft.models.layers import LinearFn, RotaryTable, apply_rotary
from quickdraft.models.quantized import QuantizedWeight, embedding_rows, quantize_legacy

HEAD_CONFIG_FILE = "head_config.json"
HEAD_WEIGHTS_FILE = "head.safetensors"
COPY_PARAMETERS = ("copy_query", "copy_key", "copy_gate")
# The matrices a draft step reads, which `quantize_for_drafting` keeps quantized (the copy path's
# are a few dozen rows: not worth it).
DRAFT_MATRICES = ("fuse", "in_proj", "qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# Stands in for log(0) where gradients flow: exp() of it is exactly 0 in float32, and unlike -inf
# it keeps logsumexp/logaddexp gradients finite on rows where every term is "impossible".
NEG_LOG = -1e4


@dataclass(frozen=True)
class HeadConfig:
    hidden_size: int  # the target's hidden size D
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    feature_layers: tuple[int, ...]  # target layers whose outputs are fused into the input feature
    draft_vocab_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    activation: str = "gelu_tanh"  # "gelu_tanh" | "silu"
    copy_dim: int = 0  # width of the copy path's queries and keys; 0: no copy path

    def __post_init__(self) -> None:
        object.__setattr__(self, "feature_layers", tuple(self.feature_layers))
        for name in ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "draft_vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"head config {name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if not self.feature_layers:
            raise ValueError("head config needs at least one feature layer")
        if self.activation not in ("gelu_tanh", "silu"):
            raise ValueError(f"unsupported head activation {self.activation!r}")
        if not isinstance(self.copy_dim, int) or isinstance(self.copy_dim, bool) or self.copy_dim < 0:
            raise ValueError(f"head config copy_dim must be a non-negative integer, got {self.copy_dim!r}")

    @classmethod
    def from_dict(cls, data: dict) -> HeadConfig:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown head config keys {unknown}")
        return cls(**data)


class CopyPath:
    """A learned copy path (pointer-generator style) for a draft head: each true entry of the
    context offers the token that followed it under a key computed from its hidden state; a
    row's feature queries those keys, and a learned gate mixes the copy distribution with the
    head's vocabulary distribution over *target* ids.

    Hosts (EagleHead, the [self] drafter's LayerSkipHead) are torch modules that provide
    ``linear``, ``d2t`` [Vd] and ``draft_logits(feature)`` (the vocabulary logits [m, Vd] of
    rows whose feature is `feature`), and call ``add_copy_path`` in their constructor and
    ``attach_copy_vocabulary`` when they attach their target.
    """

    copy_dim: int = 0  # width of the queries and keys (0: the host has no copy path)
    copy_norm_eps: float = 1e-6  # the unit RMS norm of queries, keys and the gate's input
    linear: LinearFn
    d2t: torch.Tensor  # [Vd] target id of each draft id
    t2d: torch.Tensor | None  # [V] draft id of each target id, -1 outside the draft vocabulary
    copy_query: torch.nn.Linear
    copy_key: torch.nn.Linear
    copy_gate: torch.nn.Linear

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., D] -> [..., Vd]
        raise NotImplementedError

    def add_copy_path(self, hidden_size: int, *, copy_dim: int, eps: float, dtype: torch.dtype) -> None:
        self.copy_dim, self.copy_norm_eps = copy_dim, eps
        self.copy_query = torch.nn.Linear(hidden_size, copy_dim, bias=False, dtype=dtype)
        self.copy_key = torch.nn.Linear(hidden_size, copy_dim, bias=False, dtype=dtype)
        self.copy_gate = torch.nn.Linear(hidden_size, 1, bias=True, dtype=dtype)
        self.reset_copy_path()

    def attach_copy_vocabulary(self, vocab_size: int) -> None:
        self.t2d = torch.full((vocab_size,), -1, dtype=torch.long, device=self.d2t.device)
        self.t2d[self.d2t] = torch.arange(self.d2t.shape[0], device=self.d2t.device)

    def reset_copy_path(self) -> None:
        """Fresh copy parameters: small random queries and keys, and a gate that starts mostly
        shut (sigmoid(-2) = 0.12), so a new copy path barely moves the vocabulary distribution."""
        with torch.no_grad():
            self.copy_query.weight.normal_(0.0, 0.02)
            self.copy_key.weight.normal_(0.0, 0.02)
            self.copy_gate.weight.zero_()
            self.copy_gate.bias.fill_(-2.0)

    def copy_keys(self, entry_hidden: torch.Tensor) -> torch.Tensor:  # [n, D] -> [n, C]
        """Copy keys of true entries from their input hidden states (`input_hidden`)."""
        return self.linear(_unit_rms(entry_hidden, eps=self.copy_norm_eps), self.copy_key.weight, None)

    def mixture(
        self, feature: torch.Tensor, *, keys: torch.Tensor, values: torch.Tensor, eligible: torch.Tensor
    ) -> CopyMixture:
        """The draft distribution of rows whose head output is `feature` [m, D] (what
        `draft_logits` reads), copying from sources with copy keys `keys` [n, C] and values
        (target ids) `values` [n]; row r reads the sources where `eligible` [m, n] is true.

        The gate reads the normalised output like the query does: the raw residual stream's
        scale would otherwise set the gate's temperature.
        """
        normed = _unit_rms(feature, eps=self.copy_norm_eps)
        query = self.linear(normed, self.copy_query.weight, None)  # [m, C]
        gate_logit = self.linear(normed, self.copy_gate.weight, self.copy_gate.bias)[:, 0].float()  # [m]
        scores = query.float() @ keys.float().T * self.copy_dim**-0.5  # [m, n]
        has_source = eligible.any(dim=-1)  # [m]: a row with nothing to copy keeps the vocabulary only
        return CopyMixture(
            vocab_log_probs=torch.log_softmax(self.draft_logits(feature).float(), dim=-1),
            log_keep=F.logsigmoid(-gate_logit).masked_fill(~has_source, 0.0),
            log_gate=F.logsigmoid(gate_logit).masked_fill(~has_source, -math.inf),
            copy_log_weights=torch.log_softmax(scores.masked_fill(~eligible, NEG_LOG), dim=-1),
            copy_values=values,
            eligible=eligible,
            d2t=self.d2t,
            t2d=self.t2d,
        )

    def copy_sources(self, keys: torch.Tensor, values: torch.Tensor) -> CopySources:
        """What every node of one drafting step copies from: the true entries' copy keys [n, C]
        and target ids [n] (all >= 0), with their distinct ids worked out once per step."""
        distinct, inverse = torch.unique(values, return_inverse=True)  # [U], [n]
        draft_ids = self.t2d[distinct]  # [U], -1 outside the draft vocabulary
        copied_draft_id = torch.zeros(self.d2t.shape[0], dtype=torch.bool, device=keys.device)
        copied_draft_id[draft_ids[draft_ids >= 0]] = True
        return CopySources(
            keys=keys,
            values=values,
            inverse=inverse,
            distinct=distinct,
            distinct_draft_ids=draft_ids.clamp_min(0),
            distinct_in_vocab=(draft_ids >= 0).float(),
            copied_draft_id=copied_draft_id,
        )

    def _draft_mixture(
        self,
        feature: torch.Tensor,
        sources: CopySources,
        logits: torch.Tensor | None = None,  # [m, Vd] draft_logits(feature), where the caller has them
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The drafting mixture's pieces, every row copying from `sources`: the gate [m, 1], the
        vocabulary log-probabilities [m, Vd] and the copied ids' mixture log-probabilities [m, U]."""
        normed = _unit_rms(feature, eps=self.copy_norm_eps)
        query = self.linear(normed, self.copy_query.weight, None).float()  # [m, C]
        gate = torch.sigmoid(self.linear(normed, self.copy_gate.weight, self.copy_gate.bias).float())  # [m, 1]
        weights = torch.softmax(query @ sources.keys.float().T * self.copy_dim**-0.5, dim=-1)  # [m, n]
        copied = weights.new_zeros(feature.shape[0], sources.distinct.shape[0]).index_add_(1, sources.inverse, weights)
        if logits is None:
            logits = self.draft_logits(feature)
        vocab_log_probs = torch.log_softmax(logits.float(), dim=-1)  # [m, Vd]
        vocab_of_copied = vocab_log_probs[:, sources.distinct_draft_ids].exp() * sources.distinct_in_vocab  # [m, U]
        copy_scores = torch.log((1 - gate) * vocab_of_copied + gate * copied)  # [m, U]
        return gate, vocab_log_probs, copy_scores

    def draft_top_k(
        self, feature: torch.Tensor, sources: CopySources, k: int, *, logits: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`mixture(feature, eligible=all sources, ...).top_k(k)` for drafting, where every row
        copies from the same sources: a third of its torch ops, or one C++ call on CPU float32
        (kernels/draft_mixture.py).  feature [m, D] -> target ids [m, k] and log-probabilities
        [m, k], best first.  logits [m, Vd]: the rows' draft_logits where the caller computed
        them with other requests' rows (one pass over the draft LM head for all of a step's
        requests, which each copy from their own sources)."""
        fast = self.draft_top_k_kernel(feature, sources, k, logits=logits)
        return fast if fast is not None else self.draft_top_k_reference(feature, sources, k, logits=logits)

    def draft_top_k_kernel(
        self, feature: torch.Tensor, sources: CopySources, k: int, *, logits: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """draft_top_k in one C++ call, or None where it cannot run (not CPU float32, no kernel):
        the draft logits are computed (when not given) only when it can."""
        if not (feature.is_cpu and feature.dtype == self.copy_query.weight.dtype == torch.float32):
            return None
        if not draft_mixture.available():
            return None
        return draft_mixture.draft_top_k(
            feature,
            (self.draft_logits(feature) if logits is None else logits).float(),
            query_weight=self.copy_query.weight,
            gate_weight=self.copy_gate.weight,
            gate_bias=self.copy_gate.bias,
            keys=sources.keys,
            inverse=sources.inverse,
            distinct=sources.distinct,
            distinct_draft_ids=sources.distinct_draft_ids,
            distinct_in_vocab=sources.distinct_in_vocab,
            copied_draft_id=sources.copied_draft_id,
            d2t=self.d2t,
            k=k,
            eps=self.copy_norm_eps,
        )

    def draft_top_k_reference(
        self, feature: torch.Tensor, sources: CopySources, k: int, *, logits: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """draft_top_k in torch ops (any device and dtype)."""
        gate, vocab_log_probs, copy_scores = self._draft_mixture(feature, sources, logits)
        # tokens also copied are scored among copy_scores; max is several times faster than topk
        vocab_top = vocab_log_probs.max(dim=-1, keepdim=True) if k == 1 else vocab_log_probs.topk(k, dim=-1)
        vocab_scores = (torch.log1p(-gate) + vocab_top.values).masked_fill(
            sources.copied_draft_id[vocab_top.indices], -math.inf
        )  # [m, k]
        top = torch.cat([vocab_scores, copy_scores], dim=1).topk(k, dim=-1)
        m = feature.shape[0]
        ids = torch.cat([self.d2t[vocab_top.indices], sources.distinct.expand(m, -1)], dim=1).gather(1, top.indices)
        return ids, top.values

    def draft_log_probs(
        self, feature: torch.Tensor, sources: CopySources, *, logits: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole drafting mixture (every row copying from `sources`): target ids [Vd + U] and
        log-probabilities [m, Vd + U] (draft-vocabulary ids that are also copied are -inf in the
        first part: their probability is in the copy part).  logits: as in draft_top_k."""
        gate, vocab_log_probs, copy_scores = self._draft_mixture(feature, sources, logits)
        vocab_scores = (torch.log1p(-gate) + vocab_log_probs).masked_fill(sources.copied_draft_id, -math.inf)
        return torch.cat([self.d2t, sources.distinct]), torch.cat([vocab_scores, copy_scores], dim=1)


class FeatureHead(torch.nn.Module):
    """What every feature-level draft head offers the drafter and the trainer.

    Subclasses provide ``config`` (a HeadConfig), ``d2t`` [Vd], ``attn_scale`` and the pieces
    ``fuse_features``, ``input_hidden``, ``attention_inputs``, ``block_output``,
    ``draft_logits`` and ``attach_target``; drafting (eagle drafter) and training (the
    unrolled forward below) are written once over those pieces.
    """

    # The matmul kernel: torch's (with autograd) for training; drafters install the fast
    # inference kernel of their device (quickdraft.models.layers.default_linear_fn).
    linear: LinearFn = staticmethod(F.linear)  # type: ignore[assignment]
    config: HeadConfig
    d2t: torch.Tensor  # [Vd] target id of each draft id
    t2d: torch.Tensor | None  # [V] draft id of each target id (heads with a copy path)

    attn_scale: float  # the block's attention scale (an attribute or a property)

    # ---- the pieces every head provides ---------------------------------------------------
    def attach_target(self, target) -> None:
        raise NotImplementedError

    def drop_borrowed_float_rows(self) -> None:
        """For a head that only drafts from now on: drop float copies of the target's tensors that
        its quantized drafting copies replace (none here; EagleHead's draft LM rows)."""

    def fuse_features(self, features: torch.Tensor) -> torch.Tensor:  # [..., L * D] -> [..., D]
        raise NotImplementedError

    def input_hidden(self, token_ids: torch.Tensor, feature: torch.Tensor) -> torch.Tensor:  # -> [..., D]
        raise NotImplementedError

    def attention_inputs(self, hidden: torch.Tensor, positions: torch.Tensor):  # -> q, k, v
        raise NotImplementedError

    def block_output(self, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:  # -> [N, D]
        raise NotImplementedError

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., D] -> [..., Vd]
        raise NotImplementedError

    def copy_keys(self, entry_hidden: torch.Tensor) -> torch.Tensor:  # heads with a copy path
        raise NotImplementedError

    def quantize_for_drafting(self, format: str = "Q8_0") -> None:  # heads that draft on quantized copies
        raise NotImplementedError(f"{type(self).__name__} has no quantized drafting copies")

    def copy_sources(self, keys: torch.Tensor, values: torch.Tensor) -> CopySources:
        raise NotImplementedError

    def draft_top_k(
        self, feature: torch.Tensor, sources: CopySources, k: int, *, logits: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def draft_log_probs(
        self, feature: torch.Tensor, sources: CopySources, *, logits: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    @property
    def dtype(self) -> torch.dtype:
        return next(p for p in self.parameters() if p.is_floating_point() and p.dim() == 2).dtype

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """Target layers whose features the head reads."""
        return tuple(self.config.feature_layers)

    def runs_fused_block(self, hidden: torch.Tensor) -> bool:
        """Whether `fused_block` can replace the block's pieces for these rows (a head that has
        a one-call block says so)."""
        return False

    def fused_block(self, hidden: torch.Tensor, positions: torch.Tensor, **cache) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} has no one-call block")

    def training_logits(
        self, token_ids: torch.Tensor, features: torch.Tensor, *, depths: int, first_anchor: int = 0
    ) -> list[torch.Tensor]:
        return self.unrolled_logits(token_ids, features, depths=depths, first_anchor=first_anchor)

    def weights_per_draft_token(self) -> int:
        """Matrix weights one draft token reads: the block, the fusion, the draft LM rows."""
        return (
            sum(p.numel() for name, p in self.named_parameters() if p.dim() == 2 and name != "lm_head")
            + self.d2t.numel() * self.config.hidden_size  # the draft LM rows [Vd, D]
        )

    # ---- training: all positions at once, unrolled over draft depths -------------------
    def unrolled_logits(
        self, token_ids: torch.Tensor, features: torch.Tensor, *, depths: int, first_anchor: int = 0
    ) -> list[torch.Tensor]:
        """Draft logits for draft depths 1..depths at anchors first_anchor..T-2 (training-time test).

        token_ids [T], features [T - 1, L * D] of one sequence (every token but the last).
        Returns [T - 1 - first_anchor, Vd] per depth; depth k's row for anchor j predicts
        token j + k + 1 (rows past the sequence end predict nothing).
        """
        _, outputs = self.unrolled_features(token_ids, features, depths=depths, first_anchor=first_anchor)
        return [self.draft_logits(output) for output in outputs]

    def unrolled_features(
        self, token_ids: torch.Tensor, features: torch.Tensor, *, depths: int, first_anchor: int = 0
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The true entries' input hidden states [T - 1, D] and the head's output features
        [T - 1 - first_anchor, D] per draft depth 1..depths (what `draft_logits` reads).

        token_ids [T], features [T - 1, L * D] of one sequence (every token but the last).
        Anchor j is the pair (feature j, token j+1); depth k feeds the head's own depth k-1
        output with token j+k at position j+k, attending to the true entries up to anchor j
        and to its own deeper entries, exactly what drafting sees.  Every anchor's true entry
        is computed (later anchors attend to it); outputs only from `first_anchor` on.
        """
        n = token_ids.shape[0] - 1
        padded = torch.cat([token_ids, token_ids.new_zeros(depths)])
        anchors = torch.arange(n, device=token_ids.device)
        rows = anchors[first_anchor:]
        causal = anchors[None, :] <= rows[:, None]  # [m, n]
        entry_hidden = self.input_hidden(padded[1 : n + 1], self.fuse_features(features[:n]))  # [n, D]
        q, k, v = self.attention_inputs(entry_hidden, anchors + 1)
        keys, values = [k], [v]
        queries, hidden = q[first_anchor:], entry_hidden[first_anchor:]
        outputs = []
        for depth in range(1, depths + 1):
            if depth > 1:
                hidden = self.input_hidden(padded[rows + depth], outputs[-1])  # [m, D]
                queries, k, v = self.attention_inputs(hidden, rows + depth)
                keys.append(k)
                values.append(v)
            attended = _unrolled_attention(
                queries, keys, values, causal=causal, first_anchor=first_anchor, scale=self.attn_scale
            )
            outputs.append(self.block_output(hidden, attended.reshape(hidden.shape[0], -1)))
        return entry_hidden, outputs


class EagleHead(CopyPath, FeatureHead):  # CopyPath's methods before FeatureHead's stubs
    def __init__(self, config: HeadConfig, *, dtype: torch.dtype = torch.float32, max_len: int = 4096):
        super().__init__()
        self.config = c = config
        D = c.hidden_size

        def linear(inputs: int, outputs: int) -> torch.nn.Linear:
            return torch.nn.Linear(inputs, outputs, bias=False, dtype=dtype)

        def norm() -> torch.nn.RMSNorm:
            return torch.nn.RMSNorm(D, eps=c.rms_norm_eps, dtype=dtype)

        self.fuse = linear(len(c.feature_layers) * D, D) if len(c.feature_layers) > 1 else None
        self.token_norm, self.feature_norm = norm(), norm()
        self.in_proj = linear(2 * D, D)
        self.attn_norm = norm()
        self.qkv_proj = linear(D, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim)
        self.o_proj = linear(c.num_heads * c.head_dim, D)
        self.mlp_norm = norm()
        self.gate_up_proj = linear(D, 2 * c.intermediate_size)
        self.down_proj = linear(c.intermediate_size, D)
        self.final_norm = norm()
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))  # [Vd] target ids
        # max_len: the longest head position used (sequence length plus draft depth).
        self.max_len = max_len
        self.rotary = RotaryTable(RopeConfig(theta=c.rope_theta), head_dim=c.head_dim, max_len=max_len, dtype=dtype)
        if c.copy_dim:
            self.add_copy_path(D, copy_dim=c.copy_dim, eps=c.rms_norm_eps, dtype=dtype)
        # Borrowed from the target by attach_target (not saved with the head).
        self.embed_tokens: torch.Tensor | None = None  # [V, D]
        self.embed_scale: float | None = None
        self.lm_rows: torch.Tensor | None = None  # [Vd, D] target LM-head rows of the draft vocabulary
        self.logit_softcap: float | None = None
        self.t2d: torch.Tensor | None = None  # [V] draft id of each target id, -1 outside (copy path only)
        # Quantized (Q4_0 by default) copies of DRAFT_MATRICES and of lm_rows, read instead of
        # them when drafting on the quantized kernels (quantize_for_drafting); training never sets them.
        self.draft_weights: dict[str, QuantizedWeight] = {}
        # (the weights and norms it was built from, fused_block's kernel arguments)
        self._fused_block_cache: tuple[tuple, FusedLayerWeights] | None = None
        # Whether drafting runs whole pieces of the head in single C++ calls (set with the quantized
        # copies where the CPU and the head's sizes allow; see runs_fused_block).
        self.fused_drafting = False
        self.draft_input_norm: torch.Tensor | None = None  # [2D] token then feature norm weights

    @property
    def attn_scale(self) -> float:
        return self.config.head_dim**-0.5

    # ---- the target's tensors -------------------------------------------------------------
    def attach_target(self, target) -> None:
        """Borrow the target Decoder's embedding and the draft vocabulary's LM-head rows."""
        dtype = self.in_proj.weight.dtype
        self.embed_tokens = target.embed_tokens.detach()
        self.embed_scale = target.embed_scale
        self.lm_rows = target.lm_head_weight.detach()[self.d2t].to(dtype)
        self.logit_softcap = target.config.final_logit_softcapping
        if self.config.copy_dim:
            self.attach_copy_vocabulary(self.embed_tokens.shape[0])

    def quantize_for_drafting(self, format: str = "Q8_0") -> None:
        """Draft with `format` (Q8_0, Q5_0, Q4_0) copies of the block's matrices and the draft LM
        rows (Q8_0: a quarter of the float32 bytes per draft depth, on the quantized CPU kernels).
        Drafting precision never changes the output, only how well the head guesses: measured in
        docs/performance-log.md.  Call after attach_target; the float weights stay for training and saving."""
        if self.lm_rows is None:
            raise RuntimeError("quantize_for_drafting needs the target's LM rows: call attach_target first")
        matrices = {name: getattr(self, name).weight for name in DRAFT_MATRICES if getattr(self, name) is not None}
        matrices["lm_rows"] = self.lm_rows
        self.draft_weights = {
            name: QuantizedWeight.from_parts([quantize_legacy(weight, format)]) for name, weight in matrices.items()
        }
        # The input's two norms side by side, as norm_matmul reads them: built once, not per depth.
        self.draft_input_norm = torch.cat([self.token_norm.weight, self.feature_norm.weight]).detach()
        c = self.config
        self.fused_drafting = (
            fused_layer_available()
            and c.hidden_size % 32 == 0
            and c.head_dim % 16 == 0
            and (c.num_heads * c.head_dim % 32 == 0 and c.intermediate_size % 32 == 0)
        )

    def drop_borrowed_float_rows(self) -> None:
        """For a head that only drafts from now on: drop the float32 LM rows borrowed from the
        target (40 MiB for the embedded model's 16,384-token draft vocabulary) and the float
        matrices of its block (31 MB for the shipped Gemma head) once their quantized copies
        exist.  Drafting reads the copies; such a head can no longer be trained, saved or
        quantized again (its float matrices are left with no rows)."""
        if "lm_rows" in self.draft_weights:
            self.lm_rows = None
        for name in DRAFT_MATRICES:
            module = getattr(self, name)
            if module is not None and name in self.draft_weights:
                weight = module.weight
                module.weight = torch.nn.Parameter(weight.new_empty(0, weight.shape[1]), requires_grad=False)

    def _matrix(self, name: str):  # the weight a draft step reads: [N, K] float or QuantizedWeight
        packed = self.draft_weights.get(name)
        if packed is not None:
            return packed
        return self.lm_rows if name == "lm_rows" else getattr(self, name).weight

    def set_draft_vocab(self, d2t: torch.Tensor) -> None:  # d2t [Vd]
        if d2t.shape != self.d2t.shape:
            raise ValueError(f"draft vocabulary has {d2t.shape[0]} ids, the head expects {self.d2t.shape[0]}")
        self.d2t.copy_(d2t)

    # ---- pieces of the block -----------------------------------------------------------------
    def fuse_features(self, features: torch.Tensor) -> torch.Tensor:  # [..., L * D] -> [..., D]
        return features if self.fuse is None else self.linear(features, self._matrix("fuse"), None)

    def input_hidden(self, token_ids: torch.Tensor, feature: torch.Tensor) -> torch.Tensor:
        # token_ids [...], feature [..., D] -> [..., D]
        embedded = embedding_rows(self.embed_tokens, token_ids).to(feature.dtype)
        if self.embed_scale is not None:
            embedded = embedded * self.embed_scale
        if self.runs_fused_block(feature):
            joined = torch.cat([embedded, feature], dim=-1)  # [..., 2D], each half normalized on its own
            assert self.draft_input_norm is not None  # set with fused_drafting
            out = norm_matmul(
                joined.reshape(-1, joined.shape[-1]),
                norm=self.draft_input_norm,
                weight=self.draft_weights["in_proj"],
                eps=self.token_norm.eps,
                segment=feature.shape[-1],
            )
            return out.view(*feature.shape)
        mixed = torch.cat([self.token_norm(embedded), self.feature_norm(feature)], dim=-1)
        return self.linear(mixed, self._matrix("in_proj"), None)

    def attention_inputs(self, hidden: torch.Tensor, positions: torch.Tensor):
        # hidden [N, D], positions [N] -> q [N, H, hd], k and v [N, Hkv, hd]
        c = self.config
        qkv = self.linear(self.attn_norm(hidden), self._matrix("qkv_proj"), None).view(
            hidden.shape[0], c.num_heads + 2 * c.num_kv_heads, c.head_dim
        )
        q, k, v = qkv.split([c.num_heads, c.num_kv_heads, c.num_kv_heads], dim=1)
        cos, sin = self.rotary.lookup(positions)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def block_output(self, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        # hidden [N, D], attended [N, H * hd] -> [N, D]
        hidden = hidden + self.linear(attended, self._matrix("o_proj"), None)
        gate, up = self.linear(self.mlp_norm(hidden), self._matrix("gate_up_proj"), None).chunk(2, dim=-1)
        act = F.gelu(gate, approximate="tanh") if self.config.activation == "gelu_tanh" else F.silu(gate)
        return hidden + self.linear(act * up, self._matrix("down_proj"), None)

    def runs_fused_block(self, hidden: torch.Tensor) -> bool:
        """Whether `fused_block` (and the one-call input and logits) apply: quantized drafting
        matrices (quantize_for_drafting) on a CPU with the one-call decoder layer, float32 rows.
        Each torch op costs ~10 us here, more than the head's arithmetic at one row."""
        return self.fused_drafting and hidden.is_cpu and hidden.dtype == torch.float32

    def fused_block(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        *,
        cache_keys: torch.Tensor,
        cache_values: torch.Tensor,
        sequences: list[tuple[int, int, int, int]],
        block_tables: list[list[int]],
        masks: list[torch.Tensor],
    ) -> torch.Tensor:
        """attention_inputs + KV write + attention + block_output in one C++ call (the target's
        decoder layer without its Gemma norms): one call per draft depth for every drafting
        request instead of ~40 torch ops each, which cost more than the head's arithmetic.
        hidden [N, D] from `input_hidden`, positions [N]; cache_keys/values [blocks, Hkv, bs, hd];
        sequences: per request (row_start, row_end, kv_start, kv_end) with its block table, its
        rows' KV written at kv_end - rows .. kv_end - 1; masks: per request [rows, kv_end -
        kv_start] bool -> [N, D]."""
        return fused_decoder_layer(
            hidden.contiguous(),
            layer=self._fused_block_weights(),
            rotary=self.rotary.lookup(positions),
            cache_keys=cache_keys,
            cache_values=cache_values,
            sequences=FusedSequences.of(
                sequences=sequences, block_tables=block_tables, masks=[mask.contiguous() for mask in masks]
            ),
        )

    def _fused_block_weights(self) -> FusedLayerWeights:
        """fused_block's unchanging kernel arguments, gathered again only when the quantized
        matrices or the norms are replaced (a draft depth is ~0.3 ms: Python per call counts)."""
        names = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
        sources = (*(self.draft_weights[name] for name in names), self.attn_norm.weight, self.mlp_norm.weight)
        cached = self._fused_block_cache
        if cached is None or any(a is not b for a, b in zip(sources, cached[0])):
            c = self.config
            layer = FusedLayerWeights.of(
                weights=dict(zip(names, sources[:4])),
                norms={
                    "input": sources[4],
                    "post_attention": sources[5],
                    "pre_feedforward": None,
                    "post_feedforward": None,
                    "qk": None,
                },
                eps=self.attn_norm.eps,
                gelu=c.activation == "gelu_tanh",
                num_heads=c.num_heads,
                num_kv_heads=c.num_kv_heads,
                head_dim=c.head_dim,
                scale=self.attn_scale,
            )
            cached = self._fused_block_cache = (sources, layer)  # sources kept alive: ids stay theirs
        return cached[1]

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., D] -> [..., Vd]
        if self.runs_fused_block(hidden):
            logits = norm_matmul(
                hidden.reshape(-1, hidden.shape[-1]),
                norm=self.final_norm.weight,
                weight=self.draft_weights["lm_rows"],
                eps=self.final_norm.eps,
            )
            logits = logits.view(*hidden.shape[:-1], -1)
        else:
            logits = self.linear(self.final_norm(hidden), self._matrix("lm_rows"), None)
        if self.logit_softcap:
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits

    def draft_chain(
        self,
        root: torch.Tensor,  # [D] the head's output after the root pair
        *,
        sources: CopySources,
        cache_keys: torch.Tensor,  # [blocks, Hkv, block_size, hd] the drafter's head cache
        cache_values: torch.Tensor,
        block_table: list[int],
        first_true: int,
        num_true: int,
        floors: list[float],  # per depth d = 1.., the path log-probability its pick must keep
    ) -> tuple[list[int], list[float]] | None:
        """A top-1 chain of up to len(floors) picks grown in one C++ call: the picks' target ids
        and log-probabilities, the very values the depth-by-depth path (input_hidden,
        fused_block, draft_logits and draft_top_k per depth) gives; its draft entries are
        written at num_true.. of the head cache.  None where that call cannot run here (no fused
        drafting, no copy path, no mixture kernel, an embedding that is not Q8_0 in one part, a
        logit softcap): the caller grows the chain depth by depth."""
        embed = self.embed_tokens
        address = draft_mixture.top_k_address() if self.fused_drafting and self.config.copy_dim else None
        if (
            address is None
            or self.logit_softcap
            or not self.runs_fused_block(root)
            or not isinstance(embed, QuantizedWeight)
            or len(embed.parts) != 1
            or embed.parts[0].format != "Q8_0"
            or sources.keys.dtype != torch.float32
        ):
            return None
        assert self.draft_input_norm is not None  # set with fused_drafting
        return draft_chain(
            root.reshape(1, -1).contiguous(),
            embed=embed,
            embed_scale=self.embed_scale,
            input_norm=self.draft_input_norm,
            in_proj=self.draft_weights["in_proj"],
            input_eps=self.token_norm.eps,
            layer=self._fused_block_weights(),
            rotary_tables=(self.rotary.cos, self.rotary.signed_sin),
            cache_keys=cache_keys,
            cache_values=cache_values,
            block_table=block_table,
            first_true=first_true,
            num_true=num_true,
            final_norm=self.final_norm.weight,
            final_eps=self.final_norm.eps,
            lm_rows=self.draft_weights["lm_rows"],
            mixture_address=address,
            mixture_tensors=[
                self.copy_query.weight,
                self.copy_gate.weight,
                self.copy_gate.bias,
                sources.keys.contiguous(),
                sources.inverse,
                sources.distinct,
                sources.distinct_draft_ids,
                sources.distinct_in_vocab,
                sources.copied_draft_id,
                self.d2t,
            ],
            mixture_eps=self.copy_norm_eps,
            floors=floors,
        )

    # ---- the copy path (CopyPath) ------------------------------------------------------
    def with_fresh_copy_path(self, copy_dim: int) -> EagleHead:
        """This head's weights and draft vocabulary in a head with a new copy path of width
        `copy_dim` (fine-tuning a trained head into a copying one)."""
        head = EagleHead(dataclasses.replace(self.config, copy_dim=copy_dim), dtype=self.dtype, max_len=self.max_len)
        kept = {name: tensor for name, tensor in self.state_dict().items() if not name.startswith(COPY_PARAMETERS)}
        missing, unexpected = head.load_state_dict(kept, strict=False)
        assert not unexpected and all(name.startswith(COPY_PARAMETERS) for name in missing), (missing, unexpected)
        return head.to(self.d2t.device)

    def unrolled_mixtures(
        self, token_ids: torch.Tensor, features: torch.Tensor, *, depths: int, first_anchor: int = 0
    ) -> list[CopyMixture]:
        """The training forward of a head with a copy path: per draft depth, the mixture of the
        rows `unrolled_logits` returns.  Entry i copies x_{i+2}; a row at anchor j (any depth)
        copies from the true entries 0..j-1, whose values are all known there."""
        entry_hidden, outputs = self.unrolled_features(token_ids, features, depths=depths, first_anchor=first_anchor)
        n = entry_hidden.shape[0]
        keys = self.copy_keys(entry_hidden)  # [n, C]
        values = torch.cat([token_ids[2:], token_ids.new_full((1,), -1)])  # [n]: the last entry's is unknown
        anchors = torch.arange(n, device=token_ids.device)
        eligible = anchors[None, :] < anchors[first_anchor:, None]  # [m, n]
        return [self.mixture(output, keys=keys, values=values, eligible=eligible) for output in outputs]

    # ---- files ---------------------------------------------------------------------------
    def save(self, directory: str | Path, *, dtype: torch.dtype = torch.bfloat16) -> None:
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {
            name: tensor.detach().to(dtype if tensor.is_floating_point() else tensor.dtype).contiguous()
            for name, tensor in self.state_dict().items()
        }
        save_file(state, str(directory / HEAD_WEIGHTS_FILE))
        (directory / HEAD_CONFIG_FILE).write_text(json.dumps(asdict(self.config), indent=1))

    @classmethod
    def load(
        cls, directory: str | Path, *, dtype: torch.dtype, device: torch.device | str = "cpu", max_len: int = 4096
    ) -> EagleHead:
        from safetensors.torch import load_file

        directory = Path(directory)
        config_path = directory / HEAD_CONFIG_FILE
        if not config_path.is_file():
            raise FileNotFoundError(f"no draft head in {directory} (missing {HEAD_CONFIG_FILE})")
        head = cls(HeadConfig.from_dict(json.loads(config_path.read_text())), dtype=dtype, max_len=max_len)
        state = load_file(str(directory / HEAD_WEIGHTS_FILE))
        missing, unexpected = head.load_state_dict(
            {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}, strict=False
        )
        if unexpected or [m for m in missing if not m.startswith("rotary")]:
            raise ValueError(
                f"head weights in {directory} do not match its config: missing {missing}, unexpected {unexpected}"
            )
        return head.to(device).eval()


@dataclass
class CopySources:
    """The copy sources of one drafting step (EagleHead.copy_sources)."""

    keys: torch.Tensor  # [n, C] copy keys
    values: torch.Tensor  # [n] target id each source copies
    inverse: torch.Tensor  # [n] index of each source's id in distinct
    distinct: torch.Tensor  # [U] the distinct target ids copied
    distinct_draft_ids: torch.Tensor  # [U] their draft ids (0 where outside the draft vocabulary)
    distinct_in_vocab: torch.Tensor  # [U] float: 1 where inside the draft vocabulary
    copied_draft_id: torch.Tensor  # [Vd] bool: draft ids among the copied ids


@dataclass
class CopyMixture:
    """p(v) = (1 - g) * p_vocab(v) + g * p_copy(v) over target ids v, for m rows.

    p_vocab is the softmax of the draft logits, 0 outside the draft vocabulary; p_copy(v) sums
    the copy attention weights of the eligible sources whose value is v; g is the copy gate (0 on
    rows with no eligible source).  Never materialised over the target vocabulary.
    """

    vocab_log_probs: torch.Tensor  # [m, Vd]
    log_keep: torch.Tensor  # [m] log(1 - g)
    log_gate: torch.Tensor  # [m] log g (-inf on rows without a source)
    copy_log_weights: torch.Tensor  # [m, n] log copy attention weights (meaningless where not eligible)
    copy_values: torch.Tensor  # [n] target id each source copies (-1: unknown, never eligible)
    eligible: torch.Tensor  # [m, n] bool: sources each row copies from
    d2t: torch.Tensor  # [Vd] target id of each draft id
    t2d: torch.Tensor  # [V] draft id of each target id, -1 outside the draft vocabulary

    def log_prob(self, target_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """log p(target_ids) [m] (differentiable) and whether it can be above 0 [m] (the token is
        in the draft vocabulary or an eligible source copies it); `target_ids` [m] >= 0."""
        draft_ids = self.t2d[target_ids]  # [m]
        in_vocab = draft_ids >= 0
        vocab_part = self.vocab_log_probs.gather(1, draft_ids.clamp_min(0)[:, None])[:, 0]
        vocab_part = vocab_part.masked_fill(~in_vocab, NEG_LOG)
        copies = self.eligible & (self.copy_values[None, :] == target_ids[:, None])  # [m, n]
        copy_part = torch.logsumexp(self.copy_log_weights.masked_fill(~copies, NEG_LOG), dim=-1)
        log_probs = torch.logaddexp(self.log_keep + vocab_part, self.log_gate + copy_part)
        return log_probs, in_vocab | copies.any(dim=-1)

    def top_k(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k most likely target ids of each row and their log-probabilities, best first:
        ids [m, k], log_probs [m, k].

        Only the vocabulary's own top k and the copied tokens can be among them (any other
        token has less mass than each of the vocabulary's top k), so those are the candidates,
        each distinct token once, scored with its whole mixture probability.
        """
        m, n = self.eligible.shape
        vocab_top = self.vocab_log_probs.topk(k, dim=-1)
        vocab_ids = self.d2t[vocab_top.indices]  # [m, k]
        # Copy mass per distinct copied token: O(m * n), where comparing sources pairwise would be O(n^2).
        distinct, inverse = torch.unique(self.copy_values, return_inverse=True)  # [U], [n]
        eligible = self.eligible.to(self.copy_log_weights.dtype)  # [m, n]
        weights = self.copy_log_weights.exp() * eligible  # [m, n]
        index = inverse.expand(m, n)
        copied = weights.new_zeros(m, distinct.shape[0]).scatter_add_(1, index, weights)  # [m, U]
        copyable = weights.new_zeros(m, distinct.shape[0]).scatter_add_(1, index, eligible) > 0  # [m, U]
        is_vocab_id = vocab_ids[:, :, None] == distinct[None, None, :]  # [m, k, U]
        vocab_copied = (copied[:, None, :] * is_vocab_id).sum(dim=-1)  # [m, k]
        draft_of_distinct = self.t2d[distinct.clamp_min(0)]  # [U]
        distinct_vocab = self.vocab_log_probs.gather(1, draft_of_distinct.clamp_min(0).expand(m, -1))
        distinct_vocab = distinct_vocab.masked_fill(draft_of_distinct < 0, -math.inf)  # [m, U]
        dropped = ~copyable | is_vocab_id.any(dim=1) | (distinct < 0)  # each candidate token once
        log_gate, log_keep = self.log_gate[:, None], self.log_keep[:, None]
        vocab_scores = torch.logaddexp(log_keep + vocab_top.values, log_gate + vocab_copied.log())
        copy_scores = torch.logaddexp(log_keep + distinct_vocab, log_gate + copied.log()).masked_fill(
            dropped, -math.inf
        )
        top = torch.cat([vocab_scores, copy_scores], dim=1).topk(k, dim=-1)
        ids = torch.cat([vocab_ids, distinct.expand(m, -1)], dim=1).gather(1, top.indices)
        return ids, top.values


def _unit_rms(x: torch.Tensor, *, eps: float) -> torch.Tensor:  # [..., D] -> [..., D], no learned scale
    return F.rms_norm(x, (x.shape[-1],), eps=eps)


def _unrolled_attention(
    q: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    *,
    causal: torch.Tensor,
    first_anchor: int,
    scale: float,
) -> torch.Tensor:
    """q [m, H, hd] for anchors first_anchor..; keys/values: depth 1 [n, Hkv, hd] read causally
    (causal [m, n]), deeper depths [m, Hkv, hd] only at the query's own anchor (its draft path
    so far).  Returns [m, H, hd]."""
    heads, kv_heads = q.shape[1], keys[0].shape[1]
    group = heads // kv_heads

    def expand(t: torch.Tensor) -> torch.Tensor:  # [*, Hkv, hd] -> [*, H, hd]
        return t.repeat_interleave(group, dim=1) if group > 1 else t

    first_k, first_v = expand(keys[0]), expand(values[0])
    scores = torch.einsum("qhd,khd->hqk", q, first_k) * scale  # [H, m, n]
    scores = scores.masked_fill(~causal[None], float("-inf"))
    own = [torch.einsum("qhd,qhd->hq", q, expand(k))[..., None] * scale for k in keys[1:]]  # [H, m, 1]
    weights = torch.softmax(torch.cat([scores, *own], dim=-1), dim=-1)
    n = first_k.shape[0]
    out = torch.einsum("hqk,khd->qhd", weights[..., :n], first_v)
    for i, v in enumerate(values[1:]):
        out = out + weights[..., n + i].transpose(0, 1)[..., None] * expand(v)
    return out
