"""apply_token_bitmask: the C++ kernel and the torch path give the same masked logits."""

from __future__ import annotations

import pytest
import torch

from quickdraft.kernels import token_mask


def reference(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    allowed = torch.tensor(
        [[(int(bitmask[r, t // 32]) >> (t % 32)) & 1 for t in range(logits.shape[1])] for r in range(logits.shape[0])],
        dtype=torch.bool,
    )
    return logits.masked_fill(~allowed, float("-inf"))


@pytest.mark.parametrize("vocab", [320, 333, 64])
@pytest.mark.parametrize("kernel", [True, False])
def test_masked_logits_equal_the_bitwise_reference(monkeypatch, vocab, kernel):
    if kernel:
        assert token_mask._KERNEL.get() is not None  # portable C++: builds wherever torch's extensions do
    else:
        monkeypatch.setattr(token_mask._KERNEL, "get", lambda: None)
    generator = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (5, words), dtype=torch.int32, generator=generator)
    bitmask[1] = -1  # everything allowed
    bitmask[2] = 0  # nothing allowed...
    bitmask[2, 0] = 1 << 3  # ...but token 3
    bitmask[3, : words // 2] = 0  # a mix of whole zero words and patterns
    logits = torch.randn(5, vocab, generator=generator)
    expected = reference(logits, bitmask)
    token_mask.apply_token_bitmask(logits, bitmask)
    assert torch.equal(logits, expected)
    assert torch.isfinite(logits[2]).nonzero().flatten().tolist() == [3]


def test_shapes_that_do_not_fit_are_refused():
    with pytest.raises(ValueError, match="do not fit"):
        token_mask.apply_token_bitmask(torch.zeros(2, 64), torch.zeros(3, 2, dtype=torch.int32))
