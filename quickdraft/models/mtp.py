"""Multi-token-prediction (MTP) layers in the DeepSeek-V3 / MiMo "nextn" layout.

A checkpoint with ``num_nextn_predict_layers = n`` in its config stores, after its
``num_hidden_layers`` decoder layers, n more under ``model.layers.{num_hidden_layers + k}.``:

- ``enorm``, ``hnorm``: RMSNorms of the next token's embedding and of the previous hidden state;
- ``eh_proj`` [D, 2D]: projects their concatenation (embedding first) to the hidden size;
- one decoder block of the model's own architecture (``self_attn.*``, ``mlp.*``, its norms);
- ``shared_head.norm`` and, optionally, ``shared_head.head`` (else the model's LM head).

For the first draft depth the previous hidden state is the target's final-normed last hidden
state (what its LM head reads); deeper depths feed the layer's own block output back, as
EAGLE does, so the same drafter (``quickdraft.drafters.eagle``) drives both.  The layer attends
over its own cache at full attention (a sliding window would only matter past it).

``MtpHead`` is trainable too (``quickdraft train-head --method mtp``, started from the target's
last layer): its weights are written in the same layout (``nextn_tensors``), so a head we train
is a valid MTP layer for the target's checkpoint; a trained head may draft over a reduced
vocabulary (``draft_vocab.safetensors`` next to it), its LM rows taken from the shared head.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from quickdraft.models.config import FULL_ATTENTION, ModelConfig
from quickdraft.models.decoder import DecoderLayer
from quickdraft.models.heads import FeatureHead, HeadConfig
from quickdraft.models.layers import RMSNorm, RotaryTable
from quickdraft.models.loader import (
    DRAFT_VOCAB_FILE,
    convert_hf_tensors,
    hf_layer_tensors,
    hf_tensors_from_state,
    read_draft_vocab,
    read_hf_config,
    read_hf_tensors,
)

MTP_WEIGHTS_FILE = "mtp.safetensors"
MTP_CONFIG_FILE = "config.json"


class MtpHead(FeatureHead):
    def __init__(
        self,
        target_config: ModelConfig,
        *,
        dtype: torch.dtype = torch.float32,
        max_len: int = 4096,
        own_lm_head: bool = False,
        draft_vocab_size: int | None = None,
    ):
        super().__init__()
        c = target_config
        self.target_config = c
        # The block is a decoder layer of the target's own architecture, with one full-attention layer.
        self.layer_config = dataclasses.replace(
            c, num_layers=1, layer_types=(FULL_ATTENTION,), no_rope_layers=(), moe_layers=()
        )
        self.layer = DecoderLayer(self.layer_config, layer_index=0, dtype=dtype)

        def norm() -> RMSNorm:
            return RMSNorm((c.hidden_size,), eps=c.rms_norm_eps, unit_offset=c.norm_unit_offset, dtype=dtype)

        self.enorm, self.hnorm, self.head_norm = norm(), norm(), norm()
        self.eh_proj = torch.nn.Parameter(
            torch.empty(c.hidden_size, 2 * c.hidden_size, dtype=dtype), requires_grad=False
        )
        self.lm_head = (
            torch.nn.Parameter(torch.empty(c.vocab_size, c.hidden_size, dtype=dtype), requires_grad=False)
            if own_lm_head
            else None
        )
        self.config = HeadConfig(
            hidden_size=c.hidden_size,
            num_heads=c.num_heads,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            intermediate_size=c.intermediate_size,
            feature_layers=(c.num_layers - 1,),
            draft_vocab_size=draft_vocab_size or c.vocab_size,
            rms_norm_eps=c.rms_norm_eps,
            activation=c.activation,
        )
        self.attn_scale = c.attn_scale
        # [Vd] target ids the head drafts over: the full vocabulary unless trained on a reduced one
        self.register_buffer("d2t", torch.arange(self.config.draft_vocab_size))
        rope = c.rope_by_layer_type[FULL_ATTENTION]
        self.rotary = RotaryTable(rope, head_dim=c.head_dim, max_len=max_len, dtype=dtype)
        self._target = None  # the target Decoder (embedding, final norm, LM head), not a submodule

    # ---- the target's tensors --------------------------------------------------------------
    def attach_target(self, target) -> None:
        object.__setattr__(self, "_target", target)  # borrowed, kept out of state_dict
        weight = target.lm_head_weight if self.lm_head is None else self.lm_head
        self.lm_rows = weight.detach()[self.d2t].to(self.dtype)  # [Vd, D]
        self.logit_softcap = target.config.final_logit_softcapping

    def set_draft_vocab(self, d2t: torch.Tensor) -> None:  # d2t [Vd]
        if d2t.shape != self.d2t.shape:
            raise ValueError(f"draft vocabulary has {d2t.shape[0]} ids, the head expects {self.d2t.shape[0]}")
        self.d2t.copy_(d2t)

    def initialise_from(self, target) -> None:
        """A trainable start: the block copies the target's last layer, the output norm its final
        norm, the input norms are neutral and eh_proj is random (torch's Linear init)."""
        with torch.no_grad():
            self.layer.load_state_dict(target.layers[-1].state_dict())
            self.head_norm.load_state_dict(target.norm.state_dict())
            neutral = 1.0  # stored weight of an identity-scaled norm, in either norm convention
            self.enorm.weight.fill_(neutral)
            self.hnorm.weight.fill_(neutral)
            bound = self.eh_proj.shape[1] ** -0.5
            self.eh_proj.uniform_(-bound, bound)
        for param in self.parameters():
            param.requires_grad_(True)

    # ---- pieces the drafter and trainer drive ------------------------------------------------
    def fuse_features(self, features: torch.Tensor) -> torch.Tensor:  # [..., D] last layer -> [..., D]
        return self._target.norm(features)  # MTP reads the final-normed hidden state

    def input_hidden(self, token_ids: torch.Tensor, feature: torch.Tensor) -> torch.Tensor:
        # token_ids [...], feature [..., D] -> [..., D]
        embedded = self._target.embed(token_ids).to(feature.dtype)
        return self.linear(torch.cat([self.enorm(embedded), self.hnorm(feature)], dim=-1), self.eh_proj, None)

    def attention_inputs(self, hidden: torch.Tensor, positions: torch.Tensor):
        # hidden [N, D], positions [N] -> q [N, H, hd], k and v [N, Hkv, hd]
        return self.layer.attention_inputs(hidden, rotary=self.rotary.lookup(positions), linear=self.linear)

    def block_output(self, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        # hidden [N, D], attended [N, H * hd] -> [N, D]
        return self.layer.block_output(hidden, attended, linear=self.linear)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., D] -> [..., V]
        logits = self.linear(self.head_norm(hidden), self.lm_rows, None)
        if self.logit_softcap:
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits

    # ---- the nextn layout ---------------------------------------------------------------------
    @classmethod
    def from_checkpoint(
        cls,
        model_dir: str | Path,
        *,
        target_config: ModelConfig,
        layer: int = 0,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        max_len: int = 4096,
    ) -> MtpHead:
        """MTP layer `layer` of a checkpoint in the nextn layout (a model dir, or a dir written by
        ``save``)."""
        model_dir = Path(model_dir)
        hf = read_hf_config(model_dir)
        count = int(hf.get("num_nextn_predict_layers") or 0)
        if count < 1:
            raise ValueError(
                f"{model_dir} has no multi-token-prediction layers (num_nextn_predict_layers "
                f"is {hf.get('num_nextn_predict_layers')!r} in its config.json)"
            )
        if not 0 <= layer < count:
            raise ValueError(f"MTP layer {layer} requested; {model_dir} has {count}")
        base = target_config.num_layers
        if int(hf.get("num_hidden_layers", base)) != base:
            raise ValueError(
                f"{model_dir} holds MTP layers for a {hf.get('num_hidden_layers')}-layer model; the target has {base}"
            )
        index = base + layer
        prefix = f"model.layers.{index}."
        tensors = read_hf_tensors(model_dir, prefix=prefix)
        d2t = read_draft_vocab(model_dir)
        head = cls(
            target_config,
            dtype=dtype,
            max_len=max_len,
            own_lm_head=prefix + "shared_head.head.weight" in tensors,
            draft_vocab_size=None if d2t is None else d2t.shape[0],
        )
        if d2t is not None:
            head.set_draft_vocab(d2t)
        state = convert_hf_tensors(head.layer_config, _nextn_plan(head, index), tensors)
        own = head.state_dict()
        for name, tensor in state.items():
            if own[name].shape != tensor.shape:
                raise ValueError(
                    f"MTP tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(own[name].shape)}"
                )
            own[name].copy_(tensor)
        return head.to(device).eval()

    def nextn_tensors(self, *, index: int) -> dict[str, torch.Tensor]:
        """This layer's weights under the checkpoint names of MTP layer `index` (HF conventions:
        separate q/k/v, gate/up, Gemma norms stored without the folded 1)."""
        return hf_tensors_from_state(self.layer_config, _nextn_plan(self, index), self.state_dict())

    def save(self, directory: str | Path, *, dtype: torch.dtype = torch.bfloat16) -> None:
        """A folder in the nextn layout: ``mtp.safetensors`` + a config.json naming the layer."""
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        index = self.target_config.num_layers
        tensors = {name: t.to(dtype) for name, t in self.nextn_tensors(index=index).items()}
        save_file(tensors, str(directory / MTP_WEIGHTS_FILE))
        if self.d2t.shape[0] < self.target_config.vocab_size:  # drafted over a reduced vocabulary
            save_file({"d2t": self.d2t.clone()}, str(directory / DRAFT_VOCAB_FILE))
        config = {
            "num_hidden_layers": index,
            "num_nextn_predict_layers": 1,
            "note": "MTP layer in the DeepSeek-V3 nextn layout, written by quickdraft train-head",
        }
        (directory / MTP_CONFIG_FILE).write_text(json.dumps(config, indent=1))


def _nextn_plan(head: MtpHead, index: int) -> dict[str, list[str]]:
    """Our MtpHead parameter -> the checkpoint tensors fused into it."""
    p = f"model.layers.{index}."
    plan = {f"layer.{ours}": theirs for ours, theirs in hf_layer_tensors(head.layer_config, index).items()}
    plan.update(
        {
            "enorm.weight": [p + "enorm.weight"],
            "hnorm.weight": [p + "hnorm.weight"],
            "eh_proj": [p + "eh_proj.weight"],
            "head_norm.weight": [p + "shared_head.norm.weight"],
        }
    )
    if head.lm_head is not None:
        plan["lm_head"] = [p + "shared_head.head.weight"]
    return plan
