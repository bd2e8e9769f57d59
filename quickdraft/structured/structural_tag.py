"""Structural tags as llguidance Lark grammars.

Two forms are read, both vLLM's (and xgrammar's):
- the original one: {"structures": [{"begin", "schema", "end"}], "triggers": [...]}: free text in
  which every trigger starts one of the structures whose begin starts with it;
- the nested ``format`` one: {"format": F} where F is one of const_string {value}, json_schema
  {json_schema}, regex {pattern}, grammar {grammar} (Lark or GBNF), any_text, sequence {elements},
  or {elements}, tag {begin, content, end}, triggered_tags {triggers, tags, at_least_one,
  stop_after_first} and tags_with_separator {tags, separator, at_least_one, stop_after_first}.

Free text that a trigger interrupts is an llguidance lazy lexeme ending at the trigger, and a
trigger never appears in free text outside a tag; ``any_text`` inside a tag runs to the tag's end.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

TEXT = "/(.|\\n)*/"


@dataclass(frozen=True)
class TaggedStructure:
    """A JSON value between two fixed strings (an original-form structure, a tool call block)."""

    begin: str  # starts with one of the grammar's triggers
    schema: dict[str, Any] | bool  # the JSON schema of what comes between
    end: str


@dataclass
class LarkRules:
    """Rules (and nested grammars) of one Lark grammar, named as they are added."""

    layout: dict[str, Any]  # llguidance's JSON options, for every JSON schema inside
    where: str  # the field a ValueError names
    lines: list[str] = field(default_factory=list)
    side_grammars: list[dict[str, str]] = field(default_factory=list)
    count: int = 0

    def rule(self, body: str, *, options: str = "", terminal: bool = False) -> str:
        """A new rule (`terminal`: a lexeme; with `options` such as [suffix=...] it must be
        lower case, as llguidance names lazy lexemes)."""
        self.count += 1
        name = f"lazy{self.count}" if options else f"{'T' if terminal else 'r'}{self.count}"
        self.lines.append(f"{name}{options}: {body}")
        return name

    def json_value(self, schema: Any) -> str:
        if schema is True:
            schema = {}
        if not isinstance(schema, dict):
            raise ValueError(f"{self.where}: a JSON schema is an object or true, got {schema!r}")
        return "%json " + json.dumps({**schema, "x-guidance": self.layout})

    def grammar(self, lark: str) -> str:
        self.count += 1
        self.side_grammars.append({"name": f"g{self.count}", "lark_grammar": lark})
        return f"@g{self.count}"

    def compiled(self, start: str) -> str:
        """The llguidance grammar: `start` first, nested grammars after it."""
        lark = "\n".join([f"start: {start}", *self.lines])
        return json.dumps({"grammars": [{"name": "structural_tag", "lark_grammar": lark}, *self.side_grammars]})


def tagged_text(
    rules: LarkRules,
    tags: list[tuple[str, str, str]],  # (begin, body expression, end) per tag
    *,
    triggers: list[str],
    repeat: bool = True,
    at_least_one: bool = False,
) -> str:
    """A rule: free text in which every trigger starts one of the tags whose begin starts with it
    (text up to the first trigger, a lazy match ending at it, then the rest of the begin, the
    body, the end), then the same again (once only without `repeat`); text without a trigger
    ends it. `at_least_one`: it holds a tag."""
    escaped = "|".join(re.escape(t).replace("/", "\\/") for t in triggers)  # inside /.../: slashes escaped
    no_trigger = f"~/(.|\\n)*({escaped})(.|\\n)*/"
    text = rules.rule(f"{TEXT} & {no_trigger}", terminal=True)
    segments = []
    for trigger in triggers:
        bodies = [
            _between(begin[len(trigger) :], body, end)
            for begin, body, end in tags
            if _trigger_of(begin, triggers) == trigger
        ]
        if bodies:
            before = rules.rule(f"{TEXT} & {no_trigger}", options=f"[suffix={json.dumps(trigger)}]", terminal=True)
            segments.append(f"{before} ({' | '.join(bodies)})")
    if not segments:
        raise ValueError(f"{rules.where}: no tag starts with any of the triggers {triggers}")
    segment = rules.rule(" | ".join(segments))
    name = f"r{rules.count + 1}"  # the rule made below, which refers to itself when it repeats
    after = name if repeat else text
    return rules.rule(f"{segment} {after}" if at_least_one else f"{text} | {segment} {after}")


def _literal(text: str) -> str:
    return json.dumps(text) if text else ""


def _between(begin: str, body: str, end: str) -> str:
    """A Lark sequence: the literal begin (if any), the body expression, the literal end (if any)."""
    return " ".join(part for part in (_literal(begin), body, _literal(end)) if part)


def _trigger_of(begin: str, triggers: list[str]) -> str | None:
    """The longest trigger a tag's begin starts with (its text up to there is free)."""
    return max((t for t in triggers if begin.startswith(t)), key=len, default=None)


