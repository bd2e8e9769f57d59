"""Adaptive speculation's per-step draft-length choices reach the responses and /metrics.

Also the `return_token_ids` extension the serving benchmark compares outputs with.
"""

from __future__ import annotations

from tests.server.traffic import scrape, send_traffic, total


def choices_by_length(speculations: list[dict]) -> dict[int, int]:
    summed: dict[int, int] = {}
    for speculation in speculations:
        for length, steps in enumerate(speculation["draft_length_choices"]):
            summed[length] = summed.get(length, 0) + steps
    return summed


def test_choice_counters_add_up_to_the_responses(adaptive_server):
    results = send_traffic(adaptive_server)
    samples = scrape(adaptive_server)
    labels = {"model": "adaptive", "method": "ngram"}
    for scenario in {scenario for scenario, _, _ in results}:
        mine = [speculation for s, _, speculation in results if s == scenario]
        where = {**labels, "scenario": scenario}
        expected = choices_by_length(mine)
        for length, steps in expected.items():
            assert total(samples, "quickdraft_draft_length_choices_total", **where, length=str(length)) == steps
        exposed_lengths = {
            s.labels["length"]
            for s in samples["quickdraft_draft_length_choices_total"]
            if s.labels["scenario"] == scenario
        }
        assert exposed_lengths == {str(length) for length, steps in expected.items() if steps}
        assert total(samples, "quickdraft_chosen_draft_length_total", **where) == sum(
            length * steps for length, steps in expected.items()
        )
    all_choices = choices_by_length([speculation for _, _, speculation in results])
    assert sum(all_choices.values()) > 0 and max(all_choices) <= 3  # num_speculative_tokens bounds the choice


def test_every_decoding_step_records_one_choice(adaptive_server):
    client = adaptive_server.openai_client()
    response = client.completions.create(
        model="adaptive",
        prompt="a b c a b c a b c a b c",
        max_tokens=20,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    speculation = response.model_extra["speculation"]
    assert speculation["adaptive"] is True
    # Every target forward after the prefill's (which gave the first token) is a decoding step.
    assert sum(speculation["draft_length_choices"]) == speculation["target_forwards"] - 1
    # A request only drafts on steps it chose a length >= 1 for.
    steps_with_a_draft = sum(speculation["draft_length_choices"][1:])
    assert speculation["drafts"] <= steps_with_a_draft
    assert sum(speculation["drafted_per_position"][:1]) <= steps_with_a_draft


def test_fixed_speculation_reports_no_choices(metrics_server, plain_server):
    for server in (metrics_server, plain_server):
        response = server.openai_client().completions.create(
            model=server.model_name, prompt="x y x y", max_tokens=6, temperature=0
        )
        speculation = response.model_extra["speculation"]
        assert speculation["adaptive"] is False and speculation["draft_length_choices"] == []
    assert "quickdraft_draft_length_choices_total" not in scrape(metrics_server)


def test_return_token_ids_streamed_and_whole(plain_server, offline_llms):
    from quickdraft.sampling_params import SamplingParams

    prompt = "one two one two"
    expected = (
        offline_llms["gemma3"]
        .generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
        .outputs[0]
        .token_ids
    )
    client = plain_server.openai_client()
    body = {"return_token_ids": True, "ignore_eos": True}
    whole = client.completions.create(model="tiny-gemma", prompt=prompt, max_tokens=12, temperature=0, extra_body=body)
    assert whole.choices[0].model_extra["token_ids"] == expected
    chunks = list(
        client.completions.create(
            model="tiny-gemma", prompt=prompt, max_tokens=12, temperature=0, stream=True, extra_body=body
        )
    )
    streamed = [token for chunk in chunks for choice in chunk.choices for token in choice.model_extra["token_ids"]]
    assert streamed == expected
    plain = client.completions.create(model="tiny-gemma", prompt=prompt, max_tokens=3, temperature=0)
    assert "token_ids" not in plain.choices[0].model_extra


def test_return_token_ids_in_chat(ngram_server):
    client = ngram_server.openai_client()
    messages = [{"role": "user", "content": "x y x y x y"}]
    whole = client.chat.completions.create(
        model="tiny-qwen", messages=messages, max_tokens=10, temperature=0, extra_body={"return_token_ids": True}
    )
    chunks = list(
        client.chat.completions.create(
            model="tiny-qwen",
            messages=messages,
            max_tokens=10,
            temperature=0,
            stream=True,
            extra_body={"return_token_ids": True},
        )
    )
    streamed = [
        token
        for chunk in chunks
        for choice in chunk.choices
        for token in (choice.model_extra or {}).get("token_ids", [])
    ]
    assert streamed == whole.choices[0].model_extra["token_ids"]
    assert len(streamed) == whole.usage.completion_tokens > 0
