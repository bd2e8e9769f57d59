"""Function calling (OpenAI's ``tools`` / ``tool_choice``) on top of structured outputs.

``tool_choice`` decides how the reply becomes tool calls:

- ``"none"``: plain text; the tools are not shown to the model.
- a named function (``{"type": "function", "function": {"name": ...}}``): the reply is constrained
  to that function's ``parameters`` schema and becomes one call of it, streamed as it is decoded.
- ``"required"``: the reply is constrained to a JSON array of ``{"name": ..., "parameters": ...}``
  calls of the given tools (one at most when ``parallel_tool_calls`` is false); each call goes out
  once its object is complete.
- ``"auto"``: the reply is free text, read by a tool-call parser (``hermes``: calls written as
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``); text outside the tags stays content.

The constrained modes are ordinary structured outputs, so every drafter stays exact, and the
schema's keys and punctuation are forced tokens the ``grammar`` drafter proposes for free.

Why hand-written parsing: the parsers of vLLM and SGLang are tied to their servers' request and
delta classes; what is parsed here is small (a JSON array that the grammar guarantees, and one tag
format read with ``json``), and the streamed and whole replies come from the same code.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from quickdraft.structured.params import StructuredOutputsParams

# OpenAI's rule for function names.
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# hermes: <tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks in text (Qwen, Hermes);
# llama3_json: a reply that is {"name": ..., "parameters": {...}} objects, "; " between them
# (Llama 3.1-3.3); pythonic: a reply that is [f(a=1), g()] (Llama 3.2 / 4, Gemma 3 prompts).
# "openai": gpt-oss's harmony calls, which the openai_gptoss reasoning parser reads (structured/harmony.py)
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "pythonic", "openai")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
ToolChoiceMode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class FunctionTool:
    name: str
    description: str | None
    parameters: dict[str, Any]  # JSON schema of the arguments ({"type": "object"} when not given)

    def as_template_value(self) -> dict[str, Any]:
        """The tool as chat templates read it (transformers' convention)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


def parse_tools(tools: Any) -> list[FunctionTool]:
    """OpenAI's `tools` list, checked; a ValueError naming the first bad field (``tools[i]...``)."""
    if not isinstance(tools, list) or not tools:
        raise ValueError(f"tools must be a non-empty list of function tools, got {tools!r}")
    parsed: list[FunctionTool] = []
    for position, tool in enumerate(tools):
        where = f"tools[{position}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise ValueError(f'{where} must be {{"type": "function", "function": {{"name": ...}}}}, got {tool!r}')
        unknown = sorted(set(tool) - {"type", "function"})
        if unknown:
            raise ValueError(f"{where}: unknown fields {unknown}")
        parsed.append(_parse_function(tool["function"], where=f"{where}.function"))
    names = [tool.name for tool in parsed]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"tools: each function name once; repeated: {repeated}")
    return parsed


def _parse_function(function: dict[str, Any], *, where: str) -> FunctionTool:
    unknown = sorted(set(function) - {"name", "description", "parameters", "strict"})
    if unknown:
        raise ValueError(f"{where}: unknown fields {unknown}")
    name = function.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
        raise ValueError(f"{where}.name must be 1-64 letters, digits, '_' or '-', got {name!r}")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise ValueError(f"{where}.description must be a string, got {description!r}")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ValueError(f"{where}.strict must be a bool, got {strict!r}")
    parameters = function.get("parameters", {"type": "object"})
    if not isinstance(parameters, dict):
        raise ValueError(f"{where}.parameters must be a JSON schema object, got {parameters!r}")
    try:  # the schema is compiled for the constrained modes: find a bad one now, whatever the mode
        StructuredOutputsParams(json=parameters)
    except ValueError as err:
        raise ValueError(f"{where}.parameters: {str(err).removeprefix('structured_outputs.json')}") from err
    return FunctionTool(name=name, description=description, parameters=parameters)


