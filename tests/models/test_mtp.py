"""MTP layers in the nextn layout: loading, an independent reference, exact drafting, round trip."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from quickdraft import LLM, SamplingParams
from quickdraft.models.mtp import MtpHead
from quickdraft.train.data import generate_shard
from tests.conftest import tiny_hf_config
from tests.engine.test_speculative import repetitive_prompts

GREEDY = dict(temperature=0.0, ignore_eos=True)
NUM_LAYERS = 4  # the tiny checkpoints' depth: their MTP layer is stored as layer 4


def one_layer_reference(arch: str, *, seed: int):
    """A random one-layer HF model of the arch: its layer is the MTP block, its final norm the
    MTP layer's shared_head.norm (an implementation of the block independent of ours)."""
    import transformers

    torch.manual_seed(seed)
    config = tiny_hf_config(arch)
    config.num_hidden_layers = 1
    if arch == "gemma3":
        config.layer_types = ["full_attention"]
    model_cls = transformers.Gemma3ForCausalLM if arch == "gemma3" else transformers.AutoModelForCausalLM
    model = (model_cls(config) if arch == "gemma3" else model_cls.from_config(config)).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.3)
    return model


def write_mtp_checkpoint(source, out, reference, *, seed: int):
    """Copy of the tiny checkpoint `source` with one MTP layer (the reference's block) appended."""
    shutil.copytree(source, out)
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    hidden = reference.config.hidden_size
    prefix = f"model.layers.{NUM_LAYERS}."
    tensors = {
        name.replace("model.layers.0.", prefix): t.detach().clone()
        for name, t in reference.state_dict().items()
        if name.startswith("model.layers.0.")
    }
    tensors[prefix + "shared_head.norm.weight"] = reference.state_dict()["model.norm.weight"].clone()
    tensors[prefix + "enorm.weight"] = torch.randn(hidden, generator=gen) * 0.3 + 1
    tensors[prefix + "hnorm.weight"] = torch.randn(hidden, generator=gen) * 0.3 + 1
    tensors[prefix + "eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=gen) * 0.1
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "mtp-layers.safetensors"))
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    return tensors


@pytest.fixture(scope="module")
def mtp_checkpoints(tiny_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    built = {}
    for seed, arch in enumerate(("gemma3", "llama")):
        reference = one_layer_reference(arch, seed=100 + seed)
        tensors = write_mtp_checkpoint(tiny_checkpoints[arch], root / arch, reference, seed=200 + seed)
        built[arch] = (root / arch, reference, tensors)
    return built


def _rms(x, weight, *, unit_offset):
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    return normed * (1 + weight if unit_offset else weight)


@pytest.mark.parametrize("arch", ["gemma3", "llama"])
def test_mtp_logits_match_an_independent_reference(mtp_checkpoints, arch):
    """Depth 1 of our MTP head equals: the target features (as recorded, bf16) through the HF
    target's final norm -> hnorm, the HF embedding -> enorm, eh_proj, then the HF one-layer model."""
    import transformers

    path, reference, tensors = mtp_checkpoints[arch]
    llm = LLM(str(path), max_model_len=128)
    target = llm.engine.model
    shard = generate_shard(
        llm, [repetitive_prompts()[0]], feature_layers=(NUM_LAYERS - 1,), max_new_tokens=10, temperature=0.0, seed=0
    )
    seq = shard.sequences[0]
    tokens = torch.tensor(seq.token_ids)
    head = MtpHead.from_checkpoint(path, target_config=target.config, dtype=torch.float32, max_len=128)
    head.attach_target(target)
    ours = head.unrolled_logits(tokens, seq.features.float(), depths=1)[0]  # [n, V]: anchor j -> token j + 2

    hf_target = transformers.AutoModelForCausalLM.from_pretrained(path).float().eval()
    with torch.no_grad():
        final_hidden = hf_target.model.norm(seq.features.float())  # [T - 1, D]
        embeds = hf_target.get_input_embeddings()(tokens[1:])  # [T - 1, D], Gemma's scale included
        prefix = f"model.layers.{NUM_LAYERS}."
        gemma = arch == "gemma3"
        mixed = torch.cat(
            [
                _rms(embeds, tensors[prefix + "enorm.weight"], unit_offset=gemma),
                _rms(final_hidden, tensors[prefix + "hnorm.weight"], unit_offset=gemma),
            ],
            dim=-1,
        )
        inputs = mixed @ tensors[prefix + "eh_proj.weight"].T
        reference.set_input_embeddings(hf_target.get_input_embeddings())
        reference.lm_head = hf_target.lm_head
        positions = torch.arange(1, len(tokens))[None]  # entry j sits at position j + 1
        expected = reference(inputs_embeds=inputs[None], position_ids=positions).logits[0]
    torch.testing.assert_close(ours, expected, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["gemma3", "llama"])
def test_nextn_layout_round_trip(mtp_checkpoints, tmp_path, arch):
    path, _, tensors = mtp_checkpoints[arch]
    llm = LLM(str(path), max_model_len=64)
    head = MtpHead.from_checkpoint(path, target_config=llm.engine.model.config, dtype=torch.float32)
    written = head.nextn_tensors(index=NUM_LAYERS)
    assert set(written) == set(tensors)
    for name, tensor in tensors.items():
        torch.testing.assert_close(written[name], tensor, atol=1e-6, rtol=0, msg=name)
    head.save(tmp_path / "head", dtype=torch.float32)
    again = MtpHead.from_checkpoint(tmp_path / "head", target_config=llm.engine.model.config, dtype=torch.float32)
    for name, tensor in head.state_dict().items():
        torch.testing.assert_close(again.state_dict()[name], tensor, atol=0, rtol=0, msg=name)


@pytest.mark.parametrize("arch", ["gemma3", "llama"])
@pytest.mark.parametrize("shape", [dict(top_k=1), dict(top_k=3, max_draft_tokens=10)])
def test_mtp_greedy_equals_plain(mtp_checkpoints, arch, shape):
    path, _, _ = mtp_checkpoints[arch]
    params = SamplingParams(max_tokens=30, **GREEDY)
    plain = LLM(str(path), max_model_len=256, max_num_seqs=4).generate(repetitive_prompts(), params)
    llm = LLM(
        str(path),
        max_model_len=256,
        max_num_seqs=4,
        speculative_config={"method": "mtp", "num_speculative_tokens": 3, **shape},
    )
    outs = llm.generate(repetitive_prompts(), params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    metrics = llm.get_metrics()
    assert metrics.num_drafts > 10 and metrics.num_draft_tokens >= metrics.num_drafts


def test_mtp_errors(tiny_checkpoints, mtp_checkpoints):
    with pytest.raises(ValueError, match="no multi-token-prediction layers"):
        LLM(str(tiny_checkpoints["llama"]), max_model_len=64, speculative_config={"method": "mtp"})
    with pytest.raises(ValueError, match="MTP layer 2 requested"):
        LLM(str(mtp_checkpoints["llama"][0]), max_model_len=64, speculative_config={"method": "mtp", "layer": 2})
    with pytest.raises(ValueError, match="layer must be a non-negative integer"):
        LLM(str(mtp_checkpoints["llama"][0]), max_model_len=64, speculative_config={"method": "mtp", "layer": -1})
