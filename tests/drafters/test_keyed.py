"""Keyed first children: the head's draw with the target's noise of that output position."""

from __future__ import annotations

import pytest
import torch

from quickdraft.drafters.base import DraftRequest
from quickdraft.drafters.keyed import KeyedDraw, check_coupling, coupled_order
from quickdraft.sampling_params import SamplingParams
from quickdraft.verify.sampler import position_key, sample_keyed


def test_keyed_draws_follow_the_requests_positions_and_skip_greedy_ones():
    sampled = DraftRequest("a", [1, 2], [3, 4, 5], budget=4, params=SamplingParams(temperature=0.7), seed=9)
    draw = KeyedDraw.of(sampled)
    assert draw == KeyedDraw(seed=9, first_position=3, temperature=0.7)
    assert [draw.key(d) for d in (1, 2)] == [position_key(9, 3), position_key(9, 4)]
    greedy = DraftRequest("b", [1], [], budget=4, params=SamplingParams(temperature=0.0), seed=9)
    assert KeyedDraw.of(greedy) is None and KeyedDraw.of(DraftRequest("c", [1], [], budget=4)) is None
    with pytest.raises(ValueError, match="coupling must be one of"):
        check_coupling("rejection")


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_the_first_column_is_sample_keyed_of_the_heads_distribution(temperature):
    """Over many keys: the drawn column is exactly sample_keyed(q^(1/T) over target ids, key);
    the rest are the most likely others in order."""
    vocab, generator = 50, torch.Generator().manual_seed(3)
    ids = torch.randperm(vocab, generator=generator)[:20]  # a draft vocabulary of 20 target ids
    log_probs = torch.log_softmax(torch.randn(20, generator=generator) * 2, dim=-1)
    best = log_probs.argsort(descending=True).tolist()
    for position in range(200):
        key = position_key(5, position)
        order = coupled_order(log_probs, ids, best[:4], noise_key=key, temperature=temperature)
        spread = torch.zeros(vocab).index_add_(0, ids, (log_probs / temperature).exp())[None]
        assert int(ids[order[0]]) == int(sample_keyed(spread, [key])[0])
        assert order[1:] == [c for c in best[:4] if c != order[0]]
