import pytest
import torch

from quickdraft.kernels import argmax as argmax_module
from quickdraft.kernels.argmax import argmax_rows


def kernel_loaded() -> bool:
    return argmax_module._KERNEL.get() is not None


@pytest.mark.parametrize("rows,vocab", [(1, 1), (1, 17), (3, 16), (2, 16384), (5, 16385), (16, 262144), (4, 40001)])
def test_matches_torch_argmax_on_random_rows(rows, vocab):
    generator = torch.Generator().manual_seed(rows * 7 + vocab)
    logits = torch.randn(rows, vocab, generator=generator)
    assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))


def test_ties_answer_the_first_index_across_lanes_and_chunks():
    logits = torch.zeros(4, 50000)
    logits[0, [5, 3, 40000]] = 2.0  # same lane group, earlier index wins
    logits[1, [16390, 16389]] = 1.0  # neighbouring lanes inside the second chunk
    logits[2, [49999, 20000]] = 3.0  # the second chunk beats the tail
    logits[3, :] = -float("inf")  # nothing larger than -inf: index 0, as torch answers
    assert argmax_rows(logits).tolist() == logits.argmax(dim=-1).tolist() == [3, 16389, 20000, 0]


def test_small_integer_logits_with_many_ties():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 3, (8, 70000), generator=generator).float()
    assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))


def test_nan_answers_its_first_index_like_torch():
    logits = torch.randn(3, 40000, generator=torch.Generator().manual_seed(1))
    logits[0, 30000] = float("nan")
    logits[1, [17000, 99]] = float("nan")
    logits[2, 39999] = float("nan")  # in the scalar tail
    assert argmax_rows(logits).tolist() == logits.argmax(dim=-1).tolist() == [30000, 99, 39999]


def test_other_dtypes_and_views_fall_back_or_copy():
    logits = torch.randn(6, 1000, generator=torch.Generator().manual_seed(2))
    assert torch.equal(argmax_rows(logits.to(torch.bfloat16)), logits.to(torch.bfloat16).argmax(dim=-1))
    strided = logits[::2]
    assert torch.equal(argmax_rows(strided), strided.argmax(dim=-1))
    with pytest.raises(ValueError, match=r"\[M, V\]"):
        argmax_rows(logits[0])


def test_kernel_builds_on_avx2_and_avx512_machines():
    import torch.backends.cpu

    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("neither AVX2 nor AVX-512 on this CPU: torch.argmax is used")
    assert kernel_loaded()