@dataclass(frozen=True)
class ToolCalling:
    """How one request's reply becomes tool calls (from `tools`, `tool_choice`, `parallel_tool_calls`)."""

    mode: ToolChoiceMode
    tools: list[FunctionTool]
    named: str | None = None  # the function of the "named" mode
    parallel: bool = True
    # "auto": hold the calls the reply writes to the tools' schemas (free text stays free; the
    # hermes format only: the others have no tag that tells a call from text)
    constrain_auto: bool = False
    parser: str = "hermes"  # how an "auto" reply's calls are written (TOOL_CALL_PARSERS)

    def constraint(self) -> StructuredOutputsParams | None:
        """The structured output the reply must match (None: free text)."""
        if self.mode == "named":
            return StructuredOutputsParams(json=self._tool(self.named).parameters)
        if self.mode == "auto" and self.constrain_auto and self.parser == "hermes":
            return StructuredOutputsParams(structural_tag=self._auto_structural_tag())
        if self.mode != "required":
            return None
        calls: dict[str, Any] = {"type": "array", "items": {"anyOf": self._call_schemas("parameters")}, "minItems": 1}
        if not self.parallel:
            calls["maxItems"] = 1
        return StructuredOutputsParams(json=calls)

    def _auto_structural_tag(self) -> dict[str, Any]:
        """Free text in which each <tool_call> block holds a call of one of the tools (once only
        without parallel calls): a structural tag triggered by the opening tag."""
        call = {"type": "json_schema", "json_schema": {"anyOf": self._call_schemas("arguments")}}
        tag = {"type": "tag", "begin": HERMES_OPEN, "content": call, "end": HERMES_CLOSE}
        calls = {
            "type": "triggered_tags",
            "triggers": [HERMES_OPEN],
            "tags": [tag],
            "stop_after_first": not self.parallel,
        }
        return {"type": "structural_tag", "format": calls}

    def _call_schemas(self, arguments_key: str) -> list[dict[str, Any]]:
        """One schema per tool: {"name": its name, arguments_key: its parameters}."""
        return [
            {
                "type": "object",
                "properties": {"name": {"const": tool.name}, arguments_key: tool.parameters},
                "required": ["name", arguments_key],
                "additionalProperties": False,
            }
            for tool in self.tools
        ]

    def template_tools(self) -> list[dict[str, Any]] | None:
        """What the chat template gets as `tools` (None: the model is not shown them)."""
        if self.mode == "none":
            return None
        shown = [self._tool(self.named)] if self.mode == "named" else self.tools
        return [tool.as_template_value() for tool in shown]

    def preamble(self) -> str:
        """The tools and how to call them, for a chat template that does not show `tools` itself."""
        shown = self.template_tools() or []
        listing = "\n".join(json.dumps(tool["function"], ensure_ascii=False) for tool in shown)
        if self.mode == "named":
            how = f"Reply with the arguments of {self.named} as one JSON object."
        elif self.mode == "required":
            how = 'Reply with a JSON array of calls, each {"name": <function name>, "parameters": <arguments>}.'
        elif self.parser == "llama3_json":
            how = (
                'To call a function, reply with only {"name": <function name>, "parameters": <arguments object>}; '
                "otherwise reply normally."
            )
        elif self.parser == "pythonic":
            how = (
                "To call functions, reply with only a Python list of calls with keyword arguments, "
                '[function_name(argument="value"), ...]; otherwise reply normally.'
            )
        else:
            how = (
                f'To call a function, reply with {HERMES_OPEN}{{"name": <function name>, "arguments": '
                f"<arguments object>}}{HERMES_CLOSE}; otherwise reply normally."
            )
        return f"You can call these functions (JSON definitions):\n{listing}\n{how}"

    def new_stream(self) -> ToolCallStream:
        """A parser for one completion's text."""
        if self.mode == "named":
            return NamedCallStream(name=self.named or "")
        if self.mode == "required":
            return RequiredCallsStream()
        names = frozenset(tool.name for tool in self.tools)
        if self.mode == "auto" and self.parser == "llama3_json":
            return WholeReplyCallsStream(opening="{", read=_llama3_json_calls, names=names, parallel=self.parallel)
        if self.mode == "auto" and self.parser == "pythonic":
            return WholeReplyCallsStream(opening="[", read=_pythonic_calls, names=names, parallel=self.parallel)
        if self.mode == "auto" and self.parser == "openai":
            return PlainTextStream()  # the calls are harmony messages: the reasoning parser reads them
        if self.mode == "auto":
            return HermesCallStream(names=names, parallel=self.parallel)
        return PlainTextStream()

    def finish_reason(self, reason: str | None, stream: ToolCallStream) -> str | None:
        """OpenAI's: "tool_calls" where the model chose to call (a named call ends with "stop")."""
        if reason == "stop" and stream.num_calls and self.mode in ("required", "auto"):
            return "tool_calls"
        return reason

    def _tool(self, name: str | None) -> FunctionTool:
        return next(tool for tool in self.tools if tool.name == name)


