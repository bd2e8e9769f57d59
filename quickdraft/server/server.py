"""The server object: engine, engine loop, metrics, admission control, app; and `run_server`."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import signal
import socket
import threading
import time
from collections.abc import Callable

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import HANDLED_SIGNALS

from quickdraft.engine.compute_thread import ComputeThread
from quickdraft.engine.engine import Engine
from quickdraft.kernels import build_cpu_kernels
from quickdraft.models.heap import freeze_loaded_objects
from quickdraft.models.lora import LoRARequest
from quickdraft.server.config import ServerConfig
from quickdraft.server.engine_loop import EngineLoop, Failed
from quickdraft.server.errors import APIError, queue_full, shutting_down
from quickdraft.server.metrics import ScenarioLabels, ServerMetrics
from quickdraft.server.preprocess import Preprocessor
from quickdraft.server.responses import ResponseStore

logger = logging.getLogger("quickdraft.server")

# After the grace period the requests still running are ended; this long is left for their
# handlers to write the final 503 / error event before uvicorn closes the connections.
SHUTDOWN_FLUSH_SECONDS = 5.0
DRAIN_POLL_SECONDS = 0.05


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
                raise shutting_down()
            if self._in_flight >= self.max_in_flight:
                raise queue_full(in_flight=self._in_flight, max_in_flight=self.max_in_flight)
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

    def __init__(self, config: ServerConfig, *, engine: Engine | None = None, compute: ComputeThread | None = None):
        """engine: one already loaded, on `compute` where given (the thread that loaded it and that
        should step it); by default the server loads its own on a compute thread of its own."""
        from quickdraft.server.api import create_app  # api imports this module's types

        self.config = config
        self._own_compute = None
        if engine is None and compute is None:
            compute = self._own_compute = ComputeThread(name="quickdraft-engine")
        self.engine = engine if engine is not None else compute.run(Engine, config.engine_config())
        if config.chat_template is not None:
            self.engine.tokenizer.chat_template = config.chat_template_text()
        self.model_name = config.model_name
        self.model_names = config.model_names  # every name a request may send (the first is model_name)
        # LoRA adapters a request may name in "model" (--lora-modules, and /v1/load_lora_adapter's)
        self.lora_modules: dict[str, LoRARequest] = {}
        for adapter in config.lora_requests():
            self.engine.add_lora(adapter)  # a bad adapter stops the start, naming itself
            self.lora_modules[adapter.lora_name] = adapter
        self._lora_ids = itertools.count(len(self.lora_modules) + 1)
        # What a request leaves out, from the model's generation config (vLLM's default)
        self.default_sampling = config.default_sampling_fields()
        if self.default_sampling:
            logger.info("default sampling from the model's generation config: %s", self.default_sampling)
        speculator = self.engine.speculator
        self.method = speculator.config.method if speculator is not None else "none"
        self.adaptive = speculator is not None and speculator.config.adaptive
        self.metrics = ServerMetrics(model=self.model_name, method=self.method)
        self.scenarios = ScenarioLabels(max_values=config.max_scenarios)
        self.admission = Admission(max_in_flight=config.max_queue)
        self.engine_loop = EngineLoop(engine=self.engine, metrics=self.metrics, compute=compute)
        self.preprocessor = Preprocessor()
        self.responses = ResponseStore()  # stored Responses API responses, for previous_response_id
        self.created = int(time.time())
        self._started = False
        self.app = create_app(self)

    def next_lora_id(self) -> int:
        """An adapter id no adapter of this server had before."""
        return next(self._lora_ids)

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def eos_token_ids(self) -> list[int]:
        return self.engine.eos_token_ids

    def start(self) -> None:
        if not self._started:
            self._started = True
            self.engine_loop.start()
            # The grammar engine's vocabulary index takes seconds on a large vocabulary, and a
            # kernel's first build ~35 s on a small machine: both now, beside the loop, so that
            # the first requests do not wait for them.
            self.engine.grammars.prepare_in_background()
            if self.engine.device.type == "cpu":
                threading.Thread(target=build_cpu_kernels, name="kernel-builds", daemon=True).start()

    def begin_shutdown(self) -> None:
        """Stop accepting requests (new ones get 503); in-flight ones go on."""
        self.admission.close()

    @property
    def shutting_down(self) -> bool:
        return not self.admission.accepting

    async def drain(self, *, hurry: Callable[[], bool] = lambda: False) -> None:
        """Refuse new requests (503), give in-flight ones the grace period, end the rest.

        A request ended here gets a 503 `server_shutdown` error (a stream: a final error event,
        then [DONE]); `hurry()` (a second Ctrl+C) cuts the grace period short.
        """
        grace = self.config.shutdown_grace_seconds
        if not self.shutting_down and self.admission.in_flight > 0:
            logger.info(
                "shutdown: refusing new requests; %d in flight get up to %g s to finish",
                self.admission.in_flight,
                grace,
            )
        self.begin_shutdown()
        if await self._wait_for_in_flight(timeout=grace, hurry=hurry):
            return
        logger.warning(
            "shutdown: %d request(s) still running after the %g s grace period; ending them",
            self.admission.in_flight,
            grace,
        )
        await asyncio.to_thread(self.engine_loop.stop, timeout=10.0, failure=self.shutdown_failure())
        await self._wait_for_in_flight(timeout=SHUTDOWN_FLUSH_SECONDS, hurry=hurry)

    def shutdown_failure(self) -> Failed:
        return Failed(
            status=503,
            code="server_shutdown",
            message=f"the server shut down before the request finished (shutdown grace period "
            f"{self.config.shutdown_grace_seconds:g} s)",
        )

    def shutdown_error(self) -> APIError:
        failure = self.shutdown_failure()
        return APIError(status=failure.status, message=failure.message, code=failure.code)

    async def _wait_for_in_flight(self, *, timeout: float, hurry: Callable[[], bool]) -> bool:
        """True once no request holds an admission place; False at the timeout or when hurried."""
        deadline = time.monotonic() + timeout
        while self.admission.in_flight > 0:
            if time.monotonic() >= deadline or hurry():
                return False
            await asyncio.sleep(DRAIN_POLL_SECONDS)
        return True

    async def shutdown(self) -> None:
        """Drain (a no-op when the uvicorn server already did), stop the engine loop."""
        await self.drain()
        await asyncio.to_thread(self.engine_loop.stop, timeout=10.0, failure=self.shutdown_failure())
        self.preprocessor.close()
        self.engine.close()  # tensor-parallel followers, if any
        if self._own_compute is not None:
            self._own_compute.close()

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        self.start()
        try:
            yield
        finally:
            await self.shutdown()


class DrainingUvicornServer(uvicorn.Server):
    """uvicorn.Server that drains quickdraft before it closes anything.

    On SIGINT/SIGTERM (or should_exit) the server keeps listening while it drains: requests
    arriving get a 503 JSON answer rather than a refused connection, in-flight ones get the
    grace period, then those still running are ended with a 503 / a final error event. Only
    then does uvicorn stop accepting connections, close the idle ones and run the lifespan
    shutdown. A signal that started this drain is not re-raised at the end (uvicorn's habit):
    the process exits 0, having shut down as asked.
    """

    def __init__(self, config: uvicorn.Config, *, quickdraft_server: QuickdraftServer):
        super().__init__(config)
        self.quickdraft_server = quickdraft_server

    async def shutdown(self, sockets=None) -> None:
        await self.quickdraft_server.drain(hurry=lambda: self.force_exit)
        await super().shutdown(sockets=sockets)

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield  # signals can only be handled on the main thread
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in HANDLED_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


class HeaderDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on request headers.

    uvicorn times out idle keep-alive connections, but cancels that timer at the first byte, so
    a client that sends half a request line or half its headers and stalls (slowloris) holds
    the connection forever. Here a request's headers must be complete within
    ``header_timeout_seconds`` of the connection opening or of the previous response ending;
    otherwise the connection is closed. Bodies have their own read timeout (the app's 408).
    """

    header_timeout_seconds: float = 30.0

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)

    def _arm_header_deadline(self) -> None:
        self._disarm_header_deadline()
        if not self.transport.is_closing():
            self._header_deadline = self.loop.call_later(self.header_timeout_seconds, self._header_deadline_passed)

    def _disarm_header_deadline(self) -> None:
        deadline = getattr(self, "_header_deadline", None)
        if deadline is not None:
            deadline.cancel()
            self._header_deadline = None

    def _header_deadline_passed(self) -> None:
        self._header_deadline = None
        # IDLE: h11 has not seen a whole request line and headers since the deadline was armed.
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            logger.info(
                "closed a connection whose request headers did not arrive within %.1f s", self.header_timeout_seconds
            )
            self.transport.close()


def uvicorn_config(server: QuickdraftServer) -> uvicorn.Config:
    config = server.config
    protocol = type(
        "HeaderDeadlineProtocol",
        (HeaderDeadlineProtocol,),
        {"header_timeout_seconds": config.request_read_timeout_seconds},
    )
    # The grace period is spent in DrainingUvicornServer.shutdown; uvicorn's own wait is for
    # the last answers to be written.
    return uvicorn.Config(
        server.app,
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        lifespan="on",
        timeout_graceful_shutdown=SHUTDOWN_FLUSH_SECONDS,
        http=protocol,
    )


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
        self.thread = threading.Thread(
            target=self.uvicorn_server.run,
            kwargs={"sockets": [self._listener]},
            daemon=True,
            name=f"quickdraft-server-{port}",
        )
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
    freeze_loaded_objects()
    logger.info(
        "serving %s (speculation: %s) on http://%s:%d/v1%s",
        server.model_name,
        server.method,
        config.host,
        config.port,
        " (API key required)" if config.api_key is not None else "",
    )
    DrainingUvicornServer(uvicorn_config(server), quickdraft_server=server).run()
