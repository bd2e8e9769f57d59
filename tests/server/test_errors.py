"""Bad input gets an OpenAI-style 4xx naming the field; nothing a client sends causes a 5xx."""

from __future__ import annotations

import copy
import json
import random

import httpx
import openai
import pytest

COMPLETION = {"prompt": "hello", "max_tokens": 2, "temperature": 0}
CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2, "temperature": 0}


def post(server, path, body, **kwargs):
    return httpx.post(f"{server.api_url}{path}", json=body, timeout=30, **kwargs)


def assert_openai_error(response, *, status, param):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    if param is not None:
        assert param.split(".")[0] in error["message"], error
    assert error["type"] == ("invalid_request_error" if status < 429 else error["type"])
    return error


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"n": 0}, "n"),
        ({"n": 129}, "n"),
        ({"temperature": -1}, "temperature"),
        ({"temperature": 1e-30}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -5}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"seed": 2**70}, "seed"),
        ({"logprobs": 50}, "logprobs"),
        ({"stop": [""]}, "stop"),
        ({"logit_bias": {"5": 101.0}}, "logit_bias"),
        ({"logit_bias": {"five": 1.0}}, "logit_bias"),
        ({"logit_bias": {"10000000": 1.0}}, "logit_bias"),  # out of the vocabulary: refused by the engine
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"stop_token_ids": [10_000_000]}, "stop_token_ids"),
        ({"suffix": "tail"}, "suffix"),
        ({"best_of": 3}, "best_of"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": ["one"] * 257}, "prompt"),  # more than MAX_PROMPTS
        ({"prompt": ["one", [5, 10_000_000]]}, "prompt"),  # a batch with one prompt the engine refuses
        ({"prompt": ["one", "word " * 200]}, "prompt"),
        ({"prompt": [[5], []]}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [5, 10_000_000]}, "prompt"),  # out of the vocabulary: refused by the engine itself
        ({"prompt": "word " * 200}, "prompt"),  # over max_model_len (128)
        ({"temperature": "hot"}, "temperature"),
        ({"stream": "yes"}, "stream"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"prompt": 3}, "prompt"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"metadata": {"scenario": 5}}, "metadata.scenario"),
    ],
)
def test_completion_errors_name_the_field(plain_server, change, param):
    assert_openai_error(post(plain_server, "/completions", {**COMPLETION, **change}), status=400, param=param)


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages.0.content"),
        ({"messages": [{"role": "user", "content": "word " * 200}]}, "messages"),
        ({"max_completion_tokens": 0, "max_tokens": None}, "max_completion_tokens"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 99}, "top_logprobs"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),  # auto: no parser here
        ({"tools": [{"type": "function", "function": {"name": "a b"}}], "tool_choice": "required"}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "x"}}}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "tool_choice",
        ),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "tool_choice",
        ),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f"}}]}]},
            "messages.0.tool_calls.0.function.arguments",
        ),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"type": "foo"}}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "foo"}}}}, "response_format"),
        ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs"),
        ({"structured_outputs": {"pattern": "ab"}}, "structured_outputs"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
        ({"n": 0}, "n"),
    ],
)
def test_chat_errors_name_the_field(ngram_server, change, param):
    assert_openai_error(post(ngram_server, "/chat/completions", {**CHAT, **change}), status=400, param=param)


def test_max_tokens_past_the_context_is_a_400_as_in_vllm(plain_server, ngram_server):
    """The fixtures' context is 128 tokens: a prompt of 100 token ids leaves room for 28.  A request's
    own max_tokens beyond that is refused naming it, under each endpoint's name for it; one that
    fits, or none at all (chat: until the end of the context), is answered."""
    prompt = list(range(5, 105))
    refused = post(plain_server, "/completions", {**COMPLETION, "prompt": prompt, "max_tokens": 29})
    error = assert_openai_error(refused, status=400, param="max_tokens")
    assert error["code"] == "context_length_exceeded"
    assert "context length is 128 tokens and your request has 100 input tokens (29 > 128 - 100)" in error["message"]
    answered = post(
        plain_server, "/completions", {**COMPLETION, "prompt": prompt, "max_tokens": 28, "ignore_eos": True}
    )
    assert answered.status_code == 200 and answered.json()["usage"]["completion_tokens"] == 28
    # a batch of prompts: the longest decides
    batch = post(plain_server, "/completions", {**COMPLETION, "prompt": [[5, 6], prompt], "max_tokens": 29})
    assert_openai_error(batch, status=400, param="max_tokens")
    for field in ("max_tokens", "max_completion_tokens"):
        body = {**CHAT, "max_tokens": None, field: 1000}
        assert_openai_error(post(ngram_server, "/chat/completions", body), status=400, param=field)
    responses = {"input": "hello", "max_output_tokens": 1000}
    assert_openai_error(post(ngram_server, "/responses", responses), status=400, param="max_output_tokens")
    until_the_end = post(ngram_server, "/chat/completions", {**CHAT, "max_tokens": None})
    assert until_the_end.status_code == 200


