"""Routing policies (quickdraft/server/routing.py): exact tables, no Ray."""

from __future__ import annotations

import pytest

from quickdraft.server.routing import (
    CacheAwarePolicy,
    PolicyRegistry,
    RoundRobinPolicy,
    RouteHint,
    make_policy,
    prefix_hashes,
    rendezvous_order,
    routing_text,
)

REPLICAS = ["a", "b", "c"]


def hint_for(text: str, *, chunk_chars: int = 4) -> RouteHint:
    return RouteHint(prefix_hashes=prefix_hashes(text, chunk_chars=chunk_chars))


# ---- prefix hashes and routing text -------------------------------------------------------------
def test_prefix_hashes_cover_whole_chunks_and_are_chained():
    assert prefix_hashes("abc", chunk_chars=4) == ()
    one = prefix_hashes("abcdxy", chunk_chars=4)
    two = prefix_hashes("abcdefgh", chunk_chars=4)
    assert len(one) == 1 and len(two) == 2
    assert one[0] == two[0]  # shared first chunk, same hash
    # Chained: the same second chunk after a different first one hashes differently.
    assert prefix_hashes("zzzzefgh", chunk_chars=4)[1] != two[1]
    assert prefix_hashes("abcdefgh", chunk_chars=4) == two  # stable (not Python's per-process hash())


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_prefix_hashes_reject_bad_chunk_sizes(bad):
    with pytest.raises(ValueError, match="chunk_chars must be a positive integer"):
        prefix_hashes("abcd", chunk_chars=bad)


@pytest.mark.parametrize(
    ("path", "body", "text"),
    [
        ("/v1/completions", {"prompt": "hello"}, "hello"),
        ("/v1/completions", {"prompt": ["hello"]}, "hello"),
        ("/v1/completions", {"prompt": ["hello", "there"]}, "hello"),  # a batch: its first prompt
        ("/v1/completions", {"prompt": [1, 22, 3]}, "1 22 3 "),
        ("/v1/completions", {"prompt": 5}, ""),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "user\x1fhi\x1e"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]},
            "user\x1fab\x1e",
        ),
        ("/v1/chat/completions", {"messages": "not a list"}, ""),
        ("/v1/models", {"prompt": "x"}, ""),
        ("/invocations", {"prompt": "hello"}, "hello"),
        ("/invocations", {"messages": [{"role": "user", "content": "hi"}], "prompt": "x"}, "user\x1fhi\x1e"),
        ("/invocations", {"input": "hello"}, ""),
        ("/v1/completions", ["not", "a", "dict"], ""),
        ("/v1/completions", {"prompt": "hello", "cache_salt": "t1"}, "\x1dsalt\x1et1\x1dhello"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "cache_salt": "t1"},
            "\x1dsalt\x1et1\x1duser\x1fhi\x1e",
        ),
    ],
)
def test_routing_text(path, body, text):
    assert routing_text(path, body) == text


def test_a_conversations_next_turn_starts_with_its_previous_turn():
    turn1 = {"messages": [{"role": "user", "content": "x" * 300}]}
    turn2 = {
        "messages": [*turn1["messages"], {"role": "assistant", "content": "y" * 50}, {"role": "user", "content": "z"}]
    }
    first = prefix_hashes(routing_text("/v1/chat/completions", turn1), chunk_chars=64)
    second = prefix_hashes(routing_text("/v1/chat/completions", turn2), chunk_chars=64)
    assert len(first) == 4 and second[: len(first)] == first


# ---- round robin ----------------------------------------------------------------------------------
def test_round_robin_turns_through_the_replicas():
    policy = RoundRobinPolicy()
    firsts = [policy.rank(["b", "a", "c"], hint_for("whatever text"))[0] for _ in range(4)]
    assert firsts == ["a", "b", "c", "a"]


# ---- cache aware ----------------------------------------------------------------------------------
def test_a_new_prefix_goes_to_its_rendezvous_replica_and_stays_there():
    policy = CacheAwarePolicy()
    hint = hint_for("abcdefgh")
    expected = rendezvous_order(REPLICAS, key=hint.prefix_hashes[0])
    assert policy.rank(REPLICAS, hint) == expected
    # The order does not depend on the order the replicas are listed in.
    assert policy.rank(list(reversed(REPLICAS)), hint) == expected


