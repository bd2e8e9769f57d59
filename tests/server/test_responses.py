"""OpenAI's Responses API through the official openai client: text, streamed events, JSON
schema, function calls and their outputs, previous_response_id, errors naming the field."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from quickdraft import SamplingParams
from tests.server.conftest import NGRAM_CONFIG, start_server, tiny_server_config


@pytest.fixture(scope="module")
def server(tiny_checkpoints):
    """qwen3 (a chat template), n-gram speculation, room for the tools' preamble."""
    config = tiny_server_config(
        tiny_checkpoints["qwen3"],
        served_model_name="tiny-responses",
        speculative_config=NGRAM_CONFIG,
        tool_call_parser="hermes",
        max_model_len=512,
    )
    running = start_server(config)
    yield running
    running.stop()


WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


def test_a_text_input_answers_as_chat_does(server, offline_llms):
    client = server.openai_client()
    response = client.responses.create(
        model=server.model_name,
        input="Hello there",
        instructions="Be brief.",
        max_output_tokens=12,
        temperature=0,
    )
    expected = (
        offline_llms["qwen3"]
        .chat(
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}],
            SamplingParams(max_tokens=12, temperature=0),
        )[0]
        .outputs[0]
    )
    assert response.object == "response" and response.output_text == expected.text
    assert response.status == ("incomplete" if expected.finish_reason == "length" else "completed")
    (item,) = response.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert response.usage.output_tokens == len(expected.token_ids)
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens


def test_streamed_events_build_the_same_response(server):
    client = server.openai_client()
    common = dict(model=server.model_name, input="Tell me a story", max_output_tokens=16, temperature=0)
    whole = client.responses.create(**common)
    events = list(client.responses.create(stream=True, **common))
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [event.sequence_number for event in events] == list(range(1, len(events) + 1))
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text
    assert "response.output_item.done" in kinds and "response.content_part.done" in kinds


def test_json_schema_text_format(server):
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["n"],
        "additionalProperties": False,
    }
    response = server.openai_client().responses.create(
        model=server.model_name,
        input="A number",
        text={"format": {"type": "json_schema", "name": "number", "schema": schema, "strict": True}},
        max_output_tokens=30,
        temperature=0,
    )
    assert set(json.loads(response.output_text)) == {"n"}, response.output_text


# A request that must call the tool; no max_output_tokens: the rest of the context, room for the
# call's JSON in the tiny tokenizer's bytes
MUST_CALL = dict(input="Weather in Oslo?", tools=[WEATHER], tool_choice="required", temperature=0)


def test_a_required_function_call_and_its_output_sent_back(server):
    client = server.openai_client()
    response = client.responses.create(model=server.model_name, **MUST_CALL)
    calls = [item for item in response.output if item.type == "function_call"]
    assert response.status == "completed", response.output
    assert calls and calls[0].name == "get_weather" and "city" in json.loads(calls[0].arguments)
    follow_up = client.responses.create(
        model=server.model_name,
        previous_response_id=response.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}],
        max_output_tokens=8,
        temperature=0,
    )
    assert follow_up.previous_response_id == response.id and follow_up.output
    assert client.responses.retrieve(follow_up.id).id == follow_up.id


def test_previous_response_id_continues_the_stored_conversation(server, offline_llms):
    client = server.openai_client()
    first = client.responses.create(model=server.model_name, input="Hi", max_output_tokens=6, temperature=0)
    second = client.responses.create(
        model=server.model_name,
        previous_response_id=first.id,
        input="And then?",
        max_output_tokens=6,
        temperature=0,
    )
    conversation = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And then?"},
    ]
    expected = offline_llms["qwen3"].chat(conversation, SamplingParams(max_tokens=6, temperature=0))[0].outputs[0]
    assert second.output_text == expected.text


@pytest.mark.parametrize(
    ("fields", "status", "param"),
    [
        ({"input": "x", "previous_response_id": "resp-unknown"}, 404, "previous_response_id"),
        (
            {"input": "x", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
            400,
            "text",
        ),
        ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools"),
        ({"input": [{"type": "image", "url": "x"}]}, 400, "input"),
        ({"input": "x", "include": ["reasoning.encrypted_content"]}, 400, "include"),
        ({"input": "x", "top_logprobs": 21}, 400, "top_logprobs"),
        ({"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
        ({"input": "x", "frequency": 1}, 400, "frequency"),
    ],
)
def test_bad_requests_name_the_responses_field(server, fields, status, param):
    reply = httpx.post(f"{server.api_url}/responses", json={"model": server.model_name, **fields}, timeout=30)
    assert reply.status_code == status, reply.text
    assert reply.json()["error"]["param"] == param


def test_an_unstored_response_cannot_be_continued(server):
    client = server.openai_client()
    response = client.responses.create(model=server.model_name, input="x", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


def test_a_streamed_function_call_is_the_whole_one(server):
    client = server.openai_client()
    common = dict(model=server.model_name, store=False, **MUST_CALL)
    whole = client.responses.create(**common)
    events = list(client.responses.create(stream=True, **common))
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    streamed = [item for item in events[-1].response.output if item.type == "function_call"]
    calls = [item for item in whole.output if item.type == "function_call"]
    assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in calls]
    assert arguments == "".join(c.arguments for c in calls)
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [item.id for item in done] == [item.id for item in events[-1].response.output]


def test_logprobs_come_with_the_text_when_included(server):
    client = server.openai_client()
    common = dict(
        model=server.model_name,
        input="Count",
        max_output_tokens=6,
        temperature=0,
        top_logprobs=2,
        include=["message.output_text.logprobs"],
        store=False,
    )
    whole = client.responses.create(**common)
    part = whole.output[0].content[0]
    assert len(part.logprobs) == whole.usage.output_tokens
    assert all(len(entry.top_logprobs) == 2 for entry in part.logprobs)
    assert "".join(entry.token for entry in part.logprobs) == part.text
    events = list(client.responses.create(stream=True, **common))
    streamed = [entry for e in events if e.type == "response.output_text.delta" for entry in e.logprobs]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in part.logprobs]
    without = client.responses.create(**{**common, "include": None})
    assert not without.output[0].content[0].logprobs


def test_a_deleted_response_is_gone(server):
    client = server.openai_client()
    response = client.responses.create(model=server.model_name, input="x", max_output_tokens=2)
    assert client.responses.retrieve(response.id).id == response.id
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(response.id)
