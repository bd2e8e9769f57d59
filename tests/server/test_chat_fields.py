"""vLLM's chat rendering fields: continue_final_message (a prefilled reply the model continues),
chat_template_kwargs (template variables), a request's own chat_template, and /version."""

from __future__ import annotations

import json

import httpx
import pytest

import quickdraft
from tests.server.conftest import start_server, tiny_server_config

TEMPLATE = (
    "{{ bos_token }}{{ greeting | default('') }}{% for m in messages %}[{{ m.role }}] {{ m.content }}<end>\n"
    "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
)
PREFILLED = [{"role": "user", "content": "Tell a story."}, {"role": "assistant", "content": "Once upon a time "}]


@pytest.fixture(scope="module")
def server(tiny_checkpoints):
    config = tiny_server_config(
        tiny_checkpoints["gemma3"],
        served_model_name="rendering",
        chat_template=TEMPLATE,
        trust_request_chat_template=True,
    )
    running = start_server(config)
    yield running
    running.stop()


def rendered(server, **body) -> str:
    tokens = httpx.post(f"{server.base_url}/tokenize", json=body, timeout=30).json()["tokens"]
    return httpx.post(f"{server.base_url}/detokenize", json={"tokens": tokens}, timeout=30).json()["prompt"]


def test_continue_final_message_leaves_the_last_message_open(server):
    text = rendered(server, messages=PREFILLED, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("[assistant] Once upon a time") and text.count("<end>") == 1
    closed = rendered(server, messages=PREFILLED, add_generation_prompt=False)
    assert closed.endswith("Once upon a time <end>\n")


def test_a_continued_reply_is_the_completion_of_the_open_conversation(server):
    body = dict(messages=PREFILLED, add_generation_prompt=False, continue_final_message=True)
    tokens = httpx.post(f"{server.base_url}/tokenize", json=body, timeout=30).json()["tokens"]
    common = {"model": server.model_name, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    chat = httpx.post(f"{server.api_url}/chat/completions", json=common | body, timeout=30).json()
    completion = httpx.post(f"{server.api_url}/completions", json=common | {"prompt": tokens}, timeout=30).json()
    assert chat["choices"][0]["token_ids"] == completion["choices"][0]["token_ids"]


def test_echo_puts_the_prefilled_assistant_message_before_the_reply(server):
    body = dict(messages=PREFILLED, add_generation_prompt=False, continue_final_message=True, max_tokens=6)
    common = {"model": server.model_name, "temperature": 0, **body}
    url = f"{server.api_url}/chat/completions"
    reply = httpx.post(url, json=common, timeout=30).json()["choices"][0]["message"]["content"]
    echoed = httpx.post(url, json=common | {"echo": True}, timeout=30).json()
    assert echoed["choices"][0]["message"]["content"] == "Once upon a time " + reply
    with httpx.stream("POST", url, json=common | {"echo": True, "stream": True}, timeout=30) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert streamed == "Once upon a time " + reply
    # the last message is the user's: nothing to echo
    user_last = {"model": server.model_name, "messages": PREFILLED[:1], "max_tokens": 4, "temperature": 0}
    with_echo = httpx.post(url, json=user_last | {"echo": True}, timeout=30).json()
    without = httpx.post(url, json=user_last, timeout=30).json()
    assert with_echo["choices"][0]["message"] == without["choices"][0]["message"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"continue_final_message": True}, "needs add_generation_prompt: false"),
        (
            {
                "continue_final_message": True,
                "add_generation_prompt": False,
                "messages": [{"role": "user", "content": " "}],
            },
            "needs a last message with text",
        ),
        ({"chat_template_kwargs": {"messages": []}}, "may not set ['messages']"),
        ({"chat_template": "{% for m in messages %}"}, "not a valid jinja template"),
        ({"chat_template": "{{ raise_exception('no system messages') }}"}, "refused them: no system messages"),
    ],
)
def test_bad_rendering_fields_are_400s_naming_them(server, change, message):
    body = {"model": server.model_name, "messages": PREFILLED[:1], "max_tokens": 2} | change
    response = httpx.post(f"{server.api_url}/chat/completions", json=body, timeout=30)
    error = response.json()["error"]
    assert response.status_code == 400 and message in error["message"]
    assert error["param"] in ("continue_final_message", "chat_template_kwargs", "chat_template", "messages")


def test_a_request_s_chat_template_replaces_the_server_s(server):
    template = "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
    assert rendered(server, messages=PREFILLED[:1], chat_template=template) == "<user>Tell a story.<assistant>"
    assert rendered(server, messages=PREFILLED[:1]).startswith("[user] Tell a story.")  # the next request: the server's
    common = {"model": server.model_name, "max_tokens": 4, "temperature": 0, "return_token_ids": True}
    chat = httpx.post(
        f"{server.api_url}/chat/completions",
        json=common | {"messages": PREFILLED[:1], "chat_template": template},
        timeout=30,
    ).json()
    tokens = httpx.post(
        f"{server.base_url}/tokenize", json={"messages": PREFILLED[:1], "chat_template": template}, timeout=30
    ).json()["tokens"]
    completion = httpx.post(f"{server.api_url}/completions", json=common | {"prompt": tokens}, timeout=30).json()
    assert chat["choices"][0]["token_ids"] == completion["choices"][0]["token_ids"]


