"""Drafters: everything that proposes draft tokens, behind one interface (see base.py)."""

from __future__ import annotations

from quickdraft.drafters.base import AcceptedPath, Drafter, DrafterRegistry, DraftRequest, Proposal, TargetInfo
from quickdraft.drafters.suffix import DEFAULT_DRAFT_LENGTH as SUFFIX_DRAFT_LENGTH


def _ngram(*, target: TargetInfo, **options) -> Drafter:
    from quickdraft.drafters.ngram import NgramDrafter

    return NgramDrafter(**options)


def _suffix(*, target: TargetInfo, **options) -> Drafter:
    from quickdraft.drafters.suffix import SuffixDrafter

    return SuffixDrafter(**options)


def _draft_model(*, target: TargetInfo, **options) -> Drafter:
    from quickdraft.drafters.draft_model import DraftModelDrafter

    return DraftModelDrafter(target=target, **options)


def _eagle(*, target: TargetInfo, **options) -> Drafter:
    from quickdraft.drafters.eagle import EagleDrafter

    return EagleDrafter.with_trained_head(target=target, **options)


def _mtp(*, target: TargetInfo, **options) -> Drafter:
    from quickdraft.drafters.eagle import EagleDrafter

    return EagleDrafter.with_mtp_layer(target=target, **options)


def _medusa(*, target: TargetInfo, **options) -> Drafter:
    from quickdraft.drafters.medusa import MedusaDrafter

    return MedusaDrafter(target=target, **options)


def _layer_skip(*, target: TargetInfo, **options) -> Drafter:
    from quickdraft.drafters.layer_skip import LayerSkipDrafter

    return LayerSkipDrafter(target=target, **options)


def _grammar(*, target: TargetInfo, **options) -> Drafter:
    from quickdraft.drafters.grammar import GrammarDrafter

    return GrammarDrafter(**options)


def _hybrid(*, target: TargetInfo, **options) -> Drafter:
    from quickdraft.drafters.hybrid import HybridDrafter

    return HybridDrafter(target=target, **options)


def _head_length(method: str):
    """The draft length the manifest of the head a `method` config loads recommends."""

    def advise(*, target: TargetInfo, options: dict) -> int | None:
        from quickdraft.heads import recommended_length

        return recommended_length(method=method, target=target, options=options)

    return advise


def default_registry() -> DrafterRegistry:
    """The built-in methods; a caller may register more on the returned registry."""
    registry = DrafterRegistry()
    registry.register("ngram", _ngram)
    registry.register("suffix", _suffix, num_speculative_tokens=SUFFIX_DRAFT_LENGTH)  # suffix.py says why
    registry.register("draft_model", _draft_model)
    # A head's manifest may recommend its draft length (and, read by the drafter, its tree shape).
    registry.register("eagle3", _eagle, length_advisor=_head_length("eagle3"))
    registry.register("medusa", _medusa, length_advisor=_head_length("medusa"))
    registry.register("self", _layer_skip, length_advisor=_head_length("self"))  # also spelled {"model": "[self]"}
    registry.register("mtp", _mtp)  # the checkpoint's own nextn layers (or a head in that layout)
    registry.register("grammar", _grammar)  # forced tokens of structured-output requests
    # A hybrid's depth bound; each child keeps its own default length unless its config sets one.
    registry.register("hybrid", _hybrid, num_speculative_tokens=SUFFIX_DRAFT_LENGTH)
    return registry


__all__ = ["AcceptedPath", "DraftRequest", "Drafter", "DrafterRegistry", "Proposal", "TargetInfo", "default_registry"]
