"""`quickdraft serve --replicas`: two engine replicas on a local Ray instance (1 CPU each).

One Ray instance and one deployment for the module (starting them takes ~20 s). The model is
the tiny random qwen3 (it has a chat template) with the suffix drafter, so replicas speculate as a real server would.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from quickdraft.llm import LLM
from quickdraft.sampling_params import SamplingParams
from quickdraft.server import ServerConfig
from quickdraft.server.replicas import (
    PROXY_PORT_ATTEMPTS,
    REPLICA_HEADER,
    ReplicaOptions,
    ReplicatedServer,
    RouterDecisions,
    merge_expositions,
    start_proxy,
)
from quickdraft.server.routing import CacheAwarePolicy, PolicyRegistry, RoundRobinPolicy, RouteHint
from tests.conftest import build_tiny_checkpoint

MAX_REQUEST_BYTES = 64 * 1024
SPECULATIVE_CONFIG = {"method": "suffix"}
RESTART_TIMEOUT_SECONDS = 90.0
CHUNK_CHARS = 32  # short prompts (the tiny model's context is 512) still have routing hashes

# One Ray instance at a time on this machine: with pytest-xdist, every Ray test runs on one worker.
pytestmark = pytest.mark.xdist_group("ray")


@pytest.fixture(scope="module")
def replicated(tiny_checkpoints):
    config = ServerConfig(
        model=str(tiny_checkpoints["qwen3"]),
        served_model_name="tiny-qwen3",
        port=0,
        max_model_len=512,
        max_num_seqs=4,
        log_level="warning",
        shutdown_grace_seconds=5.0,
        max_request_bytes=MAX_REQUEST_BYTES,
        speculative_config=SPECULATIVE_CONFIG,
        enable_dev_endpoints=True,
    )
    server = ReplicatedServer(
        config,
        ReplicaOptions(replicas=2, cpus_per_replica=1, chunk_chars=CHUNK_CHARS, health_check_period_seconds=2.0),
        quiet=True,
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(replicated):
    with httpx.Client(base_url=replicated.base_url, timeout=120.0) as http:
        yield http


def healthy_replicas(client) -> dict[str, int]:
    """replica id -> pid of the replicas answering now."""
    body = client.get("/health").json()
    return {replica["replica"]: replica["pid"] for replica in body["replicas"] if replica["status"] == "ok"}


def routed_counts(client) -> dict[str, float]:
    """replica -> requests the ingress has forwarded to it so far (quickdraft_ingress_requests)."""
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        if family.name == "quickdraft_ingress_requests":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    counts[sample.labels["replica"]] = counts.get(sample.labels["replica"], 0.0) + sample.value
    return counts


def complete(client, prompt: str, **fields) -> httpx.Response:
    response = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0, **fields})
    assert response.status_code == 200, response.text
    return response


def router_decisions(client) -> dict[str, float]:
    """reason -> requests the ingress's router routed, from /metrics (whose own queries count as fan_out)."""
    text = client.get("/metrics").text
    assert text.count("# HELP quickdraft_router_decisions_total ") == 1
    assert text.count("# TYPE quickdraft_router_decisions_total counter") == 1
    families = text_string_to_metric_families(text)
    [family] = [family for family in families if family.name == "quickdraft_router_decisions"]
    assert {sample.labels["policy"] for sample in family.samples} == {"cache_aware"}
    return {sample.labels["reason"]: sample.value for sample in family.samples}


def test_health_lists_every_replica(client):
    response = client.get("/health")
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "ok" and body["replicas_expected"] == 2 and body["replicas_healthy"] == 2
    assert body["routing"] == "cache_aware"
    pids = [replica["pid"] for replica in body["replicas"]]
    assert len(set(pids)) == 2 and os.getpid() not in pids
    assert all(replica["method"] == "suffix" for replica in body["replicas"])
    assert client.head("/health").status_code == 200
    for method in ("GET", "POST"):  # SageMaker's check: every replica's health, as /health
        ping = client.request(method, "/ping").json()
        assert ping["replicas_expected"] == 2 and [r["pid"] for r in ping["replicas"]] == pids


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning needs a core per replica")
def test_each_replica_is_pinned_to_its_own_core(client):
    cores = [os.sched_getaffinity(pid) for pid in healthy_replicas(client).values()]
    assert [len(share) for share in cores] == [1, 1] and cores[0] != cores[1]


