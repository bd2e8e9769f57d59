"""Drafters: everything that proposes draft tokens, behind one interface (see base.py)."""

from __future__ import annotations

from quickdraft.drafters.base import AcceptedPath, DraftRequest, Drafter, DrafterRegistry, Proposal


def _ngram(**options) -> Drafter:
    from quickdraft.drafters.ngram import NgramDrafter

    return NgramDrafter(**options)


def _suffix(**options) -> Drafter:
    from quickdraft.drafters.suffix import SuffixDrafter

    return SuffixDrafter(**options)


def default_registry() -> DrafterRegistry:
    """The built-in methods; a caller may register more on the returned registry."""
    registry = DrafterRegistry()
    registry.register("ngram", _ngram)
    registry.register("suffix", _suffix)
    return registry


__all__ = ["AcceptedPath", "DraftRequest", "Drafter", "DrafterRegistry", "Proposal", "default_registry"]
