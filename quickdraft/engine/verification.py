"""Every request of a step verified in one call: a plain decode is a proposal with no draft.

The target's rows for a proposal are its logits after each node.  Which rule walks the tree
depends on the request, not on how it was drafted:

- greedy without penalties: the target's argmax after each node (``verify_greedy``), one
  argmax call over the rows of every greedy request of the step;
- sampled, point-mass drafts (or none): the target's own position-keyed draw at each node
  (``verify_by_target_choice``), so the committed tokens are those plain decoding draws; the
  roots' draws are made in one batched call, deeper nodes only along the walked path;
- sampled drafts (``draft_probs``): recursive rejection sampling with the request's
  generator (``verify_proposal``) over every node's target distribution.

A root-only proposal (no draft) goes through the same walk: its one committed token is the
bonus token after the root, exactly what plain decoding samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quickdraft.drafters.base import AcceptedPath, Proposal
from quickdraft.engine.request import Request
from quickdraft.kernels.argmax import argmax_rows
from quickdraft.verify.rejection import verify_by_target_choice, verify_greedy, verify_proposal
from quickdraft.verify.sampler import RowContext, draw_keyed, logits_to_probs, position_key, samples_by_argmax


def verify_step(
    *,
    requests: list[Request],
    proposals: list[Proposal],  # one per request, node 0 = its last known token
    logits: torch.Tensor,  # [M, V] request i's node rows are logits[row_offsets[i]:row_offsets[i + 1]]
    row_offsets: list[int],  # [len(requests) + 1]
    eos_token_ids: list[int],
) -> list[AcceptedPath]:
    if not len(requests) == len(proposals) == len(row_offsets) - 1:
        raise ValueError(f"{len(requests)} requests, {len(proposals)} proposals, {len(row_offsets)} row offsets")
    for i, proposal in enumerate(proposals):
        if row_offsets[i + 1] - row_offsets[i] != proposal.tree.num_nodes:
            raise ValueError(f"request {i}: {row_offsets[i + 1] - row_offsets[i]} logits rows for {proposal.tree}")
    greedy = [samples_by_argmax(r.params, num_output_tokens=len(r.output_token_ids)) for r in requests]
    argmaxes = _greedy_argmaxes(logits=logits, row_offsets=row_offsets, greedy=greedy)
    keyed = [i for i, p in enumerate(proposals) if not greedy[i] and p.draft_probs is None]
    root_draws = _root_draws(
        requests=[requests[i] for i in keyed],
        logits=logits[torch.tensor([row_offsets[i] for i in keyed], device=logits.device)] if keyed else None,
        eos_token_ids=eos_token_ids,
    )
    root_draw = dict(zip(keyed, root_draws))
    results = []
    for i, (request, proposal) in enumerate(zip(requests, proposals)):
        rows = logits[row_offsets[i] : row_offsets[i + 1]]
        cap = request.remaining_output_tokens
        if greedy[i]:
            results.append(verify_greedy(proposal=proposal, target_argmax=argmaxes[i], max_new_tokens=cap))
        elif i in root_draw:
            results.append(
                verify_by_target_choice(
                    proposal=proposal,
                    target_choice=_KeyedChoice(request, proposal, rows, eos_token_ids, root_draw[i]),
                    max_new_tokens=cap,
                )
            )
        else:
            contexts = [_row_context(request, history) for history in node_histories(request, proposal)]
            target_probs = logits_to_probs(rows, contexts, eos_token_ids=eos_token_ids)  # [num_nodes, V]
            results.append(
                verify_proposal(
                    proposal=proposal, target_probs=target_probs, generator=request.generator, max_new_tokens=cap
                )
            )
    return results


def node_histories(request: Request, proposal: Proposal) -> list[list[int]]:
    """Each node's output history: committed outputs + the drafted tokens on its path (root excluded)."""
    tree = proposal.tree
    return [request.output_token_ids + tree.path_tokens(proposal.token_ids, node) for node in range(tree.num_nodes)]


def _greedy_argmaxes(*, logits: torch.Tensor, row_offsets: list[int], greedy: list[bool]) -> list[list[int]]:
    """The argmax rows of each greedy request (empty lists for the others), in one kernel call."""
    spans = [(row_offsets[i], row_offsets[i + 1]) for i, g in enumerate(greedy) if g]
    if not spans:
        return [[] for _ in greedy]
    if all(greedy):  # every row of the step: a view, no copy
        flat = argmax_rows(logits[row_offsets[0] : row_offsets[-1]]).tolist()
    else:  # only the greedy requests' rows: sampled ones may hold most of a wide step
        index = torch.cat([torch.arange(a, b) for a, b in spans]).to(logits.device)
        flat = argmax_rows(logits[index]).tolist()
    out: list[list[int]] = []
    taken = 0
    for i, g in enumerate(greedy):
        count = row_offsets[i + 1] - row_offsets[i] if g else 0
        out.append(flat[taken : taken + count])
        taken += count
    return out


def _root_draws(*, requests: list[Request], logits: torch.Tensor | None, eos_token_ids: list[int]) -> list[int]:
    # logits [len(requests), V]: each request's row after its root
    if not requests:
        return []
    assert logits is not None  # given with the requests
    contexts = [_row_context(r, r.output_token_ids) for r in requests]
    keys = [position_key(r.seed, len(r.output_token_ids)) for r in requests]
    return draw_keyed(logits, contexts, keys, eos_token_ids=eos_token_ids).tolist()


@dataclass
class _KeyedChoice:
    """node -> the target's position-keyed draw after it; the root's is drawn beforehand."""

    request: Request
    proposal: Proposal
    rows: torch.Tensor  # [num_nodes, V] the target's logits after each node
    eos_token_ids: list[int]
    root: int  # the draw after the root, made in one call with the other requests' roots

    def __call__(self, node: int) -> int:
        if node == 0:
            return self.root
        history = self.request.output_token_ids + self.proposal.tree.path_tokens(self.proposal.token_ids, node)
        key = position_key(self.request.seed, len(history))
        row = self.rows[node : node + 1]
        return int(draw_keyed(row, [_row_context(self.request, history)], [key], eos_token_ids=self.eos_token_ids)[0])


def _row_context(request: Request, history: list[int]) -> RowContext:
    return RowContext(params=request.params, prompt_token_ids=request.prompt_token_ids, output_token_ids=history)
