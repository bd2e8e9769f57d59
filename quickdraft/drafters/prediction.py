"""Predicted outputs (OpenAI's `prediction`): the request brings the text it expects back, most
of it unchanged (a file with one edit, a document to reformat), and that text is the draft.

Each step proposes the chain of predicted tokens that should come next: from the start of the
prediction, then from wherever the output is in step with it. Where the output leaves the
prediction (the edit), the next steps find it again: the longest run of the output's last
tokens that the prediction holds, the occurrence nearest past the last place used winning, so
an edit that repeats a line does not send the draft back to an earlier copy. Verified like any
draft, so the output is the target's whatever the prediction says (a wrong prediction costs
rejected rows, never a changed token).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from quickdraft.drafters.base import AcceptedPath, DraftRequest, Proposal

# How many of the output's last tokens a re-sync compares; longer runs are as good as certain.
RESYNC_WINDOW = 8


@dataclass
class _PredictionState:
    tokens: list[int]  # the prediction's token ids
    positions: dict[int, list[int]] = field(default_factory=dict)  # token -> where it occurs, ascending
    next_index: int = 0  # the prediction's index of the output's next token, while in step
    proposed_from: int | None = None  # where this step's chain started

    def __post_init__(self) -> None:
        for index, token in enumerate(self.tokens):
            self.positions.setdefault(token, []).append(index)


class PredictionDrafter:
    """Drafts a request's own predicted tokens (DraftRequest.prediction_token_ids)."""

    feature_layers: tuple[int, ...] = ()
    scores_paths = False

    def __init__(self) -> None:
        self._states: dict[str, _PredictionState] = {}

    def begin(self, request: DraftRequest) -> None:
        if request.prediction_token_ids:
            self._states[request.request_id] = _PredictionState(tokens=list(request.prediction_token_ids))

    def propose(self, requests: list[DraftRequest]) -> list[Proposal | None]:
        return [self._propose_one(request) for request in requests]

    def accept(self, request: DraftRequest, accepted: AcceptedPath) -> None:
        state = self._states.get(request.request_id)
        if state is None or state.proposed_from is None:
            return
        # The accepted draft tokens followed the prediction; the step's own token (the bonus or
        # the correction) is checked against it at the next proposal.
        state.next_index = state.proposed_from + accepted.num_accepted + 1
        state.proposed_from = None

    def observe(self, request: DraftRequest, features) -> None:  # no features needed
        return None

    def finish(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def _propose_one(self, request: DraftRequest) -> Proposal | None:
        state = self._states.get(request.request_id)
        if state is None:
            return None
        start = self._start(state, request.output_token_ids)
        state.proposed_from = None
        if start is None or start >= len(state.tokens):
            return None
        draft = state.tokens[start : start + min(request.budget, request.max_depth)]
        if not draft:
            return None
        state.proposed_from = start
        root = request.output_token_ids[-1] if request.output_token_ids else request.prompt_token_ids[-1]
        return Proposal.chain(root, draft)

    @staticmethod
    def _start(state: _PredictionState, output: list[int]) -> int | None:
        """The prediction's index of the output's next token, or None where the output's end is
        nowhere in the prediction."""
        if not output:
            return 0
        index = state.next_index
        if 0 < index <= len(state.tokens) and state.tokens[index - 1] == output[-1]:
            return index  # in step
        best_key, best_end = None, None
        for position in state.positions.get(output[-1], ()):
            length = 1
            while (
                length < RESYNC_WINDOW
                and length < len(output)
                and position - length >= 0
                and state.tokens[position - length] == output[-1 - length]
            ):
                length += 1
            end = position + 1
            # Longest run first; among equals, past where the output last was, then nearest to it.
            key = (length, end >= index, -abs(end - index))
            if best_key is None or key > best_key:
                best_key, best_end = key, end
        return best_end


class NoDrafter:
    """Proposes nothing: the drafter of an engine that speculates only for predicted outputs."""

    feature_layers: tuple[int, ...] = ()
    scores_paths = False

    def begin(self, request: DraftRequest) -> None:
        return None

    def observe(self, request: DraftRequest, features) -> None:
        return None

    def propose(self, requests: list[DraftRequest]) -> list[Proposal | None]:
        return [None] * len(requests)

    def accept(self, request: DraftRequest, accepted: AcceptedPath) -> None:
        return None

    def finish(self, request_id: str) -> None:
        return None
