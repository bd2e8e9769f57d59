"""Quantized targets: GGUF weights as stored and HF weights quantized to Q8_0 at load.

Loading keeps every value of the file (dequantized rows equal the float conversion bit for bit),
whole forwards are batch-invariant (a token's logits are the same bits alone, in a chain, in a
tree, beside another request), and so speculative greedy output equals plain output."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from quickdraft import LLM, SamplingParams
from quickdraft.engine.runner import ModelRunner, SequenceWork
from quickdraft.kernels.quant_linear import fused_layer_available, kernel_available
from quickdraft.kv.cache import KVCache
from quickdraft.models.loader import load_decoder, resolve_gguf_path, resolve_model_dir, resolve_quantization
from quickdraft.models.quantized import FORMAT_IDS, QuantizedWeight
from quickdraft.models.quantized_loader import PACKED_CACHE_FILE
from quickdraft.verify.tree import Tree
from tests.conftest import build_tiny_checkpoint
from tests.engine.test_speculative import GREEDY, GarbageDrafter, repetitive_prompts
from tests.models.test_gguf import build_tiny_gguf

CPU = torch.device("cpu")
PROMPT = [2, 40, 41, 300, 77, 91, 120, 5, 260, 261, 262, 263, 100, 101, 50, 51, 52, 53]


@pytest.fixture(scope="module")
def tiny_gguf_paths(tmp_path_factory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("quantized_ggufs")
    return {
        name: build_tiny_gguf(directory, name).path
        for name in (
            "gemma3-mixed",
            "gemma3-lowbit",
            "llama-q8_0",
            "qwen3-bf16",
            "qwen2-f16",
            "phi3-q8_0",
            "gemma2-mixed",
            "smollm3-q8_0",
            "qwen3moe-q8_0",
            "qwen2moe-mixed",
            "qwen3moe-mxfp4",
            "gpt-oss-mxfp4",
            "mixtral-mixed",
            "mixtral-split",
        )
    }


def load(path: Path, quantization: str | None, *, huge_pages: bool = False):
    model_dir = resolve_model_dir(path)
    return load_decoder(
        model_dir,
        dtype=torch.float32,
        device=CPU,
        max_len=128,
        quantization=quantization,
        gguf_path=resolve_gguf_path(path),
        huge_pages=huge_pages,
    )


@pytest.mark.parametrize(
    "name",
    [
        "gemma3-mixed",
        "gemma3-lowbit",
        "llama-q8_0",
        "qwen3-bf16",
        "qwen2-f16",  # every tensor F16, the embedding and the LM head too
        "phi3-q8_0",
        "smollm3-q8_0",
        "qwen3moe-q8_0",
        "qwen2moe-mixed",  # a shared expert (Q8_0) beside the routed ones (Q4_0)
        "qwen3moe-mxfp4",  # MXFP4 experts, as gpt-oss files and llama.cpp's MXFP4_MOE mixes store them
        "mixtral-mixed",
        "mixtral-split",  # one tensor per expert, as Mixtral files were written before spring 2024
    ],
)
def test_gguf_weights_kept_as_stored(tiny_gguf_paths, name):
    floats, _ = load(tiny_gguf_paths[name], None)
    quantized, _ = load(tiny_gguf_paths[name], "gguf")
    float_state = floats.state_dict()
    held = {n: m for n, m in _quantized_weights(quantized).items()}
    assert held, "nothing was kept quantized"
    for param_name, weight in held.items():
        # the same values as the dequantized float model, fused q/k/v and llama's Q/K order included
        assert torch.equal(weight.dequantize(), float_state[param_name]), param_name
    if name == "gemma3-lowbit":  # each of its formats runs on its own kernel tiles
        formats = {part.format for weight in held.values() for part in weight.parts}
        assert formats == {"Q2_K", "Q3_K", "IQ4_XS", "IQ4_NL", "Q4_1", "Q5_1"}, formats
    if name == "mixtral-split":  # the file's experts are tensors of their own, each kept as stored
        assert "layers.0.experts.3.gate_up_proj" in held and "layers.1.experts.0.down_proj" in held
        stacked, _ = load(tiny_gguf_paths["mixtral-mixed"], "gguf")  # the same model, experts stacked
        for param_name, weight in _quantized_weights(stacked).items():
            assert torch.equal(weight.dequantize(), held[param_name].dequantize()), param_name
    if name == "qwen3moe-mxfp4":
        assert {p.format for p in held["layers.0.experts.0.gate_up_proj"].parts} == {"MXFP4"}
    if name == "qwen3-bf16":  # its ffn weights are BF16 in the file: kept as they are
        assert {p.format for p in held["layers.0.gate_up_proj"].parts} == {"BF16"}
    if name == "qwen2-f16":
        assert {p.format for w in held.values() for p in w.parts} == {"F16"} and "embed_tokens" in held
    # nothing quantized is also held as a float copy
    assert not set(held) & set(quantized.state_dict())


def _quantized_weights(model) -> dict[str, QuantizedWeight]:
    return {
        f"{module_name}.{attr}".lstrip("."): value
        for module_name, module in model.named_modules()
        for attr, value in vars(module).items()
        if isinstance(value, QuantizedWeight)
    }


def _runner(model, config, *, slots: int, kv_dtype=torch.float32) -> ModelRunner:
    cache = KVCache(
        num_layers=config.num_layers,
        num_slots=slots,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        max_len=128,
        dtype=kv_dtype,
        device=CPU,
        block_size=4,  # the same rows whichever blocks the slots' keys land in
    )
    return ModelRunner(model=model, cache=cache, device=CPU)


def _logits(model, config, work_list, *, prefix: list[int], slots: int = 3, kv_dtype=torch.float32):
    runner = _runner(model, config, slots=slots, kv_dtype=kv_dtype)
    for slot in range(slots if prefix else 0):  # no prefix: nothing to prefill
        runner.forward([SequenceWork(slot=slot, cache_len=0, token_ids=prefix, logits_nodes=[0])])
    return [runner.forward(work).logits for work in work_list]


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "name",
    # qwen3moe: its 4 experts a token go to the threads whole at one row, each expert's matmuls
    # are split between them in wider forwards; mixtral-mixed: 2 a token, split at every width;
    # qwen2moe-mixed: a shared expert for every row beside 4 routed ones
    [
        "gemma3-mixed",
        "gemma3-lowbit",
        "llama-q8_0",
        "phi3-q8_0",
        "gemma2-mixed",
        "qwen3moe-q8_0",
        "qwen2moe-mixed",
        "qwen3moe-mxfp4",
        "gpt-oss-mxfp4",  # the torch layer around the kernels, sinks in the C++ attention
        "mixtral-mixed",
        "qwen3-bf16",  # BF16 MLP matrices in the one-call layer beside Q8_0 attention
        "qwen2-f16",  # F16 everywhere: no activation quantization at all
    ],
)
def test_whole_forward_is_batch_invariant(tiny_gguf_paths, name, kv_dtype):
    model, config = load(tiny_gguf_paths[name], "gguf")
    prefix, rest = PROMPT[:12], PROMPT[12:]
    n = len(prefix)
    alone = _logits(
        model,
        config,
        [[SequenceWork(slot=0, cache_len=n + i, token_ids=[rest[i]], logits_nodes=[0])] for i in range(len(rest))],
        prefix=prefix,
        slots=1,
        kv_dtype=kv_dtype,
    )
    alone = torch.cat(alone)
    chain_and_other, tree = _logits(
        model,
        config,
        [
            # a chain of all six beside another request's tree
            [
                SequenceWork(
                    slot=2, cache_len=n, token_ids=[7, 8, 9, 10], tree=Tree([-1, 0, 0, 1]), logits_nodes=[0, 1, 2, 3]
                ),
                SequenceWork(slot=1, cache_len=n, token_ids=rest, logits_nodes=list(range(len(rest)))),
            ],
            # the first three inside a tree with wrong siblings
            [
                SequenceWork(
                    slot=0,
                    cache_len=n,
                    token_ids=[rest[0], 99, rest[1], 98, rest[2]],
                    tree=Tree([-1, 0, 0, 2, 2]),
                    logits_nodes=[0, 2, 4],
                )
            ],
        ],
        prefix=prefix,
        kv_dtype=kv_dtype,
    )
    assert torch.equal(chain_and_other[4:], alone)
    assert torch.equal(tree, alone[:3])


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_many_decodes_in_one_forward_equal_each_alone(tiny_gguf_paths, kv_dtype):
    """Ten requests with contexts of different lengths, each decoding a token: one forward for
    all (attention's work items of every sequence in one parallel region, their heads sharing key
    reads) gives each request's bits decoded alone, with a float32 or a float16 KV cache."""
    model, config = load(tiny_gguf_paths["gemma3-mixed"], "gguf")
    slots = 10
    runner = _runner(model, config, slots=slots, kv_dtype=kv_dtype)
    lengths = [2 + slot for slot in range(slots)]  # windows full and not, one block and several
    for slot, length in enumerate(lengths):
        runner.forward([SequenceWork(slot=slot, cache_len=0, token_ids=PROMPT[:length], logits_nodes=[0])])
    decodes = [
        SequenceWork(slot=slot, cache_len=length, token_ids=[PROMPT[length]], logits_nodes=[0])
        for slot, length in enumerate(lengths)
    ]
    together = runner.forward(decodes).logits
    alone = torch.cat([runner.forward([work]).logits for work in decodes])
    assert torch.equal(together, alone)


