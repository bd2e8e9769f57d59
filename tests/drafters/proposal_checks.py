"""Checks shared by the drafter tests: a proposal's paths and its validity as a tree."""

from __future__ import annotations

from collections import Counter

from quickdraft.drafters.base import AcceptedPath, DraftRequest, Proposal


def paths(proposal: Proposal) -> list[tuple[int, ...]]:
    """Every root-to-node token path (root excluded), in node order."""
    result = []
    for node in range(1, len(proposal.token_ids)):
        path = []
        while node > 0:
            path.append(proposal.token_ids[node])
            node = proposal.parents[node]
        result.append(tuple(reversed(path)))
    return result


def assert_valid_proposal(proposal: Proposal, req: DraftRequest) -> None:
    context = req.prompt_token_ids + req.output_token_ids
    assert proposal.token_ids[0] == context[-1]
    assert proposal.parents[0] == -1
    assert all(0 <= parent < node for node, parent in enumerate(proposal.parents) if node > 0)
    assert 1 <= proposal.num_draft_tokens <= req.budget
    assert proposal.draft_probs is None
    siblings = Counter((proposal.parents[node], proposal.token_ids[node]) for node in range(1, len(proposal.token_ids)))
    assert max(siblings.values()) == 1, "duplicate siblings"


def make_request(prompt, output=(), *, budget: int, request_id: str = "r") -> DraftRequest:
    return DraftRequest(
        request_id=request_id, prompt_token_ids=list(prompt), output_token_ids=list(output), budget=budget
    )


def propose(drafter, req) -> Proposal | None:
    (proposal,) = drafter.propose([req])
    return proposal


def commit(drafter, req, token_ids) -> None:
    """What the engine does after verification: extend the output, then tell the drafter."""
    req.output_token_ids.extend(token_ids)
    drafter.accept(
        req,
        AcceptedPath(
            nodes=list(range(len(token_ids))),
            num_accepted=len(token_ids) - 1,
            committed_token_ids=list(token_ids),
            bonus=False,
        ),
    )


def mean_step_seconds(drafter, req, *, steps: int = 200, seed: int = 0) -> float:
    """Average wall time of propose + commit of one random token, on req's context."""
    import random
    import time

    rng = random.Random(seed)
    drafter.begin(req)
    started = time.perf_counter()
    for _ in range(steps):
        propose(drafter, req)
        commit(drafter, req, [rng.randrange(50)])
    return (time.perf_counter() - started) / steps
