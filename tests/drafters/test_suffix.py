import functools
import random
from collections import Counter

import pytest

from quickdraft.drafters.base import DraftRequest
from quickdraft.drafters.suffix import SuffixDrafter, SuffixTrie
from tests.drafters.proposal_checks import (
    assert_valid_proposal,
    commit,
    make_request,
    mean_step_seconds,
    paths,
    propose,
)

request = functools.partial(make_request, budget=8)


def run_request(drafter, *, prompt, output, request_id) -> None:
    req = request(prompt, request_id=request_id)
    drafter.begin(req)
    for token in output:
        propose(drafter, req)
        commit(drafter, req, [token])
    drafter.finish(request_id)


def trie_counts(trie: SuffixTrie) -> dict[tuple[int, ...], int]:
    """Every string the trie holds (tails expanded) with its count; checks the invariants
    and that every node in use is reachable (freed nodes are not leaked)."""
    counts: dict[tuple[int, ...], int] = {}
    num_reachable = 0
    stack = [(SuffixTrie.ROOT, ())]
    while stack:
        node, path = stack.pop()
        children = trie.children[node]
        if children is None:  # a tail: one occurrence continuing in its sequence
            assert trie.counts[node] == 1
            tail, start = trie.sequences[trie.tail_sequence_ids[node]], trie.tail_starts[node]
            assert tail[start - 1] == path[-1]
            for position in range(start, min(len(tail), start + trie.max_depth - len(path))):
                path = path + (tail[position],)
                counts[path] = 1
            continue
        if node != SuffixTrie.ROOT:
            assert sum(trie.counts[child] for child in children.values()) <= trie.counts[node]
        assert len(path) < trie.max_depth or not children
        for token, child in children.items():
            assert trie.counts[child] >= 1
            num_reachable += 1
            counts[path + (token,)] = trie.counts[child]
            stack.append((child, path + (token,)))
    assert num_reachable == trie.num_nodes()
    return counts


def substring_counts(sequences, *, max_depth) -> dict[tuple[int, ...], int]:
    counts: Counter = Counter()
    for seq in sequences:
        for start in range(len(seq)):
            for length in range(1, min(max_depth, len(seq) - start) + 1):
                counts[tuple(seq[start : start + length])] += 1
    return dict(counts)


def occurs_in(needle, haystacks) -> bool:
    needle = list(needle)
    return any(hay[i : i + len(needle)] == needle for hay in haystacks for i in range(len(hay)))


def repeats_a_period(context: list[int], path: tuple[int, ...]) -> bool:
    """Whether `path` reads the context on from some earlier start, the reading running on
    into the path itself past the context's end (a periodic continuation)."""
    text = context + list(path)
    return any(
        all(text[len(context) + i] == text[len(context) - period + i] for i in range(len(path)))
        for period in range(1, len(context))
    )


# ------------------------------------------------------------------------------------
# constructor
# ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(num_speculative_tokens=0),
        dict(max_tree_depth=0),
        dict(max_cached_requests=-1),
        dict(min_token_prob=1.5),
        dict(min_token_prob=-0.1),
        dict(max_spec_factor=-1.0),
        dict(max_spec_offset=float("nan")),
        dict(num_speculative_tokens=2.0),
        dict(max_cached_requests=True),
        dict(periodic=1),
    ],
)
def test_invalid_arguments_raise(kwargs):
    with pytest.raises(ValueError):
        SuffixDrafter(**kwargs)


# ------------------------------------------------------------------------------------
# exact proposals from one request's own tokens
# ------------------------------------------------------------------------------------

# after "1 2": 3 twice (then 5 or 6), 4 once (then 7)
THREE_COPIES = [1, 2, 3, 5, 1, 2, 3, 6, 1, 2, 4, 7, 1, 2]


def test_proposal_follows_the_most_frequent_continuation():
    drafter = SuffixDrafter(min_token_prob=0.5)
    proposal = propose(drafter, request(THREE_COPIES))
    # matched "1 2" (2 tokens: at most 2 drafted); 3 has probability 2/3, 4 only 1/3,
    # and 3's continuations 5, 6 have 2/3 * 1/2 < 0.5
    assert proposal.token_ids == [2, 3]
    assert proposal.parents == [-1, 0]


