"""Prometheus metrics of the server, in a registry owned by the server object.

Every request-level metric is labelled by `model` (the served name), `method` (the
speculative method, "none" for plain decoding) and `scenario` (the client's
`metadata.scenario` or `X-Scenario` header, sanitized, at most `max_scenarios` distinct
values). Step-level metrics (batch size) and load gauges have no scenario: one step mixes
requests of every scenario.

Latencies are measured from the moment the HTTP handler submitted the request, so they
include the wait in the engine loop's inbox, which the engine's own clock does not see.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from quickdraft.outputs import RequestMetrics
from quickdraft.server.vllm_metrics import VllmNamedMetrics

REQUEST_LABELS = ("model", "method", "scenario")
ENGINE_LABELS = ("model", "method")
DEFAULT_SCENARIO = "default"
OVERFLOW_SCENARIO = "other"
MAX_SCENARIO_CHARS = 48

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)
ACCEPTANCE_LENGTH_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0, 12.0, 16.0)
BATCH_SIZE_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256)


def sanitize_scenario(raw: object) -> str:
    """A safe label value: lower case, [a-z0-9_.-], at most MAX_SCENARIO_CHARS; "default" if empty."""
    if not isinstance(raw, str):
        return DEFAULT_SCENARIO
    cleaned = re.sub(r"[^a-z0-9_.-]+", "_", raw.strip().lower()).strip("_")[:MAX_SCENARIO_CHARS]
    return cleaned or DEFAULT_SCENARIO


class ScenarioLabels:
    """Bounds the cardinality of the `scenario` label: the first `max_values` win, then "other"."""

    def __init__(self, *, max_values: int):
        if max_values < 2:
            raise ValueError(f"max_values must be >= 2 (default and other), got {max_values!r}")
        self.max_values = max_values
        self._seen = {DEFAULT_SCENARIO, OVERFLOW_SCENARIO}
        self._lock = threading.Lock()

    def resolve(self, raw: object) -> str:
        name = sanitize_scenario(raw)
        with self._lock:
            if name in self._seen:
                return name
            if len(self._seen) < self.max_values:
                self._seen.add(name)
                return name
        return OVERFLOW_SCENARIO


@dataclass
class FinishedRequest:
    """What the metrics need of a request that left the engine (finished, aborted or failed)."""

    scenario: str
    submitted_at: float  # time.perf_counter() when the handler submitted it
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    metrics: RequestMetrics


class ServerMetrics:
    def __init__(self, *, model: str, method: str):
        self.registry = CollectorRegistry(auto_describe=True)
        self._engine_labels = {"model": model, "method": method}
        self._define_request_metrics()
        self._define_engine_metrics()
        # The same series under vLLM's names, for tools built on vLLM's /metrics
        self.registry.register(VllmNamedMetrics(self, model=model))

    # ---- definitions ------------------------------------------------------------------
    def _counter(self, name: str, documentation: str, extra_labels: tuple[str, ...] = ()) -> Counter:
        return Counter(name, documentation, REQUEST_LABELS + extra_labels, registry=self.registry)

    def _histogram(self, name: str, documentation: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(name, documentation, REQUEST_LABELS, buckets=buckets, registry=self.registry)

    def _define_request_metrics(self) -> None:
        self.requests = self._counter(
            "quickdraft_requests", "Requests that left the engine, by finish reason", ("finish_reason",)
        )
        self.request_errors = self._counter(
            "quickdraft_request_errors",
            "Requests answered with an error status (4xx before the engine, 5xx inside it)",
            ("status",),
        )
        self.prompt_tokens = self._counter("quickdraft_prompt_tokens", "Prompt tokens of finished requests")
        self.cached_prompt_tokens = self._counter(
            "quickdraft_prefix_cache_hit_tokens", "Prompt tokens whose KV the prefix cache supplied (not computed)"
        )
        self.generation_tokens = self._counter("quickdraft_generation_tokens", "Generated tokens")
        self.preemptions = self._counter(
            "quickdraft_preemptions", "Times a full KV cache took a request's blocks back (it recomputed them)"
        )
        self.target_forwards = self._counter(
            "quickdraft_target_forwards", "Target forwards that committed tokens (prefill included)"
        )
        self.drafts = self._counter("quickdraft_drafts", "Proposals verified (forwards with a draft)")
        self.draft_tokens = self._counter("quickdraft_draft_tokens", "Draft tokens proposed")
        self.accepted_tokens = self._counter("quickdraft_accepted_tokens", "Draft tokens accepted")
        self.accepted_by_position = self._counter(
            "quickdraft_accepted_tokens_by_position",
            "Drafts whose accepted path reached draft depth `position`",
            ("position",),
        )
        self.drafted_by_position = self._counter(
            "quickdraft_drafted_tokens_by_position", "Drafts that reached draft depth `position`", ("position",)
        )
        self.draft_seconds = self._counter(
            "quickdraft_draft_seconds", "Seconds of drafting phases of the steps each request was in"
        )
        self.verify_seconds = self._counter(
            "quickdraft_verify_seconds", "Seconds of verifying forwards of the steps each request was in"
        )
        # Adaptive speculation's per-step decision; plain share = length "0" / all, and the
        # companion sum gives the mean chosen length (PromQL cannot average a label's value).
        self.draft_length_choices = self._counter(
            "quickdraft_draft_length_choices",
            "Decoding steps by the draft length adaptive speculation chose (0 = plain decoding)",
            ("length",),
        )
        self.chosen_draft_length = self._counter(
            "quickdraft_chosen_draft_length", "Sum of the draft lengths adaptive speculation chose over decoding steps"
        )
        self.acceptance_length = self._histogram(
            "quickdraft_acceptance_length",
            "Tokens committed per target forward, per request",
            ACCEPTANCE_LENGTH_BUCKETS,
        )
        self.ttft = self._histogram(
            "quickdraft_time_to_first_token_seconds", "Submission to first generated token", LATENCY_BUCKETS
        )
        self.tpot = self._histogram(
            "quickdraft_time_per_output_token_seconds", "Mean seconds per output token after the first", TPOT_BUCKETS
        )
        self.e2e = self._histogram(
            "quickdraft_e2e_request_latency_seconds", "Submission to the end of the request", LATENCY_BUCKETS
        )
        self.queue_time = self._histogram(
            "quickdraft_queue_time_seconds", "Submission to the first step that scheduled the request", LATENCY_BUCKETS
        )

    def _define_engine_metrics(self) -> None:
        self.batch_size = Histogram(
            "quickdraft_batch_size",
            "Requests in each engine step",
            ENGINE_LABELS,
            buckets=BATCH_SIZE_BUCKETS,
            registry=self.registry,
        )
        self.steps_failed = Counter(
            "quickdraft_failed_steps",
            "Engine steps that raised (their requests were failed with a 500)",
            ENGINE_LABELS,
            registry=self.registry,
        )
        self.running = Gauge(
            "quickdraft_running_requests", "Requests holding a cache slot", ENGINE_LABELS, registry=self.registry
        )
        self.waiting = Gauge(
            "quickdraft_waiting_requests", "Requests waiting for a cache slot", ENGINE_LABELS, registry=self.registry
        )
        self.free_slots = Gauge(
            "quickdraft_free_cache_slots", "Free KV cache slots", ENGINE_LABELS, registry=self.registry
        )
        self.kv_cache_usage = Gauge(
            "quickdraft_kv_cache_usage",
            "Fraction of KV cache blocks held by requests (the fullest layer group; 1 = requests wait)",
            ENGINE_LABELS,
            registry=self.registry,
        )
        # vLLM's lora_requests_info: the value is when it was published, the labels say which
        # adapters the running and the waiting requests run (comma-separated); set with LoRA only.
        self.lora_requests_info = Gauge(
            "quickdraft_lora_requests_info",
            "Running stats on LoRA requests: the adapters of the running and of the waiting requests",
            [*ENGINE_LABELS, "max_lora", "running_lora_adapters", "waiting_lora_adapters"],
            registry=self.registry,
        )
        # Create the unlabelled-by-scenario series now so a fresh server already exposes them.
        engine_metrics = (self.batch_size, self.steps_failed, self.running, self.waiting, self.free_slots)
        for metric in (*engine_metrics, self.kv_cache_usage):
            metric.labels(**self._engine_labels)

    # ---- recording --------------------------------------------------------------------
    def record_request(self, finished: FinishedRequest) -> None:
        labels = {**self._engine_labels, "scenario": finished.scenario}
        m = finished.metrics
        self.requests.labels(**labels, finish_reason=finished.finish_reason).inc()
        if finished.finish_reason == "error":
            self.request_errors.labels(**labels, status="500").inc()
        self._record_tokens(labels, m)
        self._record_speculation(labels, m)
        self._record_latencies(labels, m, submitted_at=finished.submitted_at)

    def _record_tokens(self, labels: dict[str, str], m: RequestMetrics) -> None:
        self.prompt_tokens.labels(**labels).inc(m.num_prompt_tokens)
        self.cached_prompt_tokens.labels(**labels).inc(m.num_cached_tokens)
        self.generation_tokens.labels(**labels).inc(m.num_generation_tokens)
        self.preemptions.labels(**labels).inc(m.num_preemptions)
        self.target_forwards.labels(**labels).inc(m.num_target_forwards)

    def _record_speculation(self, labels: dict[str, str], m: RequestMetrics) -> None:
        self.drafts.labels(**labels).inc(m.num_drafts)
        self.draft_tokens.labels(**labels).inc(m.num_draft_tokens)
        self.accepted_tokens.labels(**labels).inc(m.num_accepted_tokens)
        self.draft_seconds.labels(**labels).inc(m.draft_seconds)
        self.verify_seconds.labels(**labels).inc(m.verify_seconds)
        for depth, count in enumerate(m.drafted_per_position, start=1):
            self.drafted_by_position.labels(**labels, position=str(depth)).inc(count)
        for depth, count in enumerate(m.accepted_per_position, start=1):
            self.accepted_by_position.labels(**labels, position=str(depth)).inc(count)
        if m.acceptance_length is not None:
            self.acceptance_length.labels(**labels).observe(m.acceptance_length)
        self._record_draft_length_choices(labels, m.draft_length_choices)

    def _record_draft_length_choices(self, labels: dict[str, str], choices: list[int]) -> None:
        """choices[k] = steps the request drafted k tokens (empty unless speculation is adaptive)."""
        for length, steps in enumerate(choices):
            if steps:
                self.draft_length_choices.labels(**labels, length=str(length)).inc(steps)
        if choices:
            self.chosen_draft_length.labels(**labels).inc(sum(length * steps for length, steps in enumerate(choices)))

    def _record_latencies(self, labels: dict[str, str], m: RequestMetrics, *, submitted_at: float) -> None:
        if m.first_scheduled_time is not None:
            self.queue_time.labels(**labels).observe(max(0.0, m.first_scheduled_time - submitted_at))
        if m.first_token_time is not None:
            self.ttft.labels(**labels).observe(max(0.0, m.first_token_time - submitted_at))
        if m.finished_time is not None:
            self.e2e.labels(**labels).observe(max(0.0, m.finished_time - submitted_at))
        if m.tpot is not None and m.num_generation_tokens >= 2:
            self.tpot.labels(**labels).observe(m.tpot)

    def record_rejection(self, *, scenario: str, status: int) -> None:
        """A request answered with an error before it reached the engine (or refused by it)."""
        self.request_errors.labels(**self._engine_labels, scenario=scenario, status=str(status)).inc()

    def record_step(self, *, batch_size: int) -> None:
        self.batch_size.labels(**self._engine_labels).observe(batch_size)

    def record_failed_step(self) -> None:
        self.steps_failed.labels(**self._engine_labels).inc()

    def set_load(self, *, running: int, waiting: int, free_slots: int, kv_cache_usage: float = 0.0) -> None:
        self.running.labels(**self._engine_labels).set(running)
        self.waiting.labels(**self._engine_labels).set(waiting)
        self.free_slots.labels(**self._engine_labels).set(free_slots)
        self.kv_cache_usage.labels(**self._engine_labels).set(kv_cache_usage)

    def set_loras(self, *, max_loras: int, running: list[str], waiting: list[str]) -> None:
        """The adapters in use now (one series: the previous label set is dropped)."""
        self.lora_requests_info.clear()
        self.lora_requests_info.labels(
            **self._engine_labels,
            max_lora=str(max_loras),
            running_lora_adapters=",".join(running),
            waiting_lora_adapters=",".join(waiting),
        ).set_to_current_time()

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric."""
        return generate_latest(self.registry)
