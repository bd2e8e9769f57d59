"""Draft-tree construction: static trees from Medusa-style paths, EAGLE-2 dynamic growth."""

from __future__ import annotations

import math

import pytest

from quickdraft.drafters.base import Proposal
from quickdraft.drafters.tree import DynamicTree, StaticTree, default_medusa_paths


def test_static_tree_from_paths_exact_table():
    tree = StaticTree.from_paths([[0, 0], [1], [0], [0, 1], [1, 0], [0, 0, 0]])
    assert tree.paths == ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
    assert tree.parents == (-1, 0, 0, 1, 1, 2, 3)
    assert tree.ranks == (-1, 0, 1, 0, 1, 0, 0)
    assert tree.depths == (0, 1, 1, 2, 2, 2, 3)
    assert tree.num_nodes == 7 and tree.max_depth == 3 and tree.max_rank == 2


def test_static_tree_dedups_and_validates():
    assert StaticTree.from_paths([(0,), [0]]).num_nodes == 2
    with pytest.raises(ValueError, match="no parent path"):
        StaticTree.from_paths([[0, 1]])
    for bad in ([[]], [[-1]], [["a"]], [[True]], []):
        with pytest.raises(ValueError):
            StaticTree.from_paths(bad)


def test_static_tree_truncation_keeps_breadth_first_prefix():
    tree = StaticTree.from_paths([[0], [1], [0, 0], [0, 1], [0, 0, 0]])
    small = tree.truncated(max_draft_nodes=3, max_depth=5)
    assert small.paths == ((0,), (1,), (0, 0))
    assert tree.truncated(max_draft_nodes=10, max_depth=2).paths == ((0,), (1,), (0, 0), (0, 1))
    assert tree.truncated(max_draft_nodes=10, max_depth=10) is tree
    assert tree.truncated(max_draft_nodes=0, max_depth=3) is None


def test_default_medusa_paths_form_a_valid_tree():
    paths = default_medusa_paths(depth=3, top_k=2)
    assert paths == [(0,), (1,), (0, 0), (0, 1), (0, 0, 0), (0, 0, 1), (1, 0), (1, 0, 0)]
    tree = StaticTree.from_paths(paths)
    Proposal(token_ids=list(range(tree.num_nodes)), parents=list(tree.parents))
    chain = default_medusa_paths(depth=3, top_k=1)  # the spine alone (no second-best branch)
    assert chain == [(0,), (0, 0), (0, 0, 0)]
    assert list(StaticTree.from_paths(chain).parents) == [-1, 0, 1, 2]


def test_dynamic_tree_scores_expansion_and_pruning():
    tree = DynamicTree(root_token=100)
    a, b = tree.add_children(0, [1, 2], [math.log(0.6), math.log(0.3)])
    assert tree.best_frontier([a, b], 1) == [a]
    aa, ab = tree.add_children(a, [3, 4], [math.log(0.9), math.log(0.05)])
    (ba,) = tree.add_children(b, [5], [math.log(0.9)])
    assert tree.scores[aa] == pytest.approx(math.log(0.54))
    assert tree.best_frontier([aa, ab, ba], 2) == [aa, ba]
    tokens, parents = tree.pruned(3)
    # best three: a (0.6), aa (0.54), b (0.3); ba (0.27) and ab (0.03) are dropped
    assert tokens == [100, 1, 2, 3] and parents == [-1, 0, 0, 1]
    tokens, parents = tree.pruned(10)
    assert tokens == [100, 1, 2, 3, 4, 5] and parents == [-1, 0, 0, 1, 1, 2]
    Proposal(token_ids=tokens, parents=parents)
    proposal = tree.proposal(3)  # the same nodes, each with its path's log-probability
    assert (proposal.token_ids, proposal.parents) == ([100, 1, 2, 3], [-1, 0, 0, 1])
    assert [math.exp(lp) for lp in proposal.path_log_probs] == pytest.approx([1.0, 0.6, 0.3, 0.54])
    with pytest.raises(ValueError, match="path_log_probs has 2 values for 4 nodes"):
        Proposal(token_ids=tokens[:4], parents=parents[:4], path_log_probs=[0.0, -1.0])


def test_dynamic_tree_pruning_keeps_ancestors_on_ties():
    tree = DynamicTree(root_token=0)
    (a,) = tree.add_children(0, [1], [0.0])  # probability 1: the child ties its parent
    (_aa,) = tree.add_children(a, [2], [0.0])
    tree.add_children(0, [3], [math.log(0.5)])
    tokens, parents = tree.pruned(2)
    assert tokens == [0, 1, 2] and parents == [-1, 0, 1]
    assert tree.pruned(1) == ([0, 1], [-1, 0])
