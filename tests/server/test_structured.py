"""Structured outputs through the server, with the official openai client: response_format
(json_object, json_schema), vLLM's structured_outputs and guided_* fields, streaming."""

from __future__ import annotations

import json
import re

import openai
import pytest

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "year": {"type": "integer", "minimum": 1000, "maximum": 2100},
    },
    "required": ["city", "year"],
    "additionalProperties": False,
}


def test_chat_response_format_json_schema(ngram_server):
    client = ngram_server.openai_client()
    reply = client.chat.completions.create(
        model=ngram_server.model_name,
        messages=[{"role": "user", "content": "Where and when?"}],
        response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA, "strict": True}},
        max_tokens=60,
        temperature=0,
    )
    assert reply.choices[0].finish_reason == "stop"
    document = json.loads(reply.choices[0].message.content)
    assert set(document) == {"city", "year"} and 1000 <= document["year"] <= 2100


def test_chat_json_object_streams_the_same_text(ngram_server):
    client = ngram_server.openai_client()
    common = dict(
        model=ngram_server.model_name,
        messages=[{"role": "user", "content": "Give me an object."}],
        response_format={"type": "json_object"},
        max_tokens=40,
        temperature=0,
    )
    whole = client.chat.completions.create(**common).choices[0].message.content
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in client.chat.completions.create(stream=True, **common)
        if chunk.choices
    )
    assert streamed == whole and whole.startswith("{")


@pytest.mark.parametrize(
    ("extra", "check"),
    [
        ({"guided_regex": r"[0-9]{3}-[a-z]{2}"}, lambda text: re.fullmatch(r"[0-9]{3}-[a-z]{2}", text)),
        ({"guided_choice": ["red", "green", "blue"]}, lambda text: text in ("red", "green", "blue")),
        ({"structured_outputs": {"choice": ["up", "down"]}}, lambda text: text in ("up", "down")),
        (
            {"structured_outputs": {"grammar": 'root ::= "v" [0-9] "." [0-9]'}},
            lambda text: re.fullmatch(r"v\d\.\d", text),
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
            lambda t: json.loads(t),
        ),
    ],
)
def test_completions_take_every_constraint_field(suffix_server, extra, check):
    reply = suffix_server.openai_client().completions.create(
        model=suffix_server.model_name, prompt="Answer:", max_tokens=64, temperature=0, extra_body=extra
    )
    assert reply.choices[0].finish_reason == "stop"
    assert check(reply.choices[0].text)


def test_invalid_schema_is_a_400_naming_response_format(ngram_server):
    with pytest.raises(openai.BadRequestError) as caught:
        ngram_server.openai_client().chat.completions.create(
            model=ngram_server.model_name,
            messages=[{"role": "user", "content": "x"}],
            response_format={"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "nope"}}},
            max_tokens=4,
        )
    assert caught.value.body["param"] == "response_format"
    assert "Invalid type: nope" in caught.value.body["message"]


STRUCTURAL_TAG = {
    "type": "structural_tag",
    "structures": [{"begin": "<n=", "schema": {"type": "integer"}, "end": ">"}],
    "triggers": ["<n="],
}


def test_response_format_structural_tag(ngram_server):
    client = ngram_server.openai_client()
    reply = client.chat.completions.create(
        model=ngram_server.model_name,
        messages=[{"role": "user", "content": "Number <n=12> and <n=7>"}],
        response_format=STRUCTURAL_TAG,
        max_tokens=40,
        temperature=0,
    )
    text = reply.choices[0].message.content
    # every trigger the reply writes starts a whole structure
    assert all(re.match(r"-?\d+>", rest) for rest in text.split("<n=")[1:]), text
    bad = {**STRUCTURAL_TAG, "structures": [{"begin": "<x>", "schema": {}, "end": ""}]}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=ngram_server.model_name, messages=[{"role": "user", "content": "x"}], response_format=bad
        )
    assert caught.value.body["param"] == "response_format" and "starts with none of the triggers" in str(caught.value)


def test_guided_whitespace_pattern_goes_with_a_json_constraint(suffix_server):
    client = suffix_server.openai_client()
    extra = {"guided_json": SCHEMA, "guided_whitespace_pattern": "[ ]?"}
    reply = client.completions.create(
        model=suffix_server.model_name, prompt="Answer:", max_tokens=64, temperature=0, extra_body=extra
    )
    assert set(json.loads(reply.choices[0].text)) == {"city", "year"}
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(
            model=suffix_server.model_name, prompt="x", max_tokens=4, extra_body={"guided_whitespace_pattern": " "}
        )
    assert caught.value.body["param"] == "guided_whitespace_pattern"
