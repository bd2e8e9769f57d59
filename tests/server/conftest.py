"""A real quickdraft server (uvicorn on 127.0.0.1, a free port) in a background thread."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from quickdraft.server import QuickdraftServer, ServerConfig
from quickdraft.server.server import ServerThread

STARTUP_TIMEOUT_SECONDS = 20.0
NGRAM_CONFIG = {"method": "ngram", "num_speculative_tokens": 3}
ADAPTIVE_NGRAM_CONFIG = {**NGRAM_CONFIG, "adaptive": True}


@dataclass
class RunningServer:
    server: QuickdraftServer
    serving: ServerThread

    @property
    def base_url(self) -> str:  # http://127.0.0.1:PORT
        return self.serving.base_url

    @property
    def uvicorn_server(self):
        return self.serving.uvicorn_server

    @property
    def thread(self):
        return self.serving.thread

    @property
    def api_url(self) -> str:
        return f"{self.base_url}/v1"

    @property
    def model_name(self) -> str:
        return self.server.model_name

    def openai_client(self, **kwargs):
        from openai import OpenAI

        return OpenAI(base_url=self.api_url, api_key="unused", max_retries=0, timeout=60.0, **kwargs)

    def async_openai_client(self, **kwargs):
        from openai import AsyncOpenAI

        return AsyncOpenAI(base_url=self.api_url, api_key="unused", max_retries=0, timeout=60.0, **kwargs)

    def inspect_engine(self, function, *, timeout: float = 10.0):
        """Run function(engine) on the engine loop thread (the only thread that may touch it)."""
        return self.server.engine_loop.call(function).result(timeout=timeout)

    def stop(self) -> None:
        self.serving.stop()


def start_server(config: ServerConfig) -> RunningServer:
    server = QuickdraftServer(config)
    return RunningServer(server=server, serving=ServerThread(server, start_timeout=STARTUP_TIMEOUT_SECONDS))


def tiny_server_config(path, **overrides) -> ServerConfig:
    settings = dict(model=str(path), max_model_len=128, max_num_seqs=4, log_level="warning", shutdown_grace_seconds=5.0)
    settings.update(overrides)
    return ServerConfig(**settings)


@pytest.fixture(scope="session")
def plain_server(tiny_checkpoints):
    """gemma3 (no chat template), plain decoding."""
    running = start_server(tiny_server_config(tiny_checkpoints["gemma3"], served_model_name="tiny-gemma"))
    yield running
    running.stop()


@pytest.fixture(scope="session")
def ngram_server(tiny_checkpoints):
    """qwen3 (has a chat template), n-gram speculation, room for many clients."""
    running = start_server(
        tiny_server_config(
            tiny_checkpoints["qwen3"],
            served_model_name="tiny-qwen",
            speculative_config=NGRAM_CONFIG,
            max_num_seqs=8,
            max_queue=256,
        )
    )
    yield running
    running.stop()


@pytest.fixture(scope="session")
def suffix_server(tiny_checkpoints):
    """gemma3, suffix-tree speculation."""
    running = start_server(
        tiny_server_config(
            tiny_checkpoints["gemma3"], served_model_name="tiny-gemma-suffix", speculative_config={"method": "suffix"}
        )
    )
    yield running
    running.stop()


@pytest.fixture(scope="session")
def offline_llms(tiny_checkpoints):
    """Offline plain-decoding LLMs on the same checkpoints and context, for reference outputs."""
    from quickdraft import LLM

    return {arch: LLM(str(tiny_checkpoints[arch]), max_model_len=128) for arch in ("gemma3", "qwen3")}


@pytest.fixture(scope="module")
def metrics_server(tiny_checkpoints):
    """A fresh server, so its counters hold only this module's requests."""
    running = start_server(
        tiny_server_config(
            tiny_checkpoints["qwen3"], served_model_name="metered", speculative_config=NGRAM_CONFIG, max_scenarios=4
        )
    )
    yield running
    running.stop()


@pytest.fixture(scope="module")
def adaptive_server(tiny_checkpoints):
    """A fresh server with adaptive n-gram speculation (draft length chosen per step)."""
    running = start_server(
        tiny_server_config(
            tiny_checkpoints["qwen3"], served_model_name="adaptive", speculative_config=ADAPTIVE_NGRAM_CONFIG
        )
    )
    yield running
    running.stop()
