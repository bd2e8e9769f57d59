"""Every request of a step verified in one call: a plain decode is a proposal with no draft.

The target's rows for a proposal are its logits after each node.  Which rule walks the tree
depends on the request, not on how it was drafted:

- greedy without penalties: the target's argmax after each node (the walk of
  ``verify_greedy``), one argmax call over the computed rows of every greedy request;
- sampled, point-mass drafts (or none): the target's own position-keyed draw at each node
  (``verify_by_target_choice``), so the committed tokens are those plain decoding draws; the
  roots' draws are made in one batched call, deeper nodes only along the walked path;
- sampled drafts (``draft_probs``): recursive rejection sampling with the request's
  generator (``verify_proposal``) over every node's target distribution.

A root-only proposal (no draft) goes through the same walk: its one committed token is the
bonus token after the root, exactly what plain decoding samples.

The first two walks read only the rows on their path, so the engine may leave rows out of the
forward's LM head (``StepLogits``): a walk that reaches a missing row stops, the round's missing
rows are computed in one call, and the walks run again (they consume no randomness).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import torch

from quickdraft.drafters.base import AcceptedPath, Proposal
from quickdraft.engine.request import Request
from quickdraft.kernels.argmax import argmax_rows
from quickdraft.verify.rejection import verify_by_target_choice, verify_proposal
from quickdraft.verify.sampler import RowContext, draw_keyed, logits_to_probs, position_key, samples_by_argmax


class RowMissing(Exception):
    """A walk reached a node whose logits row is not computed yet."""

    def __init__(self, node: int):
        super().__init__(node)
        self.node = node


class StepLogits:
    """The step's logits, one row per verified node, of which some may be computed only when a
    walk reaches them (``fill``: one LM-head call for every row a round asks for).  Rows stay in
    the tensors they were computed into (the forward's buffer, each fill's output): no copies.

    Exact by the LM head's batch invariance: a row's values do not depend on the rows that share
    its call, so a row computed late is the row the forward would have given, and the walk
    commits the same tokens.  Greedy and keyed walks read only the rows on their path, about
    accepted + 1 of a tree's nodes: where the LM head is bound by compute (a CPU without
    AVX-512: 2.4 ms a row against 9 ms to read the head once) the rows past the rejection are
    never computed."""

    def __init__(
        self,
        num_rows: int,
        *,
        fill: Callable[[list[int]], torch.Tensor] | None = None,  # rows (sorted) -> their logits [len(rows), V]
        first_rows: int = 1,  # rows computed together along a first-child chain (see chain_rows)
    ):
        self.num_rows = num_rows
        self.fill = fill
        self.first_rows = first_rows
        self._chunks: list[torch.Tensor] = []  # each [rows, V]
        self._where: dict[int, tuple[int, int]] = {}  # row -> (chunk, its index there)

    @classmethod
    def complete(cls, logits: torch.Tensor) -> StepLogits:  # logits [M, V], every row computed
        table = cls(logits.shape[0])
        table.add(list(range(logits.shape[0])), logits)
        return table

    def add(self, rows: list[int], logits: torch.Tensor) -> None:  # logits [len(rows), V]
        if logits.shape[0] != len(rows):
            raise ValueError(f"{logits.shape[0]} logits rows for {len(rows)} rows")
        chunk = len(self._chunks)
        self._chunks.append(logits)
        self._where.update((row, (chunk, index)) for index, row in enumerate(rows))

    def ready(self, row: int) -> bool:
        return row in self._where

    def ensure(self, rows: list[int]) -> list[int]:
        """Computes those of `rows` not ready yet, in one call; returns them (sorted)."""
        missing = sorted({row for row in rows if row not in self._where})
        if missing:
            if self.fill is None:
                raise ValueError(f"logits rows {missing} were never computed and nothing can fill them")
            self.add(missing, self.fill(missing))
        return missing

    def gather(self, rows: list[int]) -> torch.Tensor:  # -> [len(rows), V]
        """The rows' logits: a view where they lie in order in one tensor, else a copy."""
        places = [self._where[row] for row in rows]
        chunk, first = places[0]
        if places == [(chunk, first + j) for j in range(len(places))]:
            return self._chunks[chunk][first : first + len(places)]
        return torch.cat([self._chunks[c][i : i + 1] for c, i in places])


