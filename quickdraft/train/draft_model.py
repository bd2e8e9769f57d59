"""A small draft LM distilled from the target, over a reduced vocabulary.

``quickdraft train-head --method draft`` builds it: a few decoder layers of the target's own
architecture, initialised from evenly spaced target layers, with an embedding (tied to its
LM head) holding only the draft vocabulary's rows of the target's embedding plus one row for
"any other token", then trained on the target's own answers.  It is written as a plain HF
checkpoint (config.json, model.safetensors) plus ``draft_vocab.safetensors`` (``d2t``: the
target id of each draft id; the last draft id is the "other" token), which the
``draft_model`` drafter reads: it maps the target's tokens into the draft vocabulary and
the draft logits back, so the classic two-model method runs with a cheap LM head.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from quickdraft.kernels.fixed_rows import sdpa_rows
from quickdraft.models.config import ModelConfig
from quickdraft.models.decoder import DecoderLayer
from quickdraft.models.layers import RMSNorm, RotaryTable
from quickdraft.models.loader import DRAFT_VOCAB_FILE, hf_layer_tensors, hf_tensors_from_state, read_hf_config


def source_layers(num_target_layers: int, num_layers: int) -> list[int]:
    """Evenly spaced target layers (first and last included) to initialise `num_layers` from."""
    if not 1 <= num_layers <= num_target_layers:
        raise ValueError(f"a draft model of {num_layers} layers cannot come from {num_target_layers} target layers")
    if num_layers == 1:
        return [0]
    return [round(i * (num_target_layers - 1) / (num_layers - 1)) for i in range(num_layers)]


class DraftLM(torch.nn.Module):
    def __init__(
        self,
        target_config: ModelConfig,
        *,
        num_layers: int,
        draft_vocab_size: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        self.sources = source_layers(target_config.num_layers, num_layers)
        self.config = c = dataclasses.replace(
            target_config,
            num_layers=num_layers,
            vocab_size=draft_vocab_size + 1,
            tie_word_embeddings=True,
            layer_types=tuple(target_config.layer_types[i] for i in self.sources),
            no_rope_layers=tuple(j for j, i in enumerate(self.sources) if i in target_config.no_rope_layers),
            moe_layers=tuple(j for j, i in enumerate(self.sources) if i in target_config.moe_layers),
        )
        self.embed_tokens = torch.nn.Parameter(torch.zeros(c.vocab_size, c.hidden_size, dtype=dtype))
        self.layers = torch.nn.ModuleList(DecoderLayer(c, layer_index=i, dtype=dtype) for i in range(num_layers))
        self.norm = RMSNorm((c.hidden_size,), eps=c.rms_norm_eps, unit_offset=c.norm_unit_offset, dtype=dtype)
        self.rotary = torch.nn.ModuleDict(
            {
                key: RotaryTable(c.rope_for(key), head_dim=c.head_dim, max_len=max_len, dtype=dtype)
                for key in c.rotary_keys
            }
        )
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))  # [Vd] target ids
        self.embed_scale = c.embed_scale
        self._t2d: torch.Tensor | None = None

    feature_layers: tuple[int, ...] = ()  # a draft model reads tokens only

    @property
    def other_token(self) -> int:
        return self.config.vocab_size - 1

    def set_draft_vocab(self, d2t: torch.Tensor) -> None:  # d2t [Vd]
        if d2t.shape != self.d2t.shape:
            raise ValueError(f"draft vocabulary has {d2t.shape[0]} ids, the model expects {self.d2t.shape[0]}")
        self.d2t.copy_(d2t)

    def attach_target(self, target) -> None:
        """Initialise from the target Decoder: embedding rows, the source layers, the final norm."""
        with torch.no_grad():
            rows = target.embed_tokens.detach()[self.d2t].float()
            self.embed_tokens.copy_(torch.cat([rows, target.embed_tokens.detach().float().mean(0, keepdim=True)]))
            for layer, source in zip(self.layers, self.sources):
                layer.load_state_dict(target.layers[source].state_dict())
            self.norm.load_state_dict(target.norm.state_dict())
        for param in self.parameters():
            param.requires_grad_(True)
        self._t2d = torch.full((target.config.vocab_size,), self.other_token, dtype=torch.long)
        self._t2d[self.d2t] = torch.arange(self.d2t.shape[0])

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        # token_ids [T] target ids -> logits [T, Vd] over the draft vocabulary (the "other" id dropped)
        c = self.config
        hidden = F.embedding(self._t2d[token_ids], self.embed_tokens)
        if self.embed_scale is not None:
            hidden = hidden * self.embed_scale
        positions = torch.arange(token_ids.shape[0])
        causal = torch.ones(len(positions), len(positions), dtype=torch.bool).tril()
        for layer in self.layers:
            sliding = layer.is_sliding
            mask = causal & (positions[:, None] - positions[None, :] < c.sliding_window) if sliding else causal
            rotary = self.rotary[layer.rotary_key].lookup(positions)
            q, k, v = layer.attention_inputs(hidden, rotary=rotary, linear=F.linear)
            attended = sdpa_rows(  # differentiable; with the target's score cap (Gemma 2), as the engine runs it
                q, k.transpose(0, 1), v.transpose(0, 1), mask=mask, scale=c.attn_scale, softcap=c.attn_logit_softcapping
            )
            hidden = layer.block_output(hidden, attended.reshape(len(positions), -1), linear=F.linear)
        logits = F.linear(self.norm(hidden), self.embed_tokens[: self.other_token])
        cap = c.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits

    def training_logits(
        self, token_ids: torch.Tensor, features: torch.Tensor, *, depths: int, first_anchor: int = 0
    ) -> list[torch.Tensor]:
        """EagleHead.unrolled_logits' layout: depth d at anchor j predicts token j+d+1 (from the
        model's prediction after token j+d; a greedy chain only goes on while it is right)."""
        n = token_ids.shape[0] - 1
        next_token_logits = self(token_ids[:n])  # row i predicts token i + 1
        padded = torch.cat([next_token_logits, next_token_logits.new_zeros(depths, next_token_logits.shape[1])])
        return [padded[first_anchor + depth : n + depth] for depth in range(1, depths + 1)]

    def weights_per_draft_token(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.dim() == 2)

    # ---- files: a HF checkpoint the loaders read --------------------------------------------
    def save(self, directory: str | Path, *, target_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        plan = {"embed_tokens": ["model.embed_tokens.weight"], "norm.weight": ["model.norm.weight"]}
        for index in range(self.config.num_layers):
            plan.update(
                {f"layers.{index}.{ours}": theirs for ours, theirs in hf_layer_tensors(self.config, index).items()}
            )
        tensors = hf_tensors_from_state(self.config, plan, self.state_dict())
        save_file({name: t.to(dtype) for name, t in tensors.items()}, str(directory / "model.safetensors"))
        save_file({"d2t": self.d2t.clone()}, str(directory / DRAFT_VOCAB_FILE))
        hf = read_hf_config(Path(target_dir))
        hf.update(
            num_hidden_layers=self.config.num_layers,
            vocab_size=self.config.vocab_size,
            tie_word_embeddings=True,
            quickdraft_draft_of=str(target_dir),
            quickdraft_source_layers=self.sources,
        )
        if "layer_types" in hf:
            hf["layer_types"] = list(self.config.layer_types)
        hf.pop("sliding_window_pattern", None)
        (directory / "config.json").write_text(json.dumps(hf, indent=1))
