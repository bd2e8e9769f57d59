"""vLLM's hf_overrides: config.json keys replaced, and a causal LM read as a reranker at some
tokens' logits (the original Qwen3-Reranker's "no" / "yes"): scores equal transformers' own
softmax over those logits of the unconverted model."""

from __future__ import annotations

import json

import pytest
import torch

from quickdraft import LLM
from quickdraft.config import EngineConfig
from quickdraft.server.config import ServerConfig

# The tiny tokenizer is byte-level without merges: one character is one token.
RERANKER = {
    "architectures": ["Qwen3ForSequenceClassification"],
    "classifier_from_token": ["n", "y"],
    "is_original_qwen3_reranker": True,
}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("QUICKDRAFT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def causal_lm(tiny_checkpoints):
    import transformers

    path = tiny_checkpoints["qwen3"]
    return path, transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def last_logits(model, ids: list[int]) -> torch.Tensor:  # [V]
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1]


def test_the_original_reranker_scores_the_lm_s_two_way_softmax(causal_lm, cache):
    path, model = causal_lm
    llm = LLM(str(path), max_model_len=64, hf_overrides=RERANKER)
    tokenizer = llm.tokenizer
    no, yes = tokenizer.encode("n", add_special_tokens=False)[0], tokenizer.encode("y", add_special_tokens=False)[0]
    query, documents = "a cat", ["the cat sat", "stock prices", "a kitten"]
    outputs = llm.score(query, documents)
    for document, out in zip(documents, outputs):
        ids = tokenizer.encode(query) + tokenizer.encode(document, add_special_tokens=False)
        expected = torch.softmax(last_logits(model, ids)[[no, yes]], dim=0)[1].item()
        assert out.prompt_token_ids == ids and out.outputs.score == pytest.approx(expected, abs=1e-5)
    assert len({round(out.outputs.score, 6) for out in outputs}) == 3
    assert llm.engine.pooler.classifier.labels == ("y",)
    source = json.loads((path / "config.json").read_text())
    assert source["architectures"] == ["Qwen3ForCausalLM"] and "num_labels" not in source  # untouched
    again = LLM(str(path), max_model_len=64, hf_overrides=RERANKER)
    assert again.engine.model_dir == llm.engine.model_dir  # made once, then reused
    from quickdraft.models.overrides import apply_hf_overrides
    from quickdraft.models.quantized_loader import PACKED_CACHE_FILE

    (path / PACKED_CACHE_FILE).write_bytes(b"")  # a cache the engine writes beside a GGUF conversion
    try:
        assert apply_hf_overrides(path, RERANKER, cache_root=cache / "overrides") == llm.engine.model_dir
    finally:
        (path / PACKED_CACHE_FILE).unlink()


def test_no_post_processing_keeps_one_label_per_token(causal_lm, cache):
    path, model = causal_lm
    tokens = ["a", "b", "c"]
    llm = LLM(
        str(path), max_model_len=64, hf_overrides={"classifier_from_token": tokens, "method": "no_post_processing"}
    )
    ids = [llm.tokenizer.encode(t, add_special_tokens=False)[0] for t in tokens]
    prompt = list(range(5, 30))
    [out] = llm.classify([prompt])
    expected = torch.softmax(last_logits(model, prompt)[ids], dim=0)
    torch.testing.assert_close(torch.tensor(out.outputs.probs), expected, rtol=1e-4, atol=1e-5)
    assert llm.engine.pooler.classifier.labels == ("a", "b", "c")


def test_directories_of_models_since_deleted_are_removed(tiny_checkpoints, tmp_path, cache):
    import shutil

    copy = shutil.copytree(tiny_checkpoints["qwen3"], tmp_path / "copy")
    kept = LLM(str(tiny_checkpoints["qwen3"]), max_model_len=64, hf_overrides=RERANKER).engine.model_dir
    gone = LLM(str(copy), max_model_len=64, hf_overrides=RERANKER).engine.model_dir
    shutil.rmtree(copy)
    LLM(str(tiny_checkpoints["qwen3"]), max_model_len=64, hf_overrides={"max_position_embeddings": 100})
    assert kept.is_dir() and not gone.exists()


