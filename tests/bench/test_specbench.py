"""Spec-Bench questions and summaries: loading, prompts, and the figures' definitions."""

from __future__ import annotations

import json

import pytest

from quickdraft.bench.specbench import (
    QuestionResult,
    TurnRecord,
    acceptance_by_position,
    conversation_prompt,
    load_questions,
    summarize,
    task_of,
)


def write_questions(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_load_questions_groups_and_limits(tmp_path):
    rows = [
        {"question_id": i, "category": c, "turns": ["hi"]}
        for i, c in enumerate(["writing", "coding", "qa", "qa", "qa", "rag"])
    ]
    path = write_questions(tmp_path / "q.jsonl", rows)
    questions = load_questions(path, per_task=2)
    assert [q.question_id for q in questions] == [0, 1, 2, 3, 5]
    assert task_of("coding") == "multi-turn"
    assert [q.question_id for q in load_questions(path, categories=("rag",))] == [5]
    assert [q.question_id for q in load_questions(path, categories=("multi-turn",))] == [0, 1]
    assert [q.question_id for q in load_questions(path, categories=("coding", "rag"))] == [1, 5]


def test_bad_question_file_names_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"question_id": 1, "category": "qa", "turns": ["x"]}\n{"oops": 1}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        load_questions(path)
    path.write_text('{"question_id": 1, "category": "qa", "turns": []}\n')
    with pytest.raises(ValueError, match="turns"):
        load_questions(path)


def test_unknown_category_and_empty_selection_are_errors(tmp_path):
    path = write_questions(tmp_path / "q.jsonl", [{"question_id": 1, "category": "qa", "turns": ["x"]}])
    with pytest.raises(ValueError, match="unknown categories"):
        load_questions(path, categories=("poetry",))
    with pytest.raises(ValueError, match="no questions"):
        load_questions(path, categories=("rag",))
    with pytest.raises(FileNotFoundError, match=r"missing\.jsonl"):
        load_questions(tmp_path / "missing.jsonl")


def test_multi_turn_prompt_feeds_earlier_answers():
    assert conversation_prompt(["a", "b"], ["A"]) == "User: a\nAssistant: A\nUser: b\nAssistant:"


def turn(seconds, tokens, forwards, *, ttft=0.1, drafted=None, accepted=None, ids=None):
    return TurnRecord(
        seconds=seconds,
        ttft=ttft,
        token_ids=ids or [1] * tokens,
        text="",
        target_forwards=forwards,
        draft_tokens=None if drafted is None else sum(drafted),
        accepted_tokens=None if accepted is None else sum(accepted),
        accepted_per_position=accepted,
        drafted_per_position=drafted,
    )


def test_summary_definitions():
    plain = [
        QuestionResult(1, "qa", [turn(2.0, 10, 10, ids=[1] * 10)]),
        QuestionResult(2, "rag", [turn(4.0, 10, 10, ids=[2] * 10)]),
    ]
    spec = [
        QuestionResult(1, "qa", [turn(1.0, 10, 4, drafted=[4, 4, 4], accepted=[3, 2, 1], ids=[1] * 10)]),
        QuestionResult(2, "rag", [turn(4.0, 10, 10, drafted=[], accepted=[], ids=[3] * 10)]),
    ]
    table = summarize(spec, plain=plain, reference=plain)
    assert list(table) == ["qa", "rag", "overall"]
    assert table["qa"]["speedup"] == 2.0 and table["qa"]["mean_accepted_tokens"] == 2.5
    assert table["overall"]["speedup"] == pytest.approx(6.0 / 5.0)
    # Time per token: a run that wrote half as many tokens in half the time is not faster.
    short = [QuestionResult(1, "qa", [turn(1.0, 5, 5)]), QuestionResult(2, "rag", [turn(2.0, 5, 5)])]
    assert summarize(short, plain=plain)["overall"]["speedup"] == pytest.approx(1.0)
    assert table["overall"]["mean_accepted_tokens"] == pytest.approx(20 / 14)
    assert table["overall"]["exact_match"] == 0.5
    assert table["overall"]["acceptance_rate"] == pytest.approx(6 / 12)
    assert table["overall"]["tpot"] == pytest.approx((0.9 + 3.9) / 18)
    assert table["overall"]["ttft"] == pytest.approx(0.1)
    assert acceptance_by_position(spec) == [3 / 4, 2 / 4, 1 / 4]
    sampled = summarize(spec, plain=plain, reference=plain, greedy=False)
    assert sampled["overall"]["exact_match"] is None


def test_uncounted_figures_stay_unknown():
    peer = [QuestionResult(1, "qa", [TurnRecord(seconds=1.0, ttft=0.1, token_ids=[1, 2], text="")])]
    row = summarize(peer, plain=peer)["overall"]
    assert row["mean_accepted_tokens"] is None and row["acceptance_rate"] is None
    assert acceptance_by_position(peer) is None