def test_two_continuations_become_branches_ranked_by_frequency():
    # after "A B": X three times (then P, Q, S), Y twice (then R both times)
    a, b, x, y, p, q, r, s = 10, 11, 20, 21, 30, 31, 32, 33
    prompt = [a, b, x, p, 90, a, b, x, q, 91, a, b, y, r, 92, a, b, x, s, 93, a, b, y, r, 94, a, b]
    drafter = SuffixDrafter(max_spec_offset=1.0)  # match of 2 tokens + 1: three nodes
    proposal = propose(drafter, request(prompt))
    # X: 0.6, Y: 0.4, Y R: 0.4 * 1, while X P, X Q, X S: 0.2 each
    assert proposal.token_ids == [b, x, y, r]
    assert proposal.parents == [-1, 0, 0, 2]
    state = drafter._requests["r"]
    match_len, match = state.longest_match(max_length=24)
    tree = state.trie.draft_tree(match, max_draft_nodes=3, min_token_prob=0.1, match_len=match_len)
    assert tree.score == pytest.approx(0.6 + 0.4 + 0.4)
    # with room for more, min_token_prob stops the tree where the paths fall to 0.2
    narrow = propose(SuffixDrafter(max_spec_offset=10.0, min_token_prob=0.25), request(prompt))
    assert paths(narrow) == [(x,), (y,), (y, r)]
    wide = propose(SuffixDrafter(max_spec_offset=10.0, min_token_prob=0.15), request(prompt))
    assert paths(wide)[:3] == [(x,), (y,), (y, r)] and len(paths(wide)) == 8


def test_no_earlier_occurrence_gives_none():
    drafter = SuffixDrafter()
    assert propose(drafter, request([1, 2, 3, 4])) is None
    assert propose(drafter, request([5])) is None
    assert propose(drafter, request([])) is None
    assert propose(drafter, request([1, 2, 1], budget=0)) is None


