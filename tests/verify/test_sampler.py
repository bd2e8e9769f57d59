import math

import numpy as np
import pytest
import torch
from scipy import stats

from quickdraft.sampling_params import SamplingParams
from quickdraft.verify import sampler
from quickdraft.verify.sampler import (
    RowContext,
    compute_logprobs,
    exp_nonpositive,
    keyed_noise,
    keyed_uniform,
    logits_to_probs,
    make_generator,
    min_p_filter,
    position_key,
    processed_logits,
    sample_from_probs,
    sample_keyed,
    sampling_weights,
    top_k_filter,
    top_p_filter,
    uniform,
)


def row(prompt=(), output=(), **params) -> RowContext:
    return RowContext(params=SamplingParams(**params), prompt_token_ids=list(prompt), output_token_ids=list(output))


def logits_of(probs) -> torch.Tensor:  # [1, V] logits whose softmax is (about) probs
    return torch.tensor(probs, dtype=torch.float64).log().float().unsqueeze(0)


def kept(probs: torch.Tensor) -> set[int]:  # [V] -> indices with non-zero probability
    return set(probs.nonzero().flatten().tolist())


# ------------------------------------------------------------------------------------
# penalties (exact numbers)
# ------------------------------------------------------------------------------------


def penalized(logits, rows) -> torch.Tensor:  # [R, V] logits after step 1 and 2
    out = torch.tensor(logits, dtype=torch.float32).clone()
    sampler._apply_penalties(out, rows)
    return out


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    logits = [[2.0, -2.0, 1.0, -1.0, 0.5, 0.0]]
    # token 0 in the prompt, token 1 twice in the output (penalised once), token 5 is 0.
    out = penalized(logits, [row(prompt=[0, 5], output=[1, 1], repetition_penalty=2.0)])
    assert out.tolist() == [[1.0, -4.0, 1.0, -1.0, 0.5, 0.0]]


def test_repetition_penalty_below_one_rewards_repeats():
    out = penalized([[2.0, -2.0, 1.0]], [row(prompt=[0], output=[1], repetition_penalty=0.5)])
    assert out.tolist() == [[4.0, -1.0, 1.0]]


def test_frequency_and_presence_over_output_tokens_only():
    logits = [[1.0, 1.0, 1.0, 1.0, 1.0]]
    # token 0 only in the prompt: untouched; token 2 three times, token 3 once.
    rows = [row(prompt=[0, 2], output=[2, 3, 2, 2], frequency_penalty=0.5, presence_penalty=1.0)]
    assert penalized(logits, rows).tolist() == [[1.0, 1.0, 1.0 - 2.5, 1.0 - 1.5, 1.0]]


def test_negative_presence_and_frequency_encourage():
    rows = [row(output=[1, 1], frequency_penalty=-0.25, presence_penalty=-1.0)]
    assert penalized([[0.0, 0.0, 0.0]], rows).tolist() == [[0.0, 1.5, 0.0]]


def test_repetition_is_applied_before_frequency():
    # rep first: 2 / 2 - 2 * 1 = -1; the other order would give (2 - 2) / 2 = 0.
    rows = [row(output=[0, 0], repetition_penalty=2.0, frequency_penalty=1.0)]
    assert penalized([[2.0, 0.5]], rows).tolist() == [[-1.0, 0.5]]


def test_penalties_are_per_row_history():
    logits = [[1.0, 1.0, 1.0]] * 3
    rows = [
        row(output=[0], presence_penalty=1.0),
        row(output=[1, 1], presence_penalty=1.0),  # same request, another tree position
        row(output=[2], presence_penalty=0.5, repetition_penalty=2.0),
    ]
    assert penalized(logits, rows).tolist() == [[0.0, 1.0, 1.0], [1.0, 0.0, 1.0], [1.0, 1.0, 0.0]]


def test_logits_to_probs_uses_the_penalized_logits():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.0]])
    r = row(
        prompt=[0],
        output=[1, 2, 2],
        repetition_penalty=1.5,
        frequency_penalty=0.3,
        presence_penalty=0.2,
    )
    expected = torch.tensor([[2.0 / 1.5, -2.0 * 1.5 - 0.5, 1.0 / 1.5 - 0.8, 0.0]])
    torch.testing.assert_close(logits_to_probs(logits, [r]), torch.softmax(expected, -1))


def test_input_logits_are_not_modified():
    logits = torch.randn(2, 50)
    before = logits.clone()
    rows = [row(output=[1, 2], repetition_penalty=1.3, min_tokens=5), row(top_k=3)]
    logits_to_probs(logits, rows, eos_token_ids=[0])
    assert torch.equal(logits, before)


def test_out_of_range_token_id_raises():
    with pytest.raises(ValueError, match="out of range"):
        logits_to_probs(torch.zeros(1, 10), [row(output=[10], presence_penalty=1.0)])


