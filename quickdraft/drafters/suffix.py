"""SuffixDecoding: draft trees from the frequencies of what followed the context's suffix.

Two suffix tries are searched (SuffixDecoding, Oliaro et al. 2024; Arctic Inference):

- a per-request trie over the request's prompt + output so far, extended as tokens are
  committed (the request copies its own prompt and its own earlier output);
- a global trie over the outputs of finished requests (agentic and repeated workloads
  regenerate the same text), holding at most ``max_cached_requests`` outputs, oldest
  evicted first.

``propose`` finds, in each trie, the longest suffix of the context (at most
``max_tree_depth`` tokens) that occurred before, then grows a draft tree from the matched
node best-first by estimated probability: a continuation's probability is its count over
the count of all continuations of its parent, multiplied along the path; nodes under
``min_token_prob`` are not drafted.  The number of draft nodes adapts to how much context
matched: ``min(num_speculative_tokens, budget, floor(max_spec_factor * match_len +
max_spec_offset))``.  Of the two tries' trees the one with the higher score (the sum of its
nodes' probabilities, i.e. the expected number of accepted tokens) is proposed.

In the request's own trie an occurrence that overlaps the context's tail (the text repeats
with a period shorter than the draft) reads on into the tokens drafted before it, as the
n-gram drafter's continuation does: a loop of period p is drafted in full, not p tokens a
step (``periodic: false`` stops at the context's end instead).

Proposals are deterministic (``draft_probs=None``): each draft token is a point mass.

Data structure: a suffix trie of bounded depth (``max_tree_depth + num_speculative_tokens``,
so a full-length match still leaves room to draft) whose nodes count occurrences.  A node
seen once does not grow a subtree: it keeps a reference into the token sequence it came
from (its "tail"), and its single continuation is read from there on demand.  Nodes are
built only where two occurrences share a path, so random text costs about one node per
token instead of one per token per depth level.  Appending one token touches only the
occurrences still on shared paths (at most the depth cap, usually a handful).  Nodes are
ids into parallel lists (see SuffixTrie), which keeps a large cache out of the way of
Python's garbage collector.

Cost per step and request: syncing the committed tokens O(new tokens * shared depth);
the per-request match O(1) (it is the deepest shared-path suffix, kept up to date); the
global match O(max_tree_depth * log max_tree_depth) dict look-ups (binary search on the
match length); each draft tree O(draft nodes * children of the expanded nodes).
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import count as counter

from quickdraft.drafters.base import AcceptedPath, Drafter, DraftRequest, Proposal
from quickdraft.drafters.ngram import extends_indexed_tokens

# Draft nodes by default: suffix trees match long repeated spans (a base model's own loops,
# copied passages), and 16 gave 3.17-3.33x plain on Spec-Bench against 2.68x with 5 (docs/performance-log.md,
# 2026-12-03).  The registry's default for the method, and the hybrid's depth bound.
DEFAULT_DRAFT_LENGTH = 16

# An occurrence being extended: (node id, depth of node).  A match: (node id, depth, number
# of tail tokens matched below a tail node: 0 when the match ends at the node itself).
Cursor = tuple[int, int]
MatchState = tuple[int, int, int]


@dataclass
class Lookahead:
    """The tokens drafted past the end of sequence `sequence_id` (the context being continued),
    worked out only when an occurrence reaches that end."""

    sequence_id: int
    drafted: Callable[[], list[int]]  # -> [path length]


@dataclass
class DraftTree:
    token_ids: list[int]  # draft tokens (root excluded)
    parents: list[int]  # proposal indices (root = 0) of each draft token's parent
    score: float  # sum of the draft tokens' probabilities: expected accepted tokens
    match_len: int


class SuffixTrie:
    """Bounded-depth suffix trie with occurrence counts over a set of token sequences.

    Node ``n`` is one string (the tokens on its path from the root).  ``counts[n]``: the
    occurrences (start positions in the sequences) whose path passes through it.  Either
    ``children[n]`` is a dict {token: node} holding the next node of every occurrence that
    continues (always so when the count is >= 2), or ``children[n]`` is None, the count is
    1, and the single occurrence continues with
    ``sequences[tail_sequence_ids[n]][tail_starts[n]:]``, read up to the depth cap.

    Nodes live in parallel lists, not one object each: a dict of ints is invisible to
    Python's cyclic garbage collector, so a large global trie does not make every full
    collection walk hundreds of thousands of node objects (a pause of ~0.1 s at 200k
    nodes in a decoding loop).  Freed node ids are reused.
    """

    ROOT = 0

    def __init__(self, *, max_depth: int) -> None:
        self.max_depth = max_depth
        self.sequences: dict[int, list[int]] = {}
        self.counts: list[int] = [0]
        self.children: list[dict[int, int] | None] = [{}]
        self.tail_sequence_ids: list[int] = [-1]
        self.tail_starts: list[int] = [0]
        self._free_node_ids: list[int] = []

    def num_nodes(self) -> int:
        """Nodes in use, root excluded (for memory checks)."""
        return len(self.counts) - 1 - len(self._free_node_ids)

    # -- building -----------------------------------------------------------------------

    def _new_tail_node(self, sequence_id: int, tail_start: int) -> int:
        if self._free_node_ids:
            node = self._free_node_ids.pop()
            self.counts[node] = 1
            self.children[node] = None
            self.tail_sequence_ids[node] = sequence_id
            self.tail_starts[node] = tail_start
            return node
        self.counts.append(1)
        self.children.append(None)
        self.tail_sequence_ids.append(sequence_id)
        self.tail_starts.append(tail_start)
        return len(self.counts) - 1

    def add_sequence(self, sequence_id: int, token_ids: list[int]) -> None:
        """Register a sequence whose tokens are then counted with append (or insert).
        The trie reads tails from this very list: it may grow, never change."""
        if sequence_id in self.sequences:
            raise ValueError(f"sequence {sequence_id} is already in the trie")
        self.sequences[sequence_id] = token_ids

    def append(self, sequence_id: int, *, end: int, active: list[Cursor]) -> list[Cursor]:
        """Count the occurrences ending at ``sequences[sequence_id][end - 1]``.

        ``active`` holds, shallowest first, the nodes of the suffixes of the sequence's first
        end - 1 tokens that are on shared paths (count >= 2); returns the same for its first
        end tokens.  Suffixes on a count-1 node need no work: their tail reads the new token
        from the sequence itself.  O(len(active)), at most max_depth.
        """
        token = self.sequences[sequence_id][end - 1]
        counts, children = self.counts, self.children
        next_active: list[Cursor] = []
        for node, depth in [(self.ROOT, 0), *active]:
            node_children = children[node]
            assert node_children is not None  # the root and active nodes are dict nodes
            child = node_children.get(token)
            if child is None:  # first occurrence of this string: a tail node, no more work
                node_children[token] = self._new_tail_node(sequence_id, end)
                continue
            if children[child] is None:  # the second occurrence: give the first its next node
                self._materialize(child, depth=depth + 1)
            counts[child] += 1
            if depth + 1 < self.max_depth:
                next_active.append((child, depth + 1))
        return next_active

    def _materialize(self, node: int, *, depth: int) -> None:
        """Turn a tail node into a dict node whose one child carries the rest of the tail."""
        sequence_id, start = self.tail_sequence_ids[node], self.tail_starts[node]
        tail = self.sequences[sequence_id]
        node_children: dict[int, int] = {}
        self.children[node] = node_children
        self.tail_sequence_ids[node] = -1
        if depth < self.max_depth and start < len(tail):
            node_children[tail[start]] = self._new_tail_node(sequence_id, start + 1)

    def insert(self, sequence_id: int, token_ids: list[int]) -> None:
        """Add a whole sequence (which must not change until it is removed)."""
        self.add_sequence(sequence_id, token_ids)
        active: list[Cursor] = []
        for end in range(1, len(token_ids) + 1):
            active = self.append(sequence_id, end=end, active=active)

    def remove(self, sequence_id: int) -> None:
        """Uncount a whole sequence: O(len * shared depth), like its insertion.

        Nodes reaching count 0 are freed with their subtree; nodes reaching count 1 are
        folded back into a tail when their remaining child is one, so memory shrinks back.
        """
        token_ids = self.sequences[sequence_id]
        counts, children = self.counts, self.children
        num_tokens = len(token_ids)
        for start in range(num_tokens):
            now_single: list[int] = []
            node = self.ROOT
            for depth in range(min(self.max_depth, num_tokens - start)):
                token = token_ids[start + depth]
                node_children = children[node]
                assert node_children is not None  # shared paths (count >= 2) are dict nodes
                child = node_children[token]
                if counts[child] == 1:  # only this occurrence: drop the whole subtree
                    del node_children[token]
                    self._free_subtree(child)
                    break
                counts[child] -= 1
                if counts[child] == 1:
                    now_single.append(child)
                node = child
            for single in reversed(now_single):  # deepest first: its child is folded already
                self._fold_into_tail(single)
        del self.sequences[sequence_id]

    def _fold_into_tail(self, node: int) -> None:
        """A count-1 dict node whose only child is a tail node becomes a tail node itself.
        (If the remaining occurrence ends in a dict node, at the depth cap or at its
        sequence's end, the node stays a dict: correct, one node larger than needed.)"""
        node_children = self.children[node]
        if self.counts[node] != 1 or not node_children or len(node_children) != 1:
            return
        (child,) = node_children.values()
        if self.children[child] is not None:
            return
        self.tail_sequence_ids[node] = self.tail_sequence_ids[child]
        self.tail_starts[node] = self.tail_starts[child] - 1
        self.children[node] = None
        self._free_subtree(child)

    def _free_subtree(self, node: int) -> None:
        stack = [node]
        while stack:
            node = stack.pop()
            node_children = self.children[node]
            if node_children:
                stack.extend(node_children.values())
            self.counts[node] = 0
            self.children[node] = None
            self.tail_sequence_ids[node] = -1
            self._free_node_ids.append(node)

    # -- reading ------------------------------------------------------------------------

    def _tail_token(self, node: int, *, depth: int, tail_offset: int, ahead: Lookahead | None = None) -> int | None:
        """The token at tail_offset below tail node `node` (at `depth`), if within the trie.

        An occurrence that runs into the end of the sequence `ahead` continues (the context
        being drafted for) reads on into the drafted tokens: the text is periodic there."""
        sequence_id = self.tail_sequence_ids[node]
        tail = self.sequences[sequence_id]
        tail_index = self.tail_starts[node] + tail_offset
        if depth + tail_offset >= self.max_depth:
            return None
        if tail_index < len(tail):
            return tail[tail_index]
        if ahead is not None and ahead.sequence_id == sequence_id:
            drafted = ahead.drafted()
            if tail_index - len(tail) < len(drafted):
                return drafted[tail_index - len(tail)]
        return None

    def match(self, context: list[int], *, length: int) -> MatchState | None:
        """Where the last `length` tokens of context lead from the root, if they occurred."""
        node, depth, tail_offset = self.ROOT, 0, 0
        children = self.children
        for position in range(len(context) - length, len(context)):
            token = context[position]
            node_children = children[node]
            if node_children is not None:
                next_node = node_children.get(token)
                if next_node is None:
                    return None
                node = next_node
                depth += 1
            else:
                if self._tail_token(node, depth=depth, tail_offset=tail_offset) != token:
                    return None
                tail_offset += 1
        return node, depth, tail_offset

    def has_continuation(self, state: MatchState) -> bool:
        node, depth, tail_offset = state
        if self.children[node] is not None:
            return bool(self.children[node])
        return self._tail_token(node, depth=depth, tail_offset=tail_offset) is not None

    def longest_match(self, context: list[int], *, max_length: int) -> tuple[int, MatchState | None]:
        """The longest suffix of context (<= max_length tokens) found in the trie with a
        continuation (an occurrence at the very end of a cached sequence predicts nothing).

        Every substring of a sequence is in the trie, so if a suffix is followed by some
        token, so are all shorter ones: a binary search needs O(log max_length) walks.
        """
        lo, hi = 0, min(max_length, len(context))
        best: MatchState | None = None
        while lo < hi:
            mid = (lo + hi + 1) // 2
            state = self.match(context, length=mid)
            if state is None or not self.has_continuation(state):
                hi = mid - 1
            else:
                lo, best = mid, state
        return lo, best

    def continuations(
        self, state: MatchState, *, ahead: Lookahead | None = None
    ) -> list[tuple[int, float, MatchState]]:
        """(token, conditional probability, state after it) for each continuation of state.

        The probability is over the occurrences that continue: an occurrence that ends here
        (the context itself, or a sequence's last token) predicts nothing, unless `ahead`
        carries it on (see _tail_token).
        """
        node, depth, tail_offset = state
        node_children = self.children[node]
        if node_children is None:
            token = self._tail_token(node, depth=depth, tail_offset=tail_offset, ahead=ahead)
            return [] if token is None else [(token, 1.0, (node, depth, tail_offset + 1))]
        if len(node_children) == 1:
            ((token, child),) = node_children.items()
            return [(token, 1.0, (child, depth + 1, 0))]
        counts = self.counts
        total = sum(counts[child] for child in node_children.values())
        return [(token, counts[child] / total, (child, depth + 1, 0)) for token, child in node_children.items()]

    def draft_tree(
        self,
        state: MatchState,
        *,
        max_draft_nodes: int,
        min_token_prob: float,
        match_len: int,
        continues: int | None = None,
    ) -> DraftTree:
        """Best-first expansion from the matched state: the most probable continuations first,
        stopping at max_draft_nodes or when no candidate reaches min_token_prob.
        `continues`: the sequence the context is (its end is the present), so that an
        occurrence overlapping the context's own tail keeps repeating its period instead of
        stopping there (a loop of period 1 would otherwise draft one token a step).
        O(max_draft_nodes * (children per node + log heap)), plus a walk up the draft for
        each node whose occurrence reaches the context's end."""
        token_ids: list[int] = []
        parents: list[int] = []
        score = 0.0
        tie_breaker = counter()  # equal probabilities: the first pushed first
        heap: list[tuple[float, int, int, int, MatchState]] = []

        def path_to(node: int) -> list[int]:  # draft tokens from the root to proposal node `node`
            path = []
            while node > 0:
                path.append(token_ids[node - 1])
                node = parents[node - 1]
            return path[::-1]

        def push_continuations(of: MatchState, *, prob: float, parent: int) -> None:
            ahead = None if continues is None else Lookahead(sequence_id=continues, drafted=lambda: path_to(parent))
            for token, token_prob, next_state in self.continuations(of, ahead=ahead):
                path_prob = prob * token_prob
                if path_prob >= min_token_prob:
                    heapq.heappush(heap, (-path_prob, next(tie_breaker), parent, token, next_state))

        push_continuations(state, prob=1.0, parent=0)
        while heap and len(token_ids) < max_draft_nodes:
            neg_prob, _, parent, token, next_state = heapq.heappop(heap)
            token_ids.append(token)
            parents.append(parent)
            score -= neg_prob
            push_continuations(next_state, prob=-neg_prob, parent=len(token_ids))
        return DraftTree(token_ids=token_ids, parents=parents, score=score, match_len=match_len)


@dataclass
class RequestSuffixState:
    """One request's own trie, the committed tokens it indexes, and its shared-path suffixes."""

    trie: SuffixTrie
    num_prompt_tokens: int
    token_ids: list[int] = field(default_factory=list)  # the trie's one (growing) sequence
    active: list[Cursor] = field(default_factory=list)  # shallowest first

    SEQUENCE_ID = 0  # the trie's one sequence

    def __post_init__(self) -> None:
        self.trie.add_sequence(self.SEQUENCE_ID, self.token_ids)

    def extend(self, new_token_ids: list[int]) -> None:
        for token in new_token_ids:
            self.token_ids.append(token)
            self.active = self.trie.append(0, end=len(self.token_ids), active=self.active)

    def longest_match(self, *, max_length: int) -> tuple[int, MatchState | None]:
        """The deepest suffix that occurred earlier: the deepest shared-path suffix node."""
        for node, depth in reversed(self.active):
            if depth <= max_length:
                return depth, (node, depth, 0)
        return 0, None


def _check_int(name: str, value: object, *, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _check_float(name: str, value: object, *, minimum: float, maximum: float = math.inf) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not minimum <= value <= maximum
    ):
        raise ValueError(f"{name} must be a finite number in [{minimum}, {maximum}], got {value!r}")


class SuffixDrafter(Drafter):
    """SuffixDecoding drafter (per-request and global suffix tries, frequency-ranked trees)."""

    def __init__(
        self,
        *,
        num_speculative_tokens: int = DEFAULT_DRAFT_LENGTH,
        max_tree_depth: int = 24,
        max_cached_requests: int = 1000,
        min_token_prob: float = 0.1,
        max_spec_factor: float = 1.0,
        max_spec_offset: float = 0.0,
        periodic: bool = True,
    ) -> None:
        _check_int("num_speculative_tokens", num_speculative_tokens, minimum=1)
        _check_int("max_tree_depth", max_tree_depth, minimum=1)
        _check_int("max_cached_requests", max_cached_requests, minimum=0)
        _check_float("min_token_prob", min_token_prob, minimum=0.0, maximum=1.0)
        _check_float("max_spec_factor", max_spec_factor, minimum=0.0)
        _check_float("max_spec_offset", max_spec_offset, minimum=-math.inf)
        self.num_speculative_tokens = num_speculative_tokens
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.min_token_prob = min_token_prob
        self.max_spec_factor = max_spec_factor
        self.max_spec_offset = max_spec_offset
        if not isinstance(periodic, bool):
            raise ValueError(f"periodic must be true or false, got {periodic!r}")
        self.periodic = periodic
        # Deep enough that a match of max_tree_depth tokens can still draft a full budget.
        self.trie_depth = max_tree_depth + num_speculative_tokens
        self.global_trie = SuffixTrie(max_depth=self.trie_depth)
        self.cached_outputs: OrderedDict[int, list[int]] = OrderedDict()  # oldest first
        self._next_cache_key = 0
        self._requests: dict[str, RequestSuffixState] = {}

    # -- Drafter protocol ---------------------------------------------------------------

    def begin(self, request: DraftRequest) -> None:
        self._requests[request.request_id] = self._new_state(request)

    def propose(self, requests: list[DraftRequest]) -> list[Proposal | None]:
        return [self._propose_one(request) for request in requests]

    def accept(self, request: DraftRequest, accepted: AcceptedPath) -> None:
        self._synced_state(request)

    def finish(self, request_id: str) -> None:
        """Drop the request's trie and cache its output for later requests."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return
        output = state.token_ids[state.num_prompt_tokens :]
        if output and self.max_cached_requests > 0:
            self._cache_output(output)

    # -- global cache -------------------------------------------------------------------

    def _cache_output(self, output_token_ids: list[int]) -> None:
        self.global_trie.insert(self._next_cache_key, output_token_ids)
        self.cached_outputs[self._next_cache_key] = output_token_ids
        self._next_cache_key += 1
        while len(self.cached_outputs) > self.max_cached_requests:
            oldest_key, _ = self.cached_outputs.popitem(last=False)
            self.global_trie.remove(oldest_key)

    # -- per-request state --------------------------------------------------------------

    def _new_state(self, request: DraftRequest) -> RequestSuffixState:
        state = RequestSuffixState(
            trie=SuffixTrie(max_depth=self.trie_depth), num_prompt_tokens=len(request.prompt_token_ids)
        )
        state.extend(request.prompt_token_ids)
        state.extend(request.output_token_ids)
        return state

    def _synced_state(self, request: DraftRequest) -> RequestSuffixState:
        """The request's state, extended with the tokens committed since it was last seen.

        Built lazily when begin was not called; rebuilt when the request's tokens no longer
        extend what was indexed (checked in O(1): lengths and the last indexed token).
        """
        state = self._requests.get(request.request_id)
        if state is None or not extends_indexed_tokens(
            state.token_ids, num_prompt_tokens=state.num_prompt_tokens, request=request
        ):
            state = self._requests[request.request_id] = self._new_state(request)
            return state
        num_indexed_output = len(state.token_ids) - state.num_prompt_tokens
        if num_indexed_output < len(request.output_token_ids):
            state.extend(request.output_token_ids[num_indexed_output:])
        return state

    # -- proposing ----------------------------------------------------------------------

    def _draft_budget(self, *, match_len: int, budget: int) -> int:
        """Longer matches earn longer drafts (SuffixDecoding's adaptive speculation)."""
        adaptive = math.floor(self.max_spec_factor * match_len + self.max_spec_offset + 1e-6)
        return max(0, min(self.num_speculative_tokens, budget, adaptive))

    def _draft_from(
        self,
        trie: SuffixTrie,
        *,
        match_len: int,
        state: MatchState | None,
        budget: int,
        continues: int | None = None,
    ) -> DraftTree | None:
        if state is None or match_len == 0:
            return None
        max_draft_nodes = self._draft_budget(match_len=match_len, budget=budget)
        if max_draft_nodes == 0:
            return None
        tree = trie.draft_tree(
            state,
            max_draft_nodes=max_draft_nodes,
            min_token_prob=self.min_token_prob,
            match_len=match_len,
            continues=continues,
        )
        return tree if tree.token_ids else None

    def _propose_one(self, request: DraftRequest) -> Proposal | None:
        if request.budget < 1:
            return None
        state = self._synced_state(request)
        context = state.token_ids
        if not context:
            return None
        match_len, match = state.longest_match(max_length=self.max_tree_depth)
        best = self._draft_from(
            state.trie,
            match_len=match_len,
            state=match,
            budget=request.budget,
            continues=RequestSuffixState.SEQUENCE_ID if self.periodic else None,
        )
        if self.cached_outputs:
            match_len, match = self.global_trie.longest_match(context, max_length=self.max_tree_depth)
            cached = self._draft_from(self.global_trie, match_len=match_len, state=match, budget=request.budget)
            if cached is not None and (best is None or cached.score > best.score):
                best = cached
        if best is None:
            return None
        return Proposal(token_ids=[context[-1], *best.token_ids], parents=[-1, *best.parents])
