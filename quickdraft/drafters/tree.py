"""Draft-tree shapes for head drafters: static (Medusa's paths) and dynamic (EAGLE-2).

Both produce a tree whose node 0 is the root (the last committed token) and whose parents
precede their children, the layout a Proposal needs.  Tree children here are top-k picks
of a draft distribution, so the proposals they make are point masses (``draft_probs=None``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from quickdraft.drafters.base import Proposal
from quickdraft.verify.tree import Tree


@dataclass(frozen=True)
class StaticTree:
    """A fixed tree given as paths of candidate ranks, Medusa's ``medusa_choices`` form.

    ``(0,)`` is the top-1 token at depth 1, ``(0, 1)`` the second-best token at depth 2
    under it, and so on.  Every prefix of a path must be a path too.
    """

    paths: tuple[tuple[int, ...], ...]  # sorted by (depth, ranks): parents come first
    parents: tuple[int, ...]  # [num_nodes] node 0 = root, parent -1
    ranks: tuple[int, ...]  # [num_nodes] candidate rank of each node at its depth (root: -1)
    depths: tuple[int, ...]  # [num_nodes]

    @classmethod
    def from_paths(cls, paths) -> StaticTree:
        normalized = []
        for path in paths:
            if (
                not isinstance(path, (list, tuple))
                or not path
                or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in path)
            ):
                raise ValueError(f"tree path {path!r} must be a non-empty list of candidate ranks >= 0")
            normalized.append(tuple(path))
        if not normalized:
            raise ValueError("a static tree needs at least one path")
        unique = sorted(set(normalized), key=lambda p: (len(p), p))
        index = {(): 0}
        parents, ranks, depths = [-1], [-1], [0]
        for path in unique:
            if path[:-1] not in index:
                raise ValueError(f"tree path {list(path)} has no parent path {list(path[:-1])}")
            index[path] = len(parents)
            parents.append(index[path[:-1]])
            ranks.append(path[-1])
            depths.append(len(path))
        return cls(paths=tuple(unique), parents=tuple(parents), ranks=tuple(ranks), depths=tuple(depths))

    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    @property
    def max_rank(self) -> int:
        return max(self.ranks) + 1

    def truncated(self, *, max_draft_nodes: int, max_depth: int) -> StaticTree | None:
        """The first draft nodes (breadth first) within a node budget and a depth limit;
        None when not even one fits."""
        keep = [p for p in self.paths if len(p) <= max_depth][: max(0, max_draft_nodes)]
        if not keep:
            return None
        return self if len(keep) == len(self.paths) else StaticTree.from_paths(keep)


def default_medusa_paths(*, depth: int, top_k: int) -> list[tuple[int, ...]]:
    """A sensible default static tree: a top-1 spine with top_k side candidates at each depth,
    and a second branch under the second-best first token (top_k 1: the spine alone, a chain)."""
    paths = []
    spine: tuple[int, ...] = ()
    for _ in range(depth):
        paths += [spine + (rank,) for rank in range(top_k)]
        spine = spine + (0,)
    if top_k == 1:
        return paths
    second: tuple[int, ...] = (1,)
    for _ in range(depth - 1):
        second = second + (0,)
        paths.append(second)
    return paths


@dataclass
class DynamicTree:
    """EAGLE-2 tree growth: score = cumulative draft log-probability along the path.

    The drafter adds the top-k children of chosen nodes depth by depth (`add_children`),
    picks the best nodes of the newest depth to expand next (`best_frontier`), and at the
    end keeps the `budget` best nodes overall (`pruned`).  A child never scores above its
    parent, so the best nodes by score always include their ancestors.
    """

    root_token: int
    token_ids: list[int] = field(default_factory=list)  # [num_nodes]
    scores: list[float] = field(default_factory=list)  # [num_nodes] cumulative log-prob
    ranks: list[int] = field(default_factory=list)  # [num_nodes] candidate rank under the parent
    shape: Tree = field(default_factory=lambda: Tree([-1]))  # parents, depths, ancestors as it grows

    def __post_init__(self) -> None:
        self.token_ids, self.scores, self.ranks, self.shape = [self.root_token], [0.0], [-1], Tree([-1])

    @property
    def parents(self) -> list[int]:  # [num_nodes]
        return self.shape.parents

    @property
    def depths(self) -> list[int]:  # [num_nodes]
        return self.shape.depths

    def add_children(
        self, parent: int, tokens: list[int], log_probs: list[float], ranks: list[int] | None = None
    ) -> list[int]:
        """Children of `parent` with their own draft log-probs; returns their node indices."""
        added = []
        for i, (token, log_prob) in enumerate(zip(tokens, log_probs)):
            added.append(self.shape.add(parent))
            self.token_ids.append(token)
            self.scores.append(self.scores[parent] + min(0.0, log_prob))
            self.ranks.append(i if ranks is None else ranks[i])
        return added

    def path_ranks(self, node: int) -> tuple[int, ...]:
        """Candidate ranks from the root down to `node` (its path in a static tree)."""
        return tuple(self.ranks[n] for n in self.shape.path(node)[1:])

    def best_frontier(self, nodes: list[int], k: int) -> list[int]:
        """The k best of `nodes` by score (ties: earlier node first), in node order."""
        chosen = sorted(nodes, key=lambda n: (-self.scores[n], n))[:k]
        return sorted(chosen)

    def proposal(self, budget: int) -> Proposal:
        """The root plus the `budget` best draft nodes (pruned), each with its path's score."""
        order = self._kept(budget)
        token_ids, parents = self._subtree(order)
        return Proposal(token_ids=token_ids, parents=parents, path_log_probs=[self.scores[n] for n in order])

    def pruned(self, budget: int) -> tuple[list[int], list[int]]:
        """(token_ids, parents) of the root plus the `budget` best draft nodes, parents first."""
        return self._subtree(self._kept(budget))

    def _kept(self, budget: int) -> list[int]:  # the kept nodes, root first, parents before children
        drafts = sorted(range(1, len(self.token_ids)), key=lambda n: (-self.scores[n], self.depths[n], n))
        kept = set(drafts[:budget])
        for node in list(kept):  # equal scores can rank a child above its parent: keep ancestors
            parent = self.parents[node]
            while parent > 0 and parent not in kept:
                kept.add(parent)
                parent = self.parents[parent]
        while len(kept) > budget:  # only possible after adding ancestors: drop the worst leaves
            leaves = [n for n in kept if not any(self.parents[c] == n for c in kept)]
            kept.discard(max(leaves, key=lambda n: (-self.scores[n], self.depths[n], n)))
        return [0] + sorted(kept, key=lambda n: (self.depths[n], n))

    def _subtree(self, order: list[int]) -> tuple[list[int], list[int]]:  # (token_ids, parents) of those nodes
        new_index = {node: i for i, node in enumerate(order)}
        parents = [-1] + [new_index[self.parents[n]] for n in order[1:]]
        return [self.token_ids[n] for n in order], parents
