"""Reasoning parsers (structured/reasoning.py): the <think> block as `reasoning`, the rest as
content read on by the tool-call parser; streamed pieces join into the whole reply at every
split of the text."""

from __future__ import annotations

import pytest

from quickdraft.structured.reasoning import REASONING_PARSERS
from quickdraft.structured.tools import HermesCallStream, PlainTextStream
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
