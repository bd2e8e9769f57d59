"""The engine: requests in, one step at a time, outputs out.

A step: the scheduler plans which requests feed which tokens; the runner turns the plan
into one forward; the sampler turns the logits of the rows that end a known sequence into
tokens; requests commit them, check their stops, and finished ones free their slot.
"""

from __future__ import annotations

import itertools
import time

import torch

from quickdraft.config import EngineConfig, SpeculativeConfig
from quickdraft.drafters import default_registry
from quickdraft.drafters.base import Proposal, TargetInfo
from quickdraft.engine.request import Request, make_token_logprobs
from quickdraft.engine.runner import ModelRunner, SequenceWork
from quickdraft.engine.scheduler import ScheduledRequest, Scheduler
from quickdraft.engine.speculation import Speculator
from quickdraft.kernels.argmax import argmax_rows
from quickdraft.kv.cache import KVCache
from quickdraft.models.loader import (
    load_decoder,
    resolve_device,
    resolve_dtype,
    resolve_gguf_path,
    resolve_model_dir,
    resolve_quantization,
)
from quickdraft.models.tokenizer import Tokenizer
from quickdraft.outputs import EngineMetrics, StreamDelta, TokenLogprobs
from quickdraft.sampling_params import SamplingParams
from quickdraft.verify.sampler import (
    RowContext,
    compute_logprobs,
    logits_to_probs,
    make_generator,
    position_key,
    sample_keyed,
    samples_by_argmax,
)

DEFAULT_MAX_MODEL_LEN = 4096
# Storage beyond max_model_len, so that a step's new tokens (a prefill chunk's tail or a
# draft tree) always have room to be written before they are accepted or dropped.
CACHE_HEADROOM = 64


