"""Function calling: tools and tool_choice checked, the constraint of each mode, the parsers
(streamed pieces join into what the whole reply gives, at every split of the text), the
conversation as templates read it, and constrained calls staying exact under speculation."""

from __future__ import annotations

import json

import pytest

from quickdraft import LLM, SamplingParams
from quickdraft.structured.tools import (
    HermesCallStream,
    NamedCallStream,
    ReplyDelta,
    RequiredCallsStream,
    ToolCalling,
    chat_template_inputs,
    merged_calls,
    parse_tools,
    resolve_tool_calling,
)
from tests.models.test_decoder import prompt
from tests.structured.conftest import consumed

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer", "maximum": 9}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters: any object
TOOLS = [WEATHER, TIME]


@pytest.mark.parametrize(
    ("tools", "message"),
    [
        ([], "tools must be a non-empty list"),
        ("get_weather", "tools must be a non-empty list"),
        ([{"type": "retrieval"}], 'tools[0] must be {"type": "function"'),
        ([{"type": "function", "function": {"name": "has space"}}], "tools[0].function.name must be 1-64"),
        ([{"type": "function", "function": {"name": "x" * 65}}], "tools[0].function.name"),
        ([TIME, {"type": "function", "function": {"name": "f", "parameters": []}}], "tools[1].function.parameters"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "frobnicate"}}}],
            "tools[0].function.parameters",
        ),
        ([{"type": "function", "function": {"name": "f", "strict": "yes"}}], "tools[0].function.strict"),
        ([{"type": "function", "function": {"name": "f", "arguments": {}}}], "tools[0].function: unknown fields"),
        ([{"type": "function", "function": {"name": "f"}, "extra": 1}], "tools[0]: unknown fields ['extra']"),
        ([TIME, TIME], "repeated: ['get_time']"),
    ],
)
def test_bad_tools_name_the_field(tools, message):
    with pytest.raises(ValueError) as caught:
        parse_tools(tools)
    assert message in str(caught.value)


@pytest.mark.parametrize(
    ("tools", "choice", "message"),
    [
        (None, "required", "tool_choice 'required' needs tools"),
        (None, {"type": "function", "function": {"name": "get_time"}}, "needs tools"),
        (TOOLS, "sometimes", 'tool_choice must be "none", "auto", "required"'),
        (TOOLS, {"type": "function", "function": {"name": "get_date"}}, "'get_date', which is not among the tools"),
        (TOOLS, {"type": "function"}, "tool_choice must be"),
    ],
)
def test_bad_tool_choice_names_the_field(tools, choice, message):
    with pytest.raises(ValueError) as caught:
        resolve_tool_calling(tools=tools, tool_choice=choice, parallel_tool_calls=None)
    assert str(caught.value).startswith("tool_choice") and message in str(caught.value)


def test_modes_and_their_constraints():
    assert resolve_tool_calling(tools=None, tool_choice=None, parallel_tool_calls=None) is None
    assert resolve_tool_calling(tools=None, tool_choice="auto", parallel_tool_calls=None) is None
    auto = resolve_tool_calling(tools=TOOLS, tool_choice=None, parallel_tool_calls=None)
    assert auto.mode == "auto" and auto.constraint() is None and len(auto.template_tools()) == 2
    none = resolve_tool_calling(tools=TOOLS, tool_choice="none", parallel_tool_calls=None)
    assert none.constraint() is None and none.template_tools() is None
    named = resolve_tool_calling(
        tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}, parallel_tool_calls=None
    )
    assert named.constraint().json == WEATHER["function"]["parameters"]
    assert [tool["function"]["name"] for tool in named.template_tools()] == ["get_weather"]
    required = resolve_tool_calling(tools=TOOLS, tool_choice="required", parallel_tool_calls=False).constraint()
    assert required.json["minItems"] == 1 and required.json["maxItems"] == 1
    names = [item["properties"]["name"]["const"] for item in required.json["items"]["anyOf"]]
    assert names == ["get_weather", "get_time"]


