"""A light draft head on the target's features (EAGLE-style), over a reduced draft vocabulary.

The head is one pre-norm transformer block.  Its input at head position i+1 is the pair
(feature of token i, token i+1): the target's hidden states of token i (one layer, or the
low/middle/high layers fused by a linear map, as EAGLE-3 does) and the embedding of the
next token.  Its output predicts token i+2 and is also the feature fed back at the next
draft depth, so drafting runs autoregressively at feature level.

It borrows two tensors from the target instead of storing them: the token embedding and
the LM-head rows of the draft vocabulary (``d2t`` maps draft ids to target ids), so a
shipped head holds only its block and the fusion map.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from quickdraft.models.config import RopeConfig
from quickdraft.models.layers import RotaryTable, apply_rotary

HEAD_CONFIG_FILE = "head_config.json"
HEAD_WEIGHTS_FILE = "head.safetensors"


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

    def __post_init__(self) -> None:
        object.__setattr__(self, "feature_layers", tuple(self.feature_layers))
        for name in ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                     "draft_vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"head config {name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if not self.feature_layers:
            raise ValueError("head config needs at least one feature layer")
        if self.activation not in ("gelu_tanh", "silu"):
            raise ValueError(f"unsupported head activation {self.activation!r}")

    @classmethod
    def from_dict(cls, data: dict) -> HeadConfig:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown head config keys {unknown}")
        return cls(**data)


class FeatureHead(torch.nn.Module):
    """What every feature-level draft head offers the drafter and the trainer.

    Subclasses provide ``config`` (a HeadConfig), ``d2t`` [Vd], ``attn_scale`` and the pieces
    ``fuse_features``, ``input_hidden``, ``attention_inputs``, ``block_output``,
    ``draft_logits`` and ``attach_target``; drafting (eagle drafter) and training (the
    unrolled forward below) are written once over those pieces.
    """

    # The matmul kernel: torch's (with autograd) for training; drafters install the fast
    # inference kernel of their device (quickdraft.models.layers.default_linear_fn).
    linear = staticmethod(F.linear)

    @property
    def dtype(self) -> torch.dtype:
        return next(p for p in self.parameters() if p.is_floating_point() and p.dim() == 2).dtype

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """Target layers whose features the head reads."""
        return tuple(self.config.feature_layers)

    def training_logits(self, token_ids: torch.Tensor, features: torch.Tensor, *, depths: int,
                        first_anchor: int = 0) -> list[torch.Tensor]:
        return self.unrolled_logits(token_ids, features, depths=depths, first_anchor=first_anchor)

    def weights_per_draft_token(self) -> int:
        """Matrix weights one draft token reads: the block, the fusion, the draft LM rows."""
        return sum(p.numel() for name, p in self.named_parameters() if p.dim() == 2 and name != "lm_head") + \
            self.lm_rows.numel()

    # ---- training: all positions at once, unrolled over draft depths -------------------
    def unrolled_logits(self, token_ids: torch.Tensor, features: torch.Tensor, *, depths: int,
                        first_anchor: int = 0) -> list[torch.Tensor]:
        """Draft logits for draft depths 1..depths at anchors first_anchor..T-2 (training-time test).

        token_ids [T], features [T - 1, L * D] of one sequence (every token but the last).
        Anchor j is the pair (feature j, token j+1); depth k feeds the head's own depth k-1
        output with token j+k at position j+k, attending to the true entries up to anchor j
        and to its own deeper entries, exactly what drafting sees.  Every anchor's true entry
        is computed (later anchors attend to it); outputs only from `first_anchor` on.
        Returns [T - 1 - first_anchor, Vd] per depth; depth k's row for anchor j predicts
        token j + k + 1 (rows past the sequence end predict nothing).
        """
        n = token_ids.shape[0] - 1
        padded = torch.cat([token_ids, token_ids.new_zeros(depths)])
        anchors = torch.arange(n, device=token_ids.device)
        rows = anchors[first_anchor:]
        causal = anchors[None, :] <= rows[:, None]  # [m, n]
        hidden = self.input_hidden(padded[1 : n + 1], self.fuse_features(features[:n]))  # [n, D]
        q, k, v = self.attention_inputs(hidden, anchors + 1)
        keys, values = [k], [v]
        queries, hidden = q[first_anchor:], hidden[first_anchor:]
        outputs = []
        for depth in range(1, depths + 1):
            if depth > 1:
                hidden = self.input_hidden(padded[rows + depth], feature)  # [m, D]
                queries, k, v = self.attention_inputs(hidden, rows + depth)
                keys.append(k)
                values.append(v)
            attended = _unrolled_attention(queries, keys, values, causal=causal, first_anchor=first_anchor,
                                           scale=self.attn_scale)
            feature = self.block_output(hidden, attended.reshape(hidden.shape[0], -1))
            outputs.append(self.draft_logits(feature))
        return outputs



class EagleHead(FeatureHead):
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
        self.rotary = RotaryTable(RopeConfig(theta=c.rope_theta), head_dim=c.head_dim, max_len=max_len, dtype=dtype)
        # Borrowed from the target by attach_target (not saved with the head).
        self.embed_tokens: torch.Tensor | None = None  # [V, D]
        self.embed_scale: float | None = None
        self.lm_rows: torch.Tensor | None = None  # [Vd, D] target LM-head rows of the draft vocabulary
        self.logit_softcap: float | None = None

    @property
    def attn_scale(self) -> float:
        return self.config.head_dim ** -0.5

    # ---- the target's tensors -------------------------------------------------------------
    def attach_target(self, target) -> None:
        """Borrow the target Decoder's embedding and the draft vocabulary's LM-head rows."""
        dtype = self.in_proj.weight.dtype
        self.embed_tokens = target.embed_tokens.detach()
        self.embed_scale = target.embed_scale
        self.lm_rows = target.lm_head_weight.detach()[self.d2t].to(dtype)
        self.logit_softcap = target.config.final_logit_softcapping

    def set_draft_vocab(self, d2t: torch.Tensor) -> None:  # d2t [Vd]
        if d2t.shape != self.d2t.shape:
            raise ValueError(f"draft vocabulary has {d2t.shape[0]} ids, the head expects {self.d2t.shape[0]}")
        self.d2t.copy_(d2t)

    # ---- pieces of the block -----------------------------------------------------------------
    def fuse_features(self, features: torch.Tensor) -> torch.Tensor:  # [..., L * D] -> [..., D]
        return features if self.fuse is None else self.linear(features, self.fuse.weight, None)

    def input_hidden(self, token_ids: torch.Tensor, feature: torch.Tensor) -> torch.Tensor:
        # token_ids [...], feature [..., D] -> [..., D]
        embedded = F.embedding(token_ids, self.embed_tokens).to(feature.dtype)
        if self.embed_scale is not None:
            embedded = embedded * self.embed_scale
        mixed = torch.cat([self.token_norm(embedded), self.feature_norm(feature)], dim=-1)
        return self.linear(mixed, self.in_proj.weight, None)

    def attention_inputs(self, hidden: torch.Tensor, positions: torch.Tensor):
        # hidden [N, D], positions [N] -> q [N, H, hd], k and v [N, Hkv, hd]
        c = self.config
        qkv = self.linear(self.attn_norm(hidden), self.qkv_proj.weight, None).view(
            hidden.shape[0], c.num_heads + 2 * c.num_kv_heads, c.head_dim)
        q, k, v = qkv.split([c.num_heads, c.num_kv_heads, c.num_kv_heads], dim=1)
        cos, sin = self.rotary.lookup(positions)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def block_output(self, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        # hidden [N, D], attended [N, H * hd] -> [N, D]
        hidden = hidden + self.linear(attended, self.o_proj.weight, None)
        gate, up = self.linear(self.mlp_norm(hidden), self.gate_up_proj.weight, None).chunk(2, dim=-1)
        act = F.gelu(gate, approximate="tanh") if self.config.activation == "gelu_tanh" else F.silu(gate)
        return hidden + self.linear(act * up, self.down_proj.weight, None)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., D] -> [..., Vd]
        logits = self.linear(self.final_norm(hidden), self.lm_rows, None)
        if self.logit_softcap:
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits

    # ---- files ---------------------------------------------------------------------------
    def save(self, directory: str | Path, *, dtype: torch.dtype = torch.bfloat16) -> None:
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {name: tensor.detach().to(dtype if tensor.is_floating_point() else tensor.dtype).contiguous()
                 for name, tensor in self.state_dict().items()}
        save_file(state, str(directory / HEAD_WEIGHTS_FILE))
        (directory / HEAD_CONFIG_FILE).write_text(json.dumps(asdict(self.config), indent=1))

    @classmethod
    def load(cls, directory: str | Path, *, dtype: torch.dtype, device: torch.device | str = "cpu",
             max_len: int = 4096) -> EagleHead:
        from safetensors.torch import load_file

        directory = Path(directory)
        config_path = directory / HEAD_CONFIG_FILE
        if not config_path.is_file():
            raise FileNotFoundError(f"no draft head in {directory} (missing {HEAD_CONFIG_FILE})")
        head = cls(HeadConfig.from_dict(json.loads(config_path.read_text())), dtype=dtype, max_len=max_len)
        state = load_file(str(directory / HEAD_WEIGHTS_FILE))
        missing, unexpected = head.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v
                                                    for k, v in state.items()}, strict=False)
        if unexpected or [m for m in missing if not m.startswith("rotary")]:
            raise ValueError(f"head weights in {directory} do not match its config: missing {missing}, "
                             f"unexpected {unexpected}")
        return head.to(device).eval()


def _unrolled_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], *,
                        causal: torch.Tensor, first_anchor: int, scale: float) -> torch.Tensor:
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