# ------------------------------------------------------------------------------------
# min_tokens
# ------------------------------------------------------------------------------------


def test_min_tokens_blocks_eos_and_stop_token_ids():
    logits = torch.zeros(1, 6)
    r = row(output=[1], min_tokens=2, stop_token_ids=[3])
    probs = logits_to_probs(logits, [r], eos_token_ids=[4, 5])
    assert kept(probs[0]) == {0, 1, 2}
    torch.testing.assert_close(probs[0, :3], torch.full((3,), 1 / 3))


def test_min_tokens_reached_no_longer_blocks():
    r = row(output=[1, 2], min_tokens=2, stop_token_ids=[3])
    probs = logits_to_probs(torch.zeros(1, 6), [r], eos_token_ids=[4, 5])
    assert kept(probs[0]) == set(range(6))


def test_min_tokens_with_ignore_eos_blocks_only_stop_token_ids():
    r = row(output=[], min_tokens=1, stop_token_ids=[3], ignore_eos=True)
    probs = logits_to_probs(torch.zeros(1, 6), [r], eos_token_ids=[4])
    assert kept(probs[0]) == {0, 1, 2, 4, 5}


def test_min_tokens_makes_greedy_skip_eos():
    logits = torch.tensor([[0.0, 1.0, 5.0]])  # EOS = 2 is the argmax
    probs = logits_to_probs(logits, [row(temperature=0.0, min_tokens=1)], eos_token_ids=[2])
    assert probs.tolist() == [[0.0, 1.0, 0.0]]


# ------------------------------------------------------------------------------------
# logit_bias and allowed_token_ids (step 0)
# ------------------------------------------------------------------------------------


def test_logit_bias_adds_to_the_listed_tokens_and_moves_the_argmax():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    probs = logits_to_probs(logits, [row(temperature=0.0, logit_bias={0: 5.0, 3: -100.0})])
    assert probs.tolist() == [[1.0, 0.0, 0.0, 0.0]]
    sampled = logits_to_probs(logits, [row(temperature=1.0, logit_bias={1: 1.0})])
    torch.testing.assert_close(sampled[0], torch.softmax(torch.tensor([0.0, 2.0, 2.0, 3.0]), dim=0))


def test_allowed_token_ids_keep_only_those_tokens():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0]])
    probs = logits_to_probs(logits, [row(temperature=1.0, allowed_token_ids=[1, 3])])
    assert kept(probs[0]) == {1, 3}
    torch.testing.assert_close(probs[0, [1, 3]], torch.softmax(torch.tensor([1.0, 3.0]), dim=0))
    greedy = logits_to_probs(logits, [row(temperature=0.0, allowed_token_ids=[0, 2])])
    assert greedy.tolist() == [[0.0, 0.0, 1.0, 0.0, 0.0]]


def test_allowed_tokens_a_grammar_already_forbids_leave_the_grammar_its_tokens():
    logits = torch.tensor([[-math.inf, 1.0, -math.inf, 0.0]])  # a grammar allows 1 and 3
    probs = logits_to_probs(logits, [row(temperature=0.0, allowed_token_ids=[0, 2])])
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0]]  # nothing allowed by both: the grammar wins


def test_logit_bias_comes_before_the_repetition_penalty():
    # vLLM's order: (1 + 1) / 2 = 1.0, where bias after the penalty would give 1 / 2 + 1 = 1.5
    out = sampler._penalized_logits(
        torch.tensor([[1.0, 0.5]]), [row(prompt=[0], repetition_penalty=2.0, logit_bias={0: 1.0})], eos_token_ids=()
    )
    assert out.tolist() == [[1.0, 0.5]]


def test_ids_beyond_a_smaller_vocabulary_are_left_out():
    # a drafter's rows may cover fewer tokens than the target's: ids past them do not exist there
    r = row(temperature=0.0, allowed_token_ids=[1, 7], logit_bias={2: 9.0, 8: 1.0})
    assert logits_to_probs(torch.tensor([[0.0, 1.0, 2.0]]), [r]).tolist() == [[0.0, 1.0, 0.0]]


def bad_words_row(output, words, **params) -> RowContext:
    context = row(output=output, **params)
    context.params.bad_words_token_ids = words
    return context


@pytest.mark.parametrize(
    ("output", "banned"),
    [
        ([], {1}),  # a one-token word always; longer ones need their first tokens generated
        ([4], {1, 2}),
        ([0, 4], {1, 2}),
        ([4, 0], {1}),
        ([3, 4], {1, 2, 0}),  # [4] ends it for [4, 2] and [3, 4] for [3, 4, 0]
        ([3, 3], {1}),
    ],
)
def test_bad_words_ban_a_word_s_last_token_after_its_first_ones(output, banned):
    logits = torch.zeros(1, 6)
    words = [[1], [4, 2], [3, 4, 0]]
    probs = logits_to_probs(logits, [bad_words_row(output, words, temperature=1.0)])
    assert kept(probs[0]) == set(range(6)) - banned


