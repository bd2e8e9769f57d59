"""Per-request sampling parameters (shaped like vLLM's ``SamplingParams``).

Every field is validated in ``__post_init__``; a bad value raises ``ValueError`` whose
message starts with the field name and shows the offending value, so API layers can pass
it straight back to the client.

Normalisations done at construction:
- ``stop`` becomes a ``list[str]`` (``None`` -> ``[]``, ``"x"`` -> ``["x"]``),
- ``stop_token_ids`` becomes a ``list[int]`` (``None`` -> ``[]``),
- float fields given as ints become floats (``temperature=0`` -> ``0.0``).

The object is a plain mutable dataclass (like vLLM's); assignments after construction are
*not* re-validated, so prefer ``dataclasses.replace(params, ...)``, which re-runs
validation.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from quickdraft.structured.params import StructuredOutputsParams
from quickdraft.verify.logits_processors import processor_arity


class InvalidParameterError(ValueError):
    """A sampling parameter the engine cannot take (found when the request is added, e.g. a token
    id outside the model's vocabulary); ``param`` names the field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


# vLLM's default ``max_logprobs``: the most top logprobs a request may ask of an engine that
# sets no other cap (EngineConfig.max_logprobs).
DEFAULT_MAX_LOGPROBS = 20


@dataclass(kw_only=True)
class SamplingParams:
    n: int = 1
    # completions sampled, of which the n with the highest mean logprob per token are returned
    # (OpenAI's and vLLM's best_of); None = n. Needs sampling (temperature > 0) when above n.
    best_of: int | None = None
    temperature: float = 1.0  # 0 means greedy (argmax)
    top_p: float = 1.0  # in (0, 1]; 1 = off
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0  # in [0, 1]; 0 = off
    repetition_penalty: float = 1.0  # > 0; 1 = off; over prompt + output tokens
    presence_penalty: float = 0.0  # in [-2, 2]; over output tokens
    frequency_penalty: float = 0.0  # in [-2, 2]; over output tokens
    seed: int | None = None
    max_tokens: int | None = 16  # None = until EOS / context end
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # top logprobs per token; 0 = only the sampled token's
    # per prompt token after the first: its logprob and the top ones (vLLM's); computes the LM head
    # over every prompt row and takes nothing from the prefix cache for the prompt
    prompt_logprobs: int | None = None
    # keep only the prompt's last k tokens (vLLM's; left truncation: a BOS at its start goes too)
    truncate_prompt_tokens: int | None = None
    # token id -> value added to its logit (OpenAI's logit_bias, each in [-100, 100]); None = off
    logit_bias: dict[int, float] | None = None
    # only these token ids may be generated (vLLM's allowed_token_ids); None = every token
    allowed_token_ids: list[int] | None = None
    # words never generated (vLLM's bad_words): each word's tokens, as written and after a space;
    # a word's last token is banned where the tokens before it were the last ones generated
    bad_words: list[str] | None = None
    # bad_words as token ids, filled by the engine from its tokenizer when the request is added
    bad_words_token_ids: list[list[int]] | None = field(default=None, init=False, repr=False, compare=False)
    # The text the output is expected to be, mostly (OpenAI's predicted outputs: a file being
    # edited): drafted as it stands, verified like any draft, so the output is unchanged by it
    prediction: str | None = None
    # prediction as token ids, filled by the engine from its tokenizer when the request is added
    prediction_token_ids: list[int] | None = field(default=None, init=False, repr=False, compare=False)
    skip_special_tokens: bool = True
    # vLLM's: its slow (Python) tokenizers put a space between special tokens kept in the text;
    # its fast ones, like every tokenizer here, decode as the tokenizer does, so it changes nothing
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # False: no output text (vLLM's), for callers that read token_ids only; stop strings then
    # cannot be matched and are refused
    detokenize: bool = True
    # JSON schema / JSON object / regex / choice / grammar the output must match (a dict of
    # StructuredOutputsParams' fields is accepted); None = free text
    structured_outputs: StructuredOutputsParams | None = None
    # callables fn(output_token_ids, logits) or fn(prompt_token_ids, output_token_ids, logits)
    # -> logits over one row [V] (vLLM's per-request form), called on every verified row with that
    # row's own history, so exact under speculation; pure functions of their arguments
    # (verify/logits_processors.py). Shared, not copied, by clone() and n / best_of's children.
    logits_processors: list[Callable[..., Any]] | None = None
    # per processor, the form it takes (2: output and logits, 3: the prompt first), found once
    logits_processor_arities: list[int] = field(default_factory=list, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.n = _check_int("n", self.n, low=1)  # completions of the prompt (engine/parallel_sampling.py)

        self.temperature = _check_float("temperature", self.temperature, low=0.0)
        self.top_p = _check_float("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        self.top_k = _check_int("top_k", self.top_k, low=-1)
        self.min_p = _check_float("min_p", self.min_p, low=0.0, high=1.0)
        self.repetition_penalty = _check_float("repetition_penalty", self.repetition_penalty, low=0.0, low_open=True)
        self.presence_penalty = _check_float("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        self.frequency_penalty = _check_float("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        if self.seed is not None:
            self.seed = _check_int("seed", self.seed)
        if self.best_of is not None:
            self.best_of = _check_int("best_of", self.best_of, low=1)
            if self.best_of < self.n:
                raise ValueError(
                    f"best_of must be >= n ({self.n}): the n best of best_of are returned, got {self.best_of}"
                )
            if self.best_of > self.n and self.temperature == 0.0:
                raise ValueError(
                    f"best_of ({self.best_of}) > n ({self.n}) needs sampling: with temperature 0 every "
                    "completion is the same"
                )

        if self.max_tokens is not None:
            self.max_tokens = _check_int("max_tokens", self.max_tokens, low=1)
        self.min_tokens = _check_int("min_tokens", self.min_tokens, low=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens!r}")

        self.stop = _normalize_stop(self.stop)
        self.stop_token_ids = _normalize_stop_token_ids(self.stop_token_ids)

        if self.logprobs is not None:
            self.logprobs = _check_int("logprobs", self.logprobs, low=-1)  # -1: every token (vLLM's)
        if self.truncate_prompt_tokens is not None:
            self.truncate_prompt_tokens = _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, low=1)
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = _check_int("prompt_logprobs", self.prompt_logprobs, low=-1)

        if self.logit_bias is not None:
            self.logit_bias = _normalize_logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _normalize_token_ids("allowed_token_ids", self.allowed_token_ids, nonempty=True)

        if self.bad_words is not None:
            self.bad_words = _normalize_bad_words(self.bad_words)
        if self.prediction is not None and (not isinstance(self.prediction, str) or not self.prediction):
            raise ValueError(f"prediction must be a non-empty string, got {self.prediction!r}")

        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.from_value(self.structured_outputs)
        if self.logits_processors is not None:
            self.logits_processors = _normalize_logits_processors(self.logits_processors)
            self.logits_processor_arities = [
                processor_arity(processor, index=index) for index, processor in enumerate(self.logits_processors)
            ]

        for name in (
            "ignore_eos",
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "include_stop_str_in_output",
            "detokenize",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.stop and not self.detokenize:
            raise ValueError(
                f"stop strings are matched in the output text, which detokenize=False leaves out: got stop="
                f"{self.stop!r} (use stop_token_ids, or detokenize=True)"
            )

    @property
    def num_samples(self) -> int:
        """Completions sampled for the prompt: best_of, else n."""
        return self.n if self.best_of is None else self.best_of

    @property
    def is_greedy(self) -> bool:
        """Temperature 0: argmax decoding; top_k / top_p / min_p then have no effect."""
        return self.temperature == 0.0

    def clone(self) -> SamplingParams:
        # A processor may hold much (a tokenizer, tensors): shared, as vLLM's clone shares them.
        memo = {id(processor): processor for processor in self.logits_processors or ()}
        return copy.deepcopy(self, memo)


def _is_int(value: object) -> bool:
    # bool is a subclass of int, but ``top_k=True`` is a bug, not a number.
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value: object, *, low: int | None = None, high: int | None = None) -> int:
    if not _is_int(value):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value!r}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {value!r}")
    return value


def _check_float(
    name: str,
    value: object,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
) -> float:
    if not (_is_int(value) or isinstance(value, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if low is not None and (value <= low if low_open else value < low):
        bound = f"> {low}" if low_open else f">= {low}"
        raise ValueError(f"{name} must be {bound}, got {value!r}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {value!r}")
    return value


def _normalize_stop(stop: object) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)):
        raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
    for s in stop:
        if not isinstance(s, str):
            raise ValueError(f"stop must contain only strings, got {s!r}")
        if s == "":
            raise ValueError(f"stop strings must be non-empty, got {s!r}")
    return list(stop)


def _normalize_stop_token_ids(ids: object) -> list[int]:
    if ids is None:
        return []
    return _normalize_token_ids("stop_token_ids", ids)


def _normalize_token_ids(name: str, ids: object, *, nonempty: bool = False) -> list[int]:
    if not isinstance(ids, (list, tuple)):
        raise ValueError(f"{name} must be a list of ints, got {ids!r}")
    for t in ids:
        if not _is_int(t) or t < 0:
            raise ValueError(f"{name} must contain non-negative ints, got {t!r}")
    if nonempty and not ids:
        raise ValueError(f"{name} must not be empty (nothing could be generated)")
    return list(ids)


# OpenAI's range for a logit bias: -100 bans a token in practice, 100 forces it.
MAX_LOGIT_BIAS = 100.0


def _normalize_logit_bias(bias: object) -> dict[int, float]:
    """{token id: bias}; token ids given as decimal strings (as JSON object keys are) become ints."""
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a mapping of token id to bias, got {bias!r}")
    result = {}
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.strip().isdigit() else key
        if not _is_int(token) or token < 0:
            raise ValueError(f"logit_bias keys must be non-negative token ids, got {key!r}")
        result[token] = _check_float(f"logit_bias[{token}]", value, low=-MAX_LOGIT_BIAS, high=MAX_LOGIT_BIAS)
    return result


def _normalize_logits_processors(processors: object) -> list[Callable[..., Any]]:
    if not isinstance(processors, (list, tuple)):
        raise ValueError(f"logits_processors must be a list of callables, got {processors!r}")
    return list(processors)


def _normalize_bad_words(words: object) -> list[str]:
    if isinstance(words, str) or not isinstance(words, (list, tuple)):
        raise ValueError(f"bad_words must be a list of strings, got {words!r}")
    bad = [word for word in words if not isinstance(word, str) or not word.strip()]
    if bad:
        raise ValueError(f"bad_words must be non-empty strings, got {bad[0]!r}")
    return list(words)


def bad_words_token_ids(words: list[str], *, encode: Callable[[str], list[int]]) -> list[list[int]]:
    """Each word's token ids as written, and after a space where that starts with another token
    of the same count (vLLM's rule: " word" is how a word usually follows another)."""
    sequences: list[list[int]] = []
    for word in words:
        as_written = encode(word.lstrip())
        after_space = encode(" " + word.lstrip())
        candidates = [as_written]
        if as_written and after_space and after_space[0] != as_written[0] and len(after_space) == len(as_written):
            candidates.append(after_space)
        sequences += [ids for ids in candidates if ids and ids not in sequences]
    return sequences
