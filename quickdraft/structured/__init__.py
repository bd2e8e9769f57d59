"""Structured outputs: JSON (object mode or a schema), regex, choice lists and grammars per request.

The grammar engine is llguidance (why: ``quickdraft/structured/grammar.py``).  A request's
constraint masks the target's logits at every row the step computes for it, each row with the
grammar state advanced along that node's path; drafted tokens the grammar forbids are cut from
the tree before the forward.  Verification is then unchanged, so every drafter stays exact.
"""

from quickdraft.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
