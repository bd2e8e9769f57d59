"""The one drafter interface, and the registry that maps a config's method to a drafter.

A drafter proposes, for each decoding request, a **tree** of draft tokens (a chain is a
tree of width 1).  Node 0 is the root: the last committed token, whose KV is not cached
yet.  The engine verifies every node of every tree in one target forward, and tells the
drafter what was accepted.  The engine never branches on a method name.

Two conventions for what a proposal's tokens are, both exact under rejection sampling:

- ``draft_probs is None``: deterministic proposals (n-gram, suffix, top-k picks). Each
  draft token is a point mass: accepted with probability target_probs[token]; on a
  rejection that token is zeroed out of the target distribution and the rest renormalised
  before the next sibling is tried.
- ``draft_probs`` given: node i's token was *sampled* from ``draft_probs[i]`` (siblings
  drawn i.i.d. from the same row).  Accepted with probability
  min(1, target_probs[x] / draft_probs[x]); on a rejection the target distribution becomes
  normalize(max(target - draft, 0)) before the next sibling.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from quickdraft.sampling_params import SamplingParams
from quickdraft.verify.tree import Tree

if TYPE_CHECKING:  # the drafters' modules import this one: types only
    from quickdraft.kv.cache import KVCache
    from quickdraft.models.decoder import Decoder
    from quickdraft.structured.grammar import RequestGrammar


@dataclass
class Proposal:
    token_ids: list[int]  # [num_nodes] node 0 = root (the last committed token)
    parents: list[int]  # [num_nodes] parent index, -1 for the root; parents precede children
    draft_probs: torch.Tensor | None = None  # [num_nodes, V]: row i = distribution node i was drawn from
    # [num_nodes] the log-probability the drafter gives each node's path (drafters that score
    # their paths); adaptive speculation learns how often a path of that probability is accepted
    path_log_probs: list[float] | None = None
    # The tree's facts (depths, children, ancestor mask, paths), worked out once from `parents`.
    tree: Tree = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.token_ids or len(self.token_ids) != len(self.parents):
            raise ValueError(f"{len(self.token_ids)} tokens for {len(self.parents)} parents")
        self.tree = Tree(self.parents)
        if self.draft_probs is not None and self.draft_probs.shape[0] != len(self.token_ids):
            raise ValueError(f"draft_probs has {self.draft_probs.shape[0]} rows for {len(self.token_ids)} nodes")
        if self.path_log_probs is not None and len(self.path_log_probs) != len(self.token_ids):
            raise ValueError(f"path_log_probs has {len(self.path_log_probs)} values for {len(self.token_ids)} nodes")

    @property
    def num_draft_tokens(self) -> int:
        return len(self.token_ids) - 1

    @classmethod
    def root_only(cls, root: int) -> Proposal:
        """No draft: the step samples one token after the root, as plain decoding does."""
        return cls(token_ids=[root], parents=[-1])

    @classmethod
    def chain(cls, root: int, draft: Sequence[int], draft_probs: torch.Tensor | None = None) -> Proposal:
        tokens = [root, *draft]
        return cls(token_ids=tokens, parents=list(range(-1, len(tokens) - 1)), draft_probs=draft_probs)


@dataclass
class DraftRequest:
    """What a drafter sees of one request when proposing."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    budget: int  # most draft tokens (tree nodes besides the root) this step; >= 1
    max_depth: int = 1 << 30  # longest root-to-leaf draft path worth verifying this step
    params: SamplingParams | None = None  # the request's sampling parameters (None = greedy)
    slot: int | None = None  # the request's slot in the target's KV cache
    seed: int | None = None  # the request's sampling seed (position-keyed draws: sampler.position_key)
    # The request's grammar state (structured outputs) at its committed tokens, or None; drafters
    # read it (forced tokens), only the engine advances it.
    grammar: RequestGrammar | None = None
    # Adaptive speculation lets a path grow past max_depth, up to extend_depth, where the
    # probability the drafter itself gives the path stays at least min_path_prob (drafters that
    # score their paths; others never go past max_depth).
    extend_depth: int = 0
    min_path_prob: float = 0.0
    # The output the request expects (its `prediction`, tokenized): drafted by PredictionDrafter
    prediction_token_ids: list[int] | None = None

    @property
    def depth_limit(self) -> int:
        """The deepest a path may grow this step, extensions included."""
        return max(self.max_depth, self.extend_depth)

    def path_log_floor(self, depth: int, own: float) -> float:
        """The log-probability a path must keep to grow a node at `depth`: the drafter's own
        floor `own` (its min_draft_prob), and past max_depth also the request's min_path_prob."""
        if depth <= self.max_depth or self.min_path_prob <= 0:
            return own
        return max(own, math.log(self.min_path_prob))

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


