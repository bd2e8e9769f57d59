"""EAGLE-3 heads in the `speculators` and SpecForge formats: read into Eagle3Head, its draft logits
equal to the EAGLE-3 network built from transformers' own Llama / Qwen3 layers, drafting exact."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import save_file

from quickdraft import LLM, SamplingParams
from quickdraft.models.eagle3 import Eagle3Head, detect_eagle3_format
from tests.engine.test_speculative import repetitive_prompts

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, VOCAB, DRAFT_VOCAB = 64, 4, 2, 16, 96, 320, 200


def layer_config(layer_type: str) -> dict:
    return dict(
        model_type=layer_type,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=1,
        vocab_size=VOCAB,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        hidden_act="silu",
    )


def random_tensors(*, layer_type: str, prefix: str, num_aux: int, seed: int, embedding: bool) -> dict:
    """Random EAGLE-3 weights under the checkpoint names (`prefix`: layers.0. or midlayer.)."""
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.2):
        return torch.randn(*shape, generator=generator) * scale

    p = prefix
    tensors = {
        "fc.weight": rand(HIDDEN, num_aux * HIDDEN),
        p + "input_layernorm.weight": 1 + rand(HIDDEN, scale=0.1),
        p + "hidden_norm.weight": 1 + rand(HIDDEN, scale=0.1),
        p + "self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, 2 * HIDDEN),
        p + "self_attn.k_proj.weight": rand(KV_HEADS * HEAD_DIM, 2 * HIDDEN),
        p + "self_attn.v_proj.weight": rand(KV_HEADS * HEAD_DIM, 2 * HIDDEN),
        p + "self_attn.o_proj.weight": rand(HIDDEN, HEADS * HEAD_DIM),
        p + "post_attention_layernorm.weight": 1 + rand(HIDDEN, scale=0.1),
        p + "mlp.gate_proj.weight": rand(INTERMEDIATE, HIDDEN),
        p + "mlp.up_proj.weight": rand(INTERMEDIATE, HIDDEN),
        p + "mlp.down_proj.weight": rand(HIDDEN, INTERMEDIATE),
        "norm.weight": 1 + rand(HIDDEN, scale=0.1),
        "lm_head.weight": rand(DRAFT_VOCAB, HIDDEN, scale=0.5),
    }
    if layer_type == "qwen3":
        tensors[p + "self_attn.q_norm.weight"] = 1 + rand(HEAD_DIM, scale=0.1)
        tensors[p + "self_attn.k_norm.weight"] = 1 + rand(HEAD_DIM, scale=0.1)
    target_ids = torch.randperm(VOCAB, generator=generator)[:DRAFT_VOCAB].sort().values
    tensors["d2t"] = target_ids - torch.arange(DRAFT_VOCAB)  # offsets, as EAGLE-3 stores them
    tensors["t2d"] = torch.zeros(VOCAB, dtype=torch.bool)
    tensors["t2d"][target_ids] = True
    if embedding:
        tensors["embed_tokens.weight"] = rand(VOCAB, HIDDEN, scale=1.0)
    return tensors


def write_speculators_head(
    directory, *, layer_type="llama", aux=(1, 2, 4), norm_before_residual=False, seed=0, embedding=False, **extra
):
    directory.mkdir(parents=True, exist_ok=True)
    tensors = random_tensors(
        layer_type=layer_type, prefix="layers.0.", num_aux=len(aux), seed=seed, embedding=embedding
    )
    save_file(tensors, str(directory / "model.safetensors"))
    config = {
        "speculators_model_type": "eagle3",
        "architectures": ["Eagle3Speculator"],
        "transformer_layer_config": layer_config(layer_type),
        "draft_vocab_size": DRAFT_VOCAB,
        "norm_before_residual": norm_before_residual,
        "eagle_aux_hidden_state_layer_ids": list(aux),
        "speculators_config": {"algorithm": "eagle3", "verifier": {"name_or_path": "tiny", "architectures": []}},
        **extra,
    }
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def write_specforge_head(directory, *, seed=0):
    """SpecForge's LlamaForCausalLMEagle3: a flat Llama config, `midlayer.*`, default aux layers."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors = random_tensors(layer_type="llama", prefix="midlayer.", num_aux=3, seed=seed, embedding=False)
    save_file(tensors, str(directory / "model.safetensors"))
    config = {**layer_config("llama"), "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": DRAFT_VOCAB}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def reference_logits(directory, tensors, *, token_ids, features, layer_type, norm_before_residual, embed):
    """Depth-1 draft logits of every anchor, by the EAGLE-3 network built from transformers'
    layers: fc; input_layernorm(embedding) and hidden_norm(feature) side by side into q/k/v of
    2D; residual = the feature; causal attention at positions anchor + 1."""
    hf = transformers.AutoConfig.for_model(**layer_config(layer_type))
    hf._attn_implementation = "eager"
    modeling = (
        transformers.models.qwen3.modeling_qwen3 if layer_type == "qwen3" else transformers.models.llama.modeling_llama
    )
    layer_class = modeling.Qwen3DecoderLayer if layer_type == "qwen3" else modeling.LlamaDecoderLayer
    layer = layer_class(hf, layer_idx=0)
    layer.self_attn.q_proj = torch.nn.Linear(2 * HIDDEN, HEADS * HEAD_DIM, bias=False)
    layer.self_attn.k_proj = torch.nn.Linear(2 * HIDDEN, KV_HEADS * HEAD_DIM, bias=False)
    layer.self_attn.v_proj = torch.nn.Linear(2 * HIDDEN, KV_HEADS * HEAD_DIM, bias=False)
    prefix = "layers.0." if "layers.0.hidden_norm.weight" in tensors else "midlayer."
    layer.load_state_dict(
        {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix) and "hidden_norm" not in k}
    )
    hidden_norm = modeling.LlamaRMSNorm(HIDDEN, eps=1e-6) if layer_type == "llama" else modeling.Qwen3RMSNorm(HIDDEN)
    hidden_norm.weight.data = tensors[prefix + "hidden_norm.weight"]
    final_norm = modeling.LlamaRMSNorm(HIDDEN, eps=1e-6) if layer_type == "llama" else modeling.Qwen3RMSNorm(HIDDEN)
    final_norm.weight.data = tensors["norm.weight"]
    rotary = (modeling.Qwen3RotaryEmbedding if layer_type == "qwen3" else modeling.LlamaRotaryEmbedding)(hf)
    with torch.no_grad():
        n = token_ids.shape[0] - 1
        feature = features[:n] @ tensors["fc.weight"].T  # [n, D]
        embeds = embed[token_ids[1 : n + 1]]
        normed = hidden_norm(feature)
        x = torch.cat([layer.input_layernorm(embeds), normed], dim=-1)[None]
        positions = torch.arange(n)[None] + 1
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        attended, _ = layer.self_attn(
            hidden_states=x, position_embeddings=rotary(x, positions), attention_mask=mask, position_ids=positions
        )
        hidden = (normed if norm_before_residual else feature)[None] + attended
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return final_norm(hidden[0]) @ tensors["lm_head.weight"].T  # [n, Vd]


