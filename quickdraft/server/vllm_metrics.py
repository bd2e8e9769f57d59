"""The server's metrics under vLLM's names as well (`vllm:num_requests_waiting`, ...), so that
what is built on vLLM's /metrics works here unchanged: its Grafana dashboard, autoscalers
(KEDA, HPA on the waiting requests), gateways that route on queue length or KV-cache use.

A Prometheus collector reads the quickdraft_* series at scrape time and gives each vLLM family
from them: no second set of counters to keep in step. vLLM labels by `model_name` and
`engine`; the `method` and `scenario` labels are summed away (histograms too: every quickdraft
series of a family has the same buckets). Draft positions are 0-based, as vLLM counts them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase


@dataclass(frozen=True)
class Alias:
    """A vLLM family made of one quickdraft metric: `labels` are the source labels kept
    (renamed as given), the rest summed away."""

    name: str  # vLLM's name, without _total
    documentation: str
    source: str  # the ServerMetrics attribute
    labels: tuple[tuple[str, str], ...] = ()  # (source label, vLLM label)
    keep: tuple[str, ...] = ()  # only these values of the first kept label (empty: all)


ALIASES = (
    Alias("vllm:num_requests_running", "Number of requests in model execution batches.", "running"),
    Alias("vllm:num_requests_waiting", "Number of requests waiting to be processed.", "waiting"),
    Alias("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", "kv_cache_usage"),
    Alias("vllm:prompt_tokens", "Number of prefill tokens processed.", "prompt_tokens"),
    Alias("vllm:generation_tokens", "Number of generation tokens processed.", "generation_tokens"),
    Alias(
        "vllm:request_success",
        "Count of successfully processed requests.",
        "requests",
        labels=(("finish_reason", "finished_reason"),),
        keep=("stop", "length", "abort"),
    ),
    Alias("vllm:num_preemptions", "Cumulative number of preemption from the engine.", "preemptions"),
    Alias("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", "prompt_tokens"),
    Alias("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", "cached_prompt_tokens"),
    Alias("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", "ttft"),
    Alias(
        "vllm:request_time_per_output_token_seconds",
        "Histogram of time_per_output_token_seconds per request.",
        "tpot",
    ),
    Alias("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", "e2e"),
    Alias("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", "queue_time"),
    Alias("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", "drafts"),
    Alias("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", "draft_tokens"),
    Alias("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", "accepted_tokens"),
    Alias(
        "vllm:spec_decode_num_accepted_tokens_per_pos",
        "Accepted tokens per draft position.",
        "accepted_by_position",
        labels=(("position", "position"),),
    ),
    Alias(
        "vllm:lora_requests_info",
        "Running stats on lora requests.",
        "lora_requests_info",
        labels=tuple((name, name) for name in ("max_lora", "waiting_lora_adapters", "running_lora_adapters")),
    ),
)


class VllmNamedMetrics:
    """A collector giving ALIASES from a ServerMetrics' series (register it in its registry)."""

    def __init__(self, metrics: object, *, model: str):
        self._metrics = metrics
        self._base = {"model_name": model, "engine": "0"}

    def describe(self) -> list[Metric]:
        return []  # the families depend on what has been recorded: nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        for alias in ALIASES:
            source: MetricWrapperBase = getattr(self._metrics, alias.source)
            for family in source.collect():
                yield self._translated(alias, family)

    def _translated(self, alias: Alias, family: Metric) -> Metric:
        names = [vllm for _, vllm in alias.labels]
        sums: dict[tuple[str, tuple[str, ...]], float] = {}  # (sample suffix, kept label values) -> value
        for sample in family.samples:
            suffix = sample.name[len(family.name) :]
            if suffix == "_created":
                continue
            kept = tuple(sample.labels.get(source, "") for source, _ in alias.labels)
            if alias.keep and kept[0] not in alias.keep:
                continue
            if alias.source == "accepted_by_position":  # quickdraft counts depth 1.., vLLM position 0..
                kept = (str(int(kept[0]) - 1),)
            le = (sample.labels["le"],) if "le" in sample.labels else ()
            key = (suffix, kept + le)
            sums[key] = sums.get(key, 0.0) + sample.value
        label_names = [*self._base, *names]
        base_values = list(self._base.values())
        if family.type == "histogram":
            out = HistogramMetricFamily(alias.name, alias.documentation, labels=label_names)
            for kept in sorted({values[: len(names)] for (suffix, values) in sums if suffix == "_sum"}):
                buckets = sorted(
                    (
                        (values[-1], value)
                        for (suffix, values), value in sums.items()
                        if suffix == "_bucket" and values[: len(names)] == kept
                    ),
                    key=lambda bucket: float(bucket[0]),
                )
                out.add_metric(base_values + list(kept), buckets=buckets, sum_value=sums[("_sum", kept)])
            return out
        kind = CounterMetricFamily if family.type == "counter" else GaugeMetricFamily
        out = kind(alias.name, alias.documentation, labels=label_names)
        for (_, kept), value in sorted(sums.items()):
            out.add_metric(base_values + list(kept), value)
        return out