class Engine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype)
        self.model_dir = model_dir = resolve_model_dir(config.model)
        gguf_path = resolve_gguf_path(config.model)
        self.quantization = resolve_quantization(
            config.quantization, dtype=config.dtype, gguf_path=gguf_path, device=self.device
        )
        probe = _read_max_positions(model_dir)  # reads config.json first: the clearest error
        self.tokenizer = Tokenizer.from_dir(model_dir)
        self.max_model_len = config.max_model_len or min(probe, DEFAULT_MAX_MODEL_LEN)
        if self.max_model_len > probe:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's context {probe}")
        cache_len = self.max_model_len + CACHE_HEADROOM
        self.model, self.model_config = load_decoder(
            model_dir,
            dtype=self.dtype,
            device=self.device,
            max_len=cache_len,
            quantization=self.quantization,
            gguf_path=gguf_path,
        )
        self.cache = KVCache(
            num_layers=self.model_config.num_layers,
            num_slots=config.max_num_seqs,
            num_kv_heads=self.model_config.num_kv_heads,
            head_dim=self.model_config.head_dim,
            max_len=cache_len,
            dtype=self.dtype,
            device=self.device,
        )
        self.runner = ModelRunner(model=self.model, cache=self.cache, device=self.device)
        self.scheduler = Scheduler(
            cache=self.cache, max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens
        )
        self.eos_token_ids = list(
            dict.fromkeys(list(self.tokenizer.eos_token_ids) + list(self.model_config.eos_token_ids))
        )
        self._requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._seed_generator = torch.Generator()  # draws the seeds of unseeded requests
        self._seed_generator.manual_seed(config.seed)
        self.metrics = EngineMetrics()
        self._speculator: Speculator | None = None
        self.speculator = self._make_speculator(config.speculative_config)

    @property
    def speculator(self) -> Speculator | None:
        return self._speculator

    @speculator.setter
    def speculator(self, speculator: Speculator | None) -> None:
        self._speculator = speculator
        self.scheduler.draft_reserve = speculator.draft_reserve if speculator is not None else 0

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

    def _check_idle(self, what: str) -> None:
        if self.has_unfinished_requests():
            raise RuntimeError(f"cannot change {what} while requests are running")

    def _make_speculator(self, spec) -> Speculator | None:
        if spec is None:
            return None
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
        try:
            drafter = default_registry().create(
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
    ) -> str:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        token_ids = self._prompt_tokens(prompt, prompt_token_ids)
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        # Unseeded requests get a seed from the engine's generator (seeded by EngineConfig.seed),
        # returned in their output so that an answer can be replayed.
        seed = (
            params.seed
            if params.seed is not None
            else int(torch.randint(0, 2**62, (1,), generator=self._seed_generator))
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
        )
        self._requests[request_id] = request
        self.scheduler.add(request)
        return request_id

    def _prompt_tokens(self, prompt: str | None, prompt_token_ids: list[int] | None) -> list[int]:
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
            bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt_token_ids has ids outside [0, {vocab}): {bad[:5]}")
        if not token_ids:
            raise ValueError("the prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens, but max_model_len is {self.max_model_len}: "
                f"no room to generate (shorten the prompt or raise max_model_len)"
            )
        return token_ids

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its slot; False when it is unknown or already done."""
        request = self._requests.get(request_id)
        if request is None or request.is_finished:
            return False
        request.finish(reason="abort")
        self._retire(request)
        return True

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

    # ---- the step ---------------------------------------------------------------------
    def step(self) -> list[StreamDelta]:
        started = time.perf_counter()
        plan = self.scheduler.schedule()
        if not plan:
            return []
        for item in plan:
            if item.request.metrics.first_scheduled_time is None:
                item.request.metrics.first_scheduled_time = started
        # Before any commit changes the requests (one may finish inside its accepted path).
        decode_only = all(item.num_new_tokens == 1 and item.completes_prompt for item in plan)
        proposals = self._propose(plan)
        drafted = time.perf_counter()
        work = [self._work_for(item, proposals.get(item.request.request_id)) for item in plan]
        # Rows that end a known sequence without a draft: sampled like plain decoding.
        sampled_rows = [
            i for i, item in enumerate(plan) if item.completes_prompt and item.request.request_id not in proposals
        ]
        feature_layers = self.speculator.feature_layers if self.speculator is not None else ()
        out = self.runner.forward(work, capture_layers=feature_layers)
        features = _features(out.forward.captured, feature_layers)  # [N, L * D] or None
        row_starts = list(itertools.accumulate((len(w.token_ids) for w in work), initial=0))
        for i, item in enumerate(plan):
            if item.request.request_id not in proposals:
                item.request.num_computed_tokens += item.num_new_tokens
                self.cache.commit(item.request.scheduled_slot, item.request.num_computed_tokens)
                if features is not None and self.speculator is not None:  # before sampling: finishing releases
                    self.speculator.observe(item.request, features[row_starts[i] : row_starts[i + 1]])
        if sampled_rows:
            assert out.logits is not None  # rows that end a known sequence ask for logits
            rows = torch.tensor([out.logits_offsets[i] for i in sampled_rows], device=self.device)
            self._sample_and_commit([plan[i].request for i in sampled_rows], out.logits[rows])
        for i, item in enumerate(plan):
            proposal = proposals.get(item.request.request_id)
            if proposal is not None:
                assert out.logits is not None  # every tree node asks for logits
                logits = out.logits[out.logits_offsets[i] : out.logits_offsets[i + 1]]
                tree_features = None if features is None else features[row_starts[i] : row_starts[i + 1]]
                self._verify_and_commit(item.request, proposal, logits, tree_features)
        finished = time.perf_counter()
        if self.speculator is not None:
            self.speculator.observe_step(
                num_requests=len(plan),
                num_tokens=row_starts[-1],
                forward_seconds=finished - drafted,
                decode_only=decode_only,
                num_drafted_requests=len(proposals),
                draft_seconds=drafted - started,
                num_draft_tokens=sum(p.num_draft_tokens for p in proposals.values()),
            )
        if proposals:
            self.metrics.draft_seconds += drafted - started
            self.metrics.verify_seconds += finished - drafted
            for item in plan:
                item.request.metrics.draft_seconds += drafted - started
                item.request.metrics.verify_seconds += finished - drafted
        return [self._delta(item.request) for item in plan]

    def _propose(self, plan: list[ScheduledRequest]) -> dict[str, Proposal]:
        if self.speculator is None:
            return {}
        decoding = [item.request for item in plan if item.num_new_tokens == 1 and item.completes_prompt]
        if not decoding:
            return {}
        room = {r.request_id: self.cache.max_len - r.num_computed_tokens for r in decoding}
        # Draft nodes count against max_num_batched_tokens like any fed token: an equal share each.
        share = self.scheduler.draft_room(plan) // len(decoding)
        return self.speculator.propose(decoding, cache_room=room, token_room={r.request_id: share for r in decoding})

    def _work_for(self, item: ScheduledRequest, proposal: Proposal | None) -> SequenceWork:
        req = item.request
        start = req.num_computed_tokens
        if proposal is not None:
            return SequenceWork(
                slot=req.scheduled_slot,
                cache_len=start,
                token_ids=proposal.token_ids,
                parents=proposal.parents,
                logits_nodes=list(range(len(proposal.token_ids))),
            )
        tokens = req.all_token_ids[start : start + item.num_new_tokens]
        logits_nodes = [item.num_new_tokens - 1] if item.completes_prompt else []
        return SequenceWork(slot=req.scheduled_slot, cache_len=start, token_ids=tokens, logits_nodes=logits_nodes)

    def _verify_and_commit(
        self, request: Request, proposal: Proposal, logits: torch.Tensor, tree_features: torch.Tensor | None
    ) -> None:
        # logits [num_nodes, V]; tree_features [num_nodes, L * D] when the drafter reads features
        speculator = self.speculator
        assert speculator is not None  # only drafted requests are verified
        accepted = speculator.verify(
            request=request, proposal=proposal, logits=logits, eos_token_ids=self.eos_token_ids
        )
        cache_len = request.num_computed_tokens
        # Keep the accepted path's KV (root included), moved to the positions of its depths.
        self.cache.compact(
            request.scheduled_slot, source=[cache_len + node for node in accepted.nodes], destination_start=cache_len
        )
        request.num_computed_tokens = cache_len + len(accepted.nodes)
        self.cache.commit(request.scheduled_slot, request.num_computed_tokens)
        if tree_features is not None:
            speculator.observe(request, tree_features[accepted.nodes])
        request.metrics.num_target_forwards += 1
        # Committed token j was chosen from the logits after path node j.
        logprob_rows: list[TokenLogprobs | None] = [None] * len(accepted.nodes)
        if request.params.logprobs is not None:  # gathering the rows copies megabytes: only when asked
            logprob_rows = self._logprobs(
                [request] * len(accepted.nodes), logits[accepted.nodes], accepted.committed_token_ids
            )
        now = time.perf_counter()
        for token, token_logprobs in zip(accepted.committed_token_ids, logprob_rows):
            if request.append_token(token, now=now, logprobs=token_logprobs):
                break
        speculator.record(request=request, proposal=proposal, accepted=accepted)
        if request.is_finished:
            self._retire(request)

    def _sample_and_commit(self, requests: list[Request], logits: torch.Tensor) -> None:
        # logits [len(requests), V]: one row per request that completed its known tokens
        if all(samples_by_argmax(r.params, num_output_tokens=len(r.output_token_ids)) for r in requests):
            # The distribution would be one-hots of these argmaxes: skip building [R, V] of them.
            tokens = argmax_rows(logits).tolist()
        else:
            rows = [
                RowContext(params=r.params, prompt_token_ids=r.prompt_token_ids, output_token_ids=r.output_token_ids)
                for r in requests
            ]
            probs = logits_to_probs(logits, rows, eos_token_ids=self.eos_token_ids)
            keys = [position_key(r.seed, len(r.output_token_ids)) for r in requests]
            tokens = sample_keyed(probs, keys).tolist()
        logprob_rows = self._logprobs(requests, logits, tokens)
        now = time.perf_counter()
        for req, token, token_logprobs in zip(requests, tokens, logprob_rows):
            req.metrics.num_target_forwards += 1
            if req.append_token(token, now=now, logprobs=token_logprobs):
                self._retire(req)

    def _logprobs(self, requests: list[Request], logits: torch.Tensor, tokens: list[int]):
        wanted = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
        result: list[TokenLogprobs | None] = [None] * len(requests)
        if not wanted:
            return result
        num_top = max(requests[i].params.logprobs or 0 for i in wanted)
        index = torch.tensor(wanted, device=logits.device)
        token_lp, top_ids, top_lp = compute_logprobs(
            logits[index], torch.tensor([tokens[i] for i in wanted], device=logits.device), num_top
        )
        for row, i in enumerate(wanted):
            k = requests[i].params.logprobs
            result[i] = make_token_logprobs(
                token_id=tokens[i],
                logprob=float(token_lp[row]),
                top_ids=top_ids[row, :k].tolist(),
                top_logprobs=top_lp[row, :k].tolist(),
                tokenizer=self.tokenizer,
            )
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