def verify_step(
    *,
    requests: list[Request],
    proposals: list[Proposal],  # one per request, node 0 = its last known token
    logits: torch.Tensor | StepLogits,  # [M, V] request i's node rows are logits[row_offsets[i]:row_offsets[i + 1]]
    row_offsets: list[int],  # [len(requests) + 1]
    eos_token_ids: list[int],
) -> list[AcceptedPath]:
    table = logits if isinstance(logits, StepLogits) else StepLogits.complete(logits)
    if not len(requests) == len(proposals) == len(row_offsets) - 1:
        raise ValueError(f"{len(requests)} requests, {len(proposals)} proposals, {len(row_offsets)} row offsets")
    for i, proposal in enumerate(proposals):
        if row_offsets[i + 1] - row_offsets[i] != proposal.tree.num_nodes:
            raise ValueError(f"request {i}: {row_offsets[i + 1] - row_offsets[i]} logits rows for {proposal.tree}")
    if table.num_rows < row_offsets[-1]:
        raise ValueError(f"{table.num_rows} logits rows for {row_offsets[-1]} nodes")
    greedy = [samples_by_argmax(r.params, num_output_tokens=len(r.output_token_ids)) for r in requests]
    # Walks that read only their path's rows, and may run again after a round fills the row they
    # missed: greedy ones and the target's keyed choice (no generator consumed).  Rejection
    # sampling draws uniforms as it walks, so it gets all its rows first and walks once.
    walked = [walks_path(r, p) for r, p in zip(requests, proposals)]
    table.ensure(
        [row_offsets[i] for i in range(len(requests))]
        + [row for i, w in enumerate(walked) if not w for row in range(row_offsets[i], row_offsets[i + 1])]
    )
    greedy_rows = [row for i, g in enumerate(greedy) if g for row in range(row_offsets[i], row_offsets[i + 1])]
    greedy_row_set = set(greedy_rows)
    argmax = _argmaxes(table, [row for row in greedy_rows if table.ready(row)])
    keyed = [i for i, p in enumerate(proposals) if not greedy[i] and p.draft_probs is None]
    root_draws = _root_draws(
        requests=[requests[i] for i in keyed],
        logits=table.gather([row_offsets[i] for i in keyed]) if keyed else None,
        eos_token_ids=eos_token_ids,
    )
    root_draw = dict(zip(keyed, root_draws))
    results: list[AcceptedPath | None] = [None] * len(requests)
    for i, (request, proposal) in enumerate(zip(requests, proposals)):
        if not walked[i]:
            rows = table.gather(list(range(row_offsets[i], row_offsets[i + 1])))
            contexts = [row_context(request, history) for history in node_histories(request, proposal)]
            target_probs = logits_to_probs(rows, contexts, eos_token_ids=eos_token_ids)  # [num_nodes, V]
            results[i] = verify_proposal(
                proposal=proposal,
                target_probs=target_probs,
                generator=request.generator,
                max_new_tokens=request.remaining_output_tokens,
            )
    pending = [i for i, w in enumerate(walked) if w]
    choices: dict[int, Callable[[int], int]] = {
        i: _GreedyChoice(argmax, row_offsets[i])
        if greedy[i]
        else _KeyedChoice(requests[i], proposals[i], table, row_offsets[i], eos_token_ids, root_draw[i])
        for i in pending
    }
    while pending:
        missed: dict[int, int] = {}
        for i in pending:
            try:
                results[i] = verify_by_target_choice(
                    proposal=proposals[i],
                    target_choice=choices[i],
                    max_new_tokens=requests[i].remaining_output_tokens,
                )
            except RowMissing as missing:
                missed[i] = missing.node
        if not missed:
            break
        wanted: list[int] = []
        for i, node in missed.items():
            wanted += [row_offsets[i] + n for n in chain_rows(proposals[i], node, table.first_rows)]
        filled = table.ensure(wanted)
        argmax.update(_argmaxes(table, [row for row in filled if row in greedy_row_set]))
        pending = list(missed)
    assert all(result is not None for result in results)  # every walk ended
    return cast("list[AcceptedPath]", results)


