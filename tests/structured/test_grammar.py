"""RequestGrammar: tree walks cut exactly the forbidden subtrees, masks per path, no state leaks."""

from __future__ import annotations

import pytest
import torch

from quickdraft.drafters.base import Proposal
from quickdraft.models.tokenizer import Tokenizer
from quickdraft.structured import StructuredOutputsParams
from quickdraft.structured.grammar import GrammarCompiler, apply_masks
from tests.conftest import write_tiny_tokenizer

VOCAB = 320
EOS = 1


@pytest.fixture(scope="module")
def compiler(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    write_tiny_tokenizer(folder, bos="<bos>", eos="<eos>", chat=False)
    tokenizer = Tokenizer.from_dir(folder)
    compiler = GrammarCompiler(tokenizer=tokenizer.backend, vocab_size=VOCAB, eos_token_ids=[EOS])
    compiler.ids = {ch: tokenizer.token_to_id(ch) for ch in "abcdxyz0123456789"}
    return compiler


def allowed_tokens(bitmask_row: torch.Tensor) -> set[int]:  # [ceil(V / 32)] int32
    return {t for t in range(VOCAB) if (int(bitmask_row[t // 32]) >> (t % 32)) & 1}


def test_walk_cuts_forbidden_subtrees_and_masks_each_path(compiler):
    ids = compiler.ids
    grammar = compiler.matcher_for(StructuredOutputsParams(regex="a(b|c)d"))
    root = 5  # the last prompt token: not part of the output
    #            0     1         2         3         4         5         6         7
    tokens = [root, ids["a"], ids["x"], ids["b"], ids["c"], ids["d"], ids["a"], ids["d"]]
    parents = [-1, 0, 0, 1, 1, 3, 2, 4]
    masks = grammar.walk(Proposal(token_ids=tokens, parents=parents))
    # x (2) is forbidden after the root: it and its child (6) go; everything else is allowed.
    assert masks.kept == [0, 1, 3, 5, 4, 7]  # depth first, siblings in their order
    assert masks.proposal.token_ids == [root, ids["a"], ids["b"], ids["d"], ids["c"], ids["d"]]
    assert masks.proposal.parents == [-1, 0, 1, 2, 1, 4]
    expected = [{ids["a"]}, {ids["b"], ids["c"]}, {ids["d"]}, {EOS}, {ids["d"]}, {EOS}]
    assert [allowed_tokens(row) for row in masks.bitmask] == expected
    assert masks.unmasked == []
    # The walk rolled back: the committed state is still the start.
    assert grammar.forced_tokens(8) == [ids["a"]]
    grammar.accept_token(ids["a"])
    assert allowed_tokens(grammar.walk(Proposal.root_only(ids["a"])).bitmask[0]) == {ids["b"], ids["c"]}


def test_eos_ends_a_path_and_its_row_stays_unmasked(compiler):
    ids = compiler.ids
    grammar = compiler.matcher_for(StructuredOutputsParams(regex="a|ab"))
    tokens = [5, ids["a"], EOS, ids["b"], ids["b"]]
    parents = [-1, 0, 1, 1, 2]  # node 4 follows EOS
    masks = grammar.walk(Proposal(token_ids=tokens, parents=parents))
    assert masks.kept == [0, 1, 2, 3]  # EOS kept, what was drafted after it cut
    assert masks.unmasked == [2]  # the EOS node's row is left as it is


def test_sampled_chain_keeps_its_first_forbidden_token_as_last_node(compiler):
    ids = compiler.ids
    grammar = compiler.matcher_for(StructuredOutputsParams(regex="ab+"))
    tokens = [5, ids["a"], ids["x"], ids["b"]]
    draft_probs = torch.full((4, VOCAB), 1.0 / VOCAB)
    masks = grammar.walk(Proposal.chain(5, tokens[1:], draft_probs=draft_probs))
    assert masks.kept == [0, 1, 2]  # x kept (rejected for sure: its probability is 0), b cut
    assert masks.unmasked == [2]
    assert masks.proposal.draft_probs is not None and masks.proposal.draft_probs.shape == (3, VOCAB)
    point_masses = grammar.walk(Proposal.chain(5, tokens[1:]))
    assert point_masses.kept == [0, 1]


def test_apply_masks_sets_forbidden_logits_to_minus_inf(compiler):
    ids = compiler.ids
    grammar = compiler.matcher_for(StructuredOutputsParams(choice=["ab", "cd"]))
    masks = grammar.walk(Proposal(token_ids=[5, ids["a"], EOS], parents=[-1, 0, 0]))
    assert masks.kept == [0, 1]  # EOS is not allowed before the choice is complete
    with torch.inference_mode():
        logits = torch.randn(2, VOCAB)
        original = logits.clone()
        apply_masks(logits, masks)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == sorted([ids["a"], ids["c"]])
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [ids["b"]]
    assert torch.equal(logits[1, ids["b"]], original[1, ids["b"]])


def test_forced_tokens_of_a_fixed_string(compiler):
    ids = compiler.ids
    grammar = compiler.matcher_for(StructuredOutputsParams(regex="abc[0-9]"))
    assert grammar.forced_tokens(2) == [ids["a"], ids["b"]]
    assert grammar.forced_tokens(8) == [ids["a"], ids["b"], ids["c"]]
    for token in grammar.forced_tokens(8):
        grammar.accept_token(token)
    assert grammar.forced_tokens(8) == []  # a free digit next
    with pytest.raises(RuntimeError, match="refused committed token"):
        grammar.accept_token(ids["x"])


def test_sparse_token_lists_name_the_allowed_tokens_of_narrow_rows():
    from quickdraft.structured.grammar import sparse_token_lists

    bitmask = torch.zeros(4, 10, dtype=torch.int32)
    bitmask[0, 0] = 1 << 5
    bitmask[0, 3] = -(2**31) + 1  # bits 0 and 31 (the sign bit of an int32)
    bitmask[1] = -1  # everything: too many
    bitmask[2, 9] = 1 << 2
    bitmask[3, 1] = 1 << 1
    lists = sparse_token_lists(bitmask, skip={3}, limit=3)
    assert lists == [[5, 96, 127], None, [290], None]
    assert sparse_token_lists(bitmask[:1], skip=set(), limit=2) == [None]


def test_walk_appends_the_forced_tokens_after_each_leaf_within_budget_and_depth(compiler):
    ids = compiler.ids
    grammar = compiler.matcher_for(StructuredOutputsParams(regex="(ab|cd)xyz[0-9]"))
    tokens = [5, ids["a"], ids["c"], ids["d"]]
    parents = [-1, 0, 0, 2]  # a leaf after "a", a leaf after "cd"
    masks = grammar.walk(Proposal(token_ids=tokens, parents=parents), extend=5)
    # after "a": b x y z forced (4 of the 5); after "cd": x y z, but only 1 left
    assert masks.proposal.token_ids == [
        5,
        ids["a"],
        ids["b"],
        ids["x"],
        ids["y"],
        ids["z"],
        ids["c"],
        ids["d"],
        ids["x"],
    ]
    assert masks.proposal.parents == [-1, 0, 1, 2, 3, 4, 0, 6, 7]
    assert masks.kept == [0, 1, -1, -1, -1, -1, 2, 3, -1]
    assert allowed_tokens(masks.bitmask[5]) == {ids[d] for d in "0123456789"}
    deep = grammar.walk(Proposal(token_ids=tokens, parents=parents), extend=8, max_depth=3)
    assert deep.proposal.token_ids == [5, ids["a"], ids["b"], ids["x"], ids["c"], ids["d"], ids["x"]]
    assert grammar.forced_tokens(8) == []  # the walks rolled back to the start: (ab|cd) is free
    plain = grammar.walk(Proposal.root_only(5))
    assert plain.kept == [0]
