"""`quickdraft serve --replicas N`: N engine replicas behind one endpoint, on Ray Serve.

Three Ray Serve pieces (Ray is an optional extra: nothing imports this module unless
replicas are asked for):

- **EngineReplica** (N replicas, each `num_cpus` of the machine, torch threads to match):
  a whole single-server `QuickdraftServer` (engine, engine loop, FastAPI app) that never
  listens on a socket. The ingress hands it each HTTP request as data and it runs its own app
  on it in-process, streaming back the response parts, so routes, validation, errors,
  streaming, API keys and metrics are exactly the single server's.
- **QuickdraftRouter**, a Ray Serve `RequestRouter`: ranks replicas with a routing policy
  (`routing.py`: cache-aware with bounded loads, or round-robin) from the hint the ingress
  attaches to each call. It lives in the ingress process (Ray builds one per handle) and
  counts requests in flight from Ray's routed/completed callbacks, and why each request went
  where it went: it registers its policy with the ingress (`PolicyRegistry`), whose
  /metrics carries `quickdraft_router_decisions_total{policy, reason}`.
- **Ingress** (one, no CPU share): Ray Serve's HTTP proxy hands it the request; it reads the
  body under the server's size and time limits, hashes the prompt text's prefixes, forwards,
  and turns a replica that died into a clear 503 (`replica_failed`; a stream gets a final
  error event and [DONE]) while the router sends later requests to the replicas alive and
  Ray Serve restarts the dead one. `/health` and `/metrics` ask every replica (the router
  avoids replicas already asked) and merge: metrics carry a `replica` label.

Python entry point for an existing Ray cluster: `serve.run(build_app(config, options))`, or
`serve run quickdraft.server.replicas:app_builder model=... replicas=2` (see app_builder).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import ray
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import RayServeException
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from quickdraft.server.config import ServerConfig
from quickdraft.server.errors import APIError
from quickdraft.server.routing import (
    DEFAULT_CHUNK_CHARS,
    ROUTING_POLICIES,
    PolicyRegistry,
    RouteHint,
    RoutingPolicy,
    make_policy,
    prefix_hashes,
    routing_text,
)

logger = logging.getLogger("quickdraft.server")

APP_NAME = "quickdraft"
REPLICA_HEADER = "x-quickdraft-replica"  # which replica answered (routing is observable)
CLIENT_CLOSED_REQUEST = 499
# Bodies past this are parsed for their routing text on a worker thread, not the event loop.
PARSE_OFF_LOOP_BYTES = 64 * 1024
ROUTE_TIMEOUT_SECONDS = 60.0  # a request no replica takes within this gets a 503 (no_replica)
REPLICA_QUERY_TIMEOUT_SECONDS = 10.0  # a replica that does not answer /health or /metrics in time is left out
# The development endpoints every replica must run (--enable-dev-endpoints), and how long each may
# take: a weight update waits for the replica's requests in flight.
FAN_OUT_POSTS = ("/update_weights_from_disk", "/reset_prefix_cache")
FAN_OUT_TIMEOUT_SECONDS = 600.0
START_TIMEOUT_SECONDS = 600.0
PROXY_PORT_ATTEMPTS = 5  # free ports tried for Serve's proxy (one of Ray's processes may take a probed one)


@dataclass(kw_only=True)
class ReplicaOptions:
    """How many replicas, their CPU share, and how requests are routed to them."""

    replicas: int = 2
    cpus_per_replica: float | None = None  # None: the machine's cores / replicas, at least 1
    routing: str = "cache_aware"  # or "round_robin"
    load_factor: float = 1.25  # a replica takes at most this times the mean load (cache_aware)
    chunk_chars: int = DEFAULT_CHUNK_CHARS  # prompt text per routing hash
    max_prefixes: int = 65536  # prefix hashes the router remembers (LRU)
    health_check_period_seconds: float = 5.0  # Ray Serve restarts a replica whose check fails
    # The ingress passes the `replica_failed` 503 to the client; Ray Serve replaces the replica.

    def __post_init__(self) -> None:
        if not isinstance(self.replicas, int) or isinstance(self.replicas, bool) or self.replicas < 1:
            raise ValueError(f"replicas must be a positive integer, got {self.replicas!r}")
        cpus = self.cpus_per_replica
        if cpus is not None and (isinstance(cpus, bool) or not isinstance(cpus, (int, float)) or cpus <= 0):
            raise ValueError(f"cpus_per_replica must be a number > 0, got {cpus!r}")
        if self.routing not in ROUTING_POLICIES:
            raise ValueError(f"routing must be one of {list(ROUTING_POLICIES)}, got {self.routing!r}")
        make_policy(self.routing, load_factor=self.load_factor, max_prefixes=self.max_prefixes)  # validates them
        prefix_hashes("", chunk_chars=self.chunk_chars)  # validates chunk_chars
        period = self.health_check_period_seconds
        if isinstance(period, bool) or not isinstance(period, (int, float)) or period <= 0:
            raise ValueError(f"health_check_period_seconds must be a number > 0, got {period!r}")

    def replica_cpus(self) -> float:
        if self.cpus_per_replica is not None:
            return float(self.cpus_per_replica)
        return float(max(1, (os.cpu_count() or 1) // self.replicas))


# ---- what travels between ingress and replica ------------------------------------------------
@dataclass
class HttpCall:
    """One HTTP request, as data: what the ingress read, what the replica's app runs on."""

    method: str
    path: str
    query_string: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)  # raw, lower-case names
    body: bytes = b""


