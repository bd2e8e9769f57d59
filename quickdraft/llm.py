"""The offline API, shaped like vLLM's: LLM(model=...).generate(prompts, SamplingParams(...))."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

from quickdraft.config import EngineConfig, check_ranks_by_logprobs
from quickdraft.engine.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from quickdraft.engine.engine import Engine
from quickdraft.engine.parallel_sampling import child_params, child_request_ids, children_seed, merged_output
from quickdraft.models.chat import ChatRendering, render_chat
from quickdraft.models.generation_config import default_sampling_fields
from quickdraft.models.lora import LoRARequest
from quickdraft.outputs import EngineMetrics, RequestOutput, StreamDelta
from quickdraft.pooling import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingParams,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
    cosine_similarity,
    score_pairs,
)
from quickdraft.sampling_params import DEFAULT_MAX_LOGPROBS, SamplingParams
from quickdraft.structured.tools import resolve_tool_calling

if TYPE_CHECKING:
    import torch

PromptType = str | list[int] | dict[str, Any]


@dataclass
class _Group:
    """The engine requests of one prompt of a generate call (params.num_samples of them)."""

    parent_id: str
    seed: int | None  # None: one unseeded completion (the engine draws the request's seed)
    request_ids: list[str]
    n: int  # completions returned: the n best of the children where best_of > n
    keep_logprobs: bool  # the request asked for logprobs (else a best_of ranking's are dropped)

    def merged(self, outputs: dict[str, RequestOutput]) -> RequestOutput:
        children = [outputs[request_id] for request_id in self.request_ids]
        return merged_output(self.parent_id, children, seed=self.seed, n=self.n, keep_logprobs=self.keep_logprobs)


class LLM:
    """Load a model once, then generate for batches of prompts with continuous batching.

    >>> llm = LLM()                      # the embedded Gemma 3 270M (GGUF Q4_K_M, run as stored)
    >>> out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
    >>> out[0].outputs[0].text
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str = "auto",
        quantization: str | None = None,
        device: str = "cpu",
        max_model_len: int | None = None,
        max_num_seqs: int = 8,
        max_num_batched_tokens: int = 512,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        kv_cache_memory_bytes: int | None = None,
        kv_cache_dtype: str = "auto",
        seed: int = 0,
        speculative_config: dict | None = None,
        speculative_model: str | None = None,
        num_speculative_tokens: int | None = None,
        tensor_parallel_size: int = 1,
        lazy_logits_rows: int | None = None,
        weights_in_huge_pages: bool | None = None,
        generation_config: str = "auto",
        override_generation_config: dict[str, Any] | None = None,
        scheduling_policy: str = "fcfs",
        enable_lora: bool = False,
        max_loras: int = 1,
        max_lora_rank: int = 16,
        max_cpu_loras: int | None = None,
        hf_overrides: dict[str, Any] | None = None,
        logprobs_mode: str = "raw_logprobs",
        max_logprobs: int = DEFAULT_MAX_LOGPROBS,
    ):
        """`generation_config` (vLLM's): "auto" takes the sampling an HF model directory's
        generation_config.json recommends as the defaults of `get_default_sampling_params()`
        (what `generate` uses without sampling params); "vllm" ignores it; or a directory
        holding one.  `override_generation_config` replaces some of its keys.  `hf_overrides`
        (vLLM's) replaces keys of the model's config.json; with classifier_from_token it reads a
        causal LM as a reranker, e.g. the original Qwen3-Reranker: {"architectures":
        ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
        "is_original_qwen3_reranker": True}."""
        speculative_config = _merge_speculative_args(speculative_config, speculative_model, num_speculative_tokens)
        self._default_sampling = default_sampling_fields(
            model, source=generation_config, overrides=override_generation_config
        )
        self.config = EngineConfig(
            model=model,
            dtype=dtype,
            quantization=quantization,
            device=device,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            block_size=block_size,
            enable_prefix_caching=enable_prefix_caching,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            kv_cache_dtype=kv_cache_dtype,
            seed=seed,
            speculative_config=speculative_config,
            tensor_parallel_size=tensor_parallel_size,
            lazy_logits_rows=lazy_logits_rows,
            weights_in_huge_pages=weights_in_huge_pages,
            scheduling_policy=scheduling_policy,
            enable_lora=enable_lora,
            max_loras=max_loras,
            max_lora_rank=max_lora_rank,
            max_cpu_loras=max_cpu_loras,
            hf_overrides=hf_overrides,
            logprobs_mode=logprobs_mode,
            max_logprobs=max_logprobs,
        )
        self.engine = Engine(self.config)

    def close(self) -> None:
        """Stop the tensor-parallel followers (tensor_parallel_size > 1); also done when the LLM
        is garbage-collected or the interpreter exits."""
        self.engine.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        """The tokenizer (vLLM's accessor; also the `tokenizer` property)."""
        return self.engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's); True once done (requests must not be running)."""
        self.engine.reset_prefix_cache()
        return True

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """New weights for the target, as (checkpoint name, tensor) pairs: all of them or a
        bucket at a time, as an RL trainer sends its policy between rollouts (vLLM's
        model.load_weights; quickdraft/models/weight_updates.py).  Returns the model tensors
        changed.  Bad input (an unknown name, a wrong shape, a quantized format that cannot be
        rebuilt) is a ValueError that changes nothing.  The prefix cache is dropped; the drafter
        stays as it is, and speculation stays exact."""
        return self.engine.load_weights(weights)

    def get_default_sampling_params(self) -> SamplingParams:
        """The sampling a prompt gets without SamplingParams: the model's generation config
        (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens) over
        SamplingParams' own defaults, as vLLM's LLM does."""
        return SamplingParams(**self._default_sampling)

    def get_metrics(self) -> EngineMetrics:
        """Aggregate metrics over every request this engine finished."""
        return self.engine.metrics

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the order of the prompts.

        A prompt is a string, a list of token ids, or {"prompt": str} / {"prompt_token_ids": [...]},
        optionally with "cache_salt" (prefix-cache blocks are shared only with prompts of that salt).
        use_tqdm: a progress bar of the prompts done (vLLM's argument; off by default here).
        priority: one per prompt, lower first (vLLM's; needs scheduling_policy="priority").
        lora_request: the LoRA adapter for every prompt, or one per prompt (None: the base model);
        needs enable_lora=True.
        """
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = _as_params_list(sampling_params, len(prompt_list))
        priorities = [0] * len(prompt_list) if priority is None else list(priority)
        if len(priorities) != len(prompt_list):
            raise ValueError(f"priority: {len(priorities)} values for {len(prompt_list)} prompts")
        adapters = _per_prompt(lora_request, len(prompt_list), name="lora_request")
        # Validate every prompt before any is queued: a bad one must not leave the others running.
        groups: list[_Group] = []
        try:
            for prompt, params, rank, adapter in zip(prompt_list, params_list, priorities, adapters):
                group = self._new_group(params)
                groups.append(group)  # first: a failure aborts every child (an id not added is ignored)
                for request_id, child in zip(
                    group.request_ids, child_params(params, seed=group.seed, logprobs_mode=self.config.logprobs_mode)
                ):
                    self._add(prompt, child, request_id=request_id, priority=rank, lora_request=adapter)
        except Exception:
            for request_id in (request_id for group in groups for request_id in group.request_ids):
                self.engine.abort_request(request_id)
                self.engine.release(request_id)
            raise
        outputs: dict[str, RequestOutput] = {}
        group_of = {request_id: group for group in groups for request_id in group.request_ids}
        progress = _progress_bar(len(groups), enabled=use_tqdm)
        while len(outputs) < len(group_of):
            for delta in self.engine.step():
                group = group_of.get(delta.request_id)
                if delta.finish_reason == "error" and group is not None:
                    self._raise_failure(delta.request_id, list(group_of))
                if delta.finished and group is not None:
                    outputs[delta.request_id] = delta.output
                    if all(request_id in outputs for request_id in group.request_ids):
                        progress.update(1)
        progress.close()
        for request_id in group_of:
            self.engine.release(request_id)
        return [group.merged(outputs) for group in groups]

    def stream(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        *,
        lora_request: LoRARequest | None = None,
    ) -> Iterator[StreamDelta]:
        """Yield the text and tokens each step adds; the last delta carries the full output.
        With n > 1 the deltas of the n completions come interleaved, each under its `index` and
        `finished` at its own end; only the very last carries `output` (all n of them)."""
        params = sampling_params if sampling_params is not None else self.get_default_sampling_params()
        if params.num_samples > params.n:
            raise ValueError("best_of > n cannot be streamed: which completions are best is known only at the end")
        group = self._new_group(params)
        try:
            one_prompt = _as_prompt_list(prompt)[0]
            for request_id, child in zip(
                group.request_ids, child_params(params, seed=group.seed, logprobs_mode=self.config.logprobs_mode)
            ):
                self._add(one_prompt, child, request_id=request_id, lora_request=lora_request)
            index_of = {request_id: index for index, request_id in enumerate(group.request_ids)}
            finished: dict[str, RequestOutput] = {}
            while len(finished) < len(index_of):
                for delta in self.engine.step():
                    index = index_of.get(delta.request_id)
                    if index is None:
                        continue
                    if delta.finish_reason == "error":
                        self._raise_failure(delta.request_id, list(index_of))
                    if delta.finished:
                        finished[delta.request_id] = delta.output
                    if not (delta.text or delta.token_ids or delta.finished):
                        continue
                    if len(index_of) == 1:
                        yield delta
                        continue
                    done = len(finished) == len(index_of)
                    yield dataclasses.replace(
                        delta, request_id=group.parent_id, index=index, output=group.merged(finished) if done else None
                    )
        finally:
            # A consumer that stops early aborts the requests and frees their slots.
            for request_id in group.request_ids:
                self.engine.abort_request(request_id)
                self.engine.release(request_id)

    def chat(
        self,
        messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        use_tqdm: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, via the chat template.

        `tools` (OpenAI's function tools) go to the template as `tools`, or, for a template that
        does not read them, into a system message that lists them and asks for calls written as
        <tool_call>{"name": ..., "arguments": {...}}</tool_call> (as vLLM, the reply is not parsed
        here; constrain it with `SamplingParams(structured_outputs=...)` to force a call).
        `continue_final_message` (with add_generation_prompt=False) leaves the last message open
        for the reply to continue; `chat_template_kwargs` become further template variables.
        """
        rendering = ChatRendering(
            template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            variables=dict(chat_template_kwargs or {}),
            calling=None
            if not tools
            else resolve_tool_calling(tools=tools, tool_choice="auto", parallel_tool_calls=None),
        )
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conversation in conversations:
            text = render_chat(
                self.tokenizer,
                list(conversation),  # type: ignore[arg-type]
                rendering,
                missing_template="pass chat_template=..., or use generate() with a prompt",
            )
            prompts.append({"prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False), "prompt": text})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        *,
        use_tqdm: bool = False,
        lora_request: LoRARequest | None = None,
    ) -> list[BeamSearchOutput]:
        """The beam_width best continuations of each prompt by summed logprob (vLLM's
        `LLM.beam_search`; engine/beam_search.py): max_tokens rounds, each expanding every live
        beam of every prompt by one token in one batch, the prefix cache sharing what beams have in
        common. Outputs in the order of the prompts, each's beams best first."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be BeamSearchParams, got {type(params).__name__}")
        check_ranks_by_logprobs(self.config.logprobs_mode, what="beam search")
        token_ids = [self._prompt_token_ids(prompt) for prompt in _as_prompt_list(prompts)]
        search = BeamSearch(
            token_ids, params, eos_token_ids=self.engine.eos_token_ids, max_model_len=self.engine.max_model_len
        )
        progress = _progress_bar(params.max_tokens, enabled=use_tqdm)
        while not search.done:
            pending = [{"prompt_token_ids": tokens} for tokens in search.pending()]
            outputs = self.generate(pending, params.round_params(), lora_request=lora_request)
            search.advance([output.outputs[0].logprobs[0].top for output in outputs])  # type: ignore[index]
            progress.update(1)
        progress.close()
        return search.results(decode=lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True))

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = False,
    ) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding (vLLM's `LLM.embed`; quickdraft/pooling.py): the model's final
        hidden states pooled (as the model's directory says, else the last token's), through its
        modules after pooling, and normalized.  Outputs in the order of the prompts; every prompt
        is checked before any runs."""
        params = _pooling_params(pooling_params, truncate_prompt_tokens)
        token_ids = [self._prompt_token_ids(prompt) for prompt in _as_prompt_list(prompts)]
        self.engine.pooler.check(params)
        runs = self._pool_each(
            token_ids, self._embed_one(params), keep=params.truncate_prompt_tokens, use_tqdm=use_tqdm
        )
        return [EmbeddingRequestOutput(rid, EmbeddingOutput(vector.tolist()), kept) for rid, vector, kept in runs]

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | None = None,
        *,
        pooling_task: str | None = None,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = False,
    ) -> list[PoolingRequestOutput]:
        """Each prompt's result of a pooling task (vLLM's `LLM.encode`), as a float32 tensor in
        `.outputs.data`: "embed" [D] (what `embed` gives), "classify" [num_labels] (what
        `classify` gives), "token_embed" [T, D] (every prompt token's final state through the
        model's modules after pooling, cut and normalized as an embedding is), "token_classify"
        [T, num_labels] (the classifier's probabilities at every token).  No task named: the
        model's own ("classify" for a classifier, else "embed").  Outputs in the order of the
        prompts; every prompt and the task are checked before any runs."""
        pooler = self.engine.pooler
        task = pooler.default_task if pooling_task is None else pooling_task
        pooler.check_task(task)
        params = _pooling_params(pooling_params, truncate_prompt_tokens)
        pooler.check(params)
        token_ids = [self._prompt_token_ids(prompt) for prompt in _as_prompt_list(prompts)]
        runs = self._pool_each(
            token_ids,
            lambda ids: self.engine.pool([ids], params, task=task)[0],
            keep=params.truncate_prompt_tokens,
            use_tqdm=use_tqdm,
        )
        return [PoolingRequestOutput(rid, PoolingOutput(data), kept) for rid, data, kept in runs]

    def _pool_each(
        self,
        token_ids: list[list[int]],
        run: Callable[[list[int]], torch.Tensor],
        *,
        keep: int | None,
        use_tqdm: bool,
    ) -> list[tuple[str, torch.Tensor, list[int]]]:
        """(request id, run(ids), the ids kept after truncation to the last `keep`) of each prompt,
        run one after another in order (embed, classify and a reranker's pairs)."""
        results = []
        progress = _progress_bar(len(token_ids), enabled=use_tqdm)
        for ids in token_ids:
            kept = ids if keep is None else ids[-keep:]
            results.append((self.engine.new_request_id(), run(ids), kept))
            progress.update(1)
        progress.close()
        return results

    def score(
        self,
        data_1: PromptType | Sequence[PromptType],
        data_2: PromptType | Sequence[PromptType],
        /,
        *,
        truncate_prompt_tokens: int | None = None,
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = False,
    ) -> list[ScoringRequestOutput]:
        """Scores of text pairs (vLLM's `LLM.score`).  One first text pairs with every second one
        (1:N), or the i-th with the i-th (N:N).  A reranker (a classifier of one label) reads each
        pair as one prompt, the first text's tokens then the second's without special tokens, and
        scores it with its head's sigmoid; an embedding model scores the cosine of the two texts'
        embeddings (`embed`), each distinct text embedded once."""
        firsts, seconds = _as_prompt_list(data_1), _as_prompt_list(data_2)
        pairs = score_pairs(len(firsts), len(seconds))
        pooler = self.engine.pooler
        if pooler.classifier is not None and not pooler.cross_encoder:
            raise ValueError(
                f"score needs an embedding model or a reranker (a classifier of one label); this classifier has "
                f"{pooler.classifier.num_labels} labels: use classify"
            )
        if pooler.cross_encoder:
            return self._cross_encoder_scores(firsts, seconds, pairs, truncate_prompt_tokens, use_tqdm=use_tqdm)
        texts = [self._prompt_token_ids(prompt) for prompt in firsts + seconds]
        params = _pooling_params(pooling_params, truncate_prompt_tokens)
        pooler.check(params)
        distinct = [list(ids) for ids in dict.fromkeys(tuple(ids) for ids in texts)]
        runs = self._pool_each(distinct, self._embed_one(params), keep=None, use_tqdm=use_tqdm)
        vectors = {tuple(ids): vector for _, vector, ids in runs}
        keep = params.truncate_prompt_tokens
        outputs = []
        for i, j in pairs:
            first, second = tuple(texts[i]), tuple(texts[len(firsts) + j])
            kept = [token for ids in (first, second) for token in (ids if keep is None else ids[-keep:])]
            score = ScoringOutput(cosine_similarity(vectors[first], vectors[second]))
            outputs.append(ScoringRequestOutput(self.engine.new_request_id(), score, kept))
        return outputs

    def _cross_encoder_scores(
        self,
        firsts: list[PromptType],
        seconds: list[PromptType],
        pairs: list[tuple[int, int]],
        truncate_prompt_tokens: int | None,
        *,
        use_tqdm: bool,
    ) -> list[ScoringRequestOutput]:
        prompts = self.tokenizer.cross_encoder_prompts(
            firsts,
            seconds,
            pairs,
            token_ids=lambda inputs, specials: [self._prompt_token_ids(p, add_special_tokens=specials) for p in inputs],
        )
        runs = self._pool_each(
            prompts, self._classify_one(truncate_prompt_tokens), keep=truncate_prompt_tokens, use_tqdm=use_tqdm
        )
        return [ScoringRequestOutput(rid, ScoringOutput(float(probs[0])), kept) for rid, probs, kept in runs]

    def _embed_one(self, params: PoolingParams) -> Callable[[list[int]], torch.Tensor]:
        return lambda ids: self.engine.embed([ids], params)[0]

    def _classify_one(self, truncate_prompt_tokens: int | None) -> Callable[[list[int]], torch.Tensor]:
        return lambda ids: self.engine.classify([ids], truncate_prompt_tokens=truncate_prompt_tokens)[0]

    def classify(
        self,
        prompts: PromptType | Sequence[PromptType],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = False,
    ) -> list[ClassificationRequestOutput]:
        """Each prompt's class probabilities (vLLM's `LLM.classify`) from a *ForSequenceClassification
        checkpoint's head on the last token's final state: a softmax over its labels (a sigmoid for a
        single label); the labels are `llm.engine.pooler.classifier.labels`."""
        token_ids = [self._prompt_token_ids(prompt) for prompt in _as_prompt_list(prompts)]
        runs = self._pool_each(
            token_ids, self._classify_one(truncate_prompt_tokens), keep=truncate_prompt_tokens, use_tqdm=use_tqdm
        )
        return [
            ClassificationRequestOutput(rid, ClassificationOutput(probs.tolist()), kept) for rid, probs, kept in runs
        ]

    def _prompt_token_ids(self, prompt: PromptType, *, add_special_tokens: bool = True) -> list[int]:
        """A prompt's token ids, as generate would feed them (a text gets the tokenizer's BOS)."""
        given = _prompt_input(prompt)
        if given.token_ids is not None:
            return list(given.token_ids)
        if not isinstance(given.text, str):  # the engine's message for such a prompt
            raise TypeError(f"prompt must be a string, got {type(given.text).__name__}")
        return self.tokenizer.encode(given.text, add_special_tokens=add_special_tokens)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load a LoRA adapter before its first request (vLLM's); raises naming what is wrong with it."""
        return self.engine.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.engine.remove_lora(lora_int_id)

    def list_loras(self) -> set[int]:
        """The lora_int_ids of the loaded adapters."""
        return self.engine.list_loras()

    def _raise_failure(self, failed_id: str, request_ids: list[str]) -> NoReturn:
        """A request of the call failed (its logits processors raised): stop the call's other
        requests, free them, and raise its error."""
        error = self.engine.get_request(failed_id).error
        for request_id in request_ids:
            self.engine.abort_request(request_id)
            self.engine.release(request_id)
        raise error if error is not None else RuntimeError(f"request {failed_id} failed")

    def _new_group(self, params: SamplingParams) -> _Group:
        """The engine request ids of one prompt's completions (best_of, else n), and their seed
        (drawn for several when the params have none: engine/parallel_sampling.py)."""
        parent_id = self.engine.new_request_id()
        seed = children_seed(params, draw_seed=self.engine.draw_seed)
        return _Group(
            parent_id=parent_id,
            seed=seed,
            request_ids=child_request_ids(parent_id, params.num_samples),
            n=params.n,
            keep_logprobs=params.logprobs is not None,
        )

    def _add(
        self,
        prompt: PromptType,
        params: SamplingParams,
        *,
        request_id: str | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> str:
        given = _prompt_input(prompt)
        added = self.engine.add_request(
            prompt=given.text if given.token_ids is None else None,
            prompt_token_ids=given.token_ids,
            params=params,
            request_id=request_id,
            priority=priority,
            cache_salt=given.cache_salt,
            lora_request=lora_request,
        )
        if given.token_ids is not None:
            self.engine.get_request(added).prompt = given.text  # shown beside the ids, where given
        return added


@dataclass
class _PromptInput:
    """A prompt as given: its text, its token ids (given as such), and its cache salt."""

    text: str | None  # with token ids, the text shown beside them (None: none given)
    token_ids: list[int] | None
    cache_salt: str | None = None


def _prompt_input(prompt: PromptType) -> _PromptInput:
    """A string, a token-id list, or {"prompt": ...} / {"prompt_token_ids": [...]} with an
    optional "cache_salt" (vLLM's: cache blocks shared only under one salt)."""
    if isinstance(prompt, str):
        return _PromptInput(text=prompt, token_ids=None)
    if isinstance(prompt, dict):
        salt = prompt.get("cache_salt")
        if "prompt_token_ids" in prompt:
            return _PromptInput(text=prompt.get("prompt"), token_ids=prompt["prompt_token_ids"], cache_salt=salt)
        if "prompt" in prompt:
            return _PromptInput(text=prompt["prompt"], token_ids=None, cache_salt=salt)
        raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, list):
        return _PromptInput(text=None, token_ids=prompt)
    raise TypeError(f"unsupported prompt type {type(prompt).__name__}")


def _pooling_params(given: PoolingParams | None, truncate_prompt_tokens: int | None) -> PoolingParams:
    """The pooling parameters asked for (the defaults when none), with `truncate_prompt_tokens` when given."""
    params = PoolingParams() if given is None else given
    if not isinstance(params, PoolingParams):
        raise TypeError(f"pooling_params must be PoolingParams, got {type(params).__name__}")
    if truncate_prompt_tokens is not None:
        params = dataclasses.replace(params, truncate_prompt_tokens=truncate_prompt_tokens)
    return params


def _progress_bar(total: int, *, enabled: bool):
    """A tqdm bar of prompts done, or a stand-in that shows nothing."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Processed prompts", unit="prompt", disable=not enabled)


def _as_prompt_list(prompts) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty string, token-id list, or list of those")
    return list(prompts)


def _per_prompt(value, count: int, *, name: str) -> list:
    """One value for every prompt, or a sequence of one per prompt."""
    if value is None or not isinstance(value, (list, tuple)):
        return [value] * count
    if len(value) != count:
        raise ValueError(f"{name}: {len(value)} values for {count} prompts")
    return list(value)


def _as_params_list(params, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(count)]
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"{len(params)} sampling_params for {count} prompts")
    for p in params:
        if not isinstance(p, SamplingParams):
            raise TypeError(f"sampling_params entries must be SamplingParams, got {type(p).__name__}")
    return params


def _merge_speculative_args(config: dict | None, model: str | None, num_tokens: int | None) -> dict | None:
    """Accept the older spelling LLM(speculative_model=..., num_speculative_tokens=...) too."""
    if model is None and num_tokens is None:
        return config
    merged = dict(config or {})
    if model is not None:
        merged.setdefault("model", model)
    if num_tokens is not None:
        merged["num_speculative_tokens"] = num_tokens
    if "method" not in merged and "model" not in merged:
        raise ValueError("num_speculative_tokens needs a speculative method or model")
    return merged
