"""/v1/embeddings through the official openai client: the vectors LLM.embed gives, as floats or
base64 (the client's default), for texts and token ids, beside requests that generate; bad input
is a 400 that names it."""

from __future__ import annotations

import base64
import concurrent.futures
import time

import httpx
import numpy as np
import pytest
import torch

from quickdraft import PoolingParams, SamplingParams
from tests.server.conftest import start_server, tiny_server_config

TEXTS = ["The cat sat on the mat", "Speculative decoding is lossless"]


@pytest.fixture(scope="module")
def server(tiny_checkpoints):
    running = start_server(tiny_server_config(tiny_checkpoints["gemma3"], served_model_name="embedder"))
    yield running
    running.stop()


def test_vectors_are_llm_embed_s_whole_or_base64(server, offline_llms):
    client = server.openai_client()
    expected = [out.outputs.embedding for out in offline_llms["gemma3"].embed(TEXTS)]
    as_floats = client.embeddings.create(model="embedder", input=TEXTS, encoding_format="float")
    assert [item.index for item in as_floats.data] == [0, 1]
    assert [item.embedding for item in as_floats.data] == expected
    as_base64 = client.embeddings.create(model="embedder", input=TEXTS, encoding_format="base64")
    decoded = [np.frombuffer(base64.b64decode(item.embedding), dtype="<f4").tolist() for item in as_base64.data]
    assert decoded == expected
    default = client.embeddings.create(model="embedder", input=TEXTS[0])  # base64 asked and decoded by the client
    assert list(map(float, default.data[0].embedding)) == expected[0]
    tokens = offline_llms["gemma3"].tokenizer.encode(TEXTS[1])
    by_ids = client.embeddings.create(model="embedder", input=[tokens], encoding_format="float")
    assert by_ids.data[0].embedding == expected[1] and by_ids.usage.prompt_tokens == len(tokens)
    one_prompt = client.embeddings.create(model="embedder", input=tokens, encoding_format="float")
    assert one_prompt.data[0].embedding == expected[1]


def test_vectors_beside_generating_requests(server, offline_llms):
    """Embeddings run between the steps of generating requests: neither changes the other."""
    llm = offline_llms["gemma3"]
    expected_vector = llm.embed(TEXTS[:1], PoolingParams())[0].outputs.embedding
    prompt = "Once upon a time"
    expected_text = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24))[0].outputs[0].text
    body = {"model": "embedder", "prompt": prompt, "max_tokens": 24, "temperature": 0}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        completions = [
            pool.submit(httpx.post, f"{server.api_url}/completions", json=body, timeout=60) for _ in range(2)
        ]
        vectors = [
            pool.submit(
                httpx.post,
                f"{server.api_url}/embeddings",
                json={"input": TEXTS[0], "encoding_format": "float"},
                timeout=60,
            )
            for _ in range(4)
        ]
        texts = [future.result().json()["choices"][0]["text"] for future in completions]
        embedded = [future.result().json()["data"][0]["embedding"] for future in vectors]
    assert texts == [expected_text] * 2 and embedded == [expected_vector] * 4


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"input": []}, "at least one input"),
        ({"input": ["a", ""]}, r"input\[1\] is empty"),
        ({"input": [[1, 2], [10**9]]}, r"input\[1\]: ids outside the vocabulary"),
        ({"input": "a", "dimensions": 7}, "cannot be shortened to 7"),
        ({"input": [[1] * 129]}, "129 tokens, but max_model_len is 128"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "a", "model": "other"}, "does not exist"),
    ],
)
def test_bad_input_names_the_problem(server, fields, message):
    import re

    response = httpx.post(f"{server.api_url}/embeddings", json=fields, timeout=30)
    assert response.status_code in (400, 404), response.text
    assert re.search(message, response.json()["error"]["message"]), response.json()


