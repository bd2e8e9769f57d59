"""`quickdraft serve`: options reach the server config; bad options are clear errors."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

import quickdraft.server
from quickdraft.cli import main
from quickdraft.server import ServerConfig
from quickdraft.server.config import API_KEY_ENV


def test_serve_help_lists_the_options(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = capsys.readouterr().out
    for option in (
        "MODEL",
        "--speculative-config",
        "--host",
        "--port",
        "--max-model-len",
        "--max-num-seqs",
        "--dtype",
        "--device",
        "--max-queue",
        "--served-model-name",
        "--max-request-bytes",
        "--request-read-timeout",
        "--api-key",
        "QUICKDRAFT_API_KEY",
    ):
        assert option in text, option


def test_serve_options_reach_the_config(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(quickdraft.server, "run_server", seen.append)
    code = main(
        [
            "serve",
            str(tmp_path),
            "--speculative-config",
            '{"method": "suffix"}',
            "--host",
            "0.0.0.0",
            "--port",
            "9001",
            "--max-model-len",
            "256",
            "--max-num-seqs",
            "3",
            "--dtype",
            "bfloat16",
            "--max-queue",
            "5",
            "--served-model-name",
            "mine",
            "--kv-cache-dtype",
            "float16",
        ]
    )
    assert code == 0
    config = seen[0]
    assert config.kv_cache_dtype == "float16" and config.engine_config().kv_cache_dtype == "float16"
    assert config.model == str(tmp_path) and config.speculative_config == {"method": "suffix"}
    assert (config.host, config.port, config.max_model_len, config.max_num_seqs) == ("0.0.0.0", 9001, 256, 3)
    assert (config.dtype, config.max_queue, config.model_name) == ("bfloat16", 5, "mine")


def test_serve_defaults_to_the_embedded_model(monkeypatch):
    seen = []
    monkeypatch.setattr(quickdraft.server, "run_server", seen.append)
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert main(["serve"]) == 0
    assert seen[0].model is None and seen[0].model_name == "gemma-3-270m"
    assert (seen[0].host, seen[0].port) == ("127.0.0.1", 8000)
    assert (seen[0].max_request_bytes, seen[0].request_read_timeout_seconds, seen[0].api_key) == (4 * 2**20, 30.0, None)


def test_serve_hardening_options_reach_the_config(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(quickdraft.server, "run_server", seen.append)
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert (
        main(
            [
                "serve",
                str(tmp_path),
                "--max-request-bytes",
                "1000",
                "--request-read-timeout",
                "2.5",
                "--api-key",
                "sk-flag",
                "--shutdown-grace",
                "4",
            ]
        )
        == 0
    )
    config = seen[-1]
    assert (config.max_request_bytes, config.request_read_timeout_seconds) == (1000, 2.5)
    assert (config.api_key, config.shutdown_grace_seconds) == ("sk-flag", 4.0)
    assert "sk-flag" not in repr(config)  # configs end up in logs
    # The key may come from the environment instead (kept out of the process list); the flag wins.
    monkeypatch.setenv(API_KEY_ENV, "sk-env")
    assert main(["serve", str(tmp_path)]) == 0 and seen[-1].api_key == "sk-env"
    assert main(["serve", str(tmp_path), "--api-key", "sk-flag"]) == 0 and seen[-1].api_key == "sk-flag"
    monkeypatch.setenv(API_KEY_ENV, "")  # set but empty: no key
    assert main(["serve", str(tmp_path)]) == 0 and seen[-1].api_key is None


def test_serve_bad_hardening_options_are_clear_errors(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert main(["serve", str(tmp_path), "--max-request-bytes", "0"]) == 2
    assert "max_request_bytes" in capsys.readouterr().err
    assert main(["serve", str(tmp_path), "--request-read-timeout", "0"]) == 2
    assert "request_read_timeout_seconds" in capsys.readouterr().err
    assert main(["serve", str(tmp_path), "--api-key", "two words"]) == 2
    assert "api_key" in capsys.readouterr().err


def test_serve_bad_options_are_clear_errors(tmp_path, capsys):
    assert main(["serve", str(tmp_path), "--speculative-config", "{nope"]) == 2
    assert "--speculative-config is not valid JSON" in capsys.readouterr().err
    assert main(["serve", str(tmp_path), "--max-queue", "0"]) == 2
    assert "max_queue" in capsys.readouterr().err
    assert main(["serve", str(tmp_path / "missing")]) == 2
    assert "not found" in capsys.readouterr().err


def test_serve_replica_options_reach_ray_serve(monkeypatch, tmp_path):
    import quickdraft.server.replicas

    seen = []
    monkeypatch.setattr(
        quickdraft.server.replicas,
        "run_replicated_server",
        lambda config, options, *, ray_address: seen.append((config, options, ray_address)),
    )
    code = main(
        ["serve", str(tmp_path), "--replicas", "3", "--routing", "round_robin", "--cpus-per-replica", "2"]
        + ["--ray-address", "auto", "--port", "9002", "--tensor-parallel-size", "2", "--lazy-logits-rows", "0"]
    )
    assert code == 0
    [(config, options, ray_address)] = seen
    assert config.model == str(tmp_path) and config.port == 9002
    assert config.engine_config().lazy_logits_rows == 0
    assert config.tensor_parallel_size == 2 and config.engine_config().tensor_parallel_size == 2
    assert (options.replicas, options.routing, options.cpus_per_replica) == (3, "round_robin", 2.0)
    assert ray_address == "auto"


def test_serve_bad_replica_options_are_clear_errors(tmp_path, capsys, monkeypatch):
    import quickdraft.server

    monkeypatch.setattr(quickdraft.server, "run_server", lambda config: pytest.fail("must not serve"))
    assert main(["serve", str(tmp_path), "--routing", "round_robin"]) == 2
    assert "--routing applies to replicas: give --replicas N with it" in capsys.readouterr().err
    assert main(["serve", str(tmp_path), "--ray-address", "auto"]) == 2
    assert "--ray-address applies to replicas" in capsys.readouterr().err
    assert main(["serve", str(tmp_path), "--replicas", "0"]) == 2
    assert "replicas must be a positive integer, got 0" in capsys.readouterr().err
    assert main(["serve", str(tmp_path), "--replicas", "2", "--cpus-per-replica", "0"]) == 2
    assert "cpus_per_replica must be a number > 0, got 0.0" in capsys.readouterr().err


def test_server_config_validates():
    with pytest.raises(ValueError, match="port"):
        ServerConfig(port=70000)
    with pytest.raises(ValueError, match="shutdown_grace_seconds"):
        ServerConfig(shutdown_grace_seconds=-1)
    for names in (" ", [], ["a", "a"], ["a", ""]):
        with pytest.raises(ValueError, match="served_model_name"):
            ServerConfig(served_model_name=names)
    with pytest.raises(ValueError, match="max_request_bytes"):
        ServerConfig(max_request_bytes=-5)
    with pytest.raises(ValueError, match="request_read_timeout_seconds"):
        ServerConfig(request_read_timeout_seconds=float("inf"))
    with pytest.raises(ValueError, match="api_key"):
        ServerConfig(api_key="")
    with pytest.raises(ValueError, match="api_key"):
        ServerConfig(api_key="k\u00e9y")
    assert ServerConfig(model="/models/foo.gguf").model_name == "foo"
    with pytest.raises(ValueError, match="tool_call_parser must be one of"):
        ServerConfig(tool_call_parser="mistral")
    with pytest.raises(ValueError, match=r"chat_template: no such file 'missing\.jinja'"):
        ServerConfig(chat_template="missing.jinja")
    with pytest.raises(ValueError, match=r"chat_template: not a valid jinja template \(line 1\)"):
        ServerConfig(chat_template="{% for m in messages %}")


def test_serve_tool_and_template_options_reach_the_config(monkeypatch, tmp_path, capsys):
    seen = []
    monkeypatch.setattr(quickdraft.server, "run_server", seen.append)
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    options = ["--tool-call-parser", "hermes", "--enable-auto-tool-choice", "--chat-template", str(template)]
    assert main(["serve", str(tmp_path), *options]) == 0
    assert seen[0].tool_call_parser == "hermes" and seen[0].chat_template_text() == template.read_text()
    assert seen[0].auto_tool_call_grammar
    inline = "{{ messages[0].content }}"
    assert main(["serve", str(tmp_path), "--chat-template", inline]) == 0
    assert seen[1].chat_template_text() == inline and seen[1].tool_call_parser is None
    assert main(["serve", str(tmp_path), "--tool-call-parser", "hermes", "--no-auto-tool-call-grammar"]) == 0
    assert not seen[2].auto_tool_call_grammar
    assert main(["serve", str(tmp_path), "--enable-auto-tool-choice"]) == 2
    assert "--enable-auto-tool-choice needs --tool-call-parser" in capsys.readouterr().err


def test_serve_vllm_style_options_reach_the_config(monkeypatch, tmp_path, capsys):
    seen = []
    monkeypatch.setattr(quickdraft.server, "run_server", seen.append)
    options = [
        "--allowed-origins",
        '["https://ui.example"]',
        "--allow-credentials",
        "--reasoning-parser",
        "qwen3",
        "--scheduling-policy",
        "priority",
        "--logprobs-mode",
        "processed_logprobs",
        "--max-logprobs",
        "64",
        "--generation-config",
        "vllm",
        "--override-generation-config",
        '{"temperature": 0.5}',
        "--trust-request-chat-template",
    ]
    assert main(["serve", str(tmp_path), *options]) == 0
    config = seen[0]
    assert (config.allowed_origins, config.allowed_methods, config.allow_credentials) == (
        ["https://ui.example"],
        ["*"],
        True,
    )
    assert (config.reasoning_parser, config.scheduling_policy, config.trust_request_chat_template) == (
        "qwen3",
        "priority",
        True,
    )
    assert config.default_sampling_fields() == {"temperature": 0.5}
    assert (config.engine_config().logprobs_mode, config.engine_config().max_logprobs) == ("processed_logprobs", 64)
    assert main(["serve", str(tmp_path), "--allowed-origins", "*"]) == 2
    assert "--allowed-origins must be a JSON list" in capsys.readouterr().err


# ---- the real process: `python -m quickdraft serve`, stopped by a signal ----------------------
class ServeProcess:
    """`python -m quickdraft serve ...` on a free port; its log collected as it comes."""

    def __init__(self, *args: str):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "quickdraft", "serve", *args, "--port", "0"],
            cwd=REPO_ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.log: list[str] = []
        self._reader = threading.Thread(target=self._read_log, daemon=True)
        self._reader.start()
        self.base_url = f"http://127.0.0.1:{self._wait_for_port()}"

    def _read_log(self) -> None:
        for line in self.process.stderr:
            self.log.append(line)

    def _wait_for_port(self) -> int:
        deadline = time.monotonic() + PROCESS_START_SECONDS
        while time.monotonic() < deadline:
            for line in list(self.log):
                if match := re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", line):
                    return int(match.group(1))
            assert self.process.poll() is None, "the server exited:\n" + "".join(self.log)
            time.sleep(0.05)
        raise AssertionError("the server did not start:\n" + "".join(self.log))

    def health(self) -> httpx.Response:
        return httpx.get(f"{self.base_url}/health", timeout=10)

    def stop(self, sig: signal.Signals) -> int:
        self.process.send_signal(sig)
        return self.wait()

    def wait(self) -> int:
        code = self.process.wait(timeout=30)
        self._reader.join(timeout=10)
        return code

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


REPO_ROOT = str(Path(__file__).resolve().parents[2])
PROCESS_START_SECONDS = 90.0
# Long enough that a request is still decoding when the grace period ends on any CPU.
ENDLESS = {"prompt": "go", "max_tokens": 16000, "ignore_eos": True, "temperature": 0}


def wait_until(condition, *, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


def assert_clean_log(log: list[str]) -> None:
    text = "".join(log)
    assert "Traceback" not in text and "CancelledError" not in text, text
    assert not [line for line in log if line.startswith("ERROR")], text


def test_sigterm_drains_ends_the_rest_with_503s_and_exits_0(tiny_checkpoints):
    serving = ServeProcess(
        str(tiny_checkpoints["llama"]),
        "--max-model-len",
        "16384",
        "--max-num-seqs",
        "2",
        "--shutdown-grace",
        "1",
        "--log-level",
        "info",
    )
    try:
        url = f"{serving.base_url}/v1/completions"
        with ThreadPoolExecutor(max_workers=1) as pool, httpx.Client(timeout=60) as client:
            whole = pool.submit(httpx.post, url, json=ENDLESS, timeout=60)
            with client.stream("POST", url, json={**ENDLESS, "stream": True}) as stream:
                lines = stream.iter_lines()
                next(line for line in lines if line)
                wait_until(lambda: serving.health().json()["in_flight"] == 2)
                serving.process.send_signal(signal.SIGTERM)
                wait_until(lambda: serving.health().status_code == 503)
                # Still listening during the grace period: a new request gets a 503 answer.
                refused = httpx.post(url, json={"prompt": "x", "max_tokens": 2}, timeout=10)
                rest = [line for line in lines if line]
            cut_off = whole.result()
        code = serving.wait()
    finally:
        serving.kill()
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
    assert rest[-1] == "data: [DONE]", rest[-3:]
    assert json.loads(rest[-2].removeprefix("data: "))["error"]["code"] == "server_shutdown"
    assert cut_off.status_code == 503 and cut_off.json()["error"]["code"] == "server_shutdown"
    assert code == 0, "".join(serving.log)
    assert_clean_log(serving.log)
    assert any("still running after the 1 s grace period" in line for line in serving.log)


def test_sigint_on_an_idle_server_exits_0(tiny_checkpoints):
    serving = ServeProcess(str(tiny_checkpoints["gemma3"]), "--max-model-len", "128", "--log-level", "info")
    try:
        assert serving.health().status_code == 200
        code = serving.stop(signal.SIGINT)
    finally:
        serving.kill()
    assert code == 0, "".join(serving.log)
    assert_clean_log(serving.log)


def test_several_served_model_names_reach_the_config(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(quickdraft.server, "run_server", seen.append)
    assert main(["serve", str(tmp_path), "--served-model-name", "first", "alias"]) == 0
    assert (seen[0].model_name, seen[0].model_names) == ("first", ["first", "alias"])
