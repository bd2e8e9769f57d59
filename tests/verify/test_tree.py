"""The tree shape every module reads: exact tables for depths, children, paths and masks."""

from __future__ import annotations

import pytest
import torch

from quickdraft.drafters.base import Proposal
from quickdraft.verify.tree import Tree

#        0
#      /   \
#     1     2
#    / \     \
#   3   4     5
#             |
#             6
PARENTS = [-1, 0, 0, 1, 1, 2, 5]


def test_facts_of_a_tree():
    tree = Tree(PARENTS)
    assert tree.num_nodes == 7
    assert tree.depths == [0, 1, 1, 2, 2, 2, 3]
    assert tree.max_depth == 3
    assert tree.children == [[1, 2], [3, 4], [5], [], [], [6], []]
    assert [tree.path(n) for n in range(7)] == [[0], [0, 1], [0, 2], [0, 1, 3], [0, 1, 4], [0, 2, 5], [0, 2, 5, 6]]
    tokens = [10, 11, 12, 13, 14, 15, 16]
    assert tree.path_tokens(tokens, 6) == [12, 15, 16]
    assert tree.path_tokens(tokens, 0) == []


def test_ancestor_mask_table():
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0, 0],
            [1, 0, 1, 0, 0, 0, 0],
            [1, 1, 0, 1, 0, 0, 0],
            [1, 1, 0, 0, 1, 0, 0],
            [1, 0, 1, 0, 0, 1, 0],
            [1, 0, 1, 0, 0, 1, 1],
        ],
        dtype=torch.bool,
    )
    tree = Tree(PARENTS)
    assert torch.equal(tree.ancestor_mask(), expected)
    for node in range(7):
        for other in range(7):
            assert tree.is_ancestor(other, node) == bool(expected[node, other])


def test_chain_is_a_tree_of_width_one():
    tree = Tree.chain(4)
    assert tree.parents == [-1, 0, 1, 2]
    assert tree.depths == [0, 1, 2, 3]
    assert torch.equal(tree.ancestor_mask(), torch.ones(4, 4, dtype=torch.bool).tril())
    assert Tree.chain(1).parents == [-1]


def test_growing_a_tree_gives_the_same_facts_and_a_fresh_mask():
    grown = Tree([-1])
    first_mask = grown.ancestor_mask()
    assert first_mask.shape == (1, 1)
    for parent in PARENTS[1:]:
        grown.add(parent)
    assert grown == Tree(PARENTS)
    assert grown.depths == Tree(PARENTS).depths and grown.children == Tree(PARENTS).children
    assert torch.equal(grown.ancestor_mask(), Tree(PARENTS).ancestor_mask())


@pytest.mark.parametrize(
    "parents, message",
    [([], "at least its root"), ([0, 0], "node 0 must be the root"), ([-1, 1], "parents must come first"),
     ([-1, 0, 3, 1], "parents must come first"), ([-1, -1], "parents must come first")],
)  # fmt: skip
def test_bad_parents_are_refused(parents, message):
    with pytest.raises(ValueError, match=message):
        Tree(parents)


def test_proposal_carries_its_tree():
    proposal = Proposal(token_ids=[5, 6, 7, 8], parents=[-1, 0, 0, 1])
    assert proposal.tree == Tree([-1, 0, 0, 1])
    assert proposal.tree.depths == [0, 1, 1, 2]
    assert Proposal.root_only(5).tree.num_nodes == 1 and Proposal.root_only(5).num_draft_tokens == 0
    with pytest.raises(ValueError, match="parents must come first"):
        Proposal(token_ids=[5, 6], parents=[-1, 3])
