"""Speculation inside the engine step: ask the drafter, and learn from what was accepted.

Plain Python bookkeeping (draft budgets and lengths, adaptive acceptance estimates, the
drafter's view of each request).  It returns proposals to the engine and is told, once per
request and step, what the engine committed; verification itself is the engine's
(``engine/verification.py``), the same for drafted and plain requests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from quickdraft.config import SpeculativeConfig
from quickdraft.drafters.base import AcceptedPath, Drafter, DraftRequest, Proposal, catch_up_rows_of
from quickdraft.drafters.prediction import MAX_CHAIN, PredictionDrafter
from quickdraft.engine.adaptive import (
    MAX_PROBES_PER_STEP,
    PROBE_LENGTH,
    AcceptanceEstimate,
    DraftValue,
    ForwardTiming,
    PathCalibration,
    ProbeSchedule,
    StepCostModel,
    choose_draft_lengths,
    choose_drafting,
    step_throughput,
    worth_probing,
)
from quickdraft.engine.feature_cache import FeatureBlockCache
from quickdraft.engine.request import Request

# Weight of a step in the average of drafted tokens per decode (about the last ten steps count).
DRAFT_RESERVE_RATE = 0.1


@dataclass
class DraftLengthPolicy:
    """Per-request draft length: grow by one after a full accept, shrink after an early reject."""

    maximum: int
    dynamic: bool

    def next_length(self, current: int, *, drafted: int, accepted: int) -> int:
        if not self.dynamic or drafted == 0:
            return current
        if accepted == drafted:
            return min(self.maximum, current + 1)
        if accepted < drafted // 2:
            return max(1, current - 1)
        return current


class Speculator:
    def __init__(self, *, config: SpeculativeConfig, drafter: Drafter, max_tree_nodes: int):
        if config.num_speculative_tokens is None:  # the engine fills in the method's default
            raise ValueError("Speculator needs a config with num_speculative_tokens set")
        self.config = config
        self.num_speculative_tokens: int = config.num_speculative_tokens
        self.drafter = drafter
        self.predictions = PredictionDrafter()  # requests that bring their expected output draft it
        self._proposer: dict[str, Drafter] = {}  # this step's requests that the prediction drafted for
        self.max_tree_nodes = max_tree_nodes
        self.policy = DraftLengthPolicy(maximum=self.num_speculative_tokens, dynamic=config.dynamic_draft_length)
        self._draft_length: dict[str, int] = {}
        self._views: dict[str, DraftRequest] = {}
        self.step_costs = StepCostModel()  # adaptive: fed by the engine after every step
        self._acceptance: dict[str, AcceptanceEstimate] = {}  # adaptive: per request
        # adaptive: every request's drafts; new and idle requests start from / drift to its rate
        self._all_acceptance = AcceptanceEstimate(prior=config.adaptive_prior, decay=0.98)
        self._probes: dict[str, ProbeSchedule] = {}  # adaptive: per request
        self._path_calibration = PathCalibration()  # adaptive: a path-scoring drafter's acceptance by path probability
        self._values: dict[str, DraftValue] = {}  # adaptive, a path-scoring drafter: per request
        self._all_values = DraftValue(prior=(1.0, 2.0), decay=0.98)  # every request's drafts
        # adaptive: draft tokens per decoding request, exponentially averaged over the steps that
        # had decodes (the scheduler's draft_reserve).  Starts at 0 and rises as decodes draft:
        # started at the bound, every fresh speculator (a new server, a switched config) held back
        # prefill for drafts it had not chosen, ~20 steps until it decayed (in-process closed loop,
        # 16 clients, one engine switched between modes as the serving benchmark does: adaptive
        # eagle3 0.946x plain, 0.970-0.987x from 0)
        self._drafted_per_decode = 0.0
        self._step_catch_up_rows = 0  # adaptive: rows this step's drafting fed to catch up (Drafter.catch_up_rows)
        # This step's (node budget, max depth) of each request asked to draft: the engine appends
        # grammar-forced tokens within what is left of them (structured outputs).
        self.step_limits: dict[str, tuple[int, int]] = {}
        # With prefix caching, for drafters that read features: theirs of every full block
        # committed (the engine attaches it; see engine/feature_cache.py).
        self.feature_blocks: FeatureBlockCache | None = None

    # ---- lifecycle --------------------------------------------------------------------
    def view(self, request: Request) -> DraftRequest:
        """The drafter's view of a request; shares the request's token lists (no copy)."""
        view = self._views.get(request.request_id)
        if view is None:
            view = DraftRequest(
                request_id=request.request_id,
                prompt_token_ids=request.prompt_token_ids,
                output_token_ids=request.output_token_ids,
                budget=1,
                params=request.params,
                slot=request.slot,
                seed=request.seed,
                grammar=request.grammar,
                prediction_token_ids=request.params.prediction_token_ids,
            )
            self._views[request.request_id] = view
            self._draft_length[request.request_id] = self.num_speculative_tokens
            self._acceptance[request.request_id] = AcceptanceEstimate(prior=self._all_acceptance.rate)
            self._values[request.request_id] = DraftValue(prior=self._all_values.per_draft)
            self._probes[request.request_id] = ProbeSchedule(every=self.config.adaptive_probe_every)
            self.drafter.begin(view)
            self.predictions.begin(view)
        return view

    def _drafter_of(self, view: DraftRequest) -> Drafter:
        """Who drafted for a request this step: its predicted output where that was found,
        else the configured drafter."""
        return self._proposer.get(view.request_id, self.drafter)

    @property
    def draft_reserve(self) -> int:
        """Draft nodes a decode usually adds: the drafter's own node bound where it has one
        (trees), else the draft length; what the scheduler holds back from prefill per decode.
        Under adaptive speculation, what its decodes drafted lately (rounded up): decodes that
        mostly do not draft then leave prefill its budget (with the bound, 32 decodes held back
        half of every mixed step's prefill: adaptive eagle3's TTFT p50 in the serving benchmark
        at concurrency 32 was 1.35x plain decoding's, with the average 1.11x)."""
        bound = min(
            int(getattr(self.drafter, "max_draft_tokens", None) or self.num_speculative_tokens),
            self.max_tree_nodes - 1,
        )
        reserve = bound if not self.config.adaptive else min(bound, max(0, math.ceil(self._drafted_per_decode - 0.1)))
        if self.predictions.active:  # requests that brought predictions: room for their chains
            reserve = max(reserve, min(MAX_CHAIN, self.max_tree_nodes - 1))
        return reserve

    def drafts_with(self, *, num_running: int) -> bool:
        """Whether a step with this many running requests drafts at all (vLLM's disable_by_batch_size)."""
        limit = self.config.disable_by_batch_size
        return limit is None or num_running < limit

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """Target layers whose outputs the drafter reads (empty for most drafters)."""
        return tuple(getattr(self.drafter, "feature_layers", ()))

    def prefix_usable(self, key: bytes) -> bool:
        """Whether a prefix cache hit may cover the block of `key`: always, unless the drafter
        reads features and those of the block are not held (the block is recomputed instead)."""
        return not self.feature_layers or (self.feature_blocks is not None and key in self.feature_blocks)

    def finish(self, request_id: str) -> None:
        if self.feature_blocks is not None:
            self.feature_blocks.finish(request_id)
        if self._views.pop(request_id, None) is not None:
            self._draft_length.pop(request_id, None)
            self._acceptance.pop(request_id, None)
            self._values.pop(request_id, None)
            self._probes.pop(request_id, None)
            self.drafter.finish(request_id)
            self.predictions.finish(request_id)

    # ---- propose ----------------------------------------------------------------------
    def propose(
        self, requests: list[Request], *, cache_room: dict[str, int], token_room: dict[str, int] | None = None
    ) -> dict[str, Proposal]:
        """Proposals for the requests worth drafting for; others decode plainly this step.
        cache_room: cache positions left per request; token_room: draft nodes its share of the
        step's token budget allows (None: no bound beyond the cache)."""
        limits = {}
        for request in requests:
            # Nodes are bounded by cache room and the step's token budget; depth by the draft
            # length and max_tokens.  A drafter given fewer nodes proposes a smaller tree.
            budget = min(cache_room[request.request_id] - 1, self.max_tree_nodes - 1)
            if token_room is not None:
                budget = min(budget, token_room[request.request_id])
            max_depth = min(
                self._draft_length.get(request.request_id, self.num_speculative_tokens),
                request.remaining_output_tokens - 1,
            )
            limits[request.request_id] = (budget, max_depth)
        path_probs: dict[str, tuple[int, float]] = {}  # adaptive: extension depth and its path probability floor
        if self.config.adaptive:
            limits, path_probs = self._adaptive_limits(requests, limits)
        self.step_limits = {rid: (b, d) for rid, (b, d) in limits.items() if b >= 1 and d >= 1}
        predicted: list[tuple[DraftRequest, int]] = []  # (view, the engine's drafter's depth for it)
        others: list[DraftRequest] = []
        for request in requests:
            budget, max_depth = limits[request.request_id]
            # A prediction's chain is the client's guess, not the acceptance model's: it is offered
            # whatever length adaptive speculation chose for the engine's drafter.
            guess_depth = min(MAX_CHAIN, request.remaining_output_tokens - 1)
            guessed = bool(request.params.prediction_token_ids) and guess_depth >= 1
            if budget < 1 or (max_depth < 1 and not guessed):
                continue
            view = self.view(request)
            view.budget, view.max_depth, view.slot = budget, max_depth, request.slot
            view.extend_depth, view.min_path_prob = path_probs.get(request.request_id, (0, 0.0))
            if guessed:
                view.max_depth = guess_depth
                predicted.append((view, max_depth))
            else:
                others.append(view)
        drafted: list[tuple[DraftRequest, Proposal | None]] = []
        guesses = self.predictions.propose([view for view, _ in predicted]) if predicted else []
        for (view, own_depth), guess in zip(predicted, guesses):
            if guess is not None:
                drafted.append((view, guess))
            elif own_depth >= 1:  # the output is not (or no longer) the prediction: the engine's drafter drafts
                view.max_depth = own_depth
                others.append(view)
        self._proposer = {view.request_id: self.predictions for view, _ in drafted}
        if others:
            if self.config.adaptive:  # priced apart by the cost model (observe_step)
                self._step_catch_up_rows = sum(catch_up_rows_of(self.drafter, view) for view in others)
            drafted += zip(others, self.drafter.propose(others))
        proposals = {}
        for view, proposal in drafted:
            if proposal is None or proposal.num_draft_tokens == 0:
                continue
            if proposal.num_draft_tokens > view.budget:
                raise RuntimeError(
                    f"drafter proposed {proposal.num_draft_tokens} tokens over a budget of "
                    f"{view.budget} for request {view.request_id}"
                )
            last = view.output_token_ids[-1] if view.output_token_ids else view.prompt_token_ids[-1]
            if proposal.token_ids[0] != last:
                raise RuntimeError(f"proposal root {proposal.token_ids[0]} is not the last committed token {last}")
            proposals[view.request_id] = proposal
        return proposals

    def _adaptive_limits(
        self, requests: list[Request], limits: dict[str, tuple[int, int]]
    ) -> tuple[dict[str, tuple[int, int]], dict[str, tuple[int, float]]]:
        """(budget, max_depth) per request, with the draft length adaptive speculation chooses
        (0 for requests that decode plainly this step), and for a drafter that scores its paths
        an extension of each drafting request's paths (up to its limits) where the path's
        probability, calibrated (PathCalibration), pays: a node that costs c seconds pays when
        its expected tokens beat throughput * c, the drafting cost of a node priced as a whole
        draft depth (one head forward for every drafting request).

        Other drafters get a chain's worth of nodes from the chain model (choose_draft_lengths).
        A drafter that scores its paths sizes its own drafts, so whether a request drafts is
        decided on what its drafts brought lately (DraftValue: accepted tokens and verified nodes
        per draft; choose_drafting), and a drafting request is offered one node plus the
        extension.  The chain model's per-token rate misread such drafts: cut where the head is
        unsure, they end in a rejection more often than a fixed-length chain, and the rate it
        fitted (0.5-0.7 for most requests) kept adaptive eagle3 at 4 closed-loop clients plain in
        76% of its choices, 10-15% below always-on; with the drafts' own value, at parity.  The
        head's raw probability as the break-even cut paths too early (nodes it gave 0.3-0.4 were
        accepted 48% of the time)."""
        for request in requests:
            self.view(request)  # a new request gets its acceptance estimate
        estimates = [self._acceptance[r.request_id] for r in requests]
        for estimate in estimates:
            estimate.prior = self._all_acceptance.rate
        caps = [max(0, min(limits[r.request_id])) for r in requests]
        rates, cost = [e.rate for e in estimates], self.step_costs.cost()
        # A request's choice is made on a drafting request's steady costs: what its drafter owes
        # from a plain stretch is paid once, by whichever step resumes drafting.  A probe, which
        # may be the only draft, must pay for it (worth_probing below).
        scores_paths = getattr(self.drafter, "scores_paths", False)
        if scores_paths:
            values = [self._values[r.request_id] for r in requests]
            for value in values:
                value.prior = self._all_values.per_draft
            drafting, throughput = choose_drafting(
                values=[v.per_draft for v in values], allowed=[cap > 0 for cap in caps], cost=cost
            )
            lengths = [1 if d else 0 for d in drafting]
        else:
            lengths = choose_draft_lengths(rates=rates, max_lengths=caps, cost=cost)
            throughput = step_throughput(rates=rates, lengths=lengths, cost=cost)
        depth_seconds = cost.draft_per_token * sum(1 for k in lengths if k > 0)
        # a path's probability, as the drafter gives it, from which its node is accepted often enough to pay
        path_floor = self._path_calibration.path_floor(min(0.99, throughput * (cost.per_token + depth_seconds)))
        chosen, path_probs = {}, {}
        probes_left = MAX_PROBES_PER_STEP  # a due request past them stays due for a later step
        for request, estimate, cap, k in zip(requests, estimates, caps, lengths):
            rid = request.request_id
            probes = self._probes[rid]
            probe = False
            if (
                k == 0
                and cap > 0
                and probes_left
                and probes.due
                and worth_probing(
                    cost=cost,
                    throughput=throughput,
                    max_length=cap,
                    catch_up_rows=catch_up_rows_of(self.drafter, self._views[rid]),
                )
            ):
                # fresh evidence for an estimate that may have fallen too low; from a drafter that
                # sizes its drafts, a draft as it sizes it (what DraftValue must learn)
                k = 1 if scores_paths else min(cap, PROBE_LENGTH)
                probes_left -= 1
                probe = True
            if k > 0 and scores_paths:
                chosen[rid], path_probs[rid] = (limits[rid][0], k), (limits[rid][1], path_floor)
            else:
                chosen[rid] = (k, k)
            request.metrics.record_draft_length_choice(k)
            probes.step(drafted=k > 0, probe=probe)
            if k == 0:
                estimate.idle()
                if scores_paths:
                    self._values[rid].idle()
        return chosen, path_probs

    def observe_step(
        self,
        *,
        num_requests: int,
        num_tokens: int,
        forward_seconds: float,
        decode_only: bool,
        num_decodes: int,
        num_drafted_requests: int,
        num_draft_tokens: int,
        draft_seconds: float,
    ) -> None:
        """A finished step's size and timings, for the cost model of adaptive speculation.

        The draft reserve hears steps of decodes alone, and steps of decodes beside prefill
        chunks where they drafted less than the reserve: there the decodes had at least the
        reserve's room (the scheduler held it back for them) and chose fewer nodes, while a
        count at the reserve or above may be one the room cut.  Under a stream of new requests
        most steps are mixed, and a fresh speculator's reserve (the bound) stayed there, holding
        back up to half of every step's prefill for drafts that never came (adaptive eagle3 in
        the serving benchmark at 16 clients: TTFT p50 1000 ms vs plain's 851, every step plain);
        counting every mixed step instead kept a reserve cut by the room from growing again."""
        if not self.config.adaptive:
            return  # nothing else reads the cost model
        drafted = num_draft_tokens / max(1, num_decodes)
        if num_decodes and (decode_only or drafted < self._drafted_per_decode):
            self._drafted_per_decode += DRAFT_RESERVE_RATE * (drafted - self._drafted_per_decode)
        self.step_costs.observe_step(
            num_drafted_requests=num_drafted_requests,
            num_draft_tokens=num_draft_tokens,
            draft_seconds=draft_seconds,
            num_catch_up_rows=self._step_catch_up_rows,
            forward=ForwardTiming(num_requests, num_tokens, forward_seconds) if decode_only else None,
        )
        self._step_catch_up_rows = 0

    def restore(self, request: Request, num_tokens: int, *, keys: list[bytes]) -> None:
        """The request's first `num_tokens` tokens (the blocks of `keys`) entered the target's
        cache without a forward (a prefix cache hit): a drafter that reads features gets the ones
        stored for those blocks (a hit covers no other block: `prefix_usable`)."""
        if not self.feature_layers:
            return
        restored = self.feature_blocks.restore(request.request_id, keys) if self.feature_blocks is not None else None
        if restored is None or restored.shape[0] != num_tokens:
            raise RuntimeError(
                f"request {request.request_id}: a prefix cache hit of {num_tokens} tokens whose drafter features "
                "are not held (prefix_usable should have refused it)"
            )
        self.drafter.observe(self.view(request), restored)

    # ---- commit -----------------------------------------------------------------------
    def commit(
        self,
        request: Request,
        *,
        features: torch.Tensor | None,  # [n, L * D] the n tokens' features, a tensor of their own (kept as is)
        block_keys: list[bytes] | None,  # the request's full blocks' prefix-cache keys (None: no prefix caching)
        proposal: Proposal | None,
        accepted: AcceptedPath | None,
    ) -> None:
        """The engine committed the request's step (cache, tokens, metrics): the drafter gets the
        new cached tokens' features, and, when the step verified a draft, what was accepted."""
        if features is not None:
            self.drafter.observe(self.view(request), features)
            if self.feature_blocks is not None and block_keys is not None:
                self.feature_blocks.add(request.request_id, features, block_keys)
        if proposal is None or accepted is None or proposal.num_draft_tokens == 0:
            return
        depths = proposal.tree.depths[1:]
        request.metrics.record_draft(depths=depths, num_accepted=accepted.num_accepted)
        request_id = request.request_id
        if self.config.adaptive:
            for estimate in (self._acceptance[request_id], self._all_acceptance):
                estimate.record(drafted_depth=max(depths), num_accepted=accepted.num_accepted)
            self._probes[request_id].result(num_accepted=accepted.num_accepted)
            if getattr(self.drafter, "scores_paths", False):
                for value in (self._values[request_id], self._all_values):
                    value.record(num_nodes=proposal.num_draft_tokens, num_accepted=accepted.num_accepted)
            if proposal.path_log_probs is not None and not request.is_finished:  # a stop cuts paths short
                on_path = set(accepted.nodes)
                for node, log_prob in enumerate(proposal.path_log_probs[1:], start=1):
                    self._path_calibration.record(path_prob=math.exp(log_prob), accepted=node in on_path)
        self._draft_length[request_id] = self.policy.next_length(
            self._draft_length[request_id], drafted=max(depths), accepted=accepted.num_accepted
        )
        if not request.is_finished:
            view = self._views[request_id]
            self._drafter_of(view).accept(view, accepted)
