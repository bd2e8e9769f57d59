"""Lossless verification of a proposal tree: recursive rejection sampling.

Words as in DESIGN.md: the **target** distribution must come out exactly; a **drafter**
proposes a tree of draft tokens (node 0 = the root, the last committed token); each step
commits the **accepted** draft tokens plus one **recovered** token (drawn from the
residual after the children of a node were all rejected) or one **bonus** token (drawn
from the target at the leaf where a fully accepted path ends).

Inputs per proposal: ``target_probs[i]`` [V] is the target distribution of the token
*after* node i (already processed by ``logits_to_probs`` with that node's history; greedy
rows are exact one-hots).  ``draft_probs`` follows one of two conventions
(``quickdraft/drafters/base.py``):

- ``draft_probs is None`` (deterministic proposals: n-gram, suffix, top-k picks): every
  child is a point mass.  Child token x is accepted with probability ``p[x]``; on a
  rejection ``p[x] = 0`` and p is renormalised.  This rule is exact for *any* tokens
  chosen without looking at the verifier's randomness: garbage, duplicates, tokens with
  zero target probability (never accepted) and out-of-vocabulary ids (never accepted).
- ``draft_probs`` given (sampled proposals): child i's token was drawn from
  ``draft_probs[i]`` and siblings were drawn independently (i.i.d. when they share the
  row).  Accepted with probability ``min(1, p[x] / q[x])``, ``q = draft_probs[child]``;
  on a rejection ``p = normalize(max(p - q, 0))`` (if that residual is all zero, which
  only rounding can cause, p is kept).  A drafted token with ``q[x] == 0`` breaks the
  convention (no rule can be exact then) and raises ``ValueError``.

The algorithm (SpecInfer's multi-round speculative sampling, recursively down the tree):

1. Start at the root with ``p = target_probs[0]``.
2. Try the current node's children in index order with the rule of the convention.  The
   first accepted child becomes the current node, with ``p = target_probs[child]``.
3. When every child was rejected, draw the **recovered** token from the residual p.
   When the current node has no children (a leaf), draw the **bonus** token from
   ``target_probs[leaf]``.  Either way exactly one token follows the accepted ones.

``max_new_tokens`` caps the committed tokens: once ``accepted + 1 == max_new_tokens`` no
more children are tried and the last token is drawn from the current node's *unmodified*
target row.  That is exact: the committed tokens are then a prefix of what an unlimited
run would commit, and the token after a committed prefix is distributed as the target
at that prefix.  (``bonus`` is True only when the path really ended at a leaf.)

Greedy is the limit case and comes out exactly: on a one-hot row a child is accepted iff
its token is the argmax, and the recovered / bonus token is the argmax.  Nodes whose
target row is a point mass take a fast path (no float64 copies, no uniforms), and in
general a uniform is drawn only when the acceptance probability is strictly between 0
and 1, so greedy rows never consume the request's generator.

The engine verifies point-mass proposals of sampled requests another way, which is exact
too and reproducible: ``verify_by_target_choice`` walks the tree along the target's own
position-keyed draw at each node (``sampler.draw_keyed``), so a seeded request commits the
tokens plain decoding would have drawn.  For a point-mass child that accepts it with
probability ``p[x]``, as the rule above does.  The rule above remains for sampled proposals.

Acceptance arithmetic and residuals are float64 (``u < p[x] / q[x]`` with u a float64
uniform); tokens are drawn with ``sample_from_probs``.  Only rows on the visited path are
read; no Python loop runs over the vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from quickdraft.drafters.base import AcceptedPath, Proposal
from quickdraft.verify.sampler import sample_from_probs, uniform

# Nodes whose target row is a point mass are resolved without float64 copies or uniforms.
# Tests switch it off to check that the general path gives exactly the same result.
_POINT_MASS_FAST_PATH = True


def verify_proposal(
    *,
    proposal: Proposal,
    target_probs: torch.Tensor,  # [num_nodes, V] row i = target distribution after node i
    generator: torch.Generator | None,  # the request's generator (None = global RNG)
    max_new_tokens: int | None = None,  # cap on committed tokens (accepted + 1)
) -> AcceptedPath:
    """Walk the proposal tree with recursive rejection sampling; see the module docstring."""
    _check_inputs(proposal=proposal, target_probs=target_probs, max_new_tokens=max_new_tokens)
    children = proposal.tree.children
    path = [0]  # accepted path, root first
    committed: list[int] = []
    while True:
        node = path[-1]
        kids = children[node]
        at_cap = max_new_tokens is not None and len(path) == max_new_tokens
        if not kids or at_cap:
            # Bonus (leaf), or the cap: the next token from the node's unmodified target row.
            token = _draw_token(target_probs[node : node + 1], generator)
            return _result(path=path, committed=committed + [token], bonus=not kids)
        child, recovered = _resolve_children(kids=kids, proposal=proposal, row=target_probs[node], generator=generator)
        if child is None:
            assert recovered is not None  # no accepted child: a recovered token
            return _result(path=path, committed=committed + [recovered], bonus=False)
        path.append(child)
        committed.append(proposal.token_ids[child])


def verify_greedy(
    *,
    proposal: Proposal,
    target_argmax: Sequence[int],  # [num_nodes] the target's greedy token after each node
    max_new_tokens: int | None = None,
) -> AcceptedPath:
    """Greedy verification from argmaxes alone: the limit case of ``verify_proposal``.

    With one-hot target rows a child is accepted iff its token is the argmax, and the
    recovered or bonus token is the argmax; this walks the same tree with plain ints, so a
    greedy step never builds [num_nodes, V] probability rows.
    """
    return verify_by_target_choice(
        proposal=proposal, target_choice=target_argmax.__getitem__, max_new_tokens=max_new_tokens
    )


def verify_by_target_choice(
    *,
    proposal: Proposal,
    target_choice: Callable[[int], int],  # node -> the token the target itself picks after it
    max_new_tokens: int | None = None,
) -> AcceptedPath:
    """Walk the tree along the target's own choices: from each node, the child whose token is
    the target's choice there is accepted; where none is, the choice is the recovered token,
    and past a leaf the bonus one.  Exact for point-mass drafts whenever the choice is a draw
    from the target's distribution (greedy: the argmax; sampled: the position-keyed draw, so
    the committed tokens are those plain decoding draws).  `target_choice` is called only for
    the nodes on the walked path, in order.
    """
    children = proposal.tree.children
    path = [0]
    committed: list[int] = []
    while True:
        node = path[-1]
        kids = children[node]
        target = int(target_choice(node))
        if not kids or (max_new_tokens is not None and len(path) == max_new_tokens):
            return _result(path=path, committed=committed + [target], bonus=not kids)
        child = next((kid for kid in kids if proposal.token_ids[kid] == target), None)
        if child is None:
            return _result(path=path, committed=committed + [target], bonus=False)
        path.append(child)
        committed.append(target)


# ---- one node: try its children ------------------------------------------------------


def _resolve_children(
    *,
    kids: list[int],  # the current node's children, in index order
    proposal: Proposal,
    row: torch.Tensor,  # [V] the current node's target row
    generator: torch.Generator | None,
) -> tuple[int | None, int | None]:  # (accepted child, None) or (None, recovered token)
    if _POINT_MASS_FAST_PATH:
        point = _point_mass(row)
        if point is not None:
            return _resolve_point_mass(kids=kids, proposal=proposal, token=point)
    if proposal.draft_probs is None:
        return _resolve_deterministic(kids=kids, token_ids=proposal.token_ids, row=row, generator=generator)
    return _resolve_sampled(
        kids=kids,
        token_ids=proposal.token_ids,
        row=row,
        draft_probs=proposal.draft_probs,
        generator=generator,
    )


def _resolve_point_mass(*, kids: list[int], proposal: Proposal, token: int) -> tuple[int | None, int | None]:
    """Target row = point mass at ``token``: what both conventions give, without randomness.

    Deterministic: acceptance probability is 1 for ``token``, 0 otherwise, and zeroing a
    zero entry changes nothing.  Sampled: ``min(1, 1 / q[token]) = 1`` for ``token`` and
    0 otherwise; ``max(onehot - q, 0)`` stays a point mass at ``token`` (it can only
    vanish if ``q`` is that same point mass, and then ``token`` would have been drafted).
    """
    for child in kids:
        if proposal.token_ids[child] == token:
            if proposal.draft_probs is not None:
                _check_drawable(draft_row=proposal.draft_probs[child], token=token, child=child)
            return child, None
    return None, token


def _resolve_deterministic(
    *,
    kids: list[int],
    token_ids: list[int],
    row: torch.Tensor,  # [V]
    generator: torch.Generator | None,
) -> tuple[int | None, int | None]:
    """Point-mass children: accept x w.p. p[x]; on rejection zero p[x] (renormalised)."""
    vocab = row.shape[0]
    residual = row.to(torch.float64, copy=True)  # [V] unnormalised; its mass is tracked
    mass = _positive_mass(residual)
    for child in kids:
        token = token_ids[child]
        prob = float(residual[token]) if 0 <= token < vocab else 0.0
        if _accept(ratio=prob / mass, generator=generator, device=row.device):
            return child, None
        if prob > 0.0:
            # prob / mass < 1, so other tokens keep positive mass.
            residual[token] = 0.0
            mass = float(residual.sum())
    return None, _draw_token(residual.unsqueeze(0), generator)


def _resolve_sampled(
    *,
    kids: list[int],
    token_ids: list[int],
    row: torch.Tensor,  # [V]
    draft_probs: torch.Tensor,  # [num_nodes, V]
    generator: torch.Generator | None,
) -> tuple[int | None, int | None]:
    """Sampled children: accept x w.p. min(1, p[x]/q[x]); on rejection p = norm(max(p-q, 0))."""
    residual = row.to(torch.float64, copy=True)  # [V]
    residual /= _positive_mass(residual)
    for child in kids:
        token = token_ids[child]
        draft_row = draft_probs[child]  # [V] the distribution the child was drawn from
        target_prob = float(residual[token])
        if target_prob > 0.0:  # otherwise rejected for sure, whatever q says
            draft_mass = _check_drawable(draft_row=draft_row, token=token, child=child)
            draft_prob = float(draft_row[token]) / draft_mass
            if _accept(ratio=target_prob / draft_prob, generator=generator, device=row.device):
                return child, None
        else:
            draft_mass = float(draft_row.sum(dtype=torch.float64))
        residual = _sampled_residual(residual=residual, draft_row=draft_row, draft_mass=draft_mass)
    return None, _draw_token(residual.unsqueeze(0), generator)


def _sampled_residual(
    *,
    residual: torch.Tensor,  # [V] float64, normalised
    draft_row: torch.Tensor,  # [V] any float dtype
    draft_mass: float,
) -> torch.Tensor:  # [V] float64, normalised
    """normalize(max(p - q, 0)); p itself when that is all zero (only rounding does that)."""
    if draft_mass <= 0.0:
        return residual  # an all-zero draft row: p - q = p
    diff = residual - draft_row.to(torch.float64) / draft_mass  # [V]
    diff.clamp_(min=0.0)
    mass = float(diff.sum())
    if mass <= 0.0:
        return residual
    return diff.div_(mass)


# ---- small pieces ----------------------------------------------------------------------


def _accept(*, ratio: float, generator: torch.Generator | None, device: torch.device) -> bool:
    """True with probability min(1, ratio); draws a uniform only when 0 < ratio < 1."""
    if ratio >= 1.0:
        return True
    if ratio <= 0.0:
        return False
    return _draw_uniform(generator, device) < ratio


def _draw_uniform(generator: torch.Generator | None, device: torch.device) -> float:
    """One float64 uniform in [0, 1) from the request's generator (tests mock this)."""
    return float(uniform([generator], 1, device=device)[0][0])


