"""A server started with a reasoning parser: the thinking as message.reasoning (whole and
streamed), constrained replies left whole, and thinking sent back in the history."""

from __future__ import annotations

import json

import httpx
import pytest

from quickdraft import SamplingParams
from tests.server.conftest import start_server, tiny_server_config

TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% if m.reasoning_content %}[{{ m.reasoning_content }}]{% endif %}{% endfor %}<assistant>"
)
MESSAGES = [{"role": "user", "content": "Once upon"}]


@pytest.fixture(scope="module")
def server(tiny_checkpoints):
    config = tiny_server_config(
        tiny_checkpoints["gemma3"], served_model_name="thinker", chat_template=TEMPLATE, reasoning_parser="deepseek_r1"
    )
    running = start_server(config)
    yield running
    running.stop()


def chat(server, **fields) -> httpx.Response:
    body = {"model": server.model_name, "messages": MESSAGES, "max_tokens": 12, "temperature": 0} | fields
    return httpx.post(f"{server.api_url}/chat/completions", json=body, timeout=30)


def test_a_reply_inside_the_prompt_s_think_block_is_reasoning(server, offline_llms):
    prompt = httpx.post(f"{server.base_url}/tokenize", json={"messages": MESSAGES}, timeout=30).json()["tokens"]
    text = offline_llms["gemma3"].generate([prompt], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].text
    assert "</think>" not in text and text  # the tiny model never closes the block
    message = chat(server).json()["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == (text, None)
    lines = [line for line in chat(server, stream=True).text.splitlines() if line.startswith("data: {")]
    deltas = [json.loads(line[6:])["choices"] for line in lines]
    deltas = [choices[0]["delta"] for choices in deltas if choices]
    assert "".join(delta.get("reasoning", "") for delta in deltas) == text
    assert not "".join(delta.get("content") or "" for delta in deltas)


def test_a_constrained_reply_thinks_first(server):
    """The constraint holds after the think block: R1's prompt opened it, and the tiny model never
    closes it, so the reply is all (free) thinking; the same request without the parser's
    wrapping would have to start with "{"."""
    choice = chat(server, response_format={"type": "json_object"}, max_tokens=20).json()["choices"][0]
    assert choice["message"]["reasoning"] and choice["message"]["content"] is None
    assert choice["finish_reason"] == "length" and not choice["message"]["reasoning"].startswith("{")


def test_thinking_sent_back_reaches_the_template(server):
    history = MESSAGES + [
        {"role": "assistant", "content": "a", "reasoning": "r1"},
        {"role": "user", "content": "b"},
        {"role": "assistant", "content": "c", "reasoning_content": "r2"},
        {"role": "user", "content": "d"},
    ]
    tokens = httpx.post(f"{server.base_url}/tokenize", json={"messages": history}, timeout=30).json()["tokens"]
    text = httpx.post(f"{server.base_url}/detokenize", json={"tokens": tokens}, timeout=30).json()["prompt"]
    assert "<assistant>a[r1]<user>b<assistant>c[r2]<user>d<assistant>" in text
    assert chat(server, messages=history).status_code == 200


def test_an_unknown_reasoning_parser_is_refused(tiny_checkpoints):
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        tiny_server_config(tiny_checkpoints["gemma3"], reasoning_parser="o1")


def test_gpt_oss_parsers_go_together(tiny_checkpoints):
    for fields in ({"reasoning_parser": "openai_gptoss"}, {"tool_call_parser": "openai"}):
        with pytest.raises(ValueError, match="'openai' and reasoning_parser 'openai_gptoss' go together"):
            tiny_server_config(tiny_checkpoints["gemma3"], **fields)


def test_a_harmony_reply_is_decoded_with_its_markers_and_stops_at_calls(tiny_checkpoints):
    """The openai_gptoss parser reads special tokens: the reply keeps them (a model that does not
    speak harmony gets its whole text as content), ends at <|call|> where the vocabulary has it,
    and a constraint behind its reasoning is a 400 that says why."""
    from types import SimpleNamespace

    from quickdraft.server.api import _decoded_for_reasoning

    config = tiny_server_config(
        tiny_checkpoints["gemma3"],
        served_model_name="gpt-oss",
        chat_template=TEMPLATE,
        reasoning_parser="openai_gptoss",
        tool_call_parser="openai",
    )
    running = start_server(config)
    try:
        body = {"model": "gpt-oss", "messages": MESSAGES, "max_tokens": 8, "temperature": 0}
        reply = httpx.post(f"{running.api_url}/chat/completions", json=body, timeout=30).json()
        message = reply["choices"][0]["message"]
        assert message["content"] and message["reasoning"] is None  # not harmony: all content
        refused = httpx.post(
            f"{running.api_url}/chat/completions", json=body | {"response_format": {"type": "json_object"}}, timeout=30
        )
        assert refused.status_code == 400 and "harmony" in refused.json()["error"]["message"]
    finally:
        running.stop()
    vocabulary = {"<|call|>": 7, "<|return|>": 9}
    server = SimpleNamespace(
        config=SimpleNamespace(reasoning_parser="openai_gptoss"),
        tokenizer=SimpleNamespace(token_to_id=vocabulary.get),
    )
    params = _decoded_for_reasoning(server, SamplingParams(max_tokens=4, stop_token_ids=[3, 9]))
    assert params.skip_special_tokens is False and params.stop_token_ids == [3, 7, 9]
    server.config.reasoning_parser = "qwen3"
    assert _decoded_for_reasoning(server, SamplingParams(max_tokens=4)).skip_special_tokens is True