def walks_path(request: Request, proposal: Proposal) -> bool:
    """Whether the request's verification reads only the rows on its walked path (greedy, or the
    target's keyed choice over point-mass drafts), so its other rows need not be computed."""
    return proposal.draft_probs is None or samples_by_argmax(
        request.params, num_output_tokens=len(request.output_token_ids)
    )


def first_child_chain(proposal: Proposal, node: int) -> list[int]:
    """`node`, its first child, that one's first child, ... to a leaf."""
    chain = [node]
    children = proposal.tree.children
    while children[chain[-1]]:
        chain.append(children[chain[-1]][0])
    return chain


def chain_rows(proposal: Proposal, node: int, size: int) -> list[int]:
    """The nodes whose rows are computed together when a walk reaches `node` (or starts there):
    `size` of its first-child chain (where walks go on: drafters put their likeliest child
    first), or the whole chain when less than half as much again would be left, which a later
    call would pay a whole read of the LM head for."""
    chain = first_child_chain(proposal, node)
    return chain if len(chain) <= size + size // 2 else chain[:size]


@dataclass
class _GreedyChoice:
    argmax: dict[int, int]  # row -> the target's argmax there, for the rows computed so far
    offset: int  # the request's node 0 row

    def __call__(self, node: int) -> int:
        token = self.argmax.get(self.offset + node)
        if token is None:
            raise RowMissing(node)
        return token


def node_histories(request: Request, proposal: Proposal) -> list[list[int]]:
    """Each node's output history: committed outputs + the drafted tokens on its path (root excluded)."""
    tree = proposal.tree
    return [request.output_token_ids + tree.path_tokens(proposal.token_ids, node) for node in range(tree.num_nodes)]


def _argmaxes(table: StepLogits, rows: list[int]) -> dict[int, int]:
    """row -> its argmax, for `rows` (computed), in one kernel call."""
    if not rows:
        return {}
    return dict(zip(rows, argmax_rows(table.gather(rows)).tolist()))


def _root_draws(*, requests: list[Request], logits: torch.Tensor | None, eos_token_ids: list[int]) -> list[int]:
    # logits [len(requests), V]: each request's row after its root
    if not requests:
        return []
    assert logits is not None  # given with the requests
    contexts = [row_context(r, r.output_token_ids) for r in requests]
    keys = [position_key(r.seed, len(r.output_token_ids)) for r in requests]
    return draw_keyed(logits, contexts, keys, eos_token_ids=eos_token_ids).tolist()


@dataclass
class _KeyedChoice:
    """node -> the target's position-keyed draw after it; the root's is drawn beforehand, the
    others once each (a walk that ran out of rows walks its path again after the fill)."""

    request: Request
    proposal: Proposal
    table: StepLogits
    offset: int  # the request's node 0 row
    eos_token_ids: list[int]
    root: int  # the draw after the root, made in one call with the other requests' roots
    drawn: dict[int, int] = field(default_factory=dict)  # node -> its draw

    def __call__(self, node: int) -> int:
        if node == 0:
            return self.root
        if node in self.drawn:
            return self.drawn[node]
        row = self.offset + node
        if not self.table.ready(row):
            raise RowMissing(node)
        history = self.request.output_token_ids + self.proposal.tree.path_tokens(self.proposal.token_ids, node)
        key = position_key(self.request.seed, len(history))
        context = row_context(self.request, history)
        logits = self.table.gather([row])  # [1, V]
        self.drawn[node] = int(draw_keyed(logits, [context], [key], eos_token_ids=self.eos_token_ids)[0])
        return self.drawn[node]


def row_context(request: Request, history: list[int]) -> RowContext:
    """The sampler's view of a row of `request` whose output so far is `history`."""
    return RowContext(params=request.params, prompt_token_ids=request.prompt_token_ids, output_token_ids=history)