@pytest.mark.parametrize("amx", ["1", "0"])
def test_prefill_rows_equal_decoded_rows(tiny_gguf_paths, monkeypatch, amx):
    """All 18 rows of a prompt in one forward (wide enough for the AMX tiles of the Q8_0 LM head
    where the CPU has them, and for attention that shares key reads between heads) give each
    token's bits decoded alone."""
    from quickdraft.kernels.quant_linear import AMX_ENV

    monkeypatch.setenv(AMX_ENV, amx)
    model, config = load(tiny_gguf_paths["gemma3-mixed"], "gguf")
    (wide,) = _logits(
        model,
        config,
        [[SequenceWork(slot=0, cache_len=0, token_ids=PROMPT, logits_nodes=list(range(len(PROMPT))))]],
        prefix=[],
        slots=1,
    )
    alone = _logits(
        model,
        config,
        [[SequenceWork(slot=0, cache_len=i, token_ids=[PROMPT[i]], logits_nodes=[0])] for i in range(len(PROMPT))],
        prefix=[],
        slots=1,
    )
    assert torch.equal(wide, torch.cat(alone))


@pytest.mark.parametrize("quantization", ["gguf", None])
def test_float16_kv_cache_rounds_keys_and_values_once(tiny_gguf_paths, quantization):
    """A float16 KV cache (the fused layer, or the float layer's torch attention) holds the
    float32 cache's keys and values rounded to half, and gives logits close to its."""
    model, config = load(tiny_gguf_paths["gemma3-mixed"], quantization)
    work = [[SequenceWork(slot=0, cache_len=0, token_ids=PROMPT, logits_nodes=list(range(len(PROMPT))))]]
    caches = {}
    logits = {}
    for dtype in (torch.float32, torch.float16):
        runner = _runner(model, config, slots=1, kv_dtype=dtype)
        logits[dtype] = runner.forward(work[0]).logits
        caches[dtype] = runner.cache
    assert caches[torch.float16].keys[0].dtype == torch.float16
    assert caches[torch.float16].keys[0].nbytes * 2 == caches[torch.float32].keys[0].nbytes
    # layer 0's keys depend on the prompt only: the half cache holds them rounded once
    assert torch.equal(caches[torch.float16].keys[0], caches[torch.float32].keys[0].half())
    assert torch.equal(caches[torch.float16].values[0], caches[torch.float32].values[0].half())
    difference = (logits[torch.float16] - logits[torch.float32]).abs().max()
    assert 0 < difference < 0.05 * logits[torch.float32].abs().max()


