"""A conversation rendered through a chat template: one path for `LLM.chat`, the server's chat
endpoint and `/tokenize`, so that they write the same prompt text for the same messages."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from quickdraft.models.tokenizer import Tokenizer, check_chat_template
from quickdraft.structured.tools import ToolCalling, chat_template_inputs

# Template variables the renderer sets itself: `variables` may not replace them.
RESERVED_TEMPLATE_VARIABLES = ("messages", "add_generation_prompt", "tools", "documents")


class ChatRenderError(ValueError):
    """A conversation that cannot be rendered; `param` names the input at fault (a server's 400)."""

    def __init__(self, message: str, *, param: str, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass(frozen=True)
class ChatRendering:
    """How a conversation is rendered: vLLM's chat fields."""

    template: str | None = None  # jinja text; None: the model's own
    add_generation_prompt: bool = True
    # The last message stays open for the model to continue (a prefilled reply).
    continue_final_message: bool = False
    variables: dict[str, Any] = field(default_factory=dict)  # more template variables
    documents: list[dict[str, str]] | None = None  # for RAG templates (the variable `documents`)
    calling: ToolCalling | None = None  # tools shown to the model
    tool_call_parser: str = "hermes"  # the format earlier calls are written back in

    def __post_init__(self):
        if self.continue_final_message and self.add_generation_prompt:
            raise ChatRenderError(
                "continue_final_message needs add_generation_prompt: false (the reply continues the last "
                "message instead of starting a new one)",
                param="continue_final_message",
            )
        reserved = sorted(set(self.variables) & set(RESERVED_TEMPLATE_VARIABLES))
        if reserved:
            raise ChatRenderError(
                f"chat_template_kwargs may not set {reserved}: they are set from the request itself",
                param="chat_template_kwargs",
            )
        if self.template is not None:
            try:
                check_chat_template(self.template)
            except ValueError as err:
                raise ChatRenderError(str(err), param="chat_template") from err


def render_chat(
    tokenizer: Tokenizer, messages: list[dict[str, Any]], rendering: ChatRendering, *, missing_template: str
) -> str:
    """The prompt text of `messages`; a ChatRenderError naming the input at fault.
    `missing_template` says what to do where neither the model nor `rendering` has a template."""
    template = rendering.template if rendering.template is not None else tokenizer.chat_template
    if template is None:
        raise ChatRenderError(
            f"this model has no chat template, so it cannot take chat messages; {missing_template}",
            param="messages",
            code="chat_template_missing",
        )
    if rendering.continue_final_message and (not messages or not _text_of(messages[-1]).strip()):
        raise ChatRenderError("continue_final_message needs a last message with text", param="continue_final_message")
    messages, tool_variables = chat_template_inputs(
        messages, template=template, calling=rendering.calling, parser=rendering.tool_call_parser
    )
    try:
        text = tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=rendering.add_generation_prompt,
            chat_template=template,
            **(rendering.variables | tool_variables | _documents(rendering.documents)),
        )
    except Exception as err:  # the template's own checks (roles must alternate, ...) raise
        raise ChatRenderError(f"messages: the chat template refused them: {err}", param="messages") from err
    if rendering.continue_final_message:
        text = _open_final_message(text, final=_text_of(messages[-1]))
    return text


def _documents(documents: list[dict[str, str]] | None) -> dict[str, Any]:
    return {} if documents is None else {"documents": documents}


def _text_of(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return ""


def _open_final_message(text: str, *, final: str) -> str:
    """The rendered conversation cut after the last message's text, so the reply continues it
    (what the template writes after a message, an end-of-turn token, goes)."""
    end = text.rfind(final.strip())
    if end < 0:
        raise ChatRenderError(
            "continue_final_message: the chat template does not write the last message's text as given, "
            "so the conversation cannot be left open after it",
            param="continue_final_message",
        )
    return text[: end + len(final.strip())]
