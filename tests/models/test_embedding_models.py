"""Embedding models (EmbeddingGemma's layout): a Gemma 3 encoder with bidirectional attention
saved alone (Gemma3TextModel), and the sentence-transformers modules after it (mean pooling, Dense
layers, Normalize).  Their embeddings equal transformers' encoder followed by those modules."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from quickdraft import LLM, PoolingParams, SamplingParams
from quickdraft.models.attention import build_sequence_attention
from quickdraft.models.sentence_transformers import read_embedding_head, write_dense_layer, write_modules
from quickdraft.verify.tree import Tree
from tests.conftest import TINY, write_tiny_tokenizer

PROMPT = list(range(5, 45))  # 40 token ids: far beyond the sliding layers' reach of 4 either way
DENSE_SIZE = 96


def tiny_encoder_config():
    import transformers

    return transformers.Gemma3TextConfig(
        **TINY,
        head_dim=16,
        sliding_window=8,  # |query - key| <= 4 on sliding layers
        query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
        use_bidirectional_attention=True,
    )


def build_tiny_embedding_model(out_dir, *, seed: int = 0, tanh_with_bias: bool = False, vocab_size: int | None = None):
    """A random Gemma3TextModel (bidirectional) with sentence-transformers modules after it."""
    import transformers

    torch.manual_seed(seed)
    config = tiny_encoder_config()
    if vocab_size is not None:
        config.vocab_size = vocab_size
    model = transformers.Gemma3TextModel(config).float().eval()
    with torch.no_grad():  # random norms, sharp attention: a wrong mask or norm cannot hide
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.3)
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(4.0)
    model.save_pretrained(out_dir)
    write_tiny_tokenizer(out_dir, bos="<bos>", eos="<eos>", chat=False)
    hidden = model.config.hidden_size
    activation = "tanh" if tanh_with_bias else "identity"
    write_dense_layer(out_dir / "2_Dense", weight=torch.randn(DENSE_SIZE, hidden) / 8, bias=None, activation="identity")
    write_dense_layer(
        out_dir / "3_Dense",
        weight=torch.randn(hidden, DENSE_SIZE) / 8,
        bias=torch.randn(hidden) if tanh_with_bias else None,
        activation=activation,
    )
    write_modules(out_dir, hidden_size=hidden, pooling_type="MEAN", dense=["2_Dense", "3_Dense"], normalize=True)
    return out_dir


def reference_embedding(path, ids: list[int], *, normalize: bool = True) -> torch.Tensor:
    """transformers' encoder, mean pooling, the Dense layers, the norm: sentence-transformers' steps."""
    import transformers

    model = transformers.Gemma3TextModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        vector = model(torch.tensor([ids])).last_hidden_state[0].mean(0)
    head = read_embedding_head(path)
    vector = head.project(vector)
    return torch.nn.functional.normalize(vector, dim=0) if normalize else vector


@pytest.fixture(scope="module")
def encoder_dir(tmp_path_factory):
    return build_tiny_embedding_model(tmp_path_factory.mktemp("embedding-gemma"))


@pytest.fixture(scope="module")
def encoder(encoder_dir):
    return LLM(str(encoder_dir), max_model_len=64)


def test_config_reads_the_symmetric_window_and_the_modules(encoder, encoder_dir):
    config = encoder.engine.model_config
    assert config.bidirectional_attention and config.sliding_window == 5  # transformers' 8 // 2 + 1
    assert json.loads((encoder_dir / "config.json").read_text())["architectures"] == ["Gemma3TextModel"]
    pooler = encoder.engine.pooler
    assert pooler.pooling_type == "MEAN" and pooler.output_size == TINY["hidden_size"]
    assert [layer.weight.shape[0] for layer in pooler.head.dense] == [DENSE_SIZE, TINY["hidden_size"]]
    assert encoder.engine.cache.num_slots == 1  # embed() alone uses slots, one prompt at a time


def test_embeddings_equal_transformers_encoder_and_modules(encoder, encoder_dir):
    [out] = encoder.embed([PROMPT])
    torch.testing.assert_close(
        torch.tensor(out.outputs.embedding), reference_embedding(encoder_dir, PROMPT), rtol=1e-4, atol=1e-5
    )
    [raw] = encoder.embed([PROMPT], PoolingParams(normalize=False))
    torch.testing.assert_close(
        torch.tensor(raw.outputs.embedding),
        reference_embedding(encoder_dir, PROMPT, normalize=False),
        rtol=1e-4,
        atol=1e-4,
    )


def test_every_token_sees_the_whole_prompt(encoder):
    """Changing the last token moves the first token's state (a causal model's would stay)."""
    first = encoder.embed([PROMPT], PoolingParams(pooling_type="CLS"))[0].outputs.embedding
    changed = encoder.embed([PROMPT[:-1] + [7]], PoolingParams(pooling_type="CLS"))[0].outputs.embedding
    assert first != changed


def test_a_small_step_budget_still_runs_the_prompt_whole(encoder, encoder_dir):
    small = LLM(str(encoder_dir), max_model_len=64, max_num_batched_tokens=7)
    assert small.embed([PROMPT])[0].outputs.embedding == encoder.embed([PROMPT])[0].outputs.embedding


def test_quantized_encoder_is_close_to_the_float_one(encoder, encoder_dir):
    """Q8_0 weights on the quantized kernels (the one-call C++ layer's attention reads the same
    bidirectional masks)."""
    q8 = LLM(str(encoder_dir), max_model_len=64, quantization="q8_0")
    for pooling in ("MEAN", "CLS"):
        params = PoolingParams(pooling_type=pooling)
        ours = torch.tensor(q8.embed([PROMPT], params)[0].outputs.embedding)
        exact = torch.tensor(encoder.embed([PROMPT], params)[0].outputs.embedding)
        assert torch.dot(ours, exact).item() > 0.999


def test_tanh_dense_layer_with_bias(tmp_path):
    path = build_tiny_embedding_model(tmp_path / "tanh", seed=1, tanh_with_bias=True)
    llm = LLM(str(path), max_model_len=64)
    torch.testing.assert_close(
        torch.tensor(llm.embed([PROMPT])[0].outputs.embedding), reference_embedding(path, PROMPT), rtol=1e-4, atol=1e-5
    )


def test_an_encoder_does_not_generate(encoder, encoder_dir):
    with pytest.raises(ValueError, match=r"is an embedding model .* does not generate text"):
        encoder.generate([PROMPT], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="does not generate text"):
        LLM(str(encoder_dir), max_model_len=64, speculative_config={"method": "ngram"})


def test_bidirectional_masks_refuse_cached_tokens_and_trees():
    seq, positions = build_sequence_attention(
        slot=0, row_start=0, cache_len=0, tree=None, num_new=7, sliding_window=3, bidirectional=True
    )
    assert positions == list(range(7)) and seq.full_mask is None
    expected = torch.tensor([[abs(q - k) < 3 for k in range(7)] for q in range(7)])
    assert torch.equal(seq.sliding_mask, expected)
    short, _ = build_sequence_attention(
        slot=0, row_start=0, cache_len=0, tree=None, num_new=3, sliding_window=3, bidirectional=True
    )
    assert short.sliding_mask is None  # every key within reach
    with pytest.raises(ValueError, match="runs each sequence whole in one forward"):
        build_sequence_attention(
            slot=0, row_start=0, cache_len=4, tree=None, num_new=3, sliding_window=3, bidirectional=True
        )
    with pytest.raises(ValueError, match="and a draft tree"):
        build_sequence_attention(
            slot=0, row_start=0, cache_len=0, tree=Tree([-1, 0]), num_new=2, sliding_window=3, bidirectional=True
        )


def test_matryoshka_dimensions(tmp_path):
    path = build_tiny_embedding_model(tmp_path / "mrl", seed=2)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [16, 32]}))
    llm = LLM(str(path), max_model_len=64)
    full = torch.tensor(llm.embed([PROMPT], PoolingParams(normalize=False))[0].outputs.embedding)
    cut = torch.tensor(llm.embed([PROMPT], PoolingParams(dimensions=16))[0].outputs.embedding)
    torch.testing.assert_close(cut, full[:16] / full[:16].norm(), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="can have 16, 32, 64 dimensions, not 8"):
        llm.embed([PROMPT], PoolingParams(dimensions=8))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: (d / "modules.json").write_text("{}"), "not a sentence-transformers module list"),
        (
            lambda d: (d / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True})),
            "one of pooling_mode_mean_tokens, .* must be set",
        ),
        (
            lambda d: (d / "2_Dense" / "config.json").write_text(
                json.dumps({"in_features": 64, "out_features": 96, "bias": False, "activation_function": "x.Gelu"})
            ),
            "Dense activation 'x.Gelu' is not supported",
        ),
        (
            lambda d: (d / "2_Dense" / "config.json").write_text(
                json.dumps(
                    {
                        "in_features": 64,
                        "out_features": 95,
                        "bias": False,
                        "activation_function": "torch.nn.modules.linear.Identity",
                    }
                )
            ),
            r"linear.weight has shape \(96, 64\), its config says \(95, 64\)",
        ),
    ],
)
def test_bad_modules_are_named(tmp_path, edit, message):
    path = build_tiny_embedding_model(tmp_path / "bad")
    edit(path)
    with pytest.raises(ValueError, match=message):
        read_embedding_head(path)


def write_embedding_gguf(
    path, model, *, dense: list[torch.Tensor], vocab, qtype: str = "F32", pooling: int | None = None
) -> None:
    """A Gemma3TextModel encoder and its Dense weights ([out, in], in order) as llama.cpp's converter
    writes EmbeddingGemma: architecture gemma-embedding, the whole sliding span, mean pooling, the
    Dense layers as dense_2 / dense_3 (their sizes in the metadata), matrices `qtype`; `pooling`:
    llama.cpp's pooling_type (default mean)."""
    import gguf

    from tests.models.test_gguf import _write_hparams

    config, arch = model.config, "gemma-embedding"
    writer = gguf.GGUFWriter(str(path), arch)
    _write_hparams(writer, architecture=arch, config=config)  # the keys every architecture has
    writer.add_float32(f"{arch}.rope.freq_base_swa", config.rope_parameters["sliding_attention"]["rope_theta"])
    writer.add_sliding_window((config.sliding_window - 1) * 2)  # config.json's span, as the converter writes it
    writer.add_array(f"{arch}.attention.sliding_window_pattern", [t == "sliding_attention" for t in config.layer_types])
    writer.add_pooling_type(gguf.PoolingType.MEAN if pooling is None else gguf.PoolingType(pooling))
    for index, weight in enumerate(dense, start=2):
        writer.add_dense_features_dims(f"dense_{index}", weight.shape[1], weight.shape[0])
    vocab.write(writer)
    quantized = gguf.GGMLQuantizationType[qtype]

    def add(name: str, weights: np.ndarray) -> None:
        if weights.ndim == 2 and quantized != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, gguf.quants.quantize(weights, quantized), raw_dtype=quantized)
        else:
            writer.add_tensor(name, weights)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA_EMBEDDING, config.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        gguf_name = names.get_name("model." + name, try_suffixes=(".weight", ".bias"))
        weights = tensor.float().numpy()
        if gguf_name.endswith("norm.weight"):
            weights = weights + 1.0  # llama.cpp stores Gemma's (1 + w)
        add(gguf_name, np.ascontiguousarray(weights))
    for index, weight in enumerate(dense, start=2):
        add(f"dense_{index}.weight", weight.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def embedding_gguf_of(path, encoder_dir, *, vocab, qtype: str):
    """`encoder_dir` (build_tiny_embedding_model) written by write_embedding_gguf."""
    import transformers
    from safetensors.torch import load_file

    model = transformers.Gemma3TextModel.from_pretrained(encoder_dir, dtype=torch.float32)
    dense = [load_file(str(encoder_dir / sub / "model.safetensors"))["linear.weight"] for sub in ("2_Dense", "3_Dense")]
    write_embedding_gguf(path, model, dense=dense, vocab=vocab, qtype=qtype)
    return path


def test_gguf_embedding_gemma(tmp_path, monkeypatch):
    """llama.cpp's gemma-embedding files: converted to the same encoder and modules."""
    from tests.models.test_gguf import spiece_vocab

    monkeypatch.setenv("QUICKDRAFT_CACHE", str(tmp_path / "cache"))
    vocab = spiece_vocab()
    hf_dir = build_tiny_embedding_model(tmp_path / "hf", seed=3, vocab_size=len(vocab.tokens))
    expected = reference_embedding(hf_dir, PROMPT)
    exact = LLM(str(embedding_gguf_of(tmp_path / "f32.gguf", hf_dir, vocab=vocab, qtype="F32")), max_model_len=64)
    assert exact.engine.model_config.bidirectional_attention and exact.engine.model_config.sliding_window == 5
    assert exact.engine.pooler.pooling_type == "MEAN" and exact.engine.pooler.head.normalize
    torch.testing.assert_close(torch.tensor(exact.embed([PROMPT])[0].outputs.embedding), expected, rtol=1e-4, atol=1e-5)
    # the converted directory's float copy carries the modules: sentence-transformers runs it as we do
    from sentence_transformers import SentenceTransformer

    from quickdraft.models.gguf import float_checkpoint_dir

    library = SentenceTransformer(str(float_checkpoint_dir(exact.engine.model_dir)), device="cpu")
    features = {"input_ids": torch.tensor([PROMPT]), "attention_mask": torch.ones(1, len(PROMPT), dtype=torch.long)}
    with torch.no_grad():
        torch.testing.assert_close(library(features)["sentence_embedding"][0], expected, rtol=1e-4, atol=1e-5)
    q8 = LLM(str(embedding_gguf_of(tmp_path / "q8.gguf", hf_dir, vocab=vocab, qtype="Q8_0")), max_model_len=64)
    assert torch.dot(torch.tensor(q8.embed([PROMPT])[0].outputs.embedding), expected).item() > 0.999


def test_bidirectional_attention_only_for_gemma3():
    from quickdraft.models.config import ModelConfig
    from tests.conftest import tiny_hf_config

    llama = tiny_hf_config("llama").to_dict() | {"use_bidirectional_attention": True}
    with pytest.raises(ValueError, match=r"supported for Gemma 3 encoders .*, not llama"):
        ModelConfig.from_hf_dict(llama)
    assert not ModelConfig.from_hf_dict(tiny_hf_config("gemma3").to_dict()).bidirectional_attention


def test_a_bare_qwen3_model_with_last_token_pooling_modules(tmp_path):
    """Qwen3-Embedding's layout: a causal Qwen3 saved as the base model (`Qwen3Model`, tensors
    without `model.`, here without an LM head and with untied embeddings), last-token pooling and
    Normalize modules, no Dense layer."""
    import transformers

    from tests.conftest import tiny_hf_config

    torch.manual_seed(4)
    model = transformers.Qwen3Model(tiny_hf_config("qwen3")).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.3)
    model.save_pretrained(tmp_path)
    write_tiny_tokenizer(tmp_path, bos="<s>", eos="</s>", chat=False)
    write_modules(tmp_path, hidden_size=model.config.hidden_size, pooling_type="LAST", dense=[], normalize=True)
    llm = LLM(str(tmp_path), max_model_len=64)
    assert llm.engine.pooler.pooling_type == "LAST" and not llm.engine.is_encoder
    with torch.no_grad():
        last = model(torch.tensor([PROMPT])).last_hidden_state[0, -1]
    ours = torch.tensor(llm.embed([PROMPT])[0].outputs.embedding)
    torch.testing.assert_close(ours, last / last.norm(), rtol=1e-4, atol=1e-5)
    # untied embeddings and no lm_head.weight: it embeds, it cannot generate
    assert llm.engine.embedding_only and llm.engine.cache.num_slots == 1
    with pytest.raises(ValueError, match=r"saved without its LM head: lm_head\.weight is missing"):
        llm.generate([PROMPT[:4]], SamplingParams(max_tokens=3))


