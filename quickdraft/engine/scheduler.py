"""Continuous batching in plain Python: who runs this step, and with how many new tokens.

Every step, each running request feeds the tokens whose KV is not yet cached: a whole or
partial prompt (chunked prefill), or the one token sampled last step (decode).  Decodes go
first so a long prompt never stalls the requests already generating; prefill chunks fill
the rest of the token budget.  Waiting requests join when a cache slot is free and the cache
has blocks for their first chunk (and, for one that runs a LoRA adapter, when its adapter is
running already or fewer than max_loras are: the others behind it go on).

Blocks are reserved here, before the forward: a request whose next token finds no free block
preempts the newest running requests (they give their blocks back and wait first in line to
recompute, cheaply where the prefix cache still holds their blocks), so a full cache makes
requests wait and never fails a step.  With the default pool (every slot's worst case) none of
this happens.

Policies (vLLM's `scheduling_policy`): "fcfs" serves in order of arrival; "priority" orders the
waiting line by (priority, arrival), lower values first, lets running requests take blocks in
that order and preempts the running request that comes last in it.  A waiting request never
evicts a running one: it takes the next free place.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from quickdraft.config import SCHEDULING_POLICIES
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
        self,
        *,
        cache: KVCache,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_prefix_caching: bool = False,
        policy: str = "fcfs",
        max_loras: int = 1,
    ):
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {list(SCHEDULING_POLICIES)}, got {policy!r}")
        self.policy = policy
        self._arrivals = itertools.count()  # ties of priority go to the earlier arrival
        self.cache = cache
        self.enable_prefix_caching = enable_prefix_caching
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_loras = max_loras  # distinct LoRA adapters among the running requests
        # Draft tree nodes a decode may add to the forward (set by the engine from its speculator):
        # held back from prefill chunks, so that drafts are not squeezed out by a long prompt.
        self.draft_reserve = 0
        # The speculator's say on which cached blocks a hit may cover (None: any).
        self.prefix_usable: Callable[[bytes], bool] | None = None
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in order of admission
        self.preempted: list[Request] = []  # by the last schedule(): their drafter state is stale

    def add(self, request: Request) -> None:
        request.queue_key = (request.priority if self.policy == "priority" else 0, next(self._arrivals))
        self._wait(request, preempted=False)

    def _wait(self, request: Request, *, preempted: bool) -> None:
        """Into the waiting line: at its (priority, arrival) place, or (fcfs) at the back, and at
        the front when preempted (first in line to recompute)."""
        if self.policy == "priority":
            keys = [waiting.queue_key for waiting in self.waiting]
            self.waiting.insert(bisect.bisect(keys, request.queue_key), request)
        elif preempted:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    def _by_precedence(self) -> list[Request]:
        """Running requests in the order they take blocks and budget: admission (fcfs) or
        (priority, arrival)."""
        if self.policy == "priority":
            return sorted(self.running, key=lambda request: request.queue_key)
        return list(self.running)

    def _victim(self) -> Request:
        """The running request preempted when blocks lack: the newest (fcfs), or the one last in
        (priority, arrival) order."""
        if self.policy == "priority":
            return max(self.running, key=lambda request: request.queue_key)
        return self.running[-1]

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledRequest]:
        self.preempted = []
        self._admit_waiting()
        budget = self.max_num_batched_tokens
        decodes, prefills = [], []
        for req in self._by_precedence():  # oldest first: a decode that lacks blocks preempts newer requests
            if req.num_tokens - req.num_computed_tokens == 1 and self._reserve(req, req.num_computed_tokens + 1):
                decodes.append(ScheduledRequest(req, 1))
        for item in decodes:  # then room for draft nodes where the pool allows: drafts never preempt
            req = item.request
            if req.status == RequestStatus.RUNNING:
                self.cache.try_reserve(req.scheduled_slot, req.num_computed_tokens + 1 + self.draft_reserve)
        budget -= len(decodes)
        # Held back for the decodes' draft nodes, but never more than half of what prefill would
        # get: a waiting prompt is delayed, not starved.
        budget -= min(len(decodes) * self.draft_reserve, max(0, budget) // 2)
        for req in self._by_precedence():
            pending = req.num_tokens - req.num_computed_tokens
            if pending > 1 and budget > 0 and req in self.running:
                chunk = self._fit(req, min(pending, budget))
                if chunk:
                    prefills.append(ScheduledRequest(req, chunk))
                    budget -= chunk
        # A prefill that preempted newer requests may have taken a decode's place.
        return [item for item in decodes + prefills if item.request.status == RequestStatus.RUNNING]

    def draft_room(self, plan: list[ScheduledRequest]) -> int:
        """Tokens of this step's budget left for draft nodes once `plan` is fed."""
        return max(0, self.max_num_batched_tokens - sum(item.num_new_tokens for item in plan))

    def _fit(self, req: Request, chunk: int) -> int:
        """The longest part of a prefill chunk (whole blocks) the cache can hold, reserved; when
        not even one token fits, newer requests are preempted for one (0: req itself was)."""
        start, slot, size = req.num_computed_tokens, req.scheduled_slot, self.cache.block_size
        end = start + chunk
        while end > start:
            if self.cache.try_reserve(slot, end):
                return end - start
            end = (end - 1) // size * size  # the previous block boundary
        return 1 if self._reserve(req, start + 1) else 0

    def _reserve(self, req: Request, num_tokens: int) -> bool:
        """Reserve storage for req, preempting the newest running requests while blocks lack;
        False when req itself had to be preempted."""
        while not self.cache.try_reserve(req.scheduled_slot, num_tokens):
            victim = self._victim()
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        """Give back a running request's blocks; it waits first in line and recomputes its tokens
        (from the prefix cache where they are still cached): its output so far is kept."""
        self.running.remove(req)
        self.cache.free(req.scheduled_slot)
        req.slot = None
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.metrics.num_preemptions += 1
        self._wait(req, preempted=True)  # under priority, its arrival keeps it ahead of later ones of its rank
        self.preempted.append(req)

    def _admit_waiting(self) -> None:
        """Admit waiting requests in order while slots and blocks allow. One waiting for blocks a
        running prefill computes is passed over (it stays first in line): the others behind it
        need not wait for that prefill; one that lacks blocks stops the line (first come, first
        served for the cache)."""
        position = 0
        while position < len(self.waiting) and len(self.running) < self.max_num_seqs and self.cache.num_free_slots:
            req = self.waiting[position]
            if not self._adapter_fits(req):
                position += 1  # its adapter waits for one of the running ones to finish; others go on
                continue
            # Cached full blocks of the prompt start the slot's tables: their tokens count as computed.
            prefix = (
                self.cache.find_prefix(req.all_token_ids, usable=self.prefix_usable, salt=req.prefix_salt)
                if self.enable_prefix_caching and not req.needs_prompt_rows
                else None
            )
            if prefix is not None and self._prefill_computing_blocks_of(req, cached=prefix.num_tokens):
                position += 1  # it waits for them to be cached
                continue
            slot = self.cache.allocate(prefix=prefix, salt=req.prefix_salt)
            computed = prefix.num_tokens if prefix is not None else 0
            first_chunk = computed + min(req.num_tokens - computed, self.max_num_batched_tokens)
            if self.running and not self.cache.can_reserve(slot, first_chunk):
                self.cache.free(slot)  # no blocks for it yet: it waits for running requests to finish
                return
            del self.waiting[position]
            req.slot = slot
            req.num_computed_tokens = computed
            req.num_skipped_tokens = computed
            if req.metrics.num_preemptions == 0:
                req.metrics.num_cached_tokens = computed
            self.cache.commit(slot, computed)
            req.status = RequestStatus.RUNNING
            self.running.append(req)

    def _adapter_fits(self, req: Request) -> bool:
        """Whether req may run beside the running requests: its LoRA adapter (if any) is one of
        theirs or one more within max_loras."""
        if req.lora is None:
            return True
        running = {other.lora.key for other in self.running if other.lora is not None}
        return req.lora.key in running or len(running) < self.max_loras

    def _prefill_computing_blocks_of(self, req: Request, *, cached: int) -> bool:
        """Whether a running request's prefill (of the same cache_salt and adapter) is computing full blocks
        that req's tokens start with beyond its `cached` tokens.  Waiting until they are cached beats computing them a
        second time beside it (the n completions of one prompt; prompts that share a long system
        prompt), as SGLang's in-batch prefix sharing does: on a CPU, where a prefill is bound by
        its multiplies, the waiting request's first token comes no later, and the first's sooner."""
        token_ids, size = req.all_token_ids, self.cache.block_size
        reusable = (len(token_ids) - 1) // size * size  # a hit leaves the last token to compute
        if reusable <= cached:
            return False
        for other in self.running:
            if other.num_tokens - other.num_computed_tokens <= 1 or other.prefix_salt != req.prefix_salt:
                continue  # decoding (what it shares is cached already), or blocks it may not share
            shared = _shared_full_blocks(token_ids[:reusable], other.prompt_token_ids, size=size)
            if shared > max(cached, other.num_computed_tokens // size * size):
                return True
        return False

    def finish(self, request: Request) -> None:
        """Drop a finished (or aborted) request and free its cache slot at once."""
        if request in self.running:
            self.running.remove(request)
            assert request.slot is not None  # running requests hold a slot
            self.cache.free(request.slot)
            request.slot = None
        elif request in self.waiting:
            self.waiting.remove(request)


def _shared_full_blocks(first: list[int], second: list[int], *, size: int) -> int:
    """Tokens in the whole blocks of `size` that both lists start with (compared a block at a time)."""
    shared, limit = 0, min(len(first), len(second))
    while shared + size <= limit and first[shared : shared + size] == second[shared : shared + size]:
        shared += size
    return shared
