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
"""

from __future__ import annotations

import hashlib
import math
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


@dataclass(frozen=True)
class RouteHint:
    """What the router knows of one call: its prompt's chained chunk hashes, replicas to avoid."""

    prefix_hashes: tuple[int, ...] = ()  # chained hashes of the prompt text's leading chunks
    # Replicas this call must not go to (the ingress asks each replica in turn for /metrics
    # and /health); when it names every replica, the ranking holds them all.
    avoid: frozenset[str] = field(default_factory=frozenset)


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


def routing_text(path: str, body: Any) -> str:
    """The prompt text a request is routed on ("" when it has none).

    Completions: the prompt (a string; token ids as their decimal text). Chat: each message's
    role and text content, separated by control characters that no rendering template uses
    as content, so a conversation's next turn starts with its previous turn's text.
    """
    if not isinstance(body, dict):
        return ""
    if path.endswith("/chat/completions"):
        messages = body.get("messages")
        if not isinstance(messages, list):
            return ""
        return "".join(_message_text(message) for message in messages)
    if path.endswith("/completions"):
        return _prompt_text(body.get("prompt"))
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
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        return _prompt_text(prompt[0])  # a batch of one
    if isinstance(prompt, list) and all(isinstance(token, int) for token in prompt):
        return "".join(f"{token} " for token in prompt)
    return ""


class RoutingPolicy:
    """Ranks replicas for a request and keeps what it needs from the requests it routed.

    Bookkeeping only (replica ids as strings, counts as ints): the Ray router calls `rank`
    when a request arrives, `on_routed` once the request is sent, `on_completed` when it ends
    and `forget` when a replica dies.
    """

    def __init__(self) -> None:
        self.in_flight: dict[str, int] = {}

    def rank(self, replicas: Sequence[str], hint: RouteHint | None = None) -> list[str]:
        raise NotImplementedError

    def on_routed(self, replica: str, hint: RouteHint | None = None) -> None:
        self.in_flight[replica] = self.in_flight.get(replica, 0) + 1

    def on_completed(self, replica: str) -> None:
        if self.in_flight.get(replica, 0) > 0:
            self.in_flight[replica] -= 1

    def forget(self, replica: str) -> None:
        self.in_flight.pop(replica, None)

    def _eligible(self, replicas: Sequence[str], hint: RouteHint | None) -> list[str]:
        if not replicas:
            raise ValueError("no replica to route to")
        avoid = hint.avoid if hint is not None else frozenset()
        kept = [replica for replica in replicas if replica not in avoid]
        return kept or list(replicas)

    def _least_loaded(self, replicas: Sequence[str]) -> list[str]:
        return sorted(replicas, key=lambda replica: self.in_flight.get(replica, 0))  # stable: ties keep order


class RoundRobinPolicy(RoutingPolicy):
    """Each request to the next replica in turn, prefixes and loads ignored (the baseline)."""

    def __init__(self) -> None:
        super().__init__()
        self._turn = 0

    def rank(self, replicas: Sequence[str], hint: RouteHint | None = None) -> list[str]:
        eligible = sorted(self._eligible(replicas, hint))
        start = self._turn % len(eligible)
        self._turn += 1
        return eligible[start:] + eligible[:start]


class CacheAwarePolicy(RoutingPolicy):
    """Holders of the longest known prefix, then the least loaded; both within a load bound."""

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

    def on_routed(self, replica: str, hint: RouteHint | None = None) -> None:
        super().on_routed(replica, hint)
        if hint is None:
            return
        for chained in hint.prefix_hashes:
            held = self._holders.get(chained, ())
            self._holders[chained] = held if replica in held else (*held, replica)
            self._holders.move_to_end(chained)
        while len(self._holders) > self.max_prefixes:
            self._holders.popitem(last=False)

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


def make_policy(name: str, *, load_factor: float = 1.25, max_prefixes: int = 65536) -> RoutingPolicy:
    if name == "cache_aware":
        return CacheAwarePolicy(load_factor=load_factor, max_prefixes=max_prefixes)
    if name == "round_robin":
        return RoundRobinPolicy()
    raise ValueError(f"routing policy must be one of {list(ROUTING_POLICIES)}, got {name!r}")