def whole_and_streamed(make_stream, text: str, cuts: list[int]) -> tuple[ReplyDelta, ReplyDelta]:
    whole = make_stream().whole(text)
    stream, streamed, start = make_stream(), ReplyDelta(), 0
    for cut in [*sorted(cuts), len(text)]:
        streamed += stream.feed(text[start:cut])
        start = max(start, cut)
    return whole, streamed + stream.finish()


def as_message(reply: ReplyDelta) -> tuple[str, list[tuple[str, dict]]]:
    calls = merged_calls(reply.calls)
    return reply.content, [(call["function"]["name"], json.loads(call["function"]["arguments"])) for call in calls]


HERMES_CASES = [
    # (reply text, content, calls)
    ("Just text, no call.", "Just text, no call.", []),
    (
        'Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}</tool_call>',
        "Let me check.",
        [("get_weather", {"city": "Oslo", "days": 2})],
    ),
    (
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n<tool_call>{"name": "get_weather", '
        '"arguments": "{\\"city\\": \\"Rome\\", \\"days\\": 1}"}</tool_call>\n',
        "",
        [("get_time", {}), ("get_weather", {"city": "Rome", "days": 1})],
    ),
    # Not calls of the tools: stay content, as written.
    (
        '<tool_call>{"name": "launch", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "launch", "arguments": {}}</tool_call>',
        [],
    ),
    ("a <tool_call>not json</tool_call> b", "a <tool_call>not json</tool_call> b", []),
    ("x < y and <tool", "x < y and <tool", []),  # a tag's start at the end is text after all
    # The reply ended inside a block (max_tokens, or the model stopped): a call if it reads as one.
    ('ok <tool_call>{"name": "get_time", "arguments": {}}', "ok", [("get_time", {})]),
    ('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n  then text  ', "then text", [("get_time", {})]),
    ("  text with spaces \n", "  text with spaces \n", []),
    ('<tool_call>{"name": "get_time", "argu', '<tool_call>{"name": "get_time", "argu', []),
]


@pytest.mark.parametrize(("text", "content", "calls"), HERMES_CASES)
def test_hermes_parser_table(text, content, calls):
    reply = HermesCallStream(names=frozenset({"get_weather", "get_time"}), parallel=True).whole(text)
    assert as_message(reply) == (content, calls)


def splits(text: str) -> list[list[int]]:
    """Every single cut, and one character at a time."""
    return [[cut] for cut in range(len(text) + 1)] + [list(range(1, len(text)))]


@pytest.mark.parametrize(("text", "content", "calls"), HERMES_CASES)
def test_hermes_streamed_pieces_join_into_the_whole_reply(text, content, calls):
    def new_stream():
        return HermesCallStream(names=frozenset({"get_weather", "get_time"}), parallel=True)

    for cuts in splits(text):
        whole, streamed = whole_and_streamed(new_stream, text, cuts)
        assert as_message(streamed) == as_message(whole) == (content, calls), cuts


def test_hermes_without_parallel_calls_keeps_later_ones_as_content():
    second = '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome", "days": 1}}</tool_call>'
    text = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>' + second
    reply = HermesCallStream(names=frozenset({"get_weather", "get_time"}), parallel=False).whole(text)
    assert as_message(reply) == (second, [("get_time", {})])


def test_hermes_holds_back_a_possible_tag_then_lets_it_go():
    stream = HermesCallStream(names=frozenset({"get_time"}), parallel=True)
    assert stream.feed("see <tool").content == "see"  # the space waits for what follows
    assert stream.feed("box>").content == " <toolbox>"


def test_required_calls_go_out_as_each_object_completes():
    text = (
        '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Oslo", "days": 3}}]'
    )
    stream = RequiredCallsStream()
    first_end = text.index("}}") + 2
    assert stream.feed(text[: first_end - 1]).calls == []
    assert [piece.name for piece in stream.feed(text[first_end - 1 : first_end]).calls] == ["get_time"]
    rest = stream.feed(text[first_end:]) + stream.finish()
    assert as_message(rest) == ("", [("get_weather", {"city": "Oslo", "days": 3})])
    assert stream.num_calls == 2


def test_required_streamed_pieces_join_into_the_whole_reply():
    text = (
        '[{"name": "get_weather", "parameters": {"city": "a,}]", "days": 1}}, {"name": "get_time", "parameters": {}}]'
    )
    expected = ("", [("get_weather", {"city": "a,}]", "days": 1}), ("get_time", {})])
    for cuts in splits(text):
        whole, streamed = whole_and_streamed(RequiredCallsStream, text, cuts)
        assert as_message(streamed) == as_message(whole) == expected, cuts


def test_required_reply_cut_short_keeps_its_rest_as_content():
    text = '[{"name": "get_time", "parameters": {}}, {"name": "get_wea'
    reply = RequiredCallsStream().whole(text)
    assert as_message(reply) == ('{"name": "get_wea', [("get_time", {})])


def test_named_call_streams_its_arguments():
    stream = NamedCallStream(name="get_weather")
    pieces = stream.feed('{"city": ') + stream.feed('"Oslo", "days": 2}') + stream.finish()
    assert pieces.calls[0].call_id.startswith("call_") and pieces.calls[1].call_id is None
    assert as_message(pieces) == ("", [("get_weather", {"city": "Oslo", "days": 2})])
    assert NamedCallStream(name="f").whole("").calls[0].name == "f"  # even an empty reply is the call


def test_finish_reason_is_tool_calls_only_where_the_model_chose_to_call():
    auto = ToolCalling(mode="auto", tools=parse_tools(TOOLS))
    called = HermesCallStream(names=frozenset({"get_time"}), parallel=True)
    called.whole('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    assert auto.finish_reason("stop", called) == "tool_calls"
    assert auto.finish_reason("length", called) == "length"
    assert auto.finish_reason("stop", HermesCallStream(names=frozenset(), parallel=True)) == "stop"
    named = ToolCalling(mode="named", tools=parse_tools(TOOLS), named="get_time")
    assert named.finish_reason("stop", NamedCallStream(name="get_time")) == "stop"  # as OpenAI's


HISTORY = [
    {"role": "user", "content": "Weather in Oslo?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'},
            }
        ],
    },
    {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
]


def test_a_template_that_reads_tools_gets_them_and_the_calls_as_objects():
    template = "{{ tools | length }}{% for m in messages %}{{ m.tool_calls }}{% endfor %}"
    calling = resolve_tool_calling(tools=TOOLS, tool_choice="auto", parallel_tool_calls=None)
    messages, variables = chat_template_inputs(HISTORY, template=template, calling=calling)
    assert [tool["function"]["name"] for tool in variables["tools"]] == ["get_weather", "get_time"]
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo", "days": 1}
    assert HISTORY[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo", "days": 1}'  # not changed


def test_a_template_without_tools_gets_a_system_preamble_and_calls_written_out():
    template = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    calling = resolve_tool_calling(tools=TOOLS, tool_choice="auto", parallel_tool_calls=None)
    messages, variables = chat_template_inputs(HISTORY, template=template, calling=calling)
    assert variables == {} and messages[0]["role"] == "system"
    assert '"name": "get_weather"' in messages[0]["content"] and "<tool_call>" in messages[0]["content"]
    written = messages[2]["content"]
    assert HermesCallStream(names=frozenset({"get_weather"}), parallel=True).whole(written).calls  # readable back
    with_system = [{"role": "system", "content": "Be brief."}, *HISTORY]
    messages, _ = chat_template_inputs(with_system, template=template, calling=calling)
    assert messages[0]["content"].endswith("\n\nBe brief.") and messages[1]["role"] == "user"
    none = resolve_tool_calling(tools=TOOLS, tool_choice="none", parallel_tool_calls=None)
    messages, _ = chat_template_inputs(HISTORY[:1], template=template, calling=none)
    assert messages == HISTORY[:1]


@pytest.fixture(scope="module")
def target(tiny_checkpoints) -> str:
    return str(tiny_checkpoints["gemma3"])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_constrained_calls_are_exact_under_speculation_and_parse(target, choice):
    calling = resolve_tool_calling(tools=TOOLS, tool_choice=choice, parallel_tool_calls=None)
    params = SamplingParams(max_tokens=80, temperature=0, structured_outputs=calling.constraint())
    prompts = [prompt(10, seed=90), prompt(6, seed=91) * 3]
    plain = LLM(model=target, max_model_len=256).generate(prompts, params)
    for method in ("ngram", "suffix", "grammar"):
        config = {"method": method, "num_speculative_tokens": 6}
        spec = LLM(model=target, max_model_len=256, speculative_config=config).generate(prompts, params)
        assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain], method
    assert any(output.outputs[0].finish_reason == "stop" for output in plain)
    for output in plain:
        completion = output.outputs[0]
        if completion.finish_reason != "stop":
            continue  # a random model may fill max_tokens inside a string
        stream = calling.new_stream()
        content, calls = as_message(stream.whole(completion.text))
        assert content == "" and calls and calling.finish_reason("stop", stream) in ("stop", "tool_calls")
        for name, arguments in calls:
            assert name in ("get_weather", "get_time")
            if name == "get_weather":
                assert set(arguments) == {"city", "days"} and arguments["days"] <= 9


def test_llm_chat_shows_the_tools_to_the_template(target):
    llm = LLM(model=target, max_model_len=512)
    params = SamplingParams(max_tokens=2, temperature=0)
    reads_tools = "{% for t in tools %}[{{ t.function.name }}]{% endfor %}{{ messages[0].content }}{{ suffix }}"
    (output,) = llm.chat(
        HISTORY[:1], params, chat_template=reads_tools, tools=TOOLS, chat_template_kwargs={"suffix": "?"}
    )
    assert output.prompt == "[get_weather][get_time]Weather in Oslo??"
    plain = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    (output,) = llm.chat(HISTORY[:1], params, chat_template=plain, tools=[TIME])  # bytes are tokens here
    assert output.prompt.startswith("<system>You can call these functions") and "<tool_call>" in output.prompt
    with pytest.raises(ValueError, match="tools"):
        llm.chat(HISTORY[:1], params, chat_template=plain, tools=[{"type": "function"}])


def auto_matcher(text_compiler, *, parallel: bool = True):
    calling = resolve_tool_calling(tools=TOOLS, tool_choice="auto", parallel_tool_calls=parallel, constrain_auto=True)
    return text_compiler.matcher_for(calling.constraint()).matcher


CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}</tool_call>'


