"""What generate() returns: vLLM-shaped RequestOutput / CompletionOutput plus metrics."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    token_id: int
    logprob: float
    decoded: str | None = None


@dataclass
class TokenLogprobs:
    """The chosen token's logprob and the top-N alternatives, for one generated token."""

    token_id: int
    logprob: float
    top: list[Logprob] = field(default_factory=list)
    # the token's rank in its row (1: the most likely), for prompt logprobs (vLLM's field)
    rank: int | None = None


class AcceptanceFigures:
    """Derived figures shared by per-request and engine-wide metrics."""

    num_generation_tokens: int
    num_target_forwards: int
    num_draft_tokens: int
    num_accepted_tokens: int

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted draft tokens / drafted tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def acceptance_length(self) -> float | None:
        """Tokens committed per target forward, bonus included (1.0 for plain decoding)."""
        return self.num_generation_tokens / self.num_target_forwards if self.num_target_forwards else None


@dataclass
class RequestMetrics(AcceptanceFigures):
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (not computed)
    num_generation_tokens: int = 0
    num_preemptions: int = 0  # times its blocks were taken back for older requests (it recomputed)
    # Speculation (zero for plain decoding). A target forward that commits tokens for this
    # request counts once, the prefill that yields the first token included.
    num_target_forwards: int = 0
    num_drafts: int = 0  # forwards that verified a proposal
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [k]: accepted at draft depth k+1
    drafted_per_position: list[int] = field(default_factory=list)  # [k]: drafts reaching depth k+1
    draft_seconds: float = 0.0  # time of the drafting phases of the steps this request was in
    verify_seconds: float = 0.0  # time of the verifying forwards (and rejection) it was in
    # Adaptive speculation: [k] = decoding steps for which it chose to draft k tokens (0: plain)
    draft_length_choices: list[int] = field(default_factory=list)

    def record_draft_length_choice(self, length: int) -> None:
        self.draft_length_choices.extend([0] * (length + 1 - len(self.draft_length_choices)))
        self.draft_length_choices[length] += 1

    def record_draft(self, *, depths: list[int], num_accepted: int) -> None:
        """One verified proposal: `depths` = depth of every draft node, num_accepted on the path."""
        self.num_drafts += 1
        self.num_draft_tokens += len(depths)
        self.num_accepted_tokens += num_accepted
        max_depth = max(depths, default=0)
        for counts, upto in ((self.drafted_per_position, max_depth), (self.accepted_per_position, num_accepted)):
            counts.extend([0] * (max_depth - len(counts)))
            for position in range(upto):
                counts[position] += 1

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first generated token."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        """Seconds from arrival to the end of the request."""
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean seconds per output token after the first one."""
        if self.finished_time is None or self.first_token_time is None:
            return None
        if self.num_generation_tokens < 2:
            return 0.0
        return (self.finished_time - self.first_token_time) / (self.num_generation_tokens - 1)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    seed: int | None = None  # the sampling seed used (drawn by the engine when the request had none)
    # SamplingParams.prompt_logprobs: per prompt token, None for the first (nothing precedes it)
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclass
class StreamDelta:
    """What one engine step added to a request, for streaming."""

    request_id: str
    text: str  # new text (stop strings withheld until they are ruled out)
    token_ids: list[int]  # new tokens
    finished: bool
    finish_reason: str | None = None
    output: RequestOutput | None = None  # the full output, on the last delta
    index: int = 0  # the completion it belongs to (LLM.stream of n > 1 completions)


@dataclass
class EngineMetrics(AcceptanceFigures):
    """Aggregate over every request the engine finished (or aborted) in its life."""

    num_requests: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    num_generation_tokens: int = 0
    num_preemptions: int = 0  # a full KV cache took a request's blocks back (it recomputed)
    num_target_forwards: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    draft_length_choices: list[int] = field(default_factory=list)  # adaptive speculation's, summed
    draft_seconds: float = 0.0  # wall time of drafting phases, counted once per step
    verify_seconds: float = 0.0  # wall time of target forwards + rejection, once per step
    # Rows the target's LM head computed whole for verification (lazy_logits_rows leaves some out;
    # rows of a few allowed tokens are not counted: they are a few dot products each)
    num_logits_rows: int = 0
    ttft_sum: float = 0.0
    tpot_sum: float = 0.0
    e2e_sum: float = 0.0

    def add(self, m: RequestMetrics) -> None:
        self.num_requests += 1
        self.num_prompt_tokens += m.num_prompt_tokens
        self.num_cached_tokens += m.num_cached_tokens
        self.num_generation_tokens += m.num_generation_tokens
        self.num_preemptions += m.num_preemptions
        self.num_target_forwards += m.num_target_forwards
        self.num_drafts += m.num_drafts
        self.num_draft_tokens += m.num_draft_tokens
        self.num_accepted_tokens += m.num_accepted_tokens
        for mine, theirs in (
            (self.accepted_per_position, m.accepted_per_position),
            (self.drafted_per_position, m.drafted_per_position),
            (self.draft_length_choices, m.draft_length_choices),
        ):
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, count in enumerate(theirs):
                mine[i] += count
        self.ttft_sum += m.ttft or 0.0
        self.tpot_sum += m.tpot or 0.0
        self.e2e_sum += m.e2e or 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Share of prompt tokens whose KV the prefix cache supplied."""
        return self.num_cached_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        """Share of drafts reaching depth k+1 whose path accepted a token there."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    def mean(self, total: float) -> float | None:
        return total / self.num_requests if self.num_requests else None
