"""--enable-dev-endpoints: /update_weights_from_disk (SGLang's; an RL trainer's new policy) and
/reset_prefix_cache (vLLM's dev mode), each run once the requests in flight have finished."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import httpx
import pytest

from quickdraft import LLM, SamplingParams
from tests.conftest import build_tiny_checkpoint
from tests.models.test_decoder import prompt
from tests.server.conftest import start_server, tiny_server_config

PROMPT = prompt(20, seed=71)


@pytest.fixture(scope="module")
def policies(tiny_checkpoints, tmp_path_factory):
    return {
        "old": tiny_checkpoints["gemma3"],
        "new": build_tiny_checkpoint("gemma3", tmp_path_factory.mktemp("new"), seed=9),
    }


@pytest.fixture(scope="module")
def server(policies):
    running = start_server(tiny_server_config(policies["old"], served_model_name="policy", enable_dev_endpoints=True))
    yield running
    running.stop()


def greedy(path, max_tokens: int) -> list[int]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return LLM(str(path), max_model_len=128).generate([PROMPT], params)[0].outputs[0].token_ids


def complete(server, max_tokens: int) -> list[int]:
    body = {
        "model": "policy",
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    reply = httpx.post(f"{server.api_url}/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["token_ids"]


def test_an_update_waits_for_the_requests_in_flight_and_serves_the_new_policy_after(server, policies):
    old_long, new_short = greedy(policies["old"], 90), greedy(policies["new"], 8)
    gate = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        # the loop held on a call of ours, so that the three below reach it in this order
        held = pool.submit(server.inspect_engine, lambda engine: gate.wait(30), timeout=60)
        running = pool.submit(complete, server, 90)
        time.sleep(0.5)
        update = pool.submit(
            httpx.post,
            f"{server.base_url}/update_weights_from_disk",
            json={"model_path": str(policies["new"])},
            timeout=120,
        )
        time.sleep(0.5)
        after = pool.submit(complete, server, 8)  # comes while the update waits: held until it is done
        time.sleep(0.5)
        gate.set()
        assert held.result() is True
        assert running.result() == old_long  # finished on the old weights: no step on a mix of both
        reply = update.result()
        assert reply.status_code == 200 and reply.json()["success"] is True, reply.text
        assert reply.json()["num_updated_tensors"] > 0
        assert after.result() == new_short  # the new weights, and not the old prompt blocks
    assert httpx.post(f"{server.base_url}/reset_prefix_cache", timeout=60).status_code == 200
    assert complete(server, 8) == new_short


def test_a_bad_checkpoint_is_a_400_and_changes_nothing(server, policies, tmp_path):
    before = complete(server, 6)
    (tmp_path / "model.safetensors").write_bytes(b"not a checkpoint")
    for path, message in [(tmp_path / "missing", "is not a directory"), (tmp_path, "cannot read")]:
        reply = httpx.post(f"{server.base_url}/update_weights_from_disk", json={"model_path": str(path)}, timeout=60)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "model_path", reply.text
        assert message in reply.json()["error"]["message"]
    assert complete(server, 6) == before


def test_without_the_flag_there_are_no_dev_endpoints(plain_server):
    for path in ("/update_weights_from_disk", "/reset_prefix_cache"):
        assert httpx.post(f"{plain_server.base_url}{path}", json={}, timeout=30).status_code == 404
