"""The real server driven by the official openai client: outputs, streaming, concurrency."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from quickdraft import SamplingParams

PROMPTS = ["The capital of France is", "a b c a b c a b c a b", "def fib(n):", "1 2 3 4 5 6 7 8"]
MAX_TOKENS = 20


def offline_greedy(llm, prompts, *, max_tokens=MAX_TOKENS):
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return [out.outputs[0] for out in outputs]


@pytest.mark.parametrize(
    ("server_fixture", "arch"), [("plain_server", "gemma3"), ("ngram_server", "qwen3"), ("suffix_server", "gemma3")]
)
def test_greedy_completions_equal_offline_generate(request, offline_llms, server_fixture, arch):
    server = request.getfixturevalue(server_fixture)
    client = server.openai_client()
    expected = offline_greedy(offline_llms[arch], PROMPTS)
    for prompt, reference in zip(PROMPTS, expected):
        response = client.completions.create(
            model=server.model_name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
        )
        choice = response.choices[0]
        assert choice.text == reference.text
        assert choice.finish_reason == reference.finish_reason
        assert response.usage.completion_tokens == len(reference.token_ids)
        assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens


def test_speculation_figures_are_the_requests_own(ngram_server):
    client = ngram_server.openai_client()
    # A tiny random model falls into loops under greedy decoding: n-gram lookup then drafts.
    response = client.completions.create(
        model=ngram_server.model_name, prompt="x y x y x y x y", max_tokens=48, temperature=0
    )
    figures = response.model_extra["speculation"]
    assert figures["method"] == "ngram"
    assert figures["drafts"] > 0 and figures["draft_tokens"] >= figures["drafts"]
    assert 0 <= figures["accepted_tokens"] <= figures["draft_tokens"]
    assert figures["acceptance_rate"] == pytest.approx(figures["accepted_tokens"] / figures["draft_tokens"])
    assert figures["acceptance_length"] == pytest.approx(response.usage.completion_tokens / figures["target_forwards"])
    assert sum(figures["accepted_per_position"]) == figures["accepted_tokens"]
    assert figures["target_forwards"] < response.usage.completion_tokens  # speculation saved forwards


def test_plain_server_reports_no_drafts(plain_server):
    response = plain_server.openai_client().completions.create(
        model=plain_server.model_name, prompt="hi", max_tokens=5, temperature=0
    )
    figures = response.model_extra["speculation"]
    assert figures["method"] == "none" and figures["draft_tokens"] == 0 and figures["acceptance_rate"] is None
    assert figures["acceptance_length"] == 1.0


def test_chat_equals_offline_chat(ngram_server, offline_llms):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi twice."}]
    reference = offline_llms["qwen3"].chat(messages, SamplingParams(temperature=0, max_tokens=16))[0]
    response = ngram_server.openai_client().chat.completions.create(
        model=ngram_server.model_name, messages=messages, max_completion_tokens=16, temperature=0
    )
    assert response.object == "chat.completion"
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == reference.outputs[0].text
    assert response.usage.prompt_tokens == len(reference.prompt_token_ids)
    assert "speculation" in response.model_extra


def test_seeded_sampling_equals_offline(plain_server, offline_llms):
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=7, max_tokens=12)
    reference = offline_llms["gemma3"].generate(["Once upon"], params)[0].outputs[0].text
    client = plain_server.openai_client()
    texts = [
        client.completions.create(
            model=plain_server.model_name,
            prompt="Once upon",
            max_tokens=12,
            temperature=0.9,
            top_p=0.9,
            seed=7,
            extra_body={"top_k": 50},
        )
        .choices[0]
        .text
        for _ in range(2)
    ]
    assert texts == [reference, reference]


def test_streaming_completion_with_usage(ngram_server, offline_llms):
    reference = offline_greedy(offline_llms["qwen3"], [PROMPTS[1]])[0]
    stream = ngram_server.openai_client().completions.create(
        model=ngram_server.model_name,
        prompt=PROMPTS[1],
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
    assert text == reference.text
    finishing = [chunk for chunk in chunks if chunk.choices and chunk.choices[0].finish_reason]
    assert len(finishing) == 1 and finishing[0].choices[0].finish_reason == reference.finish_reason
    assert "speculation" in finishing[0].model_extra
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == len(reference.token_ids)
    assert usage_chunk.model_extra["speculation"]["target_forwards"] >= 1
    assert all(chunk.usage is None for chunk in chunks[:-1])


def test_streaming_chat_deltas(ngram_server, offline_llms):
    messages = [{"role": "user", "content": "Count: 1 2 3 1 2 3"}]
    reference = offline_llms["qwen3"].chat(messages, SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    chunks = list(
        ngram_server.openai_client().chat.completions.create(
            model=ngram_server.model_name, messages=messages, max_tokens=24, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    assert text == reference.text
    assert chunks[-1].choices[0].finish_reason == reference.finish_reason
    assert chunks[-1].model_extra["speculation"]["method"] == "ngram"


def test_raw_sse_framing_ends_with_done(plain_server):
    body = {
        "model": plain_server.model_name,
        "prompt": "abc",
        "max_tokens": 6,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{plain_server.api_url}/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in events)
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(line[len("data: ") :]) for line in events[:-1]]
    assert all(p["object"] == "text_completion" and p["model"] == plain_server.model_name for p in payloads)
    assert len({p["id"] for p in payloads}) == 1
    assert payloads[-1]["usage"]["completion_tokens"] == 6 and payloads[-1]["choices"] == []


def test_concurrent_requests_equal_offline(ngram_server, offline_llms):
    prompts = [f"{i} {i + 1} {i} {i + 1} {i}" for i in range(8)] + PROMPTS
    expected = [out.text for out in offline_greedy(offline_llms["qwen3"], prompts)]
    client = ngram_server.openai_client()

    def complete(prompt):
        return (
            client.completions.create(
                model=ngram_server.model_name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
            )
            .choices[0]
            .text
        )

    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        assert list(pool.map(complete, prompts)) == expected


def test_token_id_prompt_equals_text_prompt(plain_server, offline_llms):
    token_ids = offline_llms["gemma3"].tokenizer.encode(PROMPTS[0])
    client = plain_server.openai_client()
    by_ids = client.completions.create(model=plain_server.model_name, prompt=token_ids, max_tokens=8, temperature=0)
    by_text = client.completions.create(model=plain_server.model_name, prompt=PROMPTS[0], max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_completion_logprobs_match_offline(plain_server, offline_llms):
    reference = (
        offline_llms["gemma3"].generate(["abc"], SamplingParams(temperature=0, max_tokens=5, logprobs=2))[0].outputs[0]
    )
    response = plain_server.openai_client().completions.create(
        model=plain_server.model_name, prompt="abc", max_tokens=5, temperature=0, logprobs=2
    )
    logprobs = response.choices[0].logprobs
    assert logprobs.token_logprobs == pytest.approx([entry.logprob for entry in reference.logprobs])
    assert all(len(top) <= 2 for top in logprobs.top_logprobs) and len(logprobs.tokens) == 5
    assert logprobs.text_offset[0] == 0


def test_chat_logprobs_streamed_one_per_token(ngram_server):
    chunks = list(
        ngram_server.openai_client().chat.completions.create(
            model=ngram_server.model_name,
            messages=[{"role": "user", "content": "a a a a"}],
            max_tokens=10,
            temperature=0,
            stream=True,
            logprobs=True,
            top_logprobs=3,
            stream_options={"include_usage": True},
        )
    )
    entries = [
        entry
        for chunk in chunks
        if chunk.choices and chunk.choices[0].logprobs
        for entry in chunk.choices[0].logprobs.content
    ]
    assert len(entries) == chunks[-1].usage.completion_tokens
    assert all(len(entry.top_logprobs) == 3 and entry.logprob <= 0 for entry in entries)


def test_models_health_and_metrics_endpoints(ngram_server):
    models = ngram_server.openai_client().models.list()
    assert [m.id for m in models.data] == [ngram_server.model_name]
    health = httpx.get(f"{ngram_server.base_url}/health", timeout=10)
    assert health.status_code == 200
    body = health.json()
    assert body["status"] == "ok" and body["method"] == "ngram" and body["engine"]["num_slots"] == 8
    metrics = httpx.get(f"{ngram_server.base_url}/metrics", timeout=10)
    assert metrics.status_code == 200 and "quickdraft_batch_size" in metrics.text


def test_seeded_suffix_server_returns_the_plain_servers_text(plain_server, suffix_server):
    """Position-keyed sampling: the suffix drafter's growing cache changes nothing in a seeded
    answer, call after call, and it equals the plain server's."""

    def complete(server, **extra):
        return server.openai_client().completions.create(
            model=server.model_name, prompt="a b c a b c a b c a b", max_tokens=16, temperature=0.8, **extra
        )

    plain = complete(plain_server, seed=42)
    assert plain.model_dump()["seed"] == 42
    texts = {complete(suffix_server, seed=42).choices[0].text for _ in range(4)}
    assert texts == {plain.choices[0].text}


