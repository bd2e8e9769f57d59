"""Disconnects, many clients, engine failures, a full queue and shutdown: the loop keeps serving."""

from __future__ import annotations

import asyncio
import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.server.conftest import NGRAM_CONFIG, start_server, tiny_server_config

SETTLE_SECONDS = 15.0


def wait_until_idle(server) -> dict:
    """/health once every request has left the engine; fails if slots stay taken."""
    deadline = time.monotonic() + SETTLE_SECONDS
    while True:
        health = httpx.get(f"{server.base_url}/health", timeout=10).json()
        engine = health["engine"]
        idle = (
            health["in_flight"] == 0
            and engine["tracked_requests"] == 0
            and engine["running"] == 0
            and engine["waiting"] == 0
            and engine["free_slots"] == engine["num_slots"]
        )
        if idle:
            return health
        assert time.monotonic() < deadline, f"requests or cache slots leaked: {health}"
        time.sleep(0.05)


def engine_holds_no_request(server) -> bool:
    def check(engine):
        return (
            not engine.has_unfinished_requests()
            and not engine._requests
            and engine.cache.num_free_slots == engine.cache.num_slots
        )

    return server.inspect_engine(check)


async def streaming_client(client: httpx.AsyncClient, server, rng: random.Random, index: int) -> str:
    """One client: streams a completion, maybe hanging up after a few chunks or before any."""
    body = {
        "model": server.model_name,
        "prompt": f"{index} {index + 1} " * rng.randint(1, 4),
        "max_tokens": rng.randint(4, 16),
        "temperature": rng.choice([0, 0.8]),
        "seed": index,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    hang_up_after = rng.choice([None, None, 0, 1, 3])  # chunks read before disconnecting
    async with client.stream("POST", f"{server.api_url}/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        lines = 0
        async for line in response.aiter_lines():
            if not line:
                continue
            assert not line.startswith('data: {"error"'), line
            lines += 1
            if hang_up_after is not None and lines > hang_up_after:
                return "disconnected"
            if line == "data: [DONE]":
                return "done"
    raise AssertionError("the stream ended without [DONE]")


async def impatient_client(client: httpx.AsyncClient, server, rng: random.Random, index: int) -> str:
    """Some clients give up at a random moment: before admission, before headers, mid-stream."""
    give_up_after = rng.choice([None, None, rng.uniform(0.0, 0.05)])
    try:
        return await asyncio.wait_for(streaming_client(client, server, rng, index), timeout=give_up_after)
    except TimeoutError:
        return "cancelled"


def abort_count(server) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "quickdraft_requests_total" and sample.labels["finish_reason"] == "abort"
    )


def test_64_streaming_clients_with_random_disconnects(ngram_server, offline_llms):
    rng = random.Random(7)
    aborts_before = abort_count(ngram_server)

    async def crowd():
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            clients = [impatient_client(client, ngram_server, random.Random(rng.random()), i) for i in range(64)]
            return await asyncio.wait_for(asyncio.gather(*clients), timeout=90)

    outcomes = asyncio.run(crowd())
    assert outcomes.count("done") > 10 and outcomes.count("disconnected") > 5 and outcomes.count("cancelled") > 5
    wait_until_idle(ngram_server)
    assert abort_count(ngram_server) > aborts_before  # hang-ups reached the engine as aborts
    assert engine_holds_no_request(ngram_server)
    # Still answering, and still exact.
    from quickdraft import SamplingParams

    expected = offline_llms["qwen3"].generate(["after the storm"], SamplingParams(temperature=0, max_tokens=8))
    response = ngram_server.openai_client().completions.create(
        model=ngram_server.model_name, prompt="after the storm", max_tokens=8, temperature=0
    )
    assert response.choices[0].text == expected[0].outputs[0].text


@pytest.fixture
def small_server(tiny_checkpoints):
    """A fresh server with one cache slot and a queue of two, for failure and shutdown tests."""
    running = start_server(
        tiny_server_config(
            tiny_checkpoints["gemma3"],
            served_model_name="small",
            max_num_seqs=1,
            max_queue=2,
            speculative_config=NGRAM_CONFIG,
            shutdown_grace_seconds=10.0,
        )
    )
    yield running
    if running.thread.is_alive():
        running.stop()


def long_stream_body(max_tokens: int = 100) -> dict:
    return {
        "model": "small",
        "prompt": "go",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }


def slow_down_steps(server, *, seconds: float) -> None:
    """Make every forward take at least `seconds` (the tiny model is faster than a client's timeout)."""

    def install(engine):
        forward = engine.runner.forward

        def slow_forward(*args, **kwargs):
            time.sleep(seconds)
            return forward(*args, **kwargs)

        engine.runner.forward = slow_forward

    server.inspect_engine(install)


def test_non_streaming_disconnect_aborts_the_request(small_server):
    slow_down_steps(small_server, seconds=0.02)
    body = {"model": "small", "prompt": "go", "max_tokens": 120, "ignore_eos": True, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{small_server.api_url}/completions", json=body, timeout=0.3)
    wait_until_idle(small_server)  # well before the 120 tokens (>= 2.4 s) could have finished
    metrics = httpx.get(f"{small_server.base_url}/metrics").text
    assert (
        'quickdraft_requests_total{finish_reason="abort",method="ngram",model="small",scenario="default"} 1.0'
        in metrics
    )
    assert engine_holds_no_request(small_server)


def test_full_queue_answers_429_then_recovers(small_server):
    slow_down_steps(small_server, seconds=0.01)
    url = f"{small_server.api_url}/completions"
    with httpx.Client(timeout=30) as first, httpx.Client(timeout=30) as second:
        with (
            first.stream("POST", url, json=long_stream_body()) as running,
            second.stream("POST", url, json=long_stream_body()) as waiting,
        ):
            assert running.status_code == 200 and waiting.status_code == 200
            refused = httpx.post(url, json={"model": "small", "prompt": "x", "max_tokens": 2})
            assert refused.status_code == 429
            assert refused.json()["error"]["code"] == "queue_full"
            assert refused.headers["retry-after"] == "1"  # the openai client waits this long, then retries
    wait_until_idle(small_server)
    assert httpx.post(url, json={"model": "small", "prompt": "x", "max_tokens": 2}).status_code == 200


def test_step_failure_fails_its_requests_and_the_loop_goes_on(small_server):
    def break_next_forward(engine):
        forward = engine.runner.forward

        def failing_forward(*args, **kwargs):
            engine.runner.forward = forward  # only once
            raise RuntimeError("simulated kernel failure")

        engine.runner.forward = failing_forward

    small_server.inspect_engine(break_next_forward)
    client = small_server.openai_client()
    with pytest.raises(openai.InternalServerError) as caught:
        client.completions.create(model="small", prompt="hello", max_tokens=4)
    assert "simulated kernel failure" in caught.value.body["message"]
    # Mid-stream failures end the stream with an error event and [DONE].
    small_server.inspect_engine(break_next_forward)
    with httpx.stream("POST", f"{small_server.api_url}/completions", json=long_stream_body(4), timeout=30) as stream:
        lines = [line for line in stream.iter_lines() if line]
    assert '"error"' in lines[-2] and lines[-1] == "data: [DONE]"
    assert client.completions.create(model="small", prompt="hello", max_tokens=4).usage.completion_tokens == 4
    health = wait_until_idle(small_server)
    assert health["engine"]["failed_steps"] == 2
    assert 'quickdraft_requests_total{finish_reason="error"' in httpx.get(f"{small_server.base_url}/metrics").text


def test_graceful_shutdown_finishes_in_flight_and_refuses_new(small_server):
    slow_down_steps(small_server, seconds=0.01)
    url = f"{small_server.api_url}/completions"
    with httpx.stream("POST", url, json=long_stream_body(40), timeout=30) as stream:
        lines = stream.iter_lines()
        first = next(line for line in lines if line)
        assert first.startswith("data: {")
        small_server.server.begin_shutdown()
        refused = httpx.post(url, json={"model": "small", "prompt": "x", "max_tokens": 2})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
        assert httpx.get(f"{small_server.base_url}/health").status_code == 503
        small_server.uvicorn_server.should_exit = True  # uvicorn drains, then runs the lifespan shutdown
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in rest[-2]
    small_server.thread.join(timeout=20)
    assert not small_server.thread.is_alive()
    assert not small_server.server.engine_loop.is_alive


def test_shutdown_after_the_grace_period_ends_the_rest_with_503s(tiny_checkpoints):
    running = start_server(
        tiny_server_config(tiny_checkpoints["gemma3"], served_model_name="small", shutdown_grace_seconds=0.5)
    )
    slow_down_steps(running, seconds=0.05)  # 100 tokens take >= 5 s, far past the grace period
    url = f"{running.api_url}/completions"
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=1) as pool, httpx.Client(timeout=30) as client:
        whole = pool.submit(httpx.post, url, json={**long_stream_body(100), "stream": False}, timeout=30)
        with client.stream("POST", url, json=long_stream_body(100)) as stream:
            lines = stream.iter_lines()
            next(line for line in lines if line)
            wait_for(lambda: running.server.admission.in_flight == 2)
            running.uvicorn_server.should_exit = True
            wait_for(lambda: running.server.shutting_down)
            # During the grace period a new request is answered (503), not refused at the connection.
            refused = httpx.post(url, json={"model": "small", "prompt": "x", "max_tokens": 2}, timeout=10)
            rest = [line for line in lines if line]
        cut_off = whole.result()
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
    # The stream still ends properly: an error event saying why, then [DONE].
    assert rest[-1] == "data: [DONE]", rest[-3:]
    error = json.loads(rest[-2][len("data: ") :])["error"]
    assert error["code"] == "server_shutdown" and "grace" in error["message"]
    assert all('"error"' not in line for line in rest[:-2])
    assert cut_off.status_code == 503 and cut_off.json()["error"]["code"] == "server_shutdown"
    running.thread.join(timeout=20)
    assert not running.thread.is_alive() and not running.server.engine_loop.is_alive
    assert time.monotonic() - started < 15
    assert running.server.engine_loop.stats.tracked_requests == 0


def wait_for(condition, *, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)
