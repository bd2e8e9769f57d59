"""The EAGLE head drafter on tiny random models: exact for any head, chain and trees."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from quickdraft import LLM, SamplingParams
from quickdraft.models.heads import EagleHead, HeadConfig, _unrolled_attention
from tests.engine.test_speculative import repetitive_prompts
from tests.stats_checks import assert_speculation_keeps_sampling

GREEDY = dict(temperature=0.0, ignore_eos=True)


def random_head(directory, *, feature_layers=(0, 1, 3), draft_vocab=200, seed=0, hidden=64, vocab_size=320):
    torch.manual_seed(seed)
    config = HeadConfig(hidden_size=hidden, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=96,
                        feature_layers=feature_layers, draft_vocab_size=draft_vocab)
    head = EagleHead(config)
    with torch.no_grad():
        for param in head.parameters():
            param.normal_(0.0, 0.2)
        head.set_draft_vocab(torch.randperm(vocab_size)[:draft_vocab])
    head.save(directory, dtype=torch.float32)
    return directory


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory):
    return random_head(tmp_path_factory.mktemp("head") / "eagle3")


@pytest.fixture(scope="module")
def plain(tiny_checkpoints):
    outs = {}
    for arch in ("gemma3", "llama"):
        llm = LLM(str(tiny_checkpoints[arch]), max_model_len=256, max_num_seqs=4)
        outs[arch] = [o.outputs[0].token_ids
                      for o in llm.generate(repetitive_prompts(), SamplingParams(max_tokens=30, **GREEDY))]
    return outs


@pytest.mark.parametrize("arch", ["gemma3", "llama"])
@pytest.mark.parametrize("shape", [
    dict(top_k=1),  # a chain
    dict(top_k=3, max_draft_tokens=10),  # EAGLE-2 dynamic tree
    dict(tree=[[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]),  # static tree
    dict(top_k=2, min_draft_prob=0.004),  # unsure paths cut short (this random head is flat: ~1/200)
    dict(top_k=2, head_dtype="bfloat16"),  # the head computes in bf16, the target in fp32
    dict(top_k=2, catch_up_window=3),  # the head's context restarts at almost every catch-up
])
def test_greedy_equals_plain(tiny_checkpoints, head_dir, plain, arch, shape):
    llm = LLM(str(tiny_checkpoints[arch]), max_model_len=256, max_num_seqs=4,
              speculative_config={"method": "eagle3", "head": str(head_dir), "num_speculative_tokens": 4, **shape})
    outs = llm.generate(repetitive_prompts(), SamplingParams(max_tokens=30, **GREEDY))
    assert [o.outputs[0].token_ids for o in outs] == plain[arch]
    metrics = llm.get_metrics()
    assert metrics.num_drafts > 20 and metrics.num_draft_tokens > metrics.num_drafts
    drafter = llm.engine.speculator.drafter
    assert drafter.cache.num_free_slots == drafter.cache.num_slots and not drafter._states


def test_features_reach_the_head_in_step_with_the_tokens(tiny_checkpoints, head_dir):
    """The head's true entries cover every cached token of the request, none twice."""
    llm = LLM(str(tiny_checkpoints["gemma3"]), max_model_len=256, max_num_batched_tokens=16,  # chunked prefill
              speculative_config={"method": "eagle3", "head": str(head_dir), "num_speculative_tokens": 3})
    drafter = llm.engine.speculator.drafter
    seen = []
    original = drafter._propose_one

    def spy(request):
        proposal = original(request)
        state = drafter._states[request.request_id]
        seen.append((state.num_true, state.num_features, len(request.token_ids)))
        return proposal

    drafter._propose_one = spy
    llm.generate([repetitive_prompts()[3]], SamplingParams(max_tokens=12, **GREEDY))
    assert seen and all(true == features == tokens - 1 for true, features, tokens in seen)


def test_unrolled_attention_is_masked_attention_over_all_depths():
    torch.manual_seed(0)
    n, heads, kv_heads, dim = 6, 4, 2, 8
    q = torch.randn(n, heads, dim)
    keys = [torch.randn(n, kv_heads, dim) for _ in range(3)]
    values = [torch.randn(n, kv_heads, dim) for _ in range(3)]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    got = _unrolled_attention(q, keys, values, causal=causal, first_anchor=0, scale=dim ** -0.5)
    mask = torch.cat([causal, torch.eye(n, dtype=torch.bool), torch.eye(n, dtype=torch.bool)], dim=1)
    expected = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], torch.cat(keys).transpose(0, 1)[None], torch.cat(values).transpose(0, 1)[None],
        attn_mask=mask, enable_gqa=True)[0].transpose(0, 1)
    torch.testing.assert_close(got, expected)
    # Outputs from a later first anchor only: the same rows.
    later = _unrolled_attention(q[2:], [keys[0], keys[1][2:], keys[2][2:]], [values[0], values[1][2:], values[2][2:]],
                                causal=causal[2:], first_anchor=2, scale=dim ** -0.5)
    torch.testing.assert_close(later, expected[2:])


