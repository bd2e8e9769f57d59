"""A drafter that is always right: it drafts a known answer token for token.

Benchmarks use it for the ceiling of a setting: run plain decoding first, then the same request
with AnswerDrafter(plain's token ids).  Every draft is the target's own next tokens, so a step
commits its whole chain plus one, and the speedup is the most any drafter proposing chains of
that length can reach at the engine's real step costs.  Verified like any draft: the output is
the target's whatever the answer says (greedy, or sampled with a seed: position-keyed draws make
a seeded answer the same with or without drafts).  One request at a time (batch 1).
"""

from __future__ import annotations

from quickdraft.drafters.base import Proposal

CHAIN = 16  # as a request's `prediction` drafts (drafters/prediction.py MAX_CHAIN)


class AnswerDrafter:
    """Drafts the next tokens of `answer` while the output follows it, up to `chain` a step."""

    feature_layers: tuple[int, ...] = ()
    scores_paths = False

    def __init__(self, answer: list[int], *, chain: int = CHAIN):
        self.answer = list(answer)
        self.chain = chain

    def begin(self, request) -> None:
        pass

    def propose(self, requests):
        proposals = []
        for request in requests:
            done = request.output_token_ids
            length = min(request.budget, request.max_depth, self.chain)
            on_track = self.answer[: len(done)] == done
            draft = self.answer[len(done) : len(done) + length] if on_track else []
            root = done[-1] if done else request.prompt_token_ids[-1]
            proposals.append(Proposal.chain(root, draft) if draft else None)
        return proposals

    def accept(self, request, accepted) -> None:
        pass

    def finish(self, request_id: str) -> None:
        pass
