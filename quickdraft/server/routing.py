"""Which replica takes a request: cache-aware routing with bounded loads (no Ray in here).

A replica answers a prompt faster when its prefix cache already holds the prompt's start (an
earlier turn of the conversation, a shared RAG template) and its suffix drafter has seen the
conversation. So the router keys a request on its prompt *text* (the ingress does not tokenize:
the replica does, and the text's prefixes are the token ids' prefixes for the same template):
the text is cut into chunks of `chunk_chars` characters and each chunk gets a chained hash
(chunk i's hash covers chunks 0..i), so two prompts share the hashes of exactly the chunks
they share from the start.

How a cache-aware policy ranks the replicas for one request:

1. **Holders.** The replicas that took the longest known chained hash of this prompt (a
   table of recent hashes -> replicas, LRU-bounded), least loaded first: they hold that prefix.
2. **The others, least loaded first**, equal loads in rendezvous order: by a hash of (first
   chunk, replica id), highest first. A new prefix thus goes where there is room (spreading
   the conversations evenly matters more than where they start), and on an idle or evenly
   loaded deployment every router (several ingresses, a restarted one) picks the same replica
   for it without sharing state.
3. **Bounded load.** A replica may take the request only while its requests in flight stay
   within ``ceil(load_factor * (all in flight + 1) / replicas)`` (consistent hashing with
   bounded loads, Mirrokni, Thorup and Zadeghaddam 2018); those past the bound go to the end
   of the ranking, least loaded first. One hot prefix thus spreads once its holder is
   ``load_factor`` times busier than the mean; the replica it spills to becomes a holder too,
   and the holders share it from then on.

A prompt with no text (a GET, a body that is not JSON) ranks replicas least loaded first. The
round-robin policy (the comparison baseline) ignores prefixes and loads.

Each policy also counts why each request went where it went (`RoutingPolicy.decisions`, one
reason per routed request; the reasons are listed in each policy's docstring), which the
ingress exposes as `quickdraft_router_decisions_total{policy, reason}`.
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

ROUTING_POLICIES = ("cache_aware", "round_robin")
DEFAULT_CHUNK_CHARS = 128  # about 32 tokens of English: two 16-token KV blocks
# A prompt's first chunks only: past this many (64k characters, above any context served
# here) the hashes would cost time and table room without changing where the prompt goes.
MAX_CHUNKS = 512
HASH_BYTES = 8

# Why a routed request went to its replica (one per request, counted in RoutingPolicy.decisions).
PREFIX_HIT = "prefix_hit"
PREFIX_SPILL = "prefix_spill"
NEW_PREFIX = "new_prefix"
NO_PREFIX = "no_prefix"
ROUND_ROBIN = "round_robin"
FAN_OUT = "fan_out"


@dataclass(frozen=True)
class RouteHint:
    """What the router knows of one call: its prompt's chained chunk hashes, replicas to avoid."""

    prefix_hashes: tuple[int, ...] = ()  # chained hashes of the prompt text's leading chunks
    # Replicas this call must not go to (the ingress asks each replica in turn for /metrics
    # and /health); when it names every replica, the ranking holds them all.
    avoid: frozenset[str] = field(default_factory=frozenset)
    # One of those per-replica queries, not a client's request: counted as `fan_out`.
    fan_out: bool = False