def test_quantized_logits_close_to_float(tiny_gguf_paths):
    floats, config = load(tiny_gguf_paths["gemma3-mixed"], None)
    quantized, _ = load(tiny_gguf_paths["gemma3-mixed"], "gguf")
    work = [[SequenceWork(slot=0, cache_len=0, token_ids=PROMPT, logits_nodes=list(range(len(PROMPT))))]]
    expected = _logits(floats, config, work, prefix=[2], slots=1)[0]
    got = _logits(quantized, config, work, prefix=[2], slots=1)[0]
    assert (got - expected).abs().max() < 0.05 * expected.abs().max()


@pytest.mark.parametrize(
    ("name", "kv_cache_dtype", "tree"),
    [
        ("gemma3-mixed", "auto", False),
        ("gemma3-mixed", "auto", True),
        ("gemma3-mixed", "float16", False),
        ("gemma3-mixed", "float16", True),
        ("gemma3-lowbit", "auto", True),
        ("mixtral-mixed", "auto", True),  # the mixture of experts in the one-call layer
        ("qwen3moe-q8_0", "float16", False),
        ("qwen2moe-mixed", "auto", True),
        ("qwen3moe-mxfp4", "auto", True),
        ("gpt-oss-mxfp4", "float16", True),
    ],
)
def test_garbage_drafter_exact_on_gguf_as_stored(tiny_gguf_paths, name, tree, kv_cache_dtype):
    path = str(tiny_gguf_paths[name])
    params = SamplingParams(max_tokens=24, **GREEDY)
    prompts = [p[:12] for p in repetitive_prompts()]
    plain = LLM(path, max_model_len=128, max_num_seqs=4, kv_cache_dtype=kv_cache_dtype)
    assert plain.engine.quantization == "gguf"
    assert plain.engine.cache.keys[0].dtype == (torch.float16 if kv_cache_dtype == "float16" else torch.float32)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    llm = LLM(
        path,
        max_model_len=128,
        max_num_seqs=4,
        kv_cache_dtype=kv_cache_dtype,
        speculative_config={"method": "ngram", "num_speculative_tokens": 6},
    )
    llm.engine.speculator.drafter = GarbageDrafter(vocab_size=plain.engine.model_config.vocab_size, tree=tree)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    assert llm.get_metrics().num_draft_tokens > 50


@pytest.mark.parametrize("quantization", [None, "gguf"])
def test_yarn_gguf_gives_transformers_logits(tmp_path, quantization):
    """A Qwen2 GGUF with llama.cpp's YaRN keys (rope.scaling.type yarn, factor, original context):
    the decoder rotates as transformers does with those parameters, past the original context."""
    tiny = build_tiny_gguf(tmp_path, "qwen2-yarn")
    model, config = load(tiny.path, quantization)
    rope = config.rope_by_layer_type["full_attention"]
    assert (rope.rope_type, rope.factor, rope.original_max_position_embeddings) == ("yarn", 4.0, 32)
    tiny.model.load_state_dict(tiny.expected, strict=False)
    tokens = (PROMPT * 3)[:48]  # past the 32-position original context
    with torch.no_grad():
        expected = tiny.model(torch.tensor([tokens])).logits[0]
    work = [SequenceWork(slot=0, cache_len=0, token_ids=tokens, logits_nodes=list(range(len(tokens))))]
    (got,) = _logits(model, config, [work], prefix=[], slots=1)
    tolerance = 1e-4 if quantization is None else 5e-2  # the kernels' int8 activations
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize(("name", "quantization"), [("gpt-oss-f32", None), ("gpt-oss-mxfp4", "gguf")])
def test_gpt_oss_gguf_gives_transformers_logits(tmp_path, name, quantization):
    """gpt-oss as llama.cpp writes it (sinks, biased router and experts, gate and up apart, YaRN,
    sliding layers first and every other one): the decoder gives transformers' logits on the
    weights the file stores, its MXFP4 experts kept as stored and run on the kernels."""
    tiny = build_tiny_gguf(tmp_path, name)
    model, config = load(tiny.path, quantization)
    assert config.layer_types == ("sliding_attention", "full_attention") and config.attention_sinks
    if quantization == "gguf":
        assert {p.format for p in _quantized_weights(model)["layers.1.experts.3.down_proj"].parts} == {"MXFP4"}
    tiny.model.load_state_dict(tiny.expected)
    tokens = (PROMPT * 3)[:40]  # past the 4-token window and the 32-position original context
    with torch.no_grad():
        expected = tiny.model(torch.tensor([tokens])).logits[0]
    work = [SequenceWork(slot=0, cache_len=0, token_ids=tokens, logits_nodes=list(range(len(tokens))))]
    (got,) = _logits(model, config, [work], prefix=[], slots=1)
    tolerance = 1e-4 if quantization is None else 5e-2  # the kernels' int8 activations
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)


