"""vLLM's structural tags (free text in which each trigger starts a tagged JSON structure) and
whitespace_pattern: which outputs they take, their errors, and exactness under speculation."""

from __future__ import annotations

import pytest

from quickdraft import LLM, SamplingParams
from quickdraft.structured import StructuredOutputsParams
from tests.models.test_decoder import prompt
from tests.structured.conftest import accepts

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TAG = {
    "type": "structural_tag",
    "structures": [
        {"begin": "<function=get_weather>", "schema": WEATHER, "end": "</function>"},
        {
            "begin": "<function=get_time>",
            "schema": {"type": "object", "additionalProperties": False},
            "end": "</function>",
        },
        {"begin": "<|/n ote|>", "schema": {"type": "integer"}, "end": ""},  # a slash and a space in the trigger
    ],
    "triggers": ["<function=", "<|/n ote|>"],
}


@pytest.mark.parametrize(
    ("text", "valid"),
    [
        ("Plain text, no tag.", True),
        ('Looking. <function=get_weather>{"city": "Oslo"}</function> Done.', True),
        ('<function=get_time>{}</function><function=get_weather>{"city": "x"}</function>', True),
        ("a note <|/n ote|>42 and on", True),
        ("a <function=get_news>{}</function>", False),  # a trigger must start one of the structures
        ('a <function=get_weather>{"town": "Oslo"}</function>', False),  # held to the schema
        ('a <function=get_weather>{"city": "Oslo"}', False),  # the structure must be closed
        ("a <|/n ote|>x", False),
    ],
)
def test_a_structural_tag_holds_each_triggered_structure_and_leaves_text_free(text_compiler, text, valid):
    assert accepts(text_compiler, StructuredOutputsParams(structural_tag=TAG), text) == valid


TAG_A = {
    "type": "tag",
    "begin": "<a>",
    "content": {"type": "json_schema", "json_schema": {"type": "integer"}},
    "end": "</a>",
}
TAG_B = {"type": "tag", "begin": "<b>", "content": {"type": "any_text"}, "end": "</b>"}


def fmt(node: dict) -> StructuredOutputsParams:
    return StructuredOutputsParams(structural_tag={"type": "structural_tag", "format": node})


@pytest.mark.parametrize(
    ("node", "text", "valid"),
    [
        ({"type": "const_string", "value": "Hi!"}, "Hi!", True),
        ({"type": "const_string", "value": "Hi!"}, "Hi", False),
        ({"type": "regex", "pattern": "[0-9]{2}/x"}, "42/x", True),
        ({"type": "regex", "pattern": "[0-9]{2}/x"}, "4/x", False),
        ({"type": "json_schema", "json_schema": {"type": "integer"}}, "12", True),
        ({"type": "grammar", "grammar": 'root ::= "v" [0-9]'}, "v7", True),
        ({"type": "grammar", "grammar": 'root ::= "v" [0-9]'}, "v", False),
        ({"type": "sequence", "elements": [{"type": "const_string", "value": "n="}, TAG_A["content"]]}, "n=3", True),
        ({"type": "or", "elements": [TAG_A, TAG_B]}, "<b>any text</b>", True),
        ({"type": "or", "elements": [TAG_A, TAG_B]}, "<a>x</a>", False),
        (TAG_B, "<b>free </a> text</b>", True),
        (TAG_B, "<b>free text", False),
        ({"type": "any_text"}, "anything at all", True),
        ({"type": "tags_with_separator", "tags": [TAG_A], "separator": ","}, "<a>1</a>,<a>2</a>", True),
        ({"type": "tags_with_separator", "tags": [TAG_A], "separator": ","}, "", True),
        ({"type": "tags_with_separator", "tags": [TAG_A], "separator": ",", "at_least_one": True}, "", False),
        (
            {"type": "tags_with_separator", "tags": [TAG_A], "separator": ",", "stop_after_first": True},
            "<a>1</a>,<a>2</a>",
            False,
        ),
        ({"type": "triggered_tags", "triggers": ["<a"], "tags": [TAG_A]}, "x <a>1</a> y <a>2</a>", True),
        ({"type": "triggered_tags", "triggers": ["<a"], "tags": [TAG_A]}, "x <a>y</a>", False),
        ({"type": "triggered_tags", "triggers": ["<a"], "tags": [TAG_A]}, "no tag", True),
        ({"type": "triggered_tags", "triggers": ["<a"], "tags": [TAG_A], "at_least_one": True}, "no tag", False),
        ({"type": "triggered_tags", "triggers": ["<a"], "tags": [TAG_A], "stop_after_first": True}, "<a>1</a> x", True),
        (
            {"type": "triggered_tags", "triggers": ["<a"], "tags": [TAG_A], "stop_after_first": True},
            "<a>1</a><a>2</a>",
            False,
        ),
    ],
)
def test_the_format_form_takes_what_each_node_says(text_compiler, node, text, valid):
    assert accepts(text_compiler, fmt(node), text) == valid


