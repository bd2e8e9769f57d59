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

from quickdraft.structured.structural_tag import structural_tag_grammar

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


def json_layout(*, flexible: bool, whitespace_pattern: str | None = None) -> dict[str, Any]:
    """llguidance's JSON options: json.dumps' separators, and any other whitespace only if flexible
    (also an inline schema's "x-guidance" inside a Lark grammar); a whitespace pattern (vLLM's
    whitespace_pattern, a regex) is the whitespace allowed between tokens instead."""
    if whitespace_pattern is not None:
        return {"whitespace_flexible": True, "whitespace_pattern": whitespace_pattern}
    return {"whitespace_flexible": flexible, "item_separator": ", ", "key_separator": ": "}


@dataclass(kw_only=True)
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None  # a JSON schema
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark (llguidance's dialect) or GBNF (llama.cpp's)
    # vLLM's structural tag (a dict or its JSON text): {"structures": [{"begin", "schema", "end"}],
    # "triggers": [...]}, free text in which each trigger starts one of the structures, or
    # {"format": {...}}, xgrammar's nested form (structured/structural_tag.py)
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
        compiled = _compile(given[0], getattr(self, given[0]), json_options=layout)
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
    if REASONING_PARSERS[parser].format != "think":
        raise ValueError(
            f"structured outputs (and tool_choice 'required' or a named function) after {parser}'s reasoning are "
            "not supported: its replies are harmony messages, which a constraint on the whole reply would break"
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


def _compile(kind: str, value: Any, *, json_options: dict[str, Any]) -> str:
    """The llguidance grammar for one constraint; ValueError naming the field when it is invalid."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    name = f"structured_outputs.{kind}"
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
        grammar = structural_tag_grammar(value, layout=json_options, where=name)
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
