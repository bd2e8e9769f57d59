"""gpt-oss's replies in OpenAI's harmony format, read into reasoning, content and tool calls
(vLLM's `--reasoning-parser openai_gptoss` with `--tool-call-parser openai`).

A gpt-oss reply is a run of messages, each a header and a body between special tokens:

    <|channel|>analysis<|message|>thinking ...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.weather <|constrain|>json<|message|>{"city": "Oslo"}<|call|>
    <|start|>assistant<|channel|>final<|message|>the answer<|return|>

(the prompt ends with `<|start|>assistant`, so the first header starts at its channel).  The
`analysis` channel is the reasoning; a message to `functions.NAME` (its recipient, `to=` in the
header, before or after the channel) is a call of NAME with its body as the arguments; `final`
and `commentary` without a recipient (a preamble the model says before calling) are content.

The markers are special tokens: the server decodes such replies with them kept.  A reply that
does not start with a header is all content (a model not speaking harmony); a header the reply
never finishes gives nothing.  The result is the same whether the text comes whole or in pieces.

Not `openai_harmony`'s parser: it reads token ids with its own copy of the o200k vocabulary,
which it downloads on first use (nothing can be downloaded where this runs, and the GGUF files
carry their own vocabulary); the text form above is all the routing needs.
"""

from __future__ import annotations

import re

from quickdraft.structured.tools import CallDelta, ReplyDelta, ToolCallStream, marker_prefix_length, new_call_id

MESSAGE = "<|message|>"
BODY_ENDS = ("<|end|>", "<|return|>", "<|call|>")
MARKER_START = "<|"  # every marker's
# the tokens that end an assistant's turn for the engine beside the end of sequence (<|return|>)
STOP_TOKENS = ("<|call|>", "<|return|>")
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_FUNCTIONS = "functions."


class HarmonyStream(ToolCallStream):
    """Splits one completion's harmony text as it arrives: reasoning and calls out, content on to
    `inner`.  Text that may be the start of a marker is held back until the next piece says."""

    def __init__(self, inner: ToolCallStream):
        self.inner = inner
        self._state = "header"  # "header", "body" or "plain" (not harmony: all content)
        self._route = "content"  # the body's: "reasoning", "content" or "call"
        self._call_index = -1  # the open call's index
        self._own_calls = 0
        self._pending = ""

    @property
    def num_calls(self) -> int:  # type: ignore[override]
        return self._own_calls + self.inner.num_calls

    def feed(self, text: str) -> ReplyDelta:
        self._pending += text
        out = ReplyDelta()
        while self._pending:
            if self._state == "plain":
                text, self._pending = self._pending, ""
                out += self.inner.feed(text)
            elif self._state == "header":
                opening = self._pending.lstrip()
                if not opening.startswith(MARKER_START) and not MARKER_START.startswith(opening):
                    self._state = "plain"
                    continue
                at = self._pending.find(MESSAGE)
                if at < 0:
                    break  # the header is not whole yet
                out += self._open_body(self._pending[:at])
                self._pending = self._pending[at + len(MESSAGE) :]
            else:
                ends = [(at, end) for end in BODY_ENDS if (at := self._pending.find(end)) >= 0]
                if ends:
                    at, end = min(ends)
                    out += self._body(self._pending[:at])
                    self._pending, self._state = self._pending[at + len(end) :], "header"
                    continue
                keep = _held_back(self._pending)
                out += self._body(self._pending[: len(self._pending) - keep])
                self._pending = self._pending[len(self._pending) - keep :]
                break
        return out

    def finish(self) -> ReplyDelta:
        out = ReplyDelta()
        if self._state == "body":
            out += self._body(self._pending)  # a body cut short (max_tokens)
        elif self._state == "plain":
            out += self.inner.feed(self._pending)
        self._pending = ""
        return out + self.inner.finish()

    def _open_body(self, header: str) -> ReplyDelta:
        self._state = "body"
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        if recipient is not None and recipient.group(1).startswith(_FUNCTIONS):
            self._route, self._call_index = "call", self._own_calls + self.inner.num_calls
            self._own_calls += 1
            name = recipient.group(1).removeprefix(_FUNCTIONS)
            return ReplyDelta(calls=[CallDelta(index=self._call_index, arguments="", call_id=new_call_id(), name=name)])
        self._route = "reasoning" if channel is not None and channel.group(1) == "analysis" else "content"
        return ReplyDelta()

    def _body(self, text: str) -> ReplyDelta:
        if not text:
            return ReplyDelta()
        if self._route == "reasoning":
            return ReplyDelta(reasoning=text)
        if self._route == "call":
            return ReplyDelta(calls=[CallDelta(index=self._call_index, arguments=text)])
        return self.inner.feed(text)


def _held_back(text: str) -> int:
    """The length of the end of `text` that may begin a marker ending the body."""
    return max(marker_prefix_length(text, end) for end in BODY_ENDS)
