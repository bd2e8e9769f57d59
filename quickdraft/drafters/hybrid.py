"""Hybrid drafting: several drafters' proposals merged into one tree (SAM-Decoding style).

Each step every child drafter proposes for the same requests; their trees are merged by
prefix (a path two drafters agree on is one path), children in the configured order, within
the request's node budget: the first drafter's nodes first, then the nodes the next ones add.
A retrieval drafter that finds nothing proposes nothing, so a head behind it fills the whole
budget on new text and shares it on repeated text.

``skip_after: N`` makes it take the better of both at every step instead: once the drafters
before have proposed N draft tokens for a request, the later ones are not asked this step
(a confident retrieval match costs no head forward; a head catches up on the features it
missed the next time it is asked).

``ask_later: "measured"`` (the default; ``"always"`` turns it off) asks the later drafters
only where that pays, from measured throughput: for each context (greedy or sampled request;
whether the earlier drafters drafted anything this step) it keeps the committed tokens per
second of the steps that asked them and of the steps that did not (decayed, from the time
between one request's consecutive steps), asks by the better of the two, and tries the other
after ``explore_every`` steps of that context (the wait doubling, up to ``max_explore_every``,
while the explorations confirm the choice) so that a changed text can change it.
The measure includes every cost: a head's forward, the wider tree's verification, and the
Python around both.

Merged proposals are point masses (``draft_probs=None``): exact for any child, since
verifying a token as a point mass is exact for every proposal chosen without the
verifier's randomness.  After verification each child is told the accepted path in its own
node indices (the part of the path that lies in its tree).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from quickdraft.drafters.base import AcceptedPath, Drafter, DraftRequest, Proposal, TargetInfo, catch_up_rows_of
from quickdraft.drafters.suffix import DEFAULT_DRAFT_LENGTH


@dataclass
class MergedTree:
    token_ids: list[int]  # [num_nodes]
    parents: list[int]  # [num_nodes]
    child_nodes: list[dict[int, int]]  # per child drafter: merged node -> that child's node


def merge_proposals(proposals: list[Proposal | None], *, budget: int) -> MergedTree | None:
    """Merge trees sharing a root, by prefix, in order, keeping at most `budget` draft nodes."""
    present = [p for p in proposals if p is not None and p.num_draft_tokens > 0]
    if not present:
        return None
    root = present[0].token_ids[0]
    token_ids, parents = [root], [-1]
    children: dict[tuple[int, int], int] = {}  # (merged parent, token) -> merged node
    child_nodes: list[dict[int, int]] = []
    for proposal in proposals:
        mapping: dict[int, int] = {}
        if proposal is not None:
            if proposal.token_ids[0] != root:
                raise ValueError("hybrid: child proposals disagree on the root token")
            to_merged = {0: 0}
            for node in range(1, len(proposal.token_ids)):
                parent = to_merged.get(proposal.parents[node])
                if parent is None:
                    continue  # its parent did not fit the budget
                key = (parent, proposal.token_ids[node])
                merged = children.get(key)
                if merged is None:
                    if len(token_ids) - 1 >= budget:
                        continue
                    merged = children[key] = len(token_ids)
                    token_ids.append(proposal.token_ids[node])
                    parents.append(parent)
                to_merged[node] = merged
            mapping = {merged: node for node, merged in to_merged.items()}
        child_nodes.append(mapping)
    return MergedTree(token_ids=token_ids, parents=parents, child_nodes=child_nodes)


def path_in_child(accepted: AcceptedPath, mapping: dict[int, int]) -> AcceptedPath:
    """The accepted path as one child sees it: the prefix of it that lies in the child's tree."""
    nodes = []
    for node in accepted.nodes:
        if node not in mapping:
            break
        nodes.append(mapping[node])
    whole = len(nodes) == len(accepted.nodes)
    return AcceptedPath(
        nodes=nodes or [0],
        num_accepted=max(0, len(nodes) - 1),
        committed_token_ids=accepted.committed_token_ids,
        bonus=accepted.bonus and whole,
    )


@dataclass
class ArmThroughput:
    """Committed tokens and seconds of the steps taken one way in one context, decayed."""

    tokens: float = 0.0
    seconds: float = 0.0
    steps: int = 0
    decay: float = 0.95  # per observation: about the last twenty steps count

    @property
    def rate(self) -> float:  # tokens per second; untried arms first
        return self.tokens / self.seconds if self.seconds > 0 else float("inf")

    @property
    def mean_seconds(self) -> float:
        weight = (1 - self.decay**self.steps) / (1 - self.decay)
        return self.seconds / weight if self.steps else 0.0

    def record(self, *, tokens: int, seconds: float) -> None:
        self.tokens = self.decay * self.tokens + tokens
        self.seconds = self.decay * self.seconds + seconds
        self.steps += 1


