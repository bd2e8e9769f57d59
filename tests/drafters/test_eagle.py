"""The EAGLE head drafter on tiny random models: exact for any head, chain and trees."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from quickdraft import LLM, SamplingParams
from quickdraft.drafters.eagle import _Draft
from quickdraft.kernels.quant_linear import kernel_available
from quickdraft.models.heads import EagleHead, HeadConfig, _unrolled_attention
from tests.engine.test_speculative import repetitive_prompts
from tests.stats_checks import assert_speculation_keeps_sampling

GREEDY = dict(temperature=0.0, ignore_eos=True)


def random_head(
    directory,
    *,
    feature_layers=(0, 1, 3),
    draft_vocab=200,
    seed=0,
    hidden=64,
    vocab_size=320,
    copy_dim=0,
    copy_gate_bias=None,
):
    """A random head saved to `directory`; copy_dim > 0 gives it a random copy path whose gate's
    bias is `copy_gate_bias` (a large one makes the copy distribution dominate)."""
    torch.manual_seed(seed)
    config = HeadConfig(
        hidden_size=hidden,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=96,
        feature_layers=feature_layers,
        draft_vocab_size=draft_vocab,
        copy_dim=copy_dim,
    )
    head = EagleHead(config)
    with torch.no_grad():
        for param in head.parameters():
            param.normal_(0.0, 0.2)
        if copy_gate_bias is not None:
            head.copy_gate.bias.fill_(copy_gate_bias)
        head.set_draft_vocab(torch.randperm(vocab_size)[:draft_vocab])
    head.save(directory, dtype=torch.float32)
    return directory


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory):
    return random_head(tmp_path_factory.mktemp("head") / "eagle3")


@pytest.fixture(scope="module")
def copy_head_dir(tmp_path_factory):
    """A random head with a copy path that copies most of the time (gate sigmoid(1.5) = 0.82)."""
    return random_head(tmp_path_factory.mktemp("copy_head") / "eagle3", copy_dim=16, copy_gate_bias=1.5)


@pytest.fixture(scope="module")
def plain(tiny_checkpoints):
    outs = {}
    for arch in ("gemma3", "llama"):
        llm = LLM(str(tiny_checkpoints[arch]), max_model_len=256, max_num_seqs=4)
        outs[arch] = [
            o.outputs[0].token_ids for o in llm.generate(repetitive_prompts(), SamplingParams(max_tokens=30, **GREEDY))
        ]
    return outs


@pytest.mark.parametrize("arch", ["gemma3", "llama"])
@pytest.mark.parametrize(
    "shape",
    [
        dict(top_k=1),  # a chain
        dict(top_k=3, max_draft_tokens=10),  # EAGLE-2 dynamic tree
        dict(tree=[[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]),  # static tree
        dict(top_k=2, min_draft_prob=0.004),  # unsure paths cut short (this random head is flat: ~1/200)
        dict(top_k=2, head_dtype="bfloat16"),  # the head computes in bf16, the target in fp32
        dict(top_k=2, catch_up_window=3),  # the head's context restarts at almost every catch-up
    ],
)
def test_greedy_equals_plain(tiny_checkpoints, head_dir, plain, arch, shape):
    llm = LLM(
        str(tiny_checkpoints[arch]),
        max_model_len=256,
        max_num_seqs=4,
        speculative_config={"method": "eagle3", "head": str(head_dir), "num_speculative_tokens": 4, **shape},
    )
    outs = llm.generate(repetitive_prompts(), SamplingParams(max_tokens=30, **GREEDY))
    assert [o.outputs[0].token_ids for o in outs] == plain[arch]
    metrics = llm.get_metrics()
    assert metrics.num_drafts > 20 and metrics.num_draft_tokens > metrics.num_drafts
    drafter = llm.engine.speculator.drafter
    assert drafter.cache.num_free_slots == drafter.cache.num_slots and not drafter._states


def test_features_reach_the_head_in_step_with_the_tokens(tiny_checkpoints, head_dir):
    """The head's true entries cover every cached token of the request, none twice."""
    llm = LLM(
        str(tiny_checkpoints["gemma3"]),
        max_model_len=256,
        max_num_batched_tokens=16,  # chunked prefill
        speculative_config={"method": "eagle3", "head": str(head_dir), "num_speculative_tokens": 3},
    )
    drafter = llm.engine.speculator.drafter
    seen = []
    original = drafter.propose

    def spy(requests):
        proposals = original(requests)
        for request, proposal in zip(requests, proposals):
            state = drafter._states[request.request_id]
            if proposal is not None:
                seen.append((state.num_true, state.num_features, len(request.token_ids)))
        return proposals

    drafter.propose = spy
    llm.generate([repetitive_prompts()[3]], SamplingParams(max_tokens=12, **GREEDY))
    assert seen and all(true == features == tokens - 1 for true, features, tokens in seen)


def test_unrolled_attention_is_masked_attention_over_all_depths():
    torch.manual_seed(0)
    n, heads, kv_heads, dim = 6, 4, 2, 8
    q = torch.randn(n, heads, dim)
    keys = [torch.randn(n, kv_heads, dim) for _ in range(3)]
    values = [torch.randn(n, kv_heads, dim) for _ in range(3)]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    got = _unrolled_attention(q, keys, values, causal=causal, first_anchor=0, scale=dim**-0.5)
    mask = torch.cat([causal, torch.eye(n, dtype=torch.bool), torch.eye(n, dtype=torch.bool)], dim=1)
    expected = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        torch.cat(keys).transpose(0, 1)[None],
        torch.cat(values).transpose(0, 1)[None],
        attn_mask=mask,
        enable_gqa=True,
    )[0].transpose(0, 1)
    torch.testing.assert_close(got, expected)
    # Outputs from a later first anchor only: the same rows.
    later = _unrolled_attention(
        q[2:],
        [keys[0], keys[1][2:], keys[2][2:]],
        [values[0], values[1][2:], values[2][2:]],
        causal=causal[2:],
        first_anchor=2,
        scale=dim**-0.5,
    )
    torch.testing.assert_close(later, expected[2:])


