"""LoRA adapters in PEFT's format: what they compute (against PEFT itself), how rows of different
adapters share a forward (bit for bit as alone, on the C++ layer and the torch layers), and
the adapters refused, each with a message that names the problem."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from quickdraft import LLM, LoRARequest, SamplingParams
from quickdraft.engine.runner import ModelRunner, SequenceWork
from quickdraft.kernels.quant_linear import fused_layer_available
from quickdraft.models.config import ModelConfig
from quickdraft.models.loader import load_decoder, resolve_model_dir
from quickdraft.models.lora import LoRAError, LoRARegistry, LoRASlots, LoRAWeights, load_lora_adapter
from quickdraft.verify.tree import Tree
from tests.models.test_quantized_loader import _runner as slot_runner
from tests.models.test_quantized_loader import half_checkpoint

CPU = torch.device("cpu")
PROMPT = [2, 50, 60, 70, 80, 90, 100, 33, 44, 45, 46, 47]
GREEDY = SamplingParams(max_tokens=12, temperature=0)
ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_peft_adapter(base: Path, out: Path, *, seed: int, **lora_config) -> Path:
    """A PEFT LoRA adapter of `base` with random A and B (PEFT's own init leaves B zero)."""
    import peft
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base).float().eval()
    settings = {"r": 8, "lora_alpha": 16, "target_modules": ALL_MODULES, "init_lora_weights": False, **lora_config}
    peft.get_peft_model(model, peft.LoraConfig(**settings)).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def adapters(tiny_checkpoints, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    made = {arch: write_peft_adapter(tiny_checkpoints[arch], root / arch, seed=1) for arch in tiny_checkpoints}
    made["llama-patterns"] = write_peft_adapter(
        tiny_checkpoints["llama"],
        root / "llama-patterns",
        seed=2,
        target_modules=["q_proj", "v_proj", "down_proj"],
        rank_pattern={"q_proj": 4},
        alpha_pattern={"down_proj": 4},
        use_rslora=True,
    )
    made["gemma3-second"] = write_peft_adapter(tiny_checkpoints["gemma3"], root / "gemma3-second", seed=3)
    return made


def peft_greedy(base: Path, adapter: Path | None, prompt: list[int], max_tokens: int) -> list[int]:
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base).float().eval()
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False, attention_mask=torch.ones_like(ids))
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize(
    "arch, adapter",
    [("gemma3", "gemma3"), ("llama", "llama"), ("qwen2", "qwen2"), ("qwen3", "qwen3"), ("llama", "llama-patterns")],
)
def test_greedy_tokens_equal_peft(tiny_checkpoints, adapters, arch, adapter):
    """Float32 weights: our tokens with the adapter are PEFT's (over the HF model); the base model's
    are HF's; and a batch that mixes both gives each its own."""
    base = tiny_checkpoints[arch]
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_model_len=128)
    request = LoRARequest(adapter, 1, str(adapters[adapter]))
    expected = peft_greedy(base, adapters[adapter], PROMPT, 12)
    plain = peft_greedy(base, None, PROMPT, 12)
    assert expected != plain  # the adapter changes the answer: the test can fail
    mixed = llm.generate([PROMPT, PROMPT, PROMPT], GREEDY, lora_request=[request, None, request])
    assert [o.outputs[0].token_ids for o in mixed] == [expected, plain, expected]


def test_loaded_parts_sit_where_their_modules_write(tiny_checkpoints, adapters):
    config = _config(tiny_checkpoints["llama"])
    weights = load_lora_adapter(
        LoRARequest("p", 1, str(adapters["llama-patterns"])), config=config, max_rank=16, device=CPU
    )
    layer = weights.layers[0]
    assert set(layer) == {"qkv_proj", "down_proj"}
    q, v = layer["qkv_proj"]
    assert (q.col0, q.a.shape[0]) == (0, 4)  # rank_pattern
    assert (v.col0, v.a.shape[0]) == (config.q_size + config.kv_size, 8)
    assert weights.rank == 8
    from safetensors.torch import load_file

    raw = load_file(adapters["llama-patterns"] / "adapter_model.safetensors")
    b_down = raw["base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"]
    # rsLoRA with alpha_pattern: 4 / sqrt(8) folded into B
    assert torch.allclose(layer["down_proj"][0].b, b_down * (4 / 8**0.5))


