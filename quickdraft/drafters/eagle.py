"""EAGLE-style drafting: a light head on the target's features proposes a tree.

Per request the head keeps its own KV cache of *true* entries: entry i is the pair (target
feature of token i, token i+1) at position i+1.  Features arrive from the engine as tokens
enter the target's cache (`observe`); the pairs they complete are fed to the head in one
catch-up forward at the next `propose`, whose last row (the pair ending in the root token)
gives the depth-1 draft distribution.  Deeper nodes feed the head's own output feature
with the node's token, attending to the true entries and to their own ancestors' draft
entries, which are written past the true entries and forgotten after verification: the
rollback is just the true length.

``catch_up_window`` bounds a catch-up: after a long stretch without drafts (the prompt, or
plain steps chosen by adaptive speculation) only the last that many features are fed, and
the head's context restarts there.  The head reads little beyond its last few dozen entries,
so this costs almost no acceptance, while a catch-up over a whole prompt or a long plain
stretch costs more than the draft it serves.  Pending features beyond the window are dropped
as they arrive, so a request that never drafts holds at most a window of them; except for a
head with a copy path, which copies from the whole context: the skipped entries still get
their copy keys (the fusion and input projection only, a fraction of a full catch-up).

``min_draft_prob`` stops a path where its cumulative draft probability falls below it (no
draft at all when even the best first token is that unsure).

Tree shapes: ``tree="dynamic"`` grows an EAGLE-2 tree (expand the ``top_k`` best nodes by
cumulative draft probability at each depth, keep the best ``max_draft_tokens`` overall);
a list of paths (Medusa's ``medusa_choices`` form) gives a static tree; ``top_k=1`` is a
chain.  Children are top-k picks, so proposals are point masses (``draft_probs=None``),
exact for greedy and sampled requests alike.

A head with a copy path (``copy_dim`` > 0) also keeps, per slot, the copy key of every true
entry (written at catch-up); a node's children are then the top k of the mixture of the
vocabulary and the copy distribution over the true entries before the root's (see
``quickdraft.models.heads.CopyMixture``), possibly tokens outside the draft vocabulary.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from quickdraft.drafters.base import AcceptedPath, Drafter, DraftRequest, Proposal, TargetInfo
from quickdraft.drafters.keyed import KeyedDraw, check_coupling, coupled_order
from quickdraft.drafters.tree import DynamicTree, StaticTree
from quickdraft.heads import drafting_options, head_precision, resolve_head_dir
from quickdraft.kernels.attention import attention
from quickdraft.kv.cache import KVCache, zeroed_pool
from quickdraft.models.eagle3 import Eagle3Head, detect_eagle3_format
from quickdraft.models.heads import CopySources, EagleHead, FeatureHead
from quickdraft.models.layers import default_linear_fn
from quickdraft.models.mtp import MtpHead

DRAFT_ENTRY_HEADROOM = 128  # head cache room past max_model_len for one step's draft entries


@dataclass
class _HeadState:
    slot: int
    # Target features [n, L * D] not yet fed, kept unfused: fusing them once at catch-up keeps a
    # step in which this request does not draft (adaptive speculation, busy batches) nearly free.
    pending: list[torch.Tensor] = field(default_factory=list)
    num_pending: int = 0  # rows in pending
    first_true: int = 0  # the head attends to true entries first_true..num_true-1 (a window restarts it)
    num_true: int = 0  # true entries in the head cache (index = token position)
    num_features: int = 0  # target features observed (= tokens in the target's cache)


@dataclass
class _Draft:
    """One request's tree while a step drafts."""

    state: _HeadState
    tree: DynamicTree
    hidden: dict[int, torch.Tensor]  # node -> the head's output after it [D] (its children's feature)
    entry: dict[int, int]  # draft node -> storage index of its draft entry (the root's is a true entry)
    request: DraftRequest  # its limits: depth, budget, path probability floor past max_depth
    max_depth: int = 1
    budget: int = 1
    copy_sources: CopySources | None = None
    frontier: list[int] = field(default_factory=lambda: [0])  # the newest depth's nodes
    expand: list[int] = field(default_factory=list)  # the nodes whose children this depth adds
    # Sampled requests: each node's first child is the head's keyed draw (drafters/keyed.py).
    keyed: KeyedDraw | None = None