def test_greedy_output_equals_the_engine_alone(client, tiny_checkpoints):
    prompts = ["The quick brown fox", "Once upon a time " * 10]
    llm = LLM(model=str(tiny_checkpoints["qwen3"]), max_model_len=512)
    expected = [out.outputs[0].token_ids for out in llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0))]
    served = [
        complete(client, prompt, max_tokens=12, return_token_ids=True).json()["choices"][0]["token_ids"]
        for prompt in prompts
    ]
    assert served == expected


def test_a_conversation_stays_on_its_replica_and_hits_its_prefix_cache(client):
    before = router_decisions(client)
    for n in range(4):
        first_prompt = f"Conversation {n}: " + "tell me about the sea and the ships on it. " * 8
        first = complete(client, first_prompt)
        replica = first.headers[REPLICA_HEADER]
        answer = first.json()["choices"][0]["text"]
        second = complete(client, first_prompt + answer + " And what about rivers?")
        assert second.headers[REPLICA_HEADER] == replica
        # Most of the first turn's prompt came from the replica's prefix cache.
        cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= first.json()["usage"]["prompt_tokens"] - 16
    # The router says so too: each first turn a new prefix, each second turn a hit on it.
    after = router_decisions(client)
    counted = {reason: after[reason] - before[reason] for reason in after}
    fan_out = counted.pop("fan_out")  # the second /metrics call's queries to each replica
    assert counted == {"prefix_hit": 4, "prefix_spill": 0, "new_prefix": 4, "no_prefix": 0}
    assert 2 <= fan_out <= 2 * 2 + 2  # each replica once, then one more that finds them all asked


def test_chat_turns_stay_together_too(client):
    messages = [{"role": "user", "content": "hello " * 60}]
    first = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 4, "temperature": 0})
    assert first.status_code == 200, first.text
    messages += [
        {"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
        {"role": "user", "content": "and again"},
    ]
    second = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 4, "temperature": 0})
    assert second.status_code == 200, second.text
    assert second.headers[REPLICA_HEADER] == first.headers[REPLICA_HEADER]