def _config(base: Path) -> ModelConfig:
    return ModelConfig.from_hf_dict(json.loads((base / "config.json").read_text()))


def _runner(base: Path, *, quantization: str | None, slots: int) -> ModelRunner:
    model, config = load_decoder(
        resolve_model_dir(base), dtype=torch.float32, device=CPU, max_len=128, quantization=quantization
    )
    model.lora_enabled = True
    runner = slot_runner(model, config, slots=slots)
    runner.lora_slots = LoRASlots(2)
    return runner


def _adapter(base: Path, path: Path, int_id: int) -> LoRAWeights:
    return load_lora_adapter(LoRARequest(path.name, int_id, str(path)), config=_config(base), max_rank=16, device=CPU)


def _decode_logits(runner: ModelRunner, works: list[list[SequenceWork]], prefixes: dict[int, tuple]) -> list:
    for slot, (tokens, lora) in prefixes.items():
        runner.forward([SequenceWork(slot=slot, cache_len=0, token_ids=tokens, logits_nodes=[0], lora=lora)])
    return [runner.forward(work).logits for work in works]


@pytest.mark.skipif(not fused_layer_available(), reason="no compiled one-call layer on this CPU")
@pytest.mark.parametrize("quantization", ["q8_0", "stored"])
def test_rows_of_other_adapters_change_no_bit_of_a_row(tiny_checkpoints, adapters, tmp_path, quantization):
    """Q8_0 weights (or a bfloat16 checkpoint's, as stored) on the one-call C++ layers: a
    request's tree under adapter A gives the bits of its tokens decoded one by one alone, beside
    a request of adapter B and a base request."""
    base = tiny_checkpoints["gemma3"]
    first, second = _adapter(base, adapters["gemma3"], 1), _adapter(base, adapters["gemma3-second"], 2)
    prefix, rest = PROMPT[:8], PROMPT[8:]
    n = len(prefix)
    weights = base if quantization == "q8_0" else half_checkpoint(base, tmp_path / "bf16", torch.bfloat16)

    def fresh():
        runner = _runner(weights, quantization=quantization, slots=3)
        assert runner.model._stack_for(torch.zeros(1, 64)) is not None  # the C++ stack runs
        return runner

    alone = _decode_logits(
        fresh(),
        [[SequenceWork(slot=0, cache_len=n + i, token_ids=[rest[i]], logits_nodes=[0], lora=first)] for i in range(4)],
        {0: (prefix, first)},
    )
    (together,) = _decode_logits(
        fresh(),
        [
            [
                SequenceWork(slot=1, cache_len=n, token_ids=[7, 8, 9], logits_nodes=[0, 1, 2], lora=second),
                SequenceWork(
                    slot=0,
                    cache_len=n,
                    token_ids=[rest[0], 99, rest[1], rest[2], rest[3]],
                    tree=Tree([-1, 0, 0, 2, 3]),
                    logits_nodes=[0, 2, 3, 4],
                    lora=first,
                ),
                SequenceWork(slot=2, cache_len=n, token_ids=[5, 6], logits_nodes=[0, 1]),
            ]
        ],
        {0: (prefix, first), 1: (prefix, second), 2: (prefix, None)},
    )
    assert torch.equal(together[3:7], torch.cat(alone))
    # and the adapter is applied: the base model gives other logits for the same tokens
    (base_rows,) = _decode_logits(
        fresh(), [[SequenceWork(slot=0, cache_len=n, token_ids=[rest[0]], logits_nodes=[0])]], {0: (prefix, None)}
    )
    assert not torch.allclose(base_rows, alone[0], atol=1e-3)