def test_bad_words_leave_a_row_they_would_empty_as_it_is():
    logits = torch.tensor([[-math.inf, 1.0, -math.inf]])  # a grammar allows only token 1
    probs = logits_to_probs(logits, [bad_words_row([], [[1]], temperature=0.0)])
    assert probs.tolist() == [[0.0, 1.0, 0.0]]


def test_bias_and_allowed_tokens_take_the_slow_path_for_greedy_rows():
    assert not sampler.samples_by_argmax(SamplingParams(temperature=0.0, logit_bias={1: 1.0}), num_output_tokens=0)
    assert not sampler.samples_by_argmax(SamplingParams(temperature=0.0, allowed_token_ids=[1]), num_output_tokens=0)
    assert sampler.samples_by_argmax(SamplingParams(temperature=0.0, logit_bias={}), num_output_tokens=0)


# ------------------------------------------------------------------------------------
# greedy and temperature
# ------------------------------------------------------------------------------------


def test_greedy_is_exact_one_hot_with_lowest_index_on_ties():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [-1.0, -2.0, -0.5, -0.5]], dtype=torch.bfloat16)
    probs = logits_to_probs(logits, [row(temperature=0.0, top_k=1, top_p=0.1), row(temperature=0)])
    assert probs.dtype == torch.float32
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]]


def test_temperature_scales_logits():
    logits = torch.tensor([[1.0, 2.0, 4.0]])
    for t in (0.5, 1.0, 2.0):
        probs = logits_to_probs(logits, [row(temperature=t)])
        torch.testing.assert_close(probs, torch.softmax(logits / t, -1))


# ------------------------------------------------------------------------------------
# top_k / top_p / min_p (exact kept sets)
# ------------------------------------------------------------------------------------

P4 = [0.4, 0.3, 0.2, 0.1]


@pytest.mark.parametrize(
    "probs, top_k, expected",
    [
        (P4, 2, {0, 1}),
        (P4, 1, {0}),
        (P4, 3, {0, 1, 2}),
        (P4, 4, {0, 1, 2, 3}),
        (P4, 100, {0, 1, 2, 3}),  # k > V is off
        (P4, 0, {0, 1, 2, 3}),
        (P4, -1, {0, 1, 2, 3}),
        ([0.1, 0.4, 0.25, 0.25], 2, {1, 2, 3}),  # tie at the k-th value: both kept
        ([0.25, 0.25, 0.25, 0.25], 1, {0, 1, 2, 3}),
    ],
)
def test_top_k_kept_sets(probs, top_k, expected):
    out = logits_to_probs(logits_of(probs), [row(top_k=top_k)])[0]
    assert kept(out) == expected
    reference = torch.tensor(probs) * torch.tensor([i in expected for i in range(len(probs))])
    torch.testing.assert_close(out, reference / reference.sum())


# Exactly representable probabilities: the top_p boundary is tested without rounding.
DYADIC = [0.5, 0.25, 0.125, 0.0625, 0.0625]


@pytest.mark.parametrize(
    "top_p, expected",
    [
        (0.5, {0}),  # the first token alone reaches exactly 0.5
        (0.5000001, {0, 1}),
        (0.75, {0, 1}),  # boundary: prefix mass exactly 0.75
        (0.875, {0, 1, 2}),
        (0.9, {0, 1, 2, 3, 4}),  # the last kept value is tied: both ties kept
        (0.1, {0}),  # the most likely token is always kept
        (1.0, {0, 1, 2, 3, 4}),
    ],
)
def test_top_p_filter_exact_boundaries(top_p, expected):
    out = top_p_filter(torch.tensor([DYADIC, DYADIC[::-1]]), torch.tensor([top_p, top_p]))
    assert kept(out[0]) == expected
    assert kept(out[1]) == {4 - i for i in expected}


def test_top_p_filter_on_unnormalized_rows_uses_their_mass():
    out = top_p_filter(torch.tensor([[4.0, 2.0, 1.0, 1.0]]), torch.tensor([0.75]))
    assert kept(out[0]) == {0, 1}


@pytest.mark.parametrize(
    "params, expected",
    [
        (dict(top_p=0.65), {0, 1}),
        (dict(top_p=0.75), {0, 1, 2}),
        (dict(top_p=0.35), {0}),
        # top_p applies to the top_k-renormalised distribution (as vLLM / HF):
        # 0.4 / 0.7 = 0.571 >= 0.55 keeps token 0 alone (0.4 < 0.55 would not).
        (dict(top_k=2, top_p=0.55), {0}),
        (dict(top_k=3, top_p=0.8), {0, 1, 2}),
        (dict(top_k=3, top_p=0.7), {0, 1}),
        (dict(min_p=0.6), {0, 1}),  # cutoff 0.24
        (dict(min_p=0.8), {0}),  # cutoff 0.32
        (dict(min_p=1.0), {0}),
        (dict(top_k=3, top_p=0.99, min_p=0.6), {0, 1}),
    ],
)
def test_filters_through_logits_to_probs(params, expected):
    out = logits_to_probs(logits_of(P4), [row(**params)])[0]
    assert kept(out) == expected
    torch.testing.assert_close(out.sum(), torch.tensor(1.0))


