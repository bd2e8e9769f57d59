"""vLLM's use_beam_search through the server: the n best beams as choices, as LLM.beam_search
finds them; fields beam search would not honour are a 400 naming them."""

from __future__ import annotations

import httpx
import pytest

from quickdraft import BeamSearchParams


def post(server, path: str, **fields) -> httpx.Response:
    return httpx.post(f"{server.api_url}/{path}", json={"model": server.model_name, **fields}, timeout=60)


def test_completions_beams_are_llm_beam_search_s(suffix_server, offline_llms):
    response = post(
        suffix_server,
        "completions",
        prompt=["Once upon", "abc"],
        n=3,
        max_tokens=6,
        use_beam_search=True,
        temperature=0,
        return_token_ids=True,
        length_penalty=0.5,
    )
    assert response.status_code == 200, response.text
    body = response.json()
    expected = offline_llms["gemma3"].beam_search(
        [{"prompt": "Once upon"}, {"prompt": "abc"}], BeamSearchParams(beam_width=3, max_tokens=6, length_penalty=0.5)
    )
    beams = [sequence for result in expected for sequence in result.sequences]
    assert [c["index"] for c in body["choices"]] == list(range(6))
    assert [c["token_ids"] for c in body["choices"]] == [b.output_token_ids for b in beams]
    assert [c["text"] for c in body["choices"]] == [b.output_text for b in beams]
    assert body["usage"]["completion_tokens"] == sum(len(b.output_token_ids) for b in beams)


def test_chat_beams(ngram_server):
    response = post(
        ngram_server,
        "chat/completions",
        messages=[{"role": "user", "content": "hi"}],
        n=2,
        max_tokens=5,
        use_beam_search=True,
    )
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert len(choices) == 2 and all(c["message"]["role"] == "assistant" for c in choices)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"stream": True}, "stream"),
        ({"temperature": 0.8}, "temperature"),
        ({"top_p": 0.5}, "top_p"),
        ({"logprobs": 2}, "logprobs"),
        ({"stop": ["x"]}, "stop"),
        ({"n": 11}, "n"),
    ],
)
def test_fields_beam_search_does_not_honour_are_a_400(plain_server, fields, param):
    response = post(plain_server, "completions", prompt="x", max_tokens=3, use_beam_search=True, **fields)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
