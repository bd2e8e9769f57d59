"""The draft-model drafter: its own KV cache in step with the target, exact for any draft model."""

from __future__ import annotations

import pytest
import torch

from quickdraft import LLM, SamplingParams
from tests.conftest import build_tiny_checkpoint
from tests.engine.test_speculative import repetitive_prompts
from tests.stats_checks import count_outputs, same_distribution_p_value

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def other_gemma(tmp_path_factory):
    """A different random model with the same vocabulary: a poor but valid draft model."""
    return build_tiny_checkpoint("gemma3", tmp_path_factory.mktemp("draft") / "gemma3", seed=5)


@pytest.fixture(scope="module")
def plain(tiny_checkpoints):
    llm = LLM(str(tiny_checkpoints["gemma3"]), max_model_len=256, max_num_seqs=3)
    return [o.outputs[0].token_ids for o in llm.generate(repetitive_prompts(), SamplingParams(max_tokens=30, **GREEDY))]


@pytest.mark.parametrize("draft", ["self", "other"])
def test_greedy_equals_plain_in_a_mixed_batch(tiny_checkpoints, other_gemma, plain, draft):
    target = str(tiny_checkpoints["gemma3"])
    draft_path = target if draft == "self" else str(other_gemma)
    llm = LLM(target, max_model_len=256, max_num_seqs=3, speculative_model=draft_path, num_speculative_tokens=4)
    outs = llm.generate(repetitive_prompts(), SamplingParams(max_tokens=30, **GREEDY))
    assert [o.outputs[0].token_ids for o in outs] == plain
    metrics = llm.get_metrics()
    assert metrics.num_drafts > 0
    if draft == "self":  # the target drafting for itself: (almost) everything is accepted
        assert metrics.acceptance_rate > 0.9 and metrics.acceptance_length > 3.5
    drafter = llm.engine.speculator.drafter
    assert drafter.cache.num_free_slots == drafter.cache.num_slots  # every draft slot given back


def test_sampled_with_the_target_as_draft_accepts_almost_everything(tiny_checkpoints):
    target = str(tiny_checkpoints["gemma3"])
    llm = LLM(
        target,
        max_model_len=256,
        speculative_config={"method": "draft_model", "model": target, "num_speculative_tokens": 3},
    )
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=30, seed=3)
    first = llm.generate([repetitive_prompts()[1]], params)[0].outputs[0].token_ids
    again = llm.generate([repetitive_prompts()[1]], params)[0].outputs[0].token_ids
    assert first == again
    assert llm.get_metrics().acceptance_rate > 0.9  # same distributions: min(1, p/q) = 1


SAMPLING = {
    "top_k": dict(temperature=1.0, top_k=3),
    "top_p": dict(temperature=0.7, top_p=0.8),
    "min_p": dict(temperature=1.3, min_p=0.25),
}


@pytest.mark.parametrize(
    "num_branches, sampling, draft",
    [
        (1, "top_k", "far"),
        (1, "top_p", "far"),
        (1, "min_p", "far"),
        (1, "top_k", "close"),
        (1, "top_p", "close"),
        (1, "min_p", "close"),
        (2, "top_k", "far"),
        (2, "top_k", "close"),
    ],
)
def test_sampled_tokens_have_the_target_distribution(tiny_checkpoints, other_gemma, num_branches, sampling, draft):
    """The rejection coupling: chain (sampled drafts, min(1, p/q)) and tree (top-k side leaves,
    point masses), with a draft distribution far from the target (another random model) and
    close to it (itself)."""
    target = str(tiny_checkpoints["gemma3"])
    draft_model = str(other_gemma) if draft == "far" else target
    base = repetitive_prompts()[1][:5]
    params = [SamplingParams(max_tokens=3, seed=s, **SAMPLING[sampling]) for s in range(1200)]
    plain = count_outputs(LLM(target, max_model_len=64, max_num_seqs=8), base, params)
    spec_llm = LLM(
        target,
        max_model_len=64,
        max_num_seqs=8,
        speculative_config={
            "method": "draft_model",
            "model": draft_model,
            "coupling": "rejection",
            "num_speculative_tokens": 2,
            "num_branches": num_branches,
        },
    )
    spec = count_outputs(spec_llm, base, params)
    assert spec_llm.get_metrics().num_accepted_tokens > 100
    assert same_distribution_p_value(plain, spec) > 1e-3