@dataclass
class ResponseStart:
    status: int
    headers: list[tuple[bytes, bytes]]
    replica: str


@dataclass
class WholeResponse:
    """A response collected in the replica (for /health and /metrics of each replica)."""

    status: int
    body: bytes
    replica: str
    pid: int


# ---- the replica ---------------------------------------------------------------------------
class EngineReplica:
    """A whole quickdraft server without a socket: it runs its app on the calls it is handed."""

    def __init__(self, config: ServerConfig, *, threads: int):
        import torch

        from quickdraft.models.heap import freeze_loaded_objects
        from quickdraft.server.server import QuickdraftServer

        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        _pin_to_cpu_share(local_rank=context.rank.local_rank if context.rank is not None else 0, threads=threads)
        torch.set_num_threads(threads)
        self.server = QuickdraftServer(config)
        freeze_loaded_objects()  # the replica's process lives as long as its engine
        self.server.start()
        self.app = self.server.app

    async def handle_http(
        self, call: HttpCall, route: RouteHint | None = None
    ) -> AsyncIterator[str | ResponseStart | bytes]:
        """This replica's id (at once: a failure later is then attributed), a ResponseStart, body chunks.

        `route` is for the router only.
        """
        yield self.replica_id
        async for part in self._run_app(call):
            yield part

    async def request_once(self, call: HttpCall, route: RouteHint | None = None) -> WholeResponse:
        status, chunks = 500, []
        async for part in self._run_app(call):
            if isinstance(part, ResponseStart):
                status = part.status
            else:
                chunks.append(part)
        return WholeResponse(status=status, body=b"".join(chunks), replica=self.replica_id, pid=os.getpid())

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine loop stopped is restarted."""
        if not self.server.engine_loop.is_alive:
            raise RuntimeError(f"replica {self.replica_id}: the engine loop stopped")

    def __del__(self) -> None:  # Ray Serve calls it when it stops the replica
        server = getattr(self, "server", None)
        if server is not None:
            server.engine_loop.stop(timeout=10.0, failure=server.shutdown_failure())

    async def _run_app(self, call: HttpCall) -> AsyncIterator[ResponseStart | bytes]:
        """Run the app on call in this event loop; when the caller goes away, the app sees a disconnect."""
        parts: asyncio.Queue = asyncio.Queue()
        disconnected = asyncio.Event()
        body_sent = False

        async def receive() -> dict[str, Any]:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": call.body, "more_body": False}
            await disconnected.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            await parts.put(message)

        app_done = object()
        task = asyncio.ensure_future(self.app(_asgi_scope(call), receive, send))
        task.add_done_callback(lambda _: parts.put_nowait(app_done))
        try:
            while True:
                message = await parts.get()
                if message is app_done:
                    task.result()  # the app's own exception, if it raised one
                    return
                if message["type"] == "http.response.start":
                    yield ResponseStart(
                        status=message["status"], headers=message.get("headers", []), replica=self.replica_id
                    )
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield message["body"]
                    if not message.get("more_body", False):
                        return
        finally:
            disconnected.set()
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task


def _asgi_scope(call: HttpCall) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "method": call.method,
        "scheme": "http",
        "path": call.path,
        "raw_path": call.path.encode(),
        "query_string": call.query_string,
        "root_path": "",
        "headers": call.headers,
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 0),
        "state": {},
    }


def _pin_to_cpu_share(*, local_rank: int, threads: int) -> None:
    """Pin this replica's process to its own `threads` cores (replica k: cores k*threads ...).

    Ray only counts CPUs; without pinning two replicas' torch thread pools may share cores and
    slow each other down. Every thread of the process is pinned (an affinity is per thread on
    Linux, and Ray runs this constructor on a thread of its own); threads started later inherit
    it. Left unpinned when the machine has fewer allowed cores than needed.
    """
    if not hasattr(os, "sched_setaffinity"):
        return
    allowed = sorted(os.sched_getaffinity(0))
    first = local_rank * threads
    if first + threads > len(allowed):
        return
    share = allowed[first : first + threads]
    tasks = Path("/proc/self/task")
    thread_ids = [int(entry.name) for entry in tasks.iterdir()] if tasks.is_dir() else [0]
    for thread_id in thread_ids:
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(thread_id, share)


# ---- the router ----------------------------------------------------------------------------
class QuickdraftRouter(RequestRouter):
    """Ray Serve request router that ranks replicas with a quickdraft routing policy."""

    def initialize_state(self, **kwargs: Any) -> None:
        self.policy = make_policy(
            kwargs.get("policy", "cache_aware"),
            load_factor=kwargs.get("load_factor", 1.25),
            max_prefixes=kwargs.get("max_prefixes", 65536),
        )
        self._reported = _report_to_ingress(self.policy)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        by_id = {replica.replica_id.unique_id: replica for replica in candidate_replicas}
        if not by_id:
            return []
        ranked = self.policy.rank(list(by_id), _hint_of(pending_request))
        return [[by_id[replica]] for replica in ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        if not self._reported:
            self._reported = _report_to_ingress(self.policy)
        # The candidates `choose_replicas` ranked among: Ray passes it all its replicas.
        replicas = [known.unique_id for known in self.curr_replicas]
        self.policy.on_routed(replica_id.unique_id, _hint_of(pending_request), replicas)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.policy.on_completed(replica_id.unique_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.policy.forget(replica_id.unique_id)


def _report_to_ingress(policy: RoutingPolicy) -> bool:
    """Register policy's decision counts with this process's ingress, for its /metrics; False: not yet.

    Ray Serve builds the router itself, in the process that holds the deployment handle (the
    ingress replica), and hands it nothing of the handle's owner. Ray's replica context, which
    Ray keeps per process anyway, names the ingress instance, so this needs no registry of
    its own at module level.

    The registry's class comes from routing.py on purpose: Ray ships the router's module (this
    one) to the ingress pickled *by value* (RequestRouterConfig), so the router sees copies of
    the classes defined here, which an isinstance check against the ingress's would reject;
    routing.py travels by reference, one class for both.
    """
    try:
        context = serve.get_replica_context()
    except RayServeException:
        return True  # a handle outside any replica (a driver's): there is no /metrics to report to
    owner = context.servable_object
    if owner is None:
        return False  # the ingress is still being constructed: try again on a later request
    policies = getattr(owner, "router_policies", None)
    if isinstance(policies, PolicyRegistry):
        policies.register(policy)
    return True


def _hint_of(pending_request: PendingRequest | None) -> RouteHint | None:
    if pending_request is None:
        return None
    hint = pending_request.kwargs.get("route")
    return hint if isinstance(hint, RouteHint) else None


class RouterDecisions:
    """Prometheus collector: the requests the registered policies routed, by policy and reason.

    One sample per (policy name, reason), however many routers registered (PolicyRegistry adds
    up policies of the same name).
    """

    NAME = "quickdraft_router_decisions"
    DOCUMENTATION = (
        "Requests routed, by routing policy and the reason their replica was chosen "
        "(prefix_hit, prefix_spill, new_prefix, no_prefix, round_robin, fan_out)"
    )

    def __init__(self, policies: PolicyRegistry):
        self.policies = policies

    def collect(self) -> list[Metric]:
        family = CounterMetricFamily(self.NAME, self.DOCUMENTATION, labels=["policy", "reason"])
        for (policy, reason), count in self.policies.decisions().items():
            family.add_metric([policy, reason], count)
        return [family]


# ---- the ingress ---------------------------------------------------------------------------
class Ingress:
    """Reads each request, attaches its routing hint, forwards it; merges /health and /metrics."""

    def __init__(self, engine_replicas, *, config: ServerConfig, options: ReplicaOptions):
        self.replicas = engine_replicas
        self.config = config
        self.options = options
        self.registry = CollectorRegistry(auto_describe=True)
        self.routed = Counter(
            "quickdraft_ingress_requests",
            "Requests the ingress forwarded, by replica",
            ["replica"],
            registry=self.registry,
        )
        self.replica_failures = Counter(
            "quickdraft_ingress_replica_failures",
            "Requests that failed because their replica died or could not be reached",
            ["replica"],
            registry=self.registry,
        )
        # The router of self.replicas (built by Ray in this process) registers its policy here.
        self.router_policies = PolicyRegistry()
        self.registry.register(RouterDecisions(self.router_policies))

    async def __call__(self, request: Request) -> Response:
        path, method = request.url.path, request.method
        if (path == "/health" and method in ("GET", "HEAD")) or (path == "/ping" and method in ("GET", "HEAD", "POST")):
            return await self._health()
        if path == "/metrics" and method == "GET":
            return await self._metrics()
        if path in FAN_OUT_POSTS and method == "POST" and self.config.enable_dev_endpoints:
            return await self._fan_out(request)
        return await self._forward(request)

    # -- forwarding
    async def _read_call(self, request: Request) -> HttpCall | Response:
        """The request as an HttpCall, or the response when its body cannot be read."""
        from quickdraft.server.api import read_body

        try:
            raw = await read_body(
                request, max_bytes=self.config.max_request_bytes, idle_timeout=self.config.request_read_timeout_seconds
            )
        except APIError as err:
            return JSONResponse(err.body(), status_code=err.status, headers=err.headers)
        if raw is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return HttpCall(
            method=request.method,
            path=request.url.path,
            query_string=request.url.query.encode(),
            headers=list(request.headers.raw),
            body=raw,
        )

    async def _fan_out(self, request: Request) -> Response:
        """A development endpoint run by every replica: 200 when each answered 200, else the
        first failure's status (503 when a replica did not answer), with every replica's answer."""
        call = await self._read_call(request)
        if isinstance(call, Response):
            return call
        answers = await self.each_replica(call, timeout=FAN_OUT_TIMEOUT_SECONDS)
        replicas = []
        for answer in sorted(answers, key=lambda answer: answer.replica):
            try:
                body = json.loads(answer.body) if answer.body else {}
            except ValueError:
                body = {"message": answer.body.decode("utf-8", "replace")}
            replicas.append({"replica": answer.replica, "status": answer.status, "answer": body})
        failed = [answer.status for answer in answers if answer.status != 200]
        missing = self.options.replicas - len(answers)
        status = failed[0] if failed else (503 if missing > 0 else 200)
        body = {"success": status == 200, "replicas_expected": self.options.replicas, "replicas": replicas}
        return JSONResponse(body, status_code=status)

    async def _forward(self, request: Request) -> Response:
        call = await self._read_call(request)
        if isinstance(call, Response):
            return call
        hint = await self._hint(call)
        stream = self.replicas.options(stream=True).handle_http.remote(call, route=hint)
        replica = None
        try:
            # No replica alive (all restarting) must not hang the client: Ray would wait for one.
            replica = await asyncio.wait_for(stream.__anext__(), ROUTE_TIMEOUT_SECONDS)
            self.routed.labels(replica=replica).inc()
            start = await stream.__anext__()
        except TimeoutError:
            stream.cancel()
            return self._no_replica()
        except Exception as err:  # the replica died before answering, or none could be reached
            stream.cancel()
            return self._replica_failed(err, replica=replica)
        headers = {
            name.decode("latin-1"): value.decode("latin-1")
            for name, value in start.headers
            if name.lower() != b"content-length"
        }
        headers[REPLICA_HEADER] = start.replica
        if headers.get("content-type", "").startswith("text/event-stream"):
            return StreamingResponse(
                self._relay_events(stream, replica=start.replica), status_code=start.status, headers=headers
            )
        try:
            body = b"".join([chunk async for chunk in stream])
        except Exception as err:
            return self._replica_failed(err, replica=start.replica)
        return Response(body, status_code=start.status, headers=headers)

    async def _hint(self, call: HttpCall) -> RouteHint:
        if call.method != "POST" or not call.body:
            return RouteHint()
        if len(call.body) > PARSE_OFF_LOOP_BYTES:
            return await asyncio.to_thread(self._hint_of_body, call)
        return self._hint_of_body(call)

    def _hint_of_body(self, call: HttpCall) -> RouteHint:
        try:
            body = json.loads(call.body)
        except ValueError:
            return RouteHint()  # the replica answers the 400
        return RouteHint(
            prefix_hashes=prefix_hashes(routing_text(call.path, body), chunk_chars=self.options.chunk_chars)
        )

    async def _relay_events(self, stream, *, replica: str) -> AsyncIterator[bytes]:
        try:
            async for chunk in stream:
                yield chunk
        except Exception as err:  # the replica died mid-stream: say so in the stream's own terms
            failure = self._failure(err, replica=replica)
            yield f"data: {json.dumps(failure.body(), separators=(',', ':'))}\n\n".encode()
            yield b"data: [DONE]\n\n"
        finally:
            stream.cancel()  # a no-op when the stream ended; stops the replica when the client left

    def _failure(self, err: Exception, *, replica: str | None = None) -> APIError:
        self.replica_failures.labels(replica=replica or "unknown").inc()
        where = f"replica {replica}" if replica is not None else "the replica chosen for it"
        logger.warning("request failed: %s: %s: %s", where, type(err).__name__, err)
        return APIError(
            status=503,
            code="replica_failed",
            message=f"{where} failed while serving the request ({type(err).__name__}); the other replicas "
            "keep serving and Ray Serve restarts the failed one: retry the request",
            headers={"Retry-After": "1"},
        )

    def _no_replica(self) -> JSONResponse:
        failure = APIError(
            status=503,
            code="no_replica",
            message=f"no replica could take the request within {ROUTE_TIMEOUT_SECONDS:g} s (all failed or "
            "still starting); retry later",
            headers={"Retry-After": "5"},
        )
        return JSONResponse(failure.body(), status_code=failure.status, headers=failure.headers)

    def _replica_failed(self, err: Exception, *, replica: str | None = None) -> JSONResponse:
        failure = self._failure(err, replica=replica)
        return JSONResponse(failure.body(), status_code=failure.status, headers=failure.headers)

    # -- every replica
    async def each_replica(
        self, call: HttpCall, *, timeout: float = REPLICA_QUERY_TIMEOUT_SECONDS
    ) -> list[WholeResponse]:
        """call's answer from each replica reachable now (the router avoids those already asked)."""
        answers: dict[str, WholeResponse] = {}
        for _ in range(2 * self.options.replicas + 2):
            hint = RouteHint(avoid=frozenset(answers), fan_out=True)
            try:
                answer = await asyncio.wait_for(self.replicas.request_once.remote(call, route=hint), timeout)
            except Exception as err:  # a replica dying or restarting: the others still answer
                logger.info("a replica did not answer %s %s: %s: %s", call.method, call.path, type(err).__name__, err)
                continue
            if answer.replica in answers:
                break  # every reachable replica has answered
            answers[answer.replica] = answer
        return list(answers.values())

    async def _health(self) -> JSONResponse:
        answers = await self.each_replica(HttpCall(method="GET", path="/health"))
        replicas = []
        for answer in answers:
            try:
                body = json.loads(answer.body)
            except ValueError:
                body = {"status": "bad_health_answer"}
            replicas.append({"replica": answer.replica, "pid": answer.pid, **body})
        healthy = sum(1 for replica in replicas if replica.get("status") == "ok")
        body = {
            "status": "ok" if healthy else "unavailable",
            "model": self.config.model_name,
            "replicas_expected": self.options.replicas,
            "replicas_healthy": healthy,
            "routing": self.options.routing,
            "replicas": sorted(replicas, key=lambda replica: replica["replica"]),
        }
        return JSONResponse(body, status_code=200 if healthy else 503)

    async def _metrics(self) -> Response:
        answers = await self.each_replica(HttpCall(method="GET", path="/metrics"))
        merged = merge_expositions({answer.replica: answer.body.decode() for answer in answers if answer.status == 200})
        own = generate_latest(self.registry)
        return Response(merged + own, media_type=CONTENT_TYPE_LATEST)