def test_the_holder_of_the_longest_prefix_wins():
    policy = CacheAwarePolicy()
    short, longer = hint_for("abcd"), hint_for("abcdefgh")
    rendezvous_first = rendezvous_order(REPLICAS, key=short.prefix_hashes[0])[0]
    other = next(replica for replica in REPLICAS if replica != rendezvous_first)
    policy.on_routed(other, longer)  # some earlier request with the longer prefix went to `other`
    policy.on_completed(other)
    assert policy.rank(REPLICAS, hint_for("abcdefghijkl"))[0] == other  # continues that prefix
    assert policy.holders(short, REPLICAS) == [other]  # `other` also took the shared first chunk
    assert policy.rank(REPLICAS, hint_for("abcdzzzz"))[0] == other  # shares only the first chunk
    # A second conversation under the same first chunk, sent elsewhere, keeps its own replica.
    policy.on_routed(rendezvous_first, hint_for("abcdWXYZ"))
    policy.on_completed(rendezvous_first)
    assert policy.rank(REPLICAS, hint_for("abcdWXYZmore"))[0] == rendezvous_first
    assert policy.rank(REPLICAS, hint_for("abcdefghmore"))[0] == other


def test_a_hot_prefix_spills_past_the_load_bound():
    # load_factor 1.25, 2 replicas: the bound is ceil(1.25 * (in flight + 1) / 2).
    policy = CacheAwarePolicy(load_factor=1.25)
    replicas = ["a", "b"]
    hint = hint_for("hot prefix, shared by every request")
    owner = policy.rank(replicas, hint)[0]
    spill = next(replica for replica in replicas if replica != owner)
    table = []
    for _ in range(6):
        bound = policy.load_bound(2)
        chosen, reason = route(policy, hint, replicas)
        table.append((chosen, bound, reason))
    # In flight before each (owner, spill): (0, 0) bound 1 -> owner; (1, 0) bound 2 -> owner;
    # (2, 0) bound 2: the owner would hold 3, spill (to a non-holder: counted as a spill); from
    # then on both hold the prefix and the less loaded one takes it: (2, 1) bound 3 -> spill;
    # (2, 2) bound 4 -> owner (the older holder first on a tie); (3, 2) bound 4 -> spill.
    assert table == [
        (owner, 1, "new_prefix"),
        (owner, 2, "prefix_hit"),
        (spill, 2, "prefix_spill"),
        (spill, 3, "prefix_hit"),
        (owner, 4, "prefix_hit"),
        (spill, 4, "prefix_hit"),
    ]
    assert policy.in_flight == {owner: 3, spill: 3}
    assert policy.decisions == {"prefix_hit": 4, "prefix_spill": 1, "new_prefix": 1, "no_prefix": 0, "fan_out": 0}


def test_requests_without_a_prefix_go_to_the_least_loaded():
    policy = CacheAwarePolicy()
    policy.on_routed("a")
    policy.on_routed("a")
    policy.on_routed("c")
    assert policy.rank(REPLICAS, RouteHint()) == ["b", "c", "a"]
    policy.on_completed("a")
    policy.on_completed("a")
    policy.on_completed("a")  # more completions than routed requests do not go below zero
    assert policy.in_flight["a"] == 0


def test_avoided_replicas_are_left_out_until_all_are_avoided():
    policy = CacheAwarePolicy()
    assert set(policy.rank(REPLICAS, RouteHint(avoid=frozenset({"a"})))) == {"b", "c"}
    assert set(policy.rank(REPLICAS, RouteHint(avoid=frozenset(REPLICAS)))) == set(REPLICAS)


def test_a_dead_replica_is_forgotten():
    policy = CacheAwarePolicy()
    hint = hint_for("abcdefgh")
    policy.on_routed("b", hint)
    policy.on_routed("a", hint)
    assert policy.holders(hint, REPLICAS) == ["b", "a"]
    policy.forget("b")
    assert policy.holders(hint, REPLICAS) == ["a"] and "b" not in policy.in_flight
    policy.forget("a")
    assert policy.holders(hint, REPLICAS) == []
    assert policy.rank(["a", "c"], hint) == rendezvous_order(["a", "c"], key=hint.prefix_hashes[0])


