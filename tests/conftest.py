"""Shared fixtures: tiny random checkpoints written with transformers' own config classes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


def pytest_configure(config):
    """Build the C++ kernels once, before pytest-xdist starts its workers (the controller, or the
    only process): a test then never waits minutes for a first build, nor on a build that a server
    subprocess stopped by an earlier test left half done."""
    if hasattr(config, "workerinput") or config.option.collectonly:
        return
    from quickdraft.kernels import build_cpu_kernels

    build_cpu_kernels(threads=2)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's, which appends each test's group to its id
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist's ``--dist loadgroup`` (scripts/test.sh): a test file runs on one worker,
    so its module fixtures (trained heads, servers) are built once; files marked
    ``xdist_group("ray")`` share one worker, so one Ray instance runs at a time."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


def pytest_xdist_node_collection_finished(node, ids):
    """Run by the xdist controller: a worker whose tests came back without their group stops the
    run. Ungrouped, two workers ran Ray tests at once, which hung CI for 90 minutes (pytest 9.2
    keeps a node's id where pytest-xdist 3.8 cannot append the group, so ``--dist loadgroup``
    silently stopped grouping; pyproject.toml pins pytest below it)."""
    if node.config.getoption("dist") != "loadgroup":
        return
    ungrouped = [nodeid for nodeid in ids if "@" not in nodeid]
    if ungrouped:
        pytest.exit(
            f"pytest-xdist did not group {len(ungrouped)} tests (e.g. {ungrouped[0]}): this pytest "
            f"({pytest.__version__}) and pytest-xdist do not work together under --dist loadgroup",
            returncode=pytest.ExitCode.USAGE_ERROR,
        )


TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=320,
    max_position_embeddings=512,
)


PHI3_ORIGINAL_CONTEXT = 64
# gpt-oss's YaRN (untruncated), its original context shrunk to 32 positions for tiny models
GPT_OSS_TINY_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
}


def tiny_hf_config(arch: str):
    import transformers

    if arch == "gemma3":
        return transformers.Gemma3TextConfig(
            **TINY,
            head_dim=16,
            sliding_window=8,
            query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            bos_token_id=2,
            eos_token_id=1,
            pad_token_id=0,
        )
    if arch == "llama":
        return transformers.LlamaConfig(
            **{**TINY, "max_position_embeddings": 16384},
            bos_token_id=1,
            eos_token_id=2,
            rope_parameters={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
                "rope_theta": 500000.0,
            },
        )
    if arch == "gemma2":
        # caps far below Gemma 2's (50 and 30), so that a tiny random model's scores and logits
        # reach them and a missing cap changes the result
        return transformers.Gemma2Config(
            **TINY,
            head_dim=16,
            sliding_window=8,
            query_pre_attn_scalar=16,
            attn_logit_softcapping=0.5,
            final_logit_softcapping=2.0,
            bos_token_id=2,
            eos_token_id=1,
            pad_token_id=0,
        )
    if arch == "mistral":  # a sliding window on every layer, as Mistral 7B v0.1 has
        return transformers.MistralConfig(**TINY, head_dim=16, sliding_window=8, bos_token_id=1, eos_token_id=2)
    if arch == "phi3":
        # Phi-4-mini's shape: fused projections, partial rotary, LongRoPE; sequences past 64 positions
        # use the long factors (in transformers, and here where max_model_len is past 64)
        return transformers.Phi3Config(
            **TINY,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            sliding_window=None,
            tie_word_embeddings=True,
            original_max_position_embeddings=PHI3_ORIGINAL_CONTEXT,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
                "original_max_position_embeddings": PHI3_ORIGINAL_CONTEXT,
                "short_factor": [1.0, 1.25, 1.5, 2.0],
                "long_factor": [1.0, 2.0, 4.0, 8.0],
            },
        )
    if arch == "smollm3":  # its 4th layer without rotary embeddings (NoPE)
        return transformers.SmolLM3Config(**TINY, head_dim=16, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "qwen3_moe":  # 4 experts, 2 per token; layer 1 a dense MLP (mlp_only_layers)
        return transformers.Qwen3MoeConfig(
            **TINY,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            mlp_only_layers=[1],
            norm_topk_prob=True,
            bos_token_id=1,
            eos_token_id=2,
        )
    if arch == "qwen2_moe":  # 4 experts, 2 per token, not renormalised; a gated shared expert; layer 1 dense
        return transformers.Qwen2MoeConfig(
            **TINY,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            mlp_only_layers=[1],
            norm_topk_prob=False,
            bos_token_id=1,
            eos_token_id=2,
        )
    if arch == "gpt_oss":  # sliding and full layers in turn, sinks, biased router and experts, YaRN untruncated
        return transformers.GptOssConfig(
            **{**TINY, "intermediate_size": 32},
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=8,
            rope_parameters=GPT_OSS_TINY_ROPE,
            bos_token_id=1,
            eos_token_id=2,
        )
    if arch == "mixtral":  # 4 experts of intermediate_size, 2 per token, in every layer
        return transformers.MixtralConfig(
            **{**TINY, "intermediate_size": 32},
            num_local_experts=4,
            num_experts_per_tok=2,
            bos_token_id=1,
            eos_token_id=2,
        )
    if arch == "qwen2":
        return transformers.Qwen2Config(**TINY, bos_token_id=1, eos_token_id=2)
    if arch == "qwen3":
        return transformers.Qwen3Config(**TINY, head_dim=16, bos_token_id=1, eos_token_id=2)
    if arch == "qwen3_yarn":  # YaRN past a 32-token original context, as Qwen3's long-context configs
        return transformers.Qwen3Config(
            **TINY,
            head_dim=16,
            bos_token_id=1,
            eos_token_id=2,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        )
    raise ValueError(arch)


def build_tiny_checkpoint(arch: str, out_dir: Path, *, seed: int = 0, qk_scale: float = 1.0) -> Path:
    """A random HF model saved to out_dir (config.json + model.safetensors).  qk_scale multiplies
    the query and key projections: at transformers' init scale a tiny model's attention scores
    are so small that its attention is nearly uniform, and position handling barely shows."""
    import transformers

    torch.manual_seed(seed)
    config = tiny_hf_config(arch)
    model_cls = transformers.Gemma3ForCausalLM if arch == "gemma3" else transformers.AutoModelForCausalLM
    model = (model_cls(config) if arch == "gemma3" else model_cls.from_config(config)).float().eval()
    with torch.no_grad():  # random norm weights, so a norm convention bug cannot hide at 1.0
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(("bias", "sinks")):  # gpt-oss's sinks: per-head logits
                param.normal_(0.0, 0.3)
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(qk_scale)
            if name.endswith("qkv_proj.weight"):  # Phi-3: the query and key rows, not the values
                head_dim = config.hidden_size // config.num_attention_heads
                param[: (config.num_attention_heads + config.num_key_value_heads) * head_dim].mul_(qk_scale)
    model.save_pretrained(out_dir)
    write_tiny_tokenizer(
        out_dir,
        bos="<bos>" if arch.startswith("gemma") else "<s>",
        eos="<eos>" if arch.startswith("gemma") else "</s>",
        chat=arch == "qwen3",
    )
    return out_dir


CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def write_tiny_tokenizer(out_dir: Path, *, bos: str, eos: str, chat: bool) -> None:
    """A byte-level tokenizer (no merges) whose ids fit the tiny vocabulary of 320."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    specials = ["<pad>", eos, bos] if bos == "<bos>" else ["<pad>", bos, eos]
    vocab = {tok: i for i, tok in enumerate(specials)}
    for char in sorted(ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(specials)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {"bos_token": bos, "eos_token": eos, "pad_token": "<pad>", "add_bos_token": True}
    if chat:
        config["chat_template"] = CHAT_TEMPLATE
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config))


ARCHS = ("gemma3", "llama", "qwen2", "qwen3")
# Architectures tested in tests/models/test_architectures.py only (ARCHS runs through every suite).
MORE_ARCHS = ("gemma2", "mistral", "phi3", "smollm3", "qwen3_moe", "qwen2_moe", "mixtral", "qwen3_yarn", "gpt_oss")


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: build_tiny_checkpoint(arch, root / arch) for arch in ARCHS}
