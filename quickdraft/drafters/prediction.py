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
# A re-sync needs a run at least this long: one common token (a newline, a bracket) says little,
# and a request whose output is not the prediction's is better left to the engine's drafter.
MIN_RESYNC_RUN = 2
# The longest chain a prediction offers (while its chains are accepted whole).
MAX_CHAIN = 16


@dataclass
class _PredictionState:
    tokens: list[int]  # the prediction's token ids
    positions: dict[int, list[int]] = field(default_factory=dict)  # token -> where it occurs, ascending
    next_index: int = 0  # the prediction's index of the output's next token, while in step
    chain: int = MAX_CHAIN  # this request's chain length: doubled after a whole accept, cut after a miss
    proposed_from: int | None = None  # where this step's chain started
    proposed_length: int = 0

    def __post_init__(self) -> None:
        for index, token in enumerate(self.tokens):
            self.positions.setdefault(token, []).append(index)


class PredictionDrafter:
    """Drafts a request's own predicted tokens (DraftRequest.prediction_token_ids).

    Chains start at MAX_CHAIN (a prediction is mostly right); after a miss the next chain is
    one longer than what was accepted, and it doubles after each chain accepted whole, so where
    the output leaves the prediction a rejected chain costs one long forward and then short ones
    (measured: always-16 chains on outputs unlike their prediction ran at 0.55x plain decoding).
    A re-sync caps the chain by the run it found (2 tokens: 4 nodes).
    """

    feature_layers: tuple[int, ...] = ()
    scores_paths = False

    def __init__(self) -> None:
        self._states: dict[str, _PredictionState] = {}

    @property
    def active(self) -> bool:
        """Whether any request it drafts for is running."""
        return bool(self._states)

    def begin(self, request: DraftRequest) -> None:
        if request.prediction_token_ids:
            self._states[request.request_id] = _PredictionState(tokens=list(request.prediction_token_ids))

    def propose(self, requests: list[DraftRequest]) -> list[Proposal | None]:
        return [self._propose_one(request) for request in requests]

    def catch_up_rows(self, request: DraftRequest) -> int:
        return 0  # a prediction is read, not run

    def accept(self, request: DraftRequest, accepted: AcceptedPath) -> None:
        state = self._states.get(request.request_id)
        if state is None or state.proposed_from is None:
            return
        # The accepted draft tokens followed the prediction; the step's own token (the bonus or
        # the correction) is checked against it at the next proposal.
        state.next_index = state.proposed_from + accepted.num_accepted + 1
        whole = accepted.num_accepted >= state.proposed_length
        state.chain = min(MAX_CHAIN, 2 * state.chain) if whole else accepted.num_accepted + 1
        state.proposed_from = None

    def observe(self, request: DraftRequest, features) -> None:  # no features needed
        return None

    def finish(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def _propose_one(self, request: DraftRequest) -> Proposal | None:
        state = self._states.get(request.request_id)
        if state is None:
            return None
        state.proposed_from = None
        found = self._start(state, request.output_token_ids)
        if found is None:
            return None
        start, cap = found
        length = min(request.budget, request.max_depth, state.chain, cap)
        draft = state.tokens[start : start + length]
        if not draft:
            return None
        state.proposed_from, state.proposed_length = start, len(draft)
        root = request.output_token_ids[-1] if request.output_token_ids else request.prompt_token_ids[-1]
        return Proposal.chain(root, draft)

    @staticmethod
    def _start(state: _PredictionState, output: list[int]) -> tuple[int, int] | None:
        """(the prediction's index of the output's next token, the chain it allows), or None
        where the output's end is not found in the prediction."""
        index = state.next_index
        if not output:
            return 0, MAX_CHAIN
        if index == 0 and len(output) == 1 and state.tokens[0] == output[0]:
            return 1, MAX_CHAIN  # the first token (sampled with the prompt) is the prediction's
        if 0 < index <= len(state.tokens) and state.tokens[index - 1] == output[-1]:
            return index, MAX_CHAIN  # in step
        best_key, best = None, None
        for position in state.positions.get(output[-1], ()):
            length = 1
            while (
                length < RESYNC_WINDOW
                and length < len(output)
                and position - length >= 0
                and state.tokens[position - length] == output[-1 - length]
            ):
                length += 1
            if length < MIN_RESYNC_RUN:
                continue
            end = position + 1
            # Longest run first; among equals, past where the output last was, then nearest to it.
            key = (length, end >= index, -abs(end - index))
            if best_key is None or key > best_key:
                best_key, best = key, (end, 1 << length)
        return best


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

    def catch_up_rows(self, request: DraftRequest) -> int:
        return 0

    def accept(self, request: DraftRequest, accepted: AcceptedPath) -> None:
        return None

    def finish(self, request_id: str) -> None:
        return None
