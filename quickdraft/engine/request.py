"""A request's state inside the engine: tokens, cache slot, text, stop checks, metrics."""

from __future__ import annotations

import enum
import time

import torch

from quickdraft.models.lora import LoRAWeights
from quickdraft.models.tokenizer import IncrementalDetokenizer, Tokenizer
from quickdraft.outputs import (
    CompletionOutput,
    Logprob,
    RequestMetrics,
    RequestOutput,
    TokenLogprobs,
)
from quickdraft.sampling_params import SamplingParams
from quickdraft.structured.grammar import RequestGrammar


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    def __init__(
        self,
        *,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer: Tokenizer,
        eos_token_ids: list[int],
        max_model_len: int,
        seed: int,
        generator: torch.Generator | None,
        arrival_time: float | None = None,
        grammar: RequestGrammar | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora: LoRAWeights | None = None,
    ):
        self.request_id = request_id
        self.priority = priority  # lower first, under the "priority" scheduling policy
        self.cache_salt = cache_salt  # prefix-cache blocks are shared only under the same salt
        self.lora = lora  # the LoRA adapter the target runs for this request
        # What its prefix-cache blocks are keyed by beside their tokens: the salt and the adapter
        # (KV computed under one adapter is not another's).
        self.prefix_salt = cache_salt if lora is None else f"{cache_salt or ''}\0lora\0{lora.key}"
        self.queue_key: tuple[int, int] = (0, 0)  # (priority, arrival), set by the scheduler
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.output_token_ids: list[int] = []
        # Output position t draws its randomness from (seed, t) alone (sampler.position_key).
        self.seed = seed
        # The rejection rule of sampled drafts (draft_probs) draws from a stream of its own.
        self.generator = generator
        self.grammar = grammar  # structured outputs: the grammar state at the committed tokens
        self.status = RequestStatus.WAITING
        self.slot: int | None = None
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.num_skipped_tokens = 0  # of them, taken from the prefix cache at admission (drafters skip them)
        self.finish_reason: str | None = None
        self.error: Exception | None = None  # why a request finished with reason "error"
        self.stop_reason: str | int | None = None
        self.logprobs: list[TokenLogprobs] | None = [] if params.logprobs is not None else None
        # [P]: entry p the logprob of prompt token p given those before it (None for the first,
        # and until its row is computed); None when not asked for
        self.prompt_logprobs: list[TokenLogprobs | None] | None = (
            [None] * len(self.prompt_token_ids) if params.prompt_logprobs is not None else None
        )
        self.cumulative_logprob = 0.0
        self.metrics = RequestMetrics(
            arrival_time=arrival_time or time.perf_counter(), num_prompt_tokens=len(prompt_token_ids)
        )
        self._stop_token_ids = set(params.stop_token_ids or [])
        self._eos_token_ids = set() if params.ignore_eos else set(eos_token_ids)
        self._max_output = min(
            params.max_tokens if params.max_tokens is not None else max_model_len,
            max_model_len - len(prompt_token_ids),
        )
        self._detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=params.skip_special_tokens)
        self._tokenizer = tokenizer
        self.text = ""  # output text, cut at a stop string
        self._streamed_chars = 0
        self._streamed_tokens = 0

    # ---- token bookkeeping ------------------------------------------------------------
    @property
    def scheduled_slot(self) -> int:
        """The cache slot of a scheduled request (the scheduler gives one before any forward)."""
        if self.slot is None:
            raise RuntimeError(f"request {self.request_id} holds no cache slot")
        return self.slot

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def last_token_id(self) -> int:
        """The newest known token (without building all_token_ids)."""
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def remaining_output_tokens(self) -> int:
        return self._max_output - len(self.output_token_ids)

    @property
    def needs_prompt_rows(self) -> bool:
        """Whether its prompt's logprobs are still to compute (so no prompt block may come from
        the prefix cache: a cached block has no logits)."""
        return self.prompt_logprobs is not None and any(entry is None for entry in self.prompt_logprobs[1:])

    def append_token(self, token_id: int, *, now: float, logprobs: TokenLogprobs | None = None) -> bool:
        """Commit one generated token; returns True when the request is finished by it."""
        self.output_token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept_token(token_id)
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = now
        self.metrics.num_generation_tokens = len(self.output_token_ids)
        if logprobs is not None and self.logprobs is not None:
            self.logprobs.append(logprobs)
            self.cumulative_logprob += logprobs.logprob
        return self._check_stop(token_id)

    def _check_stop(self, token_id: int) -> bool:
        min_tokens_met = len(self.output_token_ids) >= self.params.min_tokens
        if min_tokens_met and token_id in self._eos_token_ids:
            return self._finish_text("stop", stop_reason=None, drop_token_text=True)
        if min_tokens_met and token_id in self._stop_token_ids:
            return self._finish_text("stop", stop_reason=token_id, drop_token_text=True)
        new_text = self._detokenizer.add(token_id) if self.params.detokenize else ""
        if new_text:
            self.text += new_text
            if min_tokens_met and self._cut_at_stop_string(len(new_text)):
                return True
        if self.remaining_output_tokens <= 0:
            return self._finish_text("length", stop_reason=None, drop_token_text=False)
        return False

    def _cut_at_stop_string(self, num_new_chars: int) -> bool:
        stops = self.params.stop
        if not stops:
            return False
        longest = max(len(s) for s in stops)
        search_from = max(0, len(self.text) - num_new_chars - longest + 1)
        best = None
        for stop in stops:
            at = self.text.find(stop, search_from)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return False
        at, stop = best
        self.text = self.text[: at + len(stop)] if self.params.include_stop_str_in_output else self.text[:at]
        self.finish(reason="stop", stop_reason=stop)
        return True

    def _finish_text(self, reason: str, *, stop_reason, drop_token_text: bool) -> bool:
        if not drop_token_text and self.params.detokenize:
            self.text += self._detokenizer.flush()
            if self._cut_at_stop_string(0):
                return True
        self.finish(reason=reason, stop_reason=stop_reason)
        return True

    def finish(self, *, reason: str, stop_reason: str | int | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.metrics.finished_time = time.perf_counter()

    # ---- outputs ----------------------------------------------------------------------
    def take_stream_delta(self) -> tuple[str, list[int]]:
        """New text and tokens since the last call.

        While running, the last (longest stop string - 1) characters are held back: they
        could still become the start of a stop string that must not be shown.
        """
        visible = len(self.text)
        if not self.is_finished and self.params.stop:
            visible = max(self._streamed_chars, visible - (max(len(s) for s in self.params.stop) - 1))
        text = self.text[self._streamed_chars : visible]
        tokens = self.output_token_ids[self._streamed_tokens :]
        self._streamed_chars = visible
        self._streamed_tokens = len(self.output_token_ids)
        return text, tokens

    def to_output(self) -> RequestOutput:
        completion = CompletionOutput(
            index=0,
            text=self.text,
            token_ids=list(self.output_token_ids),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=self.logprobs,
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
        )
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=list(self.prompt_token_ids),
            outputs=[completion],
            finished=self.is_finished,
            metrics=self.metrics,
            seed=self.seed,
            prompt_logprobs=None if self.prompt_logprobs is None else list(self.prompt_logprobs),
        )


def make_token_logprobs(
    *,
    token_id: int,
    logprob: float,
    top_ids: list[int],
    top_logprobs: list[float],
    tokenizer: Tokenizer,
    rank: int | None = None,
) -> TokenLogprobs:
    top = [
        Logprob(token_id=i, logprob=lp, decoded=tokenizer.decode([i], skip_special_tokens=False))
        for i, lp in zip(top_ids, top_logprobs)
    ]
    return TokenLogprobs(token_id=token_id, logprob=logprob, top=top, rank=rank)
