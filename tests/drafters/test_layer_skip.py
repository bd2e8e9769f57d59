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


def draft_a_chain_of_four(checkpoint, head):
    """A [self] drafter with `head` drafts a chain of 4 after a prompt prefilled by hand (the
    drafter given the prefill's features when its head copies); returns the engine, the
    drafter, the prompt and the proposal."""
    from quickdraft.drafters.base import DraftRequest
    from quickdraft.engine.runner import SequenceWork

    llm = LLM(
        str(checkpoint),
        max_model_len=128,
        max_num_seqs=4,
        speculative_config={"method": "self", "head": str(head), "top_k": 1, "num_speculative_tokens": 4},
    )
    engine, drafter = llm.engine, llm.engine.speculator.drafter
    prompt = repetitive_prompts()[3]
    slot = engine.cache.allocate()
    prefill = engine.runner.forward(
        [SequenceWork(slot=slot, cache_len=0, token_ids=prompt[:-1])], capture_layers=drafter.feature_layers
    )
    engine.cache.commit(slot, len(prompt) - 1)
    request = DraftRequest(
        request_id="r", prompt_token_ids=prompt, output_token_ids=[], budget=4, max_depth=4, slot=slot
    )
    drafter.begin(request)
    for layer in drafter.feature_layers:
        drafter.observe(request, prefill.forward.captured[layer])
    (proposal,) = drafter.propose([request])
    assert proposal.parents == [-1, 0, 1, 2, 3]
    return engine, drafter, prompt, proposal


def early_layer_pass(engine, drafter, token_ids: list[int]) -> torch.Tensor:  # -> [T, D]
    """The early layers over `token_ids` from scratch, in a fresh slot."""
    from quickdraft.engine.runner import SequenceWork

    scratch = engine.cache.allocate()
    out = engine.runner.forward(
        [SequenceWork(slot=scratch, cache_len=0, token_ids=token_ids)], end_layer=drafter.head.exit_layer
    )
    engine.cache.free(scratch)
    return out.forward.hidden_states


@pytest.mark.parametrize("arch", ["gemma3", "llama"])
def test_chain_is_the_heads_argmax_over_a_fresh_early_layer_pass(tiny_checkpoints, self_head, arch):
    """The drafter reads the target's cached early-layer KV of the committed tokens: each draft
    token equals the head's argmax after running the early layers over the whole sequence so
    far from scratch, in another slot."""
    engine, drafter, prompt, proposal = draft_a_chain_of_four(tiny_checkpoints[arch], self_head)
    for depth in range(1, 5):
        hidden = early_layer_pass(engine, drafter, prompt + proposal.token_ids[1:depth])
        with torch.no_grad():
            expected = drafter.head.d2t[drafter.head(hidden[-1:])[0, 0].argmax()]
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


# ---- a head with a copy path --------------------------------------------------------------------
@pytest.fixture(scope="module")
def copy_head(tmp_path_factory):
    return random_self_head(tmp_path_factory.mktemp("self-copy") / "head", copy_dim=8)


@pytest.mark.parametrize("arch", ["gemma3", "llama"])
@pytest.mark.parametrize("shape", [dict(top_k=1), dict(top_k=2, max_draft_tokens=8)])
def test_copy_head_greedy_equals_plain_also_after_prefix_cache_hits(tiny_checkpoints, copy_head, arch, shape):
    """The second round hits the prefix cache: those tokens reach the drafter as the features
    stored when the first round computed them, and copying goes on over the whole context."""
    path = str(tiny_checkpoints[arch])
    params = SamplingParams(max_tokens=30, **GREEDY)
    plain = [o.outputs[0].token_ids for o in LLM(path, max_model_len=256).generate(repetitive_prompts(), params)]
    llm = LLM(
        path,
        max_model_len=256,
        max_num_seqs=4,
        speculative_config={"model": "[self]", "head": str(copy_head), "num_speculative_tokens": 3, **shape},
    )
    drafter = llm.engine.speculator.drafter
    assert drafter.feature_layers == (drafter.head.config.feature_layer,)
    for _ in range(2):
        assert [o.outputs[0].token_ids for o in llm.generate(repetitive_prompts(), params)] == plain
    metrics = llm.get_metrics()
    assert metrics.num_drafts > 40 and metrics.num_accepted_tokens > 0 and metrics.num_cached_tokens > 0


@pytest.mark.parametrize("arch", ["gemma3", "llama"])
def test_copy_head_drafts_what_training_scores(tiny_checkpoints, copy_head, arch):
    """Drafting and training read the copy path the same way: each token of a drafted chain is
    the top-1 of the training forward's mixture (unrolled_mixtures) at the draft's anchor, with
    the early-layer features of a fresh pass over the committed tokens and the chain."""
    engine, drafter, prompt, proposal = draft_a_chain_of_four(tiny_checkpoints[arch], copy_head)
    assert drafter.feature_layers == (drafter.head.config.feature_layer,)
    sequence = prompt + proposal.token_ids[1:]
    features = early_layer_pass(engine, drafter, sequence)[:-1]  # [T - 1, D]
    with torch.inference_mode():
        mixtures = drafter.head.unrolled_mixtures(
            torch.tensor(sequence), features, depths=4, first_anchor=len(prompt) - 2
        )
    for depth, mixture in enumerate(mixtures, start=1):
        assert mixture.log_gate[0] > -10  # the copy path takes part
        assert int(mixture.top_k(1)[0][0, 0]) == proposal.token_ids[depth]