def test_training_forward_matches_drafting(tiny_checkpoints, head_dir):
    """Depth-1 and depth-2 logits of the unrolled training forward equal what the drafter computes
    incrementally (catch-up over true pairs, then one draft entry) for the same tokens."""
    llm = LLM(
        str(tiny_checkpoints["gemma3"]),
        max_model_len=128,
        speculative_config={"method": "eagle3", "head": str(head_dir), "top_k": 1},
    )
    drafter = llm.engine.speculator.drafter
    head = drafter.head
    torch.manual_seed(1)
    tokens = torch.randint(3, 320, (9,))
    features = torch.randn(9, 3 * 64)
    with torch.no_grad():
        unrolled = head.unrolled_logits(tokens, features[:8], depths=2)
        from_anchor_3 = head.unrolled_logits(tokens, features[:8], depths=2, first_anchor=3)
    for full, partial in zip(unrolled, from_anchor_3):
        torch.testing.assert_close(partial, full[3:], rtol=1e-4, atol=1e-4)
    from quickdraft.drafters.tree import DynamicTree

    request, state, root_hidden = _caught_up_on_six_pairs(drafter, tokens, features)
    with torch.inference_mode():
        torch.testing.assert_close(head.draft_logits(root_hidden), unrolled[0][5], rtol=1e-4, atol=1e-4)
        tree = DynamicTree(root_token=int(tokens[6]))
        (child,) = tree.add_children(0, [int(tokens[7])], [0.0])
        draft = _Draft(state=state, tree=tree, hidden={0: root_hidden}, entry={}, request=request, expand=[child])
        drafter._feed_nodes([draft])
        hidden = draft.hidden
        torch.testing.assert_close(head.draft_logits(hidden[child]), unrolled[1][5], rtol=1e-4, atol=1e-4)
    drafter.finish("r")


def observed_with_window(checkpoint, head, *, window: int, seed: int):
    """A drafter with catch-up window `window` that observed 11 random features of a 12-token
    request in chunks of 2 (as plain steps would bring them): (drafter, request, tokens, features,
    pending rows after each chunk)."""
    from quickdraft.drafters.base import DraftRequest

    llm = LLM(
        str(checkpoint),
        max_model_len=128,
        speculative_config={"method": "eagle3", "head": str(head), "top_k": 1, "catch_up_window": window},
    )
    drafter = llm.engine.speculator.drafter
    torch.manual_seed(seed)
    tokens = torch.randint(3, 320, (12,))
    features = torch.randn(11, 3 * 64)
    request = DraftRequest(request_id="r", prompt_token_ids=tokens.tolist(), output_token_ids=[], budget=8)
    drafter.begin(request)
    pending = []
    for chunk in features.split(2):
        drafter.observe(request, chunk)
        pending.append(drafter._states["r"].num_pending)
    return drafter, request, tokens, features, pending


def test_catch_up_window_feeds_only_the_last_tokens(tiny_checkpoints, head_dir):
    """A catch-up over more than the window restarts the head's context there: its root logits are
    the unrolled head's over the window's tokens alone (RoPE is relative, so positions may shift),
    and a request that does not draft holds at most a window of pending features (plus one chunk)."""
    window = 4
    drafter, request, tokens, features, pending = observed_with_window(
        tiny_checkpoints["gemma3"], head_dir, window=window, seed=2
    )
    assert max(pending) < window + 2
    state = drafter._states["r"]
    assert drafter.catch_up_rows(request) == window  # what adaptive speculation prices apart
    with torch.inference_mode():
        root_hidden = drafter._catch_up([(state, request.token_ids)])[0]
        head = drafter.head
        expected = head.unrolled_logits(tokens[11 - window :], features[11 - window :], depths=1)[0][-1]
        torch.testing.assert_close(head.draft_logits(root_hidden), expected, rtol=1e-4, atol=1e-4)
    assert (state.first_true, state.num_true, state.num_pending) == (11 - window, 11, 0)
    assert drafter.catch_up_rows(request) == 0
    drafter.finish("r")


def test_the_engine_hands_the_drafter_tensors_of_their_own_rows(tiny_checkpoints, copy_head_dir):
    """The features a drafter is handed (and keeps: a copy head keeps a plain-decoding request's
    rows for many steps) are no views of the step's features: those would keep every step's
    tensor alive."""
    llm = LLM(
        str(tiny_checkpoints["gemma3"]),
        max_model_len=128,
        speculative_config={"method": "eagle3", "head": str(copy_head_dir), "num_speculative_tokens": 2},
    )
    drafter, seen = llm.engine.speculator.drafter, []
    observe = drafter.observe

    def spy(request, features):
        seen.append(features)
        observe(request, features)

    drafter.observe = spy
    prompts = [{"prompt_token_ids": list(range(5, 25))}, {"prompt_token_ids": list(range(40, 52))}]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12))  # two requests share each step
    assert len(seen) > 4
    for features in seen:
        assert features.untyped_storage().nbytes() == features.numel() * features.element_size()


