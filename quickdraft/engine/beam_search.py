"""Beam search (vLLM's ``LLM.beam_search`` and the server's ``use_beam_search``).

Built, as vLLM builds it, on top of generation: each round expands every live beam by one token
through a request of ``max_tokens=1`` that returns the 2 * beam_width most likely next tokens
with their logprobs; the prefix cache lets a beam's request skip the blocks its prompt and
tokens share with the round before, so a round costs about one decode row per beam plus the
tokens of each beam's last, partly filled block.  Candidates are ranked by their summed logprob;
a candidate ending with an end-of-sequence token is set aside as finished; after max_tokens
rounds (or when no beam is left) the finished and the live beams are ranked by summed logprob /
generated length ** length_penalty, and the best beam_width are returned.

The search is a state machine (``BeamSearch``) that says which token sequences to expand and
takes their top logprobs back: ``LLM.beam_search`` drives it with ``generate``, the server with
its engine loop, the same rounds either way.  Speculative decoding has no part in it (each
request generates one token).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from quickdraft.outputs import Logprob
from quickdraft.sampling_params import DEFAULT_MAX_LOGPROBS, SamplingParams

# Each round asks for the 2 * beam_width most likely tokens of each beam (vLLM's), at most
# DEFAULT_MAX_LOGPROBS: a beam width of at most 10.
MAX_BEAM_WIDTH = DEFAULT_MAX_LOGPROBS // 2


@dataclass(kw_only=True)
class BeamSearchParams:
    beam_width: int = 1
    max_tokens: int = 16
    ignore_eos: bool = False
    # a finished beam's score is its summed logprob / (generated tokens ** length_penalty):
    # above 0 favours longer beams, 0 ranks by the summed logprob alone
    length_penalty: float = 1.0
    # vLLM's field, kept for its signature: beams are ranked by the model's logprobs, so only 0
    temperature: float = 0.0

    def __post_init__(self) -> None:
        for name, value, low, high in (
            ("beam_width", self.beam_width, 1, MAX_BEAM_WIDTH),
            ("max_tokens", self.max_tokens, 1, None),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < low or (high and value > high):
                bound = f"an int in [{low}, {high}]" if high else f"an int >= {low}"
                raise ValueError(f"{name} must be {bound}, got {value!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if isinstance(self.length_penalty, bool) or not isinstance(self.length_penalty, (int, float)):
            raise ValueError(f"length_penalty must be a number, got {self.length_penalty!r}")
        if not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be finite, got {self.length_penalty!r}")
        if self.temperature != 0.0:
            raise ValueError(
                f"temperature must be 0 for beam search (beams are ranked by the model's logprobs), "
                f"got {self.temperature!r}"
            )

    def round_params(self) -> SamplingParams:
        """What each beam's request of a round asks: one token and the top 2 * beam_width."""
        return SamplingParams(max_tokens=1, temperature=0.0, logprobs=2 * self.beam_width, ignore_eos=True)


@dataclass
class BeamSearchSequence:
    """One beam: vLLM's fields (``tokens`` and ``text`` include the prompt) and the generated part."""

    tokens: list[int]  # prompt + generated tokens
    cum_logprob: float  # summed logprob of the generated tokens
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)  # per generated token: the top candidates
    text: str = ""  # the tokens decoded (prompt included, as vLLM's)
    output_token_ids: list[int] = field(default_factory=list)
    output_text: str = ""
    finish_reason: str | None = None  # "stop" (ended with EOS) or "length"
    score: float = 0.0  # what the beams were ranked by at the end (length penalty applied)


@dataclass
class BeamSearchOutput:
    """The best beams of one prompt, best first (vLLM's shape)."""

    sequences: list[BeamSearchSequence]


@dataclass
class _Beam:
    output: list[int]
    cum_logprob: float
    logprobs: list[dict[int, Logprob]]


