"""Function calling through the server, with the official openai client: named and required
tool choice (constrained replies that become calls), auto tool choice read by the hermes
parser, streamed calls that join into the whole reply, and tool turns sent back."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.conftest import start_server, tiny_server_config

WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 6}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {"name": "clock", "parameters": {"type": "object", "additionalProperties": False}},
}
TOOLS = [WEATHER, CLOCK]
NAMED = {"type": "function", "function": {"name": "weather"}}
ASK = [{"role": "user", "content": "Weather in Oslo?"}]
# A hermes call the tiny random model is made to write (auto mode reads it out of free text).
HERMES_REGEX = r'Sure\.<tool_call>\{"name": "weather", "arguments": \{"city": "[a-z]{1,6}"\}\}</tool_call>'


@pytest.fixture(scope="module")
def tool_server(tiny_checkpoints):
    """qwen3 (a chat template that does not read tools: they go in as a system preamble), suffix
    speculation, the hermes parser for tool_choice auto."""
    config = tiny_server_config(
        tiny_checkpoints["qwen3"],
        served_model_name="tiny-tools",
        speculative_config={"method": "suffix"},
        tool_call_parser="hermes",
        max_model_len=512,
    )
    running = start_server(config)
    yield running
    running.stop()


def create(server, **kwargs):
    client = server.openai_client()
    # no max_tokens: until the end of the context (the tools' preamble leaves the tiny model little)
    options = dict(model=server.model_name, messages=ASK, tools=TOOLS, temperature=0)
    return client.chat.completions.create(**(options | kwargs))


def streamed_message(server, **kwargs) -> tuple[str | None, list[tuple[str, str]], str]:
    """Content, calls (name, arguments) and finish reason, joined from the chunks as a client does."""
    content, calls, finish_reason = "", {}, None
    for chunk in create(server, stream=True, **kwargs):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for piece in choice.delta.tool_calls or []:
            if piece.id is not None:
                assert piece.id.startswith("call_") and piece.type == "function"
                calls[piece.index] = [piece.function.name, piece.function.arguments or ""]
            else:
                calls[piece.index][1] += piece.function.arguments or ""
        finish_reason = choice.finish_reason or finish_reason
    return content or None, [tuple(calls[index]) for index in sorted(calls)], finish_reason


def whole_message(server, **kwargs) -> tuple[str | None, list[tuple[str, str]], str]:
    choice = create(server, **kwargs).choices[0]
    calls = [(call.function.name, call.function.arguments) for call in choice.message.tool_calls or []]
    assert all(call.id.startswith("call_") and call.type == "function" for call in choice.message.tool_calls or [])
    return choice.message.content, calls, choice.finish_reason


def test_named_tool_choice_is_one_call_of_that_function(tool_server):
    content, calls, finish_reason = whole_message(tool_server, tool_choice=NAMED)
    assert content is None and finish_reason == "stop" and len(calls) == 1  # OpenAI: "stop" for a named call
    name, arguments = calls[0]
    assert name == "weather" and set(json.loads(arguments)) == {"city"}
    assert streamed_message(tool_server, tool_choice=NAMED) == (content, calls, finish_reason)


def test_required_tool_choice_makes_calls_of_the_tools(tool_server):
    content, calls, finish_reason = whole_message(tool_server, tool_choice="required", parallel_tool_calls=False)
    assert content is None and finish_reason == "tool_calls" and len(calls) == 1
    name, arguments = calls[0]
    assert (name, set(json.loads(arguments))) in (("weather", {"city"}), ("clock", set()))
    streamed = streamed_message(tool_server, tool_choice="required", parallel_tool_calls=False)
    assert streamed == (content, calls, finish_reason)


def test_auto_tool_choice_reads_hermes_calls_out_of_the_reply(tool_server):
    # One tool: the preamble of two (in bytes: tokens of the tiny tokenizer) nearly fills the context.
    extra = {"tools": [WEATHER], "extra_body": {"structured_outputs": {"regex": HERMES_REGEX}}}
    content, calls, finish_reason = whole_message(tool_server, **extra)
    assert content == "Sure." and finish_reason == "tool_calls"
    assert [name for name, _ in calls] == ["weather"] and set(json.loads(calls[0][1])) == {"city"}
    assert streamed_message(tool_server, **extra) == (content, calls, finish_reason)


def test_auto_with_the_server_s_call_grammar_answers(tool_server):
    """No constraint of the request's own: the server's grammar holds any call to the tools (the
    tiny random model writes none) and leaves the text free; streamed as whole."""
    content, calls, finish_reason = whole_message(tool_server, tools=[WEATHER], max_tokens=24)
    assert content and calls == [] and finish_reason in ("stop", "length")
    assert streamed_message(tool_server, tools=[WEATHER], max_tokens=24) == (content, calls, finish_reason)


def test_auto_without_a_call_and_none_are_plain_replies(tool_server):
    extra = {"tools": [WEATHER], "extra_body": {"structured_outputs": {"regex": "No call needed"}}}
    assert whole_message(tool_server, **extra) == ("No call needed", [], "stop")
    assert whole_message(tool_server, tool_choice="none", **extra) == ("No call needed", [], "stop")


def test_tool_turns_sent_back_are_rendered(tool_server):
    conversation = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    reply = create(tool_server, messages=conversation, tool_choice="none", max_tokens=4)
    assert reply.choices[0].finish_reason in ("stop", "length")
    tokenized = httpx.post(
        f"{tool_server.base_url}/tokenize", json={"messages": conversation, "tools": TOOLS}, timeout=30
    ).json()
    text = httpx.post(f"{tool_server.base_url}/detokenize", json={"tokens": tokenized["tokens"]}, timeout=30).json()
    rendered = text["prompt"]
    assert rendered.startswith("<|system|>You can call these functions") and '"name": "clock"' in rendered
    assert '<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>' in rendered
    assert "<|tool|>sunny" in rendered


def test_auto_tool_choice_needs_a_parser(ngram_server):
    response = httpx.post(
        f"{ngram_server.api_url}/chat/completions",
        json={"model": ngram_server.model_name, "messages": ASK, "tools": TOOLS, "max_tokens": 4},
        timeout=30,
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "tool_choice"
    assert "--tool-call-parser" in response.json()["error"]["message"]


def test_a_chat_template_given_to_the_server_serves_chat_on_a_model_without_one(tiny_checkpoints):
    template = "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant] "
    config = tiny_server_config(
        tiny_checkpoints["gemma3"], served_model_name="templated", chat_template=template, max_model_len=512
    )
    running = start_server(config)
    try:
        reply = create(running, tools=[WEATHER], tool_choice=NAMED, max_tokens=80)
        assert reply.choices[0].message.tool_calls[0].function.name == "weather"
        text = httpx.post(f"{running.base_url}/tokenize", json={"messages": ASK}, timeout=30).json()
        assert text["count"] > len("[user] Weather in Oslo?")
    finally:
        running.stop()


def test_a_pythonic_parser_server_reads_its_calls(tiny_checkpoints):
    config = tiny_server_config(
        tiny_checkpoints["qwen3"], served_model_name="pythonic", tool_call_parser="pythonic", max_model_len=512
    )
    running = start_server(config)
    try:
        extra = {
            "tools": [WEATHER],
            "extra_body": {"structured_outputs": {"regex": r'\[weather\(city="[a-z]{1,6}"\)\]'}},
        }
        content, calls, finish_reason = whole_message(running, **extra)
        assert content is None and finish_reason == "tool_calls" and [name for name, _ in calls] == ["weather"]
        assert streamed_message(running, **extra) == (content, calls, finish_reason)
        prompt = httpx.post(
            f"{running.base_url}/tokenize", json={"messages": ASK, "tools": [WEATHER]}, timeout=30
        ).json()["tokens"]
        text = httpx.post(f"{running.base_url}/detokenize", json={"tokens": prompt}, timeout=30).json()["prompt"]
        assert "[function_name(" in text  # the preamble asks for the server's format
    finally:
        running.stop()


def test_tool_settings_must_come_before_the_calls_are_read():
    from quickdraft.server.protocol import ChatCompletionRequest

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=tools, tool_choice="auto")
    with pytest.raises(RuntimeError, match="before use_server_tool_settings"):
        _ = body.tool_calling  # built with defaults, it would ignore the server's parser and grammar setting
    body.use_server_tool_settings(constrain_auto_calls=False, parser="pythonic")
    assert body.tool_calling is not None and body.tool_calling.parser == "pythonic"
    with pytest.raises(RuntimeError, match="came after tool_calling was read"):
        body.use_server_tool_settings(constrain_auto_calls=True, parser="hermes")