class _Target:
    """What attach_target reads of a target decoder."""

    def __init__(self, embed):
        self.embed_tokens = embed
        self.config = type("Config", (), {"vocab_size": VOCAB})()


@pytest.mark.parametrize(
    "layer_type, norm_before_residual, embedding, specforge",
    [
        ("llama", False, False, False),
        ("llama", True, True, False),
        ("qwen3", False, False, False),
        ("llama", False, False, True),
    ],
)
def test_draft_logits_equal_the_eagle3_network(tmp_path, layer_type, norm_before_residual, embedding, specforge):
    if specforge:
        directory = write_specforge_head(tmp_path / "head")
    else:
        directory = write_speculators_head(
            tmp_path / "head", layer_type=layer_type, norm_before_residual=norm_before_residual, embedding=embedding
        )
    from safetensors.torch import load_file

    tensors = load_file(str(directory / "model.safetensors"))
    head = Eagle3Head.load(directory, target_num_layers=4, dtype=torch.float32)
    assert head.feature_layers == ((1, 1, 0) if specforge else (0, 1, 3))  # hidden-state index - 1
    target_embed = torch.randn(VOCAB, HIDDEN)
    head.attach_target(_Target(target_embed))
    embed = tensors["embed_tokens.weight"] if embedding else target_embed
    token_ids = torch.randint(0, VOCAB, (12,))
    features = torch.randn(11, 3 * HIDDEN)
    (ours,) = head.unrolled_logits(token_ids, features, depths=1)
    expected = reference_logits(
        directory,
        tensors,
        token_ids=token_ids,
        features=features,
        layer_type=layer_type,
        norm_before_residual=norm_before_residual,
        embed=embed,
    )
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4)
    assert head.d2t.tolist() == (torch.arange(DRAFT_VOCAB) + tensors["d2t"]).tolist()
    assert bool(tensors["t2d"][head.d2t].all())


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("kind", ["speculators", "specforge"])
def test_greedy_drafting_with_an_imported_head_equals_plain(tmp_path, tiny_checkpoints, arch, kind):
    path = str(tiny_checkpoints[arch])
    directory = (
        write_speculators_head(tmp_path / "head", layer_type="qwen3")
        if kind == "speculators"
        else write_specforge_head(tmp_path / "head")
    )
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in repetitive_prompts()]
    plain = LLM(path, max_model_len=256, max_num_seqs=4)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    for head_dtype in ("float32", "q8_0"):
        spec = {"method": "eagle3", "head": str(directory), "num_speculative_tokens": 3, "head_dtype": head_dtype}
        llm = LLM(path, max_model_len=256, max_num_seqs=4, speculative_config=spec)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
        assert llm.get_metrics().num_drafts > 0