def prefix_hashes(text: str, *, chunk_chars: int = DEFAULT_CHUNK_CHARS) -> tuple[int, ...]:
    """Chained hashes of text's whole chunks of chunk_chars characters (a partial last chunk is left out).

    Only whole chunks count, so a prompt and its continuation (the next turn) agree on every
    hash the shorter one has.
    """
    if not isinstance(chunk_chars, int) or isinstance(chunk_chars, bool) or chunk_chars < 1:
        raise ValueError(f"chunk_chars must be a positive integer, got {chunk_chars!r}")
    hashes = []
    previous = b""
    for start in range(0, min(len(text) // chunk_chars, MAX_CHUNKS) * chunk_chars, chunk_chars):
        digest = hashlib.blake2b(previous + text[start : start + chunk_chars].encode(), digest_size=HASH_BYTES).digest()
        hashes.append(int.from_bytes(digest, "little"))
        previous = digest
    return tuple(hashes)


# SageMaker's /invocations (server/api.py): the first field of these that a body has picks the
# route that answers it, so a request with a mistake gets that route's own error naming it.
INVOCATION_FIELDS = (
    ("messages", "/v1/chat/completions"),
    ("prompt", "/v1/completions"),
    ("query", "/v1/rerank"),
    ("text_1", "/v1/score"),
    ("input", "/v1/embeddings"),  # /v1/classify on a model with a classification head
)


def invoked_route(body: dict, *, classifier: bool) -> str | None:
    """The route an /invocations body goes to; None when it has none of INVOCATION_FIELDS."""
    for name, path in INVOCATION_FIELDS:
        if name in body:
            return "/v1/classify" if name == "input" and classifier else path
    return None


def routing_text(path: str, body: Any) -> str:
    """The prompt text a request is routed on ("" when it has none).

    Completions: the prompt (a string; token ids as their decimal text). Chat: each message's
    role and text content, separated by control characters that no rendering template uses
    as content, so a conversation's next turn starts with its previous turn's text. Both after
    the request's cache_salt, where it has one. /invocations: as the route its body picks.
    """
    if not isinstance(body, dict):
        return ""
    # A cache_salt starts the text: requests of one salt meet where its blocks are, apart from
    # the same prompt under another salt (which could not use them).
    salt = body.get("cache_salt")
    start = f"\x1dsalt\x1e{salt}\x1d" if isinstance(salt, str) else ""
    if path == "/invocations":  # routed as the route its body picks (the classifier's is not routed on)
        path = invoked_route(body, classifier=False) or ""
    if path.endswith("/chat/completions"):
        messages = body.get("messages")
        if not isinstance(messages, list):
            return ""
        return start + "".join(_message_text(message) for message in messages)
    if path.endswith("/completions"):
        return start + _prompt_text(body.get("prompt"))
    return ""


def _message_text(message: Any) -> str:
    if not isinstance(message, dict):
        return ""
    return f"{message.get('role', '')}\x1f{_content_text(message.get('content'))}\x1e"


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: [{"type": "text", "text": ...}, ...]
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return ""


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return _prompt_text(prompt[0])  # a batch: its first prompt (a batch's prompts often share a start)
    if isinstance(prompt, list) and all(isinstance(token, int) for token in prompt):
        return "".join(f"{token} " for token in prompt)
    return ""


class RoutingPolicy:
    """Ranks replicas for a request and keeps what it needs from the requests it routed.

    Bookkeeping only (replica ids as strings, counts as ints): the Ray router calls `rank`
    when a request arrives, `on_routed` once the request is sent, `on_completed` when it ends
    and `forget` when a replica dies.

    `decisions` counts the routed requests by the reason their replica was chosen (the
    subclass's `reasons`, every one present from the start at 0): it only grows, `forget`
    leaves it alone, and its counts add up to the requests routed. `fan_out` (any policy):
    one of the ingress's queries to every replica in turn (/health, /metrics), not a client's
    request.
    """

    name = ""
    reasons: tuple[str, ...] = (FAN_OUT,)

    def __init__(self) -> None:
        self.in_flight: dict[str, int] = {}
        # Its keys never change after this, so another thread may copy it while the router counts.
        self.decisions: dict[str, int] = dict.fromkeys(self.reasons, 0)

    def rank(self, replicas: Sequence[str], hint: RouteHint | None = None) -> list[str]:
        raise NotImplementedError

    def on_routed(self, replica: str, hint: RouteHint | None = None, replicas: Sequence[str] | None = None) -> None:
        """Count why `replica` took the request, then its load (a subclass learns from it after this).

        `replicas`: the candidates the request was ranked among (the router's replicas now);
        None when unknown (see the subclass's reasons).
        """
        reason = FAN_OUT if hint is not None and hint.fan_out else self._reason(replica, hint, replicas)
        self.decisions[reason] += 1
        self.in_flight[replica] = self.in_flight.get(replica, 0) + 1

    def on_completed(self, replica: str) -> None:
        if self.in_flight.get(replica, 0) > 0:
            self.in_flight[replica] -= 1

    def forget(self, replica: str) -> None:
        self.in_flight.pop(replica, None)

    def _reason(self, replica: str, hint: RouteHint | None, replicas: Sequence[str] | None) -> str:
        """Why `replica` took a client's request, from what the policy knows before learning from it."""
        raise NotImplementedError

    def _eligible(self, replicas: Sequence[str], hint: RouteHint | None) -> list[str]:
        if not replicas:
            raise ValueError("no replica to route to")
        avoid = hint.avoid if hint is not None else frozenset()
        kept = [replica for replica in replicas if replica not in avoid]
        return kept or list(replicas)

    def _least_loaded(self, replicas: Sequence[str]) -> list[str]:
        return sorted(replicas, key=lambda replica: self.in_flight.get(replica, 0))  # stable: ties keep order


class RoundRobinPolicy(RoutingPolicy):
    """Each request to the next replica in turn, prefixes and loads ignored (the baseline).

    Its reasons: `round_robin` for every client request, `fan_out` for the ingress's
    per-replica queries.
    """

    name = "round_robin"
    reasons = (ROUND_ROBIN, FAN_OUT)

    def __init__(self) -> None:
        super().__init__()
        self._turn = 0

    def rank(self, replicas: Sequence[str], hint: RouteHint | None = None) -> list[str]:
        eligible = sorted(self._eligible(replicas, hint))
        start = self._turn % len(eligible)
        self._turn += 1
        return eligible[start:] + eligible[:start]

    def _reason(self, replica: str, hint: RouteHint | None, replicas: Sequence[str] | None) -> str:
        return ROUND_ROBIN


class CacheAwarePolicy(RoutingPolicy):
    """Holders of the longest known prefix, then the least loaded; both within a load bound.

    Why a request went to its replica (`decisions`), decided when it is routed, against the
    prefix table as it was before this request (the replica becomes a holder only after), with
    `holders` over the same eligible replicas as `rank` (the candidates less those avoided):

    - `prefix_hit`: the replica holds the longest prefix of the prompt that any eligible
      replica holds (it took an earlier prompt with that start: its cache likely has it).
    - `prefix_spill`: an eligible replica held a prefix of the prompt, but the request went to
      one that does not hold the longest (it may hold a shorter one): the holders were past the
      load bound, or Ray Serve passed over them (queue full, unreachable).
    - `new_prefix`: the prompt has whole chunks (prefix hashes) but no eligible replica holds
      any of them: a new conversation or template, placed by load and rendezvous order.
    - `no_prefix`: no hint, or a prompt shorter than one chunk (a GET, a body that is not JSON,
      a short prompt): placed by load alone.
    - `fan_out`: one of the ingress's queries to every replica (/health, /metrics).

    When the router does not name the candidates (`replicas` None), every replica the prefix
    table names for the prompt, and the chosen one, count as candidates.
    """

    name = "cache_aware"
    reasons = (PREFIX_HIT, PREFIX_SPILL, NEW_PREFIX, NO_PREFIX, FAN_OUT)

    def __init__(self, *, load_factor: float = 1.25, max_prefixes: int = 65536):
        super().__init__()
        if isinstance(load_factor, bool) or not isinstance(load_factor, (int, float)) or not load_factor >= 1:
            raise ValueError(f"load_factor must be a number >= 1, got {load_factor!r}")
        if not isinstance(max_prefixes, int) or isinstance(max_prefixes, bool) or max_prefixes < 1:
            raise ValueError(f"max_prefixes must be a positive integer, got {max_prefixes!r}")
        self.load_factor = float(load_factor)
        self.max_prefixes = max_prefixes
        # chained hash -> the replicas that took a prompt with that prefix, in the order they took it
        self._holders: OrderedDict[int, tuple[str, ...]] = OrderedDict()

    def load_bound(self, num_replicas: int) -> int:
        """Requests in flight a replica may hold after taking one more."""
        total = sum(self.in_flight.values()) + 1
        return math.ceil(self.load_factor * total / num_replicas)

    def holders(self, hint: RouteHint | None, eligible: Sequence[str]) -> list[str]:
        """The eligible replicas that took the longest prefix of this prompt seen so far."""
        if hint is None:
            return []
        for chained in reversed(hint.prefix_hashes):
            held = [replica for replica in self._holders.get(chained, ()) if replica in eligible]
            if held:
                return held
        return []

    def rank(self, replicas: Sequence[str], hint: RouteHint | None = None) -> list[str]:
        eligible = self._eligible(replicas, hint)
        if hint is None or not hint.prefix_hashes:
            return self._least_loaded(eligible)
        held = self._least_loaded(self.holders(hint, eligible))
        others = [replica for replica in rendezvous_order(eligible, key=hint.prefix_hashes[0]) if replica not in held]
        preferred = held + self._least_loaded(others)  # stable: equal loads keep the rendezvous order
        bound = self.load_bound(len(eligible))
        within = [replica for replica in preferred if self.in_flight.get(replica, 0) + 1 <= bound]
        beyond = self._least_loaded([replica for replica in preferred if replica not in within])
        return within + beyond

    def on_routed(self, replica: str, hint: RouteHint | None = None, replicas: Sequence[str] | None = None) -> None:
        super().on_routed(replica, hint, replicas)  # counts the reason first, from the table before this request
        if hint is None:
            return
        for chained in hint.prefix_hashes:
            held = self._holders.get(chained, ())
            self._holders[chained] = held if replica in held else (*held, replica)
            self._holders.move_to_end(chained)
        while len(self._holders) > self.max_prefixes:
            self._holders.popitem(last=False)

    def _reason(self, replica: str, hint: RouteHint | None, replicas: Sequence[str] | None) -> str:
        if hint is None or not hint.prefix_hashes:
            return NO_PREFIX
        if replicas is None:
            named = {holder for chained in hint.prefix_hashes for holder in self._holders.get(chained, ())}
            candidates = [replica, *sorted(named - {replica})]
        else:
            candidates = list(replicas) if replica in replicas else [*replicas, replica]
        held = self.holders(hint, self._eligible(candidates, hint))
        if replica in held:
            return PREFIX_HIT
        return PREFIX_SPILL if held else NEW_PREFIX

    def forget(self, replica: str) -> None:
        super().forget(replica)
        for chained, held in list(self._holders.items()):
            if replica in held:
                kept = tuple(other for other in held if other != replica)
                if kept:
                    self._holders[chained] = kept
                else:
                    del self._holders[chained]


def rendezvous_order(replicas: Sequence[str], *, key: int) -> list[str]:
    """Replicas by the hash of (key, replica id), highest first (highest-random-weight hashing)."""

    def weight(replica: str) -> bytes:
        return hashlib.blake2b(key.to_bytes(HASH_BYTES, "little") + replica.encode(), digest_size=HASH_BYTES).digest()

    return sorted(replicas, key=weight, reverse=True)


class PolicyRegistry:
    """The routing policies of one process's routers, for whoever exposes their decisions.

    The ingress owns one (its /metrics shows the counts); each router that Ray Serve builds in
    the ingress process registers its policy. Routers register from their own thread, and
    their policies count on it: the counts are read as copies (fixed keys, plain ints).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._policies: list[RoutingPolicy] = []

    def register(self, policy: RoutingPolicy) -> None:
        with self._lock:
            if all(known is not policy for known in self._policies):
                self._policies.append(policy)

    def decisions(self) -> dict[tuple[str, str], int]:
        """(policy name, reason) -> requests routed, policies of the same name added up."""
        with self._lock:
            policies = list(self._policies)
        totals: dict[tuple[str, str], int] = {}
        for policy in policies:
            for reason, count in dict(policy.decisions).items():
                totals[(policy.name, reason)] = totals.get((policy.name, reason), 0) + count
        return totals


def make_policy(name: str, *, load_factor: float = 1.25, max_prefixes: int = 65536) -> RoutingPolicy:
    if name == "cache_aware":
        return CacheAwarePolicy(load_factor=load_factor, max_prefixes=max_prefixes)
    if name == "round_robin":
        return RoundRobinPolicy()
    raise ValueError(f"routing policy must be one of {list(ROUTING_POLICIES)}, got {name!r}")