def test_gguf_float_matrices_quantized_at_load(tmp_path, tiny_gguf_paths, caplog):
    """quantization "gguf+q8_0": what the file stores quantized stays as stored, its float
    matrices (here Qwen3's BF16 MLP, all of an F32 gpt-oss) become Q8_0, so every layer runs in
    the one call; under "gguf" BF16 stays BF16 and only F32 matrices are left to the float path
    (with a warning naming the option); a garbage drafter's trees still return plain greedy
    decoding's tokens."""
    path = tiny_gguf_paths["qwen3-bf16"]
    resolve_model_dir(path).joinpath(PACKED_CACHE_FILE).unlink(missing_ok=True)  # read the file again
    stored, _ = load(path, "gguf")
    both, _ = load(path, "gguf+q8_0")
    held, held_both = _quantized_weights(stored), _quantized_weights(both)
    assert {p.format for p in held["layers.0.gate_up_proj"].parts} == {"BF16"}
    assert {p.format for p in held_both["layers.0.gate_up_proj"].parts} == {"Q8_0"}
    mixed, _ = load(tiny_gguf_paths["gemma3-mixed"], "gguf+q8_0")  # nothing stored as floats
    assert {p.format for p in _quantized_weights(mixed)["layers.0.qkv_proj"].parts} == {"Q5_0"}  # as stored
    gpt_oss = build_tiny_gguf(tmp_path, "gpt-oss-f32").path
    with caplog.at_level("WARNING"):
        load(gpt_oss, "gguf")
    assert "stored as float32" in caplog.text and "quantization='gguf+q8_0'" in caplog.text
    model, config = load(gpt_oss, "gguf+q8_0")
    assert model._stack_for(torch.zeros(1, config.hidden_size)) is not None or not fused_layer_available()
    params = SamplingParams(max_tokens=16, **GREEDY)
    prompts = [p[:12] for p in repetitive_prompts()]
    plain = LLM(str(gpt_oss), quantization="gguf+q8_0", max_model_len=128, max_num_seqs=4)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    spec = LLM(
        str(gpt_oss),
        quantization="gguf+q8_0",
        max_model_len=128,
        max_num_seqs=4,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4},
    )
    spec.engine.speculator.drafter = GarbageDrafter(vocab_size=config.vocab_size, tree=True)
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == expected


def test_q8_0_at_load_speculative_equals_plain(tiny_checkpoints):
    path = str(tiny_checkpoints["llama"])
    params = SamplingParams(max_tokens=32, **GREEDY)
    plain = LLM(path, max_model_len=256, max_num_seqs=4, quantization="q8_0")
    assert _quantized_weights(plain.engine.model)
    expected = [o.outputs[0].token_ids for o in plain.generate(repetitive_prompts(), params)]
    spec = LLM(
        path,
        max_model_len=256,
        max_num_seqs=4,
        quantization="q8_0",
        speculative_config={"method": "suffix", "num_speculative_tokens": 6},
    )
    assert [o.outputs[0].token_ids for o in spec.generate(repetitive_prompts(), params)] == expected
    assert spec.get_metrics().num_accepted_tokens > 0


def half_checkpoint(source: Path, out: Path, dtype: torch.dtype) -> Path:
    """A copy of a tiny HF checkpoint with every tensor in `dtype` (as most published ones are)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, out)
    tensors = load_file(str(out / "model.safetensors"))
    save_file({name: t.to(dtype).contiguous() for name, t in tensors.items()}, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize(("arch", "dtype"), [("llama", torch.bfloat16), ("gemma3", torch.float16)])
def test_hf_float16_checkpoint_runs_as_stored(tmp_path, tiny_checkpoints, arch, dtype):
    """A bfloat16 / float16 HF checkpoint on the CPU with the dtype "auto": its matrices kept as
    stored (BF16 / F16 parts, half the bytes of float32 weights) and multiplied in float32, so the
    logits are the float32 model's up to the order of its sums; the float32 checkpoint stays on
    the float path; greedy speculation with a garbage drafter returns plain decoding's tokens."""
    path = half_checkpoint(tiny_checkpoints[arch], tmp_path / arch, dtype)
    assert resolve_quantization(None, dtype="auto", gguf_path=None, device=CPU, model_dir=path) == "stored"
    assert (
        resolve_quantization(None, dtype="auto", gguf_path=None, device=CPU, model_dir=tiny_checkpoints[arch]) is None
    )
    assert resolve_quantization(None, dtype="float32", gguf_path=None, device=CPU, model_dir=path) is None
    if arch == "llama":  # a mixture of experts (no dense MLP) is recognised too
        moe = half_checkpoint(build_tiny_checkpoint("qwen3_moe", tmp_path / "moe32"), tmp_path / "moe", dtype)
        assert resolve_quantization(None, dtype="auto", gguf_path=None, device=CPU, model_dir=moe) == "stored"
    stored, config = load(path, "stored")
    floats, _ = load(path, None)  # the same values, float32
    held = _quantized_weights(stored)
    name = {torch.bfloat16: "BF16", torch.float16: "F16"}[dtype]
    assert {p.format for w in held.values() for p in w.parts} == {name} and "layers.0.qkv_proj" in held
    for param_name, weight in held.items():
        assert torch.equal(weight.dequantize(), floats.state_dict()[param_name]), param_name
    work = [SequenceWork(slot=0, cache_len=0, token_ids=PROMPT, logits_nodes=list(range(len(PROMPT))))]
    (got,) = _logits(stored, config, [work], prefix=[], slots=1)
    (expected,) = _logits(floats, config, [work], prefix=[], slots=1)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    params = SamplingParams(max_tokens=24, **GREEDY)
    prompts = [p[:12] for p in repetitive_prompts()]
    plain = LLM(str(path), max_model_len=128, max_num_seqs=4)
    assert plain.engine.quantization == "stored"
    reference = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    spec = LLM(
        str(path),
        max_model_len=128,
        max_num_seqs=4,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4},
    )
    spec.engine.speculator.drafter = GarbageDrafter(vocab_size=config.vocab_size, tree=True)
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == reference


