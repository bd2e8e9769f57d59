"""The C++ keyed draw against its torch reference (sampling_weights + sample_keyed): the same token
for every row, whatever the parameters, the vocabulary or the other rows of the call."""

import math

import pytest
import torch

from quickdraft.kernels import keyed_draw as keyed_draw_module
from quickdraft.kernels.keyed_draw import sampling_weights_rows
from quickdraft.sampling_params import SamplingParams
from quickdraft.verify import sampler
from quickdraft.verify.sampler import RowContext, position_key, sample_keyed, sampling_weights


def kernel_loaded() -> bool:
    return keyed_draw_module._KERNEL.get() is not None


needs_kernel = pytest.mark.skipif(not kernel_loaded(), reason="the C++ keyed draw does not run on this CPU")

SETTINGS = [
    dict(temperature=1.0),
    dict(temperature=0.7, top_p=0.95),
    dict(temperature=0.5, top_k=40),
    dict(temperature=0.9, top_k=50, top_p=0.8),
    dict(temperature=1.3, min_p=0.05),
    dict(temperature=0.7, top_p=0.999),
    dict(temperature=2.0, top_k=3, top_p=0.5, min_p=0.3),
    dict(temperature=0.05, top_p=0.9),
]


def kernel_and_reference(logits: torch.Tensor, params: list[SamplingParams], keys: list[int]):
    """Tokens of the kernel and of the reference, after checking that the weights they race are
    the same bits."""
    rows = [RowContext(params=p, prompt_token_ids=[], output_token_ids=[]) for p in params]
    reference_weights = sampling_weights(logits, params)
    kernel_weights = sampling_weights_rows(
        logits,
        temperature=[p.temperature for p in params],
        top_k=[p.top_k if 0 < p.top_k < logits.shape[1] else logits.shape[1] for p in params],
        top_p=[p.top_p for p in params],
        min_p=[p.min_p for p in params],
    )
    assert torch.equal(kernel_weights, reference_weights)
    kernel = sampler.draw_keyed(logits, rows, keys)
    reference = sample_keyed(reference_weights, keys)
    return kernel.tolist(), reference.tolist()


@needs_kernel
@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
@pytest.mark.parametrize("vocab", [1, 7, 1000, 40001, 262144])
def test_same_tokens_as_the_reference(settings, vocab):
    generator = torch.Generator().manual_seed(vocab)
    rows = 6
    # Logits spread like a language model's (a few dominant tokens over a wide tail).
    logits = torch.randn(rows, vocab, generator=generator) * torch.linspace(1.0, 12.0, rows)[:, None]
    params = [SamplingParams(**settings)] * rows
    keys = [position_key(vocab, t) for t in range(rows)]
    kernel, reference = kernel_and_reference(logits, params, keys)
    assert kernel == reference


@needs_kernel
def test_ties_masks_and_boundaries_agree():
    generator = torch.Generator().manual_seed(3)
    logits = torch.randint(-4, 3, (8, 5003), generator=generator).float()  # many exact ties
    logits[:, ::3] = -float("inf")  # a grammar's mask
    logits[7, :] = -float("inf")
    logits[7, 4321] = 0.0  # one token left
    params = [
        SamplingParams(temperature=1.0, top_k=7),  # the k-th value is tied far beyond k
        SamplingParams(temperature=1.0, top_p=0.5),
        SamplingParams(temperature=0.3, top_p=0.3, top_k=100),
        SamplingParams(temperature=1.0, min_p=1.0),  # only the maximum's ties
        SamplingParams(temperature=1.0, top_p=1e-9),  # only the first maximum's value
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=4.0, top_p=0.9999),
        SamplingParams(temperature=1.0, top_p=0.5),
    ]
    keys = [position_key(11, t) for t in range(8)]
    kernel, reference = kernel_and_reference(logits, params, keys)
    assert kernel == reference
    assert kernel[7] == 4321


@needs_kernel
def test_a_row_draws_the_same_alone_and_beside_other_rows():
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(9, 30000, generator=generator) * 6
    params = [SamplingParams(**SETTINGS[i % len(SETTINGS)]) for i in range(9)]
    rows = [RowContext(params=p, prompt_token_ids=[], output_token_ids=[]) for p in params]
    keys = [position_key(99, t) for t in range(9)]
    together = sampler.draw_keyed(logits, rows, keys).tolist()
    alone = [int(sampler.draw_keyed(logits[i : i + 1], rows[i : i + 1], keys[i : i + 1])[0]) for i in range(9)]
    assert together == alone


