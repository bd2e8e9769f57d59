"""The engine: requests in, one step at a time, outputs out.

A step: the scheduler plans which requests feed which tokens; the speculator drafts for
the decoding ones; the runner turns the plan into one forward; every request that ends its
known tokens is verified in one call (a plain decode is a proposal with no draft: its
root alone); one function commits each request (cache, tokens, metrics, drafter), and
finished ones free their slot.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
import time
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from quickdraft.config import EngineConfig, SpeculativeConfig
from quickdraft.drafters import default_registry
from quickdraft.drafters.base import AcceptedPath, Proposal, TargetInfo
from quickdraft.drafters.hybrid import path_in_child
from quickdraft.drafters.prediction import NoDrafter
from quickdraft.engine.feature_cache import FeatureBlockCache
from quickdraft.engine.request import Request, make_token_logprobs
from quickdraft.engine.runner import REUSED_LOGITS_BYTES, ModelRunner, SequenceWork
from quickdraft.engine.scheduler import ScheduledRequest, Scheduler
from quickdraft.engine.speculation import Speculator
from quickdraft.engine.verification import (
    StepLogits,
    chain_rows,
    node_histories,
    row_context,
    verify_step,
    walks_path,
)
from quickdraft.kv.cache import CacheFullError, KVCache
from quickdraft.models.decoder import Decoder, LogitsArena
from quickdraft.models.heap import return_free_heap, transparent_huge_pages
from quickdraft.models.loader import (
    load_decoder,
    read_hf_config,
    read_model_config,
    resolve_device,
    resolve_dtype,
    resolve_gguf_path,
    resolve_model_dir,
    resolve_quantization,
)
from quickdraft.models.lora import LoRARegistry, LoRARequest, LoRASlots, LoRAWeights
from quickdraft.models.quantized_loader import quantized_weights_in_huge_pages
from quickdraft.models.tokenizer import Tokenizer
from quickdraft.models.weight_updates import load_hf_weights
from quickdraft.outputs import EngineMetrics, StreamDelta, TokenLogprobs
from quickdraft.pooling import Pooler, PoolingParams
from quickdraft.sampling_params import InvalidParameterError, SamplingParams, bad_words_token_ids
from quickdraft.structured.grammar import SPARSE_ROW_LIMIT, GrammarCompiler, TreeMasks, apply_masks
from quickdraft.verify.logits_processors import LogitsProcessorError, apply_logits_processors
from quickdraft.verify.sampler import (
    make_generator,
    position_key,
    processed_logits,
    token_logprobs,
)

if TYPE_CHECKING:  # torch.distributed is imported only when tensor parallelism is on
    from quickdraft.distributed.launch import TensorParallelWorkers

DEFAULT_MAX_MODEL_LEN = 4096
# Storage beyond max_model_len, so that a step's new tokens (a prefill chunk's tail or a
# draft tree) always have room to be written before they are accepted or dropped.
CACHE_HEADROOM = 64
# Prompt rows per LM-head call of prompt_logprobs: a row's logits over a 262k vocabulary are 1 MB.
PROMPT_LOGPROB_ROWS = 32


class Engine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype)
        # the target's keys and values: the compute dtype, or as config.kv_cache_dtype names
        self.kv_cache_dtype = self.dtype if config.kv_cache_dtype == "auto" else getattr(torch, config.kv_cache_dtype)
        self.model_dir = model_dir = resolve_model_dir(config.model, hf_overrides=config.hf_overrides)
        gguf_path = resolve_gguf_path(config.model)
        self.quantization = resolve_quantization(
            config.quantization, dtype=config.dtype, gguf_path=gguf_path, device=self.device, model_dir=model_dir
        )
        huge = config.weights_in_huge_pages
        # quantized weights in this process's huge pages, or mapped from the packed-weight file
        want_huge_pages = transparent_huge_pages() if huge is None else huge
        probe = _read_max_positions(model_dir)  # reads config.json first: the clearest error
        self.tokenizer = Tokenizer.from_dir(model_dir)
        self.max_model_len = config.max_model_len or min(probe, DEFAULT_MAX_MODEL_LEN)
        if self.max_model_len > probe:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's context {probe}")
        cache_len = self.max_model_len + CACHE_HEADROOM
        hf_config = read_hf_config(model_dir)
        declared = read_model_config(model_dir)
        # An encoder (EmbeddingGemma) runs a prompt whole in one forward, however long it is.
        self.is_encoder = declared.bidirectional_attention
        # An encoder, or a base model saved without its LM head: embed() alone uses the engine.
        self.embedding_only = self.is_encoder or declared.embedding_only
        step_tokens = max(config.max_num_batched_tokens, CACHE_HEADROOM, cache_len if self.is_encoder else 0)
        # The followers of a tensor-parallel target (None: the whole target is in this process).
        self.tensor_parallel: TensorParallelWorkers | None = None
        if config.tensor_parallel_size > 1:
            self._start_tensor_parallel(cache_len, gguf_path=gguf_path, step_tokens=step_tokens)
        else:
            self.model, self.model_config = load_decoder(
                model_dir,
                dtype=self.dtype,
                device=self.device,
                max_len=cache_len,
                quantization=self.quantization,
                gguf_path=gguf_path,
                huge_pages=want_huge_pages,
                context_len=self.max_model_len,
            )
            self.cache = KVCache(
                num_layers=self.model_config.num_layers,
                # embed() alone, one prompt at a time, uses an embedding model's slots
                num_slots=1 if self.embedding_only else config.max_num_seqs,
                num_kv_heads=self.model_config.num_kv_heads,
                head_dim=self.model_config.head_dim,
                max_len=cache_len,
                dtype=self.kv_cache_dtype,
                device=self.device,
                block_size=config.block_size,
                layer_windows=self.model_config.layer_windows,
                # A forward writes at most a prefill chunk or a draft tree per request.
                max_step_tokens=step_tokens,
                memory_bytes=config.kv_cache_memory_bytes,
            )
        self.pooler = Pooler.of_model(model_dir, config=declared, hf_config=hf_config)
        # Whether they are there: not float or CUDA weights, nor where the kernel gave no huge page.
        self.weights_in_huge_pages = (
            want_huge_pages and self.tensor_parallel is None and quantized_weights_in_huge_pages(self.model)
        )
        self.runner = ModelRunner(model=self.model, cache=self.cache, device=self.device)
        # LoRA adapters by lora_int_id (None: enable_lora is off)
        self.loras: LoRARegistry | None = None
        if config.enable_lora:
            self.loras = LoRARegistry(
                config=self.model_config,
                max_rank=config.max_lora_rank,
                capacity=config.max_cpu_loras or config.max_loras,
                device=self.device,
            )
            self.runner.lora_slots = LoRASlots(config.max_loras)
            self.model.lora_enabled = True
        # Rows computed when a walk reaches them (see lazy_logits_rows), valid through the step.
        self._logits_arena = LogitsArena(vocab_size=self.model_config.vocab_size, max_bytes=REUSED_LOGITS_BYTES)
        # request id -> node -> the error its logits processors raised on that node's row this step
        self._processor_failures: dict[str, dict[int, LogitsProcessorError]] = {}
        self._lazy_rows: int | None = config.lazy_logits_rows  # None until measured
        self.scheduler = Scheduler(
            cache=self.cache,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            enable_prefix_caching=config.enable_prefix_caching,
            policy=config.scheduling_policy,
            max_loras=config.max_loras,
        )
        self.eos_token_ids = list(
            dict.fromkeys(list(self.tokenizer.eos_token_ids) + list(self.model_config.eos_token_ids))
        )
        self.grammars = GrammarCompiler(  # structured outputs; indexes the vocabulary on first use
            tokenizer=self.tokenizer.backend,
            vocab_size=self.model_config.vocab_size,
            eos_token_ids=self.eos_token_ids,
        )
        self._requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._seed_generator = torch.Generator()  # draws the seeds of unseeded requests
        self._seed_generator.manual_seed(config.seed)
        self.metrics = EngineMetrics()
        self._speculator: Speculator | None = None
        self.speculator = self._make_speculator(config.speculative_config)
        if self.speculator is not None:
            _ = self.lazy_logits_rows  # measured at load, not in the first step's time
        return_free_heap()  # the drafter's load temporaries (a head quantized at load: ~30 MB)

    def _check_generates(self) -> None:
        if not self.embedding_only:
            return
        if self.pooler.classifier is not None:
            raise ValueError(
                f"{self.model_dir.name} is a classifier (a score head in place of the LM head), it does not "
                "generate text: use LLM.classify / LLM.score or /classify, /score, /rerank"
            )
        why = (
            "bidirectional attention: every token sees the whole prompt"
            if self.is_encoder
            else "a base model saved without its LM head: lm_head.weight is missing and the embeddings are not tied"
        )
        raise ValueError(
            f"{self.model_dir.name} is an embedding model ({why}), it does not generate text: use "
            "LLM.embed / LLM.score or /v1/embeddings"
        )

    def _start_tensor_parallel(self, cache_len: int, *, gguf_path: Path | None, step_tokens: int) -> None:
        """The target split over config.tensor_parallel_size processes, this one rank 0
        (quickdraft/distributed); the followers stop with `close` (or when the engine is collected)."""
        from quickdraft.distributed.launch import CacheOptions, start_tensor_parallel

        target = start_tensor_parallel(
            size=self.config.tensor_parallel_size,
            model_dir=self.model_dir,
            dtype=self.dtype,
            device=self.device,
            max_len=cache_len,
            context_len=self.max_model_len,
            quantization=self.quantization,
            gguf_path=gguf_path,
            cache=CacheOptions(
                num_slots=self.config.max_num_seqs,
                max_len=cache_len,
                block_size=self.config.block_size,
                max_step_tokens=step_tokens,
                memory_bytes=self.config.kv_cache_memory_bytes,
            ),
        )
        self.model, self.model_config, self.cache = target.decoder, target.config, target.cache
        self.tensor_parallel = target.workers
        weakref.finalize(self, target.workers.shutdown)

    def close(self) -> None:
        """Stop the tensor-parallel followers, if any (the engine cannot run forwards after)."""
        if self.tensor_parallel is not None:
            self.tensor_parallel.shutdown()

    @property
    def speculator(self) -> Speculator | None:
        return self._speculator

    @speculator.setter
    def speculator(self, speculator: Speculator | None) -> None:
        self._speculator = speculator
        self.scheduler.draft_reserve = speculator.draft_reserve if speculator is not None else 0
        self.scheduler.prefix_usable = None
        if speculator is not None and speculator.feature_layers and self.config.enable_prefix_caching:
            if speculator.feature_blocks is None:
                # a hit covers only blocks whose drafter features are held (engine/feature_cache.py)
                speculator.feature_blocks = FeatureBlockCache(
                    block_size=self.cache.block_size, max_blocks=self.cache.max_prefix_blocks
                )
            self.scheduler.prefix_usable = speculator.prefix_usable

    def set_speculative_config(self, spec: SpeculativeConfig | dict | None) -> None:
        """Switch drafting method (or turn speculation off) between requests."""
        self._check_idle("the speculative config")
        self.speculator = self._make_speculator(SpeculativeConfig.from_dict(spec) if isinstance(spec, dict) else spec)

    def set_drafter(self, drafter, *, num_speculative_tokens: int = 1) -> None:
        """Speculate with a drafter object of your own (anything with the Drafter interface)."""
        self._check_idle("the drafter")
        config = SpeculativeConfig(method=type(drafter).__name__, num_speculative_tokens=num_speculative_tokens)
        self.speculator = Speculator(config=config, drafter=drafter, max_tree_nodes=CACHE_HEADROOM)

    def set_speculator(self, speculator: Speculator | None) -> None:
        """Put back a speculator taken earlier from `self.speculator` (its drafter keeps what it
        learned across requests, e.g. suffix's cache of earlier outputs); None turns speculation off."""
        self._check_idle("the speculator")
        self.speculator = speculator

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (between benchmark runs, after changing what a prefix means)."""
        self._check_idle("the prefix cache")
        self.cache.reset_prefix_cache()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """New target weights under the checkpoint's names (vLLM's model.load_weights, what an RL
        trainer sends between rollouts; models/weight_updates.py), all or some of them; returns
        our names of the tensors changed.  The prefix cache and the drafter's cached features
        were computed with the old weights: both are dropped.  A drafter trained for the old
        weights still drafts, and speculation stays exact whatever it proposes."""
        self._check_idle("the weights")
        if self.tensor_parallel is not None:
            raise ValueError("load_weights needs tensor_parallel_size 1 (the followers hold their own shards)")
        if self.embedding_only:
            raise ValueError("load_weights updates a generating target; this model only embeds")
        changed = load_hf_weights(self.model, self.model_config, weights)
        self.cache.reset_prefix_cache()
        if self._speculator is not None and self._speculator.feature_blocks is not None:
            self._speculator.feature_blocks = None
            self.speculator = self._speculator  # a fresh feature cache
        return changed

    def _check_idle(self, what: str) -> None:
        if self.has_unfinished_requests():
            raise RuntimeError(f"cannot change {what} while requests are running")

    def _make_speculator(self, spec) -> Speculator | None:
        if spec is None:
            return None
        self._check_generates()
        options = dict(spec.drafter_options)
        if spec.model is not None:
            options["model"] = spec.model
        target = TargetInfo(
            vocab_size=self.model_config.vocab_size,
            dtype=self.dtype,
            device=self.device,
            max_model_len=self.max_model_len,
            max_num_seqs=self.config.max_num_seqs,
            model=self.model,
            model_dir=str(self.model_dir),
            cache=self.cache,
        )
        registry = default_registry()
        if spec.num_speculative_tokens is None:
            length = registry.default_num_speculative_tokens(spec.method, target=target, options=options)
            spec = dataclasses.replace(spec, num_speculative_tokens=length)
        try:
            drafter = registry.create(
                spec.method, target=target, num_speculative_tokens=spec.num_speculative_tokens, **options
            )
        except TypeError as err:  # an option the drafter does not take
            raise ValueError(f"speculative_config for method {spec.method!r}: {err}") from err
        return Speculator(config=spec, drafter=drafter, max_tree_nodes=CACHE_HEADROOM)

    # ---- requests ---------------------------------------------------------------------
    def add_request(
        self,
        *,
        prompt: str | None = None,
        prompt_token_ids: list[int] | None = None,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> str:
        """Queue a request; `priority` (lower first) needs scheduling_policy "priority";
        `cache_salt` (vLLM's): prefix-cache blocks are shared only with requests of the same salt;
        `lora_request`: the LoRA adapter the target runs for it (loaded on first use; needs enable_lora)."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        self._check_generates()
        self._check_priority(priority)
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise InvalidParameterError("cache_salt", f"cache_salt must be a non-empty string, got {cache_salt!r}")
        lora = self._lora_for(lora_request)
        token_ids = self._prompt_tokens(prompt, prompt_token_ids, keep_last=params.truncate_prompt_tokens)
        self._check_vocabulary_ids(params)
        params = self._with_logprob_counts(params)
        if params.num_samples != 1:
            raise ValueError(
                f"n: the engine takes one completion per request, got n={params.n}, best_of={params.best_of} "
                "(LLM.generate and the server fan n out into requests: engine/parallel_sampling.py)"
            )
        request_id = request_id if request_id is not None else self.new_request_id()
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        seed = params.seed if params.seed is not None else self.draw_seed()
        if params.bad_words or params.prediction is not None:
            params = self._with_token_ids(params)
        if params.prediction is not None and self.speculator is None:
            # An engine that does not speculate drafts predictions only (the others decode as before).
            config = SpeculativeConfig(method="prediction", num_speculative_tokens=1)
            self.speculator = Speculator(config=config, drafter=NoDrafter(), max_tree_nodes=CACHE_HEADROOM)
        structured = params.structured_outputs
        grammar = (
            None if structured is None else self.grammars.matcher_for(structured, ends_at_eos=not params.ignore_eos)
        )
        request = Request(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=token_ids,
            params=params,
            tokenizer=self.tokenizer,
            eos_token_ids=self.eos_token_ids,
            max_model_len=self.max_model_len,
            seed=seed,
            generator=make_generator(position_key(seed, -1), self.device),
            grammar=grammar,
            priority=priority,
            cache_salt=cache_salt,
            lora=lora,
        )
        self._requests[request_id] = request
        self.scheduler.add(request)
        return request_id

    def _lora_for(self, lora_request: LoRARequest | None) -> LoRAWeights | None:
        if lora_request is None:
            return None
        if self.loras is None:
            raise InvalidParameterError(
                "lora_request",
                f"LoRA adapter {getattr(lora_request, 'lora_name', lora_request)!r} asked for, "
                "but LoRA is not enabled (enable_lora=True / --enable-lora)",
            )
        return self.loras.get(lora_request)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter ahead of its requests (vLLM's add_lora); errors name what is wrong with it."""
        self._lora_for(lora_request)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drop a loaded adapter (requests running it keep it until they finish); False if not loaded."""
        return self.loras is not None and self.loras.remove(lora_int_id)

    def list_loras(self) -> set[int]:
        return set(self.loras.ids()) if self.loras is not None else set()

    def new_request_id(self) -> str:
        """An id no request of this engine was given by it before."""
        return str(next(self._ids))

    def draw_seed(self) -> int:
        """A seed for an unseeded request, from the engine's generator (seeded by EngineConfig.seed);
        returned in the request's output so that an answer can be replayed."""
        return int(torch.randint(0, 2**62, (1,), generator=self._seed_generator))

    def _with_token_ids(self, params: SamplingParams) -> SamplingParams:
        """A copy whose bad words and prediction are token ids of this engine's tokenizer (the
        caller's params may serve engines with other tokenizers)."""
        resolved = params.clone()
        encode = functools.partial(self.tokenizer.encode, add_special_tokens=False)
        if params.bad_words:
            resolved.bad_words_token_ids = bad_words_token_ids(params.bad_words, encode=encode)
        if params.prediction is not None:
            resolved.prediction_token_ids = encode(params.prediction)
        return resolved

    def _with_logprob_counts(self, params: SamplingParams) -> SamplingParams:
        """logprobs / prompt_logprobs within config.max_logprobs (vLLM's); -1, every token of
        the vocabulary, as that many."""
        vocab, cap = self.model_config.vocab_size, self.config.max_logprobs
        counts = {"logprobs": params.logprobs, "prompt_logprobs": params.prompt_logprobs}
        for name, value in counts.items():
            if value is not None and cap != -1 and (value == -1 or value > cap):
                raise InvalidParameterError(
                    name, f"{name} must be <= {cap} (the engine's max_logprobs; -1 lifts it), got {value}"
                )
        if -1 not in counts.values():
            return params
        every = {name: vocab if value == -1 else value for name, value in counts.items()}
        return dataclasses.replace(params, logprobs=every["logprobs"], prompt_logprobs=every["prompt_logprobs"])

    def _check_vocabulary_ids(self, params: SamplingParams) -> None:
        """Token ids in the parameters must exist: found at admission, not when a step samples."""
        vocab = self.model_config.vocab_size
        fields = {
            "stop_token_ids": params.stop_token_ids or [],
            "logit_bias": list(params.logit_bias or {}),
            "allowed_token_ids": params.allowed_token_ids or [],
        }
        for name, ids in fields.items():
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise InvalidParameterError(
                    name, f"{name} has token ids outside the vocabulary [0, {vocab}): {bad[:5]}"
                )

    def _prompt_tokens(
        self,
        prompt: str | None,
        prompt_token_ids: list[int] | None,
        *,
        keep_last: int | None = None,
        generates: bool = True,  # False: an embedding prompt, which may fill the whole context
    ) -> list[int]:
        if (prompt is None) == (prompt_token_ids is None):
            raise ValueError("give exactly one of prompt (text) or prompt_token_ids")
        if prompt is not None:
            if not isinstance(prompt, str):
                raise TypeError(f"prompt must be a string, got {type(prompt).__name__}")
            token_ids = self.tokenizer.encode(prompt)
        else:
            assert prompt_token_ids is not None  # exactly one of the two was given
            token_ids = list(prompt_token_ids)
            vocab = self.model_config.vocab_size
            bad = [t for t in token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt_token_ids must be integers in [0, {vocab}), got {bad[:5]}")
        if not token_ids:
            raise ValueError("the prompt is empty")
        if keep_last is not None:
            token_ids = token_ids[-keep_last:]
        if len(token_ids) >= self.max_model_len + (not generates):
            room = "no room to generate" if generates else "too long"
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens, but max_model_len is {self.max_model_len}: "
                f"{room} (shorten the prompt, truncate it or raise max_model_len)"
            )
        return token_ids

    @torch.inference_mode()
    def embed(self, prompts: list[list[int]], params: PoolingParams) -> list[torch.Tensor]:
        """Each prompt's embedding [D] float32 (quickdraft/pooling.py): its final hidden states,
        after the model's last norm, pooled (and through the model's modules after pooling).
        Every prompt is checked before any runs; each then runs as a prefill of its own in a free
        cache slot (chunks of max_num_batched_tokens; an encoder's prompt whole), between steps of
        the requests that are generating, whose state it leaves as it was.  CacheFullError when no
        slot or blocks are free for it (the server's loop runs it again once generation frees them)."""
        return self.pool(prompts, params, task="embed")

    @torch.inference_mode()
    def classify(self, prompts: list[list[int]], *, truncate_prompt_tokens: int | None = None) -> list[torch.Tensor]:
        """Each prompt's class probabilities [num_labels] float32 from a classifier's head on its
        last token's final state (Pooler.classify); run as `embed` runs its prompts."""
        if self.pooler.classifier is None:
            raise ValueError(
                f"{self.model_dir.name} has no classification head: classify and cross-encoder scores need a "
                "*ForSequenceClassification checkpoint"
            )
        return self.pool(prompts, PoolingParams(truncate_prompt_tokens=truncate_prompt_tokens), task="classify")

    @torch.inference_mode()
    def pool(self, prompts: list[list[int]], params: PoolingParams, *, task: str) -> list[torch.Tensor]:
        """Each prompt's result of a pooling task (Pooler.pool: embed, classify, token_embed,
        token_classify), float32; run as `embed` runs its prompts, every one checked first."""
        self.pooler.check_task(task)
        self.pooler.check(params)
        checked = [
            self._prompt_tokens(None, ids, keep_last=params.truncate_prompt_tokens, generates=False) for ids in prompts
        ]
        return [self.pooler.pool(self._final_hidden_states(ids), params, task=task) for ids in checked]

    def _final_hidden_states(self, token_ids: list[int]) -> torch.Tensor:  # -> [T, D]
        slot = self.cache.allocate()  # CacheFullError when every slot is taken
        try:
            states = []
            step = len(token_ids) if self.is_encoder else self.config.max_num_batched_tokens
            for start in range(0, len(token_ids), step):
                piece = token_ids[start : start + step]
                if not self.cache.try_reserve(slot, start + len(piece)):
                    raise CacheFullError(
                        f"no free KV cache blocks to embed a prompt of {len(token_ids)} tokens: retry when running "
                        "requests finish"
                    )
                out = self.runner.forward([SequenceWork(slot=slot, cache_len=start, token_ids=piece)])
                states.append(self.model.norm(out.forward.hidden_states))
                self.cache.commit(slot, start + len(piece))
            return torch.cat(states)
        finally:
            self.cache.free(slot)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its slot; False when it is unknown or already done."""
        request = self._requests.get(request_id)
        if request is None or request.is_finished:
            return False
        request.finish(reason="abort")
        self._retire(request)
        return True

    def _fail(self, request: Request, error: Exception) -> None:
        """The request cannot go on (its logits processors failed): it finishes with reason
        "error" and `request.error`."""
        request.error = error
        request.finish(reason="error")
        self._retire(request)

    def _retire(self, request: Request) -> None:
        """A request just finished: free its slot and drafter state, count its metrics."""
        self.scheduler.finish(request)
        if self.speculator is not None:
            self.speculator.finish(request.request_id)
        self.metrics.add(request.metrics)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    def get_request(self, request_id: str) -> Request:
        return self._requests[request_id]

    def release(self, request_id: str) -> None:
        """Forget a finished request (outputs have been handed out)."""
        request = self._requests.get(request_id)
        if request is not None and request.is_finished:
            del self._requests[request_id]

    def _check_priority(self, priority: object) -> None:
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidParameterError("priority", f"priority must be an int, got {priority!r}")
        if priority != 0 and self.scheduler.policy != "priority":
            raise InvalidParameterError(
                "priority",
                f"priority: got {priority}, but requests are served first come, first served; "
                "set scheduling_policy='priority' (--scheduling-policy priority) to order them",
            )

    # ---- the step ---------------------------------------------------------------------
    def step(self) -> list[StreamDelta]:
        """Schedule, draft, one target forward, verify every request at once, commit each."""
        started = time.perf_counter()
        # Whether this step drafts (disable_by_batch_size), decided once: the scheduler's reserve
        # for draft nodes and the drafting itself follow the same answer.
        drafting = self.speculator is not None and self.speculator.drafts_with(num_running=len(self.scheduler.running))
        if self.speculator is not None:  # adaptive speculation's follows what it drafts
            self.scheduler.draft_reserve = self.speculator.draft_reserve if drafting else 0
        plan = self.scheduler.schedule()
        if self.speculator is not None:
            for request in self.scheduler.preempted:  # it will recompute: its drafter state starts again
                self.speculator.finish(request.request_id)
        if not plan:
            return []
        for item in plan:
            request = item.request
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = started
            if request.num_skipped_tokens:
                if self.speculator is not None:
                    # A prefix cache hit: those tokens entered the cache without a forward.
                    keys = self.cache.block_keys(request.scheduled_slot)
                    self.speculator.restore(
                        request,
                        request.num_skipped_tokens,
                        keys=keys[: request.num_skipped_tokens // self.cache.block_size],
                    )
                request.num_skipped_tokens = 0
        # Before any commit changes the requests (one may finish inside its accepted path).
        num_decodes = sum(1 for item in plan if item.num_new_tokens == 1 and item.completes_prompt)
        decode_only = num_decodes == len(plan)
        drafts = self._propose(plan) if drafting else {}
        drafted = time.perf_counter()
        # Every item that completes its known tokens ends in a proposal; a plain decode's is its root alone.
        proposals = [self._proposal_for(item, drafts) for item in plan]
        drafted_proposals = list(proposals)  # what the drafters proposed, before any grammar cut
        grammar_masks = self._grammar_masks(plan, proposals)
        for i, masks in enumerate(grammar_masks):
            if masks is not None:
                proposals[i] = masks.proposal
        sparse_tokens = [
            _sparse_tokens(item.request, proposal, masks)
            for item, proposal, masks in zip(plan, proposals, grammar_masks)
        ]
        # LM-head rows left for the walks to ask for: greedy and keyed walks read only their path's.
        first_rows = self._first_logits_rows(proposals)
        work = [
            self._work_for(
                item,
                proposal,
                sparse=sparse,
                first_rows=first_rows if proposal is not None and walks_path(item.request, proposal) else 0,
            )
            for item, proposal, sparse in zip(plan, proposals, sparse_tokens)
        ]
        feature_layers = self.speculator.feature_layers if self.speculator is not None else ()
        out = self.runner.forward(work, capture_layers=feature_layers, reuse_logits=True)  # used within the step
        features = _features(out.forward.captured, feature_layers)  # [N, L * D] or None
        row_starts = list(itertools.accumulate((len(w.token_ids) for w in work), initial=0))
        verified = [(i, proposal) for i, proposal in enumerate(proposals) if proposal is not None]
        verifying = [i for i, _ in verified]
        accepted: list[AcceptedPath | None] = [None] * len(plan)
        logprobs: list[list[TokenLogprobs | None]] = [[] for _ in plan]
        self._processor_failures.clear()
        failed: dict[int, LogitsProcessorError] = {}  # plan index -> why its request fails this step
        if verifying:
            requests = [plan[i].request for i in verifying]
            logits, row_offsets = self._verification_logits(
                out,
                requests=requests,
                work=work,
                proposals=proposals,
                verifying=verifying,
                sparse_tokens=sparse_tokens,
                grammar_masks=grammar_masks,
                row_starts=row_starts,
                first_rows=first_rows,
            )
            paths = verify_step(
                requests=requests,
                proposals=[proposal for _, proposal in verified],
                logits=logits,
                row_offsets=row_offsets,
                eos_token_ids=self.eos_token_ids,
            )
            path_logprobs = self._path_logprobs(requests, paths, logits, row_offsets)
            for k, i in enumerate(verifying):
                accepted[i], logprobs[i] = paths[k], path_logprobs[k]
                failure = _first_failure(paths[k], self._processor_failures.get(requests[k].request_id))
                if failure is not None:  # plain decoding would have failed there: commit what came before
                    accepted[i], failed[i] = _path_before(paths[k], failure[0]), failure[1]
        self._record_prompt_logprobs(plan, work=work, row_starts=row_starts, hidden_states=out.forward.hidden_states)
        now = time.perf_counter()
        kept_features = _kept_features(
            features, plan=plan, proposals=proposals, accepted=accepted, row_starts=row_starts
        )
        for i, item in enumerate(plan):
            if i in failed and accepted[i] is None:  # failed at its root: nothing to commit
                self._fail(item.request, failed[i])
                continue
            masks = grammar_masks[i]
            self._commit(
                item,
                proposal=proposals[i],
                drafted=drafted_proposals[i],
                kept_nodes=None if masks is None else masks.kept,
                accepted=accepted[i],
                logprobs=logprobs[i],
                features=kept_features[i],
                now=now,
            )
            if i in failed and not item.request.is_finished:
                self._fail(item.request, failed[i])
        finished = time.perf_counter()
        self._record_step(
            plan=plan,
            drafts=drafts,
            num_tokens=row_starts[-1],
            decode_only=decode_only,
            num_decodes=num_decodes,
            draft_seconds=drafted - started,
            verify_seconds=finished - drafted,
        )
        return [self._delta(item.request) for item in plan]

    @torch.inference_mode()
    def _record_prompt_logprobs(
        self,
        plan: list[ScheduledRequest],
        *,
        work: list[SequenceWork],
        row_starts: list[int],  # item i's fed tokens are rows row_starts[i]:row_starts[i + 1]
        hidden_states: torch.Tensor,  # [N, D] the forward's last hidden states
    ) -> None:
        """SamplingParams.prompt_logprobs: each fed prompt row's logprobs (token_logprobs, raw
        like `logprobs`) read at the prompt token that follows it, through the LM head a few rows
        at a time (a row of the 262k vocabulary is 1 MB)."""
        for i, item in enumerate(plan):
            req = item.request
            prompt, start = req.prompt_token_ids, work[i].cache_len
            if req.prompt_logprobs is None or start >= len(prompt) - 1:
                continue
            positions = range(start, min(start + len(work[i].token_ids), len(prompt) - 1))
            wanted = req.params.prompt_logprobs or 0
            for first in range(0, len(positions), PROMPT_LOGPROB_ROWS):
                chunk = positions[first : first + PROMPT_LOGPROB_ROWS]
                rows = torch.arange(chunk.start - start, chunk.stop - start, device=self.device) + row_starts[i]
                following = torch.tensor(prompt[chunk.start + 1 : chunk.stop + 1], device=self.device)
                logits = self.model.compute_logits(hidden_states[rows])  # [rows, V]
                chosen, top_ids, top_lp, rank_of = token_logprobs(logits, following, wanted)
                ranks = rank_of.tolist()
                for j, position in enumerate(chunk):
                    req.prompt_logprobs[position + 1] = make_token_logprobs(
                        token_id=prompt[position + 1],
                        logprob=float(chosen[j]),
                        top_ids=top_ids[j].tolist(),
                        top_logprobs=top_lp[j].tolist(),
                        tokenizer=self.tokenizer,
                        rank=ranks[j],
                    )

    def _first_logits_rows(self, proposals: list[Proposal | None]) -> int:
        """Rows of a walked proposal the forward computes (0: all); measured once (at load when
        a drafter is configured, else at the first step with a draft) where
        config.lazy_logits_rows leaves it to the engine."""
        if not any(p is not None and p.num_draft_tokens > 0 for p in proposals):
            return 0
        return self.lazy_logits_rows

    @property
    def lazy_logits_rows(self) -> int:
        """The LM-head rows a forward computes of each walked proposal (0: all of them): the
        config's `lazy_logits_rows`, or what was measured on this CPU (once) where it left it to the engine."""
        if self._lazy_rows is None:
            on_cpu = self.device.type == "cpu" and self.tensor_parallel is None
            self._lazy_rows = _measured_first_rows(self.model) if on_cpu else 0
        return self._lazy_rows

    def _propose(self, plan: list[ScheduledRequest]) -> dict[str, Proposal]:
        if self.speculator is None:
            return {}
        decoding = [item.request for item in plan if item.num_new_tokens == 1 and item.completes_prompt]
        if not decoding:
            return {}
        # Room the scheduler reserved in the cache: drafts never take blocks of their own.
        room = {r.request_id: self.cache.room(r.scheduled_slot) - r.num_computed_tokens for r in decoding}
        # Draft nodes count against max_num_batched_tokens like any fed token: an equal share each.
        share = self.scheduler.draft_room(plan) // len(decoding)
        return self.speculator.propose(decoding, cache_room=room, token_room={r.request_id: share for r in decoding})

    def _grammar_masks(self, plan: list[ScheduledRequest], proposals: list[Proposal | None]) -> list[TreeMasks | None]:
        """Per item: its constrained request's tree cut to what the grammar allows, with the forced
        tokens after its leaves when the request drafts this step (within its node budget), and
        the mask after each node (None for unconstrained items and prefill chunks that sample
        nothing)."""
        limits = self.speculator.step_limits if self.speculator is not None else {}
        result: list[TreeMasks | None] = []
        for item, proposal in zip(plan, proposals):
            grammar = item.request.grammar
            if proposal is None or grammar is None:
                result.append(None)
                continue
            decoding = item.num_new_tokens == 1 and item.completes_prompt
            budget, max_depth = limits.get(item.request.request_id, (0, 0)) if decoding else (0, 0)
            result.append(
                grammar.walk(proposal, extend=max(0, budget - proposal.num_draft_tokens), max_depth=max_depth)
            )
        return result

    @staticmethod
    def _proposal_for(item: ScheduledRequest, drafts: dict[str, Proposal]) -> Proposal | None:
        """The drafted tree, the root alone (plain decoding), or None for a prefill chunk that
        leaves known tokens for later steps (nothing to sample)."""
        if not item.completes_prompt:
            return None
        request = item.request
        proposal = drafts.get(request.request_id)
        if proposal is not None:
            assert item.num_new_tokens == 1  # only decodes are drafted: the tree is the whole work
            return proposal
        return Proposal.root_only(request.last_token_id)

    @staticmethod
    def _work_for(
        item: ScheduledRequest,
        proposal: Proposal | None,
        *,
        sparse: list[list[int] | None] | None = None,  # per node: its few possible tokens, or None
        first_rows: int = 0,  # > 0: the LM head runs on this many nodes of the first-child chain only
    ) -> SequenceWork:
        """The item's tokens for the forward; the LM head runs on the proposal's nodes except those
        that can only be a few tokens and those a walk may never reach (their logits come from
        `_verification_logits`)."""
        req = item.request
        start = req.num_computed_tokens
        if proposal is not None and proposal.num_draft_tokens > 0:
            nodes = chain_rows(proposal, 0, first_rows) if first_rows else range(proposal.tree.num_nodes)
            return SequenceWork(
                slot=req.scheduled_slot,
                cache_len=start,
                token_ids=proposal.token_ids,
                tree=proposal.tree,
                logits_nodes=sorted(n for n in nodes if sparse is None or sparse[n] is None),
                lora=req.lora,
            )
        tokens = req.all_token_ids[start : start + item.num_new_tokens]
        root_dense = proposal is not None and (sparse is None or sparse[0] is None)
        logits_nodes = [item.num_new_tokens - 1] if root_dense else []
        return SequenceWork(
            slot=req.scheduled_slot, cache_len=start, token_ids=tokens, logits_nodes=logits_nodes, lora=req.lora
        )

    @torch.inference_mode()
    def _verification_logits(
        self,
        out,
        *,
        requests: list[Request],  # the verifying items' requests
        work: list[SequenceWork],
        proposals: list[Proposal | None],
        verifying: list[int],  # items with a proposal, in order
        sparse_tokens: list[list[list[int] | None] | None],  # per item, per node (see _sparse_tokens)
        grammar_masks: list[TreeMasks | None],  # per item
        row_starts: list[int],  # item i's fed tokens are rows row_starts[i]:row_starts[i + 1] of the forward
        first_rows: int,  # as given to _work_for
    ) -> tuple[StepLogits, list[int]]:  # rows [sum of the proposals' nodes, V], row offsets per verifying item
        """Every verifying node's logits row, or the means to compute it when a walk reaches it.
        Rows the LM head computed come from the forward; a node that can only be a few tokens
        (its grammar's, or the request's allowed_token_ids) gets -inf everywhere but at those
        tokens, whose logits are computed alone (``Decoder.logits_of_tokens``): same distribution
        after the mask, a few dot products instead of the whole vocabulary.  A grammar's masks,
        then a request's logits processors, are applied to every row as it is computed, so every
        use sees the constrained, processed distribution."""
        sizes = [proposals[i].tree.num_nodes for i in verifying]  # type: ignore[union-attr]
        row_offsets = list(itertools.accumulate(sizes, initial=0))
        masks = [grammar_masks[i] for i in verifying]
        # the forward row of each verifying node (a prefill chunk's root is its last fed token)
        hidden_row = [
            row_starts[i] + len(work[i].token_ids) - sizes[k] + node
            for k, i in enumerate(verifying)
            for node in range(sizes[k])
        ]
        computed = [  # logits_nodes count the item's fed tokens, of which the proposal's nodes are the last
            row_offsets[k] + fed - (len(work[i].token_ids) - sizes[k])
            for k, i in enumerate(verifying)
            for fed in work[i].logits_nodes
        ]
        hidden_states = out.forward.hidden_states  # [N, D]
        histories = [  # per verifying item: each node's output history, for its logits processors
            node_histories(request, proposals[i]) if request.params.logits_processors else None  # type: ignore[arg-type]
            for request, i in zip(requests, verifying)
        ]

        def finish_rows(values: torch.Tensor, rows: list[int]) -> None:  # [len(rows), V] in place
            self._mask_rows(values, rows=rows, masks=masks, row_offsets=row_offsets)
            self._process_rows(values, rows=rows, requests=requests, histories=histories, row_offsets=row_offsets)

        @torch.inference_mode()
        def fill(rows: list[int]) -> torch.Tensor:  # -> [len(rows), V], into the step's arena
            index = torch.tensor([hidden_row[r] for r in rows], device=self.device)
            values = self.model.compute_logits(hidden_states[index], buffer=self._logits_arena)
            finish_rows(values, rows)
            self.metrics.num_logits_rows += len(rows)
            return values

        table = StepLogits(row_offsets[-1], fill=fill, first_rows=max(1, first_rows))
        self.metrics.num_logits_rows += len(computed)
        if computed:  # the verifying items' rows, contiguous in the forward's logits, in order
            assert out.logits is not None
            start = out.logits_offsets[verifying[0]]
            rows = out.logits[start : start + len(computed)]
            finish_rows(rows, computed)
            table.add(computed, rows)
        sparse = [
            (row_offsets[k] + node, ids)
            for k, i in enumerate(verifying)
            if (nodes := sparse_tokens[i]) is not None
            for node, ids in enumerate(nodes)
            if ids is not None
        ]
        if sparse:
            dtype = out.logits.dtype if out.logits is not None else torch.float32
            rows = torch.full(
                (len(sparse), self.model_config.vocab_size), float("-inf"), dtype=dtype, device=self.device
            )
            hidden = hidden_states[torch.tensor([hidden_row[row] for row, _ in sparse], device=self.device)]
            values = self.model.logits_of_tokens(hidden, [ids for _, ids in sparse])
            for j, ((_, ids), row_values) in enumerate(zip(sparse, values)):
                rows[j, torch.tensor(ids, device=self.device)] = row_values.to(dtype)
            finish_rows(rows, [row for row, _ in sparse])
            table.add([row for row, _ in sparse], rows)
        # room for the rows a walk may still ask for (the sparse ones never go through the LM head)
        self._logits_arena.reset(row_offsets[-1] - len(computed) - len(sparse))
        return table, row_offsets

    @staticmethod
    def _mask_rows(
        logits: torch.Tensor,  # [len(rows), V] the rows' logits, masked in place
        *,
        rows: list[int],  # each logits row's node row in the step's table (sorted)
        masks: list[TreeMasks | None],  # per verifying item
        row_offsets: list[int],  # item k's nodes are table rows row_offsets[k]:row_offsets[k + 1]
    ) -> None:
        """A grammar's masks applied to the given rows of its requests, one kernel call per request."""
        constrained = [(k, item_masks) for k, item_masks in enumerate(masks) if item_masks is not None]
        if not constrained:  # most steps: nothing to map
            return
        position = {row: j for j, row in enumerate(rows)}
        for k, item_masks in constrained:
            nodes = [node for node in range(row_offsets[k + 1] - row_offsets[k]) if row_offsets[k] + node in position]
            if not nodes:
                continue
            at = [position[row_offsets[k] + node] for node in nodes]
            if at == list(range(at[0], at[0] + len(at))) and nodes == list(range(nodes[0], nodes[0] + len(nodes))):
                apply_masks(logits[at[0] : at[0] + len(at)], item_masks, nodes=slice(nodes[0], nodes[0] + len(nodes)))
            else:
                for j, node in zip(at, nodes):
                    apply_masks(logits[j : j + 1], item_masks, nodes=slice(node, node + 1))

    def _process_rows(
        self,
        logits: torch.Tensor,  # [len(rows), V] the rows' logits (masked), processed in place
        *,
        rows: list[int],  # each logits row's node row in the step's table
        requests: list[Request],  # per verifying item
        histories: list[list[list[int]] | None],  # per verifying item: its nodes' output histories
        row_offsets: list[int],  # item k's nodes are table rows row_offsets[k]:row_offsets[k + 1]
    ) -> None:
        """Each row of a request with logits processors through them, with its node's history. A
        row whose processor fails is left as it is and noted (`_processor_failures`): its request
        fails if its accepted path reaches that row, alone."""
        if not any(h is not None for h in histories):
            return
        # read-only prompts for the processors, made once a call
        prompts = [tuple(r.prompt_token_ids) if h is not None else () for r, h in zip(requests, histories)]
        for j, row in enumerate(rows):
            k = bisect.bisect_right(row_offsets, row) - 1
            request, item_histories = requests[k], histories[k]
            if item_histories is None:
                continue
            node, params = row - row_offsets[k], request.params
            try:
                logits[j] = apply_logits_processors(
                    logits[j],
                    params.logits_processors or (),
                    arities=params.logits_processor_arities,
                    prompt_token_ids=prompts[k],
                    output_token_ids=item_histories[node],
                )
            except LogitsProcessorError as err:
                self._processor_failures.setdefault(request.request_id, {})[node] = err

    def _commit(
        self,
        item: ScheduledRequest,
        *,
        proposal: Proposal | None,
        drafted: Proposal | None,  # the drafter's own tree (proposal is it after a grammar's cut)
        kept_nodes: list[int] | None,  # proposal node -> drafted node, when a grammar cut the tree
        accepted: AcceptedPath | None,
        logprobs: list[TokenLogprobs | None],  # per committed token
        features: torch.Tensor | None,  # [kept tokens, L * D] when the drafter reads features (_kept_features)
        now: float,
    ) -> None:
        """Every state change of one request's step: cache, tokens, metrics, drafter, retirement."""
        request = item.request
        start = request.num_computed_tokens
        num_known, path = _committed_rows(item, proposal, accepted)
        # Keep the accepted path's KV (root included), moved to the positions of its depths.
        self.cache.compact(
            request.scheduled_slot,
            source=[start + num_known + node for node in path],
            destination_start=start + num_known,
        )
        request.num_computed_tokens = start + num_known + len(path)
        self.cache.commit(request.scheduled_slot, request.num_computed_tokens)
        if accepted is not None:
            request.metrics.num_target_forwards += 1
            # Committed token j was chosen from the logits after path node j.
            for token, token_logprobs in zip(accepted.committed_token_ids, logprobs):
                if request.append_token(token, now=now, logprobs=token_logprobs):
                    break
        size, slot = self.cache.block_size, request.scheduled_slot
        if self.config.enable_prefix_caching and request.num_computed_tokens // size > len(self.cache.block_keys(slot)):
            # Blocks filled and not keyed yet: shareable from now on (most commits fill none).  Keyed
            # after the accepted tokens are appended: a verified path's KV holds them already.
            self.cache.cache_full_blocks(slot, request.all_token_ids)
        if self.speculator is not None:
            if kept_nodes is not None and accepted is not None:  # the drafter's node numbering: the
                # path as far as it stays in the drafter's tree (appended forced tokens are not)
                accepted = path_in_child(accepted, {new: old for new, old in enumerate(kept_nodes) if old >= 0})
            self.speculator.commit(
                request,
                features=features,
                block_keys=self.cache.block_keys(request.scheduled_slot) if self.config.enable_prefix_caching else None,
                proposal=drafted,
                accepted=accepted,
            )
        if request.is_finished:
            self._retire(request)

    def _record_step(
        self,
        *,
        plan: list[ScheduledRequest],
        drafts: dict[str, Proposal],
        num_tokens: int,
        decode_only: bool,
        num_decodes: int,
        draft_seconds: float,
        verify_seconds: float,
    ) -> None:
        if self.speculator is not None:
            self.speculator.observe_step(
                num_requests=len(plan),
                num_tokens=num_tokens,
                forward_seconds=verify_seconds,
                decode_only=decode_only,
                num_decodes=num_decodes,
                num_drafted_requests=len(drafts),
                draft_seconds=draft_seconds,
                num_draft_tokens=sum(p.num_draft_tokens for p in drafts.values()),
            )
        if drafts:
            self.metrics.draft_seconds += draft_seconds
            self.metrics.verify_seconds += verify_seconds
            for item in plan:
                item.request.metrics.draft_seconds += draft_seconds
                item.request.metrics.verify_seconds += verify_seconds

    def _path_logprobs(
        self,
        requests: list[Request],
        paths: list[AcceptedPath],
        logits: StepLogits,  # the step's rows; every path's are computed
        row_offsets: list[int],  # request k's node rows start at row_offsets[k]
    ) -> list[list[TokenLogprobs | None]]:
        """Per request, the logprobs of each committed token (None where not asked for), in one
        call: as config.logprobs_mode says, each with its rank in its row."""
        result: list[list[TokenLogprobs | None]] = [[None] * len(path.nodes) for path in paths]
        wanted = [k for k, request in enumerate(requests) if request.params.logprobs is not None]
        if not wanted:  # gathering the rows copies megabytes: only when asked
            return result
        rows = [row_offsets[k] + node for k in wanted for node in paths[k].nodes]
        tokens = [token for k in wanted for token in paths[k].committed_token_ids]
        num_top = max(requests[k].params.logprobs or 0 for k in wanted)
        values = logits.gather(rows)  # [len(rows), V]
        mode = self.config.logprobs_mode
        if mode.startswith("processed"):
            contexts = [  # the j-th committed token was chosen after the path's first j
                row_context(requests[k], requests[k].output_token_ids + paths[k].committed_token_ids[:j])
                for k in wanted
                for j in range(len(paths[k].nodes))
            ]
            values = processed_logits(values, contexts, eos_token_ids=self.eos_token_ids)
        token_ids = torch.tensor(tokens, device=values.device)  # [len(rows)]
        token_lp, top_ids, top_lp, rank_of = token_logprobs(
            values, token_ids, num_top, normalize=mode.endswith("logprobs")
        )
        ranks = rank_of.tolist()
        flat = 0
        for k in wanted:
            top = requests[k].params.logprobs
            for j in range(len(paths[k].nodes)):
                result[k][j] = make_token_logprobs(
                    token_id=tokens[flat],
                    logprob=float(token_lp[flat]),
                    top_ids=top_ids[flat, :top].tolist(),
                    top_logprobs=top_lp[flat, :top].tolist(),
                    tokenizer=self.tokenizer,
                    rank=ranks[flat],
                )
                flat += 1
        return result

    def _delta(self, request: Request) -> StreamDelta:
        text, tokens = request.take_stream_delta()
        return StreamDelta(
            request_id=request.request_id,
            text=text,
            token_ids=tokens,
            finished=request.is_finished,
            finish_reason=request.finish_reason,
            output=request.to_output() if request.is_finished else None,
        )


def _first_failure(
    path: AcceptedPath, failures: dict[int, LogitsProcessorError] | None
) -> tuple[int, LogitsProcessorError] | None:
    """(position on the path, error) of the first path node whose row a logits processor failed
    on; rows off the path were never used and do not count."""
    if not failures:
        return None
    for position, node in enumerate(path.nodes):
        if node in failures:
            return position, failures[node]
    return None


def _path_before(path: AcceptedPath, position: int) -> AcceptedPath | None:
    """The path's tokens chosen before its node at `position` (None for the root: no token):
    committed token j was chosen from node j's row, so the first `position` of them stand."""
    if position == 0:
        return None
    return AcceptedPath(
        nodes=path.nodes[:position],
        num_accepted=position - 1,
        committed_token_ids=path.committed_token_ids[:position],
        bonus=False,
    )


def _committed_rows(
    item: ScheduledRequest, proposal: Proposal | None, accepted: AcceptedPath | None
) -> tuple[int, list[int]]:
    """The rows of an item's forward that its commit keeps: the fed tokens before the proposal's
    root (a prefill chunk's; all of them when nothing is verified), then the accepted path's
    nodes (the root first)."""
    num_known = item.num_new_tokens - (proposal is not None)
    return num_known, accepted.nodes if accepted is not None else []


def _kept_features(
    features: torch.Tensor | None,  # [N, L * D] the step's features, or None
    *,
    plan: list[ScheduledRequest],
    proposals: list[Proposal | None],
    accepted: list[AcceptedPath | None],
    row_starts: list[int],
) -> list[torch.Tensor | None]:
    """Per item, the features [kept, L * D] of the rows its commit keeps (fed tokens before the
    proposal's root, then the accepted path), each a tensor of its own: the drafter and the
    prefix cache's feature blocks keep them as they are, and a view would keep the whole step's
    features alive (a copy head keeps a plainly decoding request's rows for many steps).  Made in
    one or two torch calls for the step, not one per request: in a server each call hands the GIL
    to its event loop's thread and waits to get it back (32 clients, adaptive eagle3 decoding
    plainly: a copy per request cost 5% of the server's throughput, none in one process)."""
    if features is None:
        return [None] * len(plan)
    rows: list[int] = []
    sizes = []
    for item, proposal, path, start in zip(plan, proposals, accepted, row_starts):
        num_known, nodes = _committed_rows(item, proposal, path)
        rows += range(start, start + num_known)
        rows += [start + num_known + node for node in nodes]
        sizes.append(num_known + len(nodes))
    if rows != list(range(features.shape[0])):
        features = features[torch.tensor(rows, device=features.device)]
    # torch's stubs type split_with_sizes_copy by its out= form (returning None); it returns the pieces
    pieces = torch.split_with_sizes_copy(features, sizes)  # type: ignore[func-returns-value]
    return list(cast("list[torch.Tensor]", pieces))


def _sparse_tokens(
    request: Request, proposal: Proposal | None, masks: TreeMasks | None
) -> list[list[int] | None] | None:
    """Per node of the item's proposal, the few tokens its row can be (None: the whole LM head).
    A grammar's narrow rows; else, for a request that asks no logprobs (they read the whole
    row), its allowed_token_ids when they are few: every other token is -inf either way."""
    if masks is not None:
        return masks.sparse_tokens
    allowed = request.params.allowed_token_ids
    if proposal is None or allowed is None or len(allowed) > SPARSE_ROW_LIMIT or request.params.logprobs is not None:
        return None
    tokens = sorted(set(allowed))
    return [tokens] * proposal.tree.num_nodes


def _measured_first_rows(model: Decoder, *, wide: int = 16) -> int:
    """How many LM-head rows cost about what reading the head once does: a walk's first rows
    are computed together, as the forward would; rows past them only where a walk reaches them.
    0 (every row in the forward) where `wide` rows cost less than twice one: the head is bound
    by reading its weights, and a row computed later would read them again."""
    hidden = model.embed(torch.zeros(wide, dtype=torch.long))  # [wide, D] (measured on the CPU only)

    model.compute_logits(hidden)  # first call: the kernel's set-up

    def seconds(rows: int) -> float:
        times = []
        for _ in range(2):
            started = time.perf_counter()
            model.compute_logits(hidden[:rows])
            times.append(time.perf_counter() - started)
        return min(times)

    one, all_rows = seconds(1), seconds(wide)
    if all_rows < 2 * one:
        return 0
    return max(1, round(one / (all_rows / wide)))


def _features(captured: dict[int, torch.Tensor], layers: tuple[int, ...]) -> torch.Tensor | None:
    """The captured layers' outputs side by side: [N, len(layers) * D], or None."""
    if not layers:
        return None
    return torch.cat([captured[layer] for layer in layers], dim=-1)


def _read_max_positions(model_dir) -> int:
    from quickdraft.models.loader import read_hf_config

    hf = read_hf_config(model_dir)
    hf = hf.get("text_config", hf)
    return int(hf.get("max_position_embeddings", DEFAULT_MAX_MODEL_LEN))
