"""Adaptive speculation: each step, how many tokens to draft for each request (0 = decode plainly).

The choice maximises the expected tokens the whole step commits per second:

    tokens_r(k)  = 1 + a_r + a_r^2 + ... + a_r^k      a chain whose tokens are each accepted with
                                                      probability a_r (the request's recent acceptance)
    step seconds = fixed + per_request * #requests + per_token * sum_r (1 + k_r)
                 + draft_per_request * #{r: k_r > 0} + draft_per_token * sum_r k_r

with the cost coefficients fitted online from the engine's own step timings (none below a
tenth of its prior's share; the rows a drafter feeds to catch up on what a request committed
since it last drafted are fitted apart and charged to probes alone), and a_r from the
request's own drafts, starting from (and drifting back to, while it does not draft) the
acceptance of all requests' drafts so far.  A request that has decoded plainly for
`probe_every` steps drafts a short probe, so an estimate that fell too low can recover, but
only where drafts accepted at PROBE_RATE would pay in that step (a probe of a drafter too
costly for the batch is pure loss), and less often after probes that were rejected outright.  A busy batch
makes every verified token cost a larger share of the step, so drafts shrink (down to 0 for a
request whose drafts are rarely accepted); an idle engine with a well-predicted request drafts
long.  The ratio is maximised with Dinkelbach iterations: for a throughput guess L each
request's best k maximises tokens_r(k) - L * seconds_r(k) on its own, and L is then the
throughput of those choices, until it stops improving.

A drafter that scores its paths (eagle3, `[self]`) sizes its own drafts: there the choice is
whether a request drafts at all, from what its drafts brought lately (DraftValue, choose_drafting),
and its paths grow while their probability, calibrated online (PathCalibration), pays.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class AcceptanceEstimate:
    """A request's per-token draft acceptance: accepted tokens / (accepted + rejections), over
    exponentially decayed counts, starting from a prior worth `prior_weight` drafts."""

    prior: float
    prior_weight: float = 2.0
    decay: float = 0.85  # per draft: about the last seven drafts count
    idle_decay: float = 0.97  # per step without a draft: drift back to the prior, so it is tried again
    accepted: float = 0.0
    rejected: float = 0.0

    @property
    def rate(self) -> float:
        accepted = self.accepted + self.prior * self.prior_weight
        return accepted / (self.accepted + self.rejected + self.prior_weight)

    def record(self, *, drafted_depth: int, num_accepted: int) -> None:
        self.accepted = self.decay * self.accepted + num_accepted
        self.rejected = self.decay * self.rejected + (1.0 if num_accepted < drafted_depth else 0.0)

    def idle(self) -> None:
        self.accepted *= self.idle_decay
        self.rejected *= self.idle_decay


@dataclass
class DraftValue:
    """What a request's drafts brought lately, for a drafter that sizes its own drafts (one that
    scores its paths: it stops where its path probability falls below a floor): accepted tokens
    and verified draft nodes per draft, exponentially decayed means starting from (and drifting
    back to, while it does not draft) `prior`, all requests' figures, worth `prior_weight` drafts."""

    prior: tuple[float, float]  # (accepted tokens, verified nodes) per draft
    prior_weight: float = 2.0
    decay: float = 0.85  # per draft: about the last seven drafts count
    idle_decay: float = 0.97  # per step without a draft
    drafts: float = 0.0
    accepted: float = 0.0
    nodes: float = 0.0

    @property
    def per_draft(self) -> tuple[float, float]:
        """(accepted tokens, verified draft nodes) a draft is expected to bring."""
        weight = self.drafts + self.prior_weight
        return (
            (self.accepted + self.prior[0] * self.prior_weight) / weight,
            (self.nodes + self.prior[1] * self.prior_weight) / weight,
        )

    def record(self, *, num_nodes: int, num_accepted: int) -> None:
        self.drafts = self.decay * self.drafts + 1.0
        self.accepted = self.decay * self.accepted + num_accepted
        self.nodes = self.decay * self.nodes + num_nodes

    def idle(self) -> None:
        self.drafts *= self.idle_decay
        self.accepted *= self.idle_decay
        self.nodes *= self.idle_decay