Context = tuple[bool, bool]  # (the request samples, the earlier drafters drafted this step)


@dataclass
class LaterDrafterPolicy:
    """Whether to ask the drafters after the first, per context: the arm (ask / skip) with the
    higher measured throughput, the other one after `explore_every` steps of the context; each
    exploration that confirms the choice doubles that wait (up to `max_explore_every`), one that
    changes it resets the wait.  Bookkeeping in plain Python; the clock is injectable for tests."""

    explore_every: int = 8
    max_explore_every: int = 64
    clock: Callable[[], float] = time.perf_counter
    arms: dict[Context, dict[bool, ArmThroughput]] = field(default_factory=dict)  # context -> {asked: ...}
    _schedule: dict[Context, tuple[int, int]] = field(default_factory=dict)  # (steps since exploring, wait)
    _tested: dict[Context, bool] = field(default_factory=dict)  # the choice an exploration put to the test
    # request id -> (clock at its step, output length then, context, asked)
    _last: dict[str, tuple[float, int, Context, bool]] = field(default_factory=dict)

    def observe(self, request: DraftRequest, now: float) -> None:
        """The request's previous step, now that it is back: its tokens and time go to that arm."""
        last = self._last.pop(request.request_id, None)
        if last is None:
            return
        started, length, context, asked = last
        tokens, seconds = len(request.output_token_ids) - length, now - started
        arm = self.arms.setdefault(context, {True: ArmThroughput(), False: ArmThroughput()})[asked]
        typical = arm.mean_seconds
        if tokens < 1 or seconds <= 0 or (arm.steps >= 3 and seconds > 4 * typical):
            return  # not a step of this request alone (it waited, or other work ran between)
        arm.record(tokens=tokens, seconds=seconds)

    def choose(self, context: Context) -> bool:
        arms = self.arms.setdefault(context, {True: ArmThroughput(), False: ArmThroughput()})
        if arms[True].steps == 0 or arms[False].steps == 0:
            return arms[True].steps == 0  # each arm once, asking first
        better = arms[True].rate >= arms[False].rate
        since, wait = self._schedule.get(context, (0, self.explore_every))
        tested = self._tested.pop(context, None)
        if tested is not None:
            wait = min(2 * wait, self.max_explore_every) if tested == better else self.explore_every
        since += 1
        if since >= wait:
            self._schedule[context] = (0, wait)
            self._tested[context] = better
            return not better
        self._schedule[context] = (since, wait)
        return better

    def started(self, request: DraftRequest, now: float, context: Context, asked: bool) -> None:
        self._last[request.request_id] = (now, len(request.output_token_ids), context, asked)

    def finish(self, request_id: str) -> None:
        self._last.pop(request_id, None)


def _sampled(request: DraftRequest) -> bool:
    return request.params is not None and request.params.temperature > 0


