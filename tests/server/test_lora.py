"""LoRA adapters on the server, as vLLM serves them: a request names an adapter in "model"
(--lora-modules, or added while serving through /v1/load_lora_adapter), /v1/models lists them
with their parent, answers equal LLM.generate's with the same adapter, under speculation too."""

from __future__ import annotations

import httpx
import pytest
from openai import OpenAI

from quickdraft import LLM, LoRARequest, SamplingParams
from quickdraft.server.config import ServerConfig
from tests.models.test_lora import write_peft_adapter
from tests.server.conftest import start_server, tiny_server_config

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def adapter_paths(tiny_checkpoints, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("server_lora")
    base = tiny_checkpoints["gemma3"]
    return {name: str(write_peft_adapter(base, root / name, seed=seed)) for seed, name in enumerate(("sql", "poem"), 1)}


@pytest.fixture(scope="module")
def server(tiny_checkpoints, adapter_paths):
    config = tiny_server_config(
        tiny_checkpoints["gemma3"],
        served_model_name="tiny-gemma",
        speculative_config={"method": "suffix", "num_speculative_tokens": 6},
        enable_lora=True,
        max_loras=2,
        lora_modules=[f"sql={adapter_paths['sql']}"],
        allow_runtime_lora_updating=True,
    )
    running = start_server(config)
    yield running
    running.stop()


def _expected(tiny_checkpoints, path: str | None) -> list[str]:
    llm = LLM(str(tiny_checkpoints["gemma3"]), enable_lora=True, max_model_len=128)
    adapter = None if path is None else LoRARequest("x", 1, path)
    params = SamplingParams(max_tokens=12, temperature=0)
    return [llm.generate([PROMPT], params, lora_request=adapter)[0].outputs[0].text]


def test_a_request_names_its_adapter_in_model(server, tiny_checkpoints, adapter_paths):
    client = OpenAI(base_url=server.api_url, api_key="unused")
    by_model = {}
    for model in ("sql", "tiny-gemma"):
        reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
        assert reply.model == model
        by_model[model] = reply.choices[0].text
    assert [by_model["sql"]] == _expected(tiny_checkpoints, adapter_paths["sql"])
    assert [by_model["tiny-gemma"]] == _expected(tiny_checkpoints, None)
    assert by_model["sql"] != by_model["tiny-gemma"]


def test_models_lists_adapters_with_their_parent(server, adapter_paths):
    cards = {card["id"]: card for card in httpx.get(f"{server.api_url}/models", timeout=10).json()["data"]}
    assert cards["sql"]["parent"] == "tiny-gemma" and cards["sql"]["root"] == adapter_paths["sql"]
    assert httpx.get(f"{server.api_url}/models/sql", timeout=10).json()["parent"] == "tiny-gemma"
    missing = httpx.post(f"{server.api_url}/completions", json={"model": "nope", "prompt": "x"}, timeout=10)
    assert missing.status_code == 404 and "'sql'" in missing.json()["error"]["message"]


def test_adapters_are_loaded_and_unloaded_while_serving(server, tiny_checkpoints, adapter_paths):
    url = server.base_url
    loaded = httpx.post(
        f"{url}/v1/load_lora_adapter", json={"lora_name": "poem", "lora_path": adapter_paths["poem"]}, timeout=30
    )
    assert loaded.status_code == 200 and "added successfully" in loaded.text
    body = {"model": "poem", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    reply = httpx.post(f"{server.api_url}/completions", json=body, timeout=60).json()
    assert [reply["choices"][0]["text"]] == _expected(tiny_checkpoints, adapter_paths["poem"])
    again = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "poem", "lora_path": "/x"}, timeout=10)
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    bad = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": "/no/such"}, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"
    assert "is not a directory" in bad.json()["error"]["message"]
    unloaded = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "poem"}, timeout=10)
    assert unloaded.status_code == 200 and "removed successfully" in unloaded.text
    gone = httpx.post(f"{server.api_url}/completions", json=body, timeout=10)
    assert gone.status_code == 404
    twice = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "poem"}, timeout=10)
    assert twice.status_code == 404 and twice.json()["error"]["code"] == "lora_not_found"