def test_unknown_model_is_404_naming_model(plain_server):
    with pytest.raises(openai.NotFoundError) as caught:
        plain_server.openai_client().completions.create(model="gpt-17", prompt="x", max_tokens=2)
    assert caught.value.body["param"] == "model" and "gpt-17" in caught.value.body["message"]


def test_chat_without_template_is_a_clear_400(plain_server):
    with pytest.raises(openai.BadRequestError) as caught:
        plain_server.openai_client().chat.completions.create(
            model=plain_server.model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    assert caught.value.body["code"] == "chat_template_missing"
    assert "chat template" in caught.value.body["message"]


def test_priority_on_a_first_come_first_served_server_is_a_400(plain_server):
    body = {"model": plain_server.model_name, "prompt": "x", "max_tokens": 2, "priority": 2}
    error = assert_openai_error(post(plain_server, "/completions", body), status=400, param="priority")
    assert "--scheduling-policy priority" in error["message"]


def test_a_request_s_chat_template_needs_a_server_that_trusts_it(plain_server):
    body = {"model": plain_server.model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    tokenize = {"messages": body["messages"]}
    for url, sent in (
        (f"{plain_server.api_url}/chat/completions", body),
        (f"{plain_server.base_url}/tokenize", tokenize),
    ):
        response = httpx.post(url, json=sent | {"chat_template": template}, timeout=30)
        error = assert_openai_error(response, status=400, param="chat_template")
        assert "--trust-request-chat-template" in error["message"]


def test_malformed_and_non_object_bodies(plain_server):
    url = f"{plain_server.api_url}/completions"
    malformed = httpx.post(url, content=b'{"prompt": "x",', headers={"Content-Type": "application/json"})
    assert assert_openai_error(malformed, status=400, param=None)["code"] == "invalid_json"
    not_an_object = httpx.post(url, json=[1, 2])
    assert "JSON object" in assert_openai_error(not_an_object, status=400, param=None)["message"]
    form = httpx.post(url, content=b"prompt=x", headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert_openai_error(form, status=400, param=None)
    missing = httpx.post(url, json={"max_tokens": 2})
    assert_openai_error(missing, status=400, param="prompt")


def test_unknown_route_and_method_use_the_openai_shape(plain_server):
    assert httpx.get(f"{plain_server.api_url}/nothing").json()["error"]["message"].startswith("Not Found")
    wrong_method = httpx.get(f"{plain_server.api_url}/completions")
    assert wrong_method.status_code == 405 and "error" in wrong_method.json()


# ---- fuzzing ---------------------------------------------------------------------------
FUZZ_VALUES = [
    None,
    True,
    False,
    0,
    -1,
    1,
    2,
    7,
    1e308,
    -1e308,
    0.5,
    1e-9,
    2**64,
    -(2**63) - 1,
    "",
    "x",
    "\u0000\ud7ff",
    "🙂" * 3,
    "\ud800",
    "ab\udfffc",
    [],
    [1],
    [-1],
    [[1, 2]],
    ["a", 1],
    {},
    {"a": 1},
    {"include_usage": "y"},
    [{"role": "user"}],
    [{"role": "user", "content": None}],
    [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
    [{"role": "tool", "content": "x"}],
    "NaN",
    {"type": "content", "content": "Once upon a time"},
    {"type": "content", "content": [{"type": "text", "text": "x"}]},
    [{"title": "t", "text": "x"}],
    ["os.system"],
    [{"qualname": "builtins.print", "args": [1]}],
]
FUZZ_KEYS = [
    "prompt",
    "messages",
    "model",
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "seed",
    "logprobs",
    "top_logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "stream",
    "stream_options",
    "metadata",
    "logit_bias",
    "stop_token_ids",
    "min_tokens",
    "ignore_eos",
    "echo",
    "best_of",
    "suffix",
    "tools",
    "user",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "response_format",
    "tool_choice",
    "parallel_tool_calls",
    "bad_words",
    "continue_final_message",
    "add_generation_prompt",
    "chat_template_kwargs",
    "prediction",
    "priority",
    "cache_salt",
    "request_id",
    "return_tokens_as_token_ids",
    "add_special_tokens",
    "documents",
    "chat_template",
    "logits_processors",
    "use_beam_search",
    "length_penalty",
    "guided_whitespace_pattern",
    "zzz",
]
# Generation lengths stay small so hundreds of requests take seconds.
MAX_FUZZ_TOKENS = 3


def mutate(body: dict, rng: random.Random) -> dict:
    body = copy.deepcopy(body)
    for _ in range(rng.randint(1, 4)):
        action = rng.random()
        key = rng.choice(FUZZ_KEYS)
        if action < 0.6:
            body[key] = copy.deepcopy(rng.choice(FUZZ_VALUES))
        elif action < 0.8:
            body.pop(rng.choice(list(body) or ["prompt"]), None)
        else:
            body[key] = rng.uniform(-3, 3) if rng.random() < 0.5 else rng.randint(-3, 40)
    return bound_generation(body)


def bound_generation(body: dict) -> dict:
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_FUZZ_TOKENS:
            body[key] = MAX_FUZZ_TOKENS
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_FUZZ_TOKENS
    return body


def raw_bodies(rng: random.Random) -> list[bytes]:
    """Byte-level damage: truncations, flipped bytes, other JSON types, deep nesting."""
    good = json.dumps(COMPLETION).encode()
    bodies = [good[: rng.randint(0, len(good) - 1)] for _ in range(10)]
    for _ in range(10):
        damaged = bytearray(good)
        damaged[rng.randrange(len(damaged))] = rng.randrange(256)
        bodies.append(bytes(damaged))
    return bodies + [b"null", b"42", b'"text"', b"[" * 5000 + b"]" * 5000, b"\xff\xfe", b'{"prompt": NaN}']


def send_fuzzed(client: httpx.Client, url: str, body: dict) -> int:
    """Post the body (streamed when it asks); its status, checked: never a 5xx, errors in their body."""
    # json.dumps escapes lone surrogates as \udXXX, as JavaScript clients send them
    # (httpx's json= would fail to encode them on this side).
    request = {"content": json.dumps(body).encode(), "headers": {"Content-Type": "application/json"}}
    if body.get("stream") is True:
        with client.stream("POST", url, **request) as response:
            response.read()
    else:
        response = client.post(url, **request)
    assert response.status_code < 500, (body, response.text)
    if response.status_code >= 400:
        assert "error" in response.json(), response.text
    return response.status_code


def test_fuzzed_bodies_never_get_a_5xx(plain_server, ngram_server):
    rng = random.Random(1234)
    statuses = []
    with httpx.Client(timeout=30) as client:
        for i in range(300):
            server, path, base = (
                (plain_server, "/completions", COMPLETION) if i % 2 == 0 else (ngram_server, "/chat/completions", CHAT)
            )
            statuses.append(send_fuzzed(client, f"{server.api_url}{path}", mutate(base, rng)))
        for raw in raw_bodies(rng):
            response = client.post(
                f"{plain_server.api_url}/completions", content=raw, headers={"Content-Type": "application/json"}
            )
            # A flipped byte can leave valid JSON (a 200); anything else is the client's error.
            assert response.status_code == 200 or 400 <= response.status_code < 500, (raw[:80], response.text)
    # The fuzzing reached both sides: accepted requests and refusals.
    assert statuses.count(200) > 20 and sum(400 <= s < 500 for s in statuses) > 100


RESPONSES_KEYS = [
    "input",
    "instructions",
    "max_output_tokens",
    "temperature",
    "top_p",
    "stream",
    "tools",
    "tool_choice",
    "text",
    "previous_response_id",
    "store",
    "include",
    "top_logprobs",
    "truncation",
    "metadata",
    "zzz",
]
RESPONSES_VALUES = [
    *FUZZ_VALUES,
    [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
    [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}],
    [{"type": "function_call_output", "call_id": "c", "output": "ok"}],
    [{"type": "reasoning", "summary": []}, {"role": "assistant", "content": "x"}],
    {"format": {"type": "json_object"}},
    {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
    [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
    {"type": "function", "name": "f"},
    "resp-missing",
    ["message.output_text.logprobs"],
]


def test_fuzzed_responses_bodies_never_get_a_5xx(ngram_server):
    rng = random.Random(4321)
    statuses = []
    with httpx.Client(timeout=30) as client:
        for _ in range(120):
            body = {"input": "hello", "max_output_tokens": 2, "temperature": 0}
            for _ in range(rng.randint(1, 2)):
                key = rng.choice(RESPONSES_KEYS)
                body[key] = copy.deepcopy(rng.choice(RESPONSES_VALUES)) if rng.random() < 0.8 else rng.randint(-3, 9)
            if not isinstance(body.get("max_output_tokens"), int) or body["max_output_tokens"] > MAX_FUZZ_TOKENS:
                body["max_output_tokens"] = MAX_FUZZ_TOKENS
            statuses.append(send_fuzzed(client, f"{ngram_server.api_url}/responses", body))
    assert statuses.count(200) > 5 and sum(400 <= s < 500 for s in statuses) > 30
