"""The step's one verification call: batched results equal each request verified alone, and a
root-only proposal commits the token plain decoding would sample."""

from __future__ import annotations

import pytest
import torch

from quickdraft.drafters.base import Proposal
from quickdraft.engine.request import Request
from quickdraft.engine.verification import StepLogits, chain_rows, first_child_chain, node_histories, verify_step
from quickdraft.models.tokenizer import Tokenizer
from quickdraft.sampling_params import SamplingParams
from quickdraft.verify.sampler import RowContext, logits_to_probs, make_generator, position_key, sample_keyed

VOCAB = 320
EOS = [1]


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoints) -> Tokenizer:
    return Tokenizer.from_dir(tiny_checkpoints["gemma3"])


def make_request(tokenizer, *, name: str, params: SamplingParams, outputs=(), seed: int = 7) -> Request:
    request = Request(
        request_id=name,
        prompt=None,
        prompt_token_ids=[5, 6, 7],
        params=params,
        tokenizer=tokenizer,
        eos_token_ids=EOS,
        max_model_len=256,
        seed=seed,
        generator=make_generator(position_key(seed, -1), torch.device("cpu")),
    )
    request.output_token_ids.extend(outputs)
    return request


GREEDY = SamplingParams(temperature=0.0, max_tokens=50)
SAMPLED = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=50)


def mixed_step(tokenizer):
    """Requests of every kind in one step, each with its proposal; built fresh (generators advance)."""
    gen = torch.Generator().manual_seed(1)
    draft_probs = torch.softmax(torch.randn(3, VOCAB, generator=gen), dim=-1)
    drafted = torch.multinomial(draft_probs[:2], 1, generator=gen).flatten().tolist()
    cases = [
        (make_request(tokenizer, name="greedy-plain", params=GREEDY), Proposal.root_only(7)),
        (make_request(tokenizer, name="sampled-plain", params=SAMPLED, seed=3), Proposal.root_only(7)),
        (
            make_request(tokenizer, name="greedy-tree", params=GREEDY, outputs=[9]),
            Proposal(token_ids=[9, 4, 8, 4, 2], parents=[-1, 0, 0, 1, 2]),
        ),
        (
            make_request(tokenizer, name="sampled-tree", params=SAMPLED, outputs=[9, 9], seed=11),
            Proposal(token_ids=[9, 4, 8, 4, 2], parents=[-1, 0, 0, 1, 2]),
        ),
        (
            make_request(tokenizer, name="sampled-draft-probs", params=SAMPLED, seed=5),
            Proposal.chain(7, drafted, draft_probs=draft_probs),
        ),
        (  # one token left: the cap stops the walk at the root
            make_request(tokenizer, name="capped", params=SamplingParams(temperature=0.0, max_tokens=2), outputs=[3]),
            Proposal.chain(3, [4, 5]),
        ),
    ]
    requests, proposals = [c[0] for c in cases], [c[1] for c in cases]
    offsets = [0]
    for proposal in proposals:
        offsets.append(offsets[-1] + proposal.tree.num_nodes)
    # Sharp rows, so that drafts are sometimes accepted: each node favours token (node + 4).
    logits = torch.randn(offsets[-1], VOCAB, generator=gen)
    logits[torch.arange(offsets[-1]), torch.arange(offsets[-1]) % 5 + 4] += 6.0
    return requests, proposals, logits, offsets


def test_batched_verification_equals_each_request_alone(tokenizer):
    requests, proposals, logits, offsets = mixed_step(tokenizer)
    batched = verify_step(requests=requests, proposals=proposals, logits=logits, row_offsets=offsets, eos_token_ids=EOS)
    requests, proposals, logits, offsets = mixed_step(tokenizer)  # fresh generators
    alone = [
        verify_step(
            requests=[request],
            proposals=[proposal],
            logits=logits[offsets[i] : offsets[i + 1]],
            row_offsets=[0, offsets[i + 1] - offsets[i]],
            eos_token_ids=EOS,
        )[0]
        for i, (request, proposal) in enumerate(zip(requests, proposals))
    ]
    assert batched == alone
    assert [len(path.committed_token_ids) for path in batched][-1] == 1  # the cap
    assert any(path.num_accepted > 0 for path in batched)  # the sharp rows accept some drafts


def test_root_only_proposal_commits_plain_decodings_token(tokenizer):
    requests, proposals, logits, offsets = mixed_step(tokenizer)
    paths = verify_step(
        requests=requests[:2], proposals=proposals[:2], logits=logits, row_offsets=offsets[:3], eos_token_ids=EOS
    )
    assert paths[0].nodes == [0] and paths[0].bonus
    assert paths[0].committed_token_ids == [int(logits[0].argmax())]
    sampled = requests[1]
    probs = logits_to_probs(
        logits[1:2],
        [RowContext(params=SAMPLED, prompt_token_ids=sampled.prompt_token_ids, output_token_ids=[])],
        eos_token_ids=EOS,
    )
    assert paths[1].committed_token_ids == sample_keyed(probs, [position_key(sampled.seed, 0)]).tolist()