def choose_drafting(
    *, values: list[tuple[float, float]], allowed: list[bool], cost: StepCost, iterations: int = 8
) -> tuple[list[bool], float]:
    """Which requests draft this step, for a drafter that sizes its own drafts: request r's draft
    brings values[r] = (accepted tokens, verified draft nodes); the set maximising expected
    committed tokens per second (Dinkelbach iterations, as choose_draft_lengths), and that
    throughput."""
    drafting = [False] * len(values)

    def throughput(chosen: list[bool]) -> float:
        tokens = len(values) + sum(a for (a, _), d in zip(values, chosen) if d)
        seconds = cost.seconds([n if d else 0.0 for (_, n), d in zip(values, chosen)])  # a draft: n nodes
        return tokens / seconds if seconds > 0 else float("inf")

    best = throughput(drafting)
    for _ in range(iterations):
        proposal = [
            ok and a - best * ((cost.per_token + cost.draft_per_token) * n + cost.draft_per_request) > 0
            for (a, n), ok in zip(values, allowed)
        ]
        value = throughput(proposal)
        if value <= best * (1 + 1e-9):
            break
        drafting, best = proposal, value
    return drafting, best


@dataclass
class PathCalibration:
    """How often a drafted node is accepted, by the probability the drafter gave its path: decayed
    counts in `num_bins` equal bins of that probability, each starting from the drafter's own
    word (a path of probability p accepted p of the time) worth `prior_weight` nodes.

    Measured on eagle3's shipped head (chains, greedy, 4 closed-loop clients): nodes it gave a
    conditional probability of 0.2-0.3 were accepted 37% of the time, 0.3-0.4 48%, 0.6-0.7 76%,
    0.7-0.8 87%: an underconfident head, whose paths adaptive speculation cut where they still
    paid when it read their probability as their acceptance."""

    num_bins: int = 10
    prior_weight: float = 8.0
    decay: float = 0.999  # per node recorded: about the last thousand count
    nodes: list[float] = field(init=False)
    accepted: list[float] = field(init=False)

    def __post_init__(self) -> None:
        self.nodes = [0.0] * self.num_bins
        self.accepted = [0.0] * self.num_bins

    def record(self, *, path_prob: float, accepted: bool) -> None:
        b = self._bin(path_prob)
        self.nodes = [n * self.decay for n in self.nodes]
        self.accepted = [a * self.decay for a in self.accepted]
        self.nodes[b] += 1.0
        self.accepted[b] += 1.0 if accepted else 0.0

    def acceptance(self, b: int) -> float:
        """Bin b's acceptance rate."""
        center = (b + 0.5) / self.num_bins
        return (self.accepted[b] + self.prior_weight * center) / (self.nodes[b] + self.prior_weight)

    def path_floor(self, break_even: float) -> float:
        """The lowest path probability from which every bin up is accepted at least `break_even`
        of the time: a node below it does not pay.  Where not even the top bin's average does,
        the drafter's word within it (paths near 1 are accepted near always)."""
        floor = max(break_even, (self.num_bins - 1) / self.num_bins)
        for b in range(self.num_bins - 1, -1, -1):
            if self.acceptance(b) < break_even:
                break
            floor = b / self.num_bins
        return floor

    def _bin(self, path_prob: float) -> int:
        return min(self.num_bins - 1, max(0, int(path_prob * self.num_bins)))