def structural_tag_grammar(value: Any, *, layout: dict[str, Any], where: str) -> str:
    """The llguidance grammar of a structural tag in either form; ValueError naming `where`."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where} is not valid JSON: {err}") from err
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be an object (structures and triggers, or format), got {type(value).__name__}")
    rules = LarkRules(layout=layout, where=where)
    if "format" in value:
        unknown = sorted(set(value) - {"type", "format"})
        if unknown or value.get("type", "structural_tag") != "structural_tag":
            raise ValueError(f"{where}: expected type and format, got {sorted(value)}")
        return rules.compiled(_format(rules, value["format"], path=f"{where}.format"))
    structures, triggers = read_structures(value, where=where)
    tags = [(s.begin, rules.json_value(s.schema), s.end) for s in structures]
    return rules.compiled(tagged_text(rules, tags, triggers=triggers))


def read_structures(value: dict[str, Any], *, where: str) -> tuple[list[TaggedStructure], list[str]]:
    """The original form, checked: a ValueError naming what is wrong."""
    unknown = sorted(set(value) - {"type", "structures", "triggers"})
    if unknown or value.get("type", "structural_tag") != "structural_tag":
        raise ValueError(f"{where}: expected type, structures and triggers (or format), got {sorted(value)}")
    triggers = _triggers(value.get("triggers"), where=f"{where}.triggers")
    raw = value.get("structures")
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"{where}.structures must be a non-empty list, got {raw!r}")
    structures = []
    for index, item in enumerate(raw):
        at = f"{where}.structures[{index}]"
        if not isinstance(item, dict) or set(item) - {"begin", "schema", "end"} or "begin" not in item:
            raise ValueError(f"{at} must be {{begin, schema, end}}, got {item!r}")
        begin, schema, end = item["begin"], item.get("schema", True), item.get("end", "")
        if not isinstance(begin, str) or not isinstance(end, str) or not isinstance(schema, (dict, bool)):
            raise ValueError(f"{at}: begin and end are strings and schema a JSON schema, got {item!r}")
        if schema is False:
            raise ValueError(f"{at}.schema is false: no JSON value would match")
        if _trigger_of(begin, triggers) is None:
            raise ValueError(f"{at}.begin {begin!r} starts with none of the triggers {triggers}")
        structures.append(TaggedStructure(begin=begin, schema=schema, end=end))
    return structures, triggers


def _triggers(value: Any, *, where: str) -> list[str]:
    if not isinstance(value, list) or not value or not all(isinstance(t, str) and t for t in value):
        raise ValueError(f"{where} must be a non-empty list of non-empty strings, got {value!r}")
    return value


FORMAT_KEYS = {
    "const_string": {"value"},
    "json_schema": {"json_schema"},
    "regex": {"pattern"},
    "grammar": {"grammar"},
    "any_text": set(),
    "sequence": {"elements"},
    "or": {"elements"},
    "tag": {"begin", "content", "end"},
    "triggered_tags": {"triggers", "tags", "at_least_one", "stop_after_first"},
    "tags_with_separator": {"tags", "separator", "at_least_one", "stop_after_first"},
}


def _format(rules: LarkRules, node: Any, *, path: str, end: str | None = None) -> str:
    """A Lark expression for one format node. `end`: the string that closes the enclosing tag
    (an any_text runs to it and writes it)."""
    kind = node.get("type") if isinstance(node, dict) else None
    if kind not in FORMAT_KEYS:
        raise ValueError(f"{path}.type must be one of {sorted(FORMAT_KEYS)}, got {kind!r}")
    unknown = sorted(set(node) - FORMAT_KEYS[kind] - {"type"})
    if unknown:
        raise ValueError(f"{path}: unknown fields {unknown} for {kind}")
    if kind == "const_string":
        return json.dumps(_string(node, "value", path=path))
    if kind == "json_schema":
        return rules.json_value(node.get("json_schema"))
    if kind == "regex":
        pattern = _string(node, "pattern", path=path)
        return rules.rule("/" + pattern.replace("/", "\\/") + "/", terminal=True)
    if kind == "grammar":
        from llguidance.gbnf_to_lark import any_to_lark

        try:
            return rules.grammar(any_to_lark(_string(node, "grammar", path=path)))
        except ValueError:
            raise
        except Exception as err:  # the GBNF converter raises plain exceptions with the reason
            raise ValueError(f"{path}.grammar: cannot read it: {err}") from err
    if kind == "any_text":
        if end:  # a lazy match of text that the end closes (and writes)
            return rules.rule(TEXT, options=f"[suffix={json.dumps(end)}]", terminal=True)
        return TEXT
    if kind in ("sequence", "or"):
        elements = node.get("elements")
        if not isinstance(elements, list) or not elements:
            raise ValueError(f"{path}.elements must be a non-empty list, got {elements!r}")
        parts = [_format(rules, e, path=f"{path}.elements[{i}]") for i, e in enumerate(elements)]
        return "(" + (" " if kind == "sequence" else " | ").join(parts) + ")"
    if kind == "tag":
        return _tag(rules, node, path=path)
    tags = node.get("tags")
    if not isinstance(tags, list) or not tags:
        raise ValueError(f"{path}.tags must be a non-empty list, got {tags!r}")
    flags = {key: node.get(key, False) for key in ("at_least_one", "stop_after_first")}
    if not all(isinstance(flag, bool) for flag in flags.values()):
        raise ValueError(f"{path}: at_least_one and stop_after_first are booleans, got {flags}")
    if kind == "tags_with_separator":
        one = "(" + " | ".join(_tag(rules, t, path=f"{path}.tags[{i}]") for i, t in enumerate(tags)) + ")"
        separator = _string(node, "separator", path=path)
        many = one if flags["stop_after_first"] else f"{one} ({_literal(separator) or ''} {one})*"
        return many if flags["at_least_one"] else f"({many})?"
    triggers = _triggers(node.get("triggers"), where=f"{path}.triggers")
    parsed = []
    for i, tag in enumerate(tags):
        begin, body, tag_end = _tag_parts(rules, tag, path=f"{path}.tags[{i}]")
        if _trigger_of(begin, triggers) is None:
            raise ValueError(f"{path}.tags[{i}].begin {begin!r} starts with none of the triggers {triggers}")
        parsed.append((begin, body, tag_end))
    return tagged_text(
        rules, parsed, triggers=triggers, repeat=not flags["stop_after_first"], at_least_one=flags["at_least_one"]
    )


def _tag(rules: LarkRules, node: Any, *, path: str) -> str:
    return _between(*_tag_parts(rules, node, path=path))


def _tag_parts(rules: LarkRules, node: Any, *, path: str) -> tuple[str, str, str]:
    """(begin, body expression, end) of a tag node; an any_text body writes the end itself."""
    if not isinstance(node, dict) or node.get("type", "tag") != "tag":
        raise ValueError(f"{path} must be a tag {{begin, content, end}}, got {node!r}")
    unknown = sorted(set(node) - {"type", "begin", "content", "end"})
    if unknown:
        raise ValueError(f"{path}: unknown fields {unknown} for tag")
    begin, end = _string(node, "begin", path=path), _string(node, "end", path=path)
    content = node.get("content")
    body = _format(rules, content, path=f"{path}.content", end=end)
    writes_end = isinstance(content, dict) and content.get("type") == "any_text" and bool(end)
    return begin, body, "" if writes_end else end


def _string(node: dict[str, Any], key: str, *, path: str) -> str:
    value = node.get(key)
    if not isinstance(value, str):
        raise ValueError(f"{path}.{key} must be a string, got {value!r}")
    return value