@pytest.mark.skipif(not fused_layer_available(), reason="no compiled one-call layer on this CPU")
def test_a_prompt_prefilled_at_once_gives_each_tokens_decoded_bits(tiny_checkpoints, adapters):
    """12 rows of one adapter in one forward (its deltas computed 8 rows and then 4 at a time)
    give each token's bits decoded alone."""
    base = tiny_checkpoints["gemma3"]
    first = _adapter(base, adapters["gemma3"], 1)
    runner = _runner(base, quantization="q8_0", slots=2)
    (wide,) = _decode_logits(
        runner,
        [[SequenceWork(slot=0, cache_len=0, token_ids=PROMPT, logits_nodes=list(range(len(PROMPT))), lora=first)]],
        {},
    )
    alone = _decode_logits(
        runner,
        [
            [SequenceWork(slot=1, cache_len=i, token_ids=[PROMPT[i]], logits_nodes=[0], lora=first)]
            for i in range(len(PROMPT))
        ],
        {},
    )
    assert torch.equal(wide, torch.cat(alone))


@pytest.mark.skipif(not fused_layer_available(), reason="no compiled one-call layer on this CPU")
@pytest.mark.parametrize("arch", ["gemma3", "qwen2"])
def test_the_one_call_layer_adds_what_the_torch_layer_adds(tiny_checkpoints, adapters, arch):
    """The C++ deltas are the torch layer's, to rounding (summed in another order); Qwen2's q/k/v
    biases come before the adapters' deltas in both."""
    base = tiny_checkpoints[arch]
    first = _adapter(base, adapters[arch], 1)
    results = []
    for fused in (True, False):
        runner = _runner(base, quantization="q8_0", slots=1)
        for layer in runner.model.layers:
            layer.fused = fused
        assert (runner.model._stack_for(torch.zeros(1, 64)) is not None) == fused  # which path runs
        (logits,) = _decode_logits(
            runner,
            [[SequenceWork(slot=0, cache_len=0, token_ids=PROMPT, logits_nodes=list(range(len(PROMPT))), lora=first)]],
            {},
        )
        results.append(logits)
    assert torch.allclose(results[0], results[1], atol=2e-2, rtol=0)
    assert (results[0].argmax(-1) == results[1].argmax(-1)).float().mean() >= 0.9


def test_slots_keep_their_adapters_and_take_absent_ones():
    def adapter(key: str) -> LoRAWeights:
        return LoRAWeights(name=key, int_id=1, path="", key=key, rank=1, layers=[])

    slots = LoRASlots(2)
    assert slots.assign([adapter("a")]) == {"a": 0}
    assert slots.assign([adapter("b"), adapter("a")]) == {"b": 1, "a": 0}
    assert slots.assign([adapter("c"), adapter("b")]) == {"c": 0, "b": 1}  # a's slot: a is absent
    assert slots.assign([adapter("a")]) == {"a": 1}  # b's slot: b was used less recently than c
    with pytest.raises(RuntimeError, match="exceeds max_loras 2"):
        slots.assign([adapter("a"), adapter("b"), adapter("c")])


def _broken_adapter(tmp_path: Path, source: Path, *, config: dict | None = None, tensors=None) -> Path:
    from safetensors.torch import load_file, save_file

    out = tmp_path / "broken"
    out.mkdir()
    settings = json.loads((source / "adapter_config.json").read_text())
    settings.update(config or {})
    (out / "adapter_config.json").write_text(json.dumps(settings))
    weights = load_file(source / "adapter_model.safetensors")
    save_file(tensors(weights) if tensors else weights, out / "adapter_model.safetensors")
    return out


