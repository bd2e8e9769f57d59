"""/metrics parses, adds up to the responses' figures, and labels by model, method and scenario."""

from __future__ import annotations

import httpx
import pytest

from quickdraft.server.metrics import ScenarioLabels, sanitize_scenario
from tests.server.traffic import scrape, send_traffic, total


def test_counters_add_up_to_the_responses(metrics_server):
    results = send_traffic(metrics_server)
    samples = scrape(metrics_server)
    labels = {"model": "metered", "method": "ngram"}
    assert "ignored" not in {s.labels.get("scenario") for s in samples["quickdraft_requests_total"]}
    for scenario in {scenario for scenario, _, _ in results}:
        mine = [(usage, spec) for s, usage, spec in results if s == scenario]
        where = {**labels, "scenario": scenario}
        assert total(samples, "quickdraft_requests_total", **where) == len(mine)
        assert total(samples, "quickdraft_prompt_tokens_total", **where) == sum(u["prompt_tokens"] for u, _ in mine)
        assert total(samples, "quickdraft_prefix_cache_hit_tokens_total", **where) == sum(
            u["prompt_tokens_details"]["cached_tokens"] for u, _ in mine
        )
        assert total(samples, "quickdraft_generation_tokens_total", **where) == sum(
            u["completion_tokens"] for u, _ in mine
        )
        for metric, field in [
            ("drafts", "drafts"),
            ("draft_tokens", "draft_tokens"),
            ("accepted_tokens", "accepted_tokens"),
            ("target_forwards", "target_forwards"),
        ]:
            assert total(samples, f"quickdraft_{metric}_total", **where) == sum(s[field] for _, s in mine), metric
        for metric, field in [
            ("accepted_tokens_by_position", "accepted_per_position"),
            ("drafted_tokens_by_position", "drafted_per_position"),
        ]:
            depth = max((len(s[field]) for _, s in mine), default=0)
            for position in range(1, depth + 1):
                expected = sum(s[field][position - 1] for _, s in mine if len(s[field]) >= position)
                assert total(samples, f"quickdraft_{metric}_total", **where, position=str(position)) == expected
        for histogram in (
            "quickdraft_time_to_first_token_seconds",
            "quickdraft_e2e_request_latency_seconds",
            "quickdraft_queue_time_seconds",
            "quickdraft_acceptance_length",
        ):
            assert total(samples, f"{histogram}_count", **where) == len(mine), histogram
        assert total(samples, "quickdraft_draft_seconds_total", **where) == pytest.approx(
            sum(s["draft_seconds"] for _, s in mine)
        )
    assert sum(s["draft_tokens"] for _, _, s in results) > 0  # the figures above were not all zero
    assert total(samples, "quickdraft_batch_size_count", **labels) > 0
    assert total(samples, "quickdraft_free_cache_slots", **labels) == 4
    assert samples["quickdraft_kv_cache_usage"] and samples["quickdraft_preemptions_total"]  # exposed
    assert total(samples, "quickdraft_kv_cache_usage", **labels) == 0  # idle: no request holds a block
    assert total(samples, "quickdraft_preemptions_total", **labels) == 0  # the default pool never runs out


def test_errors_are_counted_by_status_and_scenario(metrics_server):
    before = total(scrape(metrics_server), "quickdraft_request_errors_total", status="400", scenario="code")
    httpx.post(f"{metrics_server.api_url}/completions", json={"prompt": "x", "n": 0, "metadata": {"scenario": "code"}})
    after = total(scrape(metrics_server), "quickdraft_request_errors_total", status="400", scenario="code")
    assert after == before + 1


def test_scenario_cardinality_is_bounded(metrics_server):
    client = metrics_server.openai_client()
    for i in range(6):  # max_scenarios=4: default, other, and two more (code and chat came first)
        client.completions.create(
            model="metered", prompt="z", max_tokens=2, extra_body={"metadata": {"scenario": f"flood-{i}"}}
        )
    scenarios = {s.labels["scenario"] for s in scrape(metrics_server)["quickdraft_requests_total"]}
    assert len(scenarios) <= 4 and "other" in scenarios


def test_scenario_sanitizing():
    assert sanitize_scenario("  Code Review! ") == "code_review"
    assert sanitize_scenario("") == "default" and sanitize_scenario(None) == "default"
    assert sanitize_scenario("x" * 500) == "x" * 48
    assert sanitize_scenario('a"b\n{c}') == "a_b_c"
    labels = ScenarioLabels(max_values=3)
    assert [labels.resolve(v) for v in ["a", "b", "a", None]] == ["a", "other", "a", "default"]
    with pytest.raises(ValueError, match="max_values"):
        ScenarioLabels(max_values=1)


def test_vllm_s_names_carry_the_same_figures(metrics_server):
    send_traffic(metrics_server)
    samples = scrape(metrics_server)
    vllm = {"model_name": "metered", "engine": "0"}
    pairs = [
        ("vllm:prompt_tokens_total", "quickdraft_prompt_tokens_total", {}),
        ("vllm:generation_tokens_total", "quickdraft_generation_tokens_total", {}),
        ("vllm:prefix_cache_hits_total", "quickdraft_prefix_cache_hit_tokens_total", {}),
        ("vllm:num_preemptions_total", "quickdraft_preemptions_total", {}),
        ("vllm:spec_decode_num_drafts_total", "quickdraft_drafts_total", {}),
        ("vllm:spec_decode_num_draft_tokens_total", "quickdraft_draft_tokens_total", {}),
        ("vllm:spec_decode_num_accepted_tokens_total", "quickdraft_accepted_tokens_total", {}),
        ("vllm:time_to_first_token_seconds_count", "quickdraft_time_to_first_token_seconds_count", {}),
        ("vllm:e2e_request_latency_seconds_sum", "quickdraft_e2e_request_latency_seconds_sum", {}),
        ("vllm:num_requests_waiting", "quickdraft_waiting_requests", {}),
        ("vllm:kv_cache_usage_perc", "quickdraft_kv_cache_usage", {}),
    ]
    for ours_in_vllm, ours, labels in pairs:
        assert total(samples, ours_in_vllm, **vllm, **labels) == pytest.approx(total(samples, ours)), ours_in_vllm
    assert total(samples, "vllm:generation_tokens_total", **vllm) > 0
    for reason in ("stop", "length"):
        ended = total(samples, "quickdraft_requests_total", finish_reason=reason)
        assert total(samples, "vllm:request_success_total", **vllm, finished_reason=reason) == ended
    assert total(samples, "vllm:request_success_total", **vllm) > 0
    first_depth = total(samples, "quickdraft_accepted_tokens_by_position_total", position="1")
    assert total(samples, "vllm:spec_decode_num_accepted_tokens_per_pos_total", **vllm, position="0") == first_depth
    buckets = samples["vllm:time_to_first_token_seconds_bucket"]
    assert [float(s.labels["le"]) for s in buckets] == sorted(float(s.labels["le"]) for s in buckets)
