"""Spec-Bench style measurement: per-task speedup and acceptance of speculative methods.

Every method (plain decoding included) runs on the same prompts, one request at a time
(batch 1, as Spec-Bench measures), in one process.  Speedup = plain wall time / method
wall time over a task's questions; mean accepted tokens = committed tokens / target
forwards.  Multi-turn questions feed the model's own earlier answer into the next turn.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
TASKS = ("multi-turn", "translation", "summarization", "qa", "math_reasoning", "rag")


def task_of(category: str) -> str:
    return "multi-turn" if category in MT_BENCH else category


@dataclass
class Question:
    question_id: int
    category: str
    turns: list[str]


def load_questions(path: str | Path, *, per_task: int | None = None,
                   tasks: tuple[str, ...] | None = None) -> list[Question]:
    """Questions in file order; at most `per_task` of each Spec-Bench task."""
    taken: dict[str, int] = defaultdict(int)
    questions = []
    for line_number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            question = Question(question_id=row["question_id"], category=row["category"], turns=list(row["turns"]))
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ValueError(f"{path}:{line_number} is not a Spec-Bench question: {err}") from err
        task = task_of(question.category)
        if tasks is not None and task not in tasks:
            continue
        if per_task is not None and taken[task] >= per_task:
            continue
        taken[task] += 1
        questions.append(question)
    return questions


def conversation_prompt(turns: list[str], answers: list[str]) -> str:
    """A plain transcript (the base model has no chat template)."""
    parts = []
    for i, turn in enumerate(turns):
        parts.append(f"User: {turn}\nAssistant:")
        if i < len(answers):
            parts.append(f" {answers[i]}\n")
    return "".join(parts)


@dataclass
class QuestionResult:
    question_id: int
    category: str
    seconds: float = 0.0
    new_tokens: int = 0
    target_forwards: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    token_ids: list[list[int]] = field(default_factory=list)


def run_method(llm, questions: list[Question], *, max_new_tokens: int, progress=None) -> list[QuestionResult]:
    from quickdraft.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
    results = []
    for question in questions:
        result = QuestionResult(question_id=question.question_id, category=question.category)
        answers: list[str] = []
        for turn_index in range(len(question.turns)):
            prompt = conversation_prompt(question.turns[: turn_index + 1], answers)
            start = time.perf_counter()
            out = llm.generate([prompt], params)[0]
            result.seconds += time.perf_counter() - start
            m = out.metrics
            result.new_tokens += m.num_generation_tokens
            result.target_forwards += m.num_target_forwards
            result.draft_tokens += m.num_draft_tokens
            result.accepted_tokens += m.num_accepted_tokens
            result.token_ids.append(out.outputs[0].token_ids)
            answers.append(out.outputs[0].text.strip())
        results.append(result)
        if progress is not None:
            progress()
    return results


def summarize(plain: list[QuestionResult], method: list[QuestionResult]) -> dict[str, dict]:
    """Per task and overall: speedup, mean accepted tokens, exact-match rate vs plain."""
    groups: dict[str, list[tuple[QuestionResult, QuestionResult]]] = defaultdict(list)
    for base, ours in zip(plain, method):
        groups[task_of(base.category)].append((base, ours))
        groups["overall"].append((base, ours))
    table = {}
    for task in (*TASKS, "overall"):
        pairs = groups.get(task)
        if not pairs:
            continue
        plain_seconds = sum(b.seconds for b, _ in pairs)
        method_seconds = sum(o.seconds for _, o in pairs)
        table[task] = dict(
            speedup=plain_seconds / method_seconds,
            mean_accepted_tokens=sum(o.new_tokens for _, o in pairs) / sum(o.target_forwards for _, o in pairs),
            acceptance_rate=(sum(o.accepted_tokens for _, o in pairs) / max(1, sum(o.draft_tokens for _, o in pairs))),
            exact_match=sum(b.token_ids == o.token_ids for b, o in pairs) / len(pairs),
            questions=len(pairs),
            tokens_per_second=sum(o.new_tokens for _, o in pairs) / method_seconds,
        )
    return table


def format_table(name: str, table: dict[str, dict]) -> str:
    lines = [f"{name}: task  speedup  mean-accepted  accept-rate  exact-match  tok/s  (questions)"]
    for task, row in table.items():
        lines.append(f"  {task:<15}{row['speedup']:6.2f}x {row['mean_accepted_tokens']:9.2f} "
                     f"{row['acceptance_rate']:11.2f} {row['exact_match']:11.0%} {row['tokens_per_second']:8.1f}"
                     f"  ({row['questions']})")
    return "\n".join(lines)


def results_to_json(results: dict[str, list[QuestionResult]]) -> dict:
    return {name: [asdict(r) for r in rows] for name, rows in results.items()}
