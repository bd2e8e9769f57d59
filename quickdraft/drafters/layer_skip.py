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

A head with a copy path (``copy_dim`` > 0) also copies from the request's context: the drafter
asks the engine for the target's features of the head's layer (the early-layer output of every
token entering the cache), keeps one copy key per committed token (its value: the token that
followed it), and each draft node's early-layer output queries them (models/heads.py CopyPath).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from quickdraft.drafters.base import AcceptedPath, Drafter, DraftRequest, Proposal, TargetInfo
from quickdraft.drafters.eagle import head_max_len
from quickdraft.drafters.keyed import KeyedDraw, check_coupling, coupled_order
from quickdraft.drafters.tree import DynamicTree
from quickdraft.engine.runner import ModelRunner, SequenceWork
from quickdraft.heads import drafting_options, head_precision, resolve_head_dir
from quickdraft.models.heads import CopySources
from quickdraft.models.layers import default_linear_fn
from quickdraft.models.medusa import LayerSkipHead


@dataclass
class _CopyKeys:
    """One request's copy keys: entry i (the committed token at position i) copies token i+1."""

    keys: torch.Tensor  # [max_len, C] by position
    count: int = 0  # positions observed (= tokens in the target's cache)


class LayerSkipDrafter(Drafter):
    scores_paths = True  # paths grow by the head's probability and stop below min_path_prob

    def __init__(
        self,
        *,
        target: TargetInfo,
        head: str | None = None,
        head_dtype: str | None = None,
        num_speculative_tokens: int = 4,
        top_k: int | None = None,
        max_draft_tokens: int | None = None,
        min_draft_prob: float | None = None,
        coupling: str = "top_k",
    ):
        """top_k, max_draft_tokens, min_draft_prob: None takes the head's recommended value (a
        shipped head's manifest says what was measured best for it), else 2, 12 and 0."""
        self.coupling = check_coupling(coupling)  # sampled requests' first children (drafters/keyed.py)
        self.vocab_size = target.vocab_size
        if target.model is None or target.cache is None:
            raise ValueError("the [self] drafter needs the target model and its KV cache (TargetInfo)")
        directory = resolve_head_dir(head, method="self", model=target.model)
        options = drafting_options(
            directory, top_k=(top_k, 2), max_draft_tokens=(max_draft_tokens, 12), min_draft_prob=(min_draft_prob, 0.0)
        )
        top_k, max_draft_tokens, min_draft_prob = (
            options["top_k"],
            options["max_draft_tokens"],
            options["min_draft_prob"],
        )
        for name, value in (("top_k", top_k), ("max_draft_tokens", max_draft_tokens)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(min_draft_prob, (int, float)) or not 0.0 <= min_draft_prob < 1.0:
            raise ValueError(f"min_draft_prob must be in [0, 1), got {min_draft_prob!r}")
        dtype, quantization = head_precision(head_dtype, target=target)
        loaded = LayerSkipHead.load(directory, dtype=dtype, device=target.device)
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
        if quantization:
            self.head.quantize_for_drafting(quantization)
        # A copy path reads the early-layer output of every committed token (its copy key).
        self.feature_layers: tuple[int, ...] = (c.feature_layer,) if self.head.copy_dim else ()
        self.max_len = head_max_len(target)
        self._copy_keys: dict[str, _CopyKeys] = {}
        self.depth = num_speculative_tokens
        self.top_k = top_k
        self.max_draft_tokens = max_draft_tokens
        self.min_log_prob = math.log(min_draft_prob) if min_draft_prob > 0 else -math.inf
        self.runner = ModelRunner(model=target.model, cache=target.cache, device=target.device)

    def begin(self, request: DraftRequest) -> None:
        # the context is the target's own cache; a copy path keeps its keys
        if self.feature_layers:
            keys = torch.zeros(self.max_len, self.head.copy_dim, dtype=self.head.dtype, device=self.head.d2t.device)
            self._copy_keys[request.request_id] = _CopyKeys(keys=keys)

    def finish(self, request_id: str) -> None:
        self._copy_keys.pop(request_id, None)

    @torch.inference_mode()
    def observe(self, request: DraftRequest, features: torch.Tensor) -> None:
        # features [n, D]: the head's layer output of the next n tokens entering the target's cache
        state = self._copy_keys[request.request_id]
        n = features.shape[0]
        state.keys[state.count : state.count + n] = self.head.copy_keys(features.to(self.head.dtype))
        state.count += n

    def _copy_sources(self, request: DraftRequest) -> CopySources | None:
        """The committed entries a draft of `request` copies from (None: no copy path, nothing
        keyed yet, or the keys lag the tokens)."""
        state = self._copy_keys.get(request.request_id)
        if state is None or state.count != len(request.token_ids) - 1 or state.count < 1:
            return None
        values = torch.tensor(request.token_ids[1 : state.count + 1], device=state.keys.device)
        return self.head.copy_sources(state.keys[: state.count], values)

    def accept(self, request: DraftRequest, accepted: AcceptedPath) -> None:
        pass

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[Proposal | None]:
        trees = [DynamicTree(root_token=r.token_ids[-1]) for r in requests]
        sources = [self._copy_sources(r) for r in requests]
        frontiers = [[0] for _ in requests]
        budgets = [min(self.max_draft_tokens, r.budget) for r in requests]
        for depth in range(1, max(min(self.depth, r.depth_limit) for r in requests) + 1):
            growing = [
                i
                for i, r in enumerate(requests)
                if frontiers[i] and depth <= min(self.depth, r.depth_limit) and len(trees[i].token_ids) <= budgets[i]
            ]
            if not growing:
                break
            hidden = self._early_layers([requests[i] for i in growing], [trees[i] for i in growing])
            expands = [trees[i].best_frontier(frontiers[i], 1 if depth == 1 else self.top_k) for i in growing]
            features = [rows[expand] for rows, expand in zip(hidden, expands)]  # [m_i, D] each
            # One pass over the draft LM head (megabytes) for every request's rows, not one each.
            logits = (
                self.head.draft_logits(torch.cat(features)).split([len(e) for e in expands])
                if len(growing) > 1
                else None
            )
            for j, (i, expand) in enumerate(zip(growing, expands)):
                keyed = KeyedDraw.of(requests[i]) if self.coupling == "keyed" else None
                draw = None if keyed is None else (keyed.key(depth), keyed.temperature)
                frontiers[i] = self._grow(
                    trees[i],
                    expand,
                    features[j],
                    logits=None if logits is None else logits[j],
                    budget=budgets[i],
                    min_log_prob=requests[i].path_log_floor(depth, self.min_log_prob),
                    draw=draw,
                    sources=sources[i],
                )
        proposals: list[Proposal | None] = []
        for tree, budget in zip(trees, budgets):
            if len(tree.token_ids) == 1:
                proposals.append(None)
                continue
            proposals.append(tree.proposal(budget))
        return proposals

    def _early_layers(self, requests: list[DraftRequest], trees: list[DynamicTree]) -> list[torch.Tensor]:
        """Each tree through the target's first layers over its request's cache; [T_i, D] each.

        A chain (every node the parent of the next, as top_k 1 grows) runs only its newest node:
        the earlier nodes' early-layer KV, written by the previous depths at the same positions,
        is all it attends to.  A branching tree runs whole, since cached positions are visible to
        every new token and siblings must not see each other.  Rows of nodes not run are left
        zero (only the newest depth's nodes are read)."""
        work, firsts = [], []
        for r, tree in zip(requests, trees):
            assert r.slot is not None  # the engine sets a drafting request's slot
            parents = tree.parents
            first = len(parents) - 1 if all(parents[i] == i - 1 for i in range(1, len(parents))) else 0
            firsts.append(first)
            work.append(
                SequenceWork(
                    slot=r.slot,
                    cache_len=len(r.token_ids) - 1 + first,
                    token_ids=list(tree.token_ids[first:]),
                    tree=tree.shape if first == 0 else None,
                )
            )
        out = self.runner.forward(work, end_layer=self.head.exit_layer)
        rows = out.forward.hidden_states.split([len(w.token_ids) for w in work])
        return [
            torch.cat([part.new_zeros(first, part.shape[1]), part]) if first else part
            for first, part in zip(firsts, rows)
        ]

    def _grow(
        self,
        tree: DynamicTree,
        expand: list[int],
        features: torch.Tensor,  # [m, D] the head's layer output at the nodes of `expand`
        *,
        logits: torch.Tensor | None,  # [m, Vd] their draft logits, where computed with other requests'
        budget: int,
        min_log_prob: float,  # paths below it stop
        draw: tuple[int, float] | None = None,
        sources: CopySources | None = None,
    ) -> list[int]:
        """Children for the frontier nodes to expand (within the budget); returns the new frontier.
        draw: a sampled request's (noise key of this depth's position, temperature): each
        node's first child is the head's keyed draw.  sources: what a copy path copies from."""
        if sources is not None and draw is None:  # the mixture's own top-k (cheaper than all of it)
            top_ids, top_log_probs = self.head.draft_top_k(features, sources, self.top_k, logits=logits)
            picks = list(zip(top_ids.tolist(), top_log_probs.tolist()))
            return self._add_picks(tree, expand, picks, budget=budget, min_log_prob=min_log_prob)
        if sources is None:
            candidates = self.head.d2t  # [Vd] target ids
            logits = self.head.draft_logits(features) if logits is None else logits
            log_probs = torch.log_softmax(logits.float(), dim=-1)  # [m, Vd]
        else:
            # [Vd + U], [m, Vd + U]
            candidates, log_probs = self.head.draft_log_probs(features, sources, logits=logits)
        width = min(self.top_k + (draw is not None), log_probs.shape[-1])
        best = torch.topk(log_probs, width, dim=-1).indices.tolist()
        picks = []
        for row in range(len(expand)):
            order = best[row]
            if draw is not None:
                order = coupled_order(log_probs[row], candidates, order, noise_key=draw[0], temperature=draw[1])
            columns = order[: self.top_k]
            picks.append((candidates[columns].tolist(), log_probs[row, columns].tolist()))
        return self._add_picks(tree, expand, picks, budget=budget, min_log_prob=min_log_prob)

    def _add_picks(
        self,
        tree: DynamicTree,
        expand: list[int],
        picks: list[tuple[list[int], list[float]]],
        *,
        budget: int,
        min_log_prob: float,
    ) -> list[int]:
        """Each expanded node's picks (target ids, log-probabilities; best first) as its children,
        those whose path stays above min_log_prob and within the budget; returns the new frontier."""
        new_frontier = []
        for node, (ids, values) in zip(expand, picks):
            room = budget - (len(tree.token_ids) - 1)
            keep = [k for k in range(len(ids)) if tree.scores[node] + values[k] >= min_log_prob][:room]
            new_frontier += tree.add_children(node, [ids[k] for k in keep], [values[k] for k in keep])
        return new_frontier
