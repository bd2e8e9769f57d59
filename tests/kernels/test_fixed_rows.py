"""Fixed-size calls for CUDA's float path (kernels/fixed_rows.py): the results of the calls they
stand for, for any row count and mask (float32, the dtype they pad); their invariance itself needs
a GPU (tests/engine/test_cuda.py, benchmarks/cuda_invariance.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from quickdraft.kernels.fixed_rows import FIXED_ROWS, fixed_rows_attention, fixed_rows_linear


@pytest.mark.parametrize("rows", [1, 5, FIXED_ROWS, FIXED_ROWS + 1, 3 * FIXED_ROWS - 2])
def test_linear_is_f_linear_for_any_row_count(rows):
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 48, generator=generator, dtype=torch.float32)
    weight, bias = torch.randn(20, 48, generator=generator, dtype=torch.float32), torch.randn(20, dtype=torch.float32)
    torch.testing.assert_close(fixed_rows_linear(x, weight, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    folded = x.view(1, rows, 48)
    assert fixed_rows_linear(folded, weight, None).shape == (1, rows, 20)


@pytest.mark.parametrize("rows", [1, 7, FIXED_ROWS + 3])
@pytest.mark.parametrize("masked", [False, True])
def test_attention_is_sdpa_for_any_row_count(rows, masked):
    generator = torch.Generator().manual_seed(rows)
    q = torch.randn(rows, 4, 16, generator=generator, dtype=torch.float32)
    keys, values = (torch.randn(2, 30, 16, generator=generator, dtype=torch.float32) for _ in range(2))
    mask = torch.rand(rows, 30, generator=generator) < 0.6 if masked else None
    if mask is not None:
        mask[:, 0] = True
    out = fixed_rows_attention(q, keys, values, mask=mask, scale=0.25)
    expected = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys[None], values[None], attn_mask=mask, scale=0.25, enable_gqa=True
    )[0].transpose(0, 1)
    assert out.shape == (rows, 4, 16)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
