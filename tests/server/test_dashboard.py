"""The Grafana dashboard in deploy/ is valid and only queries metrics the server exposes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx

from tests.server.traffic import scrape, send_traffic

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "quickdraft.json"
METRIC_NAME = re.compile(r"\bquickdraft_[a-z0-9_]+")


def dashboard_queries(dashboard: dict) -> list[str]:
    queries = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        if isinstance(query, dict):
            queries.append(query["query"])
    return queries


def test_dashboard_is_valid_json_with_a_scenario_variable():
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert {"datasource", "model", "scenario"} <= variables.keys()
    assert variables["scenario"]["multi"] and variables["scenario"]["includeAll"]
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)) and all(panel.get("targets") for panel in dashboard["panels"])
    titles = " ".join(panel["title"].lower() for panel in dashboard["panels"])
    for topic in (
        "acceptance rate",
        "acceptance length",
        "position",
        "throughput",
        "time to first token",
        "per output token",
        "end-to-end",
        "queue",
        "batch size",
        "drafter vs verifier",
        "plain-decoding share",
        "mean draft length",
    ):
        assert topic in titles, topic


def test_every_queried_metric_exists(metrics_server, adaptive_server):
    # Labelled series appear once observed: speculative traffic (per-position counters), an error,
    # and adaptive traffic (draft-length choices exist only on an adaptive server).
    send_traffic(metrics_server)
    send_traffic(adaptive_server)
    assert httpx.post(f"{metrics_server.api_url}/completions", json={"prompt": "x", "n": 0}).status_code == 400
    exposed = set(scrape(metrics_server)) | set(scrape(adaptive_server))
    queried = {
        name for query in dashboard_queries(json.loads(DASHBOARD.read_text())) for name in METRIC_NAME.findall(query)
    }
    assert len(queried) >= 15
    assert not queried - exposed, f"dashboard queries metrics /metrics lacks: {sorted(queried - exposed)}"
