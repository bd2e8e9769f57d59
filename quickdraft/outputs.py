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


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0

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


@dataclass
class StreamDelta:
    """What one engine step added to a request, for streaming."""

    request_id: str
    text: str  # new text (stop strings withheld until they are ruled out)
    token_ids: list[int]  # new tokens
    finished: bool
    finish_reason: str | None = None
    output: RequestOutput | None = None  # the full output, on the last delta