def test_quantization_choices_and_errors(tiny_checkpoints, tiny_gguf_paths):
    gguf_path = tiny_gguf_paths["gemma3-mixed"]
    resolve = resolve_quantization
    assert resolve(None, dtype="auto", gguf_path=gguf_path, device=CPU) == "gguf"
    assert resolve(None, dtype="float32", gguf_path=gguf_path, device=CPU) is None  # today's float path
    assert resolve(None, dtype="auto", gguf_path=None, device=CPU) is None  # a HF directory
    assert resolve("none", dtype="auto", gguf_path=gguf_path, device=CPU) is None
    assert resolve("q8_0", dtype="auto", gguf_path=None, device=CPU) == "q8_0"
    assert resolve(None, dtype="auto", gguf_path=gguf_path, device=torch.device("cuda")) is None
    with pytest.raises(ValueError, match="unknown quantization 'q3'"):
        resolve("q3", dtype="auto", gguf_path=gguf_path, device=CPU)
    assert resolve("gguf+q8_0", dtype="auto", gguf_path=gguf_path, device=CPU) == "gguf+q8_0"
    with pytest.raises(ValueError, match=r"needs a \.gguf model"):
        LLM(str(tiny_checkpoints["llama"]), quantization="gguf", max_model_len=64)
    with pytest.raises(ValueError, match=r"'gguf\+q8_0' needs a \.gguf model"):
        LLM(str(tiny_checkpoints["llama"]), quantization="gguf+q8_0", max_model_len=64)
    with pytest.raises(ValueError, match="computes in float32"):
        LLM(str(gguf_path), quantization="gguf", dtype="bfloat16", max_model_len=64)
    with pytest.raises(ValueError, match="CPU kernels only"):
        resolve("gguf", dtype="auto", gguf_path=gguf_path, device=torch.device("cuda"))
    with pytest.raises(ValueError, match="'stored' is for HF checkpoints"):
        resolve("stored", dtype="auto", gguf_path=gguf_path, device=CPU)


