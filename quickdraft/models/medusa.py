"""Medusa heads: K small heads on the target's last hidden state, head k guessing token +k.

The target's own LM head turns the hidden state of token i into token i+1; Medusa head k
(k = 1..K) turns the same hidden state into a guess for token i+1+k, so one pass over the
heads drafts K depths at once, with no dependence between depths (cheap, and weaker at
depth than feature-level autoregression).  Each head is a residual block
``x + SiLU(W x + b)`` (W starts at zero: the head starts as the target's own next-token
prediction) followed by the draft vocabulary's rows of the target's LM head, borrowed like
the EAGLE head does (``d2t`` maps draft ids to target ids).  The input is the target's
final-normed last hidden state (what its LM head reads).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from quickdraft.models.heads import CopyMixture, CopyPath
from quickdraft.models.layers import LinearFn
from quickdraft.models.quantized import QuantizedWeight, matrix_weights, quantize_legacy

MEDUSA_CONFIG_FILE = "medusa_config.json"
MEDUSA_WEIGHTS_FILE = "medusa.safetensors"


@dataclass(frozen=True)
class MedusaConfig:
    hidden_size: int
    num_heads: int  # K: draft depths
    draft_vocab_size: int
    feature_layer: int  # the target's last layer
    copy_dim: int = 0  # [self] heads: width of a learned copy path (models/heads.py CopyPath); 0: none

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_heads", "draft_vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"medusa config {name} must be a positive integer, got {value!r}")
        if not isinstance(self.copy_dim, int) or isinstance(self.copy_dim, bool) or self.copy_dim < 0:
            raise ValueError(f"medusa config copy_dim must be a non-negative integer, got {self.copy_dim!r}")

    @classmethod
    def from_dict(cls, data: dict) -> MedusaConfig:
        unknown = sorted(set(data) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"unknown medusa config keys {unknown}")
        return cls(**data)


class MedusaHeads(torch.nn.Module):
    d2t: torch.Tensor  # [Vd] target id of each draft id (a buffer)
    linear: LinearFn

    def __init__(self, config: MedusaConfig, *, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = c = config
        # [K, D, D]: zero, so each head starts as the target's own next-token prediction
        self.weight = torch.nn.Parameter(torch.zeros(c.num_heads, c.hidden_size, c.hidden_size, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(c.num_heads, 1, c.hidden_size, dtype=dtype))  # [K, 1, D]
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))  # [Vd] target ids
        self.feature_layers = (c.feature_layer,)
        self._target = None  # borrowed: the target's final norm
        self.lm_rows: torch.Tensor | None = None  # [Vd, D]
        self.logit_softcap: float | None = None
        self.linear = F.linear  # drafters install their device's inference kernel
        # Quantized (Q4_0 by default) copies of the heads' matrices [K] and of lm_rows, read
        # instead of them when drafting on the quantized kernels (quantize_for_drafting); training
        # never sets them.
        self.draft_weights: list[QuantizedWeight] = []
        self.draft_lm_rows: QuantizedWeight | None = None
        if c.copy_dim and not isinstance(self, CopyPath):
            raise ValueError("medusa heads have no copy path (copy_dim is for [self] heads)")

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    def attach_target(self, target) -> None:
        object.__setattr__(self, "_target", target)  # not a submodule: not saved with the heads
        self.lm_rows = target.lm_head_weight.detach()[self.d2t].to(self.weight.dtype)
        self.logit_softcap = target.config.final_logit_softcapping

    def quantize_for_drafting(self, format: str = "Q8_0") -> None:
        """Draft with `format` (Q8_0, Q5_0, Q4_0) copies of the heads' matrices and the draft LM
        rows (Q8_0: a quarter of the float32 bytes, on the quantized CPU kernels), as EagleHead
        does beside a quantized target.  Call after attach_target; the float weights stay for
        training and saving."""
        if self.lm_rows is None:
            raise RuntimeError("quantize_for_drafting needs the target's LM rows: call attach_target first")
        self.draft_weights = [QuantizedWeight.from_parts([quantize_legacy(w, format)]) for w in self.weight]
        self.draft_lm_rows = QuantizedWeight.from_parts([quantize_legacy(self.lm_rows, format)])

    def set_draft_vocab(self, d2t: torch.Tensor) -> None:  # d2t [Vd]
        if d2t.shape != self.d2t.shape:
            raise ValueError(f"draft vocabulary has {d2t.shape[0]} ids, the heads expect {self.d2t.shape[0]}")
        self.d2t.copy_(d2t)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        # features [N, D] (the last layer, before the final norm) -> logits [K, N, Vd]
        x = self._target.norm(features.to(self._target.norm.weight.dtype)).to(self.weight.dtype)  # [N, D]
        if torch.is_grad_enabled():  # training: one batched matmul over the heads
            hidden = x[None] + F.silu(torch.matmul(x[None], self.weight.transpose(1, 2)) + self.bias)  # [K, N, D]
        else:
            weights = self.draft_weights or list(self.weight)
            hidden = torch.stack([x + F.silu(self.linear(x, w, b[0])) for w, b in zip(weights, self.bias)])
        lm_rows = self.lm_rows if self.draft_lm_rows is None or torch.is_grad_enabled() else self.draft_lm_rows
        logits = self.linear(hidden.reshape(-1, hidden.shape[-1]), lm_rows, None).view(*hidden.shape[:2], -1)
        if self.logit_softcap:
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits

    def training_logits(
        self, token_ids: torch.Tensor, features: torch.Tensor, *, depths: int, first_anchor: int = 0
    ) -> list[torch.Tensor]:
        """Per depth k (1..depths), the logits at anchors first_anchor..T-2 for token anchor+k+1.
        token_ids [T], features [T - 1, D]; same layout as EagleHead.unrolled_logits."""
        if depths > self.config.num_heads:
            raise ValueError(f"{depths} depths asked of {self.config.num_heads} medusa heads")
        logits = self(features[first_anchor:])
        return [logits[k] for k in range(depths)]

    def weights_per_draft_token(self) -> int:
        c = self.config
        return (self.weight.numel() + c.num_heads * self.lm_rows.numel()) // c.num_heads

    def save(self, directory: str | Path, *, dtype: torch.dtype = torch.bfloat16) -> None:
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {
            name: t.detach().to(dtype if t.is_floating_point() else t.dtype).contiguous()
            for name, t in self.state_dict().items()
        }
        save_file(state, str(directory / MEDUSA_WEIGHTS_FILE))
        (directory / MEDUSA_CONFIG_FILE).write_text(json.dumps(asdict(self.config), indent=1))

    @classmethod
    def load(cls, directory: str | Path, *, dtype: torch.dtype, device: torch.device | str = "cpu") -> MedusaHeads:
        from safetensors.torch import load_file

        directory = Path(directory)
        config_path = directory / MEDUSA_CONFIG_FILE
        if not config_path.is_file():
            raise FileNotFoundError(f"no medusa heads in {directory} (missing {MEDUSA_CONFIG_FILE})")
        heads = cls(MedusaConfig.from_dict(json.loads(config_path.read_text())), dtype=dtype)
        state = load_file(str(directory / MEDUSA_WEIGHTS_FILE))
        try:
            heads.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()})
        except RuntimeError as err:
            raise ValueError(f"medusa weights in {directory} do not match its config: {err}") from err
        return heads.to(device).eval()


class LayerSkipHead(CopyPath, MedusaHeads):
    """The light head of `[self]` drafting: one residual block + the draft LM rows on the output of
    the target's first ``feature_layer + 1`` layers, predicting the *next* token (what the full
    target would).  Drafting runs the target's early layers on each draft token, so every depth
    uses the same head.

    With a copy path (``copy_dim`` > 0) the head also copies from the context, induction-head
    style: every committed token's early-layer output is a key whose value is the token that
    followed it, and a draft node's early-layer output queries them (CopyPath).
    """

    def __init__(self, config: MedusaConfig, *, dtype: torch.dtype = torch.float32):
        if config.num_heads != 1:
            raise ValueError(f"a layer-skip head has one head, the config says {config.num_heads}")
        super().__init__(config, dtype=dtype)
        self.t2d: torch.Tensor | None = None  # [V] draft id of each target id (copy path only)
        if config.copy_dim:
            self.add_copy_path(config.hidden_size, copy_dim=config.copy_dim, eps=1e-6, dtype=dtype)

    def attach_target(self, target) -> None:
        super().attach_target(target)
        if self.config.copy_dim:
            self.attach_copy_vocabulary(target.config.vocab_size)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [m, D] early-layer output -> [m, Vd]
        return self(hidden)[0]

    @property
    def exit_layer(self) -> int:
        """Target layers the drafter runs."""
        return self.config.feature_layer + 1

    def training_logits(
        self, token_ids: torch.Tensor, features: torch.Tensor, *, depths: int, first_anchor: int = 0
    ) -> list[torch.Tensor]:
        """Same layout as EagleHead.unrolled_logits: depth d at anchor j predicts token j+d+1,
        here from the early-layer feature of token j+d (teacher forcing is exact for a greedy
        chain, which runs the early layers on its own, so far correct, tokens)."""
        n = features.shape[0]
        next_token_logits = self(features)[0]  # [n, Vd]: row i predicts token i + 1
        padded = torch.cat([next_token_logits, next_token_logits.new_zeros(depths, next_token_logits.shape[1])])
        return [padded[first_anchor + depth : n + depth] for depth in range(1, depths + 1)]

    def unrolled_mixtures(
        self, token_ids: torch.Tensor, features: torch.Tensor, *, depths: int, first_anchor: int = 0
    ) -> list[CopyMixture]:
        """The training forward of a head with a copy path, rows as in `training_logits`: depth d
        at anchor j reads the feature of token j+d and copies from the entries 0..j (entry i's
        value is token i+1: up to the draft root, token j+1, all committed when drafting)."""
        n = features.shape[0]  # T - 1
        keys = self.copy_keys(features)  # [n, C]
        values = token_ids[1 : n + 1]  # [n]
        padded = torch.cat([features, features.new_zeros(depths, features.shape[1])])  # [n + depths, D]
        anchors = torch.arange(n, device=token_ids.device)
        eligible = anchors[None, :] <= anchors[first_anchor:, None]  # [m, n]
        return [
            self.mixture(padded[first_anchor + depth : n + depth], keys=keys, values=values, eligible=eligible)
            for depth in range(1, depths + 1)
        ]

    def weights_per_draft_token(self) -> int:
        early = sum(matrix_weights(layer) for layer in self._target.layers[: self.exit_layer])
        return early + self.weight.numel() + self.lm_rows.numel()