class HybridDrafter(Drafter):
    def __init__(
        self,
        *,
        target: TargetInfo,
        drafters: list[dict],
        num_speculative_tokens: int = DEFAULT_DRAFT_LENGTH,
        max_draft_tokens: int | None = None,
        skip_after: int | None = None,
        ask_later: str = "measured",
        explore_every: int = 8,
        max_explore_every: int = 64,
    ):
        from quickdraft.drafters import default_registry

        if not isinstance(drafters, list) or len(drafters) < 2 or not all(isinstance(d, dict) for d in drafters):
            raise ValueError(
                "hybrid needs 'drafters': a list of at least two drafter configs, "
                'e.g. [{"method": "suffix"}, {"method": "eagle3"}]'
            )
        registry = default_registry()
        self.children = []
        for config in drafters:
            options = dict(config)
            method = options.pop("method", None)
            if not method or method == "hybrid":
                raise ValueError(f"hybrid child {config!r} needs a 'method' other than hybrid")
            # A child's length: its config's, else its method's default within the hybrid's
            # (a head's 5 stays 5 beside a suffix tree's 16).
            default_length = registry.default_num_speculative_tokens(method, target=target, options=options)
            options.setdefault("num_speculative_tokens", min(num_speculative_tokens, default_length))
            self.children.append(registry.create(method, target=target, **options))
        if max_draft_tokens is not None and (not isinstance(max_draft_tokens, int) or max_draft_tokens < 1):
            raise ValueError(f"max_draft_tokens must be a positive integer, got {max_draft_tokens!r}")
        self.max_draft_tokens = max_draft_tokens
        if skip_after is not None and (
            not isinstance(skip_after, int) or isinstance(skip_after, bool) or skip_after < 1
        ):
            raise ValueError(f"skip_after must be a positive integer, got {skip_after!r}")
        self.skip_after = skip_after
        if ask_later not in ("measured", "always"):
            raise ValueError(f"ask_later must be 'measured' or 'always', got {ask_later!r}")
        if not isinstance(explore_every, int) or isinstance(explore_every, bool) or explore_every < 2:
            raise ValueError(f"explore_every must be an integer >= 2, got {explore_every!r}")
        if (
            not isinstance(max_explore_every, int)
            or isinstance(max_explore_every, bool)
            or max_explore_every < explore_every
        ):
            raise ValueError(f"max_explore_every must be an integer >= explore_every, got {max_explore_every!r}")
        self.policy = (
            LaterDrafterPolicy(explore_every=explore_every, max_explore_every=max_explore_every)
            if ask_later == "measured"
            else None
        )
        layers = sorted({layer for child in self.children for layer in getattr(child, "feature_layers", ())})
        self.feature_layers = tuple(layers)
        # Which blocks of the concatenated features each child reads: [child] -> positions in `layers`.
        self._feature_blocks = [
            [layers.index(layer) for layer in getattr(child, "feature_layers", ())] for child in self.children
        ]
        self._merged: dict[str, MergedTree] = {}

    def begin(self, request: DraftRequest) -> None:
        for child in self.children:
            child.begin(request)

    def observe(self, request: DraftRequest, features: torch.Tensor) -> None:
        # features [n, L * D] for self.feature_layers; each child gets its own layers' blocks
        width = features.shape[1] // len(self.feature_layers)
        for child, blocks in zip(self.children, self._feature_blocks):
            if blocks:
                child.observe(request, torch.cat([features[:, b * width : (b + 1) * width] for b in blocks], dim=1))

    def propose(self, requests: list[DraftRequest]) -> list[Proposal | None]:
        now = 0.0
        if self.policy is not None:
            now = self.policy.clock()
            for request in requests:
                self.policy.observe(request, now)
        per_child = []  # [child][request index] -> proposal or None
        drafted = [0] * len(requests)
        later: dict[int, bool] = {}  # request index -> whether the later children draft this step
        for index, child in enumerate(self.children):
            if index == 1:
                later = {i: self._asks_later(requests[i], drafted[i], now) for i in range(len(requests))}
            asking = [i for i in range(len(requests)) if index == 0 or (later[i] and not self._skips(drafted[i]))]
            answers = child.propose([requests[i] for i in asking]) if asking else []
            row: list[Proposal | None] = [None] * len(requests)
            for i, proposal in zip(asking, answers):
                row[i] = proposal
                drafted[i] += proposal.num_draft_tokens if proposal is not None else 0
            per_child.append(row)
        proposals: list[Proposal | None] = []
        for index, request in enumerate(requests):
            budget = request.budget if self.max_draft_tokens is None else min(request.budget, self.max_draft_tokens)
            merged = merge_proposals([child_proposals[index] for child_proposals in per_child], budget=budget)
            if merged is None:
                self._merged.pop(request.request_id, None)
                proposals.append(None)
                continue
            self._merged[request.request_id] = merged
            proposals.append(Proposal(token_ids=merged.token_ids, parents=merged.parents))
        return proposals

    def _skips(self, drafted: int) -> bool:
        return self.skip_after is not None and drafted >= self.skip_after

    def _asks_later(self, request: DraftRequest, drafted: int, now: float) -> bool:
        """Whether the children after the first draft for `request` this step."""
        if self.policy is None or self._skips(drafted):
            return True  # skip_after still applies child by child
        context = (_sampled(request), drafted > 0)
        asked = self.policy.choose(context)
        self.policy.started(request, now, context, asked)
        return asked

    def catch_up_rows(self, request: DraftRequest) -> int:
        return sum(catch_up_rows_of(child, request) for child in self.children)

    def accept(self, request: DraftRequest, accepted: AcceptedPath) -> None:
        merged = self._merged.pop(request.request_id, None)
        for i, child in enumerate(self.children):
            mapping = merged.child_nodes[i] if merged is not None else {0: 0}
            child.accept(request, path_in_child(accepted, mapping))

    def finish(self, request_id: str) -> None:
        self._merged.pop(request_id, None)
        if self.policy is not None:
            self.policy.finish(request_id)
        for child in self.children:
            child.finish(request_id)
