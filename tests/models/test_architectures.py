"""Mistral and Phi-3 (Phi-3.5 / Phi-4-mini's shape): the same decoder with other switches.

Mistral puts a sliding window on every layer. Phi-3 stores q/k/v and gate/up fused, rotates only
part of each head (the loader reorders query and key rows so that the kernels' full-head rotation
computes it, `RopeConfig.dim_order`) and scales its rotation with LongRoPE, whose short or long
factors are chosen once from the served context. Each is checked against transformers, on float
and quantized weights, under speculation, and with LoRA adapters against PEFT.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import pytest
import torch

from quickdraft import LLM, SamplingParams
from quickdraft.engine.runner import ModelRunner, SequenceWork
from quickdraft.kv.cache import KVCache
from quickdraft.models.config import ModelConfig, RopeConfig
from quickdraft.models.loader import load_decoder
from quickdraft.models.lora import LoRARequest, write_random_adapter
from quickdraft.verify.tree import Tree
from tests.conftest import MORE_ARCHS, PHI3_ORIGINAL_CONTEXT, build_tiny_checkpoint
from tests.engine.test_speculative import GREEDY, GarbageDrafter, repetitive_prompts
from tests.models.test_decoder import prompt
from tests.models.test_lora import peft_greedy, write_peft_adapter

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("more_archs")
    return {arch: build_tiny_checkpoint(arch, root / arch, qk_scale=6.0) for arch in MORE_ARCHS}


@functools.cache
def reference_model(path: Path):
    """transformers' model in eager attention, the implementation that applies Gemma 2's cap."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def reference_logits(path: Path, token_ids: list[int]) -> torch.Tensor:  # -> [T, V]
    with torch.no_grad():
        return reference_model(path)(torch.tensor([token_ids])).logits[0]


def make_runner(path: Path, *, context_len: int, quantization: str | None = None, max_len: int = 160) -> ModelRunner:
    model, config = load_decoder(
        path, dtype=torch.float32, device=CPU, max_len=max_len, quantization=quantization, context_len=context_len
    )
    cache = KVCache(
        num_layers=config.num_layers,
        num_slots=2,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        max_len=max_len,
        dtype=torch.float32,
        block_size=5,
        layer_windows=config.layer_windows,
        device=CPU,
    )
    return ModelRunner(model=model, cache=cache, device=CPU)


def test_configs(checkpoints):
    mistral = ModelConfig.from_hf_dict(json.loads((checkpoints["mistral"] / "config.json").read_text()))
    assert set(mistral.layer_types) == {"sliding_attention"} and mistral.sliding_window == 8
    assert not mistral.fused_projections
    phi3 = ModelConfig.from_hf_dict(json.loads((checkpoints["phi3"] / "config.json").read_text()))
    assert phi3.fused_projections and set(phi3.layer_types) == {"full_attention"}
    rope = phi3.rope_by_layer_type["full_attention"]
    assert rope.rope_type == "longrope" and rope.rotary_dim(phi3.head_dim) == 8
    assert rope.factor == 512 / PHI3_ORIGINAL_CONTEXT  # transformers' default: the ratio of the contexts
    assert rope.attention_factor == pytest.approx(
        (1 + torch.tensor(8.0).log() / torch.tensor(64.0).log()).sqrt().item()
    )


def test_partial_rotary_layout():
    """Rotated pairs (i, i + R/2) land on the kernels' (j, j + D/2); the rest pass through."""
    rope = RopeConfig(theta=10_000.0, partial_rotary_factor=0.5)
    assert rope.dim_order(8) == [0, 1, 4, 5, 2, 3, 6, 7]
    assert RopeConfig(theta=10_000.0).dim_order(8) is None
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        RopeConfig(theta=10_000.0, partial_rotary_factor=0.0)
    with pytest.raises(ValueError, match="longrope needs short_factor and long_factor"):
        RopeConfig(theta=10_000.0, rope_type="longrope", short_factor=(1.0,), long_factor=())


