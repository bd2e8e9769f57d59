"""Reasoning parsers (structured/reasoning.py): the <think> block as `reasoning`, the rest as
content read on by the tool-call parser; streamed pieces join into the whole reply at every
split of the text."""

from __future__ import annotations

import json

import pytest

from quickdraft import LLM, SamplingParams
from quickdraft.models.tokenizer import Tokenizer
from quickdraft.structured.grammar import GrammarCompiler
from quickdraft.structured.params import StructuredOutputsParams
from quickdraft.structured.reasoning import REASONING_PARSERS
from quickdraft.structured.tools import HermesCallStream, PlainTextStream, merged_calls
from tests.structured.test_tools import as_message, splits, whole_and_streamed

CASES = [
    # (parser, reply, reasoning, content)
    ("deepseek_r1", "<think>Two and two.</think>\n\nFour.", "Two and two.", "\n\nFour."),
    ("deepseek_r1", "Two and two.</think>Four.", "Two and two.", "Four."),  # opened by the prompt
    ("deepseek_r1", "  <think>x</think>y", "x", "y"),  # whitespace before the opening tag
    ("deepseek_r1", "Still thinking <thi", "Still thinking <thi", ""),  # never closed: all thinking
    ("deepseek_r1", "", "", ""),
    ("deepseek_r1", "a </think>b </think>c", "a ", "b </think>c"),  # the first closing tag ends it
    ("qwen3", "<think>\nLet me see.\n</think>\n\nParis.", "\nLet me see.\n", "\n\nParis."),
    ("qwen3", "Paris.", "", "Paris."),  # thinking switched off: no block
    ("qwen3", "  Paris.", "", "  Paris."),
    ("qwen3", "<think>unfinished", "unfinished", ""),
    ("qwen3", "<thinking>is not the tag", "", "<thinking>is not the tag"),
    ("qwen3", "<th", "", "<th"),  # a reply that ends on what could have been the tag
    ("qwen3", "<think></think>Yes.", "", "Yes."),
]


@pytest.mark.parametrize(("parser", "text", "reasoning", "content"), CASES)
def test_the_block_is_reasoning_and_the_rest_content_whole_or_streamed(parser, text, reasoning, content):
    def new_stream():
        return REASONING_PARSERS[parser].new_stream(PlainTextStream())

    for cuts in splits(text):
        whole, streamed = whole_and_streamed(new_stream, text, cuts)
        assert (streamed.reasoning, streamed.content) == (whole.reasoning, whole.content) == (reasoning, content), cuts


def test_calls_are_read_from_the_content_after_the_thinking():
    call = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    text = f"<think>The user wants the time. <tool_call> is how I call.</think>\n{call}"

    def new_stream():
        inner = HermesCallStream(names=frozenset({"get_time"}), parallel=True)
        return REASONING_PARSERS["qwen3"].new_stream(inner)

    for cuts in splits(text)[:: max(1, len(text) // 40)]:
        whole, streamed = whole_and_streamed(new_stream, text, cuts)
        assert streamed.reasoning == whole.reasoning == "The user wants the time. <tool_call> is how I call."
        assert as_message(streamed) == as_message(whole) == ("", [("get_time", {})])
    stream = new_stream()
    stream.whole(text)
    assert stream.num_calls == 1  # finish_reason "tool_calls" reads the inner reader's count


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(
    ("parser", "text", "accepted"),
    [
        ("qwen3", '<think>so {"a": 2}?</think>{"a": 1}', True),
        ("qwen3", '<think>x</think>\n\n{"a": 1}', True),  # whitespace between the block and the answer
        ("qwen3", '{"a": 1}', True),  # no block: thinking off
        ("qwen3", 'hmm</think>{"a": 1}', False),  # thinking without opening the block
        ("qwen3", '<think>x</think>{"a": "one"}', False),  # the schema holds after the block
        ("deepseek_r1", 'hmm</think>{"a": 1}', True),  # the prompt opened the block
        ("deepseek_r1", '<think>hmm</think>{"a": 1}', True),
        ("deepseek_r1", '{"a": 1}', False),  # still inside the block: never closed
    ],
)
def test_a_constraint_behind_the_think_block(tiny_checkpoints, parser, text, accepted):
    from llguidance import LLMatcher

    tokenizer = Tokenizer.from_dir(tiny_checkpoints["qwen3"])
    compiler = GrammarCompiler(
        tokenizer=tokenizer.backend, vocab_size=tokenizer.vocab_size, eos_token_ids=tokenizer.eos_token_ids
    )
    params = StructuredOutputsParams(json=SCHEMA, reasoning_parser=parser)
    matcher = LLMatcher(compiler.ll_tokenizer, params.compiled, log_level=0)
    consumed = all(matcher.consume_token(token) for token in tokenizer.encode(text, add_special_tokens=False))
    assert (consumed and matcher.is_accepting()) == accepted
    reply = REASONING_PARSERS[parser].new_stream(PlainTextStream()).whole(text)
    if accepted:  # the parser splits where the grammar did: the content is the constrained answer
        assert json.loads(reply.content)["a"] == 1


def test_constrained_thinking_stays_exact_under_speculation(tiny_checkpoints):
    path = str(tiny_checkpoints["qwen3"])
    constraint = StructuredOutputsParams(json=SCHEMA, reasoning_parser="deepseek_r1")
    params = SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=constraint)
    prompts = ["Think about a", "Then answer b"]
    plain = [o.outputs[0].token_ids for o in LLM(path, max_model_len=128).generate(prompts, params)]
    drafted = LLM(path, max_model_len=128, speculative_config={"method": "suffix"}).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in drafted] == plain
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        StructuredOutputsParams(json=SCHEMA, reasoning_parser="o1")


def test_a_named_call_after_the_thinking_starts_at_its_arguments():
    from quickdraft.structured.tools import NamedCallStream

    text = '<think>Rome, one day.</think>\n\n{"city": "Rome", "days": 1}'

    def new_stream():
        return REASONING_PARSERS["qwen3"].new_stream(NamedCallStream(name="get_weather"))

    for cuts in splits(text)[:: max(1, len(text) // 30)]:
        whole, streamed = whole_and_streamed(new_stream, text, cuts)
        assert as_message(streamed) == as_message(whole) == ("", [("get_weather", {"city": "Rome", "days": 1})])
        assert merged_calls(whole.calls)[0]["function"]["arguments"].startswith("{")
