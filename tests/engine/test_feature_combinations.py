"""Sampling features together, as real requests mix them: for random combinations (penalties,
biases, bad words, filters, stops, min_tokens, constraints, logprobs, n), every drafter's output
equals plain decoding's, token for token and logprob for logprob (greedy and seeded sampling)."""

from __future__ import annotations

import random

import pytest

from quickdraft import LLM, SamplingParams
from tests.engine.test_speculative import EXACTNESS_CONFIGS, repetitive_prompts, speculative_llm

NUM_COMBINATIONS = 24


def random_request(rng: random.Random) -> dict:
    """One request's SamplingParams fields, each feature present with some probability."""
    fields: dict = {"max_tokens": rng.choice([1, 6, 20]), "temperature": rng.choice([0.0, 0.0, 0.8]), "seed": 3}
    optional = {
        "repetition_penalty": lambda: rng.choice([1.3, 2.0]),
        "presence_penalty": lambda: rng.choice([0.5, 1.5]),
        "frequency_penalty": lambda: 0.7,
        "top_k": lambda: rng.choice([1, 4, 50]),
        "top_p": lambda: rng.choice([0.6, 0.95]),
        "min_p": lambda: 0.05,
        "logit_bias": lambda: {rng.randrange(3, 300): rng.choice([-100.0, 4.0]) for _ in range(4)},
        "bad_words": lambda: [rng.choice(["ab", "q", "zz"])],
        "min_tokens": lambda: min(fields["max_tokens"], 4),
        "stop": lambda: [rng.choice(["a", "b", "xy"])],
        "stop_token_ids": lambda: [rng.randrange(3, 300)],
        "ignore_eos": lambda: True,
        "logprobs": lambda: rng.choice([0, 3]),
        "prompt_logprobs": lambda: 2,
        "include_stop_str_in_output": lambda: True,
        "structured_outputs": lambda: rng.choice(
            [{"regex": "[a-c]{2,4}-[0-9]{1,2}"}, {"choice": ["alpha", "beta"]}, {"json_object": True}]
        ),
        "n": lambda: 2,
    }
    for name, value in optional.items():
        if rng.random() < 0.25:
            fields[name] = value()
    if fields.get("n") == 2:
        fields["temperature"] = 0.8
    return fields


def combinations() -> list[dict]:
    rng = random.Random(2026)
    return [random_request(rng) for _ in range(NUM_COMBINATIONS)]


@pytest.fixture(scope="module")
def plain_results(tiny_checkpoints):
    llm = LLM(str(tiny_checkpoints["gemma3"]), max_model_len=128, max_num_seqs=4)
    return [llm.generate(repetitive_prompts(), SamplingParams(**fields)) for fields in combinations()]


def summary(results) -> list:
    return [
        (result.prompt_logprobs, [(c.token_ids, c.text, c.finish_reason, c.logprobs) for c in result.outputs])
        for result in results
    ]


@pytest.mark.parametrize("spec", EXACTNESS_CONFIGS, ids=["ngram", "suffix", "garbage"])
def test_every_combination_decodes_as_plain_decoding_does(tiny_checkpoints, plain_results, spec):
    llm = speculative_llm(str(tiny_checkpoints["gemma3"]), spec, max_model_len=128, max_num_seqs=4)
    for fields, expected in zip(combinations(), plain_results):
        got = llm.generate(repetitive_prompts(), SamplingParams(**fields))
        assert summary(got) == summary(expected), fields
    assert llm.get_metrics().num_accepted_tokens > 0