def test_the_prefix_table_is_bounded():
    policy = CacheAwarePolicy(max_prefixes=3)
    policy.on_routed("a", hint_for("abcdefgh"))  # 2 hashes
    policy.on_routed("b", hint_for("ijklmnop"))  # 2 more: the oldest goes
    assert len(policy._holders) == 3
    assert policy.holders(hint_for("ijklmnop"), REPLICAS) == ["b"]
    assert policy.holders(hint_for("abcd"), REPLICAS) == []  # the oldest hash was dropped


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"load_factor": 0.5}, "load_factor must be a number >= 1"),
        ({"load_factor": "2"}, "load_factor must be a number >= 1"),
        ({"max_prefixes": 0}, "max_prefixes must be a positive integer"),
    ],
)
def test_bad_policy_options(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_policy("cache_aware", **kwargs)


def test_unknown_policy():
    with pytest.raises(ValueError, match=r"routing policy must be one of \['cache_aware', 'round_robin'\]"):
        make_policy("random")


def test_no_replicas():
    with pytest.raises(ValueError, match="no replica to route to"):
        CacheAwarePolicy().rank([], RouteHint())


def test_a_new_prefix_goes_to_the_least_loaded_replica_first():
    policy = CacheAwarePolicy(load_factor=10)  # a bound far away: the order alone decides
    hint = hint_for("a brand new conversation")
    rendezvous_first = rendezvous_order(REPLICAS, key=hint.prefix_hashes[0])[0]
    policy.on_routed(rendezvous_first)  # busy with something else
    ranked = policy.rank(REPLICAS, hint)
    assert ranked[-1] == rendezvous_first
    assert ranked[:2] == [r for r in rendezvous_order(REPLICAS, key=hint.prefix_hashes[0]) if r != rendezvous_first]


# ---- decision reasons -------------------------------------------------------------------------
def route(policy, hint, replicas=REPLICAS, *, done: bool = False) -> tuple[str, str]:
    """Rank, send to the first, as the router does: (the replica chosen, the reason counted)."""
    before = dict(policy.decisions)
    chosen = policy.rank(replicas, hint)[0]
    policy.on_routed(chosen, hint, replicas)
    if done:
        policy.on_completed(chosen)
    return chosen, counted_since(policy, before)


def counted_since(policy, before: dict[str, int]) -> str:
    [reason] = [reason for reason, count in policy.decisions.items() if count != before[reason]]
    assert policy.decisions[reason] == before[reason] + 1
    return reason


def test_every_reason_is_counted_from_zero():
    assert make_policy("cache_aware").decisions == {
        "prefix_hit": 0,
        "prefix_spill": 0,
        "new_prefix": 0,
        "no_prefix": 0,
        "fan_out": 0,
    }
    assert make_policy("round_robin").decisions == {"round_robin": 0, "fan_out": 0}
    assert (CacheAwarePolicy.name, RoundRobinPolicy.name) == ("cache_aware", "round_robin")


def test_decisions_of_a_conversation_and_of_requests_without_a_prefix():
    policy = CacheAwarePolicy()
    turn1 = hint_for("abcdefgh")
    owner = rendezvous_order(REPLICAS, key=turn1.prefix_hashes[0])[0]
    table = [
        route(policy, turn1, done=True),  # nobody holds it yet (decided before `owner` becomes a holder)
        route(policy, hint_for("abcdefghijkl"), done=True),  # the next turn: its first turn's replica
        route(policy, hint_for("abcdefgh"), done=True),  # the same prompt again
        route(policy, RouteHint(), done=True),  # no prompt text (a GET)
        route(policy, None, done=True),  # no hint at all
        route(policy, hint_for("abc"), done=True),  # shorter than one chunk
        route(policy, RouteHint(avoid=frozenset({"a"}), fan_out=True), done=True),  # the ingress's /metrics query
    ]
    assert table == [
        (owner, "new_prefix"),
        (owner, "prefix_hit"),
        (owner, "prefix_hit"),
        ("a", "no_prefix"),  # nothing in flight: the first listed
        ("a", "no_prefix"),
        ("a", "no_prefix"),
        ("b", "fan_out"),  # "a" avoided, "b" and "c" idle
    ]
    assert policy.decisions == {"prefix_hit": 2, "prefix_spill": 0, "new_prefix": 1, "no_prefix": 3, "fan_out": 1}
    assert sum(policy.decisions.values()) == len(table)


def test_a_spill_is_judged_by_the_holders_of_the_longest_prefix():
    policy = CacheAwarePolicy()
    policy.on_routed("a", hint_for("abcdefgh"), REPLICAS)  # new_prefix
    policy.on_routed("b", hint_for("abcdzzzz"), REPLICAS)  # shares "abcd", held by "a": prefix_spill
    # The holder passed over (Ray Serve found its queue full): "b" holds only the shorter "abcd".
    before = dict(policy.decisions)
    policy.on_routed("b", hint_for("abcdefghijkl"), REPLICAS)
    assert counted_since(policy, before) == "prefix_spill"
    # A replica that never took the prefix, as a spill.
    before = dict(policy.decisions)
    policy.on_routed("c", hint_for("abcdefgh"), REPLICAS)
    assert counted_since(policy, before) == "prefix_spill"
    assert policy.decisions == {"prefix_hit": 0, "prefix_spill": 3, "new_prefix": 1, "no_prefix": 0, "fan_out": 0}


@pytest.mark.parametrize(
    ("replicas", "avoid", "reason"),
    [
        (REPLICAS, frozenset(), "prefix_spill"),  # "a" holds it and could have taken it
        (["b", "c"], frozenset(), "new_prefix"),  # "a" is no candidate (gone, not yet forgotten)
        (REPLICAS, frozenset({"a"}), "new_prefix"),  # "a" avoided
        (REPLICAS, frozenset(REPLICAS), "prefix_spill"),  # all avoided: all eligible again, as in rank
    ],
)
def test_only_holders_that_rank_would_consider_count(replicas, avoid, reason):
    policy = CacheAwarePolicy()
    hint = hint_for("abcdefgh")
    policy.on_routed("a", hint, REPLICAS)
    before = dict(policy.decisions)
    policy.on_routed("b", RouteHint(prefix_hashes=hint.prefix_hashes, avoid=avoid), replicas)
    assert counted_since(policy, before) == reason


def test_decisions_without_the_candidates_use_the_prefix_table():
    policy = CacheAwarePolicy()
    hint = hint_for("abcdefgh")
    reasons = []
    for replica in ["a", "b", "a", "c"]:
        before = dict(policy.decisions)
        policy.on_routed(replica, hint)  # no candidate list: every replica the table names
        reasons.append(counted_since(policy, before))
    assert reasons == ["new_prefix", "prefix_spill", "prefix_hit", "prefix_spill"]


def test_forgetting_a_replica_keeps_the_counts():
    policy = CacheAwarePolicy()
    hint = hint_for("abcdefgh")
    owner, _ = route(policy, hint, done=True)
    assert route(policy, hint_for("abcdefghijkl"), done=True) == (owner, "prefix_hit")
    route(policy, None)
    counts = dict(policy.decisions)
    policy.forget(owner)
    assert policy.decisions == counts and owner not in policy.in_flight
    # Its prefixes went with it: the conversation starts afresh elsewhere.
    survivors = [replica for replica in REPLICAS if replica != owner]
    assert route(policy, hint_for("abcdefghijklmnop"), survivors)[1] == "new_prefix"
    assert route(policy, hint_for("abcdefghijklmnop"), survivors)[1] == "prefix_hit"
    assert policy.decisions == {"prefix_hit": 2, "prefix_spill": 0, "new_prefix": 2, "no_prefix": 1, "fan_out": 0}
    assert sum(policy.decisions.values()) == 5  # every routed request, once


def test_round_robin_decisions():
    policy = RoundRobinPolicy()
    table = [
        route(policy, hint)
        for hint in [hint_for("abcdefgh"), hint_for("abcdefgh"), None, RouteHint(), RouteHint(fan_out=True)]
    ]
    assert table == [
        ("a", "round_robin"),
        ("b", "round_robin"),
        ("c", "round_robin"),
        ("a", "round_robin"),
        ("b", "fan_out"),
    ]
    assert policy.decisions == {"round_robin": 4, "fan_out": 1}


def test_the_policy_registry_adds_up_policies_of_the_same_name():
    registry = PolicyRegistry()
    assert registry.decisions() == {}
    first, second, baseline = CacheAwarePolicy(), CacheAwarePolicy(), RoundRobinPolicy()
    for policy in (first, second, baseline, first):  # registering twice counts once
        registry.register(policy)
    first.on_routed("a", hint_for("abcdefgh"))
    first.on_routed("a", hint_for("abcdefghijkl"))
    second.on_routed("b", None)
    second.on_routed("b", RouteHint(fan_out=True))
    baseline.on_routed("c", None)
    assert registry.decisions() == {
        ("cache_aware", "prefix_hit"): 1,
        ("cache_aware", "prefix_spill"): 0,
        ("cache_aware", "new_prefix"): 1,
        ("cache_aware", "no_prefix"): 1,
        ("cache_aware", "fan_out"): 1,
        ("round_robin", "round_robin"): 1,
        ("round_robin", "fan_out"): 0,
    }