@pytest.mark.parametrize("top_p, expected", [(0.9, {0, 1, 2, 3}), (0.5, {0, 1, 2, 3}), (0.35, {0})])
def test_top_k_with_ties_beyond_k_then_top_p(top_p, expected):
    # top_k=2 keeps all four tokens (ties at the k-th value). With top_p=0.9 the sorted
    # top-2 prefix (mass 0.6) never reaches the target, so the cut falls back to the k-th
    # value; with 0.5 the cut is the tied 0.2: all ties are kept either way.
    logits = torch.log(torch.tensor([[0.4, 0.2, 0.2, 0.2]]))
    out = logits_to_probs(logits, [row(top_k=2, top_p=top_p)])[0]
    assert kept(out) == expected


@pytest.mark.parametrize(
    "min_p, expected",
    [(0.5, {0, 1}), (0.4, {0, 1}), (0.0, {0, 1, 2, 3}), (1.0, {0}), (0.25, {0, 1, 2, 3})],
)
def test_min_p_filter_exact(min_p, expected):
    out = min_p_filter(torch.tensor([[0.5, 0.25, 0.125, 0.125]]), torch.tensor([min_p]))
    assert kept(out[0]) == expected


def test_min_p_one_keeps_all_ties_of_the_max():
    out = min_p_filter(torch.tensor([[0.375, 0.25, 0.375]]), torch.tensor([1.0]))
    assert kept(out[0]) == {0, 2}


def test_top_k_filter_returns_sorted_prefix_and_kth():
    probs = torch.tensor([[0.1, 0.4, 0.3, 0.2], [0.25, 0.25, 0.25, 0.25]])
    filtered, prefix, kth = top_k_filter(probs, torch.tensor([2, 1]))
    assert kept(filtered[0]) == {1, 2} and kept(filtered[1]) == {0, 1, 2, 3}
    torch.testing.assert_close(prefix, torch.tensor([[0.4, 0.3], [0.25, 0.25]]))  # tie kept
    torch.testing.assert_close(kth, torch.tensor([0.3, 0.25]))


# ------------------------------------------------------------------------------------
# mixed batches, fast path == slow path, reference implementation
# ------------------------------------------------------------------------------------

MIXED = [
    dict(),
    dict(temperature=0.0),
    dict(top_k=5),
    dict(top_p=0.8, temperature=0.7),
    dict(min_p=0.1),
    dict(top_k=20, top_p=0.9, min_p=0.05, temperature=1.3),
    dict(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2),
    dict(temperature=0.0, repetition_penalty=2.0),
    dict(min_tokens=10, stop_token_ids=[7]),  # 8 outputs so far: still blocked
]


def mixed_rows(vocab: int) -> list[RowContext]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for i, params in enumerate(MIXED):
        prompt = torch.randint(vocab, (12,), generator=gen).tolist()
        output = torch.randint(vocab, (i,), generator=gen).tolist()
        out.append(row(prompt=prompt, output=output, **params))
    return out


def test_each_row_of_a_mixed_batch_gets_its_own_treatment():
    vocab = 300
    logits = torch.randn(len(MIXED), vocab, generator=torch.Generator().manual_seed(0)) * 3
    rows = mixed_rows(vocab)
    batch = logits_to_probs(logits, rows, eos_token_ids=[2])
    for i, r in enumerate(rows):
        alone = logits_to_probs(logits[i : i + 1], [r], eos_token_ids=[2])
        torch.testing.assert_close(batch[i : i + 1], alone, rtol=0, atol=0)
    assert batch[1].max() == 1.0 and batch[7].max() == 1.0  # greedy rows
    assert len(kept(batch[2])) == 5
    assert kept(batch[8]).isdisjoint({2, 7})
    torch.testing.assert_close(batch.sum(-1), torch.ones(len(MIXED)))


def test_fast_path_equals_slow_path(monkeypatch):
    vocab = 2000
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(3)) * 4
    rows = [
        row(output=[1, 2, 3]),
        row(temperature=0.6),
        row(top_k=-1),
        row(temperature=0),
        row(top_k=vocab + 5),
        row(top_p=1.0, min_p=0.0),
    ]
    fast = logits_to_probs(logits, rows)
    monkeypatch.setattr(sampler, "_ALWAYS_SLOW", True)  # every stage runs with its "off" value
    slow = logits_to_probs(logits, rows)
    torch.testing.assert_close(fast, slow, rtol=1e-6, atol=1e-9)


