"""Position-keyed sampling: a seeded request returns the same tokens with or without speculation,
for every drafter, every sampling parameter, and whatever shares its batch."""

from __future__ import annotations

import pytest

from quickdraft import LLM, SamplingParams
from quickdraft.sampling_params import InvalidParameterError
from quickdraft.verify.sampler import position_key
from tests.drafters.test_eagle import random_head
from tests.drafters.test_layer_skip import random_self_head
from tests.drafters.test_medusa import random_heads
from tests.engine.test_speculative import GarbageDrafter, repetitive_prompts

SAMPLINGS = [
    dict(temperature=0.8),
    dict(temperature=1.0, top_k=5),
    dict(temperature=0.7, top_p=0.8),
    dict(temperature=1.3, min_p=0.2),
    dict(temperature=0.9, repetition_penalty=1.3),
    dict(temperature=0.9, presence_penalty=0.5, frequency_penalty=0.3),
    dict(temperature=1.1, min_tokens=10, top_p=0.95),
    dict(temperature=0.8, logit_bias={5: 4.0, 9: -100.0, 17: 2.5}),
    dict(temperature=0.0, allowed_token_ids=list(range(3, 320, 2)), logit_bias={7: 1.5}),
    dict(temperature=0.9, bad_words=["e", "at", "o r"]),
    dict(temperature=0.0),  # greedy beside sampled requests in the same batch
]


def seeded_params(seed_base: int) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=16, seed=seed_base + i, **sampling) for i, sampling in enumerate(SAMPLINGS)]


def batch_prompts() -> list[list[int]]:
    prompts = repetitive_prompts()
    return [prompts[i % len(prompts)] for i in range(len(SAMPLINGS))]


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    root = tmp_path_factory.mktemp("seeded_heads")
    return {
        "eagle3": random_head(root / "eagle3"),
        "eagle3-copy": random_head(root / "copy", copy_dim=16, copy_gate_bias=1.5),
        "medusa": random_heads(root / "medusa"),
        "self": random_self_head(root / "self"),
    }


@pytest.fixture(scope="module")
def plain_seeded(tiny_checkpoints):
    llm = LLM(str(tiny_checkpoints["gemma3"]), max_model_len=256, max_num_seqs=8)
    return [o.outputs[0].token_ids for o in llm.generate(batch_prompts(), seeded_params(100))]


def drafter_configs(tiny_checkpoints, heads) -> dict[str, dict]:
    target = str(tiny_checkpoints["gemma3"])
    return {
        "ngram": {"method": "ngram", "num_speculative_tokens": 4},
        "ngram-tree": {"method": "ngram", "num_speculative_tokens": 4, "num_branches": 3},
        "suffix": {"method": "suffix", "num_speculative_tokens": 6},
        "eagle3": {"method": "eagle3", "head": str(heads["eagle3"]), "num_speculative_tokens": 3, "top_k": 3},
        "eagle3-copy": {"method": "eagle3", "head": str(heads["eagle3-copy"]), "num_speculative_tokens": 3},
        "eagle3-copy-keyed": {"method": "eagle3", "head": str(heads["eagle3-copy"]), "coupling": "keyed"},
        "medusa": {"method": "medusa", "head": str(heads["medusa"])},
        "medusa-keyed": {"method": "medusa", "head": str(heads["medusa"]), "coupling": "keyed"},
        "self": {"method": "self", "head": str(heads["self"])},
        "self-keyed": {"method": "self", "head": str(heads["self"]), "coupling": "keyed"},
        "draft_model": {"method": "draft_model", "model": target, "num_speculative_tokens": 3},
        "draft_model-tree": {"method": "draft_model", "model": target, "num_speculative_tokens": 3, "num_branches": 2},
        "hybrid": {"method": "hybrid", "drafters": [{"method": "suffix"}, {"method": "ngram"}]},
        "adaptive": {"method": "suffix", "num_speculative_tokens": 6, "adaptive": True},
    }


@pytest.mark.parametrize(
    "name",
    [
        "ngram",
        "ngram-tree",
        "suffix",
        "eagle3",
        "eagle3-copy",
        "eagle3-copy-keyed",
        "medusa",
        "medusa-keyed",
        "self",
        "self-keyed",
        "draft_model",
        "draft_model-tree",
        "hybrid",
        "adaptive",
    ],
)
def test_seeded_speculative_equals_seeded_plain(tiny_checkpoints, heads, plain_seeded, name):
    spec = drafter_configs(tiny_checkpoints, heads)[name]
    llm = LLM(str(tiny_checkpoints["gemma3"]), max_model_len=256, max_num_seqs=8, speculative_config=spec)
    outs = llm.generate(batch_prompts(), seeded_params(100))
    assert [o.outputs[0].token_ids for o in outs] == plain_seeded
    assert llm.get_metrics().num_draft_tokens > 0


@pytest.mark.parametrize("name", ["ngram-tree", "suffix", "eagle3", "eagle3-copy-keyed", "draft_model-tree", "hybrid"])
def test_rows_computed_only_where_the_walks_reach_them_change_nothing(tiny_checkpoints, heads, plain_seeded, name):
    """lazy_logits_rows=1: the forward's LM head runs on the roots alone (the draft model's sampled
    chains: on every node) and the walks ask for the rest; same tokens, fewer rows."""
    spec = drafter_configs(tiny_checkpoints, heads)[name]
    computed = {}
    for lazy in (0, 1):
        llm = LLM(
            str(tiny_checkpoints["gemma3"]),
            max_model_len=256,
            max_num_seqs=8,
            speculative_config=spec,
            lazy_logits_rows=lazy,
        )
        outs = llm.generate(batch_prompts(), seeded_params(100))
        assert [o.outputs[0].token_ids for o in outs] == plain_seeded
        assert llm.get_metrics().num_draft_tokens > 0
        computed[lazy] = llm.get_metrics().num_logits_rows
    assert computed[1] < computed[0]