@dataclass
class _DecayedFit:
    """Least squares y = c . x over exponentially decayed sums, pulled gently towards a prior
    direction: where the observations cannot tell two coefficients apart (every plain step
    verifies one token per request, so a per-request and a per-token cost move together),
    their split is the prior's and only their level is fitted."""

    decay: float
    num_features: int
    floor: float = 0.1  # no coefficient below this share of the prior's at the data's level
    sxx: list[list[float]] = field(init=False)
    sxy: list[float] = field(init=False)
    weight: float = 0.0

    def __post_init__(self) -> None:
        self.sxx = [[0.0] * self.num_features for _ in range(self.num_features)]
        self.sxy = [0.0] * self.num_features

    def add(self, x: tuple[float, ...], y: float) -> None:
        self.age()
        for i in range(self.num_features):
            self.sxy[i] += x[i] * y
            for j in range(self.num_features):
                self.sxx[i][j] += x[i] * x[j]
        self.weight += 1.0

    def age(self) -> None:
        """A step's decay of the data so far (alone: a step without an observation, which leaves
        the fit itself unchanged)."""
        for i in range(self.num_features):
            self.sxy[i] *= self.decay
            for j in range(self.num_features):
                self.sxx[i][j] *= self.decay
        self.weight *= self.decay

    def solve(self, *, prior: tuple[float, ...], ridge: float = 1e-3) -> tuple[float, ...] | None:
        """Coefficients (all >= 0), or None before any data."""
        if self.weight == 0.0:
            return None
        n = self.num_features
        prior_x = [sum(prior[i] * self.sxx[i][k] for i in range(n)) for k in range(n)]
        denominator = sum(prior[k] * prior_x[k] for k in range(n))
        if denominator <= 0.0:
            return None
        level = max(0.0, sum(prior[i] * self.sxy[i] for i in range(n)) / denominator)
        anchor = [p * level for p in prior]  # the prior's direction at the data's level
        strength = [ridge * self.sxx[i][i] for i in range(n)]  # scaled per feature: unit-free
        matrix = [[self.sxx[i][j] + (strength[i] if i == j else 0.0) for j in range(n)] for i in range(n)]
        rhs = [self.sxy[i] + strength[i] * anchor[i] for i in range(n)]
        return tuple(_bounded_least_squares(matrix, rhs, floor=[self.floor * a for a in anchor]))


def _bounded_least_squares(matrix: list[list[float]], rhs: list[float], *, floor: list[float]) -> list[float]:
    """argmin over c >= floor of c.M.c - 2 rhs.c (M positive definite): the best of the
    solutions with each subset of coefficients held at its floor and the rest solved freely,
    among those that respect the floors (a handful of features: every face is tried)."""
    n = len(rhs)
    free_solution = _solve_linear(matrix, rhs)
    if free_solution is not None and all(c >= f for c, f in zip(free_solution, floor)):
        return free_solution  # the usual case, and then the bounded answer too (the problem is convex)
    best, best_value = list(floor), _quadratic(matrix, rhs, floor)  # every coefficient at its floor
    for held in itertools.product((False, True), repeat=n):
        free = [i for i in range(n) if not held[i]]
        if not free or len(free) == n:  # every coefficient held: the start; none: infeasible above
            continue
        sub = [[matrix[i][j] for j in free] for i in free]
        sub_rhs = [rhs[i] - sum(matrix[i][j] * floor[j] for j in range(n) if held[j]) for i in free]
        part = _solve_linear(sub, sub_rhs)
        if part is None or any(value < floor[i] for value, i in zip(part, free)):
            continue
        candidate = list(floor)
        for value, i in zip(part, free):
            candidate[i] = value
        value = _quadratic(matrix, rhs, candidate)
        if value < best_value:
            best, best_value = candidate, value
    return best


def _quadratic(matrix: list[list[float]], rhs: list[float], c: list[float]) -> float:
    """c.M.c - 2 rhs.c: least squares' objective up to a constant."""
    n = len(rhs)
    quadratic = sum(c[i] * matrix[i][j] * c[j] for i in range(n) for j in range(n))
    return quadratic - 2.0 * sum(rhs[i] * c[i] for i in range(n))


