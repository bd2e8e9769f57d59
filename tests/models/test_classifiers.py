"""Sequence classifiers and rerankers (*ForSequenceClassification checkpoints: a `score` head on
the last token's final state): LLM.classify and cross-encoder scores equal transformers' own."""

from __future__ import annotations

import pytest
import torch

from quickdraft import LLM, SamplingParams
from tests.conftest import tiny_hf_config, write_tiny_tokenizer

PROMPT = list(range(5, 37))
LABELS = {0: "negative", 1: "neutral", 2: "positive"}


def build_tiny_classifier(out_dir, *, num_labels: int, seed: int = 0):
    """A random Qwen3ForSequenceClassification (1 label: a reranker's shape)."""
    import transformers

    torch.manual_seed(seed)
    config = tiny_hf_config("qwen3")
    config.num_labels = num_labels
    if num_labels > 1:
        config.id2label = {i: LABELS[i] for i in range(num_labels)}
        config.label2id = {v: k for k, v in config.id2label.items()}
    config.pad_token_id = 0
    model = transformers.Qwen3ForSequenceClassification(config).float().eval()
    with torch.no_grad():  # random norms, a head whose logits are not all near 0
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.3)
        model.score.weight.mul_(20.0)
    model.save_pretrained(out_dir)
    write_tiny_tokenizer(out_dir, bos="<s>", eos="</s>", chat=False)
    return model


def transformers_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    path = tmp_path_factory.mktemp("classifier")
    model = build_tiny_classifier(path, num_labels=3)
    return model, LLM(str(path), max_model_len=64)


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    path = tmp_path_factory.mktemp("reranker")
    model = build_tiny_classifier(path, num_labels=1, seed=1)
    return model, LLM(str(path), max_model_len=64)


def test_classify_is_transformers_softmax(classifier):
    model, llm = classifier
    [out] = llm.classify([PROMPT])
    expected = torch.softmax(transformers_logits(model, PROMPT), dim=0)
    torch.testing.assert_close(torch.tensor(out.outputs.probs), expected, rtol=1e-4, atol=1e-5)
    assert out.outputs.num_classes == 3 and out.prompt_token_ids == PROMPT
    assert llm.engine.pooler.classifier.labels == ("negative", "neutral", "positive")
    [cut] = llm.classify([PROMPT], truncate_prompt_tokens=8)
    expected = torch.softmax(transformers_logits(model, PROMPT[-8:]), dim=0)
    torch.testing.assert_close(torch.tensor(cut.outputs.probs), expected, rtol=1e-4, atol=1e-5)


def test_encode_classifies_the_prompt_or_every_token(classifier):
    """LLM.encode on a classifier: by default what classify gives; "token_classify" the score
    head's softmax at every token, as transformers computes it before pooling the last one."""
    model, llm = classifier
    assert llm.encode([PROMPT])[0].outputs.data.tolist() == llm.classify([PROMPT])[0].outputs.probs
    [out] = llm.encode([PROMPT], pooling_task="token_classify")
    with torch.no_grad():
        logits = model.score(model.model(torch.tensor([PROMPT])).last_hidden_state)[0]  # [T, labels]
    torch.testing.assert_close(out.outputs.data, torch.softmax(logits, dim=-1), rtol=1e-4, atol=1e-5)


def test_reranker_scores_pairs_as_one_prompt(reranker):
    model, llm = reranker
    query, documents = "a cat", ["the cat sat", "stock prices", "a kitten"]
    outputs = llm.score(query, documents)
    tokenizer = llm.tokenizer
    for document, out in zip(documents, outputs):
        ids = tokenizer.encode(query) + tokenizer.encode(document, add_special_tokens=False)
        assert out.prompt_token_ids == ids
        expected = torch.sigmoid(transformers_logits(model, ids))[0].item()
        assert out.outputs.score == pytest.approx(expected, abs=1e-5)
    assert len({round(out.outputs.score, 6) for out in outputs}) == 3  # the head tells the pairs apart


def test_classifiers_refuse_what_they_cannot_do(classifier, reranker, tiny_checkpoints):
    _, three = classifier
    _, one = reranker
    with pytest.raises(ValueError, match=r"is a classifier \(a score head in place of the LM head\)"):
        three.generate([PROMPT], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="this classifier has 3 labels: use classify"):
        three.score("a", ["b"])
    assert len(one.classify([PROMPT])[0].outputs.probs) == 1
    plain = LLM(str(tiny_checkpoints["qwen3"]), max_model_len=64)
    with pytest.raises(ValueError, match="has no classification head"):
        plain.classify([PROMPT])


RERANK_TEMPLATE = "Q: {query} D: {document}!"


def write_reranker_gguf(path):
    """llama.cpp's Qwen3-Reranker layout on a tiny random Qwen3: pooling_type rank, cls.output the
    LM head's "yes" and "no" rows, a rerank template; returns (the causal LM, yes id, no id)."""
    import gguf

    from tests.models.test_gguf import byte_level_vocab, tiny_model, write_tiny_gguf

    vocab = byte_level_vocab(pre="qwen2")
    model = tiny_model("qwen3", vocab_size=len(vocab.tokens)).eval()
    yes, no = 40, 41
    head = model.get_output_embeddings().weight.detach().float()

    def rank_head(writer):
        writer.add_pooling_type(gguf.PoolingType.RANK)
        writer.add_classifier_output_labels(["yes", "no"])
        writer.add_tensor("cls.output.weight", torch.stack([head[yes], head[no]]).numpy())
        writer.add_chat_template([{"name": "rerank", "template": RERANK_TEMPLATE}])

    write_tiny_gguf(path, architecture="qwen3", model=model, vocab=vocab, qtypes={}, extra=rank_head)
    return model, yes, no


def p_yes(model, ids: list[int], *, yes: int, no: int) -> float:
    """The causal LM's softmax over its "no" and "yes" logits at the last token (the model card's score)."""
    with torch.no_grad():
        last = model(torch.tensor([ids])).logits[0, -1]
    return torch.softmax(last[[no, yes]], dim=0)[1].item()


def test_a_rank_pooling_gguf_is_llama_cpp_s_reranker(tmp_path, monkeypatch):
    """llama.cpp's Qwen3-Reranker files: pooling_type rank, cls.output = the LM head's "yes" and
    "no" rows. The score is the causal LM's softmax over those two logits (the model card's p(yes))."""
    monkeypatch.setenv("QUICKDRAFT_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "reranker.gguf"
    model, yes, no = write_reranker_gguf(path)
    llm = LLM(str(path), max_model_len=64)
    assert llm.engine.pooler.classifier.labels == ("yes",)
    for prompt in (PROMPT, PROMPT[:9]):
        [out] = llm.classify([prompt])
        assert out.outputs.probs[0] == pytest.approx(p_yes(model, prompt, yes=yes, no=no), abs=1e-5)
    with pytest.raises(ValueError, match="is a classifier"):
        llm.generate([PROMPT], SamplingParams(max_tokens=2))
    # pairs of texts read through the file's rerank template, as llama.cpp reads them
    query, documents = "a {document} cat", ["the cat sat", "stock prices"]
    for document, out in zip(documents, llm.score(query, documents)):
        ids = llm.tokenizer.encode(f"Q: {query} D: {document}!")
        assert out.prompt_token_ids == ids
        assert out.outputs.score == pytest.approx(p_yes(model, ids, yes=yes, no=no), abs=1e-5)
    as_ids = llm.score([{"prompt_token_ids": [5, 6]}], [{"prompt_token_ids": [7, 8]}])  # ids: concatenated
    assert as_ids[0].prompt_token_ids == [5, 6, 7, 8]
