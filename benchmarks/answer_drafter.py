"""A drafter that is always right: it drafts a known answer token for token.

Benchmarks use it for the ceiling of a setting: run plain decoding first, then the same request
with AnswerDrafter(plain's token ids) through `Engine.set_drafter`.  Every draft is the target's
own next tokens, so a step commits its whole chain plus one, and the speedup is the most any
drafter proposing chains of that length (the engine's `num_speculative_tokens`, at most CHAIN)
can reach at the engine's real step costs.  Verified like any draft: the output is the target's
whatever the answer says (greedy, or sampled with a seed: position-keyed draws make a seeded
answer the same with or without drafts).

It is the predicted-outputs drafter (what `quickdraft bench serve`'s ceiling drafts) given the
answer as token ids: a request's `prediction` is text, and a constrained answer often re-encodes
to other tokens than the grammar let the model choose.  Every request it drafts for gets the same
answer (batch 1).
"""

from __future__ import annotations

import dataclasses

from quickdraft.drafters.prediction import MAX_CHAIN, PredictionDrafter

CHAIN = MAX_CHAIN  # the longest chain it drafts


class AnswerDrafter(PredictionDrafter):
    """PredictionDrafter whose requests all predict `answer` (token ids)."""

    def __init__(self, answer: list[int]):
        super().__init__()
        self.answer = list(answer)

    def begin(self, request) -> None:
        super().begin(dataclasses.replace(request, prediction_token_ids=self.answer))
