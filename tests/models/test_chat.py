"""One chat rendering for LLM.chat, the server's chat endpoint and /tokenize (models/chat.py)."""

from __future__ import annotations

import pytest

from quickdraft.models.chat import ChatRenderError, ChatRendering, render_chat
from quickdraft.models.tokenizer import Tokenizer
from quickdraft.structured.tools import resolve_tool_calling

TEMPLATE = (
    "{% for m in messages %}[{{ m.role }}] {{ m.content }}<end>{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)
TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoints) -> Tokenizer:
    return Tokenizer.from_dir(tiny_checkpoints["gemma3"])  # no chat template of its own


def render(tokenizer, messages, **fields) -> str:
    return render_chat(tokenizer, messages, ChatRendering(**fields), missing_template="send a prompt")


def test_rendering_with_a_given_template_and_variables(tokenizer):
    messages = [{"role": "user", "content": "hi"}]
    assert render(tokenizer, messages, template=TEMPLATE) == "[user] hi<end>[assistant] "
    greeting = "{{ greeting }}" + TEMPLATE
    assert render(tokenizer, messages, template=greeting, variables={"greeting": "Hello! "}).startswith("Hello! [user]")


def test_a_continued_final_message_is_left_open(tokenizer):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon "}]
    text = render(tokenizer, messages, template=TEMPLATE, add_generation_prompt=False, continue_final_message=True)
    assert text == "[user] hi<end>[assistant] Once upon"
    parts = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "text", "text": "Once "}]}]
    opened = render(tokenizer, parts, template=TEMPLATE, add_generation_prompt=False, continue_final_message=True)
    assert opened.endswith("Once") and "<end>" in opened  # content parts: their text is the message's


def test_tools_reach_a_template_that_reads_them_or_a_preamble(tokenizer):
    calling = resolve_tool_calling(tools=[TOOL], tool_choice="auto", parallel_tool_calls=None)
    messages = [{"role": "user", "content": "time?"}]
    reading = "{{ tools | tojson }}" + TEMPLATE
    assert render(tokenizer, messages, template=reading, calling=calling).startswith('[{"type": "function"')
    preamble = render(tokenizer, messages, template=TEMPLATE, calling=calling)
    assert preamble.startswith("[system] ") and "get_time" in preamble and "[user] time?" in preamble


@pytest.mark.parametrize(
    ("messages", "fields", "param", "message"),
    [
        (
            [{"role": "user", "content": "hi"}],
            {},
            "messages",
            "no chat template, so it cannot take chat messages; send a prompt",
        ),
        ([{"role": "user", "content": "hi"}], {"template": "{% if %}"}, "chat_template", "not a valid jinja template"),
        (
            [{"role": "user", "content": "hi"}],
            {"template": "{{ raise_exception('only one turn') }}"},
            "messages",
            "refused them: only one turn",
        ),
        (
            [{"role": "user", "content": "hi"}],
            {"template": TEMPLATE, "continue_final_message": True},
            "continue_final_message",
            "needs add_generation_prompt: false",
        ),
        (
            [{"role": "user", "content": "  "}],
            {"template": TEMPLATE, "continue_final_message": True, "add_generation_prompt": False},
            "continue_final_message",
            "needs a last message with text",
        ),
        (
            [{"role": "user", "content": "hi"}],
            {
                "template": "{{ messages[0].content | upper }}",
                "continue_final_message": True,
                "add_generation_prompt": False,
            },
            "continue_final_message",
            "does not write the last message's text",
        ),
        (
            [{"role": "user", "content": "hi"}],
            {"template": TEMPLATE, "variables": {"tools": []}},
            "chat_template_kwargs",
            "may not set ['tools']",
        ),
    ],
)
def test_what_cannot_be_rendered_names_its_input(tokenizer, messages, fields, param, message):
    with pytest.raises(ChatRenderError) as caught:
        render(tokenizer, messages, **fields)
    assert caught.value.param == param and message in str(caught.value)
