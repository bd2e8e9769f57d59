"""Logprobs of tokens a constraint rules out are -inf, which JSON cannot carry: the server sends
vLLM's -9999.0 instead (it answered 500 whole and sent -Infinity streamed before)."""

from __future__ import annotations

import json

import httpx

from quickdraft.server.protocol import LOGPROB_FLOOR


def strict_json(text: str):
    def refuse(constant: str):
        raise AssertionError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_logprobs_of_tokens_a_constraint_rules_out_stay_valid_json(ngram_server):
    body = {
        "model": ngram_server.model_name,
        "prompt": "Answer:",
        "max_tokens": 4,
        "temperature": 0,
        "logprobs": 5,
        "structured_outputs": {"choice": ["up", "down"]},
    }
    reply = httpx.post(f"{ngram_server.api_url}/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    logprobs = strict_json(reply.text)["choices"][0]["logprobs"]
    floored = [value for top in logprobs["top_logprobs"] for value in top.values() if value == LOGPROB_FLOOR]
    assert floored  # a choice of two words leaves most of the top 5 impossible
    streamed = []
    with httpx.stream("POST", f"{ngram_server.api_url}/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                streamed.append(strict_json(line.removeprefix("data: ")))
    tops = [
        top
        for chunk in streamed
        for choice in chunk["choices"]
        if choice.get("logprobs")
        for top in choice["logprobs"]["top_logprobs"]
    ]
    assert tops == logprobs["top_logprobs"]


def test_logprobs_past_the_servers_cap_are_400s_naming_the_field(ngram_server):
    common = {"model": ngram_server.model_name, "max_tokens": 2}
    cases = [
        ("completions", {"prompt": "Hi", "logprobs": 21}, "logprobs"),
        ("completions", {"prompt": "Hi", "prompt_logprobs": 30}, "prompt_logprobs"),
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "top_logprobs": 25},
            "top_logprobs",
        ),
    ]
    for route, body, param in cases:
        reply = httpx.post(f"{ngram_server.api_url}/{route}", json={**common, **body}, timeout=60)
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == param and "--max-logprobs" in error["message"], error
