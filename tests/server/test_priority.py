"""vLLM's `priority` request field on a server started with --scheduling-policy priority."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.server.conftest import start_server, tiny_server_config


@pytest.fixture(scope="module")
def server(tiny_checkpoints):
    config = tiny_server_config(
        tiny_checkpoints["gemma3"], served_model_name="ordered", scheduling_policy="priority", max_num_seqs=1
    )
    running = start_server(config)
    yield running
    running.stop()


def complete(server, priority: int) -> dict:
    body = {"model": server.model_name, "prompt": "Once upon", "max_tokens": 6, "temperature": 0, "priority": priority}
    response = httpx.post(f"{server.api_url}/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_requests_of_every_priority_are_served_and_exact(server):
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda rank: complete(server, rank), [3, -2, 0, 3]))
    assert len({reply["choices"][0]["text"] for reply in replies}) == 1  # greedy: one answer whatever the order


def test_a_non_integer_priority_is_a_400(server):
    body = {"model": server.model_name, "prompt": "x", "max_tokens": 2, "priority": "high"}
    response = httpx.post(f"{server.api_url}/completions", json=body, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "priority"
