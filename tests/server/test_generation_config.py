"""The model's generation config fills the sampling fields a request leaves out (vLLM's
--generation-config auto); fields the request gives win."""

from __future__ import annotations

import json

import httpx
import pytest

from quickdraft import SamplingParams
from tests.server.conftest import start_server, tiny_server_config

TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"


@pytest.fixture(scope="module")
def server(tiny_checkpoints, tmp_path_factory):
    directory = tmp_path_factory.mktemp("generation-config")
    (directory / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 5}))
    config = tiny_server_config(
        tiny_checkpoints["gemma3"],
        served_model_name="defaults",
        chat_template=TEMPLATE,
        generation_config=str(directory),
        override_generation_config={"top_k": 3},
    )
    running = start_server(config)
    yield running
    running.stop()


def post(server, path, body):
    response = httpx.post(f"{server.api_url}{path}", json={"model": server.model_name} | body, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def test_fields_left_out_take_the_generation_config(server, offline_llms):
    greedy = offline_llms["gemma3"].generate(["Once upon"], SamplingParams(temperature=0.0, max_tokens=5))[0]
    chat = post(server, "/chat/completions", {"messages": [{"role": "user", "content": "Once upon"}]})
    assert chat["usage"]["completion_tokens"] <= 5  # max_new_tokens: chat's max_tokens when none is sent
    completion = post(server, "/completions", {"prompt": "Once upon", "max_tokens": 5, "return_token_ids": True})
    assert completion["choices"][0]["token_ids"] == greedy.outputs[0].token_ids  # temperature 0 from the file
    again = post(server, "/completions", {"prompt": "Once upon", "max_tokens": 5, "return_token_ids": True})
    assert again["choices"][0]["token_ids"] == greedy.outputs[0].token_ids


def test_fields_the_request_gives_win(server, offline_llms):
    params = SamplingParams(temperature=1.0, top_k=3, seed=4, max_tokens=8)  # top_k from the override
    sampled = offline_llms["gemma3"].generate(["Once upon"], params)[0]
    body = {"prompt": "Once upon", "max_tokens": 8, "temperature": 1.0, "seed": 4, "return_token_ids": True}
    assert post(server, "/completions", body)["choices"][0]["token_ids"] == sampled.outputs[0].token_ids


def test_a_bad_generation_config_stops_the_server_at_start(tiny_checkpoints):
    with pytest.raises(ValueError, match="is not a directory"):
        tiny_server_config(tiny_checkpoints["gemma3"], generation_config="/no/such/dir")