def merge_expositions(by_replica: dict[str, str]) -> bytes:
    """Several Prometheus expositions as one: every sample gets a `replica` label, each family appears once."""
    families: dict[str, Metric] = {}
    for replica, text in sorted(by_replica.items()):
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            for sample in family.samples:
                merged.add_sample(sample.name, {**sample.labels, "replica": replica}, sample.value, sample.timestamp)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_FixedCollector(list(families.values())))
    return generate_latest(registry)


class _FixedCollector:
    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


# ---- building and running ------------------------------------------------------------------
def build_app(config: ServerConfig, options: ReplicaOptions) -> serve.Application:
    """The Ray Serve application: `serve.run(build_app(config, options), route_prefix="/")`."""
    cpus = options.replica_cpus()
    # Ray Serve's own cap on a replica's requests sits above the server's queue, so the replica
    # answers 429 (queue full) itself, as the single server does.
    per_replica = config.max_queue + 8
    engine = serve.deployment(
        EngineReplica,
        name="QuickdraftEngine",
        num_replicas=options.replicas,
        ray_actor_options={"num_cpus": cpus},
        max_ongoing_requests=per_replica,
        health_check_period_s=options.health_check_period_seconds,
        # On shutdown a replica's requests get the grace period of the single server's --shutdown-grace.
        graceful_shutdown_timeout_s=config.shutdown_grace_seconds,
        request_router_config=RequestRouterConfig(
            request_router_class=QuickdraftRouter,
            request_router_kwargs={
                "policy": options.routing,
                "load_factor": options.load_factor,
                "max_prefixes": options.max_prefixes,
            },
        ),
    )
    ingress = serve.deployment(
        Ingress,
        name="QuickdraftIngress",
        num_replicas=1,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=options.replicas * per_replica + 16,
    )
    threads = max(1, int(cpus))
    return ingress.bind(engine.bind(config, threads=threads), config=config, options=options)


