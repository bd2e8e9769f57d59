"""quickdraft run-batch: the OpenAI Batch file format through the API, offline (vLLM's run-batch).

One batch file mixes chat and completion requests, a request the API refuses, and lines that
cannot be sent; the results come back one a line in the input's order, the generated ones equal
to offline plain decoding (the batch runs with suffix speculation), the bad lines named.
"""

from __future__ import annotations

import json

import pytest

from quickdraft import SamplingParams
from quickdraft.cli import main
from quickdraft.server.batch import parse_batch


def _line(custom_id, url, body, method="POST") -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


PROMPTS = ["The tide came in", "Seven small boats", "Under the old bridge", "Lanterns in the rain"]


@pytest.fixture(scope="module")
def batch_run(tiny_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("batch")
    chat = [{"role": "user", "content": "Name a river"}]
    lines = [
        *(
            _line(f"c{i}", "/v1/completions", {"model": "tiny", "prompt": p, "max_tokens": 12, "temperature": 0})
            for i, p in enumerate(PROMPTS)
        ),
        _line("chat", "/v1/chat/completions", {"model": "tiny", "messages": chat, "max_tokens": 10, "temperature": 0}),
        _line("bad-field", "/v1/completions", {"model": "tiny", "prompt": "x", "temperature": -1}),
        "{not json",
        _line("c0", "/v1/completions", {"prompt": "a repeated custom_id"}),
        _line("get", "/v1/completions", {"prompt": "x"}, method="GET"),
        _line("speech", "/v1/audio/speech", {"input": "x"}),
        _line("stream", "/v1/completions", {"prompt": "x", "stream": True}),
        _line("embed", "/v1/embeddings", {"input": PROMPTS[:2], "encoding_format": "float"}),
        _line("score", "/v1/score", {"text_1": PROMPTS[0], "text_2": PROMPTS[1:3]}),
        _line("rerank", "/v1/rerank", {"query": PROMPTS[0], "documents": PROMPTS[1:], "top_n": 2}),
        "",  # blank lines are skipped
    ]
    source = root / "in.jsonl"
    source.write_text("\n".join(lines) + "\n")
    out = root / "out.jsonl"
    args = ["run-batch", "-i", str(source), "-o", str(out), str(tiny_checkpoints["qwen3"])]
    args += ["--served-model-name", "tiny", "--max-model-len", "256", "--max-num-seqs", "4"]
    args += ["--speculative-config", json.dumps({"method": "suffix"}), "--log-level", "warning"]
    assert main(args) == 0
    return [json.loads(text) for text in out.read_text().splitlines()]


def test_results_in_input_order_equal_offline_decoding(batch_run, offline_llms):
    assert [r["custom_id"] for r in batch_run] == [
        "c0",
        "c1",
        "c2",
        "c3",
        "chat",
        "bad-field",
        None,
        "c0",
        "get",
        "speech",
        "stream",
        "embed",
        "score",
        "rerank",
    ]
    assert len({r["id"] for r in batch_run}) == len(batch_run) and all(
        r["id"].startswith("batch_req_") for r in batch_run
    )
    llm = offline_llms["qwen3"]
    expected = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0))
    for result, reference in zip(batch_run[:4], expected):
        assert result["error"] is None and result["response"]["status_code"] == 200
        body = result["response"]["body"]
        assert body["object"] == "text_completion" and body["model"] == "tiny"
        assert result["response"]["request_id"] == body["id"]
        assert body["choices"][0]["text"] == reference.outputs[0].text
    chat = batch_run[4]["response"]
    assert chat["status_code"] == 200 and chat["body"]["object"] == "chat.completion"
    reference = llm.chat([{"role": "user", "content": "Name a river"}], SamplingParams(max_tokens=10, temperature=0))
    assert chat["body"]["choices"][0]["message"]["content"] == reference[0].outputs[0].text


def test_a_refused_request_is_a_response_and_bad_lines_are_named(batch_run):
    refused = batch_run[5]
    assert refused["error"] is None and refused["response"]["status_code"] == 400
    assert "temperature" in refused["response"]["body"]["error"]["message"]
    messages = {r["custom_id"]: r["error"]["message"] for r in batch_run[6:11]}
    assert all(r["response"] is None and r["error"]["code"] == "invalid_batch_line" for r in batch_run[6:11])
    assert messages[None].startswith("line 7: not JSON")
    assert messages["c0"] == "line 8: custom_id 'c0' is already used by line 1"
    assert "method must be POST" in messages["get"]
    assert "url must be one of /v1/chat/completions" in messages["speech"]
    assert "stream is not supported" in messages["stream"]


def test_embeddings_scores_and_reranking_in_a_batch(batch_run, offline_llms):
    """vLLM's run-batch endpoints beside generation: /v1/embeddings, /v1/score, /v1/rerank."""
    llm = offline_llms["qwen3"]
    embed, score, rerank = (result["response"] for result in batch_run[11:14])
    assert [r["status_code"] for r in (embed, score, rerank)] == [200] * 3, [r["body"] for r in (embed, score, rerank)]
    assert [item["embedding"] for item in embed["body"]["data"]] == [
        o.outputs.embedding for o in llm.embed(PROMPTS[:2])
    ]
    scores = [o.outputs.score for o in llm.score(PROMPTS[0], PROMPTS[1:])]
    assert [item["score"] for item in score["body"]["data"]] == scores[:2]
    best = sorted(range(3), key=lambda i: -scores[i])[:2]
    assert [item["index"] for item in rerank["body"]["results"]] == best


def test_parse_batch_checks_each_line():
    lines = parse_batch('[1, 2]\n{"custom_id": "", "url": "/v1/completions"}\n\n' + _line("a", "/v1/completions", []))
    assert [line.number for line in lines] == [1, 2, 4]
    assert lines[0].error == "line 1: a JSON list, not an object"
    assert "custom_id must be a non-empty string" in lines[1].error
    assert lines[2].error == "line 4: body must be a JSON object, got list"


def test_missing_input_or_output_directory_is_a_clear_error(tiny_checkpoints, tmp_path, capsys):
    model = str(tiny_checkpoints["qwen3"])
    assert main(["run-batch", "-i", str(tmp_path / "nope.jsonl"), "-o", str(tmp_path / "o.jsonl"), model]) == 2
    assert "nope.jsonl" in capsys.readouterr().err
    source = tmp_path / "in.jsonl"
    source.write_text(_line("a", "/v1/completions", {"prompt": "x"}) + "\n")
    assert main(["run-batch", "-i", str(source), "-o", str(tmp_path / "missing" / "o.jsonl"), model]) == 2
    assert "directory does not exist" in capsys.readouterr().err