@pytest.mark.parametrize("head_fixture", ["head_dir", "copy_head_dir"])
def test_sampled_tokens_have_the_target_distribution(tiny_checkpoints, head_fixture, request):
    head = request.getfixturevalue(head_fixture)
    assert_speculation_keeps_sampling(
        str(tiny_checkpoints["gemma3"]),
        {"method": "eagle3", "head": str(head), "num_speculative_tokens": 2, "top_k": 3, "max_draft_tokens": 6},
        prompt=repetitive_prompts()[1][:5],
        require_accepts=False,
    )


def test_bad_heads_are_clear_errors(tiny_checkpoints, head_dir, tmp_path):
    path = str(tiny_checkpoints["gemma3"])
    with pytest.raises(ValueError, match="no eagle3 head is shipped"):
        LLM(path, speculative_config={"method": "eagle3"})
    with pytest.raises(FileNotFoundError, match="not found"):
        LLM(path, speculative_config={"method": "eagle3", "head": str(tmp_path / "missing")})
    with pytest.raises(ValueError, match="min_draft_prob"):
        LLM(path, speculative_config={"method": "eagle3", "head": str(head_dir), "min_draft_prob": 1.5})
    with pytest.raises(ValueError, match="top_k"):
        LLM(path, speculative_config={"method": "eagle3", "head": str(head_dir), "top_k": 0})
    with pytest.raises(ValueError, match="catch_up_window"):
        LLM(path, speculative_config={"method": "eagle3", "head": str(head_dir), "catch_up_window": 0})
    with pytest.raises(ValueError, match="no parent path"):
        LLM(path, speculative_config={"method": "eagle3", "head": str(head_dir), "tree": [[0, 1]]})
    wide = random_head(tmp_path / "wide", hidden=32)
    with pytest.raises(ValueError, match="hidden size"):
        LLM(path, speculative_config={"method": "eagle3", "head": str(wide)})
    deep = random_head(tmp_path / "deep", feature_layers=(0, 7))
    with pytest.raises(ValueError, match="layers"):
        LLM(path, speculative_config={"method": "eagle3", "head": str(deep)})


def test_min_draft_prob_drafts_only_confident_paths(tiny_checkpoints, head_dir):
    llm = LLM(
        str(tiny_checkpoints["gemma3"]),
        max_model_len=256,
        speculative_config={
            "method": "eagle3",
            "head": str(head_dir),
            "top_k": 2,
            "num_speculative_tokens": 4,
            "min_draft_prob": 0.999,
        },
    )
    llm.generate(repetitive_prompts()[:2], SamplingParams(max_tokens=20, **GREEDY))
    assert llm.get_metrics().num_draft_tokens == 0  # a random head is never that sure