def test_unseeded_answers_return_the_seed_that_replays_them(plain_server):
    client = plain_server.openai_client()

    def complete(**extra):
        return client.completions.create(
            model=plain_server.model_name, prompt="tell me", temperature=1.0, max_tokens=12, **extra
        )

    first = complete()
    seed = first.model_dump()["seed"]
    assert isinstance(seed, int)
    assert complete(seed=seed).choices[0].text == first.choices[0].text
    assert complete().model_dump()["seed"] != seed
    stream = client.completions.create(
        model=plain_server.model_name, prompt="x", max_tokens=4, temperature=1.0, seed=5, stream=True
    )
    assert [chunk.model_dump().get("seed") for chunk in stream][-1] == 5


def test_logit_bias_and_allowed_token_ids_reach_the_sampler(suffix_server, offline_llms):
    """OpenAI's logit_bias (string token ids) and vLLM's allowed_token_ids, through the openai
    client, give offline generate's tokens under speculation."""
    prompt, allowed = "a b c a b c", list(range(3, 200, 2))

    def served_token_ids(max_tokens: int, **fields) -> list[int]:
        response = suffix_server.openai_client().completions.create(
            model=suffix_server.model_name, prompt=prompt, max_tokens=max_tokens, temperature=0, **fields
        )
        return response.choices[0].model_extra["token_ids"]

    forced = served_token_ids(6, logit_bias={"42": 100, "7": -100}, extra_body={"return_token_ids": True})
    assert forced == [42] * 6
    limited = served_token_ids(12, extra_body={"allowed_token_ids": allowed, "return_token_ids": True})
    offline = offline_llms["gemma3"].generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=12, allowed_token_ids=allowed)
    )
    assert limited == offline[0].outputs[0].token_ids
    assert all(token in allowed for token in limited)


