"""`quickdraft train-head` on a tiny random target: data, vocabulary, training, resume, loading."""

from __future__ import annotations

import json

import pytest
import torch

from quickdraft import LLM, SamplingParams
from quickdraft.heads import HEADS_ROOT, inherited_drafting
from quickdraft.models.heads import EagleHead
from quickdraft.models.medusa import LayerSkipHead
from quickdraft.train.data import DataShard, Sequence, build_prompts, is_prose
from quickdraft.train.heads import (
    TrainHeadConfig,
    draft_vocabulary,
    new_head,
    target_to_draft,
    train_head,
    validate,
)

TINY_RUN = dict(
    num_prompts=14,
    shard_prompts=7,
    max_new_tokens=24,
    max_seq_len=160,
    draft_vocab_size=64,
    train_depths=2,
    val_depths=3,
    epochs=4,
    sequences_per_step=2,
    val_sequences=4,
    learning_rate=3e-3,
    warmup_steps=2,
    intermediate_size=64,
)


def test_prompts_are_transcripts_without_specbench():
    prompts = build_prompts(40, seed=1)
    assert len(prompts) == 40 and all(p.startswith("User: ") and p.endswith("\nAssistant:") for p in prompts)
    assert build_prompts(40, seed=1) == prompts and build_prompts(40, seed=2) != prompts


def test_draft_vocabulary_by_frequency():
    seqs = [Sequence(token_ids=[9, 9, 5, 5, 5, 7], num_prompt_tokens=2, features=torch.zeros(5, 4))]
    d2t, coverage = draft_vocabulary(seqs, 1, vocab_size=12)  # answer tokens only: 5, 5, 5, 7
    assert d2t.tolist() == [5] and coverage == pytest.approx(0.75)
    d2t, coverage = draft_vocabulary(seqs, 2, vocab_size=12)
    assert d2t.tolist() == [5, 7] and coverage == 1.0
    padded, _ = draft_vocabulary(seqs, 5, vocab_size=12)
    assert len(set(padded.tolist())) == 5
    t2d = target_to_draft(torch.tensor([5, 7]), vocab_size=12)
    assert t2d[5] == 0 and t2d[7] == 1 and t2d[9] == -100


@pytest.fixture(scope="module")
def trained(tiny_checkpoints, tmp_path_factory):
    out = tmp_path_factory.mktemp("train") / "run"
    config = TrainHeadConfig(out=out, target=str(tiny_checkpoints["gemma3"]), **TINY_RUN)
    return out, train_head(config, progress=False)


