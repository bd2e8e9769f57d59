"""Continuous batching in plain Python: who runs this step, and with how many new tokens.

Every step, each running request feeds the tokens whose KV is not yet cached: a whole or
partial prompt (chunked prefill), or the one token sampled last step (decode).  Decodes go
first so a long prompt never stalls the requests already generating; prefill chunks fill
the rest of the token budget.  Waiting requests join as soon as a cache slot is free.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from quickdraft.engine.request import Request, RequestStatus
from quickdraft.kv.cache import KVCache


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens fed to the model this step

    @property
    def completes_prompt(self) -> bool:
        """True when, after this step, every known token is in the cache (logits needed)."""
        req = self.request
        return req.num_computed_tokens + self.num_new_tokens == req.num_tokens


class Scheduler:
    def __init__(
        self, *, cache: KVCache, max_num_seqs: int, max_num_batched_tokens: int, enable_prefix_caching: bool = False
    ):
        self.cache = cache
        self.enable_prefix_caching = enable_prefix_caching
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # Draft tree nodes a decode may add to the forward (set by the engine from its speculator):
        # held back from prefill chunks, so that drafts are not squeezed out by a long prompt.
        self.draft_reserve = 0
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledRequest]:
        self._admit_waiting()
        budget = self.max_num_batched_tokens
        decodes, prefills = [], []
        for req in self.running:
            pending = req.num_tokens - req.num_computed_tokens
            if pending == 1:
                decodes.append(ScheduledRequest(req, 1))
        budget -= len(decodes)
        # Held back for the decodes' draft nodes, but never more than half of what prefill would
        # get: a waiting prompt is delayed, not starved.
        budget -= min(len(decodes) * self.draft_reserve, max(0, budget) // 2)
        for req in self.running:
            pending = req.num_tokens - req.num_computed_tokens
            if pending > 1 and budget > 0:
                chunk = min(pending, budget)
                prefills.append(ScheduledRequest(req, chunk))
                budget -= chunk
        return decodes + prefills

    def draft_room(self, plan: list[ScheduledRequest]) -> int:
        """Tokens of this step's budget left for draft nodes once `plan` is fed."""
        return max(0, self.max_num_batched_tokens - sum(item.num_new_tokens for item in plan))

    def _admit_waiting(self) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs and self.cache.num_free_slots:
            req = self.waiting.popleft()
            # Cached full blocks of the prompt start the slot's table: their tokens count as computed.
            prefix = self.cache.prefix_blocks(req.all_token_ids) if self.enable_prefix_caching else []
            req.slot = self.cache.allocate(prefix=prefix)
            req.num_computed_tokens = len(prefix) * self.cache.block_size
            req.metrics.num_cached_tokens = req.num_computed_tokens
            self.cache.commit(req.slot, req.num_computed_tokens)
            req.status = RequestStatus.RUNNING
            self.running.append(req)

    def finish(self, request: Request) -> None:
        """Drop a finished (or aborted) request and free its cache slot at once."""
        if request in self.running:
            self.running.remove(request)
            assert request.slot is not None  # running requests hold a slot
            self.cache.free(request.slot)
            request.slot = None
        elif request in self.waiting:
            self.waiting.remove(request)
