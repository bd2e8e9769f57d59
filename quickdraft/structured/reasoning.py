"""A reasoning model's thinking read out of its reply (vLLM's `--reasoning-parser`).

Models such as DeepSeek-R1 and Qwen3 think inside `<think> ... </think>` before answering. A
server started with a reasoning parser returns that part as the message's `reasoning` (vLLM's
field; DeepSeek's older `reasoning_content` is accepted in messages sent back) and the rest as
`content`, which the tool-call parser then reads. The rules, the same whole or streamed:

- a reply that starts with `<think>` (after whitespace) thinks until the first `</think>`;
- `deepseek_r1`: a reply without it thinks from its first token too (R1's template opens the
  block in the prompt); `qwen3`: a reply without it is all content (thinking switched off);
- a block never closed (the reply ran out of tokens) is all reasoning.

vLLM's qwen3 parser returns an unclosed block as content when the reply is whole and as
reasoning when streamed; here both give reasoning, so the streamed pieces join into the whole.

`openai_gptoss` reads gpt-oss's harmony channels instead (structured/harmony.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from quickdraft.structured.harmony import STOP_TOKENS as HARMONY_STOP_TOKENS
from quickdraft.structured.harmony import HarmonyStream
from quickdraft.structured.tools import ReplyDelta, ToolCallStream, marker_prefix_length

THINK_START = "<think>"
THINK_END = "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    opened_by_prompt: bool = False  # the chat template opens the think block: a reply starts inside it
    # "think": <think> blocks; "harmony": gpt-oss's channels, whose markers are special tokens the
    # reply is decoded with and whose calls this parser reads itself (structured/harmony.py)
    format: str = "think"

    def new_stream(self, inner: ToolCallStream) -> ToolCallStream:
        return HarmonyStream(inner) if self.format == "harmony" else ReasoningStream(inner, parser=self)

    @property
    def keeps_special_tokens(self) -> bool:
        return self.format == "harmony"

    @property
    def stop_tokens(self) -> tuple[str, ...]:
        """Tokens that end the reply beside the model's end of sequence (where its vocabulary has them)."""
        return HARMONY_STOP_TOKENS if self.format == "harmony" else ()


REASONING_PARSERS = {
    "deepseek_r1": ReasoningParser(name="deepseek_r1", opened_by_prompt=True),
    "qwen3": ReasoningParser(name="qwen3", opened_by_prompt=False),
    "openai_gptoss": ReasoningParser(name="openai_gptoss", format="harmony"),
}


class ReasoningStream(ToolCallStream):
    """Splits one completion's text into reasoning and content as it arrives; the content goes
    on to `inner` (the tool-call reader).  Text that may be the start of a marker is held back
    until the next piece says what it is."""

    def __init__(self, inner: ToolCallStream, *, parser: ReasoningParser):
        self.inner = inner
        self.parser = parser
        self._state = "start"  # "start" (nothing decided yet), "reasoning" or "content"
        self._pending = ""  # text not yet given out

    @property
    def num_calls(self) -> int:  # type: ignore[override]  # the reader of the content counts them
        return self.inner.num_calls

    def feed(self, text: str) -> ReplyDelta:
        self._pending += text
        out = ReplyDelta()
        while self._pending or self._state == "content":
            if self._state == "start":
                opening = self._pending.lstrip()
                if opening.startswith(THINK_START):
                    self._pending, self._state = opening[len(THINK_START) :], "reasoning"
                    continue
                if THINK_START.startswith(opening):  # whitespace, or "<thi": not known yet
                    break
                self._state = "reasoning" if self.parser.opened_by_prompt else "content"
            elif self._state == "reasoning":
                end = self._pending.find(THINK_END)
                if end >= 0:
                    out += ReplyDelta(reasoning=self._pending[:end])
                    self._pending, self._state = self._pending[end + len(THINK_END) :], "content"
                    continue
                keep = marker_prefix_length(self._pending, THINK_END)
                out += ReplyDelta(reasoning=self._pending[: len(self._pending) - keep])
                self._pending = self._pending[len(self._pending) - keep :]
                break
            else:
                text, self._pending = self._pending, ""
                if text:
                    out += self.inner.feed(text)
                break
        return out

    def finish(self) -> ReplyDelta:
        out = ReplyDelta()
        if self._state == "start":
            self._state = "reasoning" if self.parser.opened_by_prompt else "content"
        if self._state == "reasoning":
            out += ReplyDelta(reasoning=self._pending)  # a block the reply never closed
        elif self._pending:
            out += self.inner.feed(self._pending)
        self._pending = ""
        return out + self.inner.finish()
