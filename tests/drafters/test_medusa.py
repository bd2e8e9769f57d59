"""Medusa heads drafting on tiny random models: exact for any heads, default and given trees."""

from __future__ import annotations

import pytest
import torch

from quickdraft import LLM, SamplingParams
from quickdraft.drafters.base import DraftRequest
from quickdraft.models.medusa import MedusaConfig, MedusaHeads
from tests.engine.test_speculative import repetitive_prompts
from tests.stats_checks import assert_speculation_keeps_sampling

GREEDY = dict(temperature=0.0, ignore_eos=True)


def random_heads(
    directory,
    *,
    num_heads=3,
    hidden=64,
    feature_layer=3,
    draft_vocab=200,
    seed=0,
    vocab_size=320,
    scale=0.3,
    kind=MedusaHeads,
    copy_dim=0,
):
    """Random heads of `kind` (MedusaHeads, or LayerSkipHead with one head, which may have a copy
    path: random queries and keys, its gate mostly open) saved to `directory`."""
    torch.manual_seed(seed)
    config = MedusaConfig(
        hidden_size=hidden,
        num_heads=num_heads,
        draft_vocab_size=draft_vocab,
        feature_layer=feature_layer,
        copy_dim=copy_dim,
    )
    heads = kind(config)
    with torch.no_grad():
        heads.weight.normal_(0.0, scale)
        heads.bias.normal_(0.0, scale)
        heads.set_draft_vocab(torch.randperm(vocab_size)[:draft_vocab])
        if copy_dim:
            heads.copy_query.weight.normal_(0.0, 1.0)
            heads.copy_key.weight.normal_(0.0, 1.0)
            heads.copy_gate.bias.fill_(1.0)
    heads.save(directory, dtype=torch.float32)
    return directory


@pytest.fixture(scope="module")
def heads_dir(tmp_path_factory):
    return random_heads(tmp_path_factory.mktemp("medusa") / "heads")


@pytest.mark.parametrize("arch", ["gemma3", "llama"])
@pytest.mark.parametrize(
    "shape",
    [
        dict(),
        dict(tree=[[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]),
        dict(num_speculative_tokens=1, top_k=4),
        dict(head_dtype="bfloat16"),
    ],
)
def test_greedy_equals_plain(tiny_checkpoints, heads_dir, arch, shape):
    path = str(tiny_checkpoints[arch])
    params = SamplingParams(max_tokens=30, **GREEDY)
    plain = LLM(path, max_model_len=256, max_num_seqs=4).generate(repetitive_prompts(), params)
    llm = LLM(
        path,
        max_model_len=256,
        max_num_seqs=4,
        speculative_config={"method": "medusa", "head": str(heads_dir), **shape},
    )
    outs = llm.generate(repetitive_prompts(), params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    metrics = llm.get_metrics()
    assert metrics.num_drafts > 20 and metrics.num_draft_tokens > metrics.num_drafts
    assert not llm.engine.speculator.drafter._states


def test_tree_is_filled_by_depth_and_rank(tiny_checkpoints, heads_dir):
    """Node (depth k, rank r) holds head k's r-th best token, under whichever parent."""
    llm = LLM(
        str(tiny_checkpoints["gemma3"]),
        max_model_len=64,
        speculative_config={"method": "medusa", "head": str(heads_dir), "tree": [[0], [1], [0, 0], [1, 0], [0, 1]]},
    )
    drafter = llm.engine.speculator.drafter
    request = DraftRequest(request_id="r", prompt_token_ids=[5, 6, 7, 8], output_token_ids=[], budget=10)
    drafter.begin(request)
    feature = torch.randn(3, 64)
    drafter.observe(request, feature)
    (proposal,) = drafter.propose([request])
    with torch.no_grad():
        logits = drafter.heads(feature[-1:])[:, 0]  # [K, Vd]
    best = [drafter.heads.d2t[logits[k].topk(2).indices].tolist() for k in range(2)]
    # paths sorted by (depth, ranks): (0,), (1,), (0, 0), (0, 1), (1, 0)
    assert proposal.parents == [-1, 0, 0, 1, 1, 2]
    assert proposal.token_ids == [8, best[0][0], best[0][1], best[1][0], best[1][1], best[1][0]]
    small = DraftRequest(request_id="r", prompt_token_ids=[5, 6, 7, 8], output_token_ids=[], budget=2)
    assert drafter.propose([small])[0].token_ids == [8, best[0][0], best[0][1]]
    drafter.finish("r")


def test_sampled_tokens_have_the_target_distribution(tiny_checkpoints, heads_dir):
    assert_speculation_keeps_sampling(
        str(tiny_checkpoints["gemma3"]),
        {"method": "medusa", "head": str(heads_dir), "top_k": 3},
        prompt=repetitive_prompts()[1][:5],
        require_accepts=False,
    )


def test_bad_heads_are_clear_errors(tiny_checkpoints, heads_dir, tmp_path):
    path = str(tiny_checkpoints["gemma3"])
    with pytest.raises(ValueError, match="no medusa head is shipped"):
        LLM(path, speculative_config={"method": "medusa"})
    with pytest.raises(FileNotFoundError, match="not found"):
        LLM(path, speculative_config={"method": "medusa", "head": str(tmp_path / "missing")})
    with pytest.raises(ValueError, match="heads draft 3 depths"):
        LLM(
            path,
            speculative_config={
                "method": "medusa",
                "head": str(heads_dir),
                "tree": [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]],
            },
        )
    with pytest.raises(ValueError, match="tree must be"):
        LLM(path, speculative_config={"method": "medusa", "head": str(heads_dir), "tree": "wide"})
    with pytest.raises(ValueError, match="hidden size"):
        LLM(path, speculative_config={"method": "medusa", "head": str(random_heads(tmp_path / "w", hidden=32))})
    with pytest.raises(ValueError, match="last layer"):
        LLM(path, speculative_config={"method": "medusa", "head": str(random_heads(tmp_path / "l", feature_layer=1))})
    with pytest.raises(ValueError, match="medusa heads have no copy path"):
        MedusaHeads(MedusaConfig(hidden_size=64, num_heads=2, draft_vocab_size=8, feature_layer=3, copy_dim=8))
    with pytest.raises(ValueError, match="copy_dim must be a non-negative integer"):
        MedusaConfig(hidden_size=64, num_heads=1, draft_vocab_size=8, feature_layer=3, copy_dim=-1)