def test_truncation_and_pooling_setting(server, tiny_checkpoints, offline_llms):
    tokens = list(range(3, 43))
    body = {"input": [tokens], "encoding_format": "float", "truncate_prompt_tokens": 8, "normalize": False}
    reply = httpx.post(f"{server.api_url}/embeddings", json=body, timeout=30).json()
    expected = offline_llms["gemma3"].embed([tokens[-8:]], PoolingParams(normalize=False))[0].outputs.embedding
    assert reply["data"][0]["embedding"] == expected and reply["usage"]["prompt_tokens"] == 8
    with pytest.raises(ValueError, match="pooling_type must be one of"):
        tiny_server_config(tiny_checkpoints["gemma3"], pooling_type="MAX")


QUERY = "What do cats sit on?"
DOCUMENTS = ["The cat sat on the mat", "Speculative decoding is lossless", "A dog lay on the rug"]


def test_score_is_llm_score_s_cosine(server, offline_llms):
    llm = offline_llms["gemma3"]
    vectors = [torch.tensor(out.outputs.embedding) for out in llm.embed([QUERY, *DOCUMENTS])]
    cosines = [torch.nn.functional.cosine_similarity(vectors[0], v, dim=0).item() for v in vectors[1:]]
    offline = [out.outputs.score for out in llm.score(QUERY, DOCUMENTS)]
    assert offline == pytest.approx(cosines, abs=1e-6)
    for path in ("/score", "/v1/score"):
        reply = httpx.post(f"{server.base_url}{path}", json={"text_1": QUERY, "text_2": DOCUMENTS}, timeout=30).json()
        assert [item["index"] for item in reply["data"]] == [0, 1, 2] and reply["object"] == "list"
        assert [item["score"] for item in reply["data"]] == offline
        assert reply["usage"]["prompt_tokens"] == sum(len(llm.tokenizer.encode(t)) for t in [QUERY, *DOCUMENTS])
    pairwise = httpx.post(
        f"{server.base_url}/score", json={"text_1": DOCUMENTS[:2], "text_2": DOCUMENTS[1:]}, timeout=30
    )
    expected = [out.outputs.score for out in llm.score(DOCUMENTS[:2], DOCUMENTS[1:])]
    assert [item["score"] for item in pairwise.json()["data"]] == expected


def test_rerank_orders_documents_by_score(server, offline_llms):
    scores = [out.outputs.score for out in offline_llms["gemma3"].score(QUERY, DOCUMENTS)]
    order = sorted(range(3), key=lambda i: -scores[i])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        reply = httpx.post(f"{server.base_url}{path}", json={"query": QUERY, "documents": DOCUMENTS}, timeout=30).json()
        assert [r["index"] for r in reply["results"]] == order
        assert [r["relevance_score"] for r in reply["results"]] == [scores[i] for i in order]
        assert [r["document"]["text"] for r in reply["results"]] == [DOCUMENTS[i] for i in order]
    top = httpx.post(
        f"{server.base_url}/rerank",
        json={"query": QUERY, "documents": DOCUMENTS, "top_n": 2, "return_documents": False},
        timeout=30,
    ).json()
    assert [r["index"] for r in top["results"]] == order[:2] and "document" not in top["results"][0]


