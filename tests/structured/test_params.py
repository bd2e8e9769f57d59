"""StructuredOutputsParams: one constraint, compiled and checked at construction, errors that name it."""

from __future__ import annotations

import pytest

from quickdraft import SamplingParams
from quickdraft.structured import StructuredOutputsParams


@pytest.mark.parametrize(
    "fields",
    [
        {"json": {"type": "object", "properties": {"a": {"type": "integer"}}}},
        {"json": '{"type": "array", "items": {"type": "string"}}'},
        {"json_object": True},
        {"regex": r"\d{3}-[a-z]+"},
        {"choice": ["yes", "no", 'say "maybe"\n']},
        {"grammar": 'start: "a" b\nb: /[0-9]+/'},
        {"grammar": 'root ::= "a" [0-9]+'},  # GBNF, converted to Lark
    ],
)
def test_valid_constraints_compile(fields):
    params = StructuredOutputsParams(**fields)
    assert params.compiled and params.kind == next(iter(fields))
    assert SamplingParams(structured_outputs=fields).structured_outputs == params


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({}, "give exactly one of"),
        ({"regex": "a", "choice": ["a"]}, "got regex, choice"),
        ({"json": "{not json"}, "structured_outputs.json: the schema is not valid JSON"),
        ({"json": {"type": "foo"}}, "structured_outputs.json is invalid: Invalid type: foo"),
        ({"json": [1]}, "a JSON schema is an object"),
        ({"regex": "(abc"}, "structured_outputs.regex is invalid: .*unclosed group"),
        ({"regex": ""}, "structured_outputs.regex must be a non-empty string"),
        ({"choice": []}, "structured_outputs.choice must be a non-empty list"),
        ({"choice": ["a", 3]}, "structured_outputs.choice must be a non-empty list"),
        ({"grammar": "start: foo"}, 'structured_outputs.grammar is invalid: .*unknown name: "foo"'),
        ({"json_object": 1}, "structured_outputs.json_object must be true or false"),
        ({"regex": "a", "disable_any_whitespace": "yes"}, "disable_any_whitespace must be a bool"),
    ],
)
def test_bad_constraints_name_the_problem(fields, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**fields)


def test_sampling_params_take_a_dict_and_name_unknown_fields():
    with pytest.raises(ValueError, match=r"unknown fields \['schema'\]"):
        SamplingParams(structured_outputs={"schema": {}})
    with pytest.raises(ValueError, match="structured_outputs must be StructuredOutputsParams or a dict"):
        SamplingParams(structured_outputs="json")
    params = SamplingParams(structured_outputs={"regex": "a+"})
    assert isinstance(params.structured_outputs, StructuredOutputsParams)
    assert params.clone().structured_outputs == params.structured_outputs
