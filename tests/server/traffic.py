"""Helpers shared by the metrics and dashboard tests: scraping /metrics, speculative traffic."""

from __future__ import annotations

from collections import defaultdict

import httpx
from prometheus_client.parser import text_string_to_metric_families


def scrape(server) -> dict[str, list]:
    """Every sample of /metrics by sample name."""
    response = httpx.get(f"{server.base_url}/metrics", timeout=10)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    samples = defaultdict(list)
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[sample.name].append(sample)
    return samples


def total(samples, name, **labels) -> float:
    return sum(s.value for s in samples[name] if all(s.labels.get(k) == v for k, v in labels.items()))


def send_traffic(server) -> list[tuple[str, dict, dict]]:
    """(scenario, usage, speculation) of each response: completions, chat, streams, three scenarios."""
    client = server.openai_client()
    results = []
    for i, scenario in enumerate(["code", "chat", "code", None]):
        extra = {"metadata": {"scenario": scenario}} if scenario else {}
        response = client.completions.create(
            model=server.model_name, prompt=f"{i} x y x y x y", max_tokens=24 + i, temperature=0, extra_body=extra
        )
        results.append((scenario or "default", response.usage.model_dump(), response.model_extra["speculation"]))
    chat = client.chat.completions.create(
        model=server.model_name,
        messages=[{"role": "user", "content": "a b a b a b"}],
        max_tokens=20,
        temperature=0,
        extra_headers={"X-Scenario": "Chat"},
    )
    results.append(("chat", chat.usage.model_dump(), chat.model_extra["speculation"]))
    # The body's metadata wins over the header.
    chunks = list(
        client.completions.create(
            model=server.model_name,
            prompt="q r q r q r",
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers={"X-Scenario": "ignored"},
            extra_body={"metadata": {"scenario": "code"}},
        )
    )
    results.append(("code", chunks[-1].usage.model_dump(), chunks[-1].model_extra["speculation"]))
    return results