def test_copy_head_sampled_tokens_have_the_target_distribution(tiny_checkpoints, tmp_path):
    """Keyed first children drawn from the copy mixture (draft_log_probs), then point masses."""
    early_exit = random_self_head(tmp_path / "exit", feature_layer=2, draft_vocab=320, scale=0.0, copy_dim=8)
    assert_speculation_keeps_sampling(
        str(tiny_checkpoints["gemma3"]),
        {
            "method": "self",
            "head": str(early_exit),
            "num_speculative_tokens": 2,
            "top_k": 2,
            "max_draft_tokens": 6,
            "coupling": "keyed",
        },
        prompt=repetitive_prompts()[1][:5],
    )


def test_head_drafts_on_q8_0_copies_beside_a_quantized_target(tiny_checkpoints, tmp_path):
    from quickdraft.kernels.quant_linear import kernel_available

    if not kernel_available():
        pytest.skip("no quantized CPU kernel: heads beside a quantized target stay float")
    path = str(tiny_checkpoints["llama"])
    head = random_self_head(tmp_path / "head", copy_dim=8)
    params = SamplingParams(max_tokens=30, **GREEDY)
    plain = LLM(path, max_model_len=256, quantization="q8_0").generate(repetitive_prompts(), params)
    llm = LLM(
        path,
        max_model_len=256,
        max_num_seqs=4,
        quantization="q8_0",
        speculative_config={"method": "self", "head": str(head), "top_k": 2, "num_speculative_tokens": 3},
    )
    loaded = llm.engine.speculator.drafter.head
    assert len(loaded.draft_weights) == 1 and loaded.draft_lm_rows.shape == tuple(loaded.lm_rows.shape)
    outs = llm.generate(repetitive_prompts(), params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert llm.get_metrics().num_draft_tokens > 20


@pytest.mark.parametrize("copy_dim", [0, 8])
def test_drafting_requests_together_proposes_what_each_alone_would(tiny_checkpoints, tmp_path, copy_dim):
    """Every request's rows go through the early layers and the draft LM head together (one pass
    over its rows for all requests): each request's tree is the one it gets alone (a quantized
    target and a Q8_0 head: batch-invariant kernels, the same bits, so the same picks)."""
    from quickdraft.drafters.base import DraftRequest
    from quickdraft.engine.runner import SequenceWork
    from quickdraft.kernels.quant_linear import kernel_available

    if not kernel_available():
        pytest.skip("no quantized CPU kernel: the head's matmuls are not batch-invariant")
    head = random_self_head(tmp_path / "head", copy_dim=copy_dim)
    llm = LLM(
        str(tiny_checkpoints["llama"]),
        max_model_len=128,
        max_num_seqs=4,
        quantization="q8_0",
        speculative_config={"method": "self", "head": str(head), "top_k": 2, "num_speculative_tokens": 3},
    )
    engine, drafter = llm.engine, llm.engine.speculator.drafter
    requests = []
    for i, prompt in enumerate(repetitive_prompts()[1:4]):
        slot = engine.cache.allocate()
        prefill = engine.runner.forward(
            [SequenceWork(slot=slot, cache_len=0, token_ids=prompt[:-1])], capture_layers=drafter.feature_layers
        )
        engine.cache.commit(slot, len(prompt) - 1)
        request = DraftRequest(
            request_id=f"r{i}", prompt_token_ids=prompt, output_token_ids=[], budget=8, max_depth=3, slot=slot
        )
        drafter.begin(request)
        for layer in drafter.feature_layers:
            drafter.observe(request, prefill.forward.captured[layer])
        requests.append(request)
    together = [(p.token_ids, p.parents) for p in drafter.propose(requests)]
    alone = [(p.token_ids, p.parents) for r in requests for p in drafter.propose([r])]
    assert together == alone
    assert all(len(token_ids) > 3 for token_ids, _ in together)  # real trees, not single guesses


def test_a_heads_manifest_recommends_its_drafting_options(tiny_checkpoints, tmp_path):
    """Options left unset take the head's recommended values (what a shipped head's manifest
    says was measured best for it); options given win; without a recommendation, the defaults."""
    import json

    head = random_self_head(tmp_path / "head")
    path = str(tiny_checkpoints["gemma3"])

    def drafter(**options):
        spec = {"method": "self", "head": str(head), **options}
        return LLM(path, max_model_len=64, speculative_config=spec).engine.speculator.drafter

    plain = drafter()
    assert (plain.top_k, plain.max_draft_tokens, plain.min_log_prob) == (2, 12, float("-inf"))
    (head / "manifest.json").write_text(json.dumps({"drafting": {"top_k": 1, "min_draft_prob": 0.5}}))
    recommended = drafter()
    assert (recommended.top_k, recommended.max_draft_tokens) == (1, 12)
    assert recommended.min_log_prob == pytest.approx(-0.6931, abs=1e-4)
    given = drafter(top_k=3, min_draft_prob=0.0)
    assert (given.top_k, given.min_log_prob) == (3, float("-inf"))