@needs_kernel
def test_keys_with_the_top_bit_set():
    logits = torch.randn(1, 5000, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=1.0)]
    for key in (2**63, 2**64 - 1, 2**63 + 7):
        kernel, reference = kernel_and_reference(logits, params, [key])
        assert kernel == reference


@needs_kernel
@pytest.mark.parametrize("bad", ["nan", "no finite"])
def test_bad_rows_raise(bad):
    logits = torch.zeros(2, 100)
    if bad == "nan":
        logits[1, 50] = float("nan")
    else:
        logits[1, :] = -float("inf")
    rows = [RowContext(params=SamplingParams(temperature=1.0), prompt_token_ids=[], output_token_ids=[])] * 2
    with pytest.raises(ValueError, match="finite logit and no NaN"):
        sampler.draw_keyed(logits, rows, [1, 2])


def test_kernel_builds_on_avx2_machines():
    import torch.backends.cpu

    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("no AVX2 on this CPU: the torch reference is used")
    assert kernel_loaded()


def sum_in_order(values: list[float]) -> float:
    total = 0.0
    for value in values:
        total += value
    return total


@needs_kernel
def test_top_p_total_is_the_eight_lane_sum():
    """A top_p whose target sits between the eight-lane total and another summation order of the
    same weights: the kernel and the reference cut at the same place, which pins the definition."""
    for seed in range(100):  # a row whose eight-lane total differs from the one running sum
        logits = torch.randn(1, 4099, generator=torch.Generator().manual_seed(seed)) * 3
        weights = sampling_weights(logits, [SamplingParams(temperature=1.0)])[0].double()  # [V]
        lane_total = float(sum_in_order([float(weights[lane::8].cumsum(0)[-1]) for lane in range(8)]))
        other_total = float(weights.cumsum(0)[-1])
        if lane_total != other_total:
            break
    assert lane_total != other_total
    prefix = weights.sort(descending=True).values.cumsum(0)
    found = None
    for j in range(10, 2000):
        top_p = float(prefix[j]) / lane_total
        for candidate in (math.nextafter(top_p, 0.0), top_p, math.nextafter(top_p, 1.0)):
            if (float(prefix[j]) >= candidate * lane_total) != (float(prefix[j]) >= candidate * other_total):
                found = candidate
        if found is not None:
            break
    assert found is not None
    kernel, reference = kernel_and_reference(logits, [SamplingParams(temperature=1.0, top_p=found)], [5])
    assert kernel == reference


@needs_kernel
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("vocab", [5, 1000, 262144 + 3])
def test_row_logprobs_equal_the_torch_reference(normalize, vocab):
    """One read of each row for its logprobs: the chosen token's value, the top k, its rank; the
    values less the row's logsumexp (summed in double) or as they are."""
    from quickdraft.kernels.keyed_draw import row_logprobs
    from quickdraft.verify.sampler import compute_logprobs, token_ranks

    generator = torch.Generator().manual_seed(vocab)
    values = torch.randn(6, vocab, generator=generator) * 4
    values[1, : vocab // 2] = float("-inf")  # a constrained row
    values[2, 1:] = values[2, 0]  # every value tied: the top k are the smallest ids
    tokens = torch.randint(0, vocab, (6,), generator=generator)
    tokens[1] = vocab - 1
    k = min(5, vocab)
    chosen, top_ids, top_values, ranks = row_logprobs(values, tokens, k, normalize=normalize)
    ref_chosen, ref_ids, ref_values = compute_logprobs(values, tokens, k, normalize=normalize)
    torch.testing.assert_close(chosen, ref_chosen, rtol=0, atol=2e-5)
    torch.testing.assert_close(top_values, ref_values, rtol=0, atol=2e-5)
    assert torch.equal(ranks, token_ranks(values, tokens))
    untied = [row for row in range(6) if row != 2]
    assert torch.equal(top_ids[untied], ref_ids[untied]) and top_ids[2].tolist() == list(range(k))
    # a row's numbers are its own, whatever rows share the call
    alone = row_logprobs(values[4:5], tokens[4:5], k, normalize=normalize)
    assert all(torch.equal(part[4:5], single) for part, single in zip((chosen, top_ids, top_values, ranks), alone))