def test_other_keys_replace_config_json_s(tiny_checkpoints, cache):
    path = tiny_checkpoints["qwen3"]
    with pytest.raises(ValueError, match="exceeds the model's context 100"):
        LLM(str(path), max_model_len=128, hf_overrides={"max_position_embeddings": 100})
    assert LLM(str(path), max_model_len=100, hf_overrides={"max_position_embeddings": 100}).engine.max_model_len == 100


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["architectures"], "must be a JSON object"),
        ({"method": "no_post_processing"}, "method needs classifier_from_token"),
        ({"classifier_from_token": ["n", "y"]}, "needs a method"),
        ({"classifier_from_token": ["n", "y"], "method": "mean"}, "method must be one of"),
        ({"classifier_from_token": ["n", "y", "z"], "method": "from_2_way_softmax"}, "reads two tokens"),
        ({"classifier_from_token": "y", "method": "no_post_processing"}, "must be a list of token strings"),
        (
            {"classifier_from_token": ["n", "y"], "is_original_qwen3_reranker": True, "architectures": ["Qwen3Model"]},
            "makes a \\*ForSequenceClassification model",
        ),
        ({"rope_scaling": {1, 2}}, "JSON values only"),
    ],
)
def test_bad_overrides_name_the_problem(overrides, message, tiny_checkpoints):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model=str(tiny_checkpoints["qwen3"]), hf_overrides=overrides)
    with pytest.raises(ValueError, match=message):
        ServerConfig(model=str(tiny_checkpoints["qwen3"]), hf_overrides=overrides)


def test_a_token_the_tokenizer_splits_is_refused(tiny_checkpoints, cache):
    overrides = dict(RERANKER, classifier_from_token=["no", "yes"])  # 2 and 3 byte tokens here
    with pytest.raises(ValueError, match=r"classifier_from_token 'no' is 2 tokens .* each must be one token"):
        LLM(str(tiny_checkpoints["qwen3"]), max_model_len=64, hf_overrides=overrides)


def test_serve_takes_hf_overrides_as_json(tiny_checkpoints):
    from quickdraft.cli import _server_config, build_parser

    args = build_parser().parse_args(["serve", str(tiny_checkpoints["qwen3"]), "--hf-overrides", json.dumps(RERANKER)])
    config = _server_config(args, api_key=None)
    assert config.hf_overrides == RERANKER and config.engine_config().hf_overrides == RERANKER


def test_a_gguf_s_head_rows_are_read_from_the_file(tmp_path, cache):
    """A GGUF conversion keeps its quantized (here F16) LM head in the file: the rows are
    read from there, and the scores are the causal LM's (with the file's rounded weights)."""
    from gguf import GGMLQuantizationType as QType

    from tests.models.test_gguf import byte_level_vocab, tiny_model, write_tiny_gguf

    vocab = byte_level_vocab(pre="qwen2")
    model = tiny_model("qwen3", vocab_size=len(vocab.tokens)).eval()
    path = tmp_path / "lm.gguf"
    stored = write_tiny_gguf(
        path, architecture="qwen3", model=model, vocab=vocab, qtypes={"token_embd": QType.F16, "output": QType.F16}
    )
    model.load_state_dict(stored, strict=False)
    model.tie_weights()
    llm = LLM(str(path), max_model_len=64, hf_overrides=RERANKER)
    no, yes = (llm.tokenizer.encode(t, add_special_tokens=False)[0] for t in ("n", "y"))
    prompt = list(range(5, 30))
    [out] = llm.classify([prompt])
    expected = torch.softmax(last_logits(model, prompt)[[no, yes]], dim=0)[1].item()
    assert out.outputs.probs[0] == pytest.approx(expected, abs=1e-5)