@pytest.mark.parametrize("tanh_with_bias", [False, True])
def test_equal_to_sentence_transformers_itself(tmp_path, tanh_with_bias):
    """The directory as the sentence-transformers library loads and runs it (its own Transformer,
    Pooling, Dense and Normalize modules) gives our vectors."""
    from sentence_transformers import SentenceTransformer

    path = build_tiny_embedding_model(tmp_path / "st", seed=5, tanh_with_bias=tanh_with_bias)
    library = SentenceTransformer(str(path), device="cpu")
    assert [type(module).__name__ for module in library] == ["Transformer", "Pooling", "Dense", "Dense", "Normalize"]
    features = {"input_ids": torch.tensor([PROMPT]), "attention_mask": torch.ones(1, len(PROMPT), dtype=torch.long)}
    with torch.no_grad():
        expected = library(features)["sentence_embedding"][0]
    ours = torch.tensor(LLM(str(path), max_model_len=64).embed([PROMPT])[0].outputs.embedding)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)


def test_a_gguf_pooling_type_without_a_vector_writes_no_modules(tmp_path, monkeypatch):
    """pooling_type 0 (none) or 4 (rank) names no vector: with no Dense layers the file converts
    without modules (the model's default pooling), as before pooling types were read."""
    import transformers

    from tests.models.test_gguf import spiece_vocab

    monkeypatch.setenv("QUICKDRAFT_CACHE", str(tmp_path / "cache"))
    vocab = spiece_vocab()
    hf_dir = build_tiny_embedding_model(tmp_path / "hf", seed=6, vocab_size=len(vocab.tokens))
    model = transformers.Gemma3TextModel.from_pretrained(hf_dir, dtype=torch.float32)
    path = tmp_path / "none.gguf"
    write_embedding_gguf(path, model, dense=[], vocab=vocab, pooling=0)
    llm = LLM(str(path), max_model_len=64)
    assert not (llm.engine.model_dir / "modules.json").exists()
    assert llm.engine.pooler.pooling_type == "LAST" and llm.engine.pooler.head is None