def test_training_writes_a_loadable_head_with_a_manifest(trained, tiny_checkpoints):
    out, report = trained
    assert sorted(p.name for p in (out / "data").iterdir()) == ["shard-0000.safetensors", "shard-0001.safetensors"]
    manifest = json.loads((out / "head" / "manifest.json").read_text())
    assert manifest["method"] == "eagle3" and manifest["report"]["steps"] == report.steps == 4 * 5
    # drafted by default as the shipped eagle3 head is (a chain, not the drafter's wide tree), and said to be unmeasured
    shipped = json.loads((HEADS_ROOT / "gemma3-270m" / "eagle3" / "manifest.json").read_text())["drafting"]
    assert manifest["drafting"] == shipped and shipped["top_k"] == 1
    assert "not measured for this head" in manifest["drafting_measured"]
    assert report.val_chain_acceptance_length >= 1.0 and len(report.val_accuracy_by_depth) == 3
    assert 0 < report.draft_token_cost < 1
    target = str(tiny_checkpoints["gemma3"])
    prompts = [build_prompts(1, seed=5)[0][:60]]
    plain = LLM(target, max_model_len=160).generate(prompts, SamplingParams(temperature=0, max_tokens=20))
    llm = LLM(
        target,
        max_model_len=160,
        speculative_config={
            "method": "eagle3",
            "head": str(out / "head"),
            "num_speculative_tokens": 3,
            "top_k": 2,
            "min_draft_prob": 0.0,  # the tiny head is unsure of everything
        },
    )
    spec = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20))
    assert spec[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert llm.get_metrics().num_drafts > 0


def test_training_beats_the_untrained_head(trained, tiny_checkpoints):
    """The trained head predicts the target's held-out tokens far better than its initialisation."""
    out, _report = trained
    shards = [DataShard.load(p) for p in sorted((out / "data").iterdir())]
    sequences = [s for shard in shards for s in shard.sequences]
    llm = LLM(str(tiny_checkpoints["gemma3"]), max_model_len=160)
    head = EagleHead.load(out / "head", dtype=torch.float32, max_len=200)
    head.attach_target(llm.engine.model)
    torch.manual_seed(0)
    untrained = new_head(
        llm.engine.model, layers=head.config.feature_layers, draft_vocab_size=64, intermediate_size=64, max_len=200
    )
    untrained.set_draft_vocab(head.d2t)
    untrained.attach_target(llm.engine.model)
    t2d = target_to_draft(head.d2t, vocab_size=320)
    after, _ = validate(head, sequences[:6], t2d, depths=3, max_seq_len=160)
    before, _ = validate(untrained, sequences[:6], t2d, depths=3, max_seq_len=160)
    assert after[0] > before[0] + 0.1  # 20 steps on a few hundred tokens; chance is 1/64


def test_rerun_resumes_from_data_and_checkpoint(trained, tiny_checkpoints):
    out, report = trained
    mtimes = {p.name: p.stat().st_mtime_ns for p in (out / "data").iterdir()}
    config = TrainHeadConfig(out=out, target=str(tiny_checkpoints["gemma3"]), **TINY_RUN)
    again = train_head(config, progress=False)
    assert {p.name: p.stat().st_mtime_ns for p in (out / "data").iterdir()} == mtimes  # no regeneration
    assert again.steps == report.steps and again.seconds["train"] < 5  # nothing left to train


def test_bad_options_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown head method"):
        TrainHeadConfig(out=tmp_path, method="medusa2")
    with pytest.raises(ValueError, match="epochs must be a non-negative integer"):
        TrainHeadConfig(out=tmp_path, epochs=-1)
    with pytest.raises(ValueError, match="num_prompts"):
        TrainHeadConfig(out=tmp_path, num_prompts=0)
    with pytest.raises(ValueError, match="holds no shard"):
        TrainHeadConfig(out=tmp_path, extra_data=(tmp_path,))
    with pytest.raises(ValueError, match="unknown prompt_mix"):
        TrainHeadConfig(out=tmp_path, prompt_mix="wiki")
    with pytest.raises(ValueError, match="builds on earlier answers"):
        TrainHeadConfig(out=tmp_path, prompt_mix="articles")
    with pytest.raises(ValueError, match="cannot be started from a trained one"):
        TrainHeadConfig(out=tmp_path, method="draft", init_head=tmp_path)
    with pytest.raises(ValueError, match="not a head folder"):
        TrainHeadConfig(out=tmp_path, init_head=tmp_path / "missing")


def test_epochs_zero_builds_the_data_only_and_a_later_run_trains_on_it(tiny_checkpoints, tmp_path):
    target = str(tiny_checkpoints["gemma3"])
    data_only = TrainHeadConfig(out=tmp_path / "data-only", target=target, **{**TINY_RUN, "epochs": 0})
    report = train_head(data_only, progress=False)
    shards = sorted((tmp_path / "data-only" / "data").glob("shard-*.safetensors"))
    assert len(shards) == 2 and not (tmp_path / "data-only" / "head").exists()
    built = [s for path in shards for s in DataShard.load(path).sequences]
    assert report.train_sequences == len(built) == TINY_RUN["num_prompts"] and report.steps == 0
    assert report.train_answer_tokens == sum(len(s.token_ids) - s.num_prompt_tokens for s in built) > 0
    later = TrainHeadConfig(
        out=tmp_path / "later",
        target=target,
        **{**TINY_RUN, "num_prompts": 0, "epochs": 1, "extra_data": (tmp_path / "data-only" / "data",)},
    )
    assert train_head(later, progress=False).train_sequences == len(built) - TINY_RUN["val_sequences"]
    assert (tmp_path / "later" / "head").is_dir()
    with pytest.raises(ValueError, match="nothing to do"):
        TrainHeadConfig(out=tmp_path, epochs=0, num_prompts=0, extra_data=(tmp_path / "data-only" / "data",))


def test_prompt_mixes_cover_the_task_shapes():
    prompts = build_prompts(300, seed=3, mix="tasks")
    assert any(p.startswith("User: Summarize: ") for p in prompts)
    assert any(p.startswith("User: Write a ") for p in prompts)
    docs = build_prompts(50, seed=3, mix="docs")
    assert docs != prompts[:50] and all(p.endswith("\nAssistant:") for p in docs)


ANSWERS = [
    "The old lighthouse stood on the rocks above the harbour, and every night its keeper climbed "
    "the stairs to light the lamp. Ships passing in the dark knew the coast by its beam, and the "
    "village below slept soundly knowing that someone was watching over the sea.",
    "Trains leave the central station every hour for the mountains. The journey takes three hours and "
    "passes lakes, forests and small towns, where travellers often stop for lunch before continuing "
    "to the ski resorts near the border.",
]


def test_articles_mix_builds_long_contexts_and_second_turns_on_transcripts():
    transcripts = [f"User: Write a story number {i}.\nAssistant: {ANSWERS[i % 2]}" for i in range(6)]
    prompts = build_prompts(60, seed=4, mix="articles", transcripts=transcripts)
    assert all(p.endswith("\nAssistant:") for p in prompts)
    summaries = [p for p in prompts if p.startswith("User: Summarize: ")]
    second_turns = [p for p in prompts if p.count("\nUser: ") == 1 and p.count("Assistant:") == 2]
    questions = [p for p in prompts if p not in summaries and p not in second_turns]
    assert summaries and second_turns and questions
    assert all(len(p) > 4 * 200 for p in summaries)  # several passages each
    assert all(p.split("\nUser: ")[0] in transcripts for p in second_turns)
    with pytest.raises(ValueError, match="builds on earlier answers"):
        build_prompts(5, seed=4, mix="articles", transcripts=["User: hi\nAssistant: no no no no no no no"])


def test_looping_text_is_not_prose():
    assert is_prose(ANSWERS[0])
    assert not is_prose("I am not sure. " * 40)
    assert not is_prose("0000 1111 2222 " * 30)


def test_fine_tuning_starts_from_the_trained_head(trained, tiny_checkpoints, tmp_path):
    """init_head: the run starts from the given head's weights and keeps its draft vocabulary
    (a vanishing learning rate leaves the bf16 weights as they were)."""
    out, _ = trained
    config = TrainHeadConfig(
        out=tmp_path / "tuned",
        target=str(tiny_checkpoints["gemma3"]),
        init_head=out / "head",
        extra_data=(out / "data",),
        val_data=(out / "data",),
        **{**TINY_RUN, "num_prompts": 0, "epochs": 1, "learning_rate": 1e-12, "draft_vocab_size": 32},
    )
    report = train_head(config, progress=False)
    assert len(report.val_data_accuracy_by_depth) == 3 and report.val_data_chain_acceptance_length >= 1.0
    manifest = json.loads((tmp_path / "tuned" / "head" / "manifest.json").read_text())
    assert manifest["drafting"] == json.loads((out / "head" / "manifest.json").read_text())["drafting"]
    assert manifest["drafting_measured"].startswith(f"inherited from the init head {out / 'head'}")
    before = EagleHead.load(out / "head", dtype=torch.float32).state_dict()
    after = EagleHead.load(tmp_path / "tuned" / "head", dtype=torch.float32).state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_val_data_validates_a_head_on_other_answers_and_alone_writes_nothing(trained, tiny_checkpoints, tmp_path):
    """--val-data: the head is validated on those folders' sequences too (never trained on them);
    with an init head, no prompts and no epochs that is all the run does."""
    out, _ = trained
    target = str(tiny_checkpoints["gemma3"])
    options = {**TINY_RUN, "num_prompts": 0, "epochs": 0}
    config = TrainHeadConfig(
        out=tmp_path / "val", target=target, init_head=out / "head", val_data=(out / "data",), **options
    )
    assert config.validate_only
    report = train_head(config, progress=False)
    assert not (tmp_path / "val" / "head").exists() and report.steps == 0
    llm = LLM(target, max_model_len=160)
    head = EagleHead.load(out / "head", dtype=torch.float32, max_len=TINY_RUN["max_seq_len"] + 5)
    head.attach_target(llm.engine.model)
    sequences = [s for p in sorted((out / "data").iterdir()) for s in DataShard.load(p).sequences]
    expected = validate(head, sequences, target_to_draft(head.d2t, vocab_size=320), depths=3, max_seq_len=160)
    assert (report.val_data_accuracy_by_depth, report.val_data_chain_acceptance_length) == expected
    assert len(expected[0]) == 3 and expected[1] >= 1.0
    with pytest.raises(ValueError, match="to validate an init_head on val_data"):
        TrainHeadConfig(out=tmp_path / "x", target=target, init_head=out / "head", **options)
    with pytest.raises(ValueError, match=r"val_data folder .* holds no shard"):
        TrainHeadConfig(out=tmp_path / "x", target=target, init_head=out / "head", val_data=(tmp_path,), **options)


def test_fine_tuning_with_copy_dim_trains_a_copy_path_and_drafts_exactly(trained, tiny_checkpoints, tmp_path):
    """init_head + copy_dim: the trained head gains a fresh copy path (its other weights and draft
    vocabulary kept), trains with the mixture loss, validates, and drafts exactly."""
    out, _ = trained
    target = str(tiny_checkpoints["gemma3"])
    config = TrainHeadConfig(
        out=tmp_path / "copy",
        target=target,
        init_head=out / "head",
        copy_dim=16,
        extra_data=(out / "data",),
        **{**TINY_RUN, "num_prompts": 0, "epochs": 1},
    )
    report = train_head(config, progress=False)
    assert len(report.val_accuracy_by_depth) == 3 and report.val_chain_acceptance_length >= 1.0
    before = EagleHead.load(out / "head", dtype=torch.float32)
    after = EagleHead.load(tmp_path / "copy" / "head", dtype=torch.float32)
    assert after.config.copy_dim == 16 and torch.equal(after.d2t, before.d2t)
    assert set(after.state_dict()) - set(before.state_dict()) == {
        "copy_query.weight",
        "copy_key.weight",
        "copy_gate.weight",
        "copy_gate.bias",
    }
    manifest = json.loads((tmp_path / "copy" / "head" / "manifest.json").read_text())
    assert manifest["options"]["copy_dim"] == 16
    prompts = [build_prompts(1, seed=5)[0][:60]]
    params = SamplingParams(temperature=0, max_tokens=20)
    plain = LLM(target, max_model_len=160).generate(prompts, params)
    spec = {
        "method": "eagle3",
        "head": str(tmp_path / "copy" / "head"),
        "num_speculative_tokens": 3,
        "top_k": 2,
        "min_draft_prob": 0.0,
    }
    llm = LLM(target, max_model_len=160, speculative_config=spec)
    assert llm.generate(prompts, params)[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert llm.get_metrics().num_drafts > 0


def test_medusa_heads_train_on_earlier_data_and_draft_exactly(trained, tiny_checkpoints, tmp_path):
    """--method medusa with no new prompts, on the eagle run's data (its last-layer columns)."""
    out, _ = trained
    target = str(tiny_checkpoints["gemma3"])
    config = TrainHeadConfig(
        out=tmp_path / "medusa",
        target=target,
        method="medusa",
        medusa_heads=3,
        extra_data=(out / "data",),
        **{**TINY_RUN, "num_prompts": 0},
    )
    report = train_head(config, progress=False)
    assert len(report.val_accuracy_by_depth) == 3 and report.val_chain_acceptance_length >= 1.0
    assert not (tmp_path / "medusa" / "data").exists() or not list((tmp_path / "medusa" / "data").iterdir())
    manifest = json.loads((tmp_path / "medusa" / "head" / "manifest.json").read_text())
    assert manifest["method"] == "medusa"
    prompts = [build_prompts(1, seed=5)[0][:60]]
    params = SamplingParams(temperature=0, max_tokens=20)
    plain = LLM(target, max_model_len=160).generate(prompts, params)
    llm = LLM(
        target, max_model_len=160, speculative_config={"method": "medusa", "head": str(tmp_path / "medusa" / "head")}
    )
    assert llm.generate(prompts, params)[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert llm.get_metrics().num_drafts > 0


def test_a_new_head_inherits_drafting_only_where_its_shape_allows():
    """The shipped Medusa head drafts a static chain of 2: a new head with 4 heads inherits it, one
    with a single head cannot draft that deep and inherits nothing; methods shipped with no head
    (mtp, draft) get nothing."""
    shipped = json.loads((HEADS_ROOT / "gemma3-270m" / "medusa" / "manifest.json").read_text())["drafting"]
    assert max(map(len, shipped["tree"])) == 2
    drafting, source = inherited_drafting("medusa", init_head=None, depths=4)
    assert drafting == shipped and "shipped medusa head" in source
    assert inherited_drafting("medusa", init_head=None, depths=1) == ({}, "")
    assert inherited_drafting("mtp", init_head=None, depths=3) == ({}, "")
    assert inherited_drafting("draft", init_head=None, depths=1) == ({}, "")


def test_validation_counts_acceptance_per_decoding_step():
    """A head right on every token except multiples of 4, a chain of 3: decoding the answer
    (tokens 2..19) takes steps rooted at tokens 2, 4, 8, 12, 16 committing 2, 4, 4, 4, 4 tokens."""
    tokens = list(range(20))
    seq = Sequence(token_ids=tokens, num_prompt_tokens=2, features=torch.zeros(19, 4))
    t2d = torch.arange(20)

    class FakeHead:
        def training_logits(self, token_ids, features, *, depths, first_anchor):
            n = len(token_ids) - 1
            out = []
            for depth in range(1, depths + 1):
                logits = torch.zeros(n - first_anchor, 20)
                for row, anchor in enumerate(range(first_anchor, n)):
                    target = anchor + depth + 1
                    wrong = target % 4 == 0  # tokens 4, 8, 12, 16 are never predicted
                    logits[row, 0 if wrong or target >= 20 else target] = 1.0
                out.append(logits)
            return out

    accuracy, length = validate(FakeHead(), [seq], t2d, depths=3, max_seq_len=64)
    assert accuracy[0] == pytest.approx(13 / 17)  # depth 1 predicts tokens 3..19: 4, 8, 12, 16 missed
    assert length == pytest.approx(18 / 5)


@pytest.mark.parametrize("copy_dim", [0, 16])
def test_self_head_trains_on_a_middle_layer_and_drafts_exactly(trained, tiny_checkpoints, tmp_path, copy_dim):
    """--method self: the head reads the recorded middle layer (exit after 3 of 4 layers); with
    --copy-dim it also learns to copy from the context."""
    out, _ = trained
    target = str(tiny_checkpoints["gemma3"])
    config = TrainHeadConfig(
        out=tmp_path / "self",
        target=target,
        method="self",
        extra_data=(out / "data",),
        copy_dim=copy_dim,
        **{**TINY_RUN, "num_prompts": 0},
    )
    report = train_head(config, progress=False)
    assert len(report.val_accuracy_by_depth) == 3 and report.val_chain_acceptance_length >= 1.0
    assert 0 < report.draft_token_cost < 1
    manifest = json.loads((tmp_path / "self" / "head" / "manifest.json").read_text())
    assert manifest["method"] == "self" and manifest["feature_layers"] == [2]
    trained_head = LayerSkipHead.load(tmp_path / "self" / "head", dtype=torch.float32)
    assert trained_head.copy_dim == copy_dim == manifest["options"]["copy_dim"]
    if copy_dim:  # the gate moved away from its fresh value (training reached the copy path)
        assert float(trained_head.copy_gate.bias.detach()) != -2.0
    prompts = [build_prompts(1, seed=5)[0][:60]]
    params = SamplingParams(temperature=0, max_tokens=20)
    plain = LLM(target, max_model_len=160).generate(prompts, params)
    llm = LLM(
        target,
        max_model_len=160,
        speculative_model="[self]",
        speculative_config={"head": str(tmp_path / "self" / "head"), "min_draft_prob": 0.0},
    )
    assert llm.generate(prompts, params)[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert llm.get_metrics().num_drafts > 0
    with pytest.raises(ValueError, match="exit_layer must be in"):
        train_head(
            TrainHeadConfig(
                out=tmp_path / "bad",
                target=target,
                method="self",
                exit_layer=4,
                extra_data=(out / "data",),
                **{**TINY_RUN, "num_prompts": 0},
            ),
            progress=False,
        )


def test_distilled_draft_model_trains_and_drafts_exactly(trained, tiny_checkpoints, tmp_path):
    """--method draft: 2 layers initialised from target layers 0 and 3, a 64-token vocabulary;
    the draft_model drafter maps tokens in and logits out; greedy and sampled stay exact."""
    from tests.stats_checks import assert_speculation_keeps_sampling

    out, _ = trained
    target = str(tiny_checkpoints["gemma3"])
    config = TrainHeadConfig(
        out=tmp_path / "draft",
        target=target,
        method="draft",
        extra_data=(out / "data",),
        **{**TINY_RUN, "num_prompts": 0},
    )
    report = train_head(config, progress=False)
    model_dir = tmp_path / "draft" / "head"
    hf = json.loads((model_dir / "config.json").read_text())
    assert hf["num_hidden_layers"] == 2 and hf["vocab_size"] == 65 and hf["quickdraft_source_layers"] == [0, 3]
    assert report.val_chain_acceptance_length >= 1.0 and 0 < report.draft_token_cost < 1
    prompts = [build_prompts(1, seed=5)[0][:60]]
    params = SamplingParams(temperature=0, max_tokens=20)
    plain = LLM(target, max_model_len=160).generate(prompts, params)
    llm = LLM(
        target,
        max_model_len=160,
        speculative_config={"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": 3},
    )
    assert llm.generate(prompts, params)[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert llm.get_metrics().num_drafts > 0
    assert_speculation_keeps_sampling(
        target,
        {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": 2},
        prompt=[5, 6, 7, 8, 9],
        # The draft's 64-token vocabulary is the tiny target's most frequent answer tokens, which
        # need not hold the target's top 4 after this prompt: top 16 leaves accepted drafts to test.
        top_k=16,
    )


def test_mtp_head_trains_and_exports_in_the_nextn_layout(trained, tiny_checkpoints, tmp_path):
    from safetensors import safe_open

    out, _ = trained
    target = str(tiny_checkpoints["gemma3"])
    config = TrainHeadConfig(
        out=tmp_path / "mtp", target=target, method="mtp", extra_data=(out / "data",), **{**TINY_RUN, "num_prompts": 0}
    )
    report = train_head(config, progress=False)
    assert report.val_chain_acceptance_length >= 1.0 and 0 < report.draft_token_cost < 1
    head_dir = tmp_path / "mtp" / "head"
    with safe_open(str(head_dir / "mtp.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {
        "model.layers.4.eh_proj.weight",
        "model.layers.4.enorm.weight",
        "model.layers.4.hnorm.weight",
        "model.layers.4.shared_head.norm.weight",
        "model.layers.4.self_attn.q_proj.weight",
        "model.layers.4.mlp.down_proj.weight",
    } <= names
    assert json.loads((head_dir / "config.json").read_text())["num_nextn_predict_layers"] == 1
    prompts = [build_prompts(1, seed=5)[0][:60]]
    params = SamplingParams(temperature=0, max_tokens=20)
    plain = LLM(target, max_model_len=160).generate(prompts, params)
    llm = LLM(
        target,
        max_model_len=160,
        speculative_config={"method": "mtp", "head": str(head_dir), "top_k": 2, "num_speculative_tokens": 3},
    )
    assert llm.generate(prompts, params)[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert llm.get_metrics().num_drafts > 0
    assert llm.engine.speculator.drafter.head.config.draft_vocab_size == 64


def test_matrix_weights_count_a_quantized_target_like_its_float_twin(tiny_checkpoints, tmp_path):
    """draft_token_cost's parts: a target loaded with quantized weights (kept outside the state
    dict) has as many matrix weights as the same target in float32, and a [self] head's draft
    token reads as many of its early layers' weights."""
    from quickdraft.models.quantized import matrix_weights
    from tests.drafters.test_layer_skip import random_self_head

    path = str(tiny_checkpoints["llama"])
    float_target = LLM(path, max_model_len=64).engine.model
    quantized_target = LLM(path, max_model_len=64, quantization="q8_0").engine.model
    assert matrix_weights(float_target) == matrix_weights(quantized_target) > 0
    costs = []
    for target in (float_target, quantized_target):
        head = LayerSkipHead.load(random_self_head(tmp_path / "self", feature_layer=1), dtype=torch.float32)
        head.attach_target(target)
        costs.append(head.weights_per_draft_token())
    early = sum(p.numel() for layer in float_target.layers[:2] for p in layer.parameters() if p.dim() == 2)
    assert costs[0] == costs[1] > early > 0
