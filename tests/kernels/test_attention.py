"""The batch-invariant attention kernel (csrc/attention.cpp, attention_row.h): close to torch's,
and a query row's bits whatever the other rows of the call (rows of a wide call share key and
value reads between the query heads of a key head: as many heads per call as keep the threads busy)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from quickdraft.kernels.attention import attention, kernel_available

pytestmark = pytest.mark.skipif(not kernel_available(), reason="no AVX-512 attention kernel on this CPU")


def _inputs(T: int, H: int, Hkv: int, D: int, S: int, *, seed: int):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, D, generator=generator)
    cache = torch.randn(2, Hkv, S + 3, D, generator=generator)  # a cache slot: rows of D, a longer length
    keys, values = cache[0, :, 1 : S + 1], cache[1, :, 1 : S + 1]  # views with the cache's strides
    mask = torch.rand(T, S, generator=generator) < 0.7
    mask[:, 0] = True
    return q, keys, values, mask


@pytest.mark.parametrize("H,Hkv,D", [(4, 1, 256), (4, 2, 64), (8, 1, 128), (8, 2, 48), (3, 1, 32), (2, 2, 16)])
@pytest.mark.parametrize("T", [1, 5, 40])
def test_close_to_torch_and_rows_invariant(H, Hkv, D, T):
    q, keys, values, mask = _inputs(T, H, Hkv, D, 37, seed=T * 100 + D)
    out = attention(q, keys, values, mask=mask, scale=D**-0.5)
    expected = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys[None], values[None], attn_mask=mask, scale=D**-0.5, enable_gqa=Hkv != H
    )[0].transpose(0, 1)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    alone = torch.cat([attention(q[t : t + 1], keys, values, mask=mask[t : t + 1], scale=D**-0.5) for t in range(T)])
    assert torch.equal(out, alone)
    perm = torch.randperm(T, generator=torch.Generator().manual_seed(1))
    assert torch.equal(attention(q[perm], keys, values, mask=mask[perm], scale=D**-0.5), out[perm])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_are_widened_to_the_invariant_kernel(dtype):
    """bfloat16 / float16 layers: the float32 kernel on their exact widening, rounded once, so
    rows keep their bits whatever the call (torch's attention in those dtypes does not)."""
    q, keys, values, mask = (t.to(dtype) if t.is_floating_point() else t for t in _inputs(9, 8, 2, 64, 40, seed=5))
    out = attention(q, keys, values, mask=mask, scale=0.125)
    assert out.dtype == dtype
    widened = attention(q.float(), keys.float().contiguous(), values.float().contiguous(), mask=mask, scale=0.125)
    assert torch.equal(out, widened.to(dtype))
    alone = torch.cat([attention(q[t : t + 1], keys, values, mask=mask[t : t + 1], scale=0.125) for t in range(9)])
    assert torch.equal(out, alone)


def test_a_row_that_sees_nothing_is_zero():
    q, keys, values, mask = _inputs(16, 4, 1, 64, 9, seed=3)
    mask[5] = False
    out = attention(q, keys, values, mask=mask, scale=0.125)
    assert torch.equal(out[5], torch.zeros_like(out[5]))
    assert torch.equal(out[4], attention(q[4:5], keys, values, mask=mask[4:5], scale=0.125)[0])


@pytest.mark.parametrize("H,Hkv,D", [(4, 1, 256), (8, 2, 64)])
def test_heads_sharing_a_call_keep_their_bits(H, Hkv, D):
    """How many query heads share a call (and their key reads) follows the rows and the threads:
    with many threads a one-row call runs one head per call, with one thread all heads of a key
    head share it; the bits are the same."""
    q, keys, values, mask = _inputs(3, H, Hkv, D, 300, seed=7)
    threads = torch.get_num_threads()
    outs = []
    try:
        for num_threads in (1, 2, 64):
            torch.set_num_threads(num_threads)
            outs.append([attention(q[t : t + 1], keys, values, mask=mask[t : t + 1], scale=D**-0.5) for t in range(3)])
            outs[-1].append(attention(q, keys, values, mask=mask, scale=D**-0.5))
    finally:
        torch.set_num_threads(threads)
    for other in outs[1:]:
        for mine, theirs in zip(outs[0], other):
            assert torch.equal(mine, theirs)
    assert torch.equal(torch.cat(outs[0][:3]), outs[0][3])


@pytest.mark.parametrize("H,Hkv,D", [(4, 1, 256), (8, 2, 64), (3, 1, 32), (2, 2, 16)])
@pytest.mark.parametrize("T", [1, 5, 40])
def test_sinks_join_each_softmax_and_rows_stay_invariant(H, Hkv, D, T):
    """gpt-oss's attention sinks: per head a logit in the softmax's denominator whose weight goes
    nowhere, as transformers computes it; the rows keep their bits whatever the call, and a row
    that sees no key is zero (the sink takes all the weight)."""
    from quickdraft.kernels.fixed_rows import sdpa_rows

    q, keys, values, mask = _inputs(T, H, Hkv, D, 37, seed=T * 7 + D)
    sinks = torch.randn(H, generator=torch.Generator().manual_seed(D)) * 2
    out = attention(q, keys, values, mask=mask, scale=D**-0.5, sinks=sinks)
    group = H // Hkv
    scores = torch.einsum("thd,hsd->hts", q, keys.repeat_interleave(group, 0)) * D**-0.5  # [H, T, S]
    scores = scores.masked_fill(~mask[None], float("-inf"))
    with_sink = torch.cat([scores, sinks[:, None, None].expand(-1, T, 1)], dim=-1).softmax(-1)[..., :-1]
    expected = torch.einsum("hts,hsd->thd", with_sink, values.repeat_interleave(group, 0))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out, attention(q, keys, values, mask=mask, scale=D**-0.5), atol=1e-3)
    torch.testing.assert_close(sdpa_rows(q, keys, values, mask=mask, scale=D**-0.5, sinks=sinks), expected)
    alone = [attention(q[t : t + 1], keys, values, mask=mask[t : t + 1], scale=D**-0.5, sinks=sinks) for t in range(T)]
    assert torch.equal(out, torch.cat(alone))
    blind = torch.zeros(1, keys.shape[1], dtype=torch.bool)
    assert torch.equal(attention(q[:1], keys, values, mask=blind, scale=D**-0.5, sinks=sinks), torch.zeros(1, H, D))