def resolve_tool_calling(
    *,
    tools: Any,
    tool_choice: Any,
    parallel_tool_calls: bool | None,
    constrain_auto: bool = False,
    parser: str = "hermes",
) -> ToolCalling | None:
    """The request's tool calling, or None when it has no tools and asks for none. ValueErrors
    start with the field at fault (``tools...`` or ``tool_choice...``). `constrain_auto`: the
    calls of an "auto" reply are held to the tools' schemas (ToolCalling.constraint)."""
    if not tools:
        if tool_choice in (None, "none", "auto"):
            return None
        raise ValueError(f"tool_choice {tool_choice!r} needs tools")
    parsed = parse_tools(tools)
    parallel = True if parallel_tool_calls is None else parallel_tool_calls
    choice = "auto" if tool_choice is None else tool_choice  # OpenAI's default when tools are given
    if choice in ("none", "auto", "required"):
        return ToolCalling(mode=choice, tools=parsed, parallel=parallel, constrain_auto=constrain_auto, parser=parser)
    name = _named_function(choice)
    if name not in {tool.name for tool in parsed}:
        raise ValueError(f"tool_choice names the function {name!r}, which is not among the tools")
    return ToolCalling(mode="named", tools=parsed, named=name, parallel=parallel)


def _named_function(choice: Any) -> str:
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise ValueError(
            'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}, '
            f"got {choice!r}"
        )
    return name


# ---- parsing a reply into content and calls ----------------------------------------------
@dataclass
class CallDelta:
    """A piece of one tool call; `call_id` and `name` come with the call's first piece only."""

    index: int
    arguments: str
    call_id: str | None = None
    name: str | None = None

    def body(self) -> dict[str, Any]:
        """OpenAI's streamed `delta.tool_calls[k]`."""
        if self.call_id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        function = {"name": self.name, "arguments": self.arguments}
        return {"index": self.index, "id": self.call_id, "type": "function", "function": function}


@dataclass
class ReplyDelta:
    """What new text adds to a reply: content, pieces of calls, and thinking (a reasoning
    parser's: structured/reasoning.py)."""

    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)
    reasoning: str = ""

    def __add__(self, other: ReplyDelta) -> ReplyDelta:
        return ReplyDelta(
            content=self.content + other.content,
            calls=self.calls + other.calls,
            reasoning=self.reasoning + other.reasoning,
        )

    def __bool__(self) -> bool:
        return bool(self.content or self.calls or self.reasoning)


def merged_calls(calls: list[CallDelta]) -> list[dict[str, Any]]:
    """Pieces of calls joined into OpenAI's `message.tool_calls` (what a streaming client builds)."""
    merged: dict[int, dict[str, Any]] = {}
    for piece in calls:
        if piece.call_id is not None:
            merged[piece.index] = piece.body()
        else:
            merged[piece.index]["function"]["arguments"] += piece.arguments
    return [merged[index] for index in sorted(merged)]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallStream:
    """Reads one completion's text as it arrives; `feed` and `finish` give what may go out."""

    num_calls = 0

    def feed(self, text: str) -> ReplyDelta:
        raise NotImplementedError

    def finish(self) -> ReplyDelta:
        return ReplyDelta()

    def whole(self, text: str) -> ReplyDelta:
        return self.feed(text) + self.finish()

    def _new_call(self, name: str, arguments: str) -> CallDelta:
        """The first piece of the reply's next call (`arguments`: JSON text)."""
        index, self.num_calls = self.num_calls, self.num_calls + 1
        return CallDelta(index=index, arguments=arguments, call_id=new_call_id(), name=name)