def test_best_of_returns_offline_best_of(plain_server, offline_llms):
    params = SamplingParams(n=2, best_of=4, temperature=0.9, seed=31, max_tokens=10)
    reference = offline_llms["gemma3"].generate(["Once upon"], params)[0]
    body = {"prompt": ["Once upon", "Once upon"], "max_tokens": 10, "temperature": 0.9, "seed": 31, "n": 2}
    response = plain_server.openai_client().completions.create(
        model=plain_server.model_name, best_of=4, extra_body={"prompt_logprobs": 1}, **body
    )
    texts = [c.text for c in reference.outputs]
    assert [choice.text for choice in response.choices] == texts + texts  # prompt by prompt, the same seed
    assert [choice.index for choice in response.choices] == [0, 1, 2, 3]
    assert all(choice.logprobs is None for choice in response.choices)  # ranked on logprobs not asked for
    assert response.usage.completion_tokens == 2 * sum(len(c.token_ids) for c in reference.outputs)
    prompt_logprobs = [choice.model_extra["prompt_logprobs"] for choice in response.choices]
    assert prompt_logprobs[0] is not None and prompt_logprobs == [prompt_logprobs[0]] * 4


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"best_of": 3, "stream": True}, "cannot be streamed"),
        ({"best_of": 2, "n": 3}, "best_of must be >= n"),
        ({"best_of": 2, "temperature": 0}, "needs sampling"),
        ({"best_of": 10_000}, "best_of must be <="),
    ],
)
def test_bad_best_of_is_a_400_naming_it(plain_server, fields, message):
    body = {"model": plain_server.model_name, "prompt": "Once", "max_tokens": 2, "temperature": 1.0} | fields
    response = httpx.post(f"{plain_server.api_url}/completions", json=body, timeout=30)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "best_of" and message in error["message"], error


def test_n_completions_equal_offline_n(plain_server, offline_llms):
    params = SamplingParams(n=3, temperature=0.9, seed=9, max_tokens=10)
    reference = offline_llms["gemma3"].generate(["Once upon"], params)[0]
    response = plain_server.openai_client().completions.create(
        model=plain_server.model_name, prompt="Once upon", max_tokens=10, temperature=0.9, seed=9, n=3
    )
    assert [choice.index for choice in response.choices] == [0, 1, 2]
    assert [choice.text for choice in response.choices] == [c.text for c in reference.outputs]
    assert len({choice.text for choice in response.choices}) > 1
    assert response.usage.completion_tokens == sum(len(c.token_ids) for c in reference.outputs)
    assert response.usage.prompt_tokens == len(reference.prompt_token_ids)
    assert response.model_dump()["seed"] == 9
    assert response.model_extra["speculation"]["target_forwards"] >= 30  # every completion's forwards


