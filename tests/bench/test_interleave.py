"""Interleaved benchmark runs: every question by every run in turn, the first run rotating."""

from __future__ import annotations

from quickdraft.bench.backends import BenchSampling
from quickdraft.bench.runner import BenchOptions, _run_interleaved
from quickdraft.bench.specbench import Question, TurnRecord


class FakeTokenizer:
    def encode(self, text: str) -> list[int]:
        return [len(text)]


class FakeProgress:
    def __init__(self):
        self.done = 0

    def set_description(self, text: str) -> None:
        pass

    def update(self, n: int) -> None:
        self.done += n


class FakeBackend:
    engine = "quickdraft"
    setting = "fake"
    reference = None

    def __init__(self, name: str, log: list, *, fail_on_question: int | None = None):
        self.name, self.log, self.fail_on_question = name, log, fail_on_question

    def open(self) -> None:
        self.log.append(("open", self.name))

    def activate(self) -> None:
        self.log.append(("activate", self.name))

    def begin_question(self) -> None:
        self.log.append(("begin", self.name))

    def generate(self, prompt_ids, *, sampling: BenchSampling, seed: int) -> TurnRecord:
        if sampling.max_new_tokens == 8:  # the warm-up
            return TurnRecord(seconds=0.0, ttft=0.0, token_ids=[1], text="x", target_forwards=1)
        if self.fail_on_question is not None and seed // 1000 == self.fail_on_question:
            raise RuntimeError("drafter broke")
        return TurnRecord(seconds=0.0, ttft=0.0, token_ids=[1, 2], text="ab", target_forwards=2)

    def close(self) -> None:
        self.log.append(("close", self.name))


def options(tmp_path) -> BenchOptions:
    return BenchOptions(questions=tmp_path / "q.jsonl", sampling=BenchSampling(max_new_tokens=4))


def test_each_question_is_answered_by_every_run_with_the_first_rotating(tmp_path):
    log = []
    backends = [FakeBackend(name, log) for name in ("a", "b", "c")]
    questions = [Question(question_id=i, category="qa", turns=["hi"]) for i in range(4)]
    progress = FakeProgress()
    reports = _run_interleaved(
        backends, questions, tokenizer=FakeTokenizer(), options=options(tmp_path), progress=progress, memory_base=0
    )
    order = [name for event, name in log if event == "activate"]
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]
    # every run starts every question afresh (QuickdraftBackend: an empty prefix cache)
    assert [name for event, name in log if event == "begin"] == order
    assert [e for e in log if e[0] == "open"] == [("open", n) for n in "abc"]
    assert [e for e in log if e[0] == "close"] == [("close", n) for n in "abc"]
    for report in reports:
        assert report.error is None and [r.question_id for r in report.results] == [0, 1, 2, 3]
        assert report.peak_memory_bytes is None
    assert progress.done == 12


def test_a_failing_run_is_reported_and_the_others_go_on(tmp_path):
    log = []
    backends = [FakeBackend("a", log), FakeBackend("b", log, fail_on_question=1)]
    questions = [Question(question_id=i, category="qa", turns=["hi"]) for i in range(3)]
    progress = FakeProgress()
    ok, failed = _run_interleaved(
        backends, questions, tokenizer=FakeTokenizer(), options=options(tmp_path), progress=progress, memory_base=0
    )
    assert failed.error == "RuntimeError: drafter broke" and failed.results is None
    assert ok.error is None and len(ok.results) == 3
    assert [name for event, name in log if event == "activate"].count("b") == 2  # not asked after failing
    assert progress.done == 6


def test_a_quickdraft_question_starts_from_an_empty_prefix_cache(tiny_checkpoints):
    """Runs share one engine: without this, a run's first turn would hit the blocks of the same
    prompt that the run before it had just computed."""
    from quickdraft import LLM
    from quickdraft.bench.backends import QuickdraftBackend

    llm = LLM(str(tiny_checkpoints["llama"]), max_model_len=128, block_size=8)
    backend = QuickdraftBackend(llm, name="quickdraft plain", speculative_config=None, reference=None)
    backend.open()
    prompt_ids = list(range(3, 40))
    backend.generate(prompt_ids, sampling=BenchSampling(max_new_tokens=2), seed=0)
    assert llm.engine.cache.find_prefix(prompt_ids).num_tokens == 32
    backend.begin_question()
    assert llm.engine.cache.find_prefix(prompt_ids).num_tokens == 0
