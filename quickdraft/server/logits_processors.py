"""The `logits_processors` request field (vLLM's OpenAI-server form): each entry names a callable
by its qualified name ("package.module.name"), or {"qualname", "args", "kwargs"} for a factory
called with them, whose result is the processor. Only names the server's
`--logits-processor-pattern` (a regular expression, matched in full) allows are imported: a
name is code the server runs. None (the default) refuses the field."""

from __future__ import annotations

import importlib
import re
from typing import Any

from quickdraft.server.errors import bad_request
from quickdraft.verify.logits_processors import LogitsProcessor

FIELD = "logits_processors"


def resolve_logits_processors(specs: list[Any], *, pattern: str | None) -> list[LogitsProcessor]:
    """The processors the request names, built; a 400 naming the field for a name the pattern
    does not allow, that does not import, or a factory that raises."""
    if pattern is None:
        raise bad_request(
            "logits_processors are not allowed by this server: start it with --logits-processor-pattern "
            "(a regular expression the processors' qualified names must match)",
            param=FIELD,
            code="unsupported_parameter",
        )
    processors = []
    for index, spec in enumerate(specs):
        qualname = spec if isinstance(spec, str) else spec.qualname
        where = f"logits_processors[{index}] ({qualname!r})"
        if not re.fullmatch(pattern, qualname):
            raise bad_request(f"{where} is not allowed by this server's --logits-processor-pattern", param=FIELD)
        target = _import_qualname(qualname, where=where)
        if not isinstance(spec, str):
            try:
                target = target(*(spec.args or []), **(spec.kwargs or {}))
            except Exception as err:
                raise bad_request(f"{where}: building it raised {type(err).__name__}: {err}", param=FIELD) from err
        processors.append(target)
    return processors


def _import_qualname(qualname: str, *, where: str) -> Any:
    """The object at "module.attribute[.attribute...]", trying the longest importable module.
    Not pkgutil.resolve_name: it takes a module that exists but fails to import (a dependency of
    its missing) for an attribute, and would report "not found" instead of the import error."""
    parts = qualname.split(".")
    for split in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:split])
        try:
            target: Any = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            missing = err.name or ""
            if module_name == missing or module_name.startswith(missing + "."):
                continue  # no such module: a shorter prefix may be one
            raise bad_request(f"{where} could not be imported: {err}", param=FIELD) from err
        except Exception as err:  # the module itself failed to import
            raise bad_request(f"{where} could not be imported: {type(err).__name__}: {err}", param=FIELD) from err
        try:
            for attribute in parts[split:]:
                target = getattr(target, attribute)
        except AttributeError as err:
            raise bad_request(f"{where} was not found: {err}", param=FIELD) from err
        return target
    raise bad_request(f"{where} is not a qualified name of the form module.name", param=FIELD)