def test_streamed_n_completions_arrive_by_index(ngram_server, offline_llms):
    params = SamplingParams(n=2, temperature=0.8, seed=21, max_tokens=12)
    reference = offline_llms["qwen3"].generate([PROMPTS[1]], params)[0]
    chunks = list(
        ngram_server.openai_client().completions.create(
            model=ngram_server.model_name,
            prompt=PROMPTS[1],
            max_tokens=12,
            temperature=0.8,
            seed=21,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts, finishes = ["", ""], [[], []]
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                finishes[choice.index].append(choice.finish_reason)
    assert texts == [c.text for c in reference.outputs]
    assert finishes == [[c.finish_reason] for c in reference.outputs]
    with_extras = [chunk for chunk in chunks if chunk.choices and "speculation" in chunk.model_extra]
    assert len(with_extras) == 1 and with_extras[0].model_extra["seed"] == 21  # once both have finished
    assert chunks[-1].usage.completion_tokens == sum(len(c.token_ids) for c in reference.outputs)


def test_streamed_chat_n_announces_each_choice(ngram_server, offline_llms):
    messages = [{"role": "user", "content": "Count: 1 2 3 1 2 3"}]
    params = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=10)
    reference = offline_llms["qwen3"].chat(messages, params)[0]
    chunks = list(
        ngram_server.openai_client().chat.completions.create(
            model=ngram_server.model_name, messages=messages, max_tokens=10, temperature=1.0, seed=5, n=2, stream=True
        )
    )
    assert [(c.choices[0].index, c.choices[0].delta.role) for c in chunks[:2]] == [(0, "assistant"), (1, "assistant")]
    texts = ["", ""]
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == [c.text for c in reference.outputs]
    whole = ngram_server.openai_client().chat.completions.create(
        model=ngram_server.model_name, messages=messages, max_tokens=10, temperature=1.0, seed=5, n=2
    )
    assert [choice.message.content for choice in whole.choices] == texts


def test_a_batch_of_prompts_numbers_choices_prompt_by_prompt(ngram_server, offline_llms):
    prompts = [PROMPTS[1], "Once upon", "1 2 3"]  # texts, or token-id lists (not both in one batch)
    params = SamplingParams(n=2, temperature=0.9, seed=13, max_tokens=8)
    reference = offline_llms["qwen3"].generate(prompts, params)
    expected = [completion.text for output in reference for completion in output.outputs]
    body = {
        "model": ngram_server.model_name,
        "prompt": prompts,
        "n": 2,
        "max_tokens": 8,
        "temperature": 0.9,
        "seed": 13,
    }
    response = httpx.post(f"{ngram_server.api_url}/completions", json=body, timeout=60).json()
    assert [choice["index"] for choice in response["choices"]] == list(range(6))
    assert [choice["text"] for choice in response["choices"]] == expected
    usage = response["usage"]
    assert usage["prompt_tokens"] == sum(len(output.prompt_token_ids) for output in reference)
    assert usage["completion_tokens"] == sum(len(c.token_ids) for output in reference for c in output.outputs)
    chunks = list(
        ngram_server.openai_client().completions.create(
            model=ngram_server.model_name, prompt=prompts, n=2, max_tokens=8, temperature=0.9, seed=13, stream=True
        )
    )
    texts = [""] * 6
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == expected
    by_ids = ngram_server.openai_client().completions.create(
        model=ngram_server.model_name, prompt=[[5, 6, 7], [9, 10]], max_tokens=4, temperature=0
    )
    alone = offline_llms["qwen3"].generate([[5, 6, 7], [9, 10]], SamplingParams(temperature=0, max_tokens=4))
    assert [choice.text for choice in by_ids.choices] == [output.outputs[0].text for output in alone]


def test_echo_puts_the_prompt_and_its_logprobs_first(plain_server, offline_llms):
    reference = offline_llms["gemma3"].generate(
        ["abc def"], SamplingParams(temperature=0, max_tokens=3, logprobs=1, prompt_logprobs=1)
    )[0]
    client = plain_server.openai_client()
    plain = client.completions.create(model=plain_server.model_name, prompt="abc def", max_tokens=3, temperature=0)
    echoed = client.completions.create(
        model=plain_server.model_name, prompt="abc def", max_tokens=3, temperature=0, echo=True
    )
    assert echoed.choices[0].text == "abc def" + plain.choices[0].text
    scored = client.completions.create(
        model=plain_server.model_name, prompt="abc def", max_tokens=3, temperature=0, echo=True, logprobs=1
    )
    logprobs = scored.choices[0].logprobs
    num_prompt = len(reference.prompt_token_ids)
    assert len(logprobs.tokens) == num_prompt + 3
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None  # nothing precedes it
    expected = [e.logprob for e in reference.prompt_logprobs[1:]] + [e.logprob for e in reference.outputs[0].logprobs]
    assert logprobs.token_logprobs[1:] == pytest.approx(expected)
    assert "".join(logprobs.tokens[1:]) == scored.choices[0].text  # the first token is BOS
    assert logprobs.text_offset == sorted(logprobs.text_offset)
    chunks = list(
        client.completions.create(
            model=plain_server.model_name, prompt="abc def", max_tokens=3, temperature=0, echo=True, stream=True
        )
    )
    assert chunks[0].choices[0].text == "abc def"
    assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == echoed.choices[0].text
    streamed = list(
        client.completions.create(
            model=plain_server.model_name,
            prompt=["abc def", "x y"],
            max_tokens=3,
            temperature=0,
            echo=True,
            logprobs=1,
            n=2,
            stream=True,
        )
    )
    per_choice: dict[int, list] = {}
    for chunk in streamed:
        for choice in chunk.choices:
            if choice.logprobs is not None:
                per_choice.setdefault(choice.index, []).extend(choice.logprobs.token_logprobs)
    assert sorted(per_choice) == [0, 1, 2, 3]
    assert per_choice[0][1:] == pytest.approx(expected) and per_choice[1] == per_choice[0]


def test_tokenize_and_detokenize(ngram_server, offline_llms):
    tokenizer = offline_llms["qwen3"].tokenizer
    url = ngram_server.base_url
    body = httpx.post(f"{url}/tokenize", json={"prompt": "a b c", "return_token_strs": True}).json()
    assert body["tokens"] == tokenizer.encode("a b c") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 128 and body["token_strs"] == [tokenizer.id_to_token(t) for t in body["tokens"]]
    bare = httpx.post(f"{url}/tokenize", json={"prompt": "a b c", "add_special_tokens": False}).json()
    assert bare["tokens"] == tokenizer.encode("a b c", add_special_tokens=False) and bare["token_strs"] is None
    messages = [{"role": "user", "content": "Count: 1 2 3"}]
    chat = httpx.post(f"{url}/tokenize", json={"messages": messages}).json()
    served = ngram_server.openai_client().chat.completions.create(
        model=ngram_server.model_name, messages=messages, max_tokens=1, temperature=0
    )
    assert chat["count"] == served.usage.prompt_tokens  # what the chat endpoint feeds the model
    long = httpx.post(f"{url}/tokenize", json={"prompt": "word " * 300}).json()
    assert long["count"] > long["max_model_len"]  # counted, not refused: the client sees by how much
    back = httpx.post(f"{url}/detokenize", json={"tokens": bare["tokens"]}).json()
    assert back == {"prompt": "a b c"}
    for path, wrong, param in [
        ("/tokenize", {"prompt": "x", "messages": messages}, "prompt"),
        ("/tokenize", {}, "messages"),
        ("/tokenize", {"prompt": "x", "model": "other"}, "model"),
        ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
        ("/detokenize", {"tokens": "x"}, "tokens"),
    ]:
        response = httpx.post(f"{url}{path}", json=wrong)
        assert response.status_code in (400, 404), (path, wrong, response.text)
        assert response.json()["error"]["param"] == param, (path, wrong, response.text)


def test_truncate_prompt_tokens_fits_a_long_prompt(plain_server):
    client = plain_server.openai_client()
    long = "word " * 300  # past the server's 128-token context
    kept = client.completions.create(
        model=plain_server.model_name,
        prompt=long,
        max_tokens=3,
        temperature=0,
        extra_body={"truncate_prompt_tokens": 50},
    )
    assert kept.usage.prompt_tokens == 50
    response = httpx.post(
        f"{plain_server.api_url}/completions", json={"prompt": long, "max_tokens": 3, "truncate_prompt_tokens": 0}
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "truncate_prompt_tokens"


def test_continuous_usage_stats_count_the_tokens_so_far(ngram_server):
    chunks = list(
        ngram_server.openai_client().completions.create(
            model=ngram_server.model_name,
            prompt=PROMPTS[1],
            max_tokens=12,
            temperature=0,
            n=2,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )
    final = chunks[-1].usage
    counts = [chunk.usage.completion_tokens for chunk in chunks[:-1]]
    assert all(chunk.usage.prompt_tokens == final.prompt_tokens for chunk in chunks[:-1])
    assert counts == sorted(counts) and counts[-1] == final.completion_tokens == 24


def test_cache_salt_keeps_prefix_cache_hits_within_the_salt(plain_server):
    def cached(salt: str) -> int:
        body = {
            "model": plain_server.model_name,
            "prompt": "A long prompt that fills several blocks of the prefix cache, twice over.",
            "max_tokens": 2,
            "cache_salt": salt,
        }
        usage = httpx.post(f"{plain_server.api_url}/completions", json=body, timeout=30).json()["usage"]
        return usage["prompt_tokens_details"]["cached_tokens"]

    assert cached("tenant-1") == 0
    assert cached("tenant-1") > 0
    assert cached("tenant-2") == 0


def test_vllm_s_request_fields_for_ids_tokens_and_bos(plain_server):
    url = f"{plain_server.api_url}/completions"
    body = {"model": plain_server.model_name, "prompt": "Once upon", "max_tokens": 3, "temperature": 0}
    with_bos = httpx.post(url, json=body, timeout=30).json()
    without = httpx.post(url, json=body | {"add_special_tokens": False}, timeout=30).json()
    assert with_bos["usage"]["prompt_tokens"] == without["usage"]["prompt_tokens"] + 1
    named = httpx.post(url, json=body | {"request_id": "job-17"}, timeout=30).json()
    assert named["id"] == "cmpl-job-17"
    streamed = httpx.post(url, json=body | {"request_id": "job-17", "stream": True}, timeout=30).text
    chunks = [json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: {")]
    assert chunks and {chunk["id"] for chunk in chunks} == {"cmpl-job-17"}
    as_ids = httpx.post(
        url, json=body | {"logprobs": 2, "return_tokens_as_token_ids": True, "return_token_ids": True}, timeout=30
    ).json()["choices"][0]
    assert as_ids["logprobs"]["tokens"] == [f"token_id:{token}" for token in as_ids["token_ids"]]
    assert all(key.startswith("token_id:") for top in as_ids["logprobs"]["top_logprobs"] for key in top)


def test_a_prediction_is_drafted_and_reported_in_usage(plain_server):
    url = f"{plain_server.api_url}/completions"
    letters = httpx.post(
        f"{plain_server.base_url}/tokenize",
        json={"prompt": "abcdefghijklmnopqrstuvwxyz ", "add_special_tokens": False},
        timeout=30,
    ).json()["tokens"]
    body = {
        "model": plain_server.model_name,
        "prompt": "Once upon",
        "max_tokens": 40,
        "temperature": 0,
        "ignore_eos": True,
        "allowed_token_ids": letters,  # text that tokenizes back into the same tokens
        "return_token_ids": True,
    }
    plain = httpx.post(url, json=body, timeout=30).json()
    assert "completion_tokens_details" not in plain["usage"]
    choice = plain["choices"][0]
    prediction = {"type": "content", "content": [{"type": "text", "text": choice["text"]}]}
    predicted = httpx.post(url, json=body | {"prediction": prediction}, timeout=30).json()
    assert predicted["choices"][0]["token_ids"] == choice["token_ids"]
    details = predicted["usage"]["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] >= 35 and predicted["speculation"]["target_forwards"] <= 6
    diverging = {"type": "content", "content": choice["text"][:3] + "zzzz " * 8}  # right, then wrong
    wrong = httpx.post(url, json=body | {"prediction": diverging}, timeout=30).json()
    assert wrong["choices"][0]["token_ids"] == choice["token_ids"]
    assert wrong["usage"]["completion_tokens_details"]["rejected_prediction_tokens"] > 0
    for bad in ({"type": "text", "content": "x"}, {"type": "content", "content": ""}, {"content": "x"}):
        response = httpx.post(url, json=body | {"prediction": bad}, timeout=30)
        assert response.status_code == 400 and response.json()["error"]["param"] == "prediction"
