"""A smaller model with the target's vocabulary drafts a chain of K tokens per step.

The draft model has its own KV cache, one slot per request, kept in step with the target:

- before drafting, every committed token it has not seen yet (the previous step's
  recovered/bonus token, plus the last draft token after a full accept) is fed as one
  catch-up chunk; the last of them is the root, whose logits give the first draft;
- drafting feeds draft tokens 1..K-1, one forward per depth for all requests at once;
- after verification the cache keeps only what was accepted: a length rollback, no copy.

Greedy requests draft the draft model's argmax (point masses, ``draft_probs=None``).
Sampled requests draft from the draft model's distribution after the request's own
sampling parameters, and return those rows as ``draft_probs``, so the rejection sampler
accepts with min(1, p/q) and resamples from the residual: exact either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quickdraft.drafters.base import AcceptedPath, DraftRequest, Proposal, TargetInfo
from quickdraft.engine.runner import ModelRunner, SequenceWork
from quickdraft.kv.cache import KVCache
from quickdraft.models.loader import load_decoder, resolve_model_dir
from quickdraft.verify.sampler import RowContext, logits_to_probs, make_generator, sample_from_probs

# Room past max_model_len for the drafted tokens that are fed before verification.
DRAFT_HEADROOM = 64


@dataclass
class _DraftState:
    slot: int
    generator: torch.Generator | None
    context_len: int = 0  # committed tokens when the last proposal was made
    fed_drafts: int = 0  # draft tokens fed into the cache by that proposal


class DraftModelDrafter:
    def __init__(self, *, num_speculative_tokens: int = 5, model: str | None = None,
                 target: TargetInfo, seed: int = 0):
        if not model:
            raise ValueError("method 'draft_model' needs a draft 'model' (HF directory or .gguf file)")
        self.num_speculative_tokens = num_speculative_tokens
        self.device = target.device
        max_len = target.max_model_len + DRAFT_HEADROOM
        self.model, config = load_decoder(resolve_model_dir(model), dtype=target.dtype, device=target.device,
                                          max_len=max_len)
        if config.vocab_size != target.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({config.vocab_size} tokens) differs from the "
                             f"target's ({target.vocab_size}): a draft model must share the target's tokenizer")
        self.cache = KVCache(num_layers=config.num_layers, num_slots=target.max_num_seqs,
                             num_kv_heads=config.num_kv_heads, head_dim=config.head_dim, max_len=max_len,
                             dtype=target.dtype, device=target.device)
        self.runner = ModelRunner(model=self.model, cache=self.cache, device=target.device)
        self.seed = seed
        self._states: dict[str, _DraftState] = {}

    # ---- lifecycle --------------------------------------------------------------------
    def begin(self, request: DraftRequest) -> None:
        self._state(request)

    def _state(self, request: DraftRequest) -> _DraftState:
        state = self._states.get(request.request_id)
        if state is None:
            params = request.params
            seed = params.seed if params is not None and params.seed is not None else self.seed + len(self._states)
            # A generator of its own: drafting must not shift the request's target-side draws.
            state = _DraftState(slot=self.cache.allocate(), generator=make_generator(seed + 7919, self.device))
            self._states[request.request_id] = state
        return state

    def finish(self, request_id: str) -> None:
        state = self._states.pop(request_id, None)
        if state is not None:
            self.cache.free(state.slot)

    def accept(self, request: DraftRequest, accepted: AcceptedPath) -> None:
        state = self._states.get(request.request_id)
        if state is None:
            return
        # Fed: every committed token up to the root, then drafts 1..fed_drafts; keep the accepted ones.
        keep = state.context_len + min(accepted.num_accepted, state.fed_drafts)
        self.cache.commit(state.slot, min(keep, self.cache.lengths[state.slot]))
        state.fed_drafts = 0

    # ---- propose ----------------------------------------------------------------------
    def propose(self, requests: list[DraftRequest]) -> list[Proposal | None]:
        lengths = [min(self.num_speculative_tokens, r.budget, r.max_depth) for r in requests]
        active = [i for i, k in enumerate(lengths) if k >= 1]
        drafts: dict[int, list[int]] = {i: [] for i in active}
        rows: dict[int, list[torch.Tensor | None]] = {i: [] for i in active}
        feed = {i: self._catch_up_tokens(requests[i]) for i in active}
        for depth in range(max(lengths, default=0)):
            active = [i for i in active if depth < lengths[i]]
            if not active:
                break
            logits = self._forward(requests, active, feed)  # [len(active), V]
            for row, i in enumerate(active):
                token, probs = self._choose(requests[i], drafts[i], logits[row : row + 1])
                drafts[i].append(token)
                rows[i].append(probs)
                feed[i] = [token]
        proposals: list[Proposal | None] = []
        for i, request in enumerate(requests):
            if not drafts.get(i):
                proposals.append(None)
                continue
            state = self._states[request.request_id]
            state.context_len = len(request.prompt_token_ids) + len(request.output_token_ids)
            state.fed_drafts = len(drafts[i]) - 1
            self.cache.commit(state.slot, state.context_len + state.fed_drafts)
            proposals.append(Proposal.chain(request.token_ids[-1], drafts[i],
                                            draft_probs=self._draft_probs(rows[i])))
        return proposals

    def _catch_up_tokens(self, request: DraftRequest) -> list[int]:
        state = self._state(request)
        tokens = request.token_ids
        return tokens[self.cache.lengths[state.slot] :]

    def _forward(self, requests: list[DraftRequest], active: list[int], feed: dict[int, list[int]]) -> torch.Tensor:
        work = []
        for i in active:
            state = self._states[requests[i].request_id]
            tokens = feed[i]
            work.append(SequenceWork(slot=state.slot, cache_len=self.cache.lengths[state.slot], token_ids=tokens,
                                     logits_nodes=[len(tokens) - 1]))
        out = self.runner.forward(work)
        for item in work:
            self.cache.commit(item.slot, item.cache_len + len(item.token_ids))
        return out.logits

    def _choose(self, request: DraftRequest, drafted: list[int], logits: torch.Tensor):
        # logits [1, V] -> (token, draft distribution row [V] or None for a greedy point mass)
        params = request.params
        if params is None or params.is_greedy:
            return int(logits[0].argmax()), None
        row = RowContext(params=params, prompt_token_ids=request.prompt_token_ids,
                         output_token_ids=request.output_token_ids + drafted)
        probs = logits_to_probs(logits, [row])  # [1, V]
        token = int(sample_from_probs(probs, [self._states[request.request_id].generator])[0])
        return token, probs[0]

    @staticmethod
    def _draft_probs(rows: list[torch.Tensor | None]) -> torch.Tensor | None:
        """[K + 1, V] with an unused root row, or None when the drafts are point masses."""
        if rows[0] is None:
            return None
        return torch.cat([torch.zeros_like(rows[0])[None], torch.stack(rows)])
