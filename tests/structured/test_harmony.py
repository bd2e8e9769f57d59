"""gpt-oss's harmony replies (structured/harmony.py): the analysis channel as reasoning, calls
to functions.NAME as tool calls, final and preamble text as content; streamed pieces join into
the whole reply at every split of the text."""

from __future__ import annotations

import pytest

from quickdraft.structured.harmony import HarmonyStream
from quickdraft.structured.reasoning import REASONING_PARSERS
from quickdraft.structured.tools import PlainTextStream, ToolCalling, merged_calls
from tests.structured.test_tools import as_message, splits, whole_and_streamed

A = "<|start|>assistant"
CASES = [
    # (reply as decoded with its special tokens, reasoning, content, calls)
    (
        f"<|channel|>analysis<|message|>Two and two.<|end|>{A}<|channel|>final<|message|>Four.<|return|>",
        "Two and two.",
        "Four.",
        [],
    ),
    (  # a call: recipient after the channel, JSON constrained
        "<|channel|>analysis<|message|>Need the weather.<|end|>"
        f'{A}<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{{"city": "Oslo"}}<|call|>',
        "Need the weather.",
        "",
        [("get_weather", {"city": "Oslo"})],
    ),
    (  # recipient in the role's header, before the channel; a preamble first; two calls
        "<|channel|>commentary<|message|>Checking both.<|end|>"
        f"{A} to=functions.get_time<|channel|>commentary json<|message|>{{}}<|call|>"
        f'{A} to=functions.get_weather<|channel|>commentary json<|message|>{{"city": "Rome"}}<|call|>',
        "",
        "Checking both.",
        [("get_time", {}), ("get_weather", {"city": "Rome"})],
    ),
    ("<|channel|>final<|message|>Just an answer.", "", "Just an answer.", []),  # cut short: the body so far
    ("<|channel|>analysis<|message|>Still thinking <|en", "Still thinking <|en", "", []),  # cut on a marker's start
    ("<|channel|>analysis<|message|>x<|end|><|start|>assis", "x", "", []),  # a header never finished: nothing
    ("Paris.", "", "Paris.", []),  # not harmony at all: content
    ("  <|channel|>final<|message|>a < b <| c<|return|>", "", "a < b <| c", []),  # "<" and "<|" in text
    ("", "", "", []),
]


@pytest.mark.parametrize(("text", "reasoning", "content", "calls"), CASES)
def test_channels_whole_or_streamed(text, reasoning, content, calls):
    def new_stream():
        return REASONING_PARSERS["openai_gptoss"].new_stream(PlainTextStream())

    for cuts in splits(text):
        whole, streamed = whole_and_streamed(new_stream, text, cuts)
        assert streamed.reasoning == whole.reasoning == reasoning, cuts
        assert as_message(streamed) == as_message(whole) == (content, calls), cuts


def test_calls_are_numbered_and_counted_for_finish_reason():
    text = CASES[2][0]
    stream = REASONING_PARSERS["openai_gptoss"].new_stream(PlainTextStream())
    assert isinstance(stream, HarmonyStream)
    reply = stream.whole(text)
    calls = merged_calls(reply.calls)
    assert [call["function"]["name"] for call in calls] == ["get_time", "get_weather"]
    assert len({call["id"] for call in calls}) == 2 and stream.num_calls == 2
    calling = ToolCalling(mode="auto", tools=[], parser="openai")
    assert calling.finish_reason("stop", stream) == "tool_calls"
    assert isinstance(calling.new_stream(), PlainTextStream)  # the harmony reader reads the calls


def test_the_parser_keeps_special_tokens_and_stops_at_calls():
    harmony, think = REASONING_PARSERS["openai_gptoss"], REASONING_PARSERS["qwen3"]
    assert harmony.keeps_special_tokens and "<|call|>" in harmony.stop_tokens
    assert not think.keeps_special_tokens and think.stop_tokens == ()


def test_constraints_after_harmony_reasoning_are_refused():
    from quickdraft.structured.params import StructuredOutputsParams

    with pytest.raises(ValueError, match=r"openai_gptoss.*not supported.*harmony"):
        StructuredOutputsParams(json={"type": "object"}, reasoning_parser="openai_gptoss")