def test_streaming_equals_the_whole_answer(replicated, client):
    from openai import OpenAI

    openai = OpenAI(base_url=f"{replicated.base_url}/v1", api_key="unused", max_retries=0, timeout=60.0)
    whole = openai.completions.create(model="tiny-qwen3", prompt="Streams and rivers", max_tokens=16, temperature=0)
    chunks = list(
        openai.completions.create(
            model="tiny-qwen3", prompt="Streams and rivers", max_tokens=16, temperature=0, stream=True
        )
    )
    assert "".join(chunk.choices[0].text for chunk in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "code"),
    [
        ("POST", "/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "invalid_value"),
        ("POST", "/v1/completions", {"prompt": "x", "model": "other"}, 404, "model_not_found"),
        ("POST", "/v1/completions", "{not json", 400, None),
        ("GET", "/v1/nowhere", None, 404, "not_found"),
        ("POST", "/v1/completions", {"prompt": "x" * (MAX_REQUEST_BYTES + 1)}, 413, "request_too_large"),
    ],
)
def test_errors_are_the_single_servers(client, method, path, body, status, code):
    content = body if isinstance(body, str) else (json.dumps(body) if body is not None else None)
    response = client.request(method, path, content=content, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"]
    if code is not None:
        assert error["code"] == code


def test_models_route_answers_through_a_replica(client):
    response = client.get("/v1/models")
    assert response.status_code == 200
    assert response.json()["data"][0]["id"] == "tiny-qwen3"
    assert response.headers[REPLICA_HEADER] in healthy_replicas(client)


def test_metrics_are_labelled_by_replica(client):
    for n in range(3):
        complete(client, f"metrics {n} " * 20)
    text = client.get("/metrics").text
    help_lines = [line for line in text.splitlines() if line.startswith("# HELP ")]
    assert len(help_lines) == len(set(help_lines))  # each family once, however many replicas
    replicas = {
        line.split('replica="')[1].split('"')[0]
        for line in text.splitlines()
        if line.startswith("quickdraft_requests_total{")
    }
    assert replicas and replicas <= set(healthy_replicas(client))
    assert "quickdraft_ingress_requests_total{replica=" in text


def test_merge_expositions_labels_and_dedups():
    text = '# HELP x_total X\n# TYPE x_total counter\nx_total{a="1"} 2.0\n'
    merged = merge_expositions({"r1": text, "r2": text}).decode()
    assert merged.count("# HELP x_total") == 1
    assert 'x_total{a="1",replica="r1"} 2.0' in merged and 'x_total{a="1",replica="r2"} 2.0' in merged


def test_router_decisions_family():
    policies = PolicyRegistry()
    collector = RouterDecisions(policies)
    assert collector.collect()[0].samples == []  # no router yet: the family, no samples
    cache_aware, baseline = CacheAwarePolicy(), RoundRobinPolicy()
    policies.register(cache_aware)
    policies.register(baseline)
    cache_aware.on_routed("a", RouteHint(prefix_hashes=(1, 2)))
    cache_aware.on_routed("a", RouteHint(prefix_hashes=(1, 2, 3)))
    baseline.on_routed("c", None)
    registry = CollectorRegistry(auto_describe=True)
    registry.register(collector)
    text = generate_latest(registry).decode()
    assert text.count("# HELP quickdraft_router_decisions_total ") == 1
    assert text.count("# TYPE quickdraft_router_decisions_total counter") == 1
    samples = [line for line in text.splitlines() if not line.startswith("#")]
    assert samples == [
        'quickdraft_router_decisions_total{policy="cache_aware",reason="prefix_hit"} 1.0',
        'quickdraft_router_decisions_total{policy="cache_aware",reason="prefix_spill"} 0.0',
        'quickdraft_router_decisions_total{policy="cache_aware",reason="new_prefix"} 1.0',
        'quickdraft_router_decisions_total{policy="cache_aware",reason="no_prefix"} 0.0',
        'quickdraft_router_decisions_total{policy="cache_aware",reason="fan_out"} 0.0',
        'quickdraft_router_decisions_total{policy="round_robin",reason="round_robin"} 1.0',
        'quickdraft_router_decisions_total{policy="round_robin",reason="fan_out"} 0.0',
    ]


def test_a_killed_replica_fails_its_requests_clearly_and_the_endpoint_keeps_serving(replicated, client):
    before = healthy_replicas(client)
    prompt = "A long story about a lighthouse keeper. "
    long_request = {"prompt": prompt, "max_tokens": 440, "ignore_eos": True, "temperature": 1.0, "seed": 1}
    whole_answer: dict = {}

    def send_whole() -> None:  # the same prefix: mostly the same replica, while the stream runs
        with httpx.Client(base_url=replicated.base_url, timeout=120.0) as other:
            response = other.post("/v1/completions", json=long_request)
            whole_answer.update(status=response.status_code, body=response.json())

    # 12 completions, 4 at a time: the stream outlasts the wait below (one of 440 tokens could finish first)
    with client.stream("POST", "/v1/completions", json={**long_request, "stream": True, "n": 12}) as stream:
        assert stream.status_code == 200
        victim = stream.headers[REPLICA_HEADER]
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[len("data: ") :])["choices"]
        forwarded = routed_counts(client)
        sender = threading.Thread(target=send_whole)
        sender.start()
        # killed only once the whole request is on a replica (a fixed pause lost that race on a busy
        # machine); routing with bounded loads may place it on either, and each outcome is checked
        deadline = time.monotonic() + 60.0
        while sum(routed_counts(client).values()) < sum(forwarded.values()) + 1:
            assert time.monotonic() < deadline, "the second request was never forwarded"
            time.sleep(0.2)  # each /metrics call reaches the replicas too: their load, seen by the router
        whole_on_victim = routed_counts(client).get(victim, 0.0) > forwarded.get(victim, 0.0)
        os.kill(before[victim], signal.SIGKILL)
        events = [line[len("data: ") :] for line in lines if line.startswith("data: ")]
    sender.join(timeout=60.0)
    assert not sender.is_alive()
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "replica_failed" and victim in error["message"]
    if whole_on_victim:
        assert whole_answer["status"] == 503 and whole_answer["body"]["error"]["code"] == "replica_failed"
        assert victim in whole_answer["body"]["error"]["message"]
    else:  # the survivor answered it whole
        assert whole_answer["status"] == 200 and whole_answer["body"]["choices"][0]["text"]
    # The endpoint keeps serving (the other replica), at once.
    survivor = complete(client, "after the failure")
    assert survivor.headers[REPLICA_HEADER] != victim
    # Ray Serve restarts the dead replica.
    deadline = time.monotonic() + RESTART_TIMEOUT_SECONDS
    while True:
        now = healthy_replicas(client)
        if len(now) == 2 and victim not in now:
            break
        assert time.monotonic() < deadline, f"no replacement replica after {RESTART_TIMEOUT_SECONDS} s: {now}"
        time.sleep(1.0)
    text = client.get("/metrics").text
    failures = 2.0 if whole_on_victim else 1.0
    assert f'quickdraft_ingress_replica_failures_total{{replica="{victim}"}} {failures}' in text


