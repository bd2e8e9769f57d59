"""SageMaker's routes, as vLLM serves them: /ping is /health, and /invocations answers every kind
of request on one path, picked by the body's fields, exactly as the route it picks would."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from quickdraft.server.api import invocation_path
from quickdraft.server.errors import APIError
from tests.server.conftest import start_server, tiny_server_config


@pytest.fixture(scope="module")
def server(tiny_checkpoints):
    running = start_server(tiny_server_config(tiny_checkpoints["qwen3"], served_model_name="tiny"))
    yield running
    running.stop()


@pytest.mark.parametrize(
    ("body", "classifier", "path"),
    [
        ({"messages": [], "prompt": "x"}, False, "/v1/chat/completions"),  # messages first
        ({"prompt": "x", "input": "y"}, False, "/v1/completions"),
        ({"query": "q", "documents": ["d"]}, False, "/v1/rerank"),
        ({"text_1": "a", "text_2": "b"}, False, "/v1/score"),
        ({"input": "a"}, False, "/v1/embeddings"),
        ({"input": "a"}, True, "/v1/classify"),
        ({"prompt": "x"}, True, "/v1/completions"),  # the head changes only what "input" means
    ],
)
def test_the_body_s_first_known_field_picks_the_route(body, classifier, path):
    assert invocation_path(body, classifier=classifier) == path


@pytest.mark.parametrize(
    ("body", "message"),
    [({"model": "tiny", "max_tokens": 3}, "none of the fields"), ([{"prompt": "x"}], "JSON object, got list")],
)
def test_a_body_that_picks_no_route_is_refused_by_name(body, message):
    with pytest.raises(APIError, match=message) as caught:
        invocation_path(body, classifier=False)
    assert caught.value.status == 400


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=60)


def without_ids(reply: dict) -> dict:
    """The answer less what differs between two requests: ids, times, the seed drawn for the
    request, and the prefix cache's hits (the second request finds the first's blocks)."""
    kept = {key: value for key, value in reply.items() if key not in ("id", "created", "seed")}
    if "usage" in kept:
        kept["usage"] = {key: value for key, value in kept["usage"].items() if key != "prompt_tokens_details"}
    return kept


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0}),
        ("/v1/embeddings", {"input": ["a cat", "a dog"], "encoding_format": "float"}),
        ("/v1/score", {"text_1": "a cat", "text_2": ["a dog", "a mat"]}),
    ],
)
def test_invocations_answer_as_the_route_they_pick(server, path, body):
    direct, invoked = post(server, path, body), post(server, "/invocations", body)
    assert direct.status_code == invoked.status_code == 200, invoked.text
    assert without_ids(invoked.json()) == without_ids(direct.json())


def test_invocations_rerank_and_stream(server):
    body = {"query": "a cat", "documents": ["a dog", "a kitten", "stocks"]}
    assert post(server, "/invocations", body).json()["results"] == post(server, "/rerank", body).json()["results"]
    generate = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
    expected = post(server, "/v1/completions", generate).json()["choices"][0]["text"]
    with httpx.stream("POST", f"{server.base_url}/invocations", json=generate | {"stream": True}, timeout=60) as reply:
        assert reply.headers["content-type"].startswith("text/event-stream")
        lines = [line[len("data: ") :] for line in reply.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    assert "".join(json.loads(line)["choices"][0]["text"] for line in lines[:-1]) == expected


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"prompt": "x", "max_tokens": -1}, "max_tokens"),  # the completions route's own error
        ({"text_1": "a", "text_2": []}, "text_2: at least one text"),
        ({"model": "tiny"}, r"none of the fields that pick a route: messages \(/v1/chat/completions\)"),
    ],
)
def test_bad_invocations_name_the_problem(server, body, message):
    reply = post(server, "/invocations", body)
    assert reply.status_code == 400 and re.search(message, reply.json()["error"]["message"]), reply.text


def test_invocations_refuse_a_body_that_is_not_json(server):
    reply = httpx.post(
        f"{server.base_url}/invocations", content=b"{", headers={"content-type": "application/json"}, timeout=30
    )
    assert reply.status_code == 400 and "malformed JSON" in reply.json()["error"]["message"]


def test_ping_is_health(server):
    health = httpx.get(f"{server.base_url}/health", timeout=10)
    for method in ("GET", "POST"):
        ping = httpx.request(method, f"{server.base_url}/ping", timeout=10)
        assert ping.status_code == 200 and ping.json()["status"] == health.json()["status"] == "ok"