def test_greedy_tree_walks_the_argmaxes(tokenizer):
    requests, proposals, logits, offsets = mixed_step(tokenizer)
    rows = logits[offsets[2] : offsets[3]]
    argmax = rows.argmax(dim=-1).tolist()
    path = verify_step(
        requests=[requests[2]], proposals=[proposals[2]], logits=rows, row_offsets=[0, 5], eos_token_ids=EOS
    )[0]
    walk, committed = [0], []
    children = proposals[2].tree.children
    while True:
        child = next((c for c in children[walk[-1]] if proposals[2].token_ids[c] == argmax[walk[-1]]), None)
        committed.append(argmax[walk[-1]])
        if child is None:
            break
        walk.append(child)
    assert path.nodes == walk and path.committed_token_ids == committed


def test_node_histories_follow_the_paths(tokenizer):
    request = make_request(tokenizer, name="r", params=GREEDY, outputs=[9, 3])
    proposal = Proposal(token_ids=[3, 4, 8, 5], parents=[-1, 0, 0, 1])
    assert node_histories(request, proposal) == [[9, 3], [9, 3, 4], [9, 3, 8], [9, 3, 4, 5]]


def test_rows_that_do_not_match_the_trees_are_refused(tokenizer):
    requests, proposals, logits, offsets = mixed_step(tokenizer)
    with pytest.raises(ValueError, match="logits rows"):
        verify_step(
            requests=requests[:1], proposals=proposals[:1], logits=logits, row_offsets=[0, 2], eos_token_ids=EOS
        )
    with pytest.raises(ValueError, match="proposals"):
        verify_step(requests=requests, proposals=proposals[:2], logits=logits, row_offsets=offsets, eos_token_ids=EOS)


def test_rows_filled_when_the_walks_reach_them_give_the_same_paths(tokenizer):
    """Only the roots computed at first: the walks ask for the rows on their paths (with a bit of
    their first-child chains), rejection sampling for all of its rows, and commit what the full
    table commits."""
    requests, proposals, logits, offsets = mixed_step(tokenizer)
    full = verify_step(requests=requests, proposals=proposals, logits=logits, row_offsets=offsets, eos_token_ids=EOS)
    requests, proposals, logits, offsets = mixed_step(tokenizer)  # fresh generators
    roots = offsets[:-1]
    filled: list[list[int]] = []

    def fill(rows: list[int]) -> torch.Tensor:
        filled.append(rows)
        return logits[rows]

    lazy = StepLogits(logits.shape[0], fill=fill, first_rows=1)
    lazy.add(roots, logits[roots])
    paths = verify_step(requests=requests, proposals=proposals, logits=lazy, row_offsets=offsets, eos_token_ids=EOS)
    assert paths == full
    draft_probs_rows = list(range(offsets[4], offsets[5]))  # rejection sampling: every row, before any walk
    assert filled[0] == [row for row in draft_probs_rows if row not in roots]
    assert torch.equal(lazy.gather(draft_probs_rows[1:]), logits[draft_probs_rows[1:]])  # one fill: a view
    assert torch.equal(lazy.gather([offsets[2], offsets[4] + 1]), logits[[offsets[2], offsets[4] + 1]])  # a copy
    walked_rows = {offsets[k] + node for k, path in enumerate(paths) if k != 4 for node in path.nodes}
    later = {row for rows in filled[1:] for row in rows}
    assert walked_rows - set(roots) <= later  # every path row was asked for
    assert any(not lazy.ready(row) for row in range(offsets[-1]))  # and some rows never were


def test_a_row_missing_with_nothing_to_fill_it_is_an_error(tokenizer):
    requests, proposals, logits, offsets = mixed_step(tokenizer)
    lazy = StepLogits(logits.shape[0])
    with pytest.raises(ValueError, match="never computed"):
        verify_step(requests=requests, proposals=proposals, logits=lazy, row_offsets=offsets, eos_token_ids=EOS)


def test_chain_rows_follow_first_children():
    proposal = Proposal(token_ids=[3, 4, 8, 5, 6, 7, 2, 9], parents=[-1, 0, 0, 1, 1, 3, 5, 6])
    assert first_child_chain(proposal, 0) == [0, 1, 3, 5, 6, 7]
    assert chain_rows(proposal, 0, 3) == [0, 1, 3]  # 3 would be left: a call of their own if reached
    assert chain_rows(proposal, 0, 4) == [0, 1, 3, 5, 6, 7]  # 2 left (half of 4): taken now
    assert chain_rows(proposal, 1, 2) == [1, 3]
    assert chain_rows(proposal, 2, 4) == [2]