def test_chat_template_kwargs_reach_the_template(server):
    assert rendered(server, messages=PREFILLED[:1], chat_template_kwargs={"greeting": "Hello! "}).startswith(
        "Hello! [user]"  # /detokenize leaves out the special BOS
    )
    body = {"model": server.model_name, "messages": PREFILLED[:1], "max_tokens": 2}
    reply = httpx.post(
        f"{server.api_url}/chat/completions", json=body | {"chat_template_kwargs": {"greeting": "Hi"}}, timeout=30
    )
    assert reply.status_code == 200


def test_documents_and_the_tokenizer_s_bos(server):
    template = "{% for d in documents %}<{{ d.title }}: {{ d.text }}>{% endfor %}{{ messages[0].content }}"
    body = {"messages": PREFILLED[:1], "chat_template": template}
    documents = [{"title": "A", "text": "one"}, {"title": "B", "text": "two"}]
    assert rendered(server, **body, documents=documents) == "<A: one><B: two>Tell a story."
    common = {"model": server.model_name, "messages": PREFILLED[:1], "max_tokens": 1}
    url = f"{server.api_url}/chat/completions"
    plain = httpx.post(url, json=common, timeout=30).json()["usage"]["prompt_tokens"]
    doubled = httpx.post(url, json=common | {"add_special_tokens": True}, timeout=30).json()["usage"]["prompt_tokens"]
    assert doubled == plain + 1  # the template's BOS and the tokenizer's


def test_version(server):
    assert httpx.get(f"{server.base_url}/version", timeout=10).json() == {"version": quickdraft.__version__}


def test_prompt_logprobs_in_vllm_s_form(server):
    body = {"model": server.model_name, "messages": PREFILLED[:1], "max_tokens": 2, "temperature": 0}
    chat = httpx.post(f"{server.api_url}/chat/completions", json=body | {"prompt_logprobs": 2}, timeout=30).json()
    tokens = httpx.post(f"{server.base_url}/tokenize", json={"messages": PREFILLED[:1]}, timeout=30).json()["tokens"]
    entries = chat["prompt_logprobs"]
    assert len(entries) == len(tokens) and entries[0] is None
    for token, entry in zip(tokens[1:], entries[1:]):
        own = entry[str(token)]  # the prompt token first, then the top 2 (ranks 1 and 2)
        assert next(iter(entry)) == str(token) and own["rank"] >= 1 and own["logprob"] <= 0
        others = [value["rank"] for key, value in entry.items() if key != str(token)]
        assert sorted([own["rank"], *others]) == ([1, 2] if own["rank"] <= 2 else [1, 2, own["rank"]])
    plain = httpx.post(f"{server.api_url}/chat/completions", json=body, timeout=30).json()
    assert "prompt_logprobs" not in plain
    completion = httpx.post(
        f"{server.api_url}/completions",
        json={"model": server.model_name, "prompt": tokens, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2},
        timeout=30,
    ).json()
    assert completion["choices"][0]["prompt_logprobs"] == entries  # the same prompt, the same figures


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"stream": True}, "whole responses only"),
        ({"echo": True, "logprobs": 1, "prompt_logprobs": 3}, "give the same number"),
    ],
)
def test_prompt_logprobs_that_cannot_be_given_are_400s(server, change, message):
    body = {"model": server.model_name, "prompt": "x", "max_tokens": 2, "prompt_logprobs": 2} | change
    response = httpx.post(f"{server.api_url}/completions", json=body, timeout=30)
    assert response.status_code == 400 and message in response.json()["error"]["message"]
    assert response.json()["error"]["param"] == "prompt_logprobs"


def test_spaces_between_special_tokens_is_taken_as_vllm_takes_it_with_fast_tokenizers(server):
    """vLLM's field: its fast tokenizers (every one here) decode as the tokenizer does, so the
    text is the same either way; a value that is not a bool is a 400."""
    body = {"model": "rendering", "prompt": "Hi", "max_tokens": 6, "temperature": 0, "skip_special_tokens": False}
    texts = []
    for spaces in (True, False):
        reply = httpx.post(
            f"{server.api_url}/completions", json={**body, "spaces_between_special_tokens": spaces}, timeout=60
        )
        assert reply.status_code == 200, reply.text
        texts.append(reply.json()["choices"][0]["text"])
    assert texts[0] == texts[1]
    reply = httpx.post(f"{server.api_url}/completions", json={**body, "spaces_between_special_tokens": [1]}, timeout=60)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "spaces_between_special_tokens"