@pytest.mark.parametrize(
    ("text", "valid"),
    [
        ("Free text, no call at all.", True),
        (f"Let me look.{CALL} Done.", True),
        (f'{CALL}\n<tool_call>{{"name": "get_time", "arguments": {{}}}}</tool_call>', True),
        ('x <tool_call>{"name": "launch", "arguments": {}}</tool_call>', False),  # not a tool
        ('x <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>', False),  # no days
        ('<tool_call>{"name":"get_time","arguments":{}}</tool_call>', False),  # json.dumps' separators only
    ],
)
def test_auto_grammar_holds_calls_to_the_tools_and_leaves_text_free(text_compiler, text, valid):
    matcher = auto_matcher(text_compiler)
    assert (consumed(matcher, text_compiler, text) and matcher.is_accepting()) == valid


def test_auto_grammar_forces_the_call_s_keys_and_needs_it_closed(text_compiler):
    matcher = auto_matcher(text_compiler)
    assert consumed(matcher, text_compiler, "ok <tool_call>")
    assert not matcher.is_accepting()  # an open block cannot end the reply
    assert text_compiler.decode(matcher.compute_ff_tokens()) == '{"name": "get_'
    assert consumed(matcher, text_compiler, '{"name": "get_time", "arguments": {}}')
    assert text_compiler.decode(matcher.compute_ff_tokens()) == "</tool_call>"