def _only(weights: dict, keep) -> dict:
    return {name: tensor for name, tensor in weights.items() if keep(name)}


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(config={"use_dora": True}), "use_dora=True; only plain LoRA"),
        (dict(config={"bias": "all"}), "bias='all'"),
        (dict(config={"modules_to_save": ["lm_head"]}), "modules_to_save"),
        (dict(config={"peft_type": "IA3"}), "peft_type 'IA3' is not LORA"),
        (dict(config={"lora_alpha": -1}), "lora_alpha must be a positive number"),
        (
            dict(tensors=lambda w: {**w, "base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64)}),
            "embeddings and the LM head are not",
        ),
        (
            dict(tensors=lambda w: _only(w, lambda name: "q_proj.lora_B" not in name)),
            "q_proj: has lora_A without lora_B",
        ),
        (
            dict(tensors=lambda w: {n.replace("layers.0.", "layers.9."): t for n, t in w.items()}),
            "is for layer 9; the target has 4",
        ),
        (dict(tensors=lambda w: {}), "holds no LoRA tensors"),
    ],
)
def test_unsupported_adapters_are_refused_by_name(tiny_checkpoints, adapters, tmp_path, change, message):
    path = _broken_adapter(tmp_path, adapters["gemma3"], **change)
    with pytest.raises(LoRAError, match=message):
        _adapter(tiny_checkpoints["gemma3"], path, 1)


def test_adapters_that_do_not_fit_are_refused(tiny_checkpoints, adapters, tmp_path):
    gemma = tiny_checkpoints["gemma3"]
    narrower = _broken_adapter(
        tmp_path,
        adapters["gemma3"],
        tensors=lambda w: {
            n: t[:, :32].contiguous() if "layers.1.mlp.gate_proj.lora_A" in n else t for n, t in w.items()
        },
    )
    with pytest.raises(LoRAError, match=r"layer 1 gate_proj: lora_A \(8, 32\).*an adapter for another model"):
        _adapter(gemma, narrower, 1)
    config = _config(gemma)
    with pytest.raises(LoRAError, match="rank 8 exceeds max_lora_rank 4"):
        load_lora_adapter(LoRARequest("a", 1, str(adapters["gemma3"])), config=config, max_rank=4, device=CPU)
    with pytest.raises(LoRAError, match=r"is not a directory"):
        _adapter(gemma, tmp_path / "missing", 1)
    (tmp_path / "empty").mkdir()
    with pytest.raises(LoRAError, match=r"no adapter_config\.json"):
        _adapter(gemma, tmp_path / "empty", 1)
    (tmp_path / "empty" / "adapter_config.json").write_text("{not json")
    with pytest.raises(LoRAError, match=r"not valid JSON"):
        _adapter(gemma, tmp_path / "empty", 1)
    (tmp_path / "empty" / "adapter_config.json").write_text("{}")
    with pytest.raises(LoRAError, match=r"no adapter_model\.safetensors"):
        _adapter(gemma, tmp_path / "empty", 1)
    (tmp_path / "empty" / "adapter_model.safetensors").write_bytes(b"\x00\x01")
    with pytest.raises(LoRAError, match=r"cannot read adapter_model\.safetensors"):
        _adapter(gemma, tmp_path / "empty", 1)


@pytest.mark.parametrize(
    "args, message",
    [
        (("", 1, "/x"), "lora_name must be a non-empty string"),
        (("a", 0, "/x"), "lora_int_id must be an integer >= 1"),
        (("a", True, "/x"), "lora_int_id must be an integer >= 1"),
        (("a", 1, ""), "lora_path must be a non-empty path"),
    ],
)
def test_lora_request_fields_are_checked(args, message):
    with pytest.raises(LoRAError, match=message):
        LoRARequest(*args)


def test_registry_keeps_one_adapter_per_id_and_the_most_recent(tiny_checkpoints, adapters):
    gemma = tiny_checkpoints["gemma3"]
    registry = LoRARegistry(config=_config(gemma), max_rank=16, capacity=1, device=CPU)
    first = registry.get(LoRARequest("a", 1, str(adapters["gemma3"])))
    assert registry.get(LoRARequest("a", 1, str(adapters["gemma3"]))) is first
    with pytest.raises(LoRAError, match="lora_int_id 1 is adapter 'a'"):
        registry.get(LoRARequest("b", 1, str(adapters["gemma3-second"])))
    with pytest.raises(LoRAError, match="name 'a' is already lora_int_id 1"):
        registry.get(LoRARequest("a", 2, str(adapters["gemma3-second"])))
    registry.get(LoRARequest("b", 2, str(adapters["gemma3-second"])))
    assert registry.ids() == [2]  # capacity 1: the older one dropped
    assert registry.remove(2) and not registry.remove(2)