def test_adapter_routes_need_runtime_updating(tiny_checkpoints, adapter_paths):
    running = start_server(tiny_server_config(tiny_checkpoints["gemma3"], enable_lora=True))
    try:
        response = httpx.post(
            f"{running.base_url}/v1/load_lora_adapter",
            json={"lora_name": "a", "lora_path": adapter_paths["sql"]},
            timeout=10,
        )
        assert response.status_code == 404
    finally:
        running.stop()


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(lora_modules=["a=/x"]), "need enable_lora"),
        (dict(enable_lora=True, lora_modules=["a"]), "must be name=path or a JSON object"),
        (dict(enable_lora=True, lora_modules=['{"name": "a"}']), "must be"),
        (dict(enable_lora=True, lora_modules=["a=/x", "a=/y"]), "the name 'a' is given twice"),
        (dict(enable_lora=True, lora_modules=["m=/x"], served_model_name="m"), "is also a served model name"),
    ],
)
def test_lora_settings_are_checked(settings, message):
    with pytest.raises(ValueError, match=message):
        ServerConfig(**settings)


def test_json_lora_modules_name_their_base(adapter_paths):
    config = ServerConfig(
        enable_lora=True,
        lora_modules=[f'{{"name": "a", "path": "{adapter_paths["sql"]}", "base_model_name": "b"}}', "c=/p"],
    )
    first, second = config.lora_requests()
    assert (first.lora_name, first.lora_int_id, first.base_model_name) == ("a", 1, "b")
    assert (second.lora_name, second.lora_int_id, second.lora_path) == ("c", 2, "/p")


def test_metrics_name_the_adapters_of_running_requests(server):
    """vLLM's vllm:lora_requests_info: scraped while an adapter's stream runs, it names it."""
    body = {"model": "sql", "prompt": PROMPT, "max_tokens": 100, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.api_url}/completions", json=body, timeout=60) as stream:
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith("data:"))
        during = httpx.get(f"{server.base_url}/metrics", timeout=10).text
        for _ in lines:  # to its end
            pass
    info = [line for line in during.splitlines() if line.startswith("vllm:lora_requests_info{")]
    assert len(info) == 1 and 'max_lora="2"' in info[0] and 'running_lora_adapters="sql"' in info[0], info
    after = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    assert 'running_lora_adapters=""' in after


def test_fuzzed_adapter_route_bodies_never_get_a_5xx(server, adapter_paths, tmp_path):
    import copy
    import random

    from tests.server.test_errors import FUZZ_VALUES, send_fuzzed

    (tmp_path / "not-an-adapter").mkdir()
    values = [*FUZZ_VALUES, "sql", "poem", adapter_paths["poem"], str(tmp_path / "not-an-adapter"), "", "../..", None]
    rng = random.Random(99)
    statuses = []
    with httpx.Client(timeout=30) as client:
        for _ in range(80):
            route = rng.choice(["load_lora_adapter", "unload_lora_adapter"])
            body = {"lora_name": "poem", "lora_path": adapter_paths["poem"]}
            for _ in range(rng.randint(1, 2)):
                key = rng.choice(["lora_name", "lora_path", "lora_int_id", "zzz"])
                body[key] = copy.deepcopy(rng.choice(values))
            statuses.append(send_fuzzed(client, f"{server.base_url}/v1/{route}", body))
        for model in ("sql", "poem", "", "SQL", "tiny-gemma/../sql"):
            body = {"model": model, "prompt": "x", "max_tokens": 2}
            statuses.append(send_fuzzed(client, f"{server.api_url}/completions", body))
    # both sides reached: some loads, unloads and completions went through, most were refused
    assert statuses.count(200) >= 2 and sum(400 <= s < 500 for s in statuses) > 20
    httpx.post(f"{server.base_url}/v1/unload_lora_adapter", json={"lora_name": "poem"}, timeout=10)


def test_beam_search_runs_the_adapter_and_names_it(server, tiny_checkpoints, adapter_paths):
    body = {"model": "sql", "prompt": PROMPT, "max_tokens": 6, "use_beam_search": True, "n": 2, "temperature": 0}
    reply = httpx.post(f"{server.api_url}/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["model"] == "sql"
    from quickdraft import BeamSearchParams

    llm = LLM(str(tiny_checkpoints["gemma3"]), enable_lora=True, max_model_len=128)
    adapter = LoRARequest("sql", 1, adapter_paths["sql"])
    (expected,) = llm.beam_search([PROMPT], BeamSearchParams(beam_width=2, max_tokens=6), lora_request=adapter)
    assert [c["text"] for c in reply.json()["choices"]] == [s.output_text for s in expected.sequences]