def test_auto_grammar_without_parallel_calls_allows_one(text_compiler):
    matcher = auto_matcher(text_compiler, parallel=False)
    assert consumed(matcher, text_compiler, f"{CALL} and then ") and matcher.is_accepting()
    assert not consumed(matcher, text_compiler, "<tool_call>")


def test_auto_grammar_is_exact_under_speculation(target):
    calling = resolve_tool_calling(tools=TOOLS, tool_choice="auto", parallel_tool_calls=None, constrain_auto=True)
    params = SamplingParams(max_tokens=40, temperature=0, structured_outputs=calling.constraint())
    prompts = [prompt(10, seed=92), prompt(5, seed=93) * 3]
    plain = [o.outputs[0].token_ids for o in LLM(model=target, max_model_len=256).generate(prompts, params)]
    for method in ("ngram", "suffix"):
        config = {"method": method, "num_speculative_tokens": 6}
        spec = LLM(model=target, max_model_len=256, speculative_config=config).generate(prompts, params)
        assert [o.outputs[0].token_ids for o in spec] == plain, method


def other_stream(parser: str, *, parallel: bool = True):
    calling = resolve_tool_calling(tools=TOOLS, tool_choice="auto", parallel_tool_calls=parallel, parser=parser)
    return calling.new_stream()


