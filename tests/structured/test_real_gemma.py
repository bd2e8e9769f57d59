"""Structured outputs on the embedded Gemma 3 270M: constrained greedy speculative output equals
constrained greedy plain output with every kind of drafter, and parses against its schema."""

from __future__ import annotations

import json

import pytest

from quickdraft import LLM, SamplingParams

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer"},
        "city": {"type": "string", "maxLength": 30},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
    },
    "required": ["name", "age", "city", "skills"],
    "additionalProperties": False,
}
PROMPTS = [
    "Extract the person as JSON.\nText: Maria Gonzalez, 34, is a civil engineer in Valencia who speaks "
    "Spanish and English and programs in Python.\nJSON:\n",
    "Extract the person as JSON.\nText: Tom Baker (52) lives in Leeds and repairs clocks and bicycles.\nJSON:\n",
]
SPECS = {
    "grammar": {"method": "grammar"},
    "grammar+suffix+eagle3": {
        "method": "hybrid",
        "drafters": [
            {"method": "grammar"},
            {"method": "suffix"},
            {"method": "eagle3", "top_k": 1, "num_speculative_tokens": 5},
        ],
        "skip_after": 2,
    },
    "eagle3 tree": {"method": "eagle3", "top_k": 4},  # the shipped head's manifest recommends a chain
    "ngram": {"method": "ngram", "num_speculative_tokens": 5},
}


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=1024)


def test_constrained_speculation_equals_constrained_plain(llm):
    params = SamplingParams(max_tokens=96, temperature=0.0, structured_outputs={"json": SCHEMA})
    llm.engine.set_speculative_config(None)
    plain = llm.generate(PROMPTS, params)
    for out in plain:
        document = json.loads(out.outputs[0].text)
        assert set(document) == set(SCHEMA["required"]) and isinstance(document["age"], int)
    for name, spec in SPECS.items():
        llm.engine.set_speculative_config(spec)
        outs = llm.generate(PROMPTS, params)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain], name
        assert llm.get_metrics().num_draft_tokens > 0


def test_seeded_sampled_constrained_speculation_equals_plain(llm):
    params = [
        SamplingParams(max_tokens=64, temperature=0.7, top_p=0.95, seed=s, structured_outputs={"json": SCHEMA})
        for s in range(2)
    ]
    llm.engine.set_speculative_config(None)
    plain = llm.generate(PROMPTS, params)
    llm.engine.set_speculative_config(SPECS["grammar+suffix+eagle3"])
    outs = llm.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