@pytest.mark.skipif(not kernel_available(), reason="no compiled quantized kernel on this CPU")
@pytest.mark.parametrize("narrow", [False, True])
def test_lm_head_takes_the_levels_asked_for(tiny_gguf_paths, monkeypatch, narrow):
    """A Q8_0 LM head's logits are the kernel's at lm_head_activation_levels (63 under
    QUICKDRAFT_LM_HEAD_NARROW=1), whichever way they are asked for (with and without a logits
    buffer), and narrow decoding stays exact: speculative greedy output equals plain."""
    from quickdraft.kernels.quant_linear import NARROW_LM_HEAD_ENV, reference_quant_linear
    from quickdraft.models.decoder import LogitsBuffer

    monkeypatch.setenv(NARROW_LM_HEAD_ENV, "1" if narrow else "0")
    model, _ = load(tiny_gguf_paths["llama-q8_0"], "gguf")
    weight = model.lm_head_weight
    assert isinstance(weight, QuantizedWeight)
    hidden = torch.randn(5, weight.shape[1]) * 3  # [5, D]
    levels = 63 if narrow else 127
    expected = reference_quant_linear(model.norm(hidden), weight, activation_levels=levels)
    assert torch.equal(model.compute_logits(hidden), expected)
    buffer = LogitsBuffer(vocab_size=weight.shape[0], max_bytes=1 << 20)
    assert torch.equal(model.compute_logits(hidden, buffer=buffer), expected)
    other = reference_quant_linear(model.norm(hidden), weight, activation_levels=190 - levels)
    assert not torch.equal(other, expected)  # the levels matter
    path = str(tiny_gguf_paths["llama-q8_0"])
    params = SamplingParams(max_tokens=16, **GREEDY)
    prompts = repetitive_prompts()[:3]
    plain = [o.outputs[0].token_ids for o in LLM(path, max_model_len=128).generate(prompts, params)]
    spec = LLM(path, max_model_len=128, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == plain


def test_reference_path_gives_the_same_tokens(tiny_gguf_paths, monkeypatch):
    """The portable torch code and the kernel are one numerics: same greedy tokens."""
    from quickdraft.kernels import quant_linear as module

    path = str(tiny_gguf_paths["llama-q8_0"])
    params = SamplingParams(max_tokens=12, **GREEDY)
    prompts = [p[:10] for p in repetitive_prompts()[:2]]
    fast = [o.outputs[0].token_ids for o in LLM(path, max_model_len=64).generate(prompts, params)]
    monkeypatch.setattr(module, "_extension", lambda: None)
    slow = [o.outputs[0].token_ids for o in LLM(path, max_model_len=64).generate(prompts, params)]
    assert fast == slow


def _set_fused(model, fused: bool) -> None:
    for layer in model.layers:
        layer.fused = fused


@pytest.mark.skipif(not kernel_available(), reason="no compiled quantized kernel on this CPU")
@pytest.mark.parametrize(
    "name",
    [
        "llama-q8_0",
        "gemma3-mixed",
        "gemma3-lowbit",
        "phi3-q8_0",
        "gemma2-mixed",
        "qwen3moe-q8_0",
        "qwen2moe-mixed",
        "mixtral-mixed",
        "llama-q8_0+biases",
        "gpt-oss-mxfp4",  # sinks, biased router and experts, the clamped activation
    ],
)
def test_one_call_layer_matches_the_python_layer(tiny_gguf_paths, name):
    """The C++ layer computes what DecoderLayer's torch code computes, to rounding.  Rounding
    differences of ~1e-7 can flip an int8 activation quant (a ~1% step) now and then, and later
    layers carry such a flip along, so: one layer's output elementwise (flips rare), the whole
    model's next-token choices (nearly all equal).  "+biases": every matmul of every layer given
    a bias (Qwen2 has q/k/v biases; other checkpoints o_proj or MLP ones)."""
    model, config = load(tiny_gguf_paths[name.removesuffix("+biases")], "gguf")
    if name.endswith("+biases"):
        generator = torch.Generator().manual_seed(0)
        for layer in model.layers:
            for site, rows in (("qkv", layer.qkv_proj), ("o", layer.o_proj), ("gate_up", layer.gate_up_proj)):
                bias = torch.randn(rows.shape[0], generator=generator) * 0.5
                setattr(layer, f"{site}_bias", torch.nn.Parameter(bias, requires_grad=False))
            layer.down_bias = torch.nn.Parameter(torch.randn(config.hidden_size, generator=generator) * 0.5)
        assert model.layers[0]._fused_weights() is not None  # the biases run in the one call
    work = [
        [SequenceWork(slot=0, cache_len=1, token_ids=PROMPT[1:], logits_nodes=list(range(len(PROMPT) - 1)))],
        [
            SequenceWork(
                slot=0, cache_len=len(PROMPT), token_ids=[5, 6, 7], tree=Tree([-1, 0, 0]), logits_nodes=[0, 1, 2]
            ),
            SequenceWork(slot=1, cache_len=1, token_ids=PROMPT[1:9], logits_nodes=[7]),
        ],
    ]
    results = {}
    for fused in (False, True):
        _set_fused(model, fused)
        logits = torch.cat(_logits(model, config, work, prefix=[2], slots=2))
        cache = KVCache(
            num_layers=config.num_layers,
            num_slots=1,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            max_len=128,
            dtype=torch.float32,
            device=CPU,
        )
        runner = ModelRunner(model=model, cache=cache, device=CPU)
        first_layer = runner.forward([SequenceWork(slot=0, cache_len=0, token_ids=PROMPT)], end_layer=1)
        results[fused] = (logits, first_layer.forward.hidden_states)
    (python_logits, python_hidden), (fused_logits, fused_hidden) = results[False], results[True]
    off = (fused_hidden - python_hidden).abs() > 1e-4 * python_hidden.abs().max()
    assert off.float().mean() < 0.01
    assert (fused_logits.argmax(-1) == python_logits.argmax(-1)).float().mean() >= 0.9


@pytest.mark.skipif(not kernel_available(), reason="no compiled quantized kernel on this CPU")
def test_one_call_layer_follows_a_replaced_weight_or_norm(tiny_gguf_paths):
    """The fused layer gathers its kernel arguments once; a weight or norm put in place later
    (another model's) must be what the next forward reads, as a freshly loaded model would."""
    model, config = load(tiny_gguf_paths["gemma3-mixed"], "gguf")
    other, _ = load(tiny_gguf_paths["gemma3-mixed"], "gguf")
    with torch.no_grad():
        other.layers[0].input_layernorm.weight.mul_(-1.5)
    other.layers[1].gate_up_proj = model.layers[0].gate_up_proj  # same shape, other values
    work = [[SequenceWork(slot=0, cache_len=1, token_ids=PROMPT[1:], logits_nodes=list(range(len(PROMPT) - 1)))]]
    before = torch.cat(_logits(model, config, work, prefix=[2]))
    expected = torch.cat(_logits(other, config, work, prefix=[2]))
    assert not torch.equal(before, expected)
    model.layers[0].input_layernorm.weight = other.layers[0].input_layernorm.weight  # a new Parameter
    model.layers[1].gate_up_proj = other.layers[1].gate_up_proj
    assert torch.equal(torch.cat(_logits(model, config, work, prefix=[2])), expected)
    # A bias set later is what the next forward adds: the outputs move.
    model.layers[1].qkv_bias = torch.nn.Parameter(torch.full((model.layers[1].qkv_proj.shape[0],), 0.5))
    assert not torch.equal(torch.cat(_logits(model, config, work, prefix=[2])), expected)


@pytest.mark.skipif(not kernel_available(), reason="no compiled quantized kernel on this CPU")
def test_one_call_mixture_follows_a_replaced_expert_or_router(tiny_gguf_paths):
    """A mixture's layer runs in the one call (the stack is built) and reads an expert's weight
    or the router put in place after a forward, as a freshly loaded model would."""
    model, config = load(tiny_gguf_paths["mixtral-mixed"], "gguf")
    other, _ = load(tiny_gguf_paths["mixtral-mixed"], "gguf")
    assert model._stack_for(torch.zeros(1, config.hidden_size)) is not None or not fused_layer_available()
    other.layers[0].experts[1].gate_up_proj = model.layers[0].experts[0].gate_up_proj  # same shape, other values
    other.layers[1].router = torch.nn.Parameter(model.layers[1].router.flip(0), requires_grad=False)
    work = [[SequenceWork(slot=0, cache_len=1, token_ids=PROMPT[1:], logits_nodes=list(range(len(PROMPT) - 1)))]]
    before = torch.cat(_logits(model, config, work, prefix=[2]))
    expected = torch.cat(_logits(other, config, work, prefix=[2]))
    assert not torch.equal(before, expected)
    model.layers[0].experts[1].gate_up_proj = other.layers[0].experts[1].gate_up_proj
    model.layers[1].router = other.layers[1].router
    assert torch.equal(torch.cat(_logits(model, config, work, prefix=[2])), expected)


@pytest.mark.skipif(not kernel_available(), reason="no compiled quantized kernel on this CPU")
def test_one_call_mixture_with_a_nan_router_picks_experts_in_range(tiny_gguf_paths):
    """Router logits that are NaN (an overflow upstream) still pick k distinct experts of the
    layer (the first ones), so the NaN reaches the logits instead of an index past the experts."""
    model, config = load(tiny_gguf_paths["qwen3moe-q8_0"], "gguf")
    model.layers[0].router = torch.nn.Parameter(
        torch.full_like(model.layers[0].router, float("nan")), requires_grad=False
    )
    work = [[SequenceWork(slot=0, cache_len=1, token_ids=PROMPT[1:6], logits_nodes=[0, 4])]]
    (logits,) = _logits(model, config, work, prefix=[2])
    assert logits.shape[0] == 2 and torch.isnan(logits).all()


@pytest.mark.parametrize(
    "name",
    [
        "gemma3-mixed",
        "llama-q8_0",
        "gemma2-mixed",
        "smollm3-q8_0",
        "qwen3moe-q8_0",
        "qwen2moe-mixed",
        "mixtral-mixed",
        "gpt-oss-mxfp4",
    ],
)
def test_every_layer_in_one_call_is_the_layer_by_layer_forward(tiny_gguf_paths, name, monkeypatch):
    """The decoder's stack in one C++ call (FusedStack) computes what the loop over the one-call
    layers does, bit for bit: logits, captured layers, and a forward stopped early (end_layer),
    with Gemma's sliding and full layers reading their own rotary tables and key ranges."""
    from quickdraft.models.decoder import Decoder

    if not fused_layer_available():
        pytest.skip("no compiled decoder layer here")
    model, config = load(tiny_gguf_paths[name], "gguf")
    capture = (0, config.num_layers // 2, config.num_layers - 1)
    work = [SequenceWork(slot=0, cache_len=12, token_ids=PROMPT[12:], logits_nodes=list(range(len(PROMPT) - 12)))]

    def forwards() -> list[torch.Tensor]:
        runner = _runner(model, config, slots=1)
        runner.forward([SequenceWork(slot=0, cache_len=0, token_ids=PROMPT[:12], logits_nodes=[11])])
        full = runner.forward(work, capture_layers=capture)
        no_logits = [SequenceWork(slot=0, cache_len=12, token_ids=PROMPT[12:])]
        partial = runner.forward(no_logits, end_layer=config.num_layers - 1)
        return [full.logits, *(full.forward.captured[i] for i in capture), partial.forward.hidden_states]

    stacks = []
    built = Decoder._stack_for
    monkeypatch.setattr(Decoder, "_stack_for", lambda self, hidden: stacks.append(built(self, hidden)) or stacks[-1])
    at_once = forwards()
    assert stacks and all(stack is not None for stack in stacks)  # every forward took the one call
    monkeypatch.setattr(Decoder, "_stack_for", lambda self, hidden: None)
    layer_by_layer = forwards()
    for a, b in zip(at_once, layer_by_layer, strict=True):
        assert torch.equal(a, b)


def test_packed_weights_are_cached_beside_the_conversion(tiny_gguf_paths):
    from quickdraft.models.quantized_loader import PACKED_CACHE_FILE

    path = tiny_gguf_paths["llama-q8_0"]
    first, _ = load(path, "gguf")
    cache_file = resolve_model_dir(path) / PACKED_CACHE_FILE
    assert cache_file.is_file()
    second, _ = load(path, "gguf")  # read back from the cache
    for name, weight in _quantized_weights(first).items():
        assert torch.equal(_quantized_weights(second)[name].dequantize(), weight.dequantize()), name
    # A broken cache (replaced, not written in place: the loads above map the file's pages)
    broken = cache_file.with_name("broken.tmp")
    broken.write_bytes(b"not a safetensors file")
    os.replace(broken, cache_file)
    third, _ = load(path, "gguf")  # a broken cache is rebuilt, not trusted
    assert torch.equal(
        _quantized_weights(third)["layers.0.qkv_proj"].dequantize(),
        _quantized_weights(first)["layers.0.qkv_proj"].dequantize(),
    )
    assert cache_file.stat().st_size > 1000


def test_formats_without_a_kernel_load_as_floats_with_a_warning(tmp_path, caplog):
    path = build_tiny_gguf(tmp_path, "gemma3-iq2").path
    floats, _ = load(path, None)
    with caplog.at_level("WARNING"):
        quantized, _ = load(path, "gguf")
    assert "no quantized kernel for IQ2_XXS" in caplog.text
    held = _quantized_weights(quantized)
    assert "layers.0.o_proj" not in held and "layers.0.qkv_proj" in held
    assert torch.equal(quantized.state_dict()["layers.0.o_proj"], floats.state_dict()["layers.0.o_proj"])


def test_mxfp4_blocks_beyond_float16_scales_load_as_floats(tmp_path, caplog):
    """An MXFP4 tensor with a block scale 2^(e - 128) that float16 cannot hold exactly (e = 200)
    is loaded as floats, with its exact values; the other MXFP4 tensors stay as stored."""
    import gguf

    path = build_tiny_gguf(tmp_path, "qwen3moe-mxfp4").path
    reader = gguf.GGUFReader(path)
    tensor = next(t for t in reader.tensors if t.name == "blk.0.ffn_down_exps.weight")
    offset = int(tensor.data_offset)
    del reader
    with open(path, "r+b") as file:  # the first block's exponent byte
        file.seek(offset)
        file.write(bytes([200]))
    floats, _ = load(path, None)
    with caplog.at_level("WARNING"):
        quantized, _ = load(path, "gguf")
    assert "MXFP4 (or blocks it cannot hold exactly)" in caplog.text
    held = _quantized_weights(quantized)
    assert "layers.0.experts.0.down_proj" not in held and "layers.0.experts.0.gate_up_proj" in held
    assert "layers.1.experts.0.down_proj" in held
    state = quantized.state_dict()
    assert torch.equal(state["layers.0.experts.0.down_proj"], floats.state_dict()["layers.0.experts.0.down_proj"])
    assert state["layers.0.experts.0.down_proj"].abs().max() > 1e20  # 2^72 * level: kept as it is


def test_a_cache_written_for_fewer_formats_is_rebuilt(tiny_gguf_paths):
    """A packed cache from a version that kept fewer formats as stored (it left the others as
    floats) is rebuilt, so the file's Q2_K / Q3_K / IQ4 / Q4_1 / Q5_1 tensors reach their kernels."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    from quickdraft.models.quantized_loader import PACKED_CACHE_FILE

    path = tiny_gguf_paths["gemma3-lowbit"]
    load(path, "gguf")
    cache_file = resolve_model_dir(path) / PACKED_CACHE_FILE
    older = ["Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q5_K", "Q6_K"]
    with safe_open(str(cache_file), "pt") as file:
        layout = {k: v for k, v in json.loads(file.metadata()["layout"]).items() if "layers.0" not in k}
        tensors = {key: file.get_tensor(key).clone() for key in file.keys() if key.split("#")[0] in layout}
    stale = cache_file.with_name("stale.tmp")
    save_file(tensors, str(stale), metadata={"layout": json.dumps(layout), "formats": json.dumps(older)})
    os.replace(stale, cache_file)
    model, _ = load(path, "gguf")
    assert "layers.0.o_proj" in _quantized_weights(model)  # rebuilt: layer 0 quantized again
    with safe_open(str(cache_file), "pt") as file:
        assert json.loads(file.metadata()["formats"]) == list(FORMAT_IDS)


def _mapped_ranges(path) -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of `path` (Linux /proc/self/maps)."""
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].strip() == str(path):
                start, end = (int(address, 16) for address in fields[0].split("-"))
                ranges.append((start, end))
    return ranges


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads Linux /proc/self/maps")
def test_packed_weights_are_mapped_from_the_cache_file_not_copied(tiny_gguf_paths):
    from quickdraft.models.quantized_loader import PACKED_CACHE_FILE

    path = tiny_gguf_paths["llama-q8_0"]
    cache_file = resolve_model_dir(path) / PACKED_CACHE_FILE
    for _ in range(2):  # the load that writes the cache, then one that reads it
        model, _ = load(path, "gguf")
        ranges = _mapped_ranges(cache_file.resolve())
        for name, weight in _quantized_weights(model).items():
            for part in weight.parts:
                address = part.packed.data_ptr()
                assert any(start <= address < end for start, end in ranges), name  # page cache, shared


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads Linux /proc/self/maps")
@pytest.mark.parametrize("writes_cache", [True, False], ids=["first-load", "cached"])
def test_packed_weights_read_into_huge_pages(tmp_path, writes_cache):
    from quickdraft.models.heap import HUGE_PAGE_BYTES, huge_page_bytes_at, transparent_huge_pages
    from quickdraft.models.quantized_loader import PACKED_CACHE_FILE

    path = build_tiny_gguf(tmp_path, "gemma3-mixed").path
    cache_file = resolve_model_dir(path) / PACKED_CACHE_FILE
    mapped, config = load(path, "gguf")  # writes the cache, maps it
    if writes_cache:
        cache_file.unlink()
    huge, _ = load(path, "gguf", huge_pages=True)
    assert cache_file.is_file()
    ranges = _mapped_ranges(cache_file.resolve())
    addresses = []
    for name, weight in _quantized_weights(huge).items():
        assert torch.equal(weight.dequantize(), _quantized_weights(mapped)[name].dequantize()), name
        for part in weight.parts:
            address = part.packed.data_ptr()
            assert not any(start <= address < end for start, end in ranges), name  # read, not mapped
            addresses.append(address)
    assert min(addresses) % HUGE_PAGE_BYTES == 0  # one region, from a 2 MB boundary
    if transparent_huge_pages():
        assert huge_page_bytes_at(min(addresses)) >= HUGE_PAGE_BYTES
    runners = [_runner(model, config, slots=1) for model in (mapped, huge)]
    work = [SequenceWork(slot=0, cache_len=0, token_ids=PROMPT, logits_nodes=list(range(len(PROMPT))))]
    first, second = (runner.forward(work).logits for runner in runners)
    assert torch.equal(first, second)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads Linux /proc/self/maps")
def test_weights_stay_mapped_where_the_kernel_gives_no_huge_page(tmp_path, monkeypatch, caplog):
    from quickdraft.models import heap, quantized_loader
    from quickdraft.models.quantized_loader import PACKED_CACHE_FILE, quantized_weights_in_huge_pages

    path = build_tiny_gguf(tmp_path, "llama-q8_0").path
    load(path, "gguf")  # writes the cache
    monkeypatch.setattr(heap, "huge_page_bytes_at", lambda address: 0)
    monkeypatch.setattr(heap, "HUGE_PAGE_BYTES", 4096)  # a page smaller than the tiny model's weights
    reads = []
    real_read = quantized_loader._read_exactly

    def counted_read(file, view, **kwargs):
        reads.append(len(view))
        real_read(file, view, **kwargs)

    monkeypatch.setattr(quantized_loader, "_read_exactly", counted_read)
    model, _ = load(path, "gguf", huge_pages=True)
    assert "gave no transparent huge page" in caplog.text
    assert reads == [4096]  # the first page told: the rest of the file was not read
    ranges = _mapped_ranges((resolve_model_dir(path) / PACKED_CACHE_FILE).resolve())
    for name, weight in _quantized_weights(model).items():
        for part in weight.parts:
            assert any(start <= part.packed.data_ptr() < end for start, end in ranges), name
    assert not quantized_weights_in_huge_pages(model)


def test_q8_0_at_load_into_huge_pages_is_the_same_model(tiny_checkpoints):
    from quickdraft.models.heap import transparent_huge_pages

    path = str(tiny_checkpoints["llama"])
    params = SamplingParams(max_tokens=16, **GREEDY)
    outputs = []
    for huge in (False, True):
        llm = LLM(path, max_model_len=128, max_num_seqs=2, quantization="q8_0", weights_in_huge_pages=huge)
        assert llm.engine.weights_in_huge_pages is (huge and transparent_huge_pages())
        weights = _quantized_weights(llm.engine.model)
        outputs.append(([w.dequantize() for w in weights.values()], llm.generate(repetitive_prompts(), params)))
    (plain_weights, plain_out), (huge_weights, huge_out) = outputs
    assert all(torch.equal(a, b) for a, b in zip(plain_weights, huge_weights, strict=True))
    assert [o.outputs[0].token_ids for o in huge_out] == [o.outputs[0].token_ids for o in plain_out]


def test_float_weights_are_not_reported_in_huge_pages(tiny_checkpoints):
    llm = LLM(str(tiny_checkpoints["llama"]), max_model_len=64, max_num_seqs=1, weights_in_huge_pages=True)
    assert llm.engine.quantization is None
    assert llm.engine.weights_in_huge_pages is False  # asked for, but only quantized weights move there
