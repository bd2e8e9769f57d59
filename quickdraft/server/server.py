"""The server object: engine, engine loop, metrics, admission control, app; and `run_server`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time

import uvicorn

from quickdraft.engine.engine import Engine
from quickdraft.server.config import ServerConfig
from quickdraft.server.engine_loop import EngineLoop
from quickdraft.server.errors import APIError
from quickdraft.server.metrics import ScenarioLabels, ServerMetrics

logger = logging.getLogger("quickdraft.server")


class Admission:
    """Bounds the requests waiting + running; refuses all while the server shuts down."""

    def __init__(self, *, max_in_flight: int):
        self.max_in_flight = max_in_flight
        self._in_flight = 0
        self._accepting = True
        self._lock = threading.Lock()

    def enter(self) -> None:
        with self._lock:
            if not self._accepting:
                raise APIError(status=503, message="the server is shutting down", code="shutting_down")
            if self._in_flight >= self.max_in_flight:
                raise APIError(status=429, code="queue_full",
                               message=f"too many requests in flight ({self._in_flight}, --max-queue "
                                       f"{self.max_in_flight}); retry later")
            self._in_flight += 1

    def leave(self) -> None:
        with self._lock:
            self._in_flight -= 1

    def close(self) -> None:
        with self._lock:
            self._accepting = False

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def accepting(self) -> bool:
        return self._accepting


class QuickdraftServer:
    """Loads the engine at construction; the engine loop runs while the app's lifespan does."""

    def __init__(self, config: ServerConfig, *, engine: Engine | None = None):
        from quickdraft.server.api import create_app  # api imports this module's types

        self.config = config
        self.engine = engine if engine is not None else Engine(config.engine_config())
        self.model_name = config.model_name
        speculator = self.engine.speculator
        self.method = speculator.config.method if speculator is not None else "none"
        self.adaptive = speculator is not None and speculator.config.adaptive
        self.metrics = ServerMetrics(model=self.model_name, method=self.method)
        self.scenarios = ScenarioLabels(max_values=config.max_scenarios)
        self.admission = Admission(max_in_flight=config.max_queue)
        self.engine_loop = EngineLoop(engine=self.engine, metrics=self.metrics)
        self.created = int(time.time())
        self._started = False
        self.app = create_app(self)

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def start(self) -> None:
        if not self._started:
            self._started = True
            self.engine_loop.start()

    def begin_shutdown(self) -> None:
        """Stop accepting requests (new ones get 503); in-flight ones go on."""
        self.admission.close()

    async def shutdown(self) -> None:
        """Let in-flight requests finish within the grace period, then cancel the rest."""
        self.begin_shutdown()
        deadline = time.monotonic() + self.config.shutdown_grace_seconds
        while self.admission.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.to_thread(self.engine_loop.stop, timeout=10.0)

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        self.start()
        try:
            yield
        finally:
            await self.shutdown()


class DrainingUvicornServer(uvicorn.Server):
    """uvicorn.Server that tells quickdraft to refuse new requests as soon as shutdown begins.

    uvicorn then stops accepting connections, waits up to timeout_graceful_shutdown for the
    open ones, cancels the rest and runs the lifespan shutdown (which stops the engine loop).
    """

    def __init__(self, config: uvicorn.Config, *, quickdraft_server: QuickdraftServer):
        super().__init__(config)
        self.quickdraft_server = quickdraft_server

    async def shutdown(self, sockets=None) -> None:
        self.quickdraft_server.begin_shutdown()
        await super().shutdown(sockets=sockets)


def uvicorn_config(server: QuickdraftServer) -> uvicorn.Config:
    config = server.config
    return uvicorn.Config(server.app, host=config.host, port=config.port, log_level=config.log_level,
                          lifespan="on", timeout_graceful_shutdown=config.shutdown_grace_seconds)


class ServerThread:
    """`server` served by uvicorn in a background thread on a free loopback port (benchmarks,
    tests): `base_url` once started; `stop()` shuts it down gracefully and waits for it."""

    def __init__(self, server: QuickdraftServer, *, start_timeout: float = 60.0):
        self.server = server
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))  # the OS picks a free port; uvicorn serves on this socket
        port = self._listener.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{port}"
        self.uvicorn_server = DrainingUvicornServer(uvicorn_config(server), quickdraft_server=server)
        self.thread = threading.Thread(target=self.uvicorn_server.run, kwargs={"sockets": [self._listener]},
                                       daemon=True, name=f"quickdraft-server-{port}")
        self.thread.start()
        deadline = time.monotonic() + start_timeout
        while not self.uvicorn_server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the server failed to start (see the log above)")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not start within {start_timeout:.0f} s")
            time.sleep(0.02)

    def stop(self) -> None:
        self.uvicorn_server.should_exit = True
        self.thread.join(timeout=self.server.config.shutdown_grace_seconds + 30.0)
        self._listener.close()
        if self.thread.is_alive():
            raise RuntimeError("the server thread did not stop")


def run_server(config: ServerConfig) -> None:
    """Load the model, serve until SIGINT/SIGTERM, shut down gracefully."""
    logging.basicConfig(level=config.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    server = QuickdraftServer(config)
    logger.info("serving %s (speculation: %s) on http://%s:%d/v1", server.model_name, server.method,
                config.host, config.port)
    DrainingUvicornServer(uvicorn_config(server), quickdraft_server=server).run()