@pytest.mark.parametrize("match_len", range(1, 11))
def test_draft_size_grows_with_the_match_length(match_len):
    # a 10-token pattern followed by a 20-token unique continuation; the context ends
    # with the pattern's last match_len tokens (preceded by an unseen token)
    pattern, follow = list(range(100, 110)), list(range(200, 220))
    prompt = pattern + follow + [300] + pattern[10 - match_len :]
    default = propose(SuffixDrafter(), request(prompt, budget=20))  # 16 nodes at most
    assert default.token_ids[1:] == follow[:match_len]
    eight = propose(SuffixDrafter(num_speculative_tokens=8), request(prompt, budget=20))
    assert eight.token_ids[1:] == follow[: min(8, match_len)]
    half = propose(SuffixDrafter(num_speculative_tokens=8, max_spec_factor=0.5), request(prompt, budget=20))
    if match_len < 2:
        assert half is None
    else:
        assert half.token_ids[1:] == follow[: min(8, match_len // 2)]
    flat = propose(SuffixDrafter(max_spec_factor=0.0, max_spec_offset=2.0), request(prompt, budget=20))
    assert flat.token_ids[1:] == follow[:2]
    short = propose(SuffixDrafter(max_tree_depth=3), request(prompt, budget=20))
    assert short.token_ids[1:] == follow[: min(3, match_len)]
    capped = propose(SuffixDrafter(), request(prompt, budget=2))
    assert capped.token_ids[1:] == follow[: min(2, match_len)]


@pytest.mark.parametrize(
    "context, periodic_draft, stopped_draft",
    [
        # period 1: "1 1 1" occurred one token earlier; its continuation is the context's end
        ([9, 1, 1, 1, 1], [1, 1, 1], [1]),
        # period 2: "1 2 1 2" occurred two tokens earlier
        ([7, 1, 2, 1, 2, 1, 2], [1, 2, 1, 2], [1, 2]),
        # period 3, the match (6 tokens) longer than the budget (5 nodes)
        ([8, 4, 5, 6, 4, 5, 6, 4, 5, 6], [4, 5, 6, 4, 5], [4, 5, 6]),
    ],
)
def test_a_loop_shorter_than_the_draft_repeats_its_period(context, periodic_draft, stopped_draft):
    periodic = propose(SuffixDrafter(num_speculative_tokens=5), request(context))
    assert periodic.token_ids == [context[-1], *periodic_draft]
    assert periodic.parents == list(range(-1, len(periodic_draft)))
    stopped = propose(SuffixDrafter(num_speculative_tokens=5, periodic=False), request(context))
    assert stopped.token_ids == [context[-1], *stopped_draft]


def test_a_finished_output_does_not_repeat_past_its_end():
    # the global trie's outputs are not the present: a match at an output's end stops there
    drafter = SuffixDrafter(num_speculative_tokens=5)
    run_request(drafter, prompt=[50], output=[3, 3, 3, 3], request_id="done")
    proposal = propose(drafter, request([60, 61, 3, 3, 3], request_id="new"))
    # own trie: "3 3" occurred once, at 2..3, continuing into the present: period 1
    assert proposal.token_ids == [3, 3, 3]
    tree = drafter.global_trie.draft_tree(
        drafter.global_trie.match([3, 3, 3], length=3), max_draft_nodes=5, min_token_prob=0.1, match_len=3
    )
    assert tree.token_ids == [3]  # "3 3 3" once more in the cached output, then its end


def test_output_tokens_are_indexed_as_they_are_committed():
    drafter = SuffixDrafter()
    req = request([1, 2, 3, 4, 5, 6, 7])
    drafter.begin(req)
    assert propose(drafter, req) is None
    commit(drafter, req, [9, 1, 2])
    assert propose(drafter, req).token_ids == [2, 3, 4]  # match "1 2": two tokens
    commit(drafter, req, [3])
    assert propose(drafter, req).token_ids == [3, 4, 5, 6]


# ------------------------------------------------------------------------------------
# the global cache of finished requests
# ------------------------------------------------------------------------------------


def test_a_finished_request_helps_a_new_one_with_the_same_text():
    output = list(range(50, 66))
    # the new request's own text matches "52 53" (then 99, 7); the cached output matches
    # "50 51 52 53" (then 54 55 56 57): the longer match, more tokens, better score
    new_prompt = [52, 53, 99, 7, 50, 51, 52, 53]
    fresh = SuffixDrafter()
    assert propose(fresh, request(new_prompt)).token_ids == [53, 99, 7]
    drafter = SuffixDrafter()
    run_request(drafter, prompt=[1, 2, 3], output=output, request_id="old")
    assert "old" not in drafter._requests
    assert list(drafter.cached_outputs.values()) == [output]
    assert propose(drafter, request(new_prompt, request_id="new")).token_ids == [53, 54, 55, 56, 57]


def test_no_cache_when_max_cached_requests_is_zero():
    drafter = SuffixDrafter(max_cached_requests=0)
    run_request(drafter, prompt=[1], output=[50, 51, 52, 53], request_id="old")
    assert not drafter.cached_outputs
    assert propose(drafter, request([50, 51])) is None


def test_eviction_keeps_the_newest_requests_with_exact_counts():
    rng = random.Random(3)
    drafter = SuffixDrafter(max_cached_requests=3, max_tree_depth=6, num_speculative_tokens=2)
    outputs = []
    for index in range(12):
        # a tiny vocabulary: many shared paths, repeats inside one output, folds on eviction
        output = [rng.randrange(3) for _ in range(rng.randrange(1, 30))]
        outputs.append(output)
        run_request(drafter, prompt=[7, 7], output=output, request_id=str(index))
        assert len(drafter.cached_outputs) == min(index + 1, 3)
        assert list(drafter.cached_outputs.values()) == outputs[-3:]
        assert trie_counts(drafter.global_trie) == substring_counts(outputs[-3:], max_depth=8)


def test_removing_every_sequence_empties_the_trie():
    rng = random.Random(4)
    trie = SuffixTrie(max_depth=5)
    sequences = [[rng.randrange(2) for _ in range(20)] for _ in range(6)]
    for sequence_id, seq in enumerate(sequences):
        trie.insert(sequence_id, seq)
    assert trie_counts(trie) == substring_counts(sequences, max_depth=5)
    for removed in range(len(sequences)):
        trie.remove(removed)
        assert trie_counts(trie) == substring_counts(sequences[removed + 1 :], max_depth=5)
    assert trie.num_nodes() == 0 and trie.children[SuffixTrie.ROOT] == {} and trie.sequences == {}


def test_memory_stays_bounded_over_many_requests():
    rng = random.Random(5)
    drafter = SuffixDrafter(max_cached_requests=10)
    node_counts = []
    for index in range(240):
        output = [rng.randrange(8) for _ in range(40)]
        req = request([rng.randrange(8) for _ in range(20)], request_id=str(index))
        drafter.begin(req)
        for start in range(0, len(output), 4):  # 4 tokens committed per step
            propose(drafter, req)
            commit(drafter, req, output[start : start + 4])
        drafter.finish(req.request_id)
        if index % 40 == 39:
            node_counts.append(drafter.global_trie.num_nodes())
    cached = list(drafter.cached_outputs.values())
    assert len(cached) == 10 and drafter._requests == {}
    # never more nodes than distinct strings in the cached outputs (a fully built trie) ...
    exact = substring_counts(cached, max_depth=drafter.trie_depth)
    assert trie_counts(drafter.global_trie) == exact
    assert max(node_counts) <= len(exact)
    # ... and about what a fresh trie of the same outputs holds: eviction leaks nothing
    fresh = SuffixTrie(max_depth=drafter.trie_depth)
    for sequence_id, output in enumerate(cached):
        fresh.insert(sequence_id, output)
    assert drafter.global_trie.num_nodes() <= 1.2 * fresh.num_nodes()


# ------------------------------------------------------------------------------------
# incremental state, random streams, speed
# ------------------------------------------------------------------------------------


def test_incremental_trie_equals_the_substring_counts_of_the_context():
    rng = random.Random(6)
    drafter = SuffixDrafter(max_tree_depth=5, num_speculative_tokens=3)
    req = request([rng.randrange(4) for _ in range(30)])
    drafter.begin(req)
    for _ in range(40):
        propose(drafter, req)
        commit(drafter, req, [rng.randrange(4) for _ in range(rng.randrange(1, 4))])
    state = drafter._requests["r"]
    context = req.prompt_token_ids + req.output_token_ids
    assert state.token_ids == context
    assert trie_counts(state.trie) == substring_counts([context], max_depth=8)


def test_state_is_built_lazily_and_rebuilt_when_the_request_changed():
    drafter = SuffixDrafter()
    req = request([1, 2, 3, 1])  # begin never called
    assert propose(drafter, req).token_ids == [1, 2]
    req.prompt_token_ids[:] = [4, 5, 6, 4]
    assert propose(drafter, req).token_ids == [4, 5]
    drafter.finish("r")
    drafter.finish("r")  # finishing twice is harmless
    assert drafter._requests == {}


def test_random_streams_give_valid_proposals_seen_in_the_text():
    rng = random.Random(7)
    drafter = SuffixDrafter(
        num_speculative_tokens=5, max_tree_depth=6, max_cached_requests=4, min_token_prob=0.0, max_spec_offset=2.0
    )
    live: list[DraftRequest] = []
    for step in range(400):
        if not live or (len(live) < 4 and rng.random() < 0.1):
            req = request([rng.randrange(5) for _ in range(rng.randrange(0, 25))], request_id=f"q{step}")
            if rng.random() < 0.5:
                drafter.begin(req)
            live.append(req)
        req = rng.choice(live)
        req.budget = rng.randrange(0, 8)
        proposal = propose(drafter, req)
        context = req.prompt_token_ids + req.output_token_ids
        earlier = context[:-1]
        if proposal is None:
            # no draft only when nothing to draft: no budget or the last token never seen before
            cached = list(drafter.cached_outputs.values())
            seen = context and (context[-1] in earlier or any(context[-1] in out[:-1] for out in cached))
            assert req.budget == 0 or not seen
        else:
            assert_valid_proposal(proposal, req)
            texts = [context, *drafter.cached_outputs.values()]
            for path in paths(proposal):
                assert occurs_in([context[-1], *path], texts) or repeats_a_period(context, path)
        commit(drafter, req, [rng.randrange(5) for _ in range(rng.randrange(1, 4))])
        if rng.random() < 0.05:
            live.remove(req)
            drafter.finish(req.request_id)
    for req in live:
        drafter.finish(req.request_id)
    assert drafter._requests == {}
    assert len(drafter.cached_outputs) == 4
    assert trie_counts(drafter.global_trie) == substring_counts(
        list(drafter.cached_outputs.values()), max_depth=drafter.trie_depth
    )


def test_long_context_step_is_incremental():
    rng = random.Random(0)
    req = request([rng.randrange(50) for _ in range(5000)])
    per_step = mean_step_seconds(SuffixDrafter(), req)
    assert per_step < 5e-3, f"{per_step * 1e3:.2f} ms per step"
