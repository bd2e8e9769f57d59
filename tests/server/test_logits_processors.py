"""The `logits_processors` request field (vLLM's server form): processors by qualified name that
--logits-processor-pattern allows, exact under speculation; a failing one fails its request alone."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from quickdraft import SamplingParams
from tests.server.conftest import start_server, tiny_server_config

PATTERN = r"tests\.server\.test_logits_processors\.[a-z_]+"
HERE = "tests.server.test_logits_processors"


def boost_prompt_factory(*, boost: float):
    """A factory (qualname + kwargs in the request): the prompt's token at the output's position gains."""

    def processor(prompt, output, logits):
        logits[prompt[len(output) % len(prompt)]] += boost
        return logits

    return processor


def every_third(output, logits):
    if len(output) % 3 == 2:
        logits[int(logits.argmax())] -= 6.0
    return logits


def fails_at_four(output, logits):
    if len(output) == 4:
        raise RuntimeError("cannot go on")
    return logits


def broken_factory():
    raise TypeError("bad settings")


@pytest.fixture(scope="module")
def server(tiny_checkpoints):
    config = tiny_server_config(
        tiny_checkpoints["gemma3"],
        served_model_name="processed",
        speculative_config={"method": "suffix"},
        logits_processor_pattern=PATTERN,
    )
    running = start_server(config)
    yield running
    running.stop()


def body(server, **fields) -> dict:
    return {"model": server.model_name, "prompt": "abcabcabcab", "max_tokens": 16, "temperature": 0, **fields}


def post(server, payload: dict) -> httpx.Response:
    return httpx.post(f"{server.api_url}/completions", json=payload, timeout=60)


PROCESSORS = [{"qualname": f"{HERE}.boost_prompt_factory", "kwargs": {"boost": 5.0}}, f"{HERE}.every_third"]


def test_processors_by_name_give_plain_decoding_s_output_under_speculation(server, offline_llms):
    response = post(server, body(server, logits_processors=PROCESSORS, return_token_ids=True))
    assert response.status_code == 200, response.text
    tokens = response.json()["choices"][0]["token_ids"]
    processors = [boost_prompt_factory(boost=5.0), every_third]
    llm = offline_llms["gemma3"]
    expected = (
        llm.generate(["abcabcabcab"], SamplingParams(max_tokens=16, temperature=0.0, logits_processors=processors))[0]
        .outputs[0]
        .token_ids
    )
    unprocessed = llm.generate(["abcabcabcab"], SamplingParams(max_tokens=16, temperature=0.0))[0].outputs[0].token_ids
    assert tokens == expected != unprocessed
    spec = response.json()["usage"].get("speculative") or {}
    assert server.inspect_engine(lambda engine: engine.metrics.num_draft_tokens) > 0, spec


@pytest.mark.parametrize(
    ("processors", "message"),
    [
        (["os.system"], "not allowed by this server's --logits-processor-pattern"),
        ([f"{HERE}.missing_name"], "was not found"),
        ([{"qualname": f"{HERE}.broken_factory"}], "building it raised TypeError: bad settings"),
        ([f"{HERE}.boost_prompt_factory"], "must take (output_token_ids, logits)"),
    ],
)
def test_names_the_server_cannot_use_are_a_400(server, processors, message):
    response = post(server, body(server, logits_processors=processors))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "logits_processors" and message in error["message"]


def test_a_server_without_a_pattern_refuses_the_field(plain_server):
    response = post(plain_server, body(plain_server, logits_processors=[f"{HERE}.every_third"]))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "logits_processors" and "--logits-processor-pattern" in error["message"]


def test_a_failing_processor_fails_its_request_and_no_other(server):
    failing = body(server, logits_processors=[f"{HERE}.fails_at_four"])
    with ThreadPoolExecutor(3) as pool:
        replies = list(pool.map(lambda payload: post(server, payload), [body(server), failing, body(server)]))
    assert [r.status_code for r in replies] == [200, 400, 200]
    error = replies[1].json()["error"]
    assert error["code"] == "logits_processor_error" and error["param"] == "logits_processors"
    assert "fails_at_four) raised RuntimeError: cannot go on" in error["message"]
    assert replies[0].json()["choices"][0]["text"] == replies[2].json()["choices"][0]["text"]


def test_a_failing_processor_ends_a_stream_with_an_error_event(server):
    payload = body(server, logits_processors=[f"{HERE}.fails_at_four"], stream=True)
    with httpx.stream("POST", f"{server.api_url}/completions", json=payload, timeout=60) as response:
        events = [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]
    errors = [json.loads(event)["error"] for event in events if event != "[DONE]" and "error" in json.loads(event)]
    assert errors and "cannot go on" in errors[0]["message"]