def test_seeded_sampling_with_an_imported_head_equals_plain(tmp_path, tiny_checkpoints):
    """Sampled requests draw each position's token from its keyed noise: speculation with the
    head returns the very tokens plain decoding samples (the distribution is the target's)."""
    path = str(tiny_checkpoints["gemma3"])
    directory = write_speculators_head(tmp_path / "head", norm_before_residual=True)
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=30, seed=11, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in repetitive_prompts()]
    expected = [o.outputs[0].token_ids for o in LLM(path, max_model_len=256, max_num_seqs=4).generate(prompts, params)]
    spec = {"method": "eagle3", "head": str(directory), "num_speculative_tokens": 3}
    llm = LLM(path, max_model_len=256, max_num_seqs=4, speculative_config=spec)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    assert llm.get_metrics().num_drafts > 0


def test_formats_are_told_apart_and_unsupported_heads_are_clear_errors(tmp_path, tiny_checkpoints):
    ours = tmp_path / "ours"
    ours.mkdir()
    (ours / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert detect_eagle3_format(ours) is None and detect_eagle3_format(tmp_path / "nowhere") is None
    with pytest.raises(ValueError, match="norm_before_fc"):
        detect_eagle3_format(write_speculators_head(tmp_path / "fc-norm", norm_before_fc=True))
    deep = write_speculators_head(tmp_path / "deep")
    config = json.loads((deep / "config.json").read_text())
    config["transformer_layer_config"]["num_hidden_layers"] = 2
    (deep / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="only one-layer heads"):
        detect_eagle3_format(deep)
    with pytest.raises(ValueError, match=r"hidden states \[0, 1, 2\]: \[0\] outside"):
        Eagle3Head.load(
            write_speculators_head(tmp_path / "emb", aux=(0, 1, 2)), target_num_layers=4, dtype=torch.float32
        )
    broken = write_speculators_head(tmp_path / "broken")
    from safetensors.torch import load_file

    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["layers.0.hidden_norm.weight"]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match=r"lacks the tensor 'layers\.0\.hidden_norm\.weight'"):
        Eagle3Head.load(broken, target_num_layers=4, dtype=torch.float32)
    wide = write_speculators_head(tmp_path / "wide", aux=(1, 2, 9))
    with pytest.raises(ValueError, match=r"outside 1\.\.4"):
        LLM(str(tiny_checkpoints["llama"]), speculative_config={"method": "eagle3", "head": str(wide)})