class BeamSearch:
    """The beams of several prompts, round by round."""

    def __init__(
        self,
        prompts: Sequence[list[int]],  # token ids
        params: BeamSearchParams,
        *,
        eos_token_ids: Sequence[int],
        max_model_len: int,
    ):
        self.prompts = [list(p) for p in prompts]
        self.params = params
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len
        self.live: list[list[_Beam]] = [[_Beam(output=[], cum_logprob=0.0, logprobs=[])] for _ in self.prompts]
        self.finished: list[list[tuple[_Beam, str]]] = [[] for _ in self.prompts]
        self.rounds = 0
        self._retire_full()

    @property
    def done(self) -> bool:
        return not any(self.live)

    def pending(self) -> list[list[int]]:
        """The token sequences (prompt + beam) to expand this round, prompt by prompt."""
        return [self.prompts[i] + beam.output for i, beams in enumerate(self.live) for beam in beams]

    def advance(self, tops: Sequence[Sequence[Logprob]]) -> None:
        """The top next tokens of each pending sequence, in pending()'s order."""
        if len(tops) != sum(len(beams) for beams in self.live):
            raise ValueError(f"{len(tops)} results for {sum(len(b) for b in self.live)} beams")
        width, position = self.params.beam_width, 0
        for i, beams in enumerate(self.live):
            candidates: list[_Beam] = []
            for beam in beams:
                top = tops[position]
                position += 1
                row = {entry.token_id: entry for entry in top}
                for entry in top:
                    grown = _Beam(
                        output=[*beam.output, entry.token_id],
                        cum_logprob=beam.cum_logprob + entry.logprob,
                        logprobs=[*beam.logprobs, row],
                    )
                    if entry.token_id in self.eos_token_ids and not self.params.ignore_eos:
                        self.finished[i].append((grown, "stop"))
                    else:
                        candidates.append(grown)
            # ties keep the earlier candidate (the stable sort): the better beam's, the likelier token
            candidates.sort(key=lambda b: b.cum_logprob, reverse=True)
            self.live[i] = candidates[:width]
        self.rounds += 1
        if self.rounds >= self.params.max_tokens:
            for i, beams in enumerate(self.live):
                self.finished[i] += [(beam, "length") for beam in beams]
                self.live[i] = []
        self._retire_full()

    def _retire_full(self) -> None:
        """Beams the context has no room left for end here ("length")."""
        for i, beams in enumerate(self.live):
            fits = [len(self.prompts[i]) + len(beam.output) < self.max_model_len for beam in beams]
            self.finished[i] += [(beam, "length") for beam, fit in zip(beams, fits) if not fit]
            self.live[i] = [beam for beam, fit in zip(beams, fits) if fit]

    def results(self, *, decode) -> list[BeamSearchOutput]:
        """The best beam_width beams of each prompt, best first; `decode(token_ids) -> str`."""
        outputs = []
        for prompt, finished in zip(self.prompts, self.finished):
            scored = [(self._score(beam, reason), beam, reason) for beam, reason in finished]
            ranked = sorted(scored, key=lambda item: item[0], reverse=True)  # stable: ties keep their order
            sequences = [
                BeamSearchSequence(
                    tokens=prompt + beam.output,
                    cum_logprob=beam.cum_logprob,
                    logprobs=beam.logprobs,
                    text=decode(prompt + beam.output),
                    output_token_ids=list(beam.output),
                    output_text=decode(beam.output),
                    finish_reason=reason,
                    score=score,
                )
                for score, beam, reason in ranked[: self.params.beam_width]
            ]
            outputs.append(BeamSearchOutput(sequences=sequences))
        return outputs

    def _score(self, beam: _Beam, reason: str) -> float:
        # a beam that stopped ended with its end-of-sequence token, which is not length (vLLM's)
        length = max(1, len(beam.output) - (reason == "stop"))
        return beam.cum_logprob / length**self.params.length_penalty