# ---- heads with a copy path ------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["gemma3", "llama"])
@pytest.mark.parametrize(
    "shape",
    [
        dict(top_k=1),  # a chain
        dict(top_k=3, max_draft_tokens=10),  # EAGLE-2 dynamic tree
        dict(tree=[[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]),  # static tree
        dict(top_k=2, catch_up_window=3),  # the copy sources restart with the head's context
        dict(top_k=2, head_dtype="bfloat16"),  # copy keys kept in bf16
    ],
)
def test_copy_head_greedy_equals_plain(tiny_checkpoints, copy_head_dir, plain, arch, shape):
    llm = LLM(
        str(tiny_checkpoints[arch]),
        max_model_len=256,
        max_num_seqs=4,
        speculative_config={"method": "eagle3", "head": str(copy_head_dir), "num_speculative_tokens": 4, **shape},
    )
    outs = llm.generate(repetitive_prompts(), SamplingParams(max_tokens=30, **GREEDY))
    assert [o.outputs[0].token_ids for o in outs] == plain[arch]
    metrics = llm.get_metrics()
    assert metrics.num_drafts > 20 and metrics.num_draft_tokens > metrics.num_drafts
    assert llm.engine.speculator.drafter.copy_key_cache is not None


def test_copy_sources_cover_the_whole_context_past_a_catch_up_window(tiny_checkpoints, copy_head_dir):
    """A catch-up window restarts the head's attention, but a copy head still copies from every
    entry: the skipped ones get the same copy keys the training forward computes."""
    window = 4
    drafter, request, tokens, features, pending = observed_with_window(
        tiny_checkpoints["gemma3"], copy_head_dir, window=window, seed=3
    )
    assert pending[-1] == 11  # nothing dropped: the skipped entries need their copy keys
    assert drafter.catch_up_rows(request) == window  # but only the window goes through the head
    state = drafter._states["r"]
    with torch.inference_mode():
        drafter._catch_up([(state, request.token_ids)])[0]
        sources = drafter._copy_sources(state, request.token_ids)
        head = drafter.head
        entry_hidden, _ = head.unrolled_features(tokens, features, depths=1)
        expected_keys = head.copy_keys(entry_hidden)
    assert state.first_true == 11 - window
    torch.testing.assert_close(sources.keys, expected_keys[:10], rtol=1e-4, atol=1e-4)
    assert sources.values.tolist() == tokens[2:].tolist()
    drafter.finish("r")


def _one_row(mixture, row: int, *, repeat: int):
    """Row `row` of a CopyMixture, repeated `repeat` times (to ask its probability of many ids)."""
    import dataclasses

    def pick(t):
        return t[row : row + 1].expand(repeat, *t.shape[1:])

    return dataclasses.replace(
        mixture,
        vocab_log_probs=pick(mixture.vocab_log_probs),
        log_keep=pick(mixture.log_keep),
        log_gate=pick(mixture.log_gate),
        copy_log_weights=pick(mixture.copy_log_weights),
        eligible=pick(mixture.eligible),
    )


def _distribution(mixture, row: int, *, vocab_size: int = 320) -> torch.Tensor:  # [V] probabilities of one row
    log_probs, _ = _one_row(mixture, row, repeat=vocab_size).log_prob(torch.arange(vocab_size))
    return log_probs.exp()


def test_copy_head_drafting_matches_training(tiny_checkpoints, copy_head_dir):
    """The mixture the drafter computes at the root (depth 1) and at a depth-2 node equals the
    unrolled training forward's for the same tokens and features, over every target id; it is a
    distribution; and the drafter's children are its top ids with their log-probabilities."""
    llm = LLM(
        str(tiny_checkpoints["gemma3"]),
        max_model_len=128,
        speculative_config={"method": "eagle3", "head": str(copy_head_dir), "top_k": 3},
    )
    drafter = llm.engine.speculator.drafter
    head = drafter.head
    torch.manual_seed(1)
    tokens = torch.randint(3, 320, (4,)).repeat(3)[:9]  # repeats: the copy distribution has something to say
    features = torch.randn(9, 3 * 64)
    with torch.no_grad():
        unrolled = head.unrolled_mixtures(tokens, features[:8], depths=2)
        from_anchor_3 = head.unrolled_mixtures(tokens, features[:8], depths=2, first_anchor=3)
    for full, partial in zip(unrolled, from_anchor_3):
        torch.testing.assert_close(_distribution(partial, 2), _distribution(full, 5), rtol=1e-4, atol=1e-5)
    from quickdraft.drafters.tree import DynamicTree

    request, state, root_hidden = _caught_up_on_six_pairs(drafter, tokens, features)
    with torch.inference_mode():
        sources = drafter._copy_sources(state, request.token_ids)  # entries 0..4, copying x2..x6
        assert sources.values.tolist() == tokens[2:7].tolist()
        every_source = {"keys": sources.keys, "values": sources.values, "eligible": torch.ones(1, 5, dtype=torch.bool)}
        root = head.mixture(root_hidden[None], **every_source)
        expected = _distribution(unrolled[0], 5)
        torch.testing.assert_close(_distribution(root, 0), expected, rtol=1e-4, atol=1e-5)
        assert float(expected.sum()) == pytest.approx(1.0, abs=1e-5)
        ((ids, log_probs),) = drafter._pick_children(root_hidden[None], [[0, 1, 2]], sources)
        assert ids == expected.topk(3).indices.tolist()
        assert log_probs == pytest.approx(expected.topk(3).values.log().tolist(), abs=1e-4)
        tree = DynamicTree(root_token=int(tokens[6]))
        (child,) = tree.add_children(0, [int(tokens[7])], [0.0])
        draft = _Draft(state=state, tree=tree, hidden={0: root_hidden}, entry={}, request=request, expand=[child])
        drafter._feed_nodes([draft])
        hidden = draft.hidden
        deeper = head.mixture(hidden[child][None], **every_source)
        torch.testing.assert_close(_distribution(deeper, 0), _distribution(unrolled[1], 5), rtol=1e-4, atol=1e-5)
    drafter.finish("r")


def copying_head(directory, *, draft_vocab: torch.Tensor):
    """A head that only copies: its output is its input (no attention or MLP update), its input is
    the normalised embedding of its token (features ignored), copy queries and keys are that
    embedding scaled, so a row attends to the earlier entries with its own token, and the gate is
    ~1.  It proposes what followed the last occurrences of the current token."""
    config = HeadConfig(
        hidden_size=64,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=96,
        feature_layers=(0, 1, 3),
        draft_vocab_size=draft_vocab.shape[0],
        copy_dim=64,
    )
    head = EagleHead(config)
    with torch.no_grad():
        head.o_proj.weight.zero_()
        head.down_proj.weight.zero_()
        head.in_proj.weight.zero_()
        head.in_proj.weight[:, :64] = torch.eye(64)  # the token half only
        head.copy_query.weight.copy_(2.0 * torch.eye(64))
        head.copy_key.weight.copy_(2.0 * torch.eye(64))
        head.copy_gate.bias.fill_(10.0)
        head.set_draft_vocab(draft_vocab)
    head.save(directory, dtype=torch.float32)
    return directory


def test_copy_head_drafts_the_repeated_continuation(tiny_checkpoints, tmp_path):
    """On a repeated passage the copying head drafts what followed the previous occurrence, the
    first token of it outside the draft vocabulary (which the vocabulary could never propose)."""
    torch.manual_seed(3)
    order = torch.randperm(320)
    draft_vocab, outside = order[:200], order[200:]
    passage = [int(outside[0]), *order[:5].tolist()]  # the first token is outside the draft vocabulary
    tokens = [int(order[5])] + passage * 2  # root: the passage's last token, seen once before
    head_dir = copying_head(tmp_path / "copying", draft_vocab=draft_vocab)
    llm = LLM(
        str(tiny_checkpoints["gemma3"]),
        max_model_len=128,
        speculative_config={"method": "eagle3", "head": str(head_dir), "top_k": 1, "num_speculative_tokens": 4},
    )
    drafter = llm.engine.speculator.drafter
    from quickdraft.drafters.base import DraftRequest

    request = DraftRequest(request_id="r", prompt_token_ids=tokens, output_token_ids=[], budget=8)
    drafter.begin(request)
    drafter.observe(request, torch.randn(len(tokens) - 1, 3 * 64))
    proposal = drafter.propose([request])[0]
    assert proposal.token_ids == [passage[-1], *passage[:4]] and proposal.parents == [-1, 0, 1, 2, 3]
    assert proposal.draft_probs is None
    drafter.finish("r")


def _caught_up_on_six_pairs(drafter, tokens, features):
    """A request of tokens[:7] whose first 6 features the drafter observed, caught up: (request,
    its head state, the head's output after pair 5 = (f5, x6))."""
    from quickdraft.drafters.base import DraftRequest

    request = DraftRequest(request_id="r", prompt_token_ids=tokens[:7].tolist(), output_token_ids=[], budget=8)
    drafter.begin(request)
    drafter.observe(request, features[:6])
    state = drafter._states["r"]
    with torch.inference_mode():
        return request, state, drafter._catch_up([(state, request.token_ids)])[0]


@pytest.mark.parametrize(
    "head_dtype,quantized_head", [(None, True), ("float32", False), ("q8_0", True), ("q5_0", True), ("q4_0", True)]
)
def test_head_drafts_on_q8_0_copies_beside_a_quantized_target(tiny_checkpoints, head_dir, head_dtype, quantized_head):
    from quickdraft.kernels.quant_linear import kernel_available

    path = str(tiny_checkpoints["llama"])
    params = SamplingParams(max_tokens=30, **GREEDY)
    expected = [
        o.outputs[0].token_ids
        for o in LLM(path, max_model_len=256, max_num_seqs=4, quantization="q8_0").generate(
            repetitive_prompts(), params
        )
    ]
    spec = {"method": "eagle3", "head": str(head_dir), "num_speculative_tokens": 4, "top_k": 2}
    if head_dtype is not None:
        spec["head_dtype"] = head_dtype
    llm = LLM(path, max_model_len=256, max_num_seqs=4, quantization="q8_0", speculative_config=spec)
    head = llm.engine.speculator.drafter.head
    # By default the head follows its target onto the kernels (when they run on this CPU).
    expect_quantized = quantized_head and (head_dtype is not None or kernel_available())
    assert bool(head.draft_weights) == expect_quantized
    if expect_quantized:
        assert set(head.draft_weights) == {
            "fuse",
            "in_proj",
            "qkv_proj",
            "o_proj",
            "gate_up_proj",
            "down_proj",
            "lm_rows",
        }
        vocab, hidden = head.d2t.numel(), head.config.hidden_size
        assert head.draft_weights["lm_rows"].shape == (vocab, hidden)
        assert head.lm_rows is None  # the float copy is dropped: drafting reads the quantized one
        for name in ("fuse", "in_proj", "qkv_proj", "o_proj", "gate_up_proj", "down_proj"):  # so are the block's
            assert getattr(head, name).weight.numel() == 0, name
        formats = {part.format for weight in head.draft_weights.values() for part in weight.parts}
        assert formats == {(head_dtype or "q4_0").upper()}
    else:
        assert head.lm_rows is not None
    assert [o.outputs[0].token_ids for o in llm.generate(repetitive_prompts(), params)] == expected
    assert llm.get_metrics().num_draft_tokens > 20


def test_q8_0_head_guesses_like_the_float_head(tiny_checkpoints, head_dir):
    from quickdraft.models.heads import EagleHead

    llm = LLM(str(tiny_checkpoints["llama"]), max_model_len=64)
    float_head = EagleHead.load(head_dir, dtype=torch.float32)
    float_head.attach_target(llm.engine.model)
    quantized = EagleHead.load(head_dir, dtype=torch.float32)
    quantized.attach_target(llm.engine.model)
    quantized.quantize_for_drafting()
    from quickdraft.models.layers import default_linear_fn

    quantized.linear = default_linear_fn(torch.device("cpu"))
    hidden = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    exact = float_head.draft_logits(hidden)
    approx = quantized.draft_logits(hidden)
    assert approx.shape == exact.shape
    assert (approx - exact).abs().max() < 0.05 * exact.abs().max()
    assert (approx.argmax(-1) == exact.argmax(-1)).float().mean() >= 0.75
    with pytest.raises(RuntimeError, match="attach_target"):
        EagleHead.load(head_dir, dtype=torch.float32).quantize_for_drafting()


def test_fused_block_is_the_head_block(tiny_checkpoints, head_dir):
    """The one-call block (Q8_0 head on the CPU kernels) computes what the head's torch pieces
    compute with the same Q8_0 matrices, and writes the new rows' KV where they would: only its
    rounding differs (drafting precision moves guesses, never the output)."""
    from quickdraft.kernels.quant_linear import fused_layer_available
    from quickdraft.kv.cache import KVCache

    if not fused_layer_available():
        pytest.skip("no compiled quantized kernel on this CPU")
    llm = LLM(str(tiny_checkpoints["llama"]), max_model_len=64, quantization="q8_0")
    head = EagleHead.load(head_dir, dtype=torch.float32, max_len=128)
    head.attach_target(llm.engine.model)
    head.quantize_for_drafting()
    from quickdraft.models.layers import default_linear_fn

    head.linear = default_linear_fn(torch.device("cpu"))
    c = head.config
    generator = torch.Generator().manual_seed(4)
    hidden = torch.randn(3, c.hidden_size, generator=generator)
    positions = torch.tensor([7, 8, 8])
    caches = [
        KVCache(
            num_layers=1, num_slots=2, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, max_len=16, dtype=torch.float32
        )
        for _ in range(2)
    ]
    earlier = torch.randn(2, c.num_kv_heads, 6, c.head_dim, generator=generator)
    for cache in caches:  # six earlier entries of slot 1 (block 1), the same in both
        for slot in (cache.allocate(), cache.allocate()):
            cache.reserve(slot, cache.max_len)
        assert cache.block_table(1) == [1]
        cache.keys[0][1, :, :6] = earlier[0]
        cache.values[0][1, :, :6] = earlier[1]
    mask = torch.tensor(
        [[1, 1, 0, 1, 1, 1, 0, 0], [1, 1, 0, 1, 1, 1, 1, 0], [1, 1, 0, 1, 1, 1, 0, 1]], dtype=torch.bool
    )  # entries 1..8 of slot 1; rows 6..8 are the new ones (a tree)
    with torch.inference_mode():
        assert head.runs_fused_block(hidden)
        fused = head.fused_block(
            hidden,
            positions,
            cache_keys=caches[0].keys[0],
            cache_values=caches[0].values[0],
            sequences=[(0, 3, 1, 9)],
            block_tables=[caches[0].block_table(1)],
            masks=[mask],
        )
        q, k, v = head.attention_inputs(hidden, positions)
        caches[1].write(0, keys=k, values=v, block_index=torch.tensor([1, 1, 1]), block_offset=torch.tensor([6, 7, 8]))
        keys, values = caches[1].read(0, slot=1, start=1, end=9)
        attended = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], keys[None], values[None], attn_mask=mask, scale=head.attn_scale, enable_gqa=True
        )
        expected = head.block_output(hidden, attended[0].transpose(0, 1).reshape(3, -1))
    torch.testing.assert_close(fused, expected, rtol=2e-2, atol=2e-2)
    assert (fused - expected).abs().max() < 0.02 * expected.abs().max()
    torch.testing.assert_close(caches[0].keys[0], caches[1].keys[0], rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(caches[0].values[0], caches[1].values[0], rtol=1e-2, atol=1e-2)
    assert caches[0].keys[0][1, :, 6:9].abs().sum() > 0 and caches[0].keys[0][0].abs().sum() == 0  # slot 0 untouched


@pytest.mark.parametrize("k", [1, 3])
def test_draft_top_k_is_the_mixture_top_k(copy_head_dir, k):
    """The drafting shortcut (every row copies from the same sources, their distinct ids worked
    out once per step) picks the CopyMixture's top k with its log-probabilities: its torch ops
    and its C++ kernel (kernels/draft_mixture.py) alike."""
    head = EagleHead.load(copy_head_dir, dtype=torch.float32)

    class Target:  # the tensors attach_target borrows
        embed_tokens = torch.randn(320, 64, generator=torch.Generator().manual_seed(0))
        embed_scale = 8.0
        lm_head_weight = torch.randn(320, 64, generator=torch.Generator().manual_seed(1))
        config = type("Config", (), {"final_logit_softcapping": None})

    head.attach_target(Target)
    from quickdraft.models.layers import default_linear_fn

    head.linear = default_linear_fn(torch.device("cpu"))
    generator = torch.Generator().manual_seed(6)
    outside = [t for t in range(320) if t not in set(head.d2t.tolist())]
    values = torch.tensor([head.d2t[3], outside[0], head.d2t[3], head.d2t[9], outside[0], outside[5], head.d2t[1]])
    keys = torch.randn(7, head.config.copy_dim, generator=generator) * 3
    feature = torch.randn(4, 64, generator=generator)
    with torch.inference_mode():
        sources = head.copy_sources(keys, values)
        picks = {
            "torch": head.draft_top_k_reference(feature, sources, k),
            "used": head.draft_top_k(feature, sources, k),
            # the logits computed by the caller (eagle: one pass for every request of a step)
            "given logits": head.draft_top_k(feature, sources, k, logits=head.draft_logits(feature)),
            "torch, given logits": head.draft_top_k_reference(feature, sources, k, logits=head.draft_logits(feature)),
        }
        kernel = head.draft_top_k_kernel(feature, sources, k)
        if kernel is not None:
            picks["kernel"] = kernel
        else:
            assert not kernel_available()  # the kernel builds wherever the quantized kernels do
        mixture = head.mixture(feature, keys=keys, values=values, eligible=torch.ones(4, 7, dtype=torch.bool))
        expected_ids, expected_log_probs = mixture.top_k(k)
    for name, (ids, log_probs) in picks.items():
        assert torch.equal(ids, expected_ids), name
        torch.testing.assert_close(log_probs, expected_log_probs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_fixture", ["head_dir", "copy_head_dir"])
def test_drafting_requests_together_proposes_what_each_alone_would(tiny_checkpoints, head_fixture, request):
    """One head forward per depth for all requests: each request's tree is the one it gets when it
    drafts alone (the Q8_0 head on the batch-invariant kernels: the same bits, so the same picks)."""
    from quickdraft.drafters.base import DraftRequest
    from quickdraft.kernels.quant_linear import kernel_available

    if not kernel_available():
        pytest.skip("no quantized CPU kernel: the head's matmuls are not batch-invariant")
    llm = LLM(
        str(tiny_checkpoints["llama"]),
        max_model_len=128,
        max_num_seqs=4,
        quantization="q8_0",
        speculative_config={
            "method": "eagle3",
            "head": str(request.getfixturevalue(head_fixture)),
            "num_speculative_tokens": 3,
            "top_k": 2,
            "max_draft_tokens": 6,
        },
    )
    drafter = llm.engine.speculator.drafter
    generator = torch.Generator().manual_seed(5)
    lengths = [7, 12, 9]
    tokens = [torch.randint(3, 40, (n,), generator=generator).tolist() for n in lengths]  # repeats for copies
    features = [torch.randn(n - 1, 3 * 64, generator=generator) for n in lengths]

    def drafted(indices):
        requests = [
            DraftRequest(request_id=f"r{i}", prompt_token_ids=tokens[i], output_token_ids=[], budget=6) for i in indices
        ]
        for r, i in zip(requests, indices):
            drafter.begin(r)
            drafter.observe(r, features[i])
        proposals = drafter.propose(requests)
        for r in requests:
            drafter.finish(r.request_id)
        return [(p.token_ids, p.parents) for p in proposals]

    together = drafted([0, 1, 2])
    assert together == [drafted([i])[0] for i in range(3)]
    assert all(len(token_ids) > 2 for token_ids, _ in together)  # real trees, not single guesses


@pytest.mark.parametrize("arch", ["gemma3", "llama"])
@pytest.mark.parametrize("min_draft_prob", [0.0, 0.04, 0.2])
def test_a_lone_chain_grown_in_one_call_is_the_depth_by_depth_chain(
    tiny_checkpoints, copy_head_dir, arch, min_draft_prob, monkeypatch
):
    """A lone request's top-1 chain grown in one C++ call (EagleHead.draft_chain) is the chain
    the depth-by-depth loop grows: the same tokens, cut where the same path floor cuts it, pruned
    to the same budget (Gemma's embedding scale and Llama's none)."""
    from quickdraft.drafters.base import DraftRequest
    from quickdraft.drafters.eagle import EagleDrafter

    if not kernel_available():
        pytest.skip("no quantized CPU kernel: no fused drafting to grow a chain in one call")
    llm = LLM(
        str(tiny_checkpoints[arch]),
        max_model_len=128,
        quantization="q8_0",
        speculative_config={
            "method": "eagle3",
            "head": str(copy_head_dir),
            "num_speculative_tokens": 5,
            "top_k": 1,
            "min_draft_prob": min_draft_prob,
        },
    )
    drafter = llm.engine.speculator.drafter
    generator = torch.Generator().manual_seed(7)
    cases = [(n, budget) for n in (6, 11, 17, 30) for budget in (2, 16)]
    tokens = {n: torch.randint(3, 30, (n,), generator=generator).tolist() for n, _ in cases}  # repeats to copy
    features = {n: torch.randn(n - 1, 3 * 64, generator=generator) for n, _ in cases}

    def drafted() -> list[tuple[list[int], list[int]] | None]:
        proposals = []
        for n, budget in cases:
            r = DraftRequest(request_id=f"r{n}", prompt_token_ids=tokens[n], output_token_ids=[], budget=budget)
            drafter.begin(r)
            drafter.observe(r, features[n])
            proposal = drafter.propose([r])[0]
            drafter.finish(r.request_id)
            proposals.append(None if proposal is None else (proposal.token_ids, proposal.parents))
        return proposals

    one_call = EagleDrafter._grow_chain_in_one_call
    grown_at_once: list[bool] = []

    def counted(self, draft):
        grown_at_once.append(one_call(self, draft))
        return grown_at_once[-1]

    monkeypatch.setattr(EagleDrafter, "_grow_chain_in_one_call", counted)
    at_once = drafted()
    assert grown_at_once and all(grown_at_once)  # every lone chain took the one call
    monkeypatch.setattr(EagleDrafter, "_grow_chain_in_one_call", lambda self, draft: False)
    assert at_once == drafted()
    lengths = [0 if p is None else len(p[0]) - 1 for p in at_once]
    assert all(length <= 2 for length, (_, budget) in zip(lengths, cases) if budget == 2)
    if min_draft_prob:
        assert max(lengths) > 0 and min(lengths) < 5  # chains, some cut short by the floor
    else:
        assert max(lengths) == 5  # the whole depth where nothing cuts it


@pytest.mark.parametrize("top_k", [1, 2])
def test_paths_extend_past_max_depth_only_above_the_requests_floor(tiny_checkpoints, copy_head_dir, top_k):
    """Adaptive speculation's extension: past max_depth (up to extend_depth) a path grows only
    while the head gives it at least min_path_prob; with no floor that is the deeper draft."""
    from quickdraft.drafters.base import DraftRequest

    llm = LLM(
        str(tiny_checkpoints["llama"]),
        max_model_len=128,
        speculative_config={
            "method": "eagle3",
            "head": str(copy_head_dir),
            "num_speculative_tokens": 4,
            "top_k": top_k,
            "max_draft_tokens": 8,
        },
    )
    drafter = llm.engine.speculator.drafter
    generator = torch.Generator().manual_seed(5)
    tokens = torch.randint(3, 40, (12,), generator=generator).tolist()
    features = torch.randn(11, 3 * 64, generator=generator)

    def drafted(**limits):
        request = DraftRequest(request_id="r", prompt_token_ids=tokens, output_token_ids=[], budget=8, **limits)
        drafter.begin(request)
        drafter.observe(request, features)
        (proposal,) = drafter.propose([request])
        drafter.finish("r")
        return proposal

    deep, shallow = drafted(max_depth=4), drafted(max_depth=1)
    assert max(deep.tree.depths) == 4 and max(shallow.tree.depths) == 1
    unfloored = drafted(max_depth=1, extend_depth=4, min_path_prob=0.0)
    assert (unfloored.token_ids, unfloored.parents) == (deep.token_ids, deep.parents)
    sure_only = drafted(max_depth=1, extend_depth=4, min_path_prob=0.999)  # a random head is never that sure
    assert (sure_only.token_ids, sure_only.parents) == (shallow.token_ids, shallow.parents)


@pytest.mark.parametrize("head_fixture", ["head_dir", "copy_head_dir"])
@torch.no_grad()
def test_a_sampled_nodes_first_child_is_the_heads_keyed_draw(tiny_checkpoints, head_fixture, request):
    """The coupled child is exactly sample_keyed over the head's distribution (at the request's
    temperature, spread over target ids) with the noise key of the child's output position; the
    other ranks are the most likely other ids, best first."""
    from quickdraft.verify.sampler import position_key, sample_keyed

    head_path = request.getfixturevalue(head_fixture)
    llm = LLM(
        str(tiny_checkpoints["gemma3"]),
        max_model_len=64,
        speculative_config={"method": "eagle3", "head": str(head_path)},
    )
    drafter = llm.engine.speculator.drafter
    features = torch.randn(5, 64, generator=torch.Generator().manual_seed(8))
    sources = None
    if head_fixture == "copy_head_dir":
        keys = torch.randn(6, drafter.head.config.copy_dim, generator=torch.Generator().manual_seed(9))
        sources = drafter.head.copy_sources(keys, torch.tensor([3, 250, 3, 17, 301, 17]))
    couplings = [(position_key(7, 40 + row), 0.7) if row != 2 else None for row in range(5)]
    picks = drafter._pick_children(features, [[0, 1, 2]] * 5, sources, couplings)
    if sources is None:
        ids, scores = drafter.head.d2t, torch.log_softmax(drafter.head.draft_logits(features).float(), dim=-1)
    else:
        ids, scores = drafter.head.draft_log_probs(features, sources)
        top_ids, _ = drafter.head.draft_top_k(features, sources, 3)  # the mixture, read two ways
        assert top_ids.tolist() == ids[scores.topk(3).indices].tolist()
    for row, (picked_ids, picked_scores) in enumerate(picks):
        order = ids[scores[row].argsort(descending=True)].tolist()
        if couplings[row] is None:
            assert picked_ids == order[:3]
            continue
        probs = torch.zeros(320).index_add_(0, ids, (scores[row] / 0.7).exp())[None]
        drawn = int(sample_keyed(probs, [couplings[row][0]])[0])
        assert picked_ids == [drawn] + [t for t in order if t != drawn][:2]
        assert picked_scores[0] == pytest.approx(float(scores[row][ids == drawn].max()))


def test_keyed_children_raise_sampled_acceptance_and_stay_exact(tiny_checkpoints, copy_head_dir):
    """Seeded sampled requests: the same tokens with either coupling as plainly; the keyed one
    accepts more of its drafts (its first children follow the target's own draws wherever the
    head's distribution is close; the copy head's is, on this repetitive prompt)."""
    path = str(tiny_checkpoints["gemma3"])
    prompts = [{"prompt_token_ids": p} for p in repetitive_prompts()]
    params = [SamplingParams(temperature=0.8, max_tokens=24, seed=s, ignore_eos=True) for s in range(len(prompts))]
    expected = [o.outputs[0].token_ids for o in LLM(path, max_model_len=256, max_num_seqs=4).generate(prompts, params)]
    rates = {}
    for coupling in ("keyed", "top_k"):
        spec = {"method": "eagle3", "head": str(copy_head_dir), "num_speculative_tokens": 3, "coupling": coupling}
        llm = LLM(path, max_model_len=256, max_num_seqs=4, speculative_config=spec)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
        metrics = llm.get_metrics()
        rates[coupling] = metrics.num_accepted_tokens / metrics.num_drafts
    assert rates["keyed"] > rates["top_k"]


def test_a_heads_manifest_recommends_its_tree_and_draft_length(tiny_checkpoints, tmp_path):
    """Options and a draft length left unset take the head's recommended values (a shipped head's
    manifest says what was measured best for it), also as a hybrid's child within the hybrid's
    length; values given win; without a recommendation, the defaults."""
    import json

    head = random_head(tmp_path / "head")
    path = str(tiny_checkpoints["gemma3"])

    def speculator(spec: dict):
        return LLM(path, max_model_len=64, speculative_config=spec).engine.speculator

    plain = speculator({"method": "eagle3", "head": str(head)})
    assert plain.config.num_speculative_tokens == 5 and plain.drafter.depth == 5
    assert (plain.drafter.top_k, plain.drafter.max_draft_tokens, plain.drafter.min_log_prob) == (4, 16, -math.inf)
    recommendation = {"num_speculative_tokens": 7, "top_k": 1, "min_draft_prob": 0.25, "max_draft_tokens": 9}
    (head / "manifest.json").write_text(json.dumps({"drafting": recommendation}))
    recommended = speculator({"method": "eagle3", "head": str(head)})
    assert recommended.config.num_speculative_tokens == 7 and recommended.drafter.depth == 7
    assert (recommended.drafter.top_k, recommended.drafter.max_draft_tokens) == (1, 9)
    assert recommended.drafter.min_log_prob == pytest.approx(math.log(0.25))
    given = speculator({"method": "eagle3", "head": str(head), "num_speculative_tokens": 3, "top_k": 2})
    assert (given.config.num_speculative_tokens, given.drafter.depth, given.drafter.top_k) == (3, 3, 2)
    hybrid = speculator(
        {"method": "hybrid", "drafters": [{"method": "suffix"}, {"method": "eagle3", "head": str(head)}]}
    )
    child = hybrid.drafter.children[1]
    assert (child.depth, child.top_k) == (7, 1)  # within the hybrid's 16
    outs = LLM(path, max_model_len=256, speculative_config={"method": "eagle3", "head": str(head)}).generate(
        repetitive_prompts(), SamplingParams(max_tokens=20, **GREEDY)
    )
    plain_outs = LLM(path, max_model_len=256).generate(repetitive_prompts(), SamplingParams(max_tokens=20, **GREEDY))
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain_outs]