class PlainTextStream(ToolCallStream):
    def feed(self, text: str) -> ReplyDelta:
        return ReplyDelta(content=text)


class NamedCallStream(ToolCallStream):
    """The whole reply is the arguments of one call (the grammar holds it to the schema)."""

    def __init__(self, *, name: str):
        self.name = name

    def feed(self, text: str) -> ReplyDelta:
        if self.num_calls:
            return ReplyDelta(calls=[CallDelta(index=0, arguments=text)] if text else [])
        text = text.lstrip(" \t\r\n")  # after a think block the arguments may follow a blank line
        return ReplyDelta(calls=[self._new_call(self.name, text)]) if text else ReplyDelta()

    def finish(self) -> ReplyDelta:
        return ReplyDelta(calls=[self._new_call(self.name, "")]) if not self.num_calls else ReplyDelta()


class RequiredCallsStream(ToolCallStream):
    """A JSON array of {"name", "parameters"} objects; each call goes out once its object is whole.
    A reply cut short (max_tokens) keeps its unfinished rest as content."""

    def __init__(self) -> None:
        self._text = ""
        self._position = 0  # where the next array item starts (after "[" or ",")
        self._decoder = json.JSONDecoder()

    def feed(self, text: str) -> ReplyDelta:
        self._text += text
        calls = []
        while True:
            start = self._next_item_start()
            if start is None:
                break
            try:
                item, end = self._decoder.raw_decode(self._text, start)
            except json.JSONDecodeError:
                break  # the object is not complete yet
            calls.append(self._new_call(item.get("name"), json.dumps(item.get("parameters", {}), ensure_ascii=False)))
            self._position = end
        return ReplyDelta(calls=calls)

    def _next_item_start(self) -> int | None:
        position = self._position
        while position < len(self._text) and self._text[position] in " \t\r\n[,":
            position += 1
        return position if position < len(self._text) and self._text[position] == "{" else None

    def finish(self) -> ReplyDelta:
        rest = self._text[self._position :].lstrip(" \t\r\n[,").rstrip()
        return ReplyDelta(content="" if rest in ("", "]") else rest)