def app_builder(args: dict[str, Any]) -> serve.Application:
    """For `serve run quickdraft.server.replicas:app_builder model=DIR replicas=2 routing=cache_aware`.

    Keys are ServerConfig fields and ReplicaOptions fields; values arrive as strings from the
    command line (numbers and JSON objects are parsed).
    """
    server_fields = {f.name for f in fields(ServerConfig)}
    option_fields = {f.name for f in fields(ReplicaOptions)}
    unknown = sorted(set(args) - server_fields - option_fields)
    if unknown:
        raise ValueError(f"unknown arguments {unknown}; known: {sorted(server_fields | option_fields)}")
    parsed = {name: _parse_argument(value) for name, value in args.items()}
    return build_app(
        ServerConfig(**{name: value for name, value in parsed.items() if name in server_fields}),
        ReplicaOptions(**{name: value for name, value in parsed.items() if name in option_fields}),
    )


def _parse_argument(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


class ReplicatedServer:
    """The replicated endpoint on a local Ray instance (or an existing cluster): tests, benchmarks, the CLI.

    Starts Ray when it is not running (stopping it again in `stop()`), starts Serve's HTTP
    proxy on config.host:config.port (0: a free port) and deploys the app; `base_url` once
    every replica is up.
    """

    def __init__(
        self, config: ServerConfig, options: ReplicaOptions, *, ray_address: str | None = None, quiet: bool = False
    ):
        self.config = config
        self.options = options
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(
                address=ray_address, include_dashboard=False, log_to_driver=not quiet, logging_level=logging.WARNING
            )
        try:
            port = start_proxy(config.host, config.port, start=serve.start, stop=serve.shutdown)
        except Exception:
            self.stop()
            raise
        self.base_url = f"http://{config.host}:{port}"
        try:
            serve.run(build_app(config, options), name=APP_NAME, route_prefix="/", blocking=False)
            self._wait_until_ready()
        except RuntimeError as err:
            self.stop()
            raise RuntimeError(
                f"the replicas did not start: {err} (the replica's own error is in Ray's logs: "
                "/tmp/ray/session_latest/logs/serve/controller_*.log)"
            ) from err

    def _wait_until_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while True:
            status = serve.status().applications.get(APP_NAME)
            state = str(status.status) if status is not None else "NOT_STARTED"
            if state.endswith("RUNNING"):
                return
            if state.endswith("DEPLOY_FAILED") or time.monotonic() > deadline:
                message = status.message if status is not None else ""
                raise RuntimeError(f"{state}: {message}")
            time.sleep(0.2)

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            serve.shutdown()
        if self._owns_ray:
            ray.shutdown()


def start_proxy(host: str, port: int, *, start: Callable[..., object], stop: Callable[[], object]) -> int:
    """Serve's HTTP proxy (`start`: serve.start) on `port`, or for port 0 on a free one; returns
    the port.  A port probed free can be taken by one of Ray's own processes before the proxy
    binds it ("Failed to bind to address"): then Serve is stopped (`stop`) and a fresh port
    tried, up to PROXY_PORT_ATTEMPTS times.  A port the user chose is tried once."""
    attempts = 1 if port else PROXY_PORT_ATTEMPTS
    for attempt in range(attempts):
        chosen = port or _free_port(host)
        try:
            start(http_options={"host": host, "port": chosen})
            return chosen
        except Exception as err:
            if attempt + 1 == attempts or "Failed to bind" not in str(err):
                raise
            logger.warning("port %d was taken before Serve's proxy bound it; trying another", chosen)
            with contextlib.suppress(Exception):
                stop()
    raise AssertionError("unreachable")


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def run_replicated_server(config: ServerConfig, options: ReplicaOptions, *, ray_address: str | None = None) -> None:
    """`quickdraft serve --replicas N`: serve until SIGINT/SIGTERM, then shut Serve (and Ray) down."""
    logging.basicConfig(level=config.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    server = ReplicatedServer(config, options, ray_address=ray_address)
    logger.info(
        "serving %s on %s/v1 with %d replicas (%g CPUs each, routing: %s)%s",
        config.model_name,
        server.base_url,
        options.replicas,
        options.replica_cpus(),
        options.routing,
        " (API key required)" if config.api_key is not None else "",
    )
    try:
        stop.wait()
    finally:
        logger.info("shutting down the replicas")
        server.stop()
