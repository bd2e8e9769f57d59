"""The Spec-Bench runner on a tiny model: figures consistent with their definitions."""

from __future__ import annotations

import json

import pytest

from quickdraft import LLM
from quickdraft.bench.specbench import (
    QuestionResult,
    conversation_prompt,
    load_questions,
    run_method,
    summarize,
    task_of,
)


def write_questions(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_load_questions_groups_and_limits(tmp_path):
    rows = [{"question_id": i, "category": c, "turns": ["hi"]} for i, c in
            enumerate(["writing", "coding", "qa", "qa", "qa", "rag"])]
    path = write_questions(tmp_path / "q.jsonl", rows)
    questions = load_questions(path, per_task=2)
    assert [q.question_id for q in questions] == [0, 1, 2, 3, 5]
    assert task_of("coding") == "multi-turn"
    assert [q.question_id for q in load_questions(path, tasks=("rag",))] == [5]


def test_bad_question_file_names_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"question_id": 1, "category": "qa", "turns": ["x"]}\n{"oops": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        load_questions(path)


def test_multi_turn_prompt_feeds_earlier_answers():
    assert conversation_prompt(["a", "b"], ["A"]) == "User: a\nAssistant: A\nUser: b\nAssistant:"


def test_summary_definitions():
    plain = [QuestionResult(1, "qa", seconds=2.0, new_tokens=10, target_forwards=10, token_ids=[[1]]),
             QuestionResult(2, "rag", seconds=4.0, new_tokens=10, target_forwards=10, token_ids=[[2]])]
    spec = [QuestionResult(1, "qa", seconds=1.0, new_tokens=10, target_forwards=4, draft_tokens=12,
                           accepted_tokens=6, token_ids=[[1]]),
            QuestionResult(2, "rag", seconds=4.0, new_tokens=10, target_forwards=10, token_ids=[[3]])]
    table = summarize(plain, spec)
    assert table["qa"]["speedup"] == 2.0 and table["qa"]["mean_accepted_tokens"] == 2.5
    assert table["overall"]["speedup"] == pytest.approx(6.0 / 5.0)
    assert table["overall"]["mean_accepted_tokens"] == pytest.approx(20 / 14)
    assert table["overall"]["exact_match"] == 0.5


def test_run_method_end_to_end(tiny_checkpoints, tmp_path):
    rows = [{"question_id": 1, "category": "writing", "turns": ["abab", "again"]},
            {"question_id": 2, "category": "qa", "turns": ["xyzxyz"]}]
    questions = load_questions(write_questions(tmp_path / "q.jsonl", rows))
    llm = LLM(str(tiny_checkpoints["gemma3"]), max_model_len=256, max_num_seqs=1)
    plain = run_method(llm, questions, max_new_tokens=12)
    llm.engine.set_speculative_config({"method": "ngram", "num_speculative_tokens": 4})
    spec = run_method(llm, questions, max_new_tokens=12)
    assert [len(r.token_ids) for r in plain] == [2, 1]
    assert all(r.new_tokens == 12 * len(r.token_ids) for r in spec)
    table = summarize(plain, spec)
    assert table["overall"]["exact_match"] == 1.0
    assert table["overall"]["mean_accepted_tokens"] >= 1.0