def _draw_token(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from ``weights`` [1, V] (unnormalised; no draw for a point mass)."""
    return int(sample_from_probs(weights, [generator])[0])


def _point_mass(row: torch.Tensor) -> int | None:  # row [V] -> its only non-zero token
    """The token of a one-hot (point-mass) row, else None.  Exact: no sum is compared."""
    token = int(row.argmax())
    # [top, max of the entries left of it, max right of it]: one host sync for all three.
    parts = [row[token : token + 1]]
    parts += [part.amax().reshape(1) for part in (row[:token], row[token + 1 :]) if part.numel()]
    top, *rest = torch.cat(parts).tolist()
    if not top > 0.0:
        raise ValueError("a target row has no positive probability")
    return token if all(value == 0.0 for value in rest) else None


def _positive_mass(weights: torch.Tensor) -> float:  # weights [V] float64
    mass = float(weights.sum())
    if not mass > 0.0:
        raise ValueError("a target row has no positive probability")
    return mass


def _check_drawable(*, draft_row: torch.Tensor, token: int, child: int) -> float:
    """The draft row's mass; raises when the drafted token could not have been drawn."""
    if not float(draft_row[token]) > 0.0:
        raise ValueError(
            f"node {child} proposes token {token} with draft probability 0: a sampled "
            "proposal's tokens must be drawn from draft_probs (use draft_probs=None for "
            "deterministic proposals)"
        )
    return float(draft_row.sum(dtype=torch.float64))


def _result(*, path: list[int], committed: list[int], bonus: bool) -> AcceptedPath:
    return AcceptedPath(nodes=list(path), num_accepted=len(path) - 1, committed_token_ids=committed, bonus=bonus)


def _check_inputs(*, proposal: Proposal, target_probs: torch.Tensor, max_new_tokens: int | None) -> None:
    num_nodes = len(proposal.token_ids)
    if target_probs.dim() != 2 or target_probs.shape[0] != num_nodes:
        raise ValueError(
            f"target_probs must be [{num_nodes}, V] for {num_nodes} nodes, got {tuple(target_probs.shape)}"
        )
    if max_new_tokens is not None and max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    draft_probs = proposal.draft_probs
    if draft_probs is None:
        return
    vocab = target_probs.shape[1]
    if draft_probs.dim() != 2 or draft_probs.shape[1] != vocab:
        raise ValueError(f"draft_probs must be [{num_nodes}, {vocab}], got {tuple(draft_probs.shape)}")
    bad = [t for t in proposal.token_ids[1:] if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"draft token ids {bad} out of range for vocabulary size {vocab}")
