"""Draft children coupled with the target's position-keyed draws, for sampled requests.

Verification takes a sampled request's token at output position t as ``argmax_v p(v) / E_v``,
with E the Exp(1) noise of key ``position_key(seed, t)`` (``verify.sampler.sample_keyed``), and a
point-mass child is accepted exactly when it equals that draw (drafters opt in with
``coupling="keyed"``).  A head proposing its most likely
ids gets each accepted with the target's p of it.  Drawing the first child of a node the same
way from the head's own distribution q, ``argmax_v q(v) / E_v`` with the very same noise, makes
it the target's token whenever the two races agree (always when q = p), and is still a point
mass chosen without reading the target, so verification stays exact.  The other children are
the head's most likely other ids, as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quickdraft.drafters.base import DraftRequest
from quickdraft.verify.sampler import keyed_uniform, position_key

COUPLINGS = ("keyed", "top_k")


def check_coupling(coupling: str) -> str:
    """A drafter's `coupling` option: "top_k" (the default: the head's most likely ids, sampled
    requests too) or "keyed" (first children are keyed draws).  Keyed children did not pay on
    the embedded model at temperature 0.7 (docs/performance-log.md: the acceptance barely moved, and every keyed
    draw costs a vocabulary-wide noise draw), so they are asked for, not the default."""
    if coupling not in COUPLINGS:
        raise ValueError(f"coupling must be one of {COUPLINGS}, got {coupling!r}")
    return coupling


@dataclass(frozen=True)
class KeyedDraw:
    """A sampled request's draw parameters: its seed, the output position its depth-1 draft
    tokens take, and its temperature."""

    seed: int
    first_position: int
    temperature: float

    @classmethod
    def of(cls, request: DraftRequest) -> KeyedDraw | None:
        """None for greedy requests (their children are the head's argmax, the target's rule)."""
        params = request.params
        if params is None or params.is_greedy or request.seed is None:
            return None
        return cls(seed=request.seed, first_position=len(request.output_token_ids), temperature=params.temperature)

    def key(self, depth: int) -> int:
        """The noise key of the draft tokens at `depth` (1 = the first draft token)."""
        return position_key(self.seed, self.first_position + depth - 1)


def coupled_order(
    log_probs: torch.Tensor,  # [C] the head's log-probabilities (or logits) of the candidates
    candidate_ids: torch.Tensor,  # [C] their target ids
    best: list[int],  # candidate columns, most likely first (at least as many as are wanted)
    *,
    noise_key: int,  # position_key of the draft tokens' output position
    temperature: float,
) -> list[int]:
    """Candidate columns in proposal order: the head's keyed draw at this temperature first,
    then the most likely others.  The noise is counter-based: only the candidates' ids are hashed."""
    log_noise = keyed_uniform(noise_key, candidate_ids.to(torch.long)).log_().neg_().log_()  # [C] log Exp(1)
    drawn = int(torch.argmax(log_probs / temperature - log_noise))
    return [drawn] + [column for column in best if column != drawn]