def test_app_builder_for_serve_run_parses_its_arguments():
    from ray import serve

    from quickdraft.server.replicas import app_builder

    app = app_builder({"replicas": "3", "routing": "round_robin", "max_model_len": "256", "served_model_name": "m"})
    assert isinstance(app, serve.Application)
    with pytest.raises(ValueError, match=r"unknown arguments \['replica'\]"):
        app_builder({"replica": "3"})
    with pytest.raises(ValueError, match="routing must be one of"):
        app_builder({"routing": "random"})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"replicas": 0}, "replicas must be a positive integer"),
        ({"cpus_per_replica": -1}, "cpus_per_replica must be a number > 0"),
        ({"load_factor": 0.9}, "load_factor must be a number >= 1"),
        ({"chunk_chars": 0}, "chunk_chars must be a positive integer"),
        ({"health_check_period_seconds": 0}, "health_check_period_seconds must be a number > 0"),
    ],
)
def test_replica_options_validate(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ReplicaOptions(**kwargs)


def test_a_proxy_port_taken_before_serve_binds_it_is_retried_on_another():
    """Port 0: a probed free port that one of Ray's processes takes first ("Failed to bind") is
    given up and another tried (Serve stopped in between); a user's port and other errors are
    not retried."""
    calls, stops = [], []

    def start(*, http_options):
        calls.append(http_options["port"])
        if len(calls) < 3:
            raise RuntimeError(f"Failed to bind to address '127.0.0.1:{http_options['port']}'.")

    port = start_proxy("127.0.0.1", 0, start=start, stop=lambda: stops.append(True))
    assert len(calls) == 3 and port == calls[-1] and all(0 < p < 65536 for p in calls) and len(stops) == 2
    calls.clear()
    with pytest.raises(RuntimeError, match="Failed to bind"):
        start_proxy("127.0.0.1", 8123, start=start, stop=lambda: None)
    assert calls == [8123]

    def always_taken(*, http_options):
        calls.append(http_options["port"])
        raise RuntimeError("Failed to bind to address")

    calls.clear()
    with pytest.raises(RuntimeError, match="Failed to bind"):
        start_proxy("127.0.0.1", 0, start=always_taken, stop=lambda: None)
    assert len(calls) == PROXY_PORT_ATTEMPTS

    def broken(*, http_options):
        calls.append(http_options["port"])
        raise ValueError("something else")

    calls.clear()
    with pytest.raises(ValueError, match="something else"):
        start_proxy("127.0.0.1", 0, start=broken, stop=lambda: None)
    assert len(calls) == 1


def test_a_weight_update_reaches_every_replica(replicated, client, tiny_checkpoints, tmp_path_factory):
    """The ingress hands /update_weights_from_disk and /reset_prefix_cache to each replica and
    answers with all their answers; every replica then serves the new weights."""
    deadline = time.monotonic() + RESTART_TIMEOUT_SECONDS  # a replica killed by an earlier test restarts
    while len(healthy_replicas(client)) < 2:
        assert time.monotonic() < deadline, "fewer than 2 healthy replicas"
        time.sleep(1.0)
    new = build_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("new_qwen3"), seed=5)
    prompts = [f"Question {i}: what comes after {i}?" for i in range(6)]
    llm = LLM(model=str(new), max_model_len=512)
    expected = [out.outputs[0].token_ids for out in llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0))]
    try:
        reply = client.post("/update_weights_from_disk", json={"model_path": str(new)})
        assert reply.status_code == 200, reply.text
        answers = reply.json()["replicas"]
        assert len({answer["replica"] for answer in answers}) == 2
        assert all(answer["answer"]["success"] and answer["answer"]["num_updated_tensors"] > 0 for answer in answers)
        served = [
            complete(client, prompt, return_token_ids=True).json()["choices"][0]["token_ids"] for prompt in prompts
        ]
        assert served == expected
    finally:
        restored = client.post("/update_weights_from_disk", json={"model_path": str(tiny_checkpoints["qwen3"])})
        assert restored.status_code == 200, restored.text
    assert client.post("/reset_prefix_cache").status_code == 200
