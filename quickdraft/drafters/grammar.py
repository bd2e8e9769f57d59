"""Forced-token drafting ("jump-forward"): where a request's grammar allows one continuation only
(a schema's keys and punctuation, a fixed string), draft it whole.

The tokens come from the request's grammar state at its committed position
(``RequestGrammar.forced_tokens``); a stretch of k forced tokens then costs one verification
instead of k forwards.  Requests without a constraint, or at a free position, get no proposal.
Point masses (``draft_probs=None``), so exact like any deterministic draft; the target may still
prefer another tokenization of the same text, which verification settles.  Alone it drafts only
forced stretches; in a hybrid (``{"method": "hybrid", "drafters": [{"method": "grammar"},
{"method": "suffix"}]}``) the other drafters fill the free positions.
"""

from __future__ import annotations

from quickdraft.drafters.base import AcceptedPath, Drafter, DraftRequest, Proposal


class GrammarDrafter(Drafter):
    def __init__(self, *, num_speculative_tokens: int = 16):
        if not isinstance(num_speculative_tokens, int) or isinstance(num_speculative_tokens, bool):
            raise ValueError(f"num_speculative_tokens must be a positive integer, got {num_speculative_tokens!r}")
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be a positive integer, got {num_speculative_tokens!r}")
        self.max_tokens = num_speculative_tokens

    def begin(self, request: DraftRequest) -> None:
        pass

    def propose(self, requests: list[DraftRequest]) -> list[Proposal | None]:
        proposals: list[Proposal | None] = []
        for request in requests:
            if request.grammar is None:
                proposals.append(None)
                continue
            limit = min(self.max_tokens, request.budget, request.max_depth)
            forced = request.grammar.forced_tokens(limit)
            root = request.output_token_ids[-1] if request.output_token_ids else request.prompt_token_ids[-1]
            proposals.append(Proposal.chain(root, forced) if forced else None)
        return proposals

    def accept(self, request: DraftRequest, accepted: AcceptedPath) -> None:
        pass

    def finish(self, request_id: str) -> None:
        pass
