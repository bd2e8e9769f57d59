import functools
import random

import pytest

from quickdraft.drafters.ngram import NgramDrafter, NgramIndex, continuation
from tests.drafters.proposal_checks import (
    assert_valid_proposal,
    commit,
    make_request,
    mean_step_seconds,
    paths,
    propose,
)

request = functools.partial(make_request, budget=5)


def brute_force_chain(tokens, *, length, min_n, max_n):
    """Reference prompt lookup: longest n first, most recent earlier occurrence first."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[len(tokens) - n :]
        for start in range(len(tokens) - 1, n - 1, -1):  # start: where the continuation begins
            if tokens[start - n : start] == suffix:
                return continuation(tokens, start=start, length=length)
    return None


# ------------------------------------------------------------------------------------
# constructor
# ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(num_speculative_tokens=0),
        dict(prompt_lookup_max=0),
        dict(prompt_lookup_min=0),
        dict(prompt_lookup_min=3, prompt_lookup_max=2),
        dict(num_branches=0),
        dict(num_branches=1.5),
        dict(num_speculative_tokens=True),
    ],
)
def test_invalid_arguments_raise(kwargs):
    with pytest.raises(ValueError):
        NgramDrafter(**kwargs)


def test_defaults_follow_vllm_names():
    drafter = NgramDrafter()
    assert (
        drafter.num_speculative_tokens,
        drafter.prompt_lookup_max,
        drafter.prompt_lookup_min,
        drafter.num_branches,
    ) == (5, 4, 1, 1)


# ------------------------------------------------------------------------------------
# exact proposals
# ------------------------------------------------------------------------------------


def test_repeated_pattern_gives_its_continuation():
    drafter = NgramDrafter(num_speculative_tokens=3)
    req = request([10, 11, 12, 13, 14, 15, 99, 11, 12])
    proposal = propose(drafter, req)
    assert proposal.token_ids == [12, 13, 14, 15]
    assert proposal.parents == [-1, 0, 1, 2]


def test_longest_ngram_wins_over_a_more_recent_shorter_one():
    # "7 8" followed by 1 long ago; "8" alone followed by 2 more recently.
    drafter = NgramDrafter(num_speculative_tokens=1, prompt_lookup_max=2)
    proposal = propose(drafter, request([7, 8, 1, 5, 8, 2, 6, 7, 8]))
    assert proposal.token_ids == [8, 1]
    # with bigrams off, the most recent unigram match wins
    proposal = propose(
        NgramDrafter(num_speculative_tokens=1, prompt_lookup_max=1), request([7, 8, 1, 5, 8, 2, 6, 7, 8])
    )
    assert proposal.token_ids == [8, 2]


def test_most_recent_match_wins():
    drafter = NgramDrafter(num_speculative_tokens=2, prompt_lookup_max=2)
    proposal = propose(drafter, request([1, 2, 3, 4, 0, 1, 2, 5, 6, 0, 1, 2]))
    assert proposal.token_ids == [2, 5, 6]


def test_budget_caps_the_draft():
    drafter = NgramDrafter(num_speculative_tokens=5)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2]
    assert propose(drafter, request(prompt, budget=2)).token_ids == [2, 3, 4]
    assert propose(drafter, request(prompt, budget=9)).token_ids == [2, 3, 4, 5, 6, 7]
    assert propose(drafter, request(prompt, budget=0)) is None


def test_no_match_gives_none():
    drafter = NgramDrafter()
    assert propose(drafter, request([1, 2, 3, 4, 5])) is None
    assert propose(drafter, request([7])) is None
    assert propose(drafter, request([])) is None
    # prompt_lookup_min=2: a repeated unigram alone is not enough
    assert propose(NgramDrafter(prompt_lookup_min=2), request([1, 2, 3, 4, 3])) is None


def test_overlapping_match_repeats_the_period():
    # the most recent copy of "1 2" is one period back: the loop is drafted to full length
    drafter = NgramDrafter(num_speculative_tokens=5, prompt_lookup_max=2)
    assert propose(drafter, request([9, 1, 2, 3, 1, 2])).token_ids == [2, 3, 1, 2, 3, 1]
    assert propose(drafter, request([4, 4, 4])).token_ids == [4, 4, 4, 4, 4, 4]


def test_continuation_is_copied_or_periodically_extended():
    assert continuation([5, 6, 7, 8], start=1, length=2) == [6, 7]
    assert continuation([5, 6, 7, 8], start=2, length=5) == [7, 8, 7, 8, 7]


# ------------------------------------------------------------------------------------
# trees of several matches
# ------------------------------------------------------------------------------------


def test_branches_merge_common_prefixes_most_trusted_first():
    # "0 1" continues with 2 3 4, then (more recently) 2 3 5, then 6 7 8.
    prompt = [0, 1, 2, 3, 4, 9, 0, 1, 2, 3, 5, 9, 0, 1, 6, 7, 8, 9, 0, 1]
    drafter = NgramDrafter(num_speculative_tokens=3, prompt_lookup_max=2, num_branches=3)
    proposal = propose(drafter, request(prompt, budget=12))
    assert proposal.token_ids == [1, 6, 7, 8, 2, 3, 5, 4]
    assert proposal.parents == [-1, 0, 1, 2, 0, 4, 5, 5]
    assert set(paths(proposal)) == {(6,), (6, 7), (6, 7, 8), (2,), (2, 3), (2, 3, 5), (2, 3, 4)}


def test_branches_respect_the_total_budget_and_branch_count():
    prompt = [0, 1, 2, 3, 4, 9, 0, 1, 2, 3, 5, 9, 0, 1, 6, 7, 8, 9, 0, 1]
    drafter = NgramDrafter(num_speculative_tokens=3, prompt_lookup_max=2, num_branches=3)
    assert propose(drafter, request(prompt, budget=4)).token_ids == [1, 6, 7, 8, 2]
    two = NgramDrafter(num_speculative_tokens=3, prompt_lookup_max=2, num_branches=2)
    assert set(paths(propose(two, request(prompt, budget=12)))) == {(6,), (6, 7), (6, 7, 8), (2,), (2, 3), (2, 3, 5)}


def test_branches_fall_back_to_shorter_ngrams():
    # only one match of the bigram "4 5"; the unigram "5" adds a second continuation
    prompt = [4, 5, 1, 1, 5, 2, 2, 4, 5]
    drafter = NgramDrafter(num_speculative_tokens=2, prompt_lookup_max=2, num_branches=2)
    proposal = propose(drafter, request(prompt, budget=10))
    assert proposal.token_ids == [5, 1, 1, 2, 2]
    assert proposal.parents == [-1, 0, 1, 0, 3]


def test_identical_continuations_are_one_branch():
    drafter = NgramDrafter(num_speculative_tokens=2, prompt_lookup_max=1, num_branches=3)
    proposal = propose(drafter, request([3, 7, 8, 3, 7, 8, 3], budget=10))
    assert proposal.token_ids == [3, 7, 8]


# ------------------------------------------------------------------------------------
# incremental state
# ------------------------------------------------------------------------------------


def test_incremental_index_equals_a_fresh_rebuild():
    rng = random.Random(1)
    drafter = NgramDrafter(prompt_lookup_max=3, num_branches=2)
    req = request([rng.randrange(6) for _ in range(40)], budget=6)
    drafter.begin(req)
    for _ in range(30):
        propose(drafter, req)
        commit(drafter, req, [rng.randrange(6) for _ in range(rng.randrange(1, 4))])
    incremental = drafter._indexes["r"]
    fresh = NgramIndex(
        min_n=1, max_n=3, max_positions_per_ngram=drafter.max_matches_per_n, num_prompt_tokens=len(req.prompt_token_ids)
    )
    fresh.extend(req.prompt_token_ids + req.output_token_ids)
    assert incremental.token_ids == fresh.token_ids
    assert incremental.continuations == fresh.continuations


def test_state_is_built_lazily_and_dropped_on_finish():
    drafter = NgramDrafter(num_speculative_tokens=2)
    req = request([1, 2, 3, 1])  # begin never called
    assert propose(drafter, req).token_ids == [1, 2, 3]
    commit(drafter, req, [2])
    assert propose(drafter, req).token_ids == [2, 3, 1]
    drafter.finish("r")
    assert "r" not in drafter._indexes
    drafter.finish("r")  # finishing twice is harmless


def test_a_changed_request_is_reindexed():
    drafter = NgramDrafter(num_speculative_tokens=2)
    req = request([1, 2, 3, 1], output=[2])
    drafter.begin(req)
    req.output_token_ids[:] = [5]  # same length, different token: must not reuse the index
    assert propose(drafter, req) is None


def test_several_requests_keep_separate_state():
    drafter = NgramDrafter(num_speculative_tokens=1)
    first = request([1, 2, 1], request_id="a")
    second = request([1, 3, 1], request_id="b")
    assert [p.token_ids for p in drafter.propose([first, second])] == [[1, 2], [1, 3]]


# ------------------------------------------------------------------------------------
# random streams and speed
# ------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_branches", [1, 3])
def test_random_streams_give_valid_proposals_matching_a_brute_force_search(num_branches):
    rng = random.Random(num_branches)
    drafter = NgramDrafter(num_speculative_tokens=4, prompt_lookup_max=3, num_branches=num_branches)
    for request_index in range(6):
        req = request(
            [rng.randrange(5) for _ in range(rng.randrange(0, 30))],
            budget=rng.randrange(1, 9),
            request_id=str(request_index),
        )
        if rng.random() < 0.5:
            drafter.begin(req)
        for _ in range(25):
            req.budget = rng.randrange(0, 9)
            proposal = propose(drafter, req)
            context = req.prompt_token_ids + req.output_token_ids
            expected = brute_force_chain(context, length=min(4, req.budget), min_n=1, max_n=3)
            if expected is None or req.budget == 0:
                assert proposal is None
            else:
                assert_valid_proposal(proposal, req)
                # the first branch is always the best match
                first_chain = [proposal.token_ids[node] for node in range(1, 1 + len(expected))]
                assert first_chain == expected
                if num_branches == 1:
                    assert proposal.token_ids[1:] == expected
            commit(drafter, req, [rng.randrange(5) for _ in range(rng.randrange(1, 4))])
        drafter.finish(req.request_id)
    assert drafter._indexes == {}


def test_long_context_propose_does_not_rescan():
    rng = random.Random(0)
    req = request([rng.randrange(50) for _ in range(5000)], budget=5)
    per_step = mean_step_seconds(NgramDrafter(), req)
    assert per_step < 5e-3, f"{per_step * 1e3:.2f} ms per step"
