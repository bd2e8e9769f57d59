"""LLM.load_weights: another checkpoint's tensors, under its own names, make the model that
checkpoint loads, on float and quantized weights alike, whole or a bucket at a time; bad input
changes nothing."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from quickdraft import LLM, SamplingParams
from tests.conftest import ARCHS, build_tiny_checkpoint
from tests.models.test_decoder import prompt
from tests.models.test_quantized_loader import half_checkpoint

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)
PROMPTS = [prompt(40, seed=61), prompt(5, seed=62) * 7]  # whole 16-token blocks: prefix-cached


@pytest.fixture(scope="module")
def other_checkpoints(tmp_path_factory):
    """Each architecture again with other random weights: what a trainer's update carries."""
    root = tmp_path_factory.mktemp("updated")
    return {arch: build_tiny_checkpoint(arch, root / arch, seed=7) for arch in ARCHS}


def tensors_of(path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def outputs(llm: LLM):
    return [(c.token_ids, c.logprobs) for c in (o.outputs[0] for o in llm.generate(PROMPTS, GREEDY))]


@pytest.mark.parametrize("arch", ARCHS)
def test_all_of_another_checkpoint_makes_that_model(tiny_checkpoints, other_checkpoints, arch):
    llm = LLM(str(tiny_checkpoints[arch]), max_model_len=128)
    before = outputs(llm)
    changed = llm.load_weights(tensors_of(other_checkpoints[arch]).items())
    assert "layers.0.qkv_proj" in changed and "embed_tokens" in changed
    expected = outputs(LLM(str(other_checkpoints[arch]), max_model_len=128))
    assert outputs(llm) == expected != before


@pytest.mark.parametrize(
    ("quantization", "half"), [("q8_0", None), ("stored", torch.bfloat16), ("stored", torch.float16)]
)
def test_quantized_weights_are_rebuilt_in_their_format(
    tiny_checkpoints, other_checkpoints, tmp_path, quantization, half
):
    """Q8_0 re-rounded as at load; F16 / BF16 parts take the values as they are."""
    base, other = tiny_checkpoints["llama"], other_checkpoints["llama"]
    if half is not None:
        base, other = half_checkpoint(base, tmp_path / "base", half), half_checkpoint(other, tmp_path / "other", half)
    llm = LLM(str(base), max_model_len=128, quantization=quantization)
    assert type(llm.engine.model.layers[0].qkv_proj).__name__ == "QuantizedWeight"
    llm.load_weights(tensors_of(other).items())
    assert outputs(llm) == outputs(LLM(str(other), max_model_len=128, quantization=quantization))


def test_buckets_and_single_pieces_land_in_their_rows(tiny_checkpoints, other_checkpoints):
    """A fused matrix's q / k / v (or gate / up) may come in different calls; a piece changes
    its own rows only."""
    llm = LLM(str(tiny_checkpoints["gemma3"]), max_model_len=128)
    qkv = llm.engine.model.layers[1].qkv_proj.detach().clone()
    new = tensors_of(other_checkpoints["gemma3"])
    llm.load_weights([("model.layers.1.self_attn.k_proj.weight", new["model.layers.1.self_attn.k_proj.weight"])])
    after = llm.engine.model.layers[1].qkv_proj
    config = llm.engine.model_config
    q, kv = config.q_size, config.kv_size
    assert torch.equal(after[:q], qkv[:q]) and torch.equal(after[q + kv :], qkv[q + kv :])
    assert torch.equal(after[q : q + kv], new["model.layers.1.self_attn.k_proj.weight"])
    names = sorted(new)
    for bucket in (names[: len(names) // 3], names[len(names) // 3 :]):
        llm.load_weights((name, new[name]) for name in bucket)
    assert outputs(llm) == outputs(LLM(str(other_checkpoints["gemma3"]), max_model_len=128))


def test_a_quantized_piece_keeps_the_other_rows_bytes(tiny_checkpoints, other_checkpoints):
    llm = LLM(str(tiny_checkpoints["llama"]), max_model_len=128, quantization="q8_0")
    before = llm.engine.model.layers[0].gate_up_proj.dequantize()
    up = tensors_of(other_checkpoints["llama"])["model.layers.0.mlp.up_proj.weight"]
    llm.load_weights([("model.layers.0.mlp.up_proj.weight", up)])
    after = llm.engine.model.layers[0].gate_up_proj.dequantize()
    half = before.shape[0] // 2
    assert torch.equal(after[:half], before[:half])  # gate: the same bytes
    torch.testing.assert_close(after[half:], up, atol=float(up.abs().max()) / 127, rtol=0)  # up: Q8_0 of the new


def test_the_prefix_cache_and_speculation_follow_the_new_weights(tiny_checkpoints, other_checkpoints):
    """Cached prompt blocks hold the old weights' keys: a prompt seen before must not reuse them;
    drafting (its head's or retrieval's proposals) stays exact for the new model."""
    spec = {"method": "suffix", "num_speculative_tokens": 6}
    llm = LLM(str(tiny_checkpoints["gemma3"]), max_model_len=128, speculative_config=spec)
    outputs(llm)  # caches the prompts' blocks
    llm.load_weights(tensors_of(other_checkpoints["gemma3"]).items())
    assert outputs(llm) == outputs(LLM(str(other_checkpoints["gemma3"]), max_model_len=128))
    assert llm.get_metrics().num_drafts > 0


def test_bad_input_changes_nothing(tiny_checkpoints, other_checkpoints):
    llm = LLM(str(tiny_checkpoints["qwen3"]), max_model_len=128)
    before = {name: t.clone() for name, t in llm.engine.model.state_dict().items()}
    new = tensors_of(other_checkpoints["qwen3"])
    good = list(new.items())[:5]
    with pytest.raises(ValueError, match=r"1 tensors this model does not have: model\.layers\.0\.mlp\.fc9\.weight"):
        llm.load_weights([*good, ("model.layers.0.mlp.fc9.weight", torch.zeros(2, 2))])
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.o_proj\.weight has shape \(64, 63\)"):
        llm.load_weights([*good, ("model.layers.0.self_attn.o_proj.weight", torch.zeros(64, 63))])
    with pytest.raises(ValueError, match="not a tensor"):
        llm.load_weights([("model.norm.weight", [1.0, 2.0])])
    assert all(torch.equal(t, before[name]) for name, t in llm.engine.model.state_dict().items())
    assert not llm.load_weights([("model.rotary_emb.inv_freq", torch.zeros(4))])  # a buffer, not a weight


def test_formats_that_cannot_be_rebuilt_are_refused(tmp_path):
    from tests.models.test_gguf import build_tiny_gguf

    tiny = build_tiny_gguf(tmp_path, "gemma3-lowbit")
    llm = LLM(str(tiny.path), max_model_len=64)
    weight = tiny.expected["model.layers.0.self_attn.o_proj.weight"]
    with pytest.raises(ValueError, match=r"o_proj\.weight is held as Q3_K, which quickdraft cannot quantize to"):
        llm.load_weights([("model.layers.0.self_attn.o_proj.weight", weight)])


def test_a_gguf_in_updatable_formats_takes_another_files_weights(tmp_path):
    """Q8_0 / Q5_0 / Q4_0 as stored: another file's values (as stored, dequantized) quantize back
    to that file's bytes, so the updated model is the other file's."""
    from tests.models.test_gguf import build_tiny_gguf

    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    first, second = build_tiny_gguf(tmp_path / "a", "gemma3-mixed"), build_tiny_gguf(tmp_path / "b", "gemma3-mixed")
    llm = LLM(str(first.path), max_model_len=64)
    llm.load_weights(second.expected.items())
    assert outputs(llm) == outputs(LLM(str(second.path), max_model_len=64))