@pytest.mark.parametrize(
    ("path", "fields", "message"),
    [
        ("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "one text with N, or N with N: got 2 and 3"),
        ("/score", {"text_1": [], "text_2": "a"}, "text_1: at least one text"),
        ("/score", {"text_1": "a", "text_2": ["b", ""]}, r"text_2\[1\] is empty"),
        ("/rerank", {"query": "a", "documents": []}, "documents: at least one text"),
        ("/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n must be >= 0"),
        ("/rerank", {"documents": ["b"]}, "query"),
        ("/v1/score", {"text_1": "a", "text_2": "b", "model": "other"}, "does not exist"),
    ],
)
def test_bad_scoring_input_names_the_problem(server, path, fields, message):
    import re

    response = httpx.post(f"{server.base_url}{path}", json=fields, timeout=30)
    assert response.status_code in (400, 404), response.text
    assert re.search(message, response.json()["error"]["message"]), response.json()


def test_an_embedding_model_serves_embeddings_and_refuses_completions(tmp_path):
    """EmbeddingGemma's layout (tests/models/test_embedding_models.py): its modules' vectors over
    HTTP; a completion is a 400 naming why."""
    from quickdraft import LLM
    from tests.models.test_embedding_models import build_tiny_embedding_model

    path = build_tiny_embedding_model(tmp_path / "encoder")
    expected = LLM(str(path), max_model_len=128).embed(TEXTS)
    running = start_server(tiny_server_config(path, served_model_name="encoder"))
    try:
        reply = httpx.post(
            f"{running.api_url}/embeddings", json={"input": TEXTS, "encoding_format": "float"}, timeout=30
        )
        assert [item["embedding"] for item in reply.json()["data"]] == [out.outputs.embedding for out in expected]
        refused = httpx.post(f"{running.api_url}/completions", json={"prompt": "a", "max_tokens": 2}, timeout=30)
        assert refused.status_code == 400 and "does not generate text" in refused.json()["error"]["message"]
    finally:
        running.stop()


def test_classifiers_and_rerankers_over_http(tmp_path):
    """/classify on a 3-label classifier; /rerank and /score on a 1-label one (a cross-encoder:
    each pair one prompt), equal to LLM.classify / LLM.score; what a model cannot do is a 400."""
    from quickdraft import LLM
    from tests.models.test_classifiers import build_tiny_classifier

    build_tiny_classifier(tmp_path / "cls", num_labels=3)
    build_tiny_classifier(tmp_path / "rr", num_labels=1, seed=1)
    texts = ["great film", "dull plot"]
    expected = [out.outputs.probs for out in LLM(str(tmp_path / "cls"), max_model_len=128).classify(texts)]
    documents = ["the cat sat", "stock prices", "a kitten"]
    scores = [out.outputs.score for out in LLM(str(tmp_path / "rr"), max_model_len=128).score("a cat", documents)]
    running = start_server(tiny_server_config(tmp_path / "cls", served_model_name="cls"))
    try:
        reply = httpx.post(f"{running.base_url}/classify", json={"input": texts}, timeout=30).json()
        assert [item["probs"] for item in reply["data"]] == expected
        labels = ["negative", "neutral", "positive"]
        assert [item["label"] for item in reply["data"]] == [labels[max(range(3), key=p.__getitem__)] for p in expected]
        refused = httpx.post(f"{running.base_url}/score", json={"text_1": "a", "text_2": "b"}, timeout=30)
        assert refused.status_code == 400 and "3 labels: use /classify" in refused.json()["error"]["message"]
    finally:
        running.stop()
    running = start_server(tiny_server_config(tmp_path / "rr", served_model_name="rr"))
    try:
        body = {"query": "a cat", "documents": documents}
        reply = httpx.post(f"{running.base_url}/v1/rerank", json=body, timeout=30).json()
        order = sorted(range(3), key=lambda i: -scores[i])
        assert [r["index"] for r in reply["results"]] == order
        assert [r["relevance_score"] for r in reply["results"]] == [scores[i] for i in order]
        pairs = httpx.post(f"{running.base_url}/score", json={"text_1": "a cat", "text_2": documents}, timeout=30)
        assert [item["score"] for item in pairs.json()["data"]] == scores
    finally:
        running.stop()


def test_a_reranker_gguf_reads_pairs_through_its_template_over_http(tmp_path, monkeypatch):
    """/rerank on llama.cpp's reranker layout: each pair through the file's rerank template, the
    causal LM's p(yes), as LLM.score gives it."""
    from tests.models.test_classifiers import RERANK_TEMPLATE, p_yes, write_reranker_gguf

    monkeypatch.setenv("QUICKDRAFT_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "reranker.gguf"
    model, yes, no = write_reranker_gguf(path)
    documents = ["the cat sat", "stock prices", "a kitten"]
    running = start_server(tiny_server_config(path, served_model_name="rr"))
    try:
        tokenizer = running.server.tokenizer
        expected = [
            p_yes(model, tokenizer.encode(RERANK_TEMPLATE.format(query="a cat", document=d)), yes=yes, no=no)
            for d in documents
        ]
        body = {"query": "a cat", "documents": documents}
        reply = httpx.post(f"{running.base_url}/v1/rerank", json=body, timeout=30).json()
        assert sorted(r["index"] for r in reply["results"]) == [0, 1, 2]
        for result in reply["results"]:
            assert result["relevance_score"] == pytest.approx(expected[result["index"]], abs=1e-5)
    finally:
        running.stop()


def test_pooling_returns_llm_encode_s_results(server, offline_llms):
    """vLLM's /pooling: each input's result of the task asked for (the model's own when none),
    as LLM.encode gives it, nested floats or base64 row after row; a task the model cannot run
    is a 400 naming it."""
    llm = offline_llms["gemma3"]
    tokens = llm.encode(TEXTS, pooling_task="token_embed")
    body = {"model": "embedder", "input": TEXTS, "task": "token_embed"}
    reply = httpx.post(f"{server.base_url}/pooling", json=body, timeout=30).json()
    assert [item["object"] for item in reply["data"]] == ["pooling", "pooling"]
    assert [item["data"] for item in reply["data"]] == [out.outputs.data.tolist() for out in tokens]
    assert reply["usage"]["prompt_tokens"] == sum(len(out.prompt_token_ids) for out in tokens)
    packed = httpx.post(f"{server.base_url}/v1/pooling", json={**body, "encoding_format": "base64"}, timeout=30)
    rows = np.frombuffer(base64.b64decode(packed.json()["data"][1]["data"]), dtype="<f4").reshape(-1, 64)
    assert rows.tolist() == tokens[1].outputs.data.tolist()
    default = httpx.post(f"{server.base_url}/pooling", json={"input": TEXTS[0]}, timeout=30).json()
    assert default["data"][0]["data"] == llm.embed(TEXTS[:1])[0].outputs.embedding
    refused = httpx.post(f"{server.base_url}/pooling", json={"input": "x", "task": "classify"}, timeout=30)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "task"
    assert "task 'classify' needs a classification head" in refused.json()["error"]["message"]


def test_classify_needs_a_classifier(server):
    response = httpx.post(f"{server.base_url}/classify", json={"input": "x"}, timeout=30)
    assert response.status_code == 400 and "no classification head" in response.json()["error"]["message"]


def test_an_embedding_waits_for_the_slot_generation_holds(tiny_checkpoints, offline_llms):
    """With every cache slot generating, an embedding (or a score) waits for one, as a generation
    request waits in the queue, instead of failing with 503 (run-batch mixes them)."""
    running = start_server(tiny_server_config(tiny_checkpoints["gemma3"], max_num_seqs=1))
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            body = {"prompt": "Once upon a time", "max_tokens": 60, "ignore_eos": True, "temperature": 0}
            completion = pool.submit(httpx.post, f"{running.api_url}/completions", json=body, timeout=120)
            deadline = time.monotonic() + 60
            while httpx.get(f"{running.base_url}/health", timeout=30).json()["engine"]["free_slots"] != 0:
                assert time.monotonic() < deadline and not completion.done()
                time.sleep(0.01)
            vector = pool.submit(
                httpx.post, f"{running.api_url}/embeddings", json={"input": TEXTS[0], "encoding_format": "float"}
            )
            reply = vector.result(timeout=120)
            assert reply.status_code == 200, reply.text
            assert reply.json()["data"][0]["embedding"] == offline_llms["gemma3"].embed(TEXTS[:1])[0].outputs.embedding
            assert completion.result(timeout=120).status_code == 200
    finally:
        running.stop()