class HermesCallStream(ToolCallStream):
    """Text with calls written as <tool_call>{"name": ..., "arguments": {...}}</tool_call>.

    Text that may be the start of a tag is held back until it is known not to be; whitespace
    is held until text follows it, and dropped beside a call (so a reply of calls has no
    content); a reply without calls is its text as written. A block that is not a call of one
    of the tools (bad JSON, unknown name), a call past the first when parallel calls are off,
    and an unclosed block that does not read as a call stay content, as written.
    """

    def __init__(self, *, names: frozenset[str], parallel: bool):
        self.names = names
        self.parallel = parallel
        self._pending = ""  # text not read yet: a possible tag's start, or an open block
        self._space = ""  # trailing whitespace read, given out only before more text
        self._after_call = False  # no text since the last call
        self._in_call = False

    def feed(self, text: str) -> ReplyDelta:
        self._pending += text
        out = ReplyDelta()
        while True:
            if self._in_call:
                end = self._pending.find(HERMES_CLOSE)
                if end < 0:
                    return out
                end += len(HERMES_CLOSE)
                block, self._pending = self._pending[:end], self._pending[end:]
                self._in_call = False
                out += self._block(block)
                continue
            start = self._pending.find(HERMES_OPEN)
            if start < 0:
                ready = len(self._pending) - _tag_prefix_length(self._pending, HERMES_OPEN)
                text, self._pending = self._pending[:ready], self._pending[ready:]
                return out + self._content(text)
            text, self._pending = self._pending[:start], self._pending[start:]
            out += self._content(text)
            self._in_call = True

    def _content(self, text: str) -> ReplyDelta:
        body = text.rstrip()
        if self._after_call:  # whitespace between a call and the text after it is dropped
            body = body.lstrip()
        if not body:
            self._space += text
            return ReplyDelta()
        lead = "" if self._after_call else self._space
        self._space, self._after_call = text[len(text.rstrip()) :], False
        return ReplyDelta(content=lead + body)

    def _block(self, block: str) -> ReplyDelta:
        return self._take(self._read_call(block[len(HERMES_OPEN) : len(block) - len(HERMES_CLOSE)]), written=block)

    def _take(self, call: tuple[str, str] | None, *, written: str) -> ReplyDelta:
        """A block read as `call` (None: not a call): the call, or its text as content."""
        if call is None or (self.num_calls and not self.parallel):
            return self._content(written)
        self._space, self._after_call = "", True  # whitespace before a call is dropped
        return ReplyDelta(calls=[self._new_call(*call)])

    def _read_call(self, inside: str) -> tuple[str, str] | None:
        try:
            call = json.loads(inside)
        except json.JSONDecodeError:
            return None
        if not isinstance(call, dict) or call.get("name") not in self.names:
            return None
        arguments = call.get("arguments", call.get("parameters", {}))
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return None
        if not isinstance(arguments, dict):
            return None
        return call["name"], json.dumps(arguments, ensure_ascii=False)

    def finish(self) -> ReplyDelta:
        rest, self._pending = self._pending, ""
        if self._in_call:  # an unclosed block (the reply ended inside it): a call if it reads as one
            self._in_call = False
            call = self._read_call(rest[len(HERMES_OPEN) :])
            if call is not None:
                return self._take(call, written=rest)
        out = self._content(rest)
        if not self.num_calls:  # a reply without calls keeps its text as written
            out += ReplyDelta(content=self._space)
        return out


class WholeReplyCallsStream(ToolCallStream):
    """A reply that is calls and nothing else, in a format that `read` parses (llama3_json,
    pythonic): a reply that starts with `opening` is held to its end and becomes calls if it
    reads as calls of the tools (one when parallel calls are off), else it is content, as written;
    any other reply streams as content."""

    def __init__(self, *, opening: str, read, names: frozenset[str], parallel: bool):
        self.opening = opening
        self.read = read  # text -> [(name, arguments dict)], or None when it is not calls
        self.names = names
        self.parallel = parallel
        self._held = ""
        self._holding: bool | None = None  # None until the first text that is not whitespace

    def feed(self, text: str) -> ReplyDelta:
        if self._holding is False:
            return ReplyDelta(content=text)
        self._held += text
        if self._holding is None and self._held.strip():
            self._holding = self._held.lstrip().startswith(self.opening)
            if not self._holding:
                text, self._held = self._held, ""
                return ReplyDelta(content=text)
        return ReplyDelta()

    def finish(self) -> ReplyDelta:
        held, self._held = self._held, ""
        calls = self.read(held) if self._holding else None
        valid = calls and all(name in self.names for name, _ in calls) and (self.parallel or len(calls) == 1)
        if not valid:
            return ReplyDelta(content=held if held.strip() else "")
        return ReplyDelta(
            calls=[self._new_call(name, json.dumps(arguments, ensure_ascii=False)) for name, arguments in calls]
        )


def _llama3_json_calls(text: str) -> list[tuple[str, dict[str, Any]]] | None:
    """{"name": ..., "parameters": {...}} objects (or "arguments"), separated by ";"."""
    decoder, calls, position = json.JSONDecoder(), [], 0
    text = text.strip()
    while position < len(text):
        try:
            call, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return None
        arguments = call.get("parameters", call.get("arguments", {})) if isinstance(call, dict) else None
        if not isinstance(arguments, dict) or not isinstance(call.get("name"), str):
            return None
        calls.append((call["name"], arguments))
        while position < len(text) and text[position] in " \t\r\n;":
            position += 1
    return calls or None