def _solve_linear(matrix: list[list[float]], rhs: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None for a singular system."""
    n = len(rhs)
    rows = [list(matrix[i]) + [rhs[i]] for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(rows[r][col]))
        if abs(rows[pivot][col]) < 1e-300:
            return None
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for r in range(col + 1, n):
            factor = rows[r][col] / rows[col][col]
            for c in range(col, n + 1):
                rows[r][c] -= factor * rows[col][c]
    solution = [0.0] * n
    for r in range(n - 1, -1, -1):
        solution[r] = (rows[r][n] - sum(rows[r][c] * solution[c] for c in range(r + 1, n))) / rows[r][r]
    return solution


@dataclass
class StepCost:
    """Seconds of a step: the target forward (fixed + per request + per verified token) and the
    drafting phase (per drafting request + per drafted token; and per row a drafting request's
    drafter feeds to catch up on what it committed since it last drafted, which only a probe is
    charged: see Speculator._adaptive_limits)."""

    fixed: float
    per_request: float
    per_token: float
    draft_per_request: float
    draft_per_token: float
    draft_per_catch_up_row: float = 0.0

    def seconds(self, lengths: Sequence[float]) -> float:
        """lengths: per request the draft nodes it verifies (0: none; a mean where expected)."""
        drafting = [k for k in lengths if k]
        return (
            self.fixed
            + self.per_request * len(lengths)
            + self.per_token * sum(1 + k for k in lengths)
            + self.draft_per_request * len(drafting)
            + self.draft_per_token * sum(drafting)
        )

    def draft_start(self, catch_up_rows: int) -> float:
        """Seconds a request's drafting costs before its first draft token, owing `catch_up_rows`."""
        return self.draft_per_request + self.draft_per_catch_up_row * catch_up_rows


@dataclass(frozen=True)
class ForwardTiming:
    """A forward over decode/verify rows only."""

    num_requests: int
    num_tokens: int  # rows: committed tokens' and drafted ones'
    seconds: float


@dataclass
class StepCostModel:
    """The StepCost fitted online from the engine's step timings.

    The priors only set ratios until the data separates the coefficients (the choice of draft
    lengths depends on ratios, not on the unit): a request and a verified token each cost 5% of
    a step's fixed part, a drafted token 1%.

    The drafting fit is what decides whether drafts are tried at all, so it must not lock a
    wrong answer in.  A drafter's first call costs what later ones do not (its caches allocated,
    its memory first touched: 20 ms for eagle3's first draft of one token on the 2-core machine,
    ~1 ms after); fed to the fit, that one observation priced every drafted token at 20 ms, no
    draft or probe paid again, and no later observation could correct it (adaptive eagle3
    decoded plainly in 88% of its steps at 4 clients, where always-on was 1.17x plain).  So the
    first `warmup_drafts` drafting steps are not fed, and a fit whose data has aged away (no
    drafting for a few hundred steps) gives way to the prior again, so that a probe can measure
    it afresh.
    """

    decay: float = 0.98
    prior_forward: tuple[float, float, float] = (1.0, 0.05, 0.05)  # fixed, per request, per verified token
    # per drafting request, per drafted token, per row a drafting request's drafter feeds to catch up
    prior_draft: tuple[float, float, float] = (0.0, 0.01, 0.01)
    warmup_drafts: int = 1  # drafting steps not fed to the fit (the drafter's first calls)
    min_weight: float = 0.05  # the fit's decayed count of observations below which the prior is used
    _forward: _DecayedFit = field(init=False)
    _draft: _DecayedFit = field(init=False)
    _drafts_seen: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self._forward = _DecayedFit(self.decay, num_features=3)
        self._draft = _DecayedFit(self.decay, num_features=3)

    def observe_step(
        self,
        *,
        num_drafted_requests: int = 0,
        num_draft_tokens: int = 0,
        draft_seconds: float = 0.0,
        num_catch_up_rows: int = 0,
        forward: ForwardTiming | None = None,
    ) -> None:
        """One step: its drafting phase (every step: one without drafts ages the drafting fit's
        data) and its forward (None where the step carried prompt chunks: not fed).

        Rows a drafter fed to catch up on what its requests committed since they last drafted (a
        head's features: a whole prompt at a request's first draft) are a regressor of their
        own: fitted as a cost per drafting request, a request's first draft after its prompt
        priced every request's draft at several ms.

        Neither half of a warm-up drafting step is fed: its forward pays first-call costs too
        (46-52 ms for the first 5-row verification of a fresh eagle3 speculator in the server,
        ~11 after), and at one request, where every plain step is one row wide, the only wide
        forward sets the cost of a verified token alone: 3.5 ms instead of ~0.6, so neither a
        draft nor a probe paid again and the request decoded plainly to its end."""
        warm_up = False
        if num_drafted_requests == 0:
            self._draft.age()
        else:
            self._drafts_seen += 1
            warm_up = self._drafts_seen <= self.warmup_drafts
            if not warm_up:
                features = (float(num_drafted_requests), float(num_draft_tokens), float(num_catch_up_rows))
                self._draft.add(features, draft_seconds)
        if forward is not None and not warm_up:
            self._forward.add((1.0, float(forward.num_requests), float(forward.num_tokens)), forward.seconds)

    def cost(self) -> StepCost:
        forward = self._forward.solve(prior=self.prior_forward) or self.prior_forward
        one_token_step = sum(forward)  # the prior draft costs are shares of it
        fitted = self._draft.solve(prior=self.prior_draft) if self._draft.weight >= self.min_weight else None
        draft = fitted or tuple(p * one_token_step for p in self.prior_draft)
        return StepCost(*forward, *draft)


def expected_tokens(rate: float, depth: int) -> float:
    """Tokens a step commits for a chain of `depth` draft tokens each accepted with `rate`."""
    if rate >= 1.0:
        return depth + 1.0
    return (1.0 - rate ** (depth + 1)) / (1.0 - rate)


PROBE_RATE = 0.9  # the acceptance a probe hopes to find: a probe is drafted only where it would pay
PROBE_LENGTH = 2  # draft tokens of a probe
# Requests that probe in one step.  Requests fall due together (a batch that stopped drafting),
# and a probe of a head that reads features first feeds the request's pending features (up to
# its catch-up window): 22 of 32 requests probing at once took a 113 ms drafting phase beside a
# 60 ms step.  Two at a time measure the same acceptance and drafting cost for a tenth of that.
MAX_PROBES_PER_STEP = 2


@dataclass
class ProbeSchedule:
    """When a request that decodes plainly drafts a probe: after `every` plain steps, doubled
    (up to 8x) for each probe in a row that had no token accepted.

    Only probes back off: a request's own drafts that miss are what its estimate already
    weighs.  Counting them too, a request whose answer began with a few drafts that missed (a qa
    answer's opening words) waited 64 plain steps for its first probe, and decoded half of its
    128 tokens plainly where its drafts, once tried, brought 6-8 tokens each."""

    every: int
    plain_steps: int = 0
    misses: int = 0
    probing: bool = False  # this step's draft is a probe

    @property
    def due(self) -> bool:
        return self.plain_steps >= self.every << min(self.misses, 3)

    def step(self, *, drafted: bool, probe: bool = False) -> None:
        self.plain_steps = 0 if drafted else self.plain_steps + 1
        self.probing = drafted and probe

    def result(self, *, num_accepted: int) -> None:
        if num_accepted:
            self.misses = 0
        elif self.probing:
            self.misses += 1


def worth_probing(*, cost: StepCost, throughput: float, max_length: int, catch_up_rows: int = 0) -> bool:
    """Whether a request's drafts, if accepted at PROBE_RATE, would pay in a step of `throughput`
    (its drafter's catch-up included: after a long plain stretch, most of what a probe costs)."""
    per_token = cost.per_token + cost.draft_per_token
    return _best_length(PROBE_RATE, max_length, throughput, per_token, cost.draft_start(catch_up_rows)) > 0


def step_throughput(*, rates: list[float], lengths: list[int], cost: StepCost) -> float:
    """Expected committed tokens per second of a step with these draft lengths."""
    seconds = cost.seconds(lengths)
    tokens = sum(expected_tokens(a, k) for a, k in zip(rates, lengths))
    return tokens / seconds if seconds > 0 else float("inf")


def choose_draft_lengths(
    *, rates: list[float], max_lengths: list[int], cost: StepCost, iterations: int = 8
) -> list[int]:
    """Draft lengths (0..max_lengths[r]) maximising expected committed tokens per second."""
    lengths = [0] * len(rates)
    best = step_throughput(rates=rates, lengths=lengths, cost=cost)
    for _ in range(iterations):
        proposal = [
            _best_length(rate, limit, best, cost.per_token + cost.draft_per_token, cost.draft_per_request)
            for rate, limit in zip(rates, max_lengths)
        ]
        value = step_throughput(rates=rates, lengths=proposal, cost=cost)
        if value <= best * (1 + 1e-9):
            break
        lengths, best = proposal, value
    return lengths


def _best_length(rate: float, limit: int, throughput: float, per_token: float, per_request: float) -> int:
    """argmax over k of tokens(k) - throughput * extra seconds(k), for one request.  Past k = 1 a
    token adds rate^k tokens for a fixed cost, so once that no longer pays no longer k does (run
    for every request of every step: most of adaptive's per-step work in a busy batch)."""
    best_k, best_gain = 0, 0.0
    token_cost = throughput * per_token
    drafted, power = 0.0, 1.0  # expected_tokens(rate, k) - 1 and rate^k, built up with k
    for k in range(1, limit + 1):
        power = power * rate if rate < 1.0 else 1.0
        if k > 1 and power <= token_cost:
            break
        drafted += power
        gain = drafted - token_cost * k - throughput * per_request
        if gain > best_gain:
            best_k, best_gain = k, gain
    return best_k