@pytest.mark.parametrize("tree", [False, True])
def test_garbage_drafts_and_other_requests_change_nothing(tiny_checkpoints, plain_seeded, tree):
    """Random drafts, requests alone or beside others, in another order: same tokens per seed."""
    llm = LLM(
        str(tiny_checkpoints["gemma3"]),
        max_model_len=256,
        max_num_seqs=8,
        speculative_config={"method": "ngram", "num_speculative_tokens": 6},
    )
    llm.engine.speculator.drafter = GarbageDrafter(vocab_size=320, tree=tree, seed=5)
    prompts, params = batch_prompts(), seeded_params(100)
    alone = [llm.generate([p], q)[0].outputs[0].token_ids for p, q in zip(prompts, params)]
    assert alone == plain_seeded
    order = list(reversed(range(len(prompts))))
    shuffled = llm.generate([prompts[i] for i in order], [params[i] for i in order])
    assert [shuffled[order.index(i)].outputs[0].token_ids for i in range(len(prompts))] == plain_seeded


def test_logit_bias_and_allowed_tokens_shape_the_output(tiny_checkpoints, plain_seeded):
    allowed = SAMPLINGS.index(dict(temperature=0.0, allowed_token_ids=list(range(3, 320, 2)), logit_bias={7: 1.5}))
    assert all(token % 2 == 1 and token >= 3 for token in plain_seeded[allowed])
    biased = SAMPLINGS.index(dict(temperature=0.8, logit_bias={5: 4.0, 9: -100.0, 17: 2.5}))
    assert 9 not in plain_seeded[biased]
    llm = LLM(str(tiny_checkpoints["gemma3"]), max_model_len=128, speculative_config={"method": "suffix"})
    forced = llm.generate(batch_prompts()[:1], SamplingParams(max_tokens=8, temperature=0.0, logit_bias={42: 100.0}))
    assert forced[0].outputs[0].token_ids == [42] * 8


def test_a_few_allowed_tokens_are_computed_alone_not_through_the_lm_head(tiny_checkpoints):
    llm = LLM(str(tiny_checkpoints["gemma3"]), max_model_len=128, speculative_config={"method": "suffix"})
    computed: list[list[int]] = []
    logits_of_tokens = llm.engine.model.logits_of_tokens

    def spy(hidden, token_lists):
        computed.extend(token_lists)
        return logits_of_tokens(hidden, token_lists)

    llm.engine.model.logits_of_tokens = spy
    allowed = [11, 40, 41, 97, 200]
    params = SamplingParams(max_tokens=24, temperature=0.0, allowed_token_ids=list(reversed(allowed)))
    alone = llm.generate(batch_prompts()[:1], params)[0].outputs[0].token_ids
    assert set(alone) <= set(allowed)
    assert computed and all(tokens == allowed for tokens in computed)
    assert llm.get_metrics().num_draft_tokens > 0  # verified trees went this way too
    # with logprobs asked the rows go through the whole LM head (logprobs read every token)
    computed.clear()
    llm.generate(batch_prompts()[:1], SamplingParams(max_tokens=4, allowed_token_ids=allowed, logprobs=2))
    assert computed == []


def test_token_ids_outside_the_vocabulary_are_refused_naming_the_field(tiny_checkpoints):
    llm = LLM(str(tiny_checkpoints["gemma3"]), max_model_len=128)
    vocab = llm.engine.model_config.vocab_size
    for field, value in [
        ("logit_bias", {vocab: 1.0}),
        ("allowed_token_ids", [1, vocab + 5]),
        ("stop_token_ids", [vocab]),
    ]:
        with pytest.raises(InvalidParameterError, match=f"^{field} has token ids outside") as info:
            llm.engine.add_request(prompt_token_ids=[1, 2, 3], params=SamplingParams(**{field: value}))
        assert info.value.param == field
    assert not llm.engine.has_unfinished_requests()


def test_unseeded_requests_get_a_seed_that_replays_them(tiny_checkpoints):
    path = str(tiny_checkpoints["gemma3"])
    llm = LLM(path, max_model_len=128, speculative_config={"method": "suffix"})
    params = SamplingParams(max_tokens=12, temperature=1.0)
    first = llm.generate([repetitive_prompts()[0]], params)[0]
    assert isinstance(first.seed, int)
    replay = LLM(path, max_model_len=128).generate(
        [repetitive_prompts()[0]], SamplingParams(max_tokens=12, temperature=1.0, seed=first.seed)
    )[0]
    assert replay.outputs[0].token_ids == first.outputs[0].token_ids
    second = llm.generate([repetitive_prompts()[0]], params)[0]
    assert second.seed != first.seed


def test_position_key_depends_on_both_and_is_stable():
    keys = {position_key(seed, position) for seed in range(50) for position in range(50)}
    assert len(keys) == 2500
    assert position_key(42, 7) == position_key(42, 7)
    assert all(0 <= key < 2**64 for key in keys)