@dataclass
class AcceptedPath:
    """What verification kept of a proposal."""

    nodes: list[int]  # the accepted path's node indices, root (0) first
    num_accepted: int  # accepted draft tokens (len(nodes) - 1)
    committed_token_ids: list[int]  # accepted draft tokens + the recovered/bonus token
    bonus: bool  # True when the path ended at a leaf: the last token is a bonus token


class Drafter(Protocol):
    """The interface every drafter implements.

    A drafter that reads the target's hidden states (a head on the target's features) sets
    ``feature_layers`` to the target layers whose outputs it needs and implements
    ``observe``: the engine then captures those layers in every target forward and hands
    over, in order, the features of every token as its KV enters the target's cache (tokens
    of a prefix cache hit included: their features were stored when their blocks were first
    computed, see engine/feature_cache.py). Drafters that need no features leave
    ``feature_layers`` empty.
    """

    feature_layers: tuple[int, ...] = ()
    # True for drafters that grow paths by their own probability (EAGLE-style heads) and grow a
    # path past a request's ``max_depth`` (up to ``extend_depth``) only while its probability
    # stays at least the request's ``min_path_prob`` (adaptive speculation's break-even).
    scores_paths: bool = False

    def begin(self, request: DraftRequest) -> None:
        """A request starts (its prompt is known)."""

    def observe(self, request: DraftRequest, features: torch.Tensor) -> None:
        """features [n, len(feature_layers) * D]: the next n cached tokens' target features, a
        tensor of these rows alone that nothing changes later: a drafter may keep it as it is."""
        return None  # drafters without feature_layers are never handed any

    def propose(self, requests: list[DraftRequest]) -> list[Proposal | None]:
        """One proposal per request (None: no draft, plain decoding for it this step)."""

    def catch_up_rows(self, request: DraftRequest) -> int:
        """Rows a propose for `request` would feed before its first draft depth (what it committed
        since it last drafted), for a drafter keeping a context of its own: a head's features, a
        draft model's KV.  Adaptive speculation fits their cost apart from the drafts' and charges
        it to a probe after a long plain stretch."""
        return 0

    def accept(self, request: DraftRequest, accepted: AcceptedPath) -> None:
        """The request committed tokens (request's token lists are already updated)."""

    def finish(self, request_id: str) -> None:
        """The request is done: drop its state."""


def catch_up_rows_of(drafter: Drafter, request: DraftRequest) -> int:
    """Drafter.catch_up_rows, 0 for a drafter written without it (the protocol's methods are
    duck-typed: a registered drafter need not derive from Drafter)."""
    method = getattr(drafter, "catch_up_rows", None)
    return 0 if method is None else method(request)


DrafterFactory = Callable[..., Drafter]
# (target=TargetInfo, options=the config's drafter options) -> a recommended draft length or None
LengthAdvisor = Callable[..., "int | None"]


@dataclass(frozen=True)
class TargetInfo:
    """What a drafter may need to know about the target it drafts for."""

    vocab_size: int
    dtype: torch.dtype
    device: torch.device
    max_model_len: int  # longest sequence (prompt + output) the engine runs
    max_num_seqs: int  # requests decoded at once
    model: Decoder | None = None  # the target, for drafters that borrow its weights
    model_dir: str | None = None  # where the target was loaded from (finds heads shipped for it)
    cache: KVCache | None = None  # the target's cache, for drafters that run the target's own layers


@dataclass
class DrafterRegistry:
    """Maps a speculative config's ``method`` to the drafter class that implements it, and to the
    draft length a config that names none gets (``num_speculative_tokens``)."""

    factories: dict[str, DrafterFactory] = field(default_factory=dict)
    default_lengths: dict[str, int] = field(default_factory=dict)
    # Per method, what a config's own files recommend (a head's manifest), before the default.
    length_advisors: dict[str, LengthAdvisor] = field(default_factory=dict)

    def register(
        self,
        method: str,
        factory: DrafterFactory,
        *,
        num_speculative_tokens: int = 5,
        length_advisor: LengthAdvisor | None = None,
    ) -> None:
        if method in self.factories:
            raise ValueError(f"drafter method {method!r} is already registered")
        self.factories[method] = factory
        self.default_lengths[method] = num_speculative_tokens
        if length_advisor is not None:
            self.length_advisors[method] = length_advisor

    def _check_known(self, method: str) -> None:
        if method not in self.factories:
            raise ValueError(f"unknown speculative method {method!r}; available: {', '.join(sorted(self.factories))}")

    def default_num_speculative_tokens(
        self, method: str, *, target: TargetInfo | None = None, options: dict | None = None
    ) -> int:
        """The draft length of a config that names none: what its head recommends (given the
        target and the config's options, for methods with an advisor), else the method's."""
        self._check_known(method)
        advisor = self.length_advisors.get(method)
        if advisor is not None and target is not None:
            recommended = advisor(target=target, options=options or {})
            if recommended is not None:
                return recommended
        return self.default_lengths[method]

    def create(self, method: str, **kwargs) -> Drafter:
        self._check_known(method)
        return self.factories[method](**kwargs)