OTHER_PARSER_CASES = [
    # (parser, reply, content, calls)
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}',
        "",
        [("get_weather", {"city": "Oslo", "days": 2})],
    ),
    (
        "llama3_json",
        ' {"name": "get_time", "arguments": {}}; {"name": "get_weather", "parameters": {"city": "Rome", "days": 1}}',
        "",
        [("get_time", {}), ("get_weather", {"city": "Rome", "days": 1})],
    ),
    ("llama3_json", "It is sunny in Oslo.", "It is sunny in Oslo.", []),
    ("llama3_json", '{"name": "launch", "parameters": {}}', '{"name": "launch", "parameters": {}}', []),  # not a tool
    ("llama3_json", '{"name": "get_time", "param', '{"name": "get_time", "param', []),  # cut short
    (
        "pythonic",
        '[get_weather(city="Oslo", days=2), get_time()]',
        "",
        [("get_weather", {"city": "Oslo", "days": 2}), ("get_time", {})],
    ),
    ("pythonic", "[get_weather(city='Rome', days=1)]\n", "", [("get_weather", {"city": "Rome", "days": 1})]),
    ("pythonic", "Sure: [get_time()]", "Sure: [get_time()]", []),  # calls only when the reply is nothing else
    ("pythonic", "[get_weather('Oslo', 2)]", "[get_weather('Oslo', 2)]", []),  # positional: no names to map
    ("pythonic", "[__import__('os').system('x')]", "[__import__('os').system('x')]", []),  # never evaluated
    ("pythonic", "[get_time(at={1, 2})]", "[get_time(at={1, 2})]", []),  # a set is not JSON
    ("pythonic", "[1, 2, 3]", "[1, 2, 3]", []),
]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), OTHER_PARSER_CASES)
def test_llama3_json_and_pythonic_parsers(parser, text, content, calls):
    for cuts in splits(text):
        whole, streamed = whole_and_streamed(lambda: other_stream(parser), text, cuts)
        assert as_message(streamed) == as_message(whole) == (content, calls), cuts


def test_other_parsers_stream_plain_replies_at_once_and_keep_one_call_without_parallel_calls():
    stream = other_stream("pythonic")
    assert stream.feed("  ").content == "" and stream.feed("Hello").content == "  Hello"
    two = '[get_time(), get_weather(city="x", days=1)]'
    reply = other_stream("pythonic", parallel=False).whole(two)
    assert as_message(reply) == (two, [])  # not one call: left as written


def test_each_parser_s_preamble_says_how_to_call():
    for parser, marker in (("hermes", "<tool_call>"), ("llama3_json", '"parameters"'), ("pythonic", "[function_name(")):
        calling = resolve_tool_calling(tools=TOOLS, tool_choice="auto", parallel_tool_calls=None, parser=parser)
        assert marker in calling.preamble()
    pythonic = resolve_tool_calling(
        tools=TOOLS, tool_choice="auto", parallel_tool_calls=None, parser="pythonic", constrain_auto=True
    )
    assert pythonic.constraint() is None  # the call grammar is the hermes format's only


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "pythonic"])
def test_calls_written_into_history_read_back_with_the_server_s_parser(parser):
    from quickdraft.structured.tools import written_calls

    calls = [("get_weather", {"city": 'O\'slo "x"', "days": 2}), ("get_time", {})]
    text = written_calls(calls, parser=parser)
    assert as_message(other_stream(parser).whole(text)) == ("", calls)
    template = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    messages, _ = chat_template_inputs(HISTORY, template=template, calling=None, parser=parser)
    assert messages[1]["content"] == written_calls([("get_weather", {"city": "Oslo", "days": 1})], parser=parser)