@pytest.mark.parametrize("quantization", [None, "q8_0"])
@pytest.mark.parametrize("arch", MORE_ARCHS)
def test_prefill_and_decode_match_transformers(checkpoints, arch, quantization):
    """A prefill in chunks then decodes (past Mistral's window; within Phi-3's original context, so
    both use the short factors) gives transformers' logits; Q8_0 weights stay close."""
    path = checkpoints[arch]
    tokens = prompt(PHI3_ORIGINAL_CONTEXT - 4, seed=2)
    runner = make_runner(path, context_len=PHI3_ORIGINAL_CONTEXT, quantization=quantization)
    got, cache_len = [], 0
    for chunk in [tokens[:7], tokens[7:30]] + [[t] for t in tokens[30:]]:
        out = runner.forward(
            [SequenceWork(slot=1, cache_len=cache_len, token_ids=chunk, logits_nodes=list(range(len(chunk))))]
        )
        got.append(out.logits)
        cache_len += len(chunk)
        runner.cache.commit(1, cache_len)
    tolerance = 1e-4 if quantization is None else 5e-2  # Q8_0 rounding
    torch.testing.assert_close(torch.cat(got), reference_logits(path, tokens), rtol=tolerance, atol=tolerance)


def test_longrope_factors_follow_the_served_context(checkpoints):
    """transformers rotates with the short factors while a sequence is within the original context
    and with the long ones past it; we pick once, from the served context: our rotary table equals
    transformers' cos/sin for short sequences when the context is within the original length, for
    long ones when it runs past. And a long prompt's logits are transformers'."""
    path = checkpoints["phi3"]
    hf_rotary = reference_model(path).model.rotary_emb
    D, R = 16, 8  # head_dim, rotated dimensions
    for context_len, positions in ((PHI3_ORIGINAL_CONTEXT, 40), (128, 100)):
        model, _ = load_decoder(path, dtype=torch.float32, device=CPU, max_len=160, context_len=context_len)
        table = model.rotary["full_attention"]
        cos, sin = hf_rotary(torch.zeros(1), torch.arange(positions)[None])  # [1, T, R]
        ours = torch.cat([table.cos[:positions, : R // 2], table.cos[:positions, D // 2 : D // 2 + R // 2]], dim=-1)
        torch.testing.assert_close(ours, cos[0], rtol=1e-6, atol=1e-6)
        ours_sin = torch.cat(
            [-table.signed_sin[:positions, : R // 2], table.signed_sin[:positions, D // 2 : D // 2 + R // 2]], dim=-1
        )
        torch.testing.assert_close(ours_sin, sin[0], rtol=1e-6, atol=1e-6)
        # the pass-through dimensions: an exact identity
        assert torch.equal(table.cos[:, R // 2 : D // 2], torch.ones(160, D // 2 - R // 2))
        assert not table.signed_sin[:, R // 2 : D // 2].any()
    short_table = load_decoder(path, dtype=torch.float32, device=CPU, max_len=160, context_len=64)[0].rotary[
        "full_attention"
    ]
    assert not torch.equal(short_table.cos, table.cos)  # the two choices differ
    tokens = prompt(PHI3_ORIGINAL_CONTEXT + 16, seed=3)
    work = [SequenceWork(slot=0, cache_len=0, token_ids=tokens, logits_nodes=list(range(len(tokens))))]
    torch.testing.assert_close(
        make_runner(path, context_len=128).forward(work).logits, reference_logits(path, tokens), rtol=1e-4, atol=1e-4
    )


@pytest.mark.parametrize("arch", MORE_ARCHS)
def test_tree_rows_are_bit_identical_to_decoding_alone(checkpoints, arch):
    """Q8_0 weights on the one-call C++ layers: every node of a tree beside another request's
    chain has the bits of its path decoded token by token."""
    path = checkpoints[arch]
    context = prompt(12, seed=4)
    parents = [-1, 0, 0, 1, 1, 2, 3]
    nodes = [context[-1], 11, 12, 13, 14, 15, 16]
    runner = make_runner(path, context_len=128, quantization="q8_0")
    for slot in (0, 1):
        runner.forward([SequenceWork(slot=slot, cache_len=0, token_ids=context[:-1])])
        runner.cache.commit(slot, len(context) - 1)
    n = len(context) - 1
    tree = runner.forward(
        [
            SequenceWork(
                slot=0, cache_len=n, token_ids=nodes, tree=Tree(parents), logits_nodes=list(range(len(nodes)))
            ),
            SequenceWork(slot=1, cache_len=n, token_ids=[5, 6, 7], logits_nodes=[0, 1, 2]),
        ]
    ).logits
    for node in range(len(nodes)):
        path_tokens, walk = [], node
        while walk >= 0:
            path_tokens.append(nodes[walk])
            walk = parents[walk]
        alone = make_runner(path, context_len=128, quantization="q8_0")
        alone.forward([SequenceWork(slot=0, cache_len=0, token_ids=context[:-1])])
        cache_len = n
        for token in path_tokens[::-1]:
            logits = alone.forward(
                [SequenceWork(slot=0, cache_len=cache_len, token_ids=[token], logits_nodes=[0])]
            ).logits
            cache_len += 1
            alone.cache.commit(0, cache_len)
        assert torch.equal(tree[node], logits[0]), node


@pytest.mark.parametrize("quantization", [None, "q8_0"])
@pytest.mark.parametrize("arch", MORE_ARCHS)
def test_speculative_equals_plain(checkpoints, arch, quantization):
    """Suffix speculation and a drafter proposing garbage trees return plain decoding's tokens."""
    path = str(checkpoints[arch])
    params = SamplingParams(max_tokens=32, **GREEDY)
    settings = dict(max_model_len=256, max_num_seqs=4, quantization=quantization)
    expected = [o.outputs[0].token_ids for o in LLM(path, **settings).generate(repetitive_prompts(), params)]
    suffix = LLM(path, **settings, speculative_config={"method": "suffix", "num_speculative_tokens": 6})
    assert [o.outputs[0].token_ids for o in suffix.generate(repetitive_prompts(), params)] == expected
    assert suffix.get_metrics().num_accepted_tokens > 0
    garbage = LLM(path, **settings, speculative_config={"method": "ngram", "num_speculative_tokens": 6})
    garbage.engine.speculator.drafter = GarbageDrafter(vocab_size=320, tree=True, seed=7)
    assert [o.outputs[0].token_ids for o in garbage.generate(repetitive_prompts(), params)] == expected


def test_phi3_lora_on_fused_projections_equals_peft(checkpoints, tmp_path):
    """A PEFT adapter on Phi-3's own qkv_proj / gate_up_proj: PEFT's tokens (its q/k rows reordered
    as the base weight's); an adapter naming modules the target lacks is refused by name."""
    base = checkpoints["phi3"]
    adapter = write_peft_adapter(
        base, tmp_path / "phi3", seed=1, target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    )
    prompt_ids = prompt(12, seed=5)
    # within the original context, as transformers' generate then rotates with the short factors
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_model_len=PHI3_ORIGINAL_CONTEXT)
    expected = peft_greedy(base, adapter, prompt_ids, 12)
    assert expected != peft_greedy(base, None, prompt_ids, 12)  # the adapter changes the answer
    request = LoRARequest("phi3", 1, str(adapter))
    out = llm.generate([prompt_ids], SamplingParams(max_tokens=12, **GREEDY), lora_request=request)
    assert out[0].outputs[0].token_ids == expected
    llama_style = write_peft_adapter(checkpoints["mistral"], tmp_path / "mistral", seed=2, target_modules=["q_proj"])
    with pytest.raises(ValueError, match="no q_proj"):
        llm.generate([prompt_ids], SamplingParams(max_tokens=2), lora_request=LoRARequest("m", 2, str(llama_style)))


def _phi_config(**fields) -> dict:
    """config.json fields of a Phi-3 family checkpoint (transformers 4.x spelling, as published)."""
    return {
        "architectures": ["Phi3ForCausalLM"],
        "model_type": "phi3",
        "vocab_size": 32064,
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 32000,
        "tie_word_embeddings": False,
    } | fields


def test_published_phi_configs_parse():
    """The shapes of Phi-3-mini-4k (a 2047-token window on every layer), Phi-3.5-mini (LongRoPE
    from 4k to 128k) and Phi-4-mini (partial rotary, tied head) as their config.json spell them."""
    mini = ModelConfig.from_hf_dict(_phi_config(max_position_embeddings=4096, sliding_window=2047, rope_scaling=None))
    assert mini.sliding_window == 2047 and set(mini.layer_types) == {"sliding_attention"} and mini.head_dim == 96
    factors = [1.0 + i / 10 for i in range(48)]
    longrope = {"type": "longrope", "short_factor": factors, "long_factor": [2 * f for f in factors]}
    phi35 = ModelConfig.from_hf_dict(
        _phi_config(max_position_embeddings=131072, original_max_position_embeddings=4096, rope_scaling=longrope)
    )
    rope = phi35.rope_by_layer_type["full_attention"]
    assert rope.rope_type == "longrope" and rope.factor == 32.0 and rope.rotary_dim(96) == 96
    assert rope.attention_factor == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
    phi4 = ModelConfig.from_hf_dict(
        _phi_config(
            vocab_size=200064,
            num_attention_heads=24,
            num_key_value_heads=8,
            partial_rotary_factor=0.75,
            max_position_embeddings=131072,
            original_max_position_embeddings=4096,
            sliding_window=262144,
            tie_word_embeddings=True,
            rope_scaling=longrope,
        )
    )
    assert phi4.head_dim == 128 and phi4.rope_by_layer_type["full_attention"].rotary_dim(128) == 96
    assert phi4.tie_word_embeddings and phi4.fused_projections
    with pytest.raises(ValueError, match="longrope has 48 factors; 32 rotated dimension pairs need 32"):
        ModelConfig.from_hf_dict(
            _phi_config(
                partial_rotary_factor=0.5,
                num_attention_heads=24,
                num_key_value_heads=8,
                max_position_embeddings=131072,
                original_max_position_embeddings=4096,
                rope_scaling=longrope,
            )
        )


def test_published_gemma2_config_parses():
    """Gemma 2 2B's config.json (transformers 4.x spelling): sliding and global layers in turn
    from the first, one rope base for both, both caps, queries scaled by query_pre_attn_scalar."""
    config = ModelConfig.from_hf_dict(
        {
            "architectures": ["Gemma2ForCausalLM"],
            "model_type": "gemma2",
            "vocab_size": 256000,
            "hidden_size": 2304,
            "intermediate_size": 9216,
            "num_hidden_layers": 26,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": 256,
            "sliding_window": 4096,
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
            "rope_theta": 10000.0,
            "rms_norm_eps": 1e-06,
            "max_position_embeddings": 8192,
            "bos_token_id": 2,
            "eos_token_id": 1,
        }
    )
    assert config.layer_types[:3] == ("sliding_attention", "full_attention", "sliding_attention")
    assert {rope.theta for rope in config.rope_by_layer_type.values()} == {10000.0}
    assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (50.0, 30.0)
    assert config.attn_scale == 256**-0.5 and not config.qk_norm and config.sandwich_norms
    with pytest.raises(ValueError, match="attn_logit_softcapping is not supported for Gemma 3"):
        ModelConfig.from_hf_dict({**_gemma3_dict(), "attn_logit_softcapping": 50.0})


def _gemma3_dict() -> dict:
    return {
        "model_type": "gemma3_text",
        "vocab_size": 262144,
        "hidden_size": 640,
        "intermediate_size": 2048,
        "num_hidden_layers": 18,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "sliding_window": 512,
    }


def test_yarn_configs_parse():
    """Qwen2.5's long-context YaRN as its model card spells it (transformers 4.x `rope_scaling`,
    `type`), DeepSeek's with mscale terms and no factor, and YaRN without its original context."""
    qwen = ModelConfig.from_hf_dict(
        {
            "model_type": "qwen2",
            "vocab_size": 152064,
            "hidden_size": 3584,
            "intermediate_size": 18944,
            "num_hidden_layers": 28,
            "num_attention_heads": 28,
            "num_key_value_heads": 4,
            "max_position_embeddings": 32768,
            "rope_theta": 1000000.0,
            "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"},
        }
    )
    rope = qwen.rope_by_layer_type["full_attention"]
    assert (rope.rope_type, rope.factor, rope.theta, rope.beta_fast, rope.beta_slow) == (
        "yarn",
        4.0,
        1e6,
        32.0,
        1.0,
    )
    assert rope.attention_factor == pytest.approx(0.1 * math.log(4.0) + 1.0)
    common = {"model_type": "llama", "vocab_size": 10, "hidden_size": 64, "intermediate_size": 128}
    common |= {"num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 16384}
    deepseek_style = ModelConfig.from_hf_dict(
        common
        | {
            "rope_scaling": {
                "type": "yarn",
                "original_max_position_embeddings": 4096,
                "mscale": 0.707,
                "mscale_all_dim": 0.707,
                "beta_fast": 16,
                "truncate": False,
            }
        }
    )
    rope = deepseek_style.rope_by_layer_type["full_attention"]
    assert rope.factor == 4.0 and rope.attention_factor == 1.0 and rope.beta_fast == 16.0 and not rope.truncate
    with pytest.raises(ValueError, match="yarn rope scaling needs original_max_position_embeddings"):
        ModelConfig.from_hf_dict(common | {"rope_scaling": {"type": "yarn", "factor": 2.0}})


def test_published_moe_configs_parse():
    """Qwen3-30B-A3B (128 experts of 768, 8 a token, renormalised), Qwen1.5-MoE-A2.7B and Mixtral
    8x7B (8 experts of 14336, 2 a token) as their config.json spell them; mixtures cannot be split
    over ranks."""
    from quickdraft.distributed.sharding import check_tensor_parallel

    common = {"hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 4, "rms_norm_eps": 1e-6}
    qwen = ModelConfig.from_hf_dict(
        common
        | {
            "model_type": "qwen3_moe",
            "vocab_size": 151936,
            "intermediate_size": 6144,
            "num_hidden_layers": 48,
            "head_dim": 128,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": 768,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "norm_topk_prob": True,
            "rope_theta": 1000000.0,
        }
    )
    assert (qwen.num_experts, qwen.experts_per_token, qwen.moe_intermediate_size) == (128, 8, 768)
    assert qwen.moe_layers == tuple(range(48)) and qwen.moe_renormalize and qwen.qk_norm
    assert qwen.shared_expert_intermediate_size == 0
    # Qwen1.5-MoE-A2.7B: 60 experts of 1408, 4 a token, not renormalised, a gated shared expert of
    # 5632; q/k/v biases as every Qwen2
    qwen2 = ModelConfig.from_hf_dict(
        common
        | {
            "model_type": "qwen2_moe",
            "vocab_size": 151936,
            "intermediate_size": 5632,
            "num_hidden_layers": 24,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "num_experts": 60,
            "num_experts_per_tok": 4,
            "moe_intermediate_size": 1408,
            "shared_expert_intermediate_size": 5632,
            "norm_topk_prob": False,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "use_sliding_window": False,
            "sliding_window": 32768,
            "rope_theta": 1000000.0,
        }
    )
    assert (qwen2.num_experts, qwen2.experts_per_token, qwen2.moe_intermediate_size) == (60, 4, 1408)
    assert qwen2.shared_expert_intermediate_size == 5632 and qwen2.shared_expert_gated
    assert not qwen2.moe_renormalize and qwen2.qkv_bias and not qwen2.o_bias and not qwen2.qk_norm
    assert qwen2.moe_layers == tuple(range(24)) and set(qwen2.layer_types) == {"full_attention"}
    mixtral = ModelConfig.from_hf_dict(
        common
        | {
            "model_type": "mixtral",
            "vocab_size": 32000,
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_key_value_heads": 8,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "sliding_window": None,
            "rope_theta": 1000000.0,
        }
    )
    assert (mixtral.num_experts, mixtral.moe_intermediate_size, len(mixtral.moe_layers)) == (8, 14336, 32)
    assert set(mixtral.layer_types) == {"full_attention"}
    with pytest.raises(ValueError, match=r"mixture-of-experts model .* runs in one process"):
        check_tensor_parallel(mixtral, 2)
    with pytest.raises(ValueError, match="experts per token"):
        ModelConfig.from_hf_dict(
            {
                **common,
                "model_type": "mixtral",
                "vocab_size": 10,
                "intermediate_size": 64,
                "num_hidden_layers": 2,
                "num_local_experts": 2,
                "num_experts_per_tok": 3,
            }
        )


def test_moe_on_quantized_weights_with_an_attention_adapter(checkpoints, tmp_path):
    """Qwen3-MoE quantized at load: every layer, mixtures included, runs in the one-call C++
    stack, an attention adapter's rows included; a request's tokens are the same decoded beside a
    base request and under a garbage drafter's trees as decoded alone."""
    from quickdraft.kernels.quant_linear import fused_layer_available

    base = checkpoints["qwen3_moe"]
    adapter = write_peft_adapter(base, tmp_path / "attention", seed=3, target_modules=["q_proj", "v_proj", "o_proj"])
    lora = LoRARequest("a", 1, str(adapter))
    prompts = [prompt(12, seed=6), prompt(9, seed=7)]
    params = SamplingParams(max_tokens=12, **GREEDY)
    llm = LLM(str(base), quantization="q8_0", enable_lora=True, max_model_len=64, max_num_seqs=4)
    hidden = llm.engine.model_config.hidden_size
    assert llm.engine.model._stack_for(torch.zeros(1, hidden)) is not None or not fused_layer_available()
    alone = [llm.generate([p], params, lora_request=lora)[0].outputs[0].token_ids for p in prompts]
    base_only = llm.generate([prompts[0]], params)[0].outputs[0].token_ids
    assert base_only != alone[0]  # the adapter is applied
    together = llm.generate(prompts + prompts[:1], params, lora_request=[lora, lora, None])
    assert [o.outputs[0].token_ids for o in together] == [*alone, base_only]
    spec = LLM(
        str(base),
        quantization="q8_0",
        enable_lora=True,
        max_model_len=64,
        max_num_seqs=4,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4},
    )
    spec.engine.speculator.drafter = GarbageDrafter(vocab_size=llm.engine.model_config.vocab_size, tree=True)
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params, lora_request=lora)] == alone
    assert spec.get_metrics().num_draft_tokens > 10


def test_moe_dense_layers_and_lora_on_attention_only(checkpoints, tmp_path):
    """Qwen3-MoE's mlp_only_layers keep a dense MLP (the checkpoint's mlp.gate_proj is read); an
    adapter on the attention projections runs as PEFT's, one on a layer's experts is refused."""
    base = checkpoints["qwen3_moe"]
    config = ModelConfig.from_hf_dict(json.loads((base / "config.json").read_text()))
    assert config.moe_layers == (0, 2, 3)
    model, _ = load_decoder(base, dtype=torch.float32, device=CPU, max_len=64)
    assert model.layers[1].experts is None and model.layers[1].gate_up_proj is not None
    assert model.layers[0].experts is not None and model.layers[0].gate_up_proj is None
    adapter = write_peft_adapter(base, tmp_path / "attention", seed=3, target_modules=["q_proj", "v_proj", "o_proj"])
    prompt_ids = prompt(12, seed=6)
    expected = peft_greedy(base, adapter, prompt_ids, 10)
    assert expected != peft_greedy(base, None, prompt_ids, 10)
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_model_len=64)
    out = llm.generate(
        [prompt_ids], SamplingParams(max_tokens=10, **GREEDY), lora_request=LoRARequest("a", 1, str(adapter))
    )
    assert out[0].outputs[0].token_ids == expected
    dense_mlp = write_peft_adapter(
        base, tmp_path / "dense", seed=4, target_modules=["gate_proj", "up_proj", "down_proj"]
    )
    # PEFT adapts the experts' fused parameters (transformers >= 5 holds them so) by target_parameters
    with pytest.raises(ValueError, match="target_parameters"):
        llm.generate([prompt_ids], SamplingParams(max_tokens=2), lora_request=LoRARequest("d", 2, str(dense_mlp)))
    # an adapter written with gate/up/down modules in every layer names the experts' layers
    every_layer = write_random_adapter(tmp_path / "every", config=config, rank=4, b_std=0.1, seed=0)
    with pytest.raises(ValueError, match="layer 0 is a mixture of experts; adapters on experts are not supported"):
        llm.generate([prompt_ids], SamplingParams(max_tokens=2), lora_request=LoRARequest("e", 3, str(every_layer)))


@pytest.mark.parametrize("quantization", [None, "q8_0"])
def test_gpt_oss_mxfp4_checkpoint_reads_as_transformers_dequantizes_it(checkpoints, tmp_path, quantization):
    """gpt-oss as published: the experts' matrices as MXFP4 blocks and scales (`*_blocks`,
    `*_scales`); read as transformers dequantizes them, the model gives its logits.  Quantized at
    load ("q8_0") the experts stay MXFP4 as stored (the rest Q8_0), never expanded to floats."""
    import copy
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    source = checkpoints["gpt_oss"]
    path = tmp_path / "gpt_oss_mxfp4"
    shutil.copytree(source, path)
    tensors = load_file(path / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    reference = copy.deepcopy(reference_model(source))
    state = reference.state_dict()
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, cols, rows = tensors.pop(name).shape  # [E, in, out]
        blocks = torch.randint(0, 256, (experts, rows, cols // 32, 16), dtype=torch.uint8, generator=generator)
        scales = torch.randint(118, 126, (experts, rows, cols // 32), dtype=torch.uint8, generator=generator)
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        state[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    save_file(tensors, path / "model.safetensors")
    reference.load_state_dict(state)
    tokens = prompt(40, seed=3)
    runner = make_runner(path, context_len=128, quantization=quantization)
    if quantization is not None:
        expert = runner.model.layers[1].experts[3]
        assert {p.format for w in (expert.gate_up_proj, expert.down_proj) for p in w.parts} == {"MXFP4"}
        floats = make_runner(path, context_len=128).model.layers[1].experts[3]  # transformers' values
        assert torch.equal(expert.gate_up_proj.dequantize(), floats.gate_up_proj)
        assert torch.equal(expert.down_proj.dequantize(), floats.down_proj)
    work = [SequenceWork(slot=0, cache_len=0, token_ids=tokens, logits_nodes=list(range(len(tokens))))]
    with torch.no_grad():
        expected = reference(torch.tensor([tokens])).logits[0]
    tolerance = 1e-4 if quantization is None else 5e-2  # the kernels' int8 activations, Q8_0 attention
    torch.testing.assert_close(runner.forward(work).logits, expected, rtol=tolerance, atol=tolerance)


def test_published_gpt_oss_config_parses():
    """gpt-oss-20b's config.json as published (transformers 4.55 spelling, MXFP4 quantization
    config beside it)."""
    config = ModelConfig.from_hf_dict(
        {
            "architectures": ["GptOssForCausalLM"],
            "model_type": "gpt_oss",
            "attention_bias": True,
            "head_dim": 64,
            "hidden_act": "silu",
            "hidden_size": 2880,
            "intermediate_size": 2880,
            "layer_types": ["sliding_attention", "full_attention"] * 12,
            "max_position_embeddings": 131072,
            "num_attention_heads": 64,
            "num_experts_per_tok": 4,
            "num_hidden_layers": 24,
            "num_key_value_heads": 8,
            "num_local_experts": 32,
            "quantization_config": {"quant_method": "mxfp4"},
            "rms_norm_eps": 1e-05,
            "rope_scaling": {
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "factor": 32.0,
                "original_max_position_embeddings": 4096,
                "rope_type": "yarn",
                "truncate": False,
            },
            "rope_theta": 150000,
            "sliding_window": 128,
            "swiglu_limit": 7.0,
            "tie_word_embeddings": False,
            "vocab_size": 201088,
            "eos_token_id": 200002,
        }
    )
    assert (config.num_experts, config.experts_per_token, config.moe_intermediate_size) == (32, 4, 2880)
    assert config.layer_types[:2] == ("sliding_attention", "full_attention") and config.sliding_window == 128
    assert config.attention_sinks and config.router_bias and config.expert_bias and config.activation == "swiglu_oai"
    rope = config.rope_by_layer_type["full_attention"]
    assert (rope.rope_type, rope.factor, rope.truncate, rope.theta) == ("yarn", 32.0, False, 150000.0)
    assert rope.attention_factor == pytest.approx(0.1 * math.log(32.0) + 1.0)
    assert config.qkv_bias and config.o_bias and config.head_dim == 64
