"""Several served model names (vLLM's --served-model-name a b): a request may send any of them,
responses and metrics carry the first, /v1/models lists them all."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import start_server, tiny_server_config


@pytest.fixture(scope="module")
def server(tiny_checkpoints):
    running = start_server(
        tiny_server_config(tiny_checkpoints["gemma3"], served_model_name=["tiny-main", "tiny-alias"])
    )
    yield running
    running.stop()


def test_any_served_name_is_taken_and_the_first_is_answered(server):
    for name in ("tiny-main", "tiny-alias"):
        body = {"model": name, "prompt": "ab", "max_tokens": 2}
        reply = httpx.post(f"{server.api_url}/completions", json=body, timeout=30)
        assert reply.status_code == 200 and reply.json()["model"] == "tiny-main"
    reply = httpx.post(f"{server.api_url}/completions", json={"model": "other", "prompt": "ab"}, timeout=30)
    assert reply.status_code == 404 and "'tiny-main' or 'tiny-alias'" in reply.json()["error"]["message"]


def test_models_lists_every_name(server):
    listed = httpx.get(f"{server.api_url}/models", timeout=30).json()["data"]
    assert [model["id"] for model in listed] == ["tiny-main", "tiny-alias"]
    assert httpx.get(f"{server.api_url}/models/tiny-alias", timeout=30).json()["id"] == "tiny-alias"
    assert httpx.get(f"{server.api_url}/models/other", timeout=30).status_code == 404
