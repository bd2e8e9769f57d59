"""`[self]` drafting (the target's first layers + a light head) on tiny random models."""

from __future__ import annotations

import pytest
import torch

from quickdraft import LLM, SamplingParams
from quickdraft.models.medusa import LayerSkipHead
from tests.drafters.test_medusa import random_heads
from tests.engine.test_speculative import repetitive_prompts
from tests.stats_checks import assert_speculation_keeps_sampling

GREEDY = dict(temperature=0.0, ignore_eos=True)


def random_self_head(directory, *, feature_layer=1, **options):
    return random_heads(directory, num_heads=1, feature_layer=feature_layer, kind=LayerSkipHead, **options)


@pytest.fixture(scope="module")
def self_head(tmp_path_factory):
    return random_self_head(tmp_path_factory.mktemp("self") / "head")


@pytest.mark.parametrize("arch", ["gemma3", "llama"])
@pytest.mark.parametrize(
    "shape",
    [
        dict(top_k=1),
        dict(top_k=2, max_draft_tokens=8),
        dict(top_k=3, min_draft_prob=0.004),
        dict(top_k=2, head_dtype="bfloat16"),
    ],
)
def test_greedy_equals_plain(tiny_checkpoints, self_head, arch, shape):
    path = str(tiny_checkpoints[arch])
    params = SamplingParams(max_tokens=30, **GREEDY)
    plain = LLM(path, max_model_len=256, max_num_seqs=4).generate(repetitive_prompts(), params)
    llm = LLM(
        path,
        max_model_len=256,
        max_num_seqs=4,
        speculative_config={"model": "[self]", "head": str(self_head), "num_speculative_tokens": 3, **shape},
    )
    outs = llm.generate(repetitive_prompts(), params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    metrics = llm.get_metrics()
    assert metrics.num_drafts > 20 and metrics.num_draft_tokens >= metrics.num_drafts


@pytest.mark.parametrize("arch", ["gemma3", "llama"])
def test_chain_is_the_heads_argmax_over_a_fresh_early_layer_pass(tiny_checkpoints, self_head, arch):
    """The drafter reads the target's cached early-layer KV of the committed tokens: each draft
    token equals the head's argmax after running the early layers over the whole sequence so
    far from scratch, in another slot."""
    from quickdraft.drafters.base import DraftRequest
    from quickdraft.engine.runner import SequenceWork

    llm = LLM(
        str(tiny_checkpoints[arch]),
        max_model_len=128,
        max_num_seqs=4,
        speculative_config={"method": "self", "head": str(self_head), "top_k": 1, "num_speculative_tokens": 4},
    )
    engine, drafter = llm.engine, llm.engine.speculator.drafter
    prompt = repetitive_prompts()[3]
    slot = engine.cache.allocate()
    engine.runner.forward([SequenceWork(slot=slot, cache_len=0, token_ids=prompt[:-1])])
    engine.cache.commit(slot, len(prompt) - 1)
    request = DraftRequest(
        request_id="r", prompt_token_ids=prompt, output_token_ids=[], budget=4, max_depth=4, slot=slot
    )
    (proposal,) = drafter.propose([request])
    assert proposal.parents == [-1, 0, 1, 2, 3]
    scratch = engine.cache.allocate()
    for depth in range(1, 5):
        sequence = prompt + proposal.token_ids[1:depth]
        out = engine.runner.forward(
            [SequenceWork(slot=scratch, cache_len=0, token_ids=sequence)], end_layer=drafter.head.exit_layer
        )
        with torch.no_grad():
            expected = drafter.head.d2t[drafter.head(out.forward.hidden_states[-1:])[0, 0].argmax()]
        assert proposal.token_ids[depth] == int(expected)


def test_sampled_tokens_have_the_target_distribution(tiny_checkpoints, tmp_path):
    """An early-exit head (zero block: the target's own norm and LM rows after 3 of 4 layers)
    proposes tokens the target often takes, so accepts and rejections are both exercised."""
    early_exit = random_self_head(tmp_path / "exit", feature_layer=2, draft_vocab=320, scale=0.0)
    assert_speculation_keeps_sampling(
        str(tiny_checkpoints["gemma3"]),
        {"method": "self", "head": str(early_exit), "num_speculative_tokens": 2, "top_k": 3, "max_draft_tokens": 6},
        prompt=repetitive_prompts()[1][:5],
    )


def test_bad_heads_are_clear_errors(tiny_checkpoints, self_head, tmp_path):
    path = str(tiny_checkpoints["gemma3"])
    with pytest.raises(ValueError, match="no self head is shipped"):
        LLM(path, speculative_config={"model": "[self]"})
    with pytest.raises(ValueError, match="is the 'self' method"):
        LLM(path, speculative_config={"model": "[self]", "method": "ngram"})
    with pytest.raises(ValueError, match="before the target's last layer"):
        LLM(path, speculative_config={"method": "self", "head": str(random_self_head(tmp_path / "x", feature_layer=3))})
    with pytest.raises(ValueError, match="hidden size"):
        LLM(path, speculative_config={"method": "self", "head": str(random_self_head(tmp_path / "w", hidden=32))})
    with pytest.raises(ValueError, match="top_k"):
        LLM(path, speculative_config={"method": "self", "head": str(self_head), "top_k": 0})
