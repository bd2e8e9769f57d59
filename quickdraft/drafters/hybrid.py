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

Merged proposals are point masses (``draft_probs=None``): exact for any child, since
verifying a token as a point mass is exact for every proposal chosen without the
verifier's randomness.  After verification each child is told the accepted path in its own
node indices (the part of the path that lies in its tree).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quickdraft.drafters.base import AcceptedPath, Drafter, DraftRequest, Proposal, TargetInfo


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


class HybridDrafter(Drafter):
    def __init__(
        self,
        *,
        target: TargetInfo,
        drafters: list[dict],
        num_speculative_tokens: int = 5,
        max_draft_tokens: int | None = None,
        skip_after: int | None = None,
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
            options.setdefault("num_speculative_tokens", num_speculative_tokens)
            self.children.append(registry.create(method, target=target, **options))
        if max_draft_tokens is not None and (not isinstance(max_draft_tokens, int) or max_draft_tokens < 1):
            raise ValueError(f"max_draft_tokens must be a positive integer, got {max_draft_tokens!r}")
        self.max_draft_tokens = max_draft_tokens
        if skip_after is not None and (
            not isinstance(skip_after, int) or isinstance(skip_after, bool) or skip_after < 1
        ):
            raise ValueError(f"skip_after must be a positive integer, got {skip_after!r}")
        self.skip_after = skip_after
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

    def skip(self, request: DraftRequest, num_tokens: int) -> None:
        for child, blocks in zip(self.children, self._feature_blocks):
            if blocks:
                child.skip(request, num_tokens)

    def propose(self, requests: list[DraftRequest]) -> list[Proposal | None]:
        per_child = []  # [child][request index] -> proposal or None
        drafted = [0] * len(requests)
        for child in self.children:
            asking = [i for i in range(len(requests)) if self.skip_after is None or drafted[i] < self.skip_after]
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

    def accept(self, request: DraftRequest, accepted: AcceptedPath) -> None:
        merged = self._merged.pop(request.request_id, None)
        for i, child in enumerate(self.children):
            mapping = merged.child_nodes[i] if merged is not None else {0: 0}
            child.accept(request, path_in_child(accepted, mapping))

    def finish(self, request_id: str) -> None:
        self._merged.pop(request_id, None)
        for child in self.children:
            child.finish(request_id)