def _pythonic_calls(text: str) -> list[tuple[str, dict[str, Any]]] | None:
    """[f(a=1, b="x"), g()]: a list of calls by name with literal keyword arguments (read by
    Python's parser, never evaluated)."""
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(tree, ast.List):
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        try:
            arguments = {keyword.arg: ast.literal_eval(keyword.value) for keyword in node.keywords}
        except ValueError:
            return None
        if None in arguments:  # **kwargs
            return None
        try:
            json.dumps(arguments)
        except (TypeError, ValueError):  # a set, bytes, a complex number: not JSON
            return None
        calls.append((node.func.id, arguments))
    return calls or None


def _tag_prefix_length(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag`."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


# ---- the conversation as the chat template reads it -----------------------------------------
def template_messages(messages: list[dict[str, Any]], *, template: str, parser: str = "hermes") -> list[dict[str, Any]]:
    """Messages with assistant `tool_calls` as templates read them: arguments as objects (as
    transformers' templates expect); a template that shows no tool calls gets them written into
    the content, in the format `parser` reads, so the history keeps them."""
    shows_calls = "tool_calls" in template
    rendered = []
    for message in messages:
        calls = message.get("tool_calls")
        if not calls:
            rendered.append(message)
            continue
        calls = [_call_for_template(call) for call in calls]
        if shows_calls:
            rendered.append({**message, "tool_calls": calls})
            continue
        written = written_calls([(c["function"]["name"], c["function"]["arguments"]) for c in calls], parser=parser)
        rendered.append(
            {key: value for key, value in message.items() if key != "tool_calls"}
            | {"content": (message.get("content") or "") + written}
        )
    return rendered


def written_calls(calls: list[tuple[str, Any]], *, parser: str) -> str:
    """Calls (name, arguments) as a model writes them in `parser`'s format (what it reads back)."""
    if parser == "llama3_json":
        return "; ".join(json.dumps({"name": name, "parameters": arguments}) for name, arguments in calls)
    if parser == "pythonic":

        def call(name: str, arguments: Any) -> str:
            pairs = arguments.items() if isinstance(arguments, dict) else []
            return f"{name}({', '.join(f'{key}={value!r}' for key, value in pairs)})"

        return "[" + ", ".join(call(name, arguments) for name, arguments in calls) + "]"
    return "".join(
        f"{HERMES_OPEN}{json.dumps({'name': name, 'arguments': arguments})}{HERMES_CLOSE}" for name, arguments in calls
    )


def _call_for_template(call: dict[str, Any]) -> dict[str, Any]:
    function = dict(call["function"])
    try:
        function["arguments"] = json.loads(function["arguments"])
    except (json.JSONDecodeError, TypeError):
        pass  # left as written: the template shows the string
    return {**call, "function": function}


def with_preamble(messages: list[dict[str, Any]], preamble: str) -> list[dict[str, Any]]:
    """The preamble as the system message (before an existing one's text)."""
    if messages and messages[0].get("role") == "system":
        first = messages[0]
        return [{**first, "content": f"{preamble}\n\n{first.get('content') or ''}"}, *messages[1:]]
    return [{"role": "system", "content": preamble}, *messages]


def chat_template_inputs(
    messages: list[dict[str, Any]], *, template: str, calling: ToolCalling | None, parser: str = "hermes"
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and extra variables to render a conversation with: `tools` for a template
    that reads them, else the preamble as the system message; earlier calls in `parser`'s format
    where the template does not show them."""
    messages = template_messages(messages, template=template, parser=parser)
    tools = None if calling is None else calling.template_tools()
    if tools is None:
        return messages, {}
    if "tools" in template:
        return messages, {"tools": tools}
    return with_preamble(messages, calling.preamble()), {}


def marker_prefix_length(text: str, marker: str) -> int:
    """The length of the longest end of `text` that starts `marker` (held back: the next piece
    may complete it)."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0
