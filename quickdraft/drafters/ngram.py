"""Prompt lookup decoding: draft the tokens that followed an earlier copy of the context's tail.

For each request the drafter looks for the last ``n`` tokens (``n`` from
``prompt_lookup_max`` down to ``prompt_lookup_min``) earlier in the prompt + output, most
recent occurrence first, and proposes the tokens that followed it.  Longer matches win over
shorter ones (they predict better); among matches of one length the most recent wins
(generation tends to copy what it has just read).  With ``num_branches > 1`` the distinct
continuations of several matches become sibling branches of one tree, most trusted first
(verification tries siblings in order).  No match: no proposal, the engine decodes plainly.

Proposals are deterministic (``draft_probs=None``): each draft token is a point mass.

Speed: an index per request maps every n-gram to the positions that followed its latest
occurrences, updated with the committed tokens only, so ``propose`` costs
O(prompt_lookup_max - prompt_lookup_min + budget * num_branches) dict look-ups and list
slices, whatever the context length.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from quickdraft.drafters.base import AcceptedPath, Drafter, DraftRequest, Proposal

NgramKey = tuple[int, ...]


def _check_positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass
class NgramIndex:
    """The committed tokens of one request and, for each n-gram, where its continuations start.

    ``continuations[gram]`` lists, oldest first, the positions ``e`` such that
    ``token_ids[e - n:e] == gram`` and ``token_ids[e]`` exists: an n-gram is indexed only once
    the token that followed it is known, so every stored position has a continuation.
    Only the latest ``max_positions_per_ngram`` positions are kept: frequent short n-grams
    (a common token) would otherwise hold one entry per occurrence.
    """

    min_n: int
    max_n: int
    max_positions_per_ngram: int
    token_ids: list[int] = field(default_factory=list)
    num_prompt_tokens: int = 0
    continuations: dict[NgramKey, list[int]] = field(default_factory=dict)

    def extend(self, new_token_ids: list[int]) -> None:
        """Append committed tokens, indexing the n-grams that each new token continues."""
        tokens = self.token_ids
        continuations = self.continuations
        keep = self.max_positions_per_ngram
        for token in new_token_ids:
            end = len(tokens)  # the n-grams ending here are continued by `token`
            tokens.append(token)
            for n in range(self.min_n, min(self.max_n, end) + 1):
                key = tuple(tokens[end - n : end])
                positions = continuations.get(key)
                if positions is None:
                    continuations[key] = [end]
                else:
                    positions.append(end)
                    if len(positions) > keep:
                        del positions[0]

    def matches(self, *, max_matches_per_n: int) -> Iterator[tuple[int, int]]:
        """(n, continuation start) of earlier copies of the context's tail: longest n first,
        most recent first within one n."""
        tokens = self.token_ids
        num_tokens = len(tokens)
        for n in range(min(self.max_n, num_tokens - 1), self.min_n - 1, -1):
            positions = self.continuations.get(tuple(tokens[num_tokens - n :]))
            if positions:
                for start in reversed(positions[-max_matches_per_n:]):
                    yield n, start


def continuation(token_ids: list[int], *, start: int, length: int) -> list[int]:
    """The `length` tokens predicted to follow the context if it repeats from `start`.

    When the match overlaps the context's own tail (start + length > len), the context is
    periodic with period len - start, and the prediction keeps repeating that period
    (predicted token i equals predicted token i - period), instead of stopping short: a
    generation stuck in a loop is where n-gram drafting pays most.
    """
    available = len(token_ids) - start
    if available >= length:
        return token_ids[start : start + length]
    return [token_ids[start + i % available] for i in range(length)]


@dataclass
class DraftTreeBuilder:
    """Merges draft chains by common prefix into one tree (no duplicate siblings)."""

    max_draft_nodes: int
    token_ids: list[int]
    parents: list[int] = field(default_factory=lambda: [-1])
    children: list[dict[int, int]] = field(default_factory=lambda: [{}])  # node -> {token: node}

    @property
    def num_draft_nodes(self) -> int:
        return len(self.token_ids) - 1

    def add_chain(self, chain: list[int]) -> bool:
        """Add one chain below the root; True when it added at least one node."""
        node = 0
        added = False
        for token in chain:
            child = self.children[node].get(token)
            if child is None:
                if self.num_draft_nodes >= self.max_draft_nodes:
                    break
                child = len(self.token_ids)
                self.token_ids.append(token)
                self.parents.append(node)
                self.children.append({})
                self.children[node][token] = child
                added = True
            node = child
        return added

    def proposal(self) -> Proposal | None:
        if self.num_draft_nodes == 0:
            return None
        return Proposal(token_ids=self.token_ids, parents=self.parents)


class NgramDrafter(Drafter):
    """Prompt lookup decoding (vLLM's ``ngram`` method), chains or trees of distinct matches."""

    def __init__(
        self,
        *,
        num_speculative_tokens: int = 5,
        prompt_lookup_max: int = 4,
        prompt_lookup_min: int = 1,
        num_branches: int = 1,
    ) -> None:
        _check_positive_int("num_speculative_tokens", num_speculative_tokens)
        _check_positive_int("prompt_lookup_max", prompt_lookup_max)
        _check_positive_int("prompt_lookup_min", prompt_lookup_min)
        _check_positive_int("num_branches", num_branches)
        if prompt_lookup_min > prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({prompt_lookup_min}) must be <= prompt_lookup_max ({prompt_lookup_max})"
            )
        self.num_speculative_tokens = num_speculative_tokens
        self.prompt_lookup_max = prompt_lookup_max
        self.prompt_lookup_min = prompt_lookup_min
        self.num_branches = num_branches
        # Matches looked at per n-gram length: recent matches often continue identically (a
        # loop), so a few extra are scanned to find num_branches distinct continuations.
        self.max_matches_per_n = 4 * num_branches
        self._indexes: dict[str, NgramIndex] = {}

    # -- Drafter protocol ---------------------------------------------------------------

    def begin(self, request: DraftRequest) -> None:
        self._indexes[request.request_id] = self._new_index(request)

    def propose(self, requests: list[DraftRequest]) -> list[Proposal | None]:
        return [self._propose_one(request) for request in requests]

    def accept(self, request: DraftRequest, accepted: AcceptedPath) -> None:
        self._synced_index(request)

    def finish(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)

    # -- internals ----------------------------------------------------------------------

    def _new_index(self, request: DraftRequest) -> NgramIndex:
        index = NgramIndex(
            min_n=self.prompt_lookup_min,
            max_n=self.prompt_lookup_max,
            max_positions_per_ngram=self.max_matches_per_n,
            num_prompt_tokens=len(request.prompt_token_ids),
        )
        index.extend(request.prompt_token_ids)
        index.extend(request.output_token_ids)
        return index

    def _synced_index(self, request: DraftRequest) -> NgramIndex:
        """The request's index, extended with the tokens committed since it was last seen.

        Built lazily when begin was not called; rebuilt when the request's tokens no longer
        extend what was indexed (a different prompt, or fewer tokens than indexed).
        """
        index = self._indexes.get(request.request_id)
        if index is None or not extends_indexed_tokens(
            index.token_ids, num_prompt_tokens=index.num_prompt_tokens, request=request
        ):
            index = self._indexes[request.request_id] = self._new_index(request)
            return index
        num_indexed_output = len(index.token_ids) - index.num_prompt_tokens
        if num_indexed_output < len(request.output_token_ids):
            index.extend(request.output_token_ids[num_indexed_output:])
        return index

    def _propose_one(self, request: DraftRequest) -> Proposal | None:
        if request.budget < 1:
            return None
        index = self._synced_index(request)
        if not index.token_ids:
            return None
        chain_length = min(self.num_speculative_tokens, request.budget, request.max_depth)
        tree = DraftTreeBuilder(max_draft_nodes=request.budget, token_ids=[index.token_ids[-1]])
        num_branches = 0
        for _, start in index.matches(max_matches_per_n=self.max_matches_per_n):
            if tree.add_chain(continuation(index.token_ids, start=start, length=chain_length)):
                num_branches += 1
            if num_branches == self.num_branches or tree.num_draft_nodes >= request.budget:
                break
        return tree.proposal()


def extends_indexed_tokens(indexed_token_ids: list[int], *, num_prompt_tokens: int, request: DraftRequest) -> bool:
    """Whether the request's tokens are the indexed ones plus (maybe) more, checked in O(1):
    same prompt length, no fewer tokens, and the same token at the last indexed position.
    (Shared by the drafters that index a request's tokens incrementally.)"""
    if len(request.prompt_token_ids) != num_prompt_tokens:
        return False
    num_indexed_output = len(indexed_token_ids) - num_prompt_tokens
    if num_indexed_output > len(request.output_token_ids):
        return False
    if num_indexed_output > 0:
        return request.output_token_ids[num_indexed_output - 1] == indexed_token_ids[-1]
    if num_prompt_tokens > 0:
        return request.prompt_token_ids[-1] == indexed_token_ids[num_prompt_tokens - 1]
    return True