@dataclass
class _HeadRows:
    """One request's rows of a head forward: true pairs at catch-up, or draft nodes."""

    state: _HeadState
    token_ids: list[int]  # [m]
    features: torch.Tensor  # [m, D] the features paired with the tokens (fused)
    positions: list[int]  # [m]
    store: list[int]  # [m] head-cache entries written: a contiguous run that ends the attended range
    mask: torch.Tensor  # [m, store[-1] + 1 - first_true] bool, over entries first_true..store[-1]
    true_entries: bool = False  # catch-up rows (their copy keys are kept)


class EagleDrafter(Drafter):
    """Drives any FeatureHead: a trained EAGLE head, or a checkpoint's own MTP layer."""

    scores_paths = True  # paths grow by the head's probability and stop below min_path_prob

    def __init__(
        self,
        *,
        target: TargetInfo,
        head: FeatureHead,
        num_speculative_tokens: int = 5,
        tree: str | list = "dynamic",
        top_k: int = 4,
        max_draft_tokens: int = 16,
        min_draft_prob: float = 0.0,
        catch_up_window: int | None = 64,
        coupling: str = "top_k",
    ):
        self.coupling = check_coupling(coupling)  # sampled requests' first children (drafters/keyed.py)
        if target.model is None:
            raise ValueError("the eagle drafter needs the target model (TargetInfo.model)")
        if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
            raise ValueError(f"top_k must be a positive integer, got {top_k!r}")
        if not isinstance(max_draft_tokens, int) or isinstance(max_draft_tokens, bool) or max_draft_tokens < 1:
            raise ValueError(f"max_draft_tokens must be a positive integer, got {max_draft_tokens!r}")
        if catch_up_window is not None and (
            not isinstance(catch_up_window, int) or isinstance(catch_up_window, bool) or catch_up_window < 1
        ):
            raise ValueError(f"catch_up_window must be a positive integer or null, got {catch_up_window!r}")
        self.catch_up_window = catch_up_window
        self.depth = num_speculative_tokens
        self.top_k = top_k
        self.max_draft_tokens = max_draft_tokens
        if not isinstance(min_draft_prob, (int, float)) or not 0.0 <= min_draft_prob < 1.0:
            raise ValueError(f"min_draft_prob must be in [0, 1), got {min_draft_prob!r}")
        # Nodes whose path probability under the head falls below this are not drafted: where the
        # head is unsure, verifying its guesses costs more than they return.
        self.min_log_prob = math.log(min_draft_prob) if min_draft_prob > 0 else -math.inf
        self.static_tree = None if tree == "dynamic" else _static_tree(tree)
        self.device = target.device
        self.vocab_size = target.vocab_size  # the keyed noise is drawn over the whole vocabulary
        self.head = head
        if self.head.config.hidden_size != target.model.config.hidden_size:
            raise ValueError(
                f"head hidden size {self.head.config.hidden_size} does not match the target's "
                f"{target.model.config.hidden_size}"
            )
        if int(self.head.d2t.max()) >= target.vocab_size:
            raise ValueError("the head's draft vocabulary maps to ids outside the target's vocabulary")
        bad_layers = [i for i in self.head.config.feature_layers if not 0 <= i < target.model.config.num_layers]
        if bad_layers:
            raise ValueError(f"head reads target layers {bad_layers} that the target does not have")
        self.head.attach_target(target.model)
        self.head.linear = default_linear_fn(target.device)
        self.feature_layers = tuple(self.head.config.feature_layers)
        self.feature_dtype = head.dtype  # read per request and step: head.dtype walks the parameters
        c = self.head.config
        self.cache = KVCache(
            num_layers=1,
            num_slots=target.max_num_seqs,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            max_len=head_max_len(target),
            dtype=head.dtype,
            device=target.device,
        )
        # [num_slots, max_len, C]: copy keys of the true entries, by entry index (heads with a copy path)
        self.copy_key_cache = (
            zeroed_pool((target.max_num_seqs, head_max_len(target), c.copy_dim), dtype=head.dtype, device=target.device)
            if c.copy_dim
            else None
        )
        self._states: dict[str, _HeadState] = {}

    @classmethod
    def with_trained_head(
        cls,
        *,
        target: TargetInfo,
        head: str | None = None,
        head_dtype: str | None = None,
        tree: str | list | None = None,
        top_k: int | None = None,
        max_draft_tokens: int | None = None,
        min_draft_prob: float | None = None,
        **options,
    ) -> EagleDrafter:
        """`head`: a directory written by `quickdraft train-head`, or a shipped head's name;
        `head_dtype`: how the head computes: "float32", "bfloat16", "float16", or "q8_0", "q5_0",
        "q4_0" (its matrices quantized, float32 elsewhere, on the quantized CPU kernels).
        Default: q4_0 when the target runs quantized weights, else the target's dtype.  Drafting
        precision never affects the output, only how well and how fast the head guesses.
        tree, top_k, max_draft_tokens, min_draft_prob: None takes what the head's manifest
        recommends (measured best for that head), else "dynamic", 4, 16 and 0."""
        directory = resolve_head_dir(head, method="eagle3", model=target.model)
        options.update(
            drafting_options(
                directory,
                tree=(tree, "dynamic"),
                top_k=(top_k, 4),
                max_draft_tokens=(max_draft_tokens, 16),
                min_draft_prob=(min_draft_prob, 0.0),
            )
        )
        dtype, quantization = head_precision(head_dtype, target=target)
        module: FeatureHead
        if detect_eagle3_format(directory) is not None:  # a head trained elsewhere (speculators, SpecForge)
            if target.model is None:
                raise ValueError("the eagle drafter needs the target model (TargetInfo.model)")
            module = Eagle3Head.load(
                directory,
                target_num_layers=target.model.config.num_layers,
                dtype=dtype,
                device=target.device,
                max_len=head_max_len(target),
            )
        else:
            module = EagleHead.load(directory, dtype=dtype, device=target.device, max_len=head_max_len(target))
        drafter = cls(target=target, head=module, **options)  # attaches the target's LM rows
        if quantization:
            module.quantize_for_drafting(quantization)
            module.drop_borrowed_float_rows()  # this head only drafts
        return drafter

    @classmethod
    def with_mtp_layer(cls, *, target: TargetInfo, head: str | None = None, layer: int = 0, **options) -> EagleDrafter:
        """MTP layer `layer` of the target's own checkpoint, or of `head` (a folder in the nextn
        layout, e.g. one written by `quickdraft train-head --method mtp`)."""
        source = head or target.model_dir
        if source is None:
            raise ValueError("the mtp drafter needs the target's checkpoint directory or a head folder")
        if not isinstance(layer, int) or isinstance(layer, bool) or layer < 0:
            raise ValueError(f"layer must be a non-negative integer, got {layer!r}")
        if target.model is None:
            raise ValueError("the mtp drafter needs the target model (TargetInfo.model)")
        module = MtpHead.from_checkpoint(
            Path(source).expanduser(),
            target_config=target.model.config,
            layer=layer,
            dtype=target.dtype,
            device=target.device,
            max_len=head_max_len(target),
        )
        return cls(target=target, head=module, **options)

    # ---- lifecycle ------------------------------------------------------------------------
    def begin(self, request: DraftRequest) -> None:
        slot = self.cache.allocate()
        self.cache.reserve(slot, self.cache.max_len)  # one block: the head's entries by index
        self._states[request.request_id] = _HeadState(slot=slot)

    def finish(self, request_id: str) -> None:
        state = self._states.pop(request_id, None)
        if state is not None:
            self.cache.free(state.slot)

    def observe(self, request: DraftRequest, features: torch.Tensor) -> None:
        # features [n, L * D] of the next n tokens entering the target's cache: their own tensor
        # (Drafter.observe), kept as it is where it has the head's dtype.  A request that decodes
        # plainly keeps its pending rows (a copy head: all of them) for many steps.
        state = self._states[request.request_id]
        if features.dtype != self.feature_dtype:  # checked here: a torch call per request and step
            features = features.to(self.feature_dtype)  # hands a server's GIL away (engine._kept_features)
        state.pending.append(features)
        state.num_pending += features.shape[0]
        state.num_features += features.shape[0]
        window = None if self.copy_key_cache is not None else self.catch_up_window  # copy keys need them all
        while window is not None and state.num_pending - state.pending[0].shape[0] >= window:
            state.num_pending -= state.pending.pop(0).shape[0]  # older than any catch-up will feed

    def catch_up_rows(self, request: DraftRequest) -> int:
        state = self._states.get(request.request_id)
        if state is None:
            return 0
        owed = state.num_features - state.num_true  # what _catch_up feeds
        return owed if self.catch_up_window is None else min(owed, self.catch_up_window)

    def accept(self, request: DraftRequest, accepted: AcceptedPath) -> None:
        pass  # draft entries sit past num_true: they are overwritten next step

    # ---- propose ----------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[Proposal | None]:
        """Every request's tree grown together: one head forward per draft depth for all of them
        (and one catch-up forward), not one per request."""
        ready = [r for r in requests if self._in_step(r)]
        if not ready:
            return [None] * len(requests)
        states = [self._states[r.request_id] for r in ready]
        roots = self._catch_up([(state, r.token_ids) for state, r in zip(states, ready)])
        drafts = {
            r.request_id: _Draft(
                state=state,
                tree=DynamicTree(root_token=r.token_ids[-1]),
                hidden={0: root},
                entry={},
                request=r,
                max_depth=min(self.depth, r.depth_limit),
                budget=min(self.max_draft_tokens, r.budget),
                copy_sources=self._copy_sources(state, r.token_ids),
                keyed=KeyedDraw.of(r) if self.coupling == "keyed" else None,
            )
            for r, state, root in zip(ready, states, roots)
        }
        grown_at_once = len(drafts) == 1 and self._grow_chain_in_one_call(next(iter(drafts.values())))
        if not grown_at_once:
            self._grow_depth_by_depth(list(drafts.values()))
        proposals: list[Proposal | None] = []
        for request in requests:
            grown = drafts.get(request.request_id)
            if grown is None or len(grown.tree.token_ids) == 1:
                proposals.append(None)
                continue
            proposals.append(grown.tree.proposal(grown.budget))
        return proposals

    def _grow_depth_by_depth(self, drafts: list[_Draft]) -> None:
        """Every draft's tree, one head forward per depth for all of them."""
        for depth in range(1, max(d.max_depth for d in drafts) + 1):
            growing = []
            for draft in drafts:
                draft.expand = (
                    self._nodes_to_expand(draft.tree, draft.frontier, depth) if depth <= draft.max_depth else []
                )
                if draft.expand:
                    growing.append(draft)
            if not growing:
                break
            if depth > 1:  # depth-1 children come from the catch-up's last rows
                self._feed_nodes(growing)
            self._add_children(growing)

    def _grow_chain_in_one_call(self, draft: _Draft) -> bool:
        """A lone request's top-1 chain, every depth in one C++ call (EagleHead.draft_chain):
        ~10 Python-driven calls per depth cost more than the head's arithmetic at one row.  The
        same picks as the depth-by-depth loop, which runs where this cannot (trees, keyed draws,
        several requests, heads without a copy path) -- False then, and nothing has changed."""
        if self.static_tree is not None or self.top_k != 1 or draft.keyed is not None or draft.copy_sources is None:
            return False
        chain_head = getattr(self.head, "draft_chain", None)
        if chain_head is None:
            return False
        state, request = draft.state, draft.request
        picks = chain_head(
            draft.hidden[0],
            sources=draft.copy_sources,
            cache_keys=self.cache.keys[0],
            cache_values=self.cache.values[0],
            block_table=self.cache.block_table(state.slot),
            first_true=state.first_true,
            num_true=state.num_true,
            floors=[request.path_log_floor(depth, self.min_log_prob) for depth in range(1, draft.max_depth + 1)],
        )
        if picks is None:
            return False
        node = 0
        for token, log_prob in zip(*picks):
            node = draft.tree.add_children(node, [token], [log_prob], [0])[0]
        return True

    def _in_step(self, request: DraftRequest) -> bool:
        """New features arrived and they match the tokens (else: no draft for it this step)."""
        state = self._states[request.request_id]
        return bool(state.pending) and state.num_features == len(request.token_ids) - 1

    def _add_children(self, drafts: list[_Draft]) -> None:
        """The children of every draft's expanded nodes, from one pick over all their rows."""
        ranks = [[self._child_ranks(d.tree, node) for node in d.expand] for d in drafts]
        features = torch.stack([d.hidden[node] for d in drafts for node in d.expand])  # [m, D]
        couplings = [[_coupling(d, node) for node in d.expand] for d in drafts]
        picks = self._pick_children_of(drafts, features, ranks, couplings)
        for draft, draft_ranks, draft_picks in zip(drafts, ranks, picks):
            draft.frontier = []
            tree = draft.tree
            for node, node_ranks, (picked_ids, picked_log_probs) in zip(draft.expand, draft_ranks, draft_picks):
                floor = draft.request.path_log_floor(tree.depths[node] + 1, self.min_log_prob)
                keep = [i for i, lp in enumerate(picked_log_probs) if tree.scores[node] + lp >= floor]
                draft.frontier += tree.add_children(
                    node,
                    [picked_ids[i] for i in keep],
                    [picked_log_probs[i] for i in keep],
                    [node_ranks[i] for i in keep],
                )

    def _pick_children_of(
        self,
        drafts: list[_Draft],
        features: torch.Tensor,
        ranks: list[list[list[int]]],
        couplings: list[list[tuple[int, float] | None]],
    ) -> list[list[tuple[list[int], list[float]]]]:
        """Per draft, per expanded node: its picks.  Drafts without copy sources share one call;
        each with its own copy sources (its own context) gets one, on draft logits computed for
        all of them at once (one pass over the draft LM head, megabytes, instead of one each)."""
        offsets = list(itertools.accumulate((len(d.expand) for d in drafts), initial=0))
        plain = [i for i, d in enumerate(drafts) if d.copy_sources is None]
        copying = [i for i, d in enumerate(drafts) if d.copy_sources is not None]
        logits = self.head.draft_logits(features) if len(copying) > 1 else None  # [m, Vd]
        picks: list[list[tuple[list[int], list[float]]]] = [[] for _ in drafts]
        if plain:
            rows = torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in plain]).to(features.device)
            shared = self._pick_children(
                features[rows],
                [r for i in plain for r in ranks[i]],
                None,
                [c for i in plain for c in couplings[i]],
                logits=None if logits is None else logits[rows],
            )
            taken = 0
            for i in plain:
                picks[i] = shared[taken : taken + len(ranks[i])]
                taken += len(ranks[i])
        for i in copying:
            own = slice(offsets[i], offsets[i + 1])
            picks[i] = self._pick_children(
                features[own],
                ranks[i],
                drafts[i].copy_sources,
                couplings[i],
                logits=None if logits is None else logits[own],
            )
        return picks

    def _pick_children(
        self,
        features: torch.Tensor,
        ranks_per_node: list[list[int]],
        copy_sources: CopySources | None,
        couplings: list[tuple[int, float] | None] | None = None,
        *,
        logits: torch.Tensor | None = None,  # [m, Vd] the rows' draft logits, if computed already
    ) -> list[tuple[list[int], list[float]]]:
        """Per node (head output `features` [m, D]): the target ids and log-probabilities of its
        candidates of the given ranks (0 = most likely; for a node with a coupling (key,
        temperature), rank 0 is the head's keyed draw and the ranks after it the most likely
        other ids)."""
        num_ranks = max(max(ranks) for ranks in ranks_per_node) + 1
        couplings = couplings or [None] * len(ranks_per_node)
        if all(coupling is None for coupling in couplings):
            if copy_sources is None:
                logits = self.head.draft_logits(features) if logits is None else logits  # [m, Vd]
                log_probs = torch.log_softmax(logits.float(), dim=-1)
                top = torch.topk(log_probs, num_ranks, dim=-1)  # every row at once
                top_ids, top_values = self.head.d2t[top.indices].tolist(), top.values.tolist()
                return [
                    ([top_ids[row][r] for r in ranks], [top_values[row][r] for r in ranks])
                    for row, ranks in enumerate(ranks_per_node)
                ]
            # every node copies from the same true entries
            ids, log_probs = self.head.draft_top_k(features, copy_sources, num_ranks, logits=logits)
            return [
                (ids[row, ranks].tolist(), log_probs[row, ranks].tolist()) for row, ranks in enumerate(ranks_per_node)
            ]
        if copy_sources is None:
            candidates = self.head.d2t  # [Vd] target ids
            logits = self.head.draft_logits(features) if logits is None else logits
            scores = torch.log_softmax(logits.float(), dim=-1)  # [m, Vd]
        else:
            # [Vd + U], [m, Vd + U]
            candidates, scores = self.head.draft_log_probs(features, copy_sources, logits=logits)
        picks = []
        best = torch.topk(scores, min(num_ranks + 1, scores.shape[1]), dim=-1).indices.tolist()
        for row, (ranks, coupling) in enumerate(zip(ranks_per_node, couplings)):
            order = best[row]
            if coupling is not None:
                key, temperature = coupling
                order = coupled_order(scores[row], candidates, order, noise_key=key, temperature=temperature)
            columns = [order[r] for r in ranks if r < len(order)]
            picks.append((candidates[columns].tolist(), scores[row, columns].tolist()))
        return picks

    def _copy_sources(self, state: _HeadState, tokens: list[int]) -> CopySources | None:
        """Copy keys [n, C] and values [n] of the true entries every node of this step copies
        from: 0..root's entry - 1, the whole context even where a catch-up window restarted the
        head's attention (entry i copies token i + 2; the root's own is the token being drafted).
        None without a copy path or with nothing to copy yet."""
        if self.copy_key_cache is None or state.num_true < 2:
            return None
        keys = self.copy_key_cache[state.slot, : state.num_true - 1]
        values = torch.tensor(tokens[2 : state.num_true + 1], device=self.device)
        return self.head.copy_sources(keys, values)

    def _write_copy_keys(self, state: _HeadState, tokens: list[int], features: torch.Tensor, *, start: int) -> None:
        """Copy keys of true entries start.. from their target features [n, L * D], without running
        the head's block over them (entries a catch-up window skips)."""
        assert self.copy_key_cache is not None  # only heads with a copy path key their entries
        count = features.shape[0]
        next_tokens = torch.tensor(tokens[start + 1 : start + 1 + count], device=self.device)
        hidden = self.head.input_hidden(next_tokens, self.head.fuse_features(features))  # [n, D]
        self.copy_key_cache[state.slot, start : start + count] = self.head.copy_keys(hidden)

    # ---- tree shape -------------------------------------------------------------------------
    def _nodes_to_expand(self, tree: DynamicTree, frontier: list[int], depth: int) -> list[int]:
        if self.static_tree is None:
            return tree.best_frontier(frontier, 1 if depth == 1 else self.top_k)
        return [n for n in frontier if self._static_children(tree, n)]

    def _child_ranks(self, tree: DynamicTree, node: int) -> list[int]:
        if self.static_tree is None:
            return list(range(self.top_k))
        return self._static_children(tree, node)

    def _static_children(self, tree: DynamicTree, node: int) -> list[int]:
        assert self.static_tree is not None  # only static trees ask
        path = tree.path_ranks(node)
        return [p[-1] for p in self.static_tree.paths if len(p) == len(path) + 1 and p[:-1] == path]

    # ---- head forwards ------------------------------------------------------------------------
    def _catch_up(self, requests: list[tuple[_HeadState, list[int]]]) -> list[torch.Tensor]:
        """Feed each request's pending true pairs, all in one forward; returns per request the
        head's output after its root pair [D]."""
        batch = []
        for state, tokens in requests:
            pending = torch.cat(state.pending)  # [num_pending, L * D]
            count = state.num_features - state.num_true  # entries owed
            if self.catch_up_window is not None and count > self.catch_up_window:
                count = self.catch_up_window
                if self.copy_key_cache is not None:  # pending holds every owed entry: key the skipped ones
                    self._write_copy_keys(state, tokens, pending[: pending.shape[0] - count], start=state.num_true)
                state.first_true = state.num_features - count  # older entries would only be a gap: restart
            state.pending, state.num_pending = [], 0
            start = state.num_features - count
            causal = torch.ones(count, start + count - state.first_true, dtype=torch.bool)
            causal[:, start - state.first_true :] = torch.ones(count, count, dtype=torch.bool).tril_()
            batch.append(
                _HeadRows(
                    state=state,
                    token_ids=tokens[start + 1 : start + 1 + count],
                    features=pending[pending.shape[0] - count :],
                    positions=list(range(start + 1, start + 1 + count)),
                    store=list(range(start, start + count)),
                    mask=causal,
                    true_entries=True,
                )
            )
            state.num_true = start + count
        # The fusion of every request's features in one call, then split back.
        fused = self.head.fuse_features(torch.cat([rows.features for rows in batch])).split(
            [len(rows.store) for rows in batch]
        )
        for rows, features in zip(batch, fused):
            rows.features = features
        return [out[-1] for out in self._forward(batch)]

    def _feed_nodes(self, drafts: list[_Draft]) -> None:
        """Draft entries for each draft's `expand` nodes (their parents' outputs + their tokens),
        all in one forward; fills the drafts' hidden and entry."""
        batch = []
        for draft in drafts:
            state, tree, nodes, entry = draft.state, draft.tree, draft.expand, draft.entry
            first_free = state.num_true + len(entry)
            store = list(range(first_free, first_free + len(nodes)))
            first = state.first_true
            width, num_true = first_free + len(nodes) - first, state.num_true - first  # columns from first
            mask_rows = []  # built as lists: one tensor at the end instead of an indexing op per entry
            for row, node in enumerate(nodes):
                entry[node] = store[row]
                visible = [True] * num_true + [False] * (width - num_true)
                for ancestor in tree.shape.path(node)[1:]:
                    visible[entry[ancestor] - first] = True
                mask_rows.append(visible)
            mask = torch.tensor(mask_rows, dtype=torch.bool)
            batch.append(
                _HeadRows(
                    state=state,
                    token_ids=[tree.token_ids[n] for n in nodes],
                    features=torch.stack([draft.hidden[tree.parents[n]] for n in nodes]),  # [m, D]
                    positions=[state.num_true + tree.depths[n] for n in nodes],
                    store=store,
                    mask=mask,
                )
            )
        for draft, out in zip(drafts, self._forward(batch)):
            for row, node in enumerate(draft.expand):
                draft.hidden[node] = out[row]

    def _forward(self, batch: list[_HeadRows]) -> list[torch.Tensor]:
        """One head forward over every request's rows -> per request its outputs [m, D]."""
        head = self.head
        sizes = [len(rows.store) for rows in batch]
        offsets = list(itertools.accumulate(sizes, initial=0))
        token_ids = torch.tensor([t for rows in batch for t in rows.token_ids], device=self.device)
        positions = torch.tensor([p for rows in batch for p in rows.positions], device=self.device)
        hidden = head.input_hidden(token_ids, torch.cat([rows.features for rows in batch]))  # [N, D]
        for i, rows in enumerate(batch):
            if rows.true_entries and self.copy_key_cache is not None:  # only true entries are copied from
                keys = head.copy_keys(hidden[offsets[i] : offsets[i + 1]])
                self.copy_key_cache[rows.state.slot, rows.store[0] : rows.store[-1] + 1] = keys
        masks = [rows.mask.to(self.device) for rows in batch]
        if head.runs_fused_block(hidden):  # each store is the contiguous run ending its attended range
            out = head.fused_block(
                hidden,
                positions,
                cache_keys=self.cache.keys[0],
                cache_values=self.cache.values[0],
                sequences=[
                    (offsets[i], offsets[i + 1], rows.state.first_true, rows.state.first_true + mask.shape[1])
                    for i, (rows, mask) in enumerate(zip(batch, masks))
                ],
                block_tables=[self.cache.block_table(rows.state.slot) for rows in batch],
                masks=masks,
            )
            return list(out.split(sizes))
        q, k, v = head.attention_inputs(hidden, positions)  # q [N, H, hd], k and v [N, Hkv, hd]
        located = [self.cache.locate(rows.state.slot, rows.store) for rows in batch]
        self.cache.write(
            0,
            keys=k,
            values=v,
            block_index=torch.tensor([b for blocks, _ in located for b in blocks], device=self.device),
            block_offset=torch.tensor([r for _, offsets in located for r in offsets], device=self.device),
        )
        attended = []
        for i, (rows, mask) in enumerate(zip(batch, masks)):
            first = rows.state.first_true
            keys, values = self.cache.read(0, slot=rows.state.slot, start=first, end=first + mask.shape[1])
            # The batch-invariant kernel where it runs: a request's draft is then the same bits
            # whichever other requests draft beside it.
            attended.append(attention(q[offsets[i] : offsets[i + 1]], keys, values, mask=mask, scale=head.attn_scale))
        return list(head.block_output(hidden, torch.cat(attended).reshape(hidden.shape[0], -1)).split(sizes))


def _coupling(draft: _Draft, node: int) -> tuple[int, float] | None:
    """(noise key, temperature) of the keyed draw for `node`'s first child, or None (greedy)."""
    if draft.keyed is None:
        return None
    return draft.keyed.key(draft.tree.depths[node] + 1), draft.keyed.temperature


def head_max_len(target: TargetInfo) -> int:
    return target.max_model_len + DRAFT_ENTRY_HEADROOM


def _static_tree(tree) -> StaticTree:
    if not isinstance(tree, (list, tuple)):
        raise ValueError(f"tree must be 'dynamic' or a list of paths (medusa_choices form), got {tree!r}")
    return StaticTree.from_paths(tree)