def test_training_forward_matches_drafting(tiny_checkpoints, head_dir):
    """Depth-1 and depth-2 logits of the unrolled training forward equal what the drafter computes
    incrementally (catch-up over true pairs, then one draft entry) for the same tokens."""
    llm = LLM(str(tiny_checkpoints["gemma3"]), max_model_len=128,
              speculative_config={"method": "eagle3", "head": str(head_dir), "top_k": 1})
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
    from quickdraft.drafters.base import DraftRequest
    from quickdraft.drafters.tree import DynamicTree

    request = DraftRequest(request_id="r", prompt_token_ids=tokens[:7].tolist(), output_token_ids=[], budget=8)
    drafter.begin(request)
    drafter.observe(request, features[:6])
    state = drafter._states["r"]
    with torch.inference_mode():
        root_hidden = drafter._catch_up(state, request.token_ids)  # pairs 0..5: row 5 = (f5, x6)
        torch.testing.assert_close(head.draft_logits(root_hidden), unrolled[0][5], rtol=1e-4, atol=1e-4)
        tree = DynamicTree(root_token=int(tokens[6]))
        child, = tree.add_children(0, [int(tokens[7])], [0.0])
        hidden, entry = {0: root_hidden}, {0: None}
        drafter._feed_nodes(state, tree, [child], hidden, entry)
        torch.testing.assert_close(head.draft_logits(hidden[child]), unrolled[1][5], rtol=1e-4, atol=1e-4)
    drafter.finish("r")


def test_catch_up_window_feeds_only_the_last_tokens(tiny_checkpoints, head_dir):
    """A catch-up over more than the window restarts the head's context there: its root logits are
    the unrolled head's over the window's tokens alone (RoPE is relative, so positions may shift),
    and a request that does not draft holds at most a window of pending features (plus one chunk)."""
    window = 4
    llm = LLM(str(tiny_checkpoints["gemma3"]), max_model_len=128,
              speculative_config={"method": "eagle3", "head": str(head_dir), "top_k": 1,
                                  "catch_up_window": window})
    drafter = llm.engine.speculator.drafter
    torch.manual_seed(2)
    tokens = torch.randint(3, 320, (12,))
    features = torch.randn(11, 3 * 64)
    from quickdraft.drafters.base import DraftRequest

    request = DraftRequest(request_id="r", prompt_token_ids=tokens.tolist(), output_token_ids=[], budget=8)
    drafter.begin(request)
    for chunk in features.split(2):  # 2+2+2+2+2+1 features, as plain steps would bring them
        drafter.observe(request, chunk)
        state = drafter._states["r"]
        assert state.num_pending < window + 2
    with torch.inference_mode():
        root_hidden = drafter._catch_up(state, request.token_ids)
        head = drafter.head
        expected = head.unrolled_logits(tokens[11 - window:], features[11 - window:], depths=1)[0][-1]
        torch.testing.assert_close(head.draft_logits(root_hidden), expected, rtol=1e-4, atol=1e-4)
    assert (state.first_true, state.num_true, state.num_pending) == (11 - window, 11, 0)
    drafter.finish("r")


def test_sampled_tokens_have_the_target_distribution(tiny_checkpoints, head_dir):
    assert_speculation_keeps_sampling(
        str(tiny_checkpoints["gemma3"]), {"method": "eagle3", "head": str(head_dir), "num_speculative_tokens": 2,
                                          "top_k": 3, "max_draft_tokens": 6}, prompt=repetitive_prompts()[1][:5],
        require_accepts=False)


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
    llm = LLM(str(tiny_checkpoints["gemma3"]), max_model_len=256,
              speculative_config={"method": "eagle3", "head": str(head_dir), "top_k": 2,
                                  "num_speculative_tokens": 4, "min_draft_prob": 0.999})
    llm.generate(repetitive_prompts()[:2], SamplingParams(max_tokens=20, **GREEDY))
    assert llm.get_metrics().num_draft_tokens == 0  # a random head is never that sure