def test_fast_path_does_not_sort(monkeypatch):
    def no_sort(*args, **kwargs):
        raise AssertionError("the fast path must not sort")

    monkeypatch.setattr(torch, "sort", no_sort)
    logits = torch.randn(3, 1000)
    logits_to_probs(logits, [row(), row(top_k=40), row(min_p=0.2, temperature=0.5)])


def test_top_p_probe_and_full_sort_agree(monkeypatch):
    logits = torch.randn(4, 3000, generator=torch.Generator().manual_seed(5)) * 2
    rows = [row(top_p=p) for p in (0.05, 0.5, 0.9, 0.99)]
    with_probe = logits_to_probs(logits, rows)
    monkeypatch.setattr(sampler, "_TOP_P_PROBE", 4)  # forces the full-sort fallback
    full_sort = logits_to_probs(logits, rows)
    assert torch.equal(with_probe, full_sort)


def reference_filter(probs: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Naive per-row top_k -> top_p -> min_p -> renormalise on one float32 softmax row."""
    p = probs.astype(np.float64)
    vocab = p.size
    if 0 < params.top_k < vocab:
        kth = np.sort(p)[::-1][params.top_k - 1]
        p = np.where(p >= kth, p, 0.0)
    if params.top_p < 1.0:
        order = np.sort(p)[::-1]
        cum = np.cumsum(order)
        first = int(np.argmax(cum >= params.top_p * p.sum()))
        p = np.where(p >= order[first], p, 0.0)
    if params.min_p > 0.0:
        p = np.where(p >= params.min_p * p.max(), p, 0.0)
    return p / p.sum()


def test_against_naive_reference():
    vocab = 500
    gen = torch.Generator().manual_seed(11)
    rng = np.random.default_rng(11)
    params = [
        SamplingParams(
            temperature=float(rng.choice([0.5, 1.0, 1.7])),
            top_k=int(rng.choice([0, 1, 3, 50, 499, 600])),
            top_p=float(rng.choice([1.0, 0.3, 0.9, 0.999])),
            min_p=float(rng.choice([0.0, 0.02, 0.3])),
        )
        for _ in range(40)
    ]
    logits = torch.randn(len(params), vocab, generator=gen) * 3
    probs = logits_to_probs(logits, [RowContext(p, [], []) for p in params])
    for i, p in enumerate(params):
        softmax = torch.softmax(logits[i : i + 1] / p.temperature, -1)[0].numpy()
        expected = reference_filter(softmax, p)
        assert kept(probs[i]) == set(np.nonzero(expected)[0].tolist()), p
        np.testing.assert_allclose(probs[i].numpy(), expected, rtol=1e-5, atol=1e-8)


def test_large_vocabulary_smoke():
    vocab = 262144
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(2))
    logits[:, 7] = 30.0
    rows = [row(top_k=5), row(top_p=0.5, output=[7], repetition_penalty=1.1), row(temperature=0.0)]
    probs = logits_to_probs(logits, rows)
    assert probs.shape == (3, vocab) and probs.dtype == torch.float32
    assert len(kept(probs[0])) == 5 and 7 in kept(probs[0])
    assert kept(probs[1]) == {7} and probs[2, 7] == 1.0


# ------------------------------------------------------------------------------------
# sampling: statistics
# ------------------------------------------------------------------------------------


def chi_square_accepts(samples: torch.Tensor, probs: torch.Tensor, *, alpha: float = 1e-4) -> bool:
    """Goodness of fit of integer ``samples`` to ``probs`` [V]; False = rejected at alpha.

    Tokens with zero probability must never be sampled; bins with small expected counts
    are pooled so the chi-square approximation holds.
    """
    probs = probs.double() / probs.double().sum()
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    if bool((counts[probs == 0] > 0).any()):
        return False
    expected = probs * samples.numel()
    big = expected >= 5
    obs = counts[big].tolist()
    exp = expected[big].tolist()
    if bool((~big & (probs > 0)).any()):
        obs.append(counts[~big].sum().item())
        exp.append(expected[~big].sum().item())
    if len(obs) < 2:
        return True
    return stats.chisquare(obs, exp).pvalue >= alpha


def draw_many(probs: torch.Tensor, n: int, seed: int) -> torch.Tensor:  # [V] -> [n]
    gen = make_generator(seed)
    return sample_from_probs(probs.unsqueeze(0).expand(n, -1), [gen] * n)


DISTRIBUTIONS = [
    [0.5, 0.3, 0.2],
    [0.05, 0.0, 0.6, 0.0, 0.25, 0.1],
    (torch.arange(1, 41, dtype=torch.float32) ** 2).tolist(),  # unnormalised weights
]


@pytest.mark.parametrize("probs", DISTRIBUTIONS)
def test_sampling_matches_distribution(probs):
    probs = torch.tensor(probs)
    samples = draw_many(probs, 20000, seed=123)
    assert chi_square_accepts(samples, probs)


def test_chi_square_helper_rejects_a_wrong_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2])
    samples = draw_many(probs, 20000, seed=123)
    assert not chi_square_accepts(samples, torch.tensor([0.47, 0.33, 0.2]))
    assert not chi_square_accepts(samples, torch.tensor([0.5, 0.5, 0.0]))  # zero-prob token drawn


def test_filtered_distribution_sampling_end_to_end():
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -1.0]])
    probs = logits_to_probs(logits, [row(top_k=4, top_p=0.9, temperature=0.8)])[0]
    samples = draw_many(probs, 20000, seed=9)
    assert set(samples.tolist()) <= kept(probs)
    assert chi_square_accepts(samples, probs)


def test_sampling_float64_weights():
    probs = torch.tensor([1e-3, 0.0, 2e-3, 7e-3], dtype=torch.float64)
    samples = draw_many(probs, 20000, seed=4)
    assert chi_square_accepts(samples, probs)


def keyed_draws(probs: torch.Tensor, keys: list[int]) -> torch.Tensor:  # [V] -> [len(keys)]
    return sample_keyed(probs.unsqueeze(0).expand(len(keys), -1), keys)


@pytest.mark.parametrize("probs", DISTRIBUTIONS)
def test_keyed_draws_have_the_distribution_across_seeds_and_across_positions(probs):
    probs = torch.tensor(probs)
    across_seeds = keyed_draws(probs, [position_key(seed, 17) for seed in range(20000)])
    across_positions = keyed_draws(probs, [position_key(2024, t) for t in range(20000)])
    assert chi_square_accepts(across_seeds, probs)
    assert chi_square_accepts(across_positions, probs)


def test_keyed_draws_of_neighbouring_positions_are_independent():
    # The joint of (position t, position t + 1) over seeds must be the product distribution.
    probs = torch.tensor([0.5, 0.3, 0.2])
    seeds = range(30000)
    first = keyed_draws(probs, [position_key(seed, 0) for seed in seeds])
    second = keyed_draws(probs, [position_key(seed, 1) for seed in seeds])
    assert chi_square_accepts(first * 3 + second, torch.outer(probs, probs).flatten())
    # ...and the check can fail: the same key at both positions is perfectly dependent.
    assert not chi_square_accepts(first * 3 + first, torch.outer(probs, probs).flatten())


def test_keyed_draw_is_a_function_of_distribution_and_key_alone():
    probs = torch.softmax(torch.randn(3, 5000, generator=torch.Generator().manual_seed(0)), dim=-1)
    keys = [position_key(5, 0), position_key(5, 1), position_key(6, 0)]
    together = sample_keyed(probs, keys)
    alone = [int(sample_keyed(probs[r : r + 1], [keys[r]])[0]) for r in range(3)]
    assert together.tolist() == alone
    assert sample_keyed(probs.flip(0), keys[::-1]).tolist() == together.flip(0).tolist()
    one_token = torch.zeros(1, 5000)
    one_token[0, 4321] = 0.2
    assert sample_keyed(one_token, keys[:1]).tolist() == [4321]
    with pytest.raises(ValueError, match="positive entry"):
        sample_keyed(torch.zeros(1, 10), keys[:1])


def fmix32(h: int) -> int:  # MurmurHash3's finaliser, on Python ints
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


@pytest.mark.parametrize("key", [0, 1, 0xDEADBEEF, 2**63 + 12345, 2**64 - 1, position_key(7, 3)])
def test_keyed_uniform_is_the_documented_hash(key):
    ids = [0, 1, 2, 255, 65537, 262143, 2**32 - 1]
    got = keyed_uniform(key, torch.tensor(ids)).tolist()
    for token, u in zip(ids, got):
        h = fmix32(fmix32((token * 0x9E3779B9 + key) & 0xFFFFFFFF) ^ (key >> 32))
        assert u == (h + 0.5) / 2**32
        assert 0.0 < u < 1.0


def test_keyed_noise_is_exponential_and_every_key_bit_matters():
    noise = keyed_noise(position_key(1, 0), 200000)
    assert stats.kstest(noise.numpy(), "expon").pvalue > 1e-4
    assert (noise > 0).all()
    for bit in (0, 31, 32, 63):
        assert not torch.equal(keyed_noise(1 << bit, 1000), keyed_noise(0, 1000))


def test_exp_nonpositive_is_exp_to_float32_rounding():
    d = -torch.cat([torch.linspace(0, 86, 100001), torch.rand(10000) * 1e-3])
    got = exp_nonpositive(d)
    torch.testing.assert_close(got, torch.exp(d.double()).float(), rtol=4e-7, atol=0)
    assert exp_nonpositive(torch.tensor([0.0])).item() == 1.0  # the top token weighs exactly 1
    assert exp_nonpositive(torch.tensor([-86.01, -1e4, -float("inf")])).tolist() == [0.0, 0.0, 0.0]


def test_sampling_weights_top_token_is_one_and_errors_name_the_row_problem():
    weights = sampling_weights(torch.tensor([[0.5, 3.0, -float("inf"), 2.0]]), [SamplingParams(temperature=0.5)])
    assert weights[0, 1] == 1.0 and weights[0, 2] == 0.0
    torch.testing.assert_close(weights[0, 3], torch.tensor(math.exp(-2.0)))
    for bad in ([[float("nan"), 1.0]], [[-float("inf"), -float("inf")]]):
        with pytest.raises(ValueError, match="finite logit"):
            sampling_weights(torch.tensor(bad), [SamplingParams(temperature=1.0)])


@pytest.mark.parametrize("force_reference", [False, True])
def test_draw_keyed_has_the_filtered_distribution(force_reference, monkeypatch):
    """draw_keyed over many keys (the C++ kernel, and the torch reference) against logits_to_probs."""
    if force_reference:
        monkeypatch.setattr(sampler, "keyed_draw_rows", lambda *args, **kwargs: None)
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -1.0, -3.0, -float("inf")] + [-2.0] * 9])
    for params in (dict(temperature=0.8), dict(temperature=0.8, top_k=4, top_p=0.9), dict(temperature=1.2, min_p=0.1)):
        r = row(**params)
        probs = logits_to_probs(logits, [r])[0]
        keys = [position_key(seed, 3) for seed in range(6000)]
        draws = torch.cat(
            [sampler.draw_keyed(logits.expand(500, -1), [r] * 500, keys[i : i + 500]) for i in range(0, 6000, 500)]
        )
        assert set(draws.tolist()) <= kept(probs)
        assert chi_square_accepts(draws, probs)


def test_draw_keyed_greedy_rows_take_the_penalised_argmax():
    logits = torch.tensor([[1.0, 3.0, 2.0], [1.0, 3.0, 2.0]])
    rows = [row(temperature=0.0, output=[1], repetition_penalty=4.0), row(temperature=0.0)]
    assert sampler.draw_keyed(logits, rows, [1, 2]).tolist() == [2, 1]


# ------------------------------------------------------------------------------------
# sampling: seeds and generators
# ------------------------------------------------------------------------------------

FLAT = torch.full((1, 1000), 1e-3)


def seeded_sequence(seed: int, steps: int = 20) -> list[int]:
    gen = make_generator(seed)
    return [int(sample_from_probs(FLAT, [gen])[0]) for _ in range(steps)]


def test_same_seed_reproduces_different_seeds_differ():
    assert seeded_sequence(42) == seeded_sequence(42)
    assert seeded_sequence(42) != seeded_sequence(43)


def test_seeded_row_does_not_depend_on_the_rest_of_the_batch():
    vocab = 1000
    probs = torch.softmax(torch.randn(1, vocab, generator=torch.Generator().manual_seed(0)), -1)
    alone_gen = make_generator(7)
    alone = [int(sample_from_probs(probs, [alone_gen])[0]) for _ in range(10)]

    batch_gen, other_gen = make_generator(7), make_generator(8)
    in_batch = []
    for step in range(10):
        others = torch.softmax(torch.randn(3, vocab), -1)
        others[1] = 0.0
        others[1, step] = 1.0  # a one-hot row in between
        batch = torch.cat([others[:2], probs, others[2:]])
        tokens = sample_from_probs(batch, [None, other_gen, batch_gen, None])
        assert int(tokens[1]) == step
        in_batch.append(int(tokens[2]))
    assert in_batch == alone


def test_one_hot_rows_are_deterministic_and_do_not_advance_the_generator():
    gen = make_generator(5)
    state = gen.get_state()
    probs = torch.zeros(2, 10)
    probs[0, 3] = 1.0
    probs[1, 9] = 0.25  # a single non-zero weight, unnormalised
    assert sample_from_probs(probs, [gen, gen]).tolist() == [3, 9]
    assert torch.equal(gen.get_state(), state)


def test_sample_from_probs_rejects_an_all_zero_row():
    with pytest.raises(ValueError, match="positive"):
        sample_from_probs(torch.zeros(1, 4), [None])


def test_global_rng_is_used_without_generator():
    torch.manual_seed(0)
    a = sample_from_probs(FLAT.expand(5, -1), [None] * 5)
    torch.manual_seed(0)
    b = sample_from_probs(FLAT.expand(5, -1), [None] * 5)
    assert torch.equal(a, b)


def test_make_generator():
    assert make_generator(None) is None
    a, b = make_generator(3), make_generator(3)
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))


def test_uniform_per_row_generators():
    draws = uniform([make_generator(1), None, make_generator(2)], [3, 0, 5])
    assert [d.shape for d in draws] == [(3,), (0,), (5,)]
    assert all(d.dtype == torch.float64 for d in draws)
    assert all(bool(((d >= 0) & (d < 1)).all()) for d in draws)
    again = uniform([make_generator(1)], 3)
    assert torch.equal(draws[0], again[0])
    # A row's draws depend only on its own generator.
    assert torch.equal(uniform([make_generator(2)], 5)[0], draws[2])


def test_uniform_is_uniform():
    u = uniform([make_generator(0)], 20000)[0]
    assert stats.kstest(u.numpy(), "uniform").pvalue > 1e-4


# ------------------------------------------------------------------------------------
# logprobs
# ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compute_logprobs_matches_log_softmax(dtype):
    logits = (torch.randn(4, 100, generator=torch.Generator().manual_seed(0)) * 5).to(dtype)
    tokens = torch.tensor([0, 17, 99, 50])
    token_lp, top_ids, top_lp = compute_logprobs(logits, tokens, 5)
    reference = torch.log_softmax(logits.float(), dim=-1)
    assert token_lp.dtype == torch.float32 and top_ids.dtype == torch.int64
    torch.testing.assert_close(token_lp, reference[torch.arange(4), tokens])
    ref_lp, ref_ids = reference.topk(5, dim=-1)
    torch.testing.assert_close(top_lp, ref_lp)
    assert torch.equal(top_ids, ref_ids)
    assert bool((top_lp[:, :-1] >= top_lp[:, 1:]).all())
    assert float(top_lp[0].exp().sum()) <= 1.0 + 1e-6


def test_compute_logprobs_zero_top():
    token_lp, top_ids, top_lp = compute_logprobs(torch.randn(2, 10), torch.tensor([1, 2]), 0)
    assert token_lp.shape == (2,) and top_ids.shape == (2, 0) and top_lp.shape == (2, 0)


def test_compute_logprobs_unnormalized_returns_the_values():
    values = torch.tensor([[1.0, 3.0, -2.0, 0.5]])
    token, top_ids, top = compute_logprobs(values, torch.tensor([3]), 2, normalize=False)
    assert token.tolist() == [0.5] and top_ids.tolist() == [[1, 0]] and top.tolist() == [[3.0, 1.0]]


def test_processed_logits_exact_table():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [2.0, 1.0, 0.0, -1.0], [4.0, -2.0, 1.0, 0.0]])
    rows = [
        row(temperature=0, logit_bias={3: 5.0}),  # greedy: penalized, no temperature, nothing dropped
        row(temperature=0.5, top_k=2),  # / 0.5, all but the top 2 dropped
        row(output=[0], temperature=2.0, repetition_penalty=2.0, min_p=0.5),  # 4 -> 2, / 2, min_p
    ]
    inf = math.inf
    assert processed_logits(logits, rows).tolist() == [
        [2.0, 1.0, 0.0, 4.0],
        [4.0, 2.0, -inf, -inf],
        [1.0, -inf, 0.5, -inf],  # weights e^0, e^-2, e^-0.5, e^-1 against min_p's 0.5: 0 and 2 kept
    ]
    assert logits.tolist()[0] == [2.0, 1.0, 0.0, -1.0]  # the caller's tensor is not written


def test_processed_logprobs_are_the_log_of_the_sampled_distribution():
    logits = torch.randn(6, 400, generator=torch.Generator().manual_seed(3)) * 4
    rows = [
        row(temperature=0.7, top_p=0.8),
        row(temperature=1.3, top_k=20, min_p=0.05),
        row(output=[1, 2, 2], temperature=0.9, presence_penalty=1.0, frequency_penalty=0.5, top_p=0.95),
        row(temperature=1.0, allowed_token_ids=[5, 9, 11]),
        row(temperature=0.01),  # far below the others: exp underflows, which drops nothing
        row(temperature=0.6, top_k=1),
    ]
    probs = logits_to_probs(logits, rows)
    values = torch.log_softmax(processed_logits(logits, rows), dim=-1)
    kept = probs > 1e-30
    torch.testing.assert_close(values[kept].exp(), probs[kept], rtol=2e-5, atol=1e-7)
    assert torch.equal(torch.isneginf(values[:4]), probs[:4] == 0)  # exactly the dropped tokens, where no underflow
    assert not bool(torch.isneginf(values[4]).any())  # an underflow is not a drop


def test_token_ranks_count_the_more_likely_tokens():
    logits = torch.tensor([[0.5, 2.0, 2.0, -1.0], [3.0, 1.0, 0.0, 1.0]])
    ranks = sampler.token_ranks(logits, torch.tensor([3, 1]))
    assert ranks.tolist() == [4, 2]  # ties share the better rank
    assert sampler.token_ranks(logits, torch.tensor([1, 0])).tolist() == [1, 1]
