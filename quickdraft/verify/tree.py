"""The shape of a draft tree, worked out once: depths, children, ancestors, paths.

Node 0 is the root (the last committed token); every other node's parent comes before it.
A chain is a tree of width 1.  Every module that needs a tree fact (the attention mask and
positions of the verification forward, the rejection walk, the node histories of sampled
verification, the drafters that grow trees depth by depth) reads it from here, so a fact
has one definition.

Ancestor sets are Python ints used as bitsets (bit j set: node j is the node itself or one
of its ancestors): one OR per node builds them, and the boolean mask tensor is made from
them only when a forward asks for it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class Tree:
    """A tree shape given by parent indices (-1 for the root); nodes may be added at the end."""

    __slots__ = ("_ancestors", "_mask", "children", "depths", "parents")

    def __init__(self, parents: Sequence[int]):
        if not parents:
            raise ValueError("a tree needs at least its root")
        if parents[0] != -1:
            raise ValueError("node 0 must be the root (parent -1)")
        self.parents: list[int] = [-1]  # [num_nodes]
        self.depths: list[int] = [0]  # [num_nodes] root 0
        self.children: list[list[int]] = [[]]  # [num_nodes] children in index order
        self._ancestors: list[int] = [1]  # [num_nodes] bitset: the node and its ancestors
        self._mask: torch.Tensor | None = None  # [num_nodes, num_nodes] built on demand
        for parent in parents[1:]:
            self.add(parent)

    @classmethod
    def chain(cls, num_nodes: int) -> Tree:
        return cls([-1, *range(num_nodes - 1)])

    def add(self, parent: int) -> int:
        """Append a child of `parent`; returns its node index."""
        node = len(self.parents)
        if not 0 <= parent < node:
            raise ValueError(f"node {node} has parent {parent}: parents must come first")
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.children.append([])
        self.children[parent].append(node)
        self._ancestors.append(self._ancestors[parent] | (1 << node))
        self._mask = None
        return node

    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    def path(self, node: int) -> list[int]:
        """The nodes from the root down to `node`, both included."""
        path = [node]
        while node > 0:
            node = self.parents[node]
            path.append(node)
        return path[::-1]

    def path_tokens(self, token_ids: Sequence[int], node: int) -> list[int]:
        """The tokens of the nodes below the root on the path to `node` (the root's excluded)."""
        return [token_ids[n] for n in self.path(node)[1:]]

    def is_ancestor(self, ancestor: int, node: int) -> bool:
        """True when `ancestor` is `node` itself or on its path to the root."""
        return bool(self._ancestors[node] >> ancestor & 1)

    def ancestor_mask(self) -> torch.Tensor:  # -> [num_nodes, num_nodes] bool (CPU)
        """mask[i, j] is True when node j is node i or one of its ancestors."""
        if self._mask is None:
            num_nodes = self.num_nodes
            rows: list[list[bool]] = []
            for node, parent in enumerate(self.parents):
                row = rows[parent].copy() if parent >= 0 else [False] * num_nodes
                row[node] = True
                rows.append(row)
            self._mask = torch.tensor(rows, dtype=torch.bool)
        return self._mask

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Tree) and self.parents == other.parents

    def __repr__(self) -> str:
        return f"Tree(parents={self.parents})"