@pytest.mark.parametrize("sampling", ["top_k", "top_p", "min_p"])
@pytest.mark.parametrize("draft", ["far", "close"])
@pytest.mark.parametrize("num_branches", [1, 2])
def test_keyed_coupling_returns_the_seeded_plain_tokens(tiny_checkpoints, other_gemma, sampling, draft, num_branches):
    """Drafts drawn with the target's own position-keyed noise: every seeded request commits
    exactly the tokens of the seeded plain run, and a draft close to the target is accepted."""
    target = str(tiny_checkpoints["gemma3"])
    draft_model = str(other_gemma) if draft == "far" else target
    prompts = [p[:6] for p in repetitive_prompts()]
    params = [SamplingParams(max_tokens=12, seed=s, **SAMPLING[sampling]) for s in range(len(prompts))]
    plain = LLM(target, max_model_len=64, max_num_seqs=4).generate(prompts, params)
    spec_llm = LLM(
        target,
        max_model_len=64,
        max_num_seqs=4,
        speculative_config={
            "method": "draft_model",
            "model": draft_model,
            "num_speculative_tokens": 3,
            "num_branches": num_branches,
        },
    )
    spec = spec_llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    metrics = spec_llm.get_metrics()
    assert metrics.num_draft_tokens > 0
    if draft == "close":  # the same distribution and the same noise: the same draw (chains of 3)
        assert metrics.num_accepted_tokens > 2.5 * metrics.num_drafts


def test_coupling_is_checked(tiny_checkpoints):
    target = str(tiny_checkpoints["gemma3"])
    with pytest.raises(ValueError, match="coupling"):
        LLM(target, speculative_config={"method": "draft_model", "model": target, "coupling": "gumbel"})


def test_vocabulary_mismatch_is_a_clear_error(tiny_checkpoints, tmp_path):
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=300,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "small")
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(str(tiny_checkpoints["llama"]), speculative_model=str(tmp_path / "small"))


def test_missing_draft_model(tiny_checkpoints, tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        LLM(str(tiny_checkpoints["llama"]), speculative_model=str(tmp_path / "none"))
    with pytest.raises(ValueError, match="needs a draft 'model'"):
        LLM(str(tiny_checkpoints["llama"]), speculative_config={"method": "draft_model"})


def test_draft_cache_rolls_back_to_the_accepted_prefix(tiny_checkpoints, other_gemma):
    """After each step the draft cache holds exactly committed tokens (at most one behind)."""
    target = str(tiny_checkpoints["gemma3"])
    llm = LLM(target, max_model_len=256, speculative_model=str(other_gemma), num_speculative_tokens=4)
    engine = llm.engine
    request_id = engine.add_request(
        prompt_token_ids=repetitive_prompts()[0], params=SamplingParams(max_tokens=25, **GREEDY)
    )
    drafter = engine.speculator.drafter
    view = engine.speculator.view(engine.get_request(request_id))
    assert drafter.catch_up_rows(view) == len(repetitive_prompts()[0])  # its first draft feeds them all
    while engine.has_unfinished_requests():
        engine.step()
        state = drafter._states.get(request_id)
        if state is not None:
            request = engine.get_request(request_id)
            assert drafter.cache.lengths[state.slot] <= request.num_tokens - 1
            if request.metrics.num_drafts:  # then it owes only what the last step committed
                assert 1 <= drafter.catch_up_rows(view) <= 4 + 1
    assert torch.is_tensor(drafter.cache.keys[0])


def test_tree_mode_greedy_equals_plain_and_uses_side_branches(tiny_checkpoints, other_gemma, plain):
    target = str(tiny_checkpoints["gemma3"])
    llm = LLM(
        target,
        max_model_len=256,
        max_num_seqs=3,
        speculative_config={
            "method": "draft_model",
            "model": str(other_gemma),
            "num_speculative_tokens": 3,
            "num_branches": 3,
        },
    )
    outs = llm.generate(repetitive_prompts(), SamplingParams(max_tokens=30, **GREEDY))
    assert [o.outputs[0].token_ids for o in outs] == plain
    metrics = llm.get_metrics()
    assert metrics.num_draft_tokens > 3 * metrics.num_drafts  # trees, not chains
