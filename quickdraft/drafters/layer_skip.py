"""`[self]` drafting: the target's own first layers plus a light trained head.

To draft, the target's first ``exit_layer`` layers run on the draft tree (root first) and a
light head (``LayerSkipHead``: a residual block and the draft vocabulary's LM-head rows) turns
their output into next-token candidates; each new depth runs the early layers again on the
grown tree, so deeper drafts see real (early-layer) attention over their ancestors.

The early layers read the *target's own* KV cache: every committed token's early-layer keys
and values were written there by the target's forwards, so the drafter has no context of its
own to keep or catch up, and never recomputes it.  The draft tree's early-layer KV is written
past the committed length, where verification (which runs a pruned tree of its own through
all layers) overwrites it: the target never reads anything the drafter wrote.

The tree grows EAGLE-2 style (the best ``top_k`` nodes by cumulative draft probability are
expanded with their ``top_k`` best children) within the step's node budget.  Children are
top-k picks, so proposals are point masses (``draft_probs=None``).
"""

from __future__ import annotations

import math

import torch

from quickdraft.drafters.base import AcceptedPath, Drafter, DraftRequest, Proposal, TargetInfo
from quickdraft.drafters.keyed import KeyedDraw, NoiseTable, check_coupling, coupled_order
from quickdraft.drafters.tree import DynamicTree
from quickdraft.engine.runner import ModelRunner, SequenceWork
from quickdraft.heads import head_compute_dtype, resolve_head_dir
from quickdraft.models.layers import default_linear_fn
from quickdraft.models.medusa import LayerSkipHead


class LayerSkipDrafter(Drafter):
    def __init__(
        self,
        *,
        target: TargetInfo,
        head: str | None = None,
        head_dtype: str | None = None,
        num_speculative_tokens: int = 4,
        top_k: int = 2,
        max_draft_tokens: int = 12,
        min_draft_prob: float = 0.0,
        coupling: str = "top_k",
    ):
        self.coupling = check_coupling(coupling)  # sampled requests' first children (drafters/keyed.py)
        self.vocab_size = target.vocab_size
        if target.model is None or target.cache is None:
            raise ValueError("the [self] drafter needs the target model and its KV cache (TargetInfo)")
        for name, value in (("top_k", top_k), ("max_draft_tokens", max_draft_tokens)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(min_draft_prob, (int, float)) or not 0.0 <= min_draft_prob < 1.0:
            raise ValueError(f"min_draft_prob must be in [0, 1), got {min_draft_prob!r}")
        loaded = LayerSkipHead.load(
            resolve_head_dir(head, method="self", model=target.model),
            dtype=head_compute_dtype(head_dtype, default=target.dtype),
            device=target.device,
        )
        assert isinstance(loaded, LayerSkipHead)  # load builds an instance of the class it is called on
        self.head = loaded
        c, num_layers = self.head.config, target.model.config.num_layers
        if c.hidden_size != target.model.config.hidden_size:
            raise ValueError(
                f"[self] head hidden size {c.hidden_size} does not match the target's {target.model.config.hidden_size}"
            )
        if not 1 <= self.head.exit_layer < num_layers:
            raise ValueError(
                f"[self] head reads layer {c.feature_layer}: the drafter must stop before the "
                f"target's last layer ({num_layers - 1})"
            )
        if int(self.head.d2t.max()) >= target.vocab_size:
            raise ValueError("the [self] head's draft vocabulary maps to ids outside the target's vocabulary")
        self.head.attach_target(target.model)
        self.head.linear = default_linear_fn(target.device)
        self.depth = num_speculative_tokens
        self.top_k = top_k
        self.max_draft_tokens = max_draft_tokens
        self.min_log_prob = math.log(min_draft_prob) if min_draft_prob > 0 else -math.inf
        self.runner = ModelRunner(model=target.model, cache=target.cache, device=target.device)

    def begin(self, request: DraftRequest) -> None:
        pass  # the context is the target's own cache

    def finish(self, request_id: str) -> None:
        pass

    def accept(self, request: DraftRequest, accepted: AcceptedPath) -> None:
        pass

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[Proposal | None]:
        trees = [DynamicTree(root_token=r.token_ids[-1]) for r in requests]
        frontiers = [[0] for _ in requests]
        budgets = [min(self.max_draft_tokens, r.budget) for r in requests]
        for depth in range(1, max(min(self.depth, r.max_depth) for r in requests) + 1):
            growing = [
                i
                for i, r in enumerate(requests)
                if frontiers[i] and depth <= min(self.depth, r.max_depth) and len(trees[i].token_ids) <= budgets[i]
            ]
            if not growing:
                break
            hidden = self._early_layers([requests[i] for i in growing], [trees[i] for i in growing])
            noise = NoiseTable(vocab_size=self.vocab_size, device=hidden[0].device)
            for i, rows in zip(growing, hidden):
                keyed = KeyedDraw.of(requests[i]) if self.coupling == "keyed" else None
                draw = None if keyed is None else (noise.log_noise(keyed.key(depth)), keyed.temperature)
                frontiers[i] = self._grow(trees[i], frontiers[i], rows, depth=depth, budget=budgets[i], draw=draw)
        proposals: list[Proposal | None] = []
        for tree, budget in zip(trees, budgets):
            if len(tree.token_ids) == 1:
                proposals.append(None)
                continue
            token_ids, parents = tree.pruned(budget)
            proposals.append(Proposal(token_ids=token_ids, parents=parents))
        return proposals

    def _early_layers(self, requests: list[DraftRequest], trees: list[DynamicTree]) -> list[torch.Tensor]:
        """Each tree through the target's first layers over its request's cache; [T_i, D] each."""
        work = []
        for r, tree in zip(requests, trees):
            assert r.slot is not None  # the engine sets a drafting request's slot
            work.append(
                SequenceWork(
                    slot=r.slot,
                    cache_len=len(r.token_ids) - 1,
                    token_ids=list(tree.token_ids),
                    tree=tree.shape,
                )
            )
        out = self.runner.forward(work, end_layer=self.head.exit_layer)
        return list(out.forward.hidden_states.split([len(t.token_ids) for t in trees]))

    def _grow(
        self,
        tree: DynamicTree,
        frontier: list[int],
        hidden: torch.Tensor,
        *,
        depth: int,
        budget: int,
        draw: tuple[torch.Tensor, float] | None = None,
    ) -> list[int]:
        """Children for the best frontier nodes (within the budget); returns the new frontier.
        draw: a sampled request's (log noise [V] of this depth's position, temperature): each
        node's first child is the head's keyed draw."""
        expand = tree.best_frontier(frontier, 1 if depth == 1 else self.top_k)
        log_probs = torch.log_softmax(self.head(hidden[expand])[0].float(), dim=-1)  # [m, Vd]
        width = min(self.top_k + (draw is not None), log_probs.shape[-1])
        best = torch.topk(log_probs, width, dim=-1).indices.tolist()
        new_frontier = []
        for row, node in enumerate(expand):
            order = best[row]
            if draw is not None:
                order = coupled_order(log_probs[row], self.head.d2t, order, log_noise=draw[0], temperature=draw[1])
            columns = order[: self.top_k]
            values, ids = log_probs[row, columns].tolist(), self.head.d2t[columns].tolist()
            room = budget - (len(tree.token_ids) - 1)
            keep = [k for k in range(len(columns)) if tree.scores[node] + values[k] >= self.min_log_prob][:room]
            new_frontier += tree.add_children(node, [ids[k] for k in keep], [values[k] for k in keep])
        return new_frontier
