"""Spec-Bench style measurement: questions, per-question records, per-task summaries.

Every run (plain decoding included) answers the same prompts, one request at a time (batch
1, as Spec-Bench measures), in one process.  Speedup = reference plain wall time / run wall
time over a task's questions; mean accepted tokens = committed tokens / target forwards.
Multi-turn questions feed the run's own earlier answer into the next turn.
"""

from __future__ import annotations

import json
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


def load_questions(
    path: str | Path, *, per_task: int | None = None, categories: tuple[str, ...] | None = None
) -> list[Question]:
    """Questions in file order; at most `per_task` of each Spec-Bench task.

    `categories` keeps questions whose task ("multi-turn", "qa", ...) or own category
    ("coding", ...) is listed.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"questions file {str(path)!r} not found")
    seen: set[str] = set()
    taken: dict[str, int] = defaultdict(int)
    questions = []
    for line_number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        question = _parse_question(line, where=f"{path}:{line_number}")
        seen.add(question.category)
        task = task_of(question.category)
        if categories is not None and task not in categories and question.category not in categories:
            continue
        if per_task is not None and taken[task] >= per_task:
            continue
        taken[task] += 1
        questions.append(question)
    if categories is not None:
        unknown = sorted(set(categories) - seen - set(TASKS) - set(MT_BENCH))
        if unknown:
            raise ValueError(
                f"unknown categories {unknown}: the file has {sorted(seen)}; the Spec-Bench tasks are {list(TASKS)}"
            )
    if not questions:
        raise ValueError(f"no questions selected from {path}")
    return questions


def _parse_question(line: str, *, where: str) -> Question:
    try:
        row = json.loads(line)
        question = Question(question_id=row["question_id"], category=row["category"], turns=list(row["turns"]))
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise ValueError(f"{where} is not a Spec-Bench question (question_id, category, turns): {err}") from err
    if not question.turns or not all(isinstance(turn, str) for turn in question.turns):
        raise ValueError(f"{where}: 'turns' must be a non-empty list of strings")
    return question


def conversation_prompt(turns: list[str], answers: list[str]) -> str:
    """A plain transcript (the base model has no chat template)."""
    parts = []
    for i, turn in enumerate(turns):
        parts.append(f"User: {turn}\nAssistant:")
        if i < len(answers):
            parts.append(f" {answers[i]}\n")
    return "".join(parts)


@dataclass
class TurnRecord:
    """One generate call of a run: what a backend measured."""

    seconds: float
    ttft: float
    token_ids: list[int]
    text: str
    target_forwards: int | None = None  # None: the backend cannot count its forwards
    draft_tokens: int | None = None
    accepted_tokens: int | None = None
    accepted_per_position: list[int] | None = None  # [k]: drafts whose path accepted depth k+1
    drafted_per_position: list[int] | None = None  # [k]: drafts reaching depth k+1


@dataclass
class QuestionResult:
    question_id: int
    category: str
    turns: list[TurnRecord] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return sum(t.seconds for t in self.turns)

    @property
    def new_tokens(self) -> int:
        return sum(len(t.token_ids) for t in self.turns)

    @property
    def token_ids(self) -> list[list[int]]:
        return [t.token_ids for t in self.turns]

    def total(self, name: str) -> int | None:
        values = [getattr(t, name) for t in self.turns]
        return None if any(v is None for v in values) else sum(values)

    def to_dict(self) -> dict:
        return dict(
            question_id=self.question_id,
            category=self.category,
            task=task_of(self.category),
            seconds=self.seconds,
            new_tokens=self.new_tokens,
            target_forwards=self.total("target_forwards"),
            turns=[asdict(t) for t in self.turns],
        )


def add_counts(into: list[int], counts: list[int]) -> None:
    into.extend([0] * (len(counts) - len(into)))
    for i, count in enumerate(counts):
        into[i] += count


def group_by_task(results: list[QuestionResult]) -> dict[str, list[int]]:
    """Question indices per task present, in TASKS order, then "overall"."""
    groups: dict[str, list[int]] = defaultdict(list)
    for index, result in enumerate(results):
        groups[task_of(result.category)].append(index)
    ordered = {task: groups[task] for task in TASKS if task in groups}
    ordered.update({task: rows for task, rows in groups.items() if task not in ordered})
    ordered["overall"] = list(range(len(results)))
    return ordered


def summarize_rows(
    rows: list[QuestionResult], *, plain: list[QuestionResult], reference: list[QuestionResult] | None, greedy: bool
) -> dict:
    """Figures of one run over some questions, against the plain baseline and its reference.

    `plain` is the engine's own plain decoding (speedup is measured against it);
    `reference` is the run whose outputs this one must equal (exact match).  Speedup is the
    ratio of time per generated token, so runs whose answers differ in length (sampled runs,
    peers with other numerics) compare fairly; when both produced the same tokens (greedy
    speculation) it is exactly plain time / run time.
    """
    seconds = sum(r.seconds for r in rows)
    new_tokens = sum(r.new_tokens for r in rows)
    forwards = [r.total("target_forwards") for r in rows]
    ttfts = [t.ttft for r in rows for t in r.turns]
    later_ttfts = [t.ttft for r in rows for t in r.turns[1:]]  # turns whose conversation is cached
    decode_tokens = sum(max(0, len(t.token_ids) - 1) for r in rows for t in r.turns)
    decode_seconds = sum(t.seconds - t.ttft for r in rows for t in r.turns)
    row = dict(
        questions=len(rows),
        seconds=seconds,
        new_tokens=new_tokens,
        speedup=new_tokens / seconds / _tokens_per_second(plain),
        tokens_per_second=new_tokens / seconds,
        mean_accepted_tokens=(new_tokens / sum(forwards) if None not in forwards and sum(forwards) else None),
        ttft=sum(ttfts) / len(ttfts),
        ttft_first_turns=sum(r.turns[0].ttft for r in rows) / len(rows),
        ttft_later_turns=sum(later_ttfts) / len(later_ttfts) if later_ttfts else None,
        tpot=decode_seconds / decode_tokens if decode_tokens else None,
        exact_match=None,
        acceptance_rate=None,
        speedup_vs_reference=None if reference is None else new_tokens / seconds / _tokens_per_second(reference),
    )
    if reference is not None and greedy:
        row["exact_match"] = sum(r.token_ids == o.token_ids for r, o in zip(reference, rows)) / len(rows)
    drafted = [r.total("draft_tokens") for r in rows]
    accepted = [r.total("accepted_tokens") for r in rows]
    if None not in drafted and None not in accepted and sum(drafted):
        row["acceptance_rate"] = sum(accepted) / sum(drafted)
    return row


def _tokens_per_second(rows: list[QuestionResult]) -> float:
    return sum(r.new_tokens for r in rows) / sum(r.seconds for r in rows)


def acceptance_by_position(results: list[QuestionResult]) -> list[float] | None:
    """Share of drafts reaching depth k+1 whose accepted path reached it too."""
    accepted: list[int] = []
    drafted: list[int] = []
    for result in results:
        for turn in result.turns:
            if turn.accepted_per_position is None or turn.drafted_per_position is None:
                return None
            add_counts(accepted, turn.accepted_per_position)
            add_counts(drafted, turn.drafted_per_position)
    if not drafted:
        return None
    return [a / d if d else 0.0 for a, d in zip(accepted, drafted)]


def summarize(
    results: list[QuestionResult],
    *,
    plain: list[QuestionResult],
    reference: list[QuestionResult] | None = None,
    greedy: bool = True,
) -> dict[str, dict]:
    """Per task (the six Spec-Bench tasks) and overall."""
    table = {}
    for task, indices in group_by_task(results).items():
        table[task] = summarize_rows(
            [results[i] for i in indices],
            plain=[plain[i] for i in indices],
            reference=None if reference is None else [reference[i] for i in indices],
            greedy=greedy,
        )
    return table