def test_a_structural_tag_may_come_as_json_text():
    import json

    assert (
        StructuredOutputsParams(structural_tag=json.dumps(TAG)).compiled
        == StructuredOutputsParams(structural_tag=TAG).compiled
    )


@pytest.mark.parametrize(
    ("tag", "message"),
    [
        ("{not json", "is not valid JSON"),
        ({"structures": TAG["structures"]}, "triggers must be a non-empty list"),
        ({"structures": [], "triggers": ["<f"]}, "structures must be a non-empty list"),
        ({"structures": [{"begin": "<g>", "schema": {}, "end": ""}], "triggers": ["<f"]}, "starts with none"),
        ({"structures": [{"begin": "<f>", "schema": False}], "triggers": ["<f"]}, "schema is false"),
        ({"structures": [{"begin": "<f>", "extra": 1}], "triggers": ["<f"]}, r"must be \{begin, schema, end\}"),
        ({"format": {"type": "const_string"}}, r"\.format\.value must be a string"),
        ({"format": {"type": "nope"}}, r"\.format\.type must be one of"),
        ({"format": {"type": "tag", "begin": "<a>", "content": {"type": "any_text"}}}, r"\.end must be a string"),
        ({"format": {"type": "sequence", "elements": []}}, r"\.elements must be a non-empty list"),
        ({"format": {"type": "regex", "pattern": "x", "flags": 1}}, "unknown fields"),
        (
            {"format": {"type": "triggered_tags", "triggers": ["<x"], "tags": [TAG_A]}},
            r"\.tags\[0\]\.begin '<a>' starts with none of the triggers",
        ),
    ],
)
def test_bad_structural_tags_name_the_problem(tag, message):
    with pytest.raises(ValueError, match=r"^structured_outputs\.structural_tag.*" + message):
        StructuredOutputsParams(structural_tag=tag)


def test_whitespace_pattern_is_the_whitespace_json_allows(text_compiler):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    compact = StructuredOutputsParams(json=schema)
    spaced = StructuredOutputsParams(json=schema, whitespace_pattern="[ ]?")
    assert accepts(text_compiler, compact, '{"a": 1}') and not accepts(text_compiler, compact, '{ "a": 1}')
    assert all(accepts(text_compiler, spaced, text) for text in ('{"a": 1}', '{"a":1}', '{ "a" : 1 }'))
    assert not accepts(text_compiler, spaced, '{\n"a": 1}')
    with pytest.raises(ValueError, match=r"^structured_outputs\.whitespace_pattern must be a regular expression"):
        StructuredOutputsParams(json=schema, whitespace_pattern="[")


def test_structural_tags_are_exact_under_speculation(tiny_checkpoints):
    """A logits processor steers the tiny model to write the trigger ("<" gains, "a" after it), so
    the output holds structures; every drafter then gives plain decoding's tokens."""
    target = str(tiny_checkpoints["gemma3"])
    plain_llm = LLM(model=target, max_model_len=256)
    less, a = (plain_llm.tokenizer.encode(char, add_special_tokens=False)[0] for char in "<a")

    def write_triggers(output, logits):
        logits[a if output and output[-1] == less else less] += 6.0
        return logits

    tag = {"structures": [{"begin": "<a>", "schema": {"type": "integer"}, "end": "</a>"}], "triggers": ["<a"]}
    params = SamplingParams(
        max_tokens=60, temperature=0, logits_processors=[write_triggers], structured_outputs={"structural_tag": tag}
    )
    prompts = [prompt(10, seed=92), prompt(5, seed=93) * 3]
    plain = [o.outputs[0] for o in plain_llm.generate(prompts, params)]
    assert all(output.text.count("</a>") >= 3 for output in plain)
    for method in ("ngram", "suffix"):
        config = {"method": method, "num_speculative_tokens": 6}
        spec = LLM(model=target, max_model_len=256, speculative_config=config)
        assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == [o.token_ids for o in plain], method
        assert spec.get_metrics().num_accepted_tokens > 0