def write_gguf_adapter(peft_dir: Path, out: Path, *, architecture: str, config: ModelConfig, f16: bool = False) -> Path:
    """The PEFT adapter as llama.cpp's convert_lora_to_gguf writes it: blk.N.<leaf>.weight.lora_a/b,
    adapter.lora.alpha, and (Llama) the q and k B rows in llama.cpp's permuted order."""
    import gguf
    import numpy as np
    from safetensors.torch import load_file

    from tests.models.test_gguf import _llama_permute

    leaves = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
              "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}  # fmt: skip
    settings = json.loads((peft_dir / "adapter_config.json").read_text())
    writer = gguf.GGUFWriter(out, architecture)
    writer.add_type("adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(settings["lora_alpha"]))
    for name, tensor in sorted(load_file(peft_dir / "adapter_model.safetensors").items()):
        layer = name.split("layers.")[1].split(".")[0]
        proj = name.split(".lora_")[0].rsplit(".", 1)[1]
        ab = name.split(".lora_")[1][0].lower()
        values = tensor.float().numpy()
        if architecture == "llama" and ab == "b" and proj in ("q_proj", "k_proj"):
            values = _llama_permute(values, n_head=config.num_heads if proj == "q_proj" else config.num_kv_heads)
        values = np.ascontiguousarray(values.astype(np.float16 if f16 else np.float32))
        writer.add_tensor(f"blk.{layer}.{leaves[proj]}.weight.lora_{ab}", values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.mark.parametrize("arch", ["gemma3", "llama"])
def test_llama_cpp_gguf_adapters_load_as_their_peft_source(tiny_checkpoints, adapters, tmp_path, arch):
    """A GGUF LoRA adapter (llama.cpp's layout) gives the very parts of the PEFT adapter it was
    written from (Llama's permuted q and k rows put back), so the same tokens; float16 runs too."""
    base = tiny_checkpoints[arch]
    config = _config(base)
    path = write_gguf_adapter(adapters[arch], tmp_path / "a.gguf", architecture=arch, config=config)
    from_gguf, from_peft = _adapter(base, path, 1), _adapter(base, adapters[arch], 2)
    for ours, theirs in zip(from_gguf.layers, from_peft.layers):
        assert ours.keys() == theirs.keys()
        for site in ours:
            for part, expected in zip(ours[site], theirs[site]):
                assert part.col0 == expected.col0
                assert torch.equal(part.a, expected.a) and torch.equal(part.b, expected.b)
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_model_len=128)
    tokens = [
        llm.generate([PROMPT], GREEDY, lora_request=LoRARequest(n, i, str(p)))[0].outputs[0].token_ids
        for i, (n, p) in enumerate([("gguf", path), ("peft", adapters[arch])], start=1)
    ]
    assert tokens[0] == tokens[1]
    half = write_gguf_adapter(adapters[arch], tmp_path / "h.gguf", architecture=arch, config=config, f16=True)
    assert len(llm.generate([PROMPT], GREEDY, lora_request=LoRARequest("half", 3, str(half)))[0].outputs[0].token_ids)


def test_gguf_files_that_are_not_adapters_of_the_target_are_refused(tiny_checkpoints, adapters, tmp_path):
    from tests.models.test_gguf import build_tiny_gguf

    gemma = tiny_checkpoints["gemma3"]
    model_file = build_tiny_gguf(tmp_path, "llama-q8_0").path
    with pytest.raises(LoRAError, match=r"is not a LoRA adapter GGUF \(general.type"):
        _adapter(gemma, model_file, 1)
    llama_adapter = write_gguf_adapter(
        adapters["llama"], tmp_path / "l.gguf", architecture="llama", config=_config(tiny_checkpoints["llama"])
    )
    with pytest.raises(LoRAError, match="an adapter of 'llama' models; the target is 'gemma3'"):
        _adapter(gemma, llama_adapter, 1)
