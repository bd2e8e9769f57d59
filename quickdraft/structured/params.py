"""What a request asks its output to match (vLLM's ``StructuredOutputsParams`` shape).

Exactly one of ``json`` (a JSON schema, dict or string), ``json_object`` (any JSON object),
``regex``, ``choice`` (a list of strings), ``grammar`` (Lark, or GBNF, which is converted) or
``structural_tag`` (free text in which each trigger starts a tagged JSON structure) is given.
The constraint is compiled to an llguidance grammar and checked at construction (without a
tokenizer), so an invalid schema, regex or grammar is a ``ValueError`` that starts
with ``structured_outputs.<field>`` and names the problem, before any request is queued.
"""

from __future__ import annotations

import json as json_module
import re
from dataclasses import dataclass, field
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


def json_layout(*, flexible: bool, whitespace_pattern: str | None = None) -> dict[str, Any]:
    """llguidance's JSON options: json.dumps' separators, and any other whitespace only if flexible
    (also an inline schema's "x-guidance" inside a Lark grammar); a whitespace pattern (vLLM's
    whitespace_pattern, a regex) is the whitespace allowed between tokens instead."""
    if whitespace_pattern is not None:
        return {"whitespace_flexible": True, "whitespace_pattern": whitespace_pattern}
    return {"whitespace_flexible": flexible, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class TaggedStructure:
    """A JSON value between two fixed strings (a structural tag's structure, a tool call block)."""

    begin: str  # starts with one of the grammar's triggers
    schema: dict[str, Any] | bool  # the JSON schema of what comes between
    end: str


def tagged_text_grammar(
    structures: list[TaggedStructure], *, triggers: list[str], repeat: bool, layout: dict[str, Any]
) -> str:
    """A Lark grammar of free text in which every trigger starts one of the structures whose
    begin starts with it: text up to the first trigger (a lazy match ending at it), the rest of
    the begin, the JSON, the end, then the same again (once only without `repeat`); text without
    a trigger ends the output. Inside a structure its keys and punctuation are forced tokens."""
    # a trigger as a regex inside /.../ (its slashes escaped too)
    no_trigger = "~/(.|\\n)*(" + "|".join(re.escape(t).replace("/", "\\/") for t in triggers) + ")(.|\\n)*/"
    after = "start" if repeat else "TEXT"
    lines = [f"start: TEXT | segment {after}"]
    segments = []
    for index, trigger in enumerate(triggers):
        bodies = []
        for structure in structures:
            if not structure.begin.startswith(trigger) or _trigger_of(structure.begin, triggers) != trigger:
                continue
            schema = structure.schema if isinstance(structure.schema, dict) else {}
            parts = [structure.begin[len(trigger) :], None, structure.end]
            json_part = "%json " + json_module.dumps({**schema, "x-guidance": layout})
            bodies.append(" ".join(json_module.dumps(p) if p is not None else json_part for p in parts if p != ""))
        if not bodies:
            continue
        segments.append(f"before_{index} body_{index}")
        lines.append(f"before_{index}[suffix={json_module.dumps(trigger)}]: /(.|\\n)*/ & {no_trigger}")
        lines.append(f"body_{index}: " + " | ".join(bodies))
    lines.insert(1, "segment: " + " | ".join(segments))
    lines.append(f"TEXT: /(.|\\n)*/ & {no_trigger}")
    return "\n".join(lines)


def _trigger_of(begin: str, triggers: list[str]) -> str | None:
    """The longest trigger a structure's begin starts with (its text up to there is free)."""
    return max((t for t in triggers if begin.startswith(t)), key=len, default=None)


@dataclass(kw_only=True)
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None  # a JSON schema
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark (llguidance's dialect) or GBNF (llama.cpp's)
    # vLLM's structural tag (a dict or its JSON text): {"structures": [{"begin", "schema", "end"}],
    # "triggers": [...]}: free text in which each trigger starts one of the structures
    structural_tag: str | dict[str, Any] | None = None
    # vLLM's whitespace_pattern: the whitespace a JSON constraint allows between tokens (a regex);
    # given, it replaces disable_any_whitespace's layout
    whitespace_pattern: str | None = None
    # JSON kinds: True (default) writes JSON with json.dumps' separators (", " and ": ") and no
    # other whitespace; False lets the model put any whitespace between tokens, as vLLM does by
    # default (small models then often loop on newlines, and fewer tokens are forced).
    disable_any_whitespace: bool = True
    # A reasoning model's thinking comes first, unconstrained: the output is a <think> block as
    # that reasoning parser reads it (structured/reasoning.py: "deepseek_r1", "qwen3"), then the
    # constraint (after optional whitespace). None: the constraint holds from the first token.
    reasoning_parser: str | None = None
    # The compiled llguidance grammar (a JSON string), filled at construction.
    compiled: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        given = [kind for kind in KINDS if self._given(kind)]
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs: give exactly one of {', '.join(KINDS)}; got {', '.join(given) or 'none'}"
            )
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(
                f"structured_outputs.disable_any_whitespace must be a bool, got {self.disable_any_whitespace!r}"
            )
        if self.whitespace_pattern is not None and (
            not isinstance(self.whitespace_pattern, str) or _regex_error(self.whitespace_pattern)
        ):
            raise ValueError(
                f"structured_outputs.whitespace_pattern must be a regular expression, got {self.whitespace_pattern!r}"
            )
        layout = json_layout(flexible=not self.disable_any_whitespace, whitespace_pattern=self.whitespace_pattern)
        compiled = _compile(given[0], getattr(self, given[0]), layout=layout)
        if self.reasoning_parser is not None:
            compiled = _after_thinking(compiled, parser=self.reasoning_parser)
        self.compiled = compiled

    def _given(self, kind: str) -> bool:
        value = getattr(self, kind)
        return value is not False if kind == "json_object" else value is not None

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if self._given(kind))

    @classmethod
    def from_value(cls, value: StructuredOutputsParams | dict[str, Any]) -> StructuredOutputsParams:
        """The params from themselves or from a dict of their fields (unknown keys named)."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(
                f"structured_outputs must be StructuredOutputsParams or a dict, got {type(value).__name__}"
            )
        known = (*KINDS, "disable_any_whitespace", "reasoning_parser", "whitespace_pattern")
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise ValueError(f"structured_outputs: unknown fields {unknown}; known: {list(known)}")
        return cls(**value)


def _after_thinking(compiled: str, *, parser: str) -> str:
    """`compiled` behind a think block: free text up to the first </think> (which the prompt
    opened, or the output opens with <think>, as `parser` reads replies), optional whitespace,
    then the constraint as a nested grammar.  The think text is a lazy lexeme: it ends at the
    first </think>, as the reasoning parser splits the reply."""
    from llguidance import LLMatcher

    from quickdraft.structured.reasoning import REASONING_PARSERS  # it imports this module's users

    if parser not in REASONING_PARSERS:
        raise ValueError(
            f"structured_outputs.reasoning_parser must be one of {list(REASONING_PARSERS)}, got {parser!r}"
        )
    opened = REASONING_PARSERS[parser].opened_by_prompt
    grammars = json_module.loads(compiled)["grammars"]
    grammars[0] = {**grammars[0], "name": "constraint"}
    think = "think" if opened else '("<think>" think)?'
    lark = (
        "%llguidance {}\n"
        f"start: {think} GAP @constraint\n"
        'think[lazy]: THINK_TEXT "</think>"\n'
        "THINK_TEXT: /(.|\\n)*/\n"
        "GAP: /[ \\t\\r\\n]*/\n"
    )
    wrapped = json_module.dumps({"grammars": [{"name": "reasoning", "lark_grammar": lark}, *grammars]})
    is_error, messages = LLMatcher.validate_grammar_with_warnings(wrapped)
    if is_error:
        raise ValueError(f"structured_outputs.reasoning_parser: {' '.join(messages[0].split())}")
    return wrapped


def _regex_error(pattern: str) -> bool:
    try:
        re.compile(pattern)
    except re.error:
        return True
    return False


def _read_structural_tag(value: Any, *, name: str) -> tuple[list[TaggedStructure], list[str]]:
    """vLLM's structural tag ({"structures": [...], "triggers": [...]}, or its JSON text), checked:
    a ValueError naming what is wrong."""
    if isinstance(value, str):
        try:
            value = json_module.loads(value)
        except json_module.JSONDecodeError as err:
            raise ValueError(f"{name} is not valid JSON: {err}") from err
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be an object with structures and triggers, got {type(value).__name__}")
    if "format" in value:
        raise ValueError(
            f"{name}: the 'format' form (xgrammar's newer structural tags) is not supported here; "
            "give structures and triggers"
        )
    unknown = sorted(set(value) - {"type", "structures", "triggers"})
    if unknown or value.get("type", "structural_tag") != "structural_tag":
        raise ValueError(f"{name}: expected type, structures and triggers, got {sorted(value)}")
    triggers = value.get("triggers")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise ValueError(f"{name}.triggers must be a non-empty list of non-empty strings, got {triggers!r}")
    raw = value.get("structures")
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"{name}.structures must be a non-empty list, got {raw!r}")
    structures = []
    for index, item in enumerate(raw):
        where = f"{name}.structures[{index}]"
        if not isinstance(item, dict) or set(item) - {"begin", "schema", "end"} or "begin" not in item:
            raise ValueError(f"{where} must be {{begin, schema, end}}, got {item!r}")
        begin, schema, end = item["begin"], item.get("schema", True), item.get("end", "")
        if not isinstance(begin, str) or not isinstance(end, str) or not isinstance(schema, (dict, bool)):
            raise ValueError(f"{where}: begin and end are strings and schema a JSON schema, got {item!r}")
        if schema is False:
            raise ValueError(f"{where}.schema is false: no JSON value would match")
        if _trigger_of(begin, triggers) is None:
            raise ValueError(f"{where}.begin {begin!r} starts with none of the triggers {triggers}")
        structures.append(TaggedStructure(begin=begin, schema=schema, end=end))
    return structures, triggers


def _compile(kind: str, value: Any, *, layout: dict[str, Any]) -> str:
    """The llguidance grammar for one constraint; ValueError naming the field when it is invalid."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    name = f"structured_outputs.{kind}"
    json_options = layout
    if kind == "json_object":
        if value is not True:
            raise ValueError(f"{name} must be true or false, got {value!r}")
        grammar = LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=json_options)
    elif kind == "json":
        schema = value
        if isinstance(schema, str):
            try:
                schema = json_module.loads(schema)
            except json_module.JSONDecodeError as err:
                raise ValueError(f"{name}: the schema is not valid JSON: {err}") from err
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"{name}: a JSON schema is an object, got {type(schema).__name__}")
        grammar = LLMatcher.grammar_from_json_schema(schema, overrides=json_options)
    elif kind == "regex":
        if not isinstance(value, str) or not value:
            raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        grammar = LLMatcher.grammar_from_regex(value)
    elif kind == "choice":
        if not isinstance(value, (list, tuple)) or not value or not all(isinstance(c, str) and c for c in value):
            raise ValueError(f"{name} must be a non-empty list of non-empty strings, got {value!r}")
        # Lark string literals take JSON's escapes: any choice text is matched literally.
        grammar = LLMatcher.grammar_from_lark("start: " + " | ".join(json_module.dumps(c) for c in value))
    elif kind == "structural_tag":
        structures, triggers = _read_structural_tag(value, name=name)
        grammar = LLMatcher.grammar_from_lark(
            tagged_text_grammar(structures, triggers=triggers, repeat=True, layout=json_options)
        )
    else:
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"{name} must be a non-empty grammar (Lark or GBNF), got {value!r}")
        try:
            lark = any_to_lark(value)
        except Exception as err:  # the GBNF converter raises plain exceptions with the reason
            raise ValueError(f"{name}: cannot read the GBNF grammar: {err}") from err
        grammar = LLMatcher.grammar_from_lark(lark)
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ValueError(f"{name} is invalid: {' '.join(messages[0].split())}")  # one line: it goes into HTTP errors
    return grammar
