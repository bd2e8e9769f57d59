"""Eagle heads with a copy path: the mixture loss, files, fine-tuning options (tiny random target)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from quickdraft import LLM
from quickdraft.models.heads import EagleHead, HeadConfig
from quickdraft.train.data import Sequence
from quickdraft.train.heads import (
    TrainHeadConfig,
    _sequence_loss,
    load_trained_head,
    new_head,
    target_to_draft,
    validate,
)
from tests.drafters.test_eagle import random_head


@pytest.fixture(scope="module")
def target(tiny_checkpoints):
    return LLM(str(tiny_checkpoints["gemma3"]), max_model_len=160).engine.model


def repetitive_sequences(*, count: int, draft_vocab: torch.Tensor, seed: int) -> list[Sequence]:
    """Passages of 8 tokens (two of them outside the draft vocabulary) said 5 times over, after a
    one-passage prompt, with random features: only copying predicts them."""
    generator = torch.Generator().manual_seed(seed)
    inside = set(draft_vocab.tolist())
    outside = torch.tensor([t for t in range(3, 320) if t not in inside])
    sequences = []
    for _ in range(count):
        passage = torch.cat(
            [
                draft_vocab[torch.randperm(len(draft_vocab), generator=generator)[:6]],
                outside[torch.randperm(len(outside), generator=generator)[:2]],
            ]
        )
        passage = passage[torch.randperm(8, generator=generator)].tolist()
        tokens = passage * 5
        sequences.append(
            Sequence(
                token_ids=tokens,
                num_prompt_tokens=8,
                features=torch.randn(len(tokens) - 1, 3 * 64, generator=generator),
            )
        )
    return sequences


def copy_head(target, *, d2t: torch.Tensor, copy_dim: int = 16) -> EagleHead:
    torch.manual_seed(0)
    head = new_head(
        target, layers=(0, 1, 3), draft_vocab_size=len(d2t), intermediate_size=64, max_len=64, copy_dim=copy_dim
    )
    head.set_draft_vocab(d2t)
    head.attach_target(target)
    return head


def test_a_new_copy_path_starts_mostly_shut(target):
    head = copy_head(target, d2t=torch.arange(100, 164))
    assert head.copy_gate.weight.abs().sum() == 0 and head.copy_gate.bias.item() == -2.0
    assert 0.01 < head.copy_query.weight.std().item() < 0.03 and 0.01 < head.copy_key.weight.std().item() < 0.03


def test_copy_loss_counts_copied_tokens_and_falls_with_training(target):
    """The mixture loss also counts targets outside the draft vocabulary that the context holds
    (the same sequence without a copy path counts fewer), and a few steps on repetitive data
    lower it a lot and teach the head to copy (top-1 accuracy far above the vocabulary's)."""
    d2t = torch.arange(100, 164)
    t2d = target_to_draft(d2t, vocab_size=320)
    train = repetitive_sequences(count=8, draft_vocab=d2t, seed=0)
    held_out = repetitive_sequences(count=4, draft_vocab=d2t, seed=1)
    head = copy_head(target, d2t=d2t)
    plain = copy_head(target, d2t=d2t, copy_dim=0)
    _, copy_count = _sequence_loss(head, train[0], t2d, depths=2, max_seq_len=64)
    _, plain_count = _sequence_loss(plain, train[0], t2d, depths=2, max_seq_len=64)
    assert copy_count > plain_count  # the two passage tokens outside the vocabulary, after their first time

    def mean_loss() -> float:
        with torch.no_grad():
            losses = [_sequence_loss(head, seq, t2d, depths=2, max_seq_len=64) for seq in held_out]
        return sum(float(loss) for loss, _ in losses) / sum(count for _, count in losses)

    before, (accuracy_before, _) = mean_loss(), validate(head, held_out, t2d, depths=2, max_seq_len=64)
    optimizer = torch.optim.AdamW(head.parameters(), lr=3e-3, weight_decay=0.0)
    for step in range(40):
        optimizer.zero_grad()
        loss, count = _sequence_loss(head, train[step % len(train)], t2d, depths=2, max_seq_len=64)
        (loss / count).backward()
        optimizer.step()
    after, (accuracy_after, _) = mean_loss(), validate(head, held_out, t2d, depths=2, max_seq_len=64)
    assert after < 0.6 * before, (before, after)
    assert accuracy_after[0] > accuracy_before[0] + 0.3, (accuracy_before, accuracy_after)


def test_copy_head_files_round_trip(tmp_path):
    random_head(tmp_path / "copy", copy_dim=8, copy_gate_bias=0.5)
    head = EagleHead.load(tmp_path / "copy", dtype=torch.float32)
    assert head.config.copy_dim == 8 and head.copy_gate.bias.item() == 0.5
    head.save(tmp_path / "again", dtype=torch.float32)
    again = EagleHead.load(tmp_path / "again", dtype=torch.float32)
    assert again.config == head.config
    assert all(torch.equal(again.state_dict()[k], v) for k, v in head.state_dict().items())


def test_heads_saved_before_the_copy_path_still_load(tmp_path):
    random_head(tmp_path / "old")
    config_file = tmp_path / "old" / "head_config.json"
    config = json.loads(config_file.read_text())
    del config["copy_dim"]  # a file written before copy_dim existed
    config_file.write_text(json.dumps(config))
    head = EagleHead.load(tmp_path / "old", dtype=torch.float32)
    assert head.config.copy_dim == 0 and not hasattr(head, "copy_gate")


def test_copy_dim_is_validated(tmp_path):
    base = dict(
        hidden_size=64,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=96,
        feature_layers=(0,),
        draft_vocab_size=10,
    )
    for bad in (-1, 2.0, True):
        with pytest.raises(ValueError, match="copy_dim"):
            HeadConfig(**base, copy_dim=bad)
    with pytest.raises(ValueError, match="copy_dim"):
        TrainHeadConfig(out=tmp_path, copy_dim=-3)
    with pytest.raises(ValueError, match="only eagle3 and self heads have a copy path"):
        TrainHeadConfig(out=tmp_path, method="medusa", copy_dim=8)
    with pytest.raises(ValueError, match="only an eagle3 head gains a fresh copy path"):
        TrainHeadConfig(out=tmp_path, method="self", copy_dim=8, init_head=tmp_path)


def test_init_head_gains_a_fresh_copy_path(tmp_path):
    """--init-head with --copy-dim: the trained head's weights and vocabulary, plus a new copy
    path; a head that already has one is not silently replaced."""
    random_head(tmp_path / "trained")
    trained = EagleHead.load(tmp_path / "trained", dtype=torch.float32)
    head = load_trained_head("eagle3", tmp_path / "trained", max_len=100, copy_dim=8)
    assert head.config == dataclasses.replace(trained.config, copy_dim=8)
    state = head.state_dict()
    assert all(torch.equal(state[k], v) for k, v in trained.state_dict().items())
    assert head.copy_gate.weight.abs().sum() == 0 and head.copy_gate.bias.item() == -2.0
    assert head.rotary.cos.shape[0] == 100
    random_head(tmp_path / "copying", copy_dim=4)
    with pytest.raises(ValueError, match="already has a copy path"):
        load_trained_head("eagle3", tmp_path / "copying", max_len=100, copy_dim=8)
    assert load_trained_head("eagle3", tmp_path / "copying", max_len=100).config.copy_dim == 4


def test_mixture_top_k_is_the_brute_force_top_k():
    """CopyMixture.top_k against the whole mixture over the target vocabulary, with repeated copied
    tokens, copied tokens inside and outside the draft vocabulary, and rows that may copy from
    different sources (and one that may copy from none)."""
    from quickdraft.models.heads import CopyMixture

    generator = torch.Generator().manual_seed(5)
    vocab, draft_vocab, m, n, k = 40, 12, 5, 9, 4
    d2t = torch.randperm(vocab, generator=generator)[:draft_vocab]
    t2d = torch.full((vocab,), -1, dtype=torch.long)
    t2d[d2t] = torch.arange(draft_vocab)
    out0, out1 = [v for v in range(vocab) if v not in set(d2t.tolist())][:2]  # outside the draft vocabulary
    values = torch.tensor([d2t[0], out0, d2t[3], out0, d2t[0], out1, out0, d2t[5], -1])  # repeats, both kinds
    eligible = torch.rand(m, n, generator=generator) < 0.7
    eligible[:, -1] = False  # the unknown value is never a source
    eligible[4] = False  # a row with nothing to copy
    gate = torch.randn(m, generator=generator)
    has_source = eligible.any(dim=-1)
    scores = torch.randn(m, n, generator=generator)
    mixture = CopyMixture(
        vocab_log_probs=torch.log_softmax(torch.randn(m, draft_vocab, generator=generator), dim=-1),
        log_keep=torch.nn.functional.logsigmoid(-gate).masked_fill(~has_source, 0.0),
        log_gate=torch.nn.functional.logsigmoid(gate).masked_fill(~has_source, -float("inf")),
        copy_log_weights=torch.log_softmax(scores.masked_fill(~eligible, -1e4), dim=-1),
        copy_values=values,
        eligible=eligible,
        d2t=d2t,
        t2d=t2d,
    )
    full = torch.zeros(m, vocab)  # the mixture over every target id, by its definition
    keep, copy = mixture.log_keep.exp(), mixture.log_gate.exp()
    full[:, d2t] += keep[:, None] * mixture.vocab_log_probs.exp()
    weights = mixture.copy_log_weights.exp() * eligible
    for source in range(n - 1):
        full[:, values[source]] += copy * weights[:, source]
    torch.testing.assert_close(full.sum(dim=-1), torch.ones(m))
    ids, log_probs = mixture.top_k(k)
    expected = full.topk(k, dim=-1)
    torch.testing.assert_close(log_probs.exp(), expected.values, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(full.gather(1, ids), expected.values, rtol=1e-5, atol=1e-6)
    assert all(len(set(row)) == k for row in ids.tolist())  # each token once
    targets = torch.arange(vocab).repeat(m, 1)  # log_prob agrees with the same definition
    for row in range(m):
        rows = {
            name: getattr(mixture, name)[row : row + 1].expand(vocab, *getattr(mixture, name).shape[1:])
            for name in ("vocab_log_probs", "log_keep", "log_gate", "copy_log_weights", "eligible")
        }
        one = dataclasses.replace(mixture, **rows)
        lp, _ = one.log_prob(targets[row])
        torch.testing.assert_close(lp.exp(), full[row], rtol=1e-5, atol=1e-6)
