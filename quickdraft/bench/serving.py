"""`quickdraft bench serve`: the real server under concurrent streaming clients, per speculative mode.

The flow: load the engine once; for each mode (off = plain decoding, always-on = the given
speculative config, adaptive = that config plus "adaptive": true; on request, ceiling = plain
decoding whose every request brings off's answer to it as its OpenAI `prediction`) switch the
engine's speculation, start the real server (uvicorn, in this process, on a free loopback port), send
one uncounted warm-up request, then for each concurrency C run C clients that each stream
`requests_per_client` greedy completions one after another.  The clients run in a process of
their own (as a real server's do), or with `clients="thread"` in this one.  Prompts are the first turns of
Spec-Bench questions, interleaved across tasks (so every level sees a mix, not only the file's
first task) and cycled; request n of a level asks question n, so every mode answers the same
prompts and its greedy tokens can be compared with plain decoding's, request by request.

ceiling is what a drafter that is always right would reach on this machine: each request's
chains of up to 16 tokens are off's own tokens (drafters/prediction.py), verified as any draft
(its tokens still equal off's), so it bounds any drafter whose drafts are chains of that length
at the engine's real step costs: where its ratio is low, no drafter can do much better.

Measured from the client side: output tokens per second over the level's wall time, TTFT
(request sent to first token) and TPOT (first to last token / tokens after the first), as
median and p90.  The acceptance figures are the server's own (the `speculation` field of each
response).  After `time_limit_seconds` a level sends no new request (every client still sends
its first, so each level measures something) and the report says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import math
import os
import platform
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from quickdraft.bench.specbench import TASKS, Question, add_counts, conversation_prompt, load_questions, task_of

MODES = ("off", "always-on", "adaptive", "ceiling")
DEFAULT_MODES = ("off", "always-on", "adaptive")
# Needs off's answers of its level: runs right after off whatever the rotation (_mode_order).
CEILING_MODE = "ceiling"
CLIENT_PLACES = ("process", "thread")
BASELINE_MODE = "off"
DEFAULT_CONCURRENCY = (1, 4, 16, 32)
DEFAULT_QUESTIONS = Path("../shared/data/specbench/questions.dev.jsonl")
SUMMARY_FILE = "summary.md"
JSON_FILE = "results.json"
SERVED_MODEL_NAME = "bench"
WARMUP_PROMPT = "User: Say hello.\nAssistant:"
WARMUP_MAX_TOKENS = 8
SERVER_START_TIMEOUT_SECONDS = 60.0


# ---- options ------------------------------------------------------------------------------
@dataclass(kw_only=True)
class ServingBenchOptions:
    speculative_config: dict  # the always-on config; adaptive adds "adaptive": true to it
    questions: Path = DEFAULT_QUESTIONS
    model: str | None = None  # None: the embedded Gemma 3 270M
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    device: str = "cpu"
    max_model_len: int | None = None
    concurrency: tuple[int, ...] = DEFAULT_CONCURRENCY
    requests_per_client: int = 2
    max_tokens: int = 128
    time_limit_seconds: float = 300.0  # per level: no client starts another request after it
    max_num_seqs: int | None = None  # None: the largest concurrency, so no level queues for a slot
    request_timeout_seconds: float = 600.0
    modes: tuple[str, ...] = DEFAULT_MODES  # which to run; off (the baseline) always runs
    # None: the single server in this process; N: N replicas on Ray Serve (a local instance),
    # deployed afresh for each mode, each with cores / N CPUs (quickdraft/server/replicas.py).
    replicas: int | None = None
    routing: str = "cache_aware"
    # Rounds of the whole sweep.  Each round asks new prompts and runs every level once per mode,
    # the modes of a level back to back (their order rotating from round to round), so a ratio
    # to "off" compares runs minutes apart at most, whatever this machine's speed drifts to.
    rounds: int = 1
    # LoRA adapters the requests run ("name=path", as `quickdraft serve --lora-modules`): request n
    # names adapter n % len(lora_modules); empty: every request runs the base model.
    lora_modules: tuple[str, ...] = ()
    max_loras: int = 1
    # Where the clients run: "process", one process of their own beside the server's, as a real
    # server's clients (and vLLM's `bench serve`) are; "thread", this process's main thread, where
    # their HTTP and JSON work takes the interpreter lock the server's engine thread also needs.
    clients: str = "process"

    def __post_init__(self) -> None:
        self.questions = Path(self.questions)
        self.lora_modules = tuple(self.lora_modules)
        self.concurrency = tuple(self.concurrency)
        self.modes = tuple(self.modes)
        unknown = [m for m in self.modes if m not in MODES]
        if unknown or len(set(self.modes)) != len(self.modes):
            raise ValueError(f"modes must be distinct names from {list(MODES)}, got {list(self.modes)}")
        if BASELINE_MODE not in self.modes:
            raise ValueError(f"modes must include {BASELINE_MODE!r}: every figure is a ratio to it")
        _check_speculative_config(self.speculative_config)
        if not self.concurrency:
            raise ValueError("concurrency needs at least one level")
        for level in self.concurrency:
            _check_positive_int("concurrency", level)
        if len(set(self.concurrency)) != len(self.concurrency):
            raise ValueError(f"concurrency levels must be distinct, got {list(self.concurrency)}")
        for name in ("requests_per_client", "max_tokens", "rounds", "max_loras"):
            _check_positive_int(name, getattr(self, name))
        if self.replicas is not None:
            _check_positive_int("replicas", self.replicas)
            if self.lora_modules:
                raise ValueError("LoRA adapters with replicas are not built (quickdraft serve refuses them too)")
        if self.max_num_seqs is not None:
            _check_positive_int("max_num_seqs", self.max_num_seqs)
        if self.clients not in CLIENT_PLACES:
            raise ValueError(f"clients must be one of {list(CLIENT_PLACES)}, got {self.clients!r}")
        for name in ("time_limit_seconds", "request_timeout_seconds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a number > 0, got {value!r}")

    def request_model(self, index: int) -> str:
        """The "model" request `index` names: the served model, or its LoRA adapter."""
        if not self.lora_modules:
            return SERVED_MODEL_NAME
        from quickdraft.server.config import lora_module_fields

        return lora_module_fields(self.lora_modules[index % len(self.lora_modules)])[0]

    @property
    def num_slots(self) -> int:
        return self.max_num_seqs if self.max_num_seqs is not None else max(self.concurrency)

    def mode_configs(self) -> dict[str, dict | None]:
        """The speculative config of each chosen mode, in the order they run."""
        configs = {
            "off": None,
            "always-on": dict(self.speculative_config),
            "adaptive": {**self.speculative_config, "adaptive": True},
            CEILING_MODE: None,  # plain decoding; the requests bring their predictions
        }
        return {mode: config for mode, config in configs.items() if mode in self.modes}


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def _check_speculative_config(config: object) -> None:
    from quickdraft.config import SpeculativeConfig

    if not isinstance(config, dict):
        raise ValueError(f"speculative_config must be a JSON object, got {config!r}")
    if "adaptive" in config:
        raise ValueError(
            "speculative_config: give the always-on config without 'adaptive'; the benchmark runs "
            'it both as given and with "adaptive": true'
        )
    # Both modes' configs must be valid before any model is loaded (e.g. adaptive excludes
    # dynamic_draft_length); SpeculativeConfig's errors name the field.
    SpeculativeConfig.from_dict(dict(config))
    SpeculativeConfig.from_dict({**config, "adaptive": True})


# ---- prompts ------------------------------------------------------------------------------
@dataclass
class BenchPrompt:
    question_id: int
    category: str
    text: str

    @property
    def task(self) -> str:
        return task_of(self.category)


def interleave_by_task(questions: list[Question]) -> list[Question]:
    """Round robin over the Spec-Bench tasks (file order within a task)."""
    by_task: dict[str, list[Question]] = defaultdict(list)
    for question in questions:
        by_task[task_of(question.category)].append(question)
    order = [task for task in TASKS if task in by_task] + [task for task in by_task if task not in TASKS]
    interleaved = []
    for position in range(max(len(rows) for rows in by_task.values())):
        interleaved += [by_task[task][position] for task in order if position < len(by_task[task])]
    return interleaved


def select_prompts(
    questions: list[Question], *, count_tokens, max_model_len: int, max_tokens: int
) -> tuple[list[BenchPrompt], list[int]]:
    """First-turn prompts whose prompt + max_tokens fit the context, and the ids left out."""
    prompts, skipped = [], []
    for question in interleave_by_task(questions):
        text = conversation_prompt(question.turns[:1], [])
        if count_tokens(text) + max_tokens > max_model_len:
            skipped.append(question.question_id)
            continue
        prompts.append(BenchPrompt(question_id=question.question_id, category=question.category, text=text))
    if not prompts:
        raise ValueError(
            f"no question's first turn fits max_model_len {max_model_len} with {max_tokens} new "
            "tokens; raise --max-model-len or lower --max-tokens"
        )
    return prompts, skipped


# ---- one request, from the client's side ----------------------------------------------------
@dataclass
class RequestRecord:
    index: int  # request number within its level; it asked prompt index % len(prompts)
    question_id: int
    task: str
    seconds: float = 0.0
    ttft: float | None = None
    tpot: float | None = None
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    speculation: dict | None = None  # the server's figures for this request
    text: str = ""  # the streamed text (off's is the ceiling mode's prediction)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.finish_reason is not None


async def stream_completion(
    client,
    *,
    prompt: BenchPrompt,
    index: int,
    max_tokens: int,
    model: str = SERVED_MODEL_NAME,
    prediction: str | None = None,
) -> RequestRecord:
    """One greedy streamed completion; errors are recorded, not raised (the level goes on).
    prediction: the text sent as the request's OpenAI `prediction` (None: none)."""
    import httpx

    record = RequestRecord(index=index, question_id=prompt.question_id, task=prompt.task)
    body = {
        "model": model,
        "prompt": prompt.text,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
        "metadata": {"scenario": prompt.task},
    }
    if prediction:
        body["prediction"] = {"type": "content", "content": prediction}
    started = time.perf_counter()
    first_token_at = last_token_at = None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread()).decode(errors='replace')[:300]}"
                return record
            async for chunk in sse_chunks(response):
                if "error" in chunk:
                    record.error = f"stream error: {chunk['error'].get('message')}"
                    break
                for choice in chunk.get("choices", []):
                    new_tokens = choice.get("token_ids") or []
                    if new_tokens:
                        last_token_at = time.perf_counter()
                        first_token_at = first_token_at or last_token_at
                        record.token_ids += new_tokens
                    record.text += choice.get("text") or ""
                    record.finish_reason = choice.get("finish_reason") or record.finish_reason
                record.speculation = chunk.get("speculation") or record.speculation
    except httpx.HTTPError as err:
        record.error = f"{type(err).__name__}: {err}"
    if record.error is None and record.finish_reason is None:
        record.error = "the stream ended without a finish_reason"
    record.seconds = time.perf_counter() - started
    if first_token_at is not None:
        record.ttft = first_token_at - started
        if len(record.token_ids) >= 2:
            record.tpot = (last_token_at - first_token_at) / (len(record.token_ids) - 1)
    return record


async def sse_chunks(response):
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        payload = line[len("data: ") :]
        if payload == "[DONE]":
            return
        yield json.loads(payload)


# ---- one concurrency level ----------------------------------------------------------------
@dataclass
class LevelResult:
    mode: str
    concurrency: int
    planned: int  # requests the level would send without a time limit
    wall_seconds: float
    stopped_by_time_limit: bool
    requests: list[RequestRecord]
    summary: dict = field(default_factory=dict)
    round: int = 0


async def run_level(
    *,
    base_url: str,
    prompts: list[BenchPrompt],
    mode: str,
    concurrency: int,
    options: ServingBenchOptions,
    round_index: int = 0,
    predictions: dict[int, str] | None = None,
) -> LevelResult:
    """C clients, each sending requests_per_client requests back to back; request n = prompt n
    (round r's requests are numbered after the earlier rounds' ones: new prompts).
    predictions: request index -> the text request n sends as its `prediction` (ceiling)."""
    import httpx

    first_index = round_index * concurrency * options.requests_per_client
    started = time.perf_counter()
    deadline = started + options.time_limit_seconds
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async with httpx.AsyncClient(base_url=base_url, timeout=options.request_timeout_seconds, limits=limits) as client:

        async def one_client(client_index: int) -> list[RequestRecord]:
            records = []
            for turn in range(options.requests_per_client):
                if turn > 0 and time.perf_counter() >= deadline:
                    break  # the time limit: no new request, the ones in flight finish
                index = first_index + turn * concurrency + client_index
                records.append(
                    await stream_completion(
                        client,
                        prompt=prompts[index % len(prompts)],
                        index=index,
                        max_tokens=options.max_tokens,
                        model=options.request_model(index),
                        prediction=(predictions or {}).get(index),
                    )
                )
            return records

        per_client = await asyncio.gather(*(one_client(i) for i in range(concurrency)))
    records = sorted((r for rows in per_client for r in rows), key=lambda r: r.index)
    planned = concurrency * options.requests_per_client
    return LevelResult(
        mode=mode,
        concurrency=concurrency,
        planned=planned,
        wall_seconds=time.perf_counter() - started,
        stopped_by_time_limit=len(records) < planned,
        requests=records,
        round=round_index,
    )


def percentile(values: list[float], fraction: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    position = fraction * (len(ordered) - 1)
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize_level(level: LevelResult, *, baseline: LevelResult | None) -> dict:
    done = [r for r in level.requests if r.ok]
    tokens = sum(len(r.token_ids) for r in done)
    ttfts = [r.ttft for r in done if r.ttft is not None]
    tpots = [r.tpot for r in done if r.tpot is not None]
    summary = dict(
        requests_sent=len(level.requests),
        requests_ok=len(done),
        errors=len(level.requests) - len(done),
        output_tokens=tokens,
        tokens_per_second=tokens / level.wall_seconds if level.wall_seconds > 0 else None,
        ttft_p50=percentile(ttfts, 0.5),
        ttft_p90=percentile(ttfts, 0.9),
        tpot_p50=percentile(tpots, 0.5),
        tpot_p90=percentile(tpots, 0.9),
    )
    summary.update(speculation_totals(done))
    summary.update(compare_outputs(level, baseline=baseline))
    if baseline is not None and summary["tokens_per_second"] and baseline.summary.get("tokens_per_second"):
        summary["throughput_vs_off"] = summary["tokens_per_second"] / baseline.summary["tokens_per_second"]
    else:
        summary["throughput_vs_off"] = None
    return summary


def speculation_totals(records: list[RequestRecord]) -> dict:
    """The server's acceptance figures over the level's requests, and adaptive's choices."""
    figures = [r.speculation for r in records if r.speculation is not None]
    drafted = sum(f["draft_tokens"] for f in figures)
    accepted = sum(f["accepted_tokens"] for f in figures)
    forwards = sum(f["target_forwards"] for f in figures)
    generated = sum(len(r.token_ids) for r in records if r.speculation is not None)
    choices: list[int] = []
    for figure in figures:
        add_counts(choices, figure.get("draft_length_choices") or [])
    steps = sum(choices)
    return dict(
        draft_tokens=drafted,
        accepted_tokens=accepted,
        target_forwards=forwards,
        acceptance_rate=accepted / drafted if drafted else None,
        tokens_per_forward=generated / forwards if forwards else None,
        draft_length_choices=choices,
        plain_step_share=choices[0] / steps if steps else None,
        mean_draft_length=sum(k * n for k, n in enumerate(choices)) / steps if steps else None,
    )


def compare_outputs(level: LevelResult, *, baseline: LevelResult | None) -> dict:
    """Greedy tokens of each request against plain decoding's answer to the same prompt."""
    if baseline is None:
        return dict(exact=None, compared=0, differing=[])
    reference = {r.index: r.token_ids for r in baseline.requests if r.ok}
    compared = [r for r in level.requests if r.ok and r.index in reference]
    differing = [r.index for r in compared if r.token_ids != reference[r.index]]
    return dict(exact=None if not compared else not differing, compared=len(compared), differing=differing)


# ---- the server, in this process ------------------------------------------------------------
@contextlib.contextmanager
def running_server(server) -> Iterator[str]:
    """Serve `server` (a QuickdraftServer) on a free loopback port; yields its base URL; always stops it."""
    from quickdraft.server.server import ServerThread

    running = ServerThread(server, start_timeout=SERVER_START_TIMEOUT_SECONDS)
    try:
        yield running.base_url
    finally:
        running.stop()


def server_config(options: ServingBenchOptions, *, speculative_config: dict | None):
    from quickdraft.server import ServerConfig

    return ServerConfig(
        model=options.model,
        served_model_name=SERVED_MODEL_NAME,
        dtype=options.dtype,
        kv_cache_dtype=options.kv_cache_dtype,
        device=options.device,
        max_model_len=options.max_model_len,
        max_num_seqs=options.num_slots,
        max_queue=max(64, 2 * max(options.concurrency)),
        speculative_config=speculative_config,
        shutdown_grace_seconds=5.0,
        log_level="warning",
        enable_lora=bool(options.lora_modules),
        lora_modules=list(options.lora_modules),
        max_loras=options.max_loras,
    )


# ---- the whole benchmark ------------------------------------------------------------------
@dataclass
class ServingBenchReport:
    options: ServingBenchOptions
    header: str
    machine: str
    command: str | None
    prompts: int
    skipped_question_ids: list[int]
    levels: list[LevelResult] = field(default_factory=list)

    def level(self, mode: str, concurrency: int, round_index: int = 0) -> LevelResult | None:
        return next(
            (x for x in self.levels if x.mode == mode and x.concurrency == concurrency and x.round == round_index),
            None,
        )

    def pooled(self) -> list[LevelResult]:
        """Per mode and concurrency, every round's requests as one level (wall times added), its
        summary against the pooled "off" and, in summary["round_ratios"], each round's own ratio."""
        rounds: dict[tuple[str, int], list[LevelResult]] = {}
        for x in sorted(self.levels, key=lambda x: x.round):
            rounds.setdefault((x.mode, x.concurrency), []).append(x)
        pooled = {
            (mode, concurrency): LevelResult(
                mode=mode,
                concurrency=concurrency,
                planned=sum(x.planned for x in levels),
                wall_seconds=sum(x.wall_seconds for x in levels),
                stopped_by_time_limit=any(x.stopped_by_time_limit for x in levels),
                requests=[r for x in levels for r in x.requests],
            )
            for (mode, concurrency), levels in rounds.items()
        }
        for key, level in sorted(pooled.items(), key=lambda item: MODES.index(item[0][0])):  # off first
            baseline = None if level.mode == BASELINE_MODE else pooled.get((BASELINE_MODE, level.concurrency))
            level.summary = summarize_level(level, baseline=baseline)
            level.summary["round_ratios"] = [x.summary["throughput_vs_off"] for x in rounds[key]]
        return list(pooled.values())


def run_serving_bench(options: ServingBenchOptions, *, command: str | None = None, log=None) -> ServingBenchReport:
    """Every mode at every concurrency; the engine is loaded once and shared by the modes' servers."""
    from quickdraft.engine.compute_thread import ComputeThread
    from quickdraft.engine.engine import Engine
    from quickdraft.models.heap import loaded_objects_frozen

    log = log or (lambda message: None)
    questions = load_questions(options.questions)
    # The engine is loaded, set up and stepped on one thread (engine/compute_thread.py says why).
    compute = ComputeThread(name="quickdraft-bench-engine")
    engine = compute.run(Engine, server_config(options, speculative_config=None).engine_config())
    prompts, skipped = select_prompts(
        questions,
        count_tokens=lambda text: len(engine.tokenizer.encode(text)),
        max_model_len=engine.max_model_len,
        max_tokens=options.max_tokens,
    )
    report = ServingBenchReport(
        options=options,
        header=_header(options, engine=engine, num_prompts=len(prompts)),
        machine=machine_description(options.device),
        command=command,
        prompts=len(prompts),
        skipped_question_ids=skipped,
    )
    configs = options.mode_configs()
    if options.replicas is not None:
        del engine  # the replicas load their own; this one only counted prompt tokens
        serving, start = ray_instance(), functools.partial(running_replicas, options)
    else:
        serving, start = contextlib.nullcontext(), functools.partial(_running_mode, engine, options, compute=compute)
    # frozen as `quickdraft serve` does after loading; unfrozen after, for the caller
    answers: dict[tuple[int, int], dict[int, str]] = {}  # (round, concurrency) -> off's texts by request
    with loaded_objects_frozen(), serving, contextlib.closing(compute), _clients(options) as run_clients:
        for round_index, mode, levels in _schedule(options, list(configs), per_level=options.replicas is None):
            predictions = None
            if mode == CEILING_MODE:
                predictions = {clients: answers.get((round_index, clients), {}) for clients in levels}
            with start(speculative_config=configs[mode]) as base_url:
                results = run_clients(
                    base_url=base_url,
                    prompts=prompts,
                    mode=mode,
                    concurrency=levels,
                    round_index=round_index,
                    predictions=predictions,
                )
            for level in results:
                if level.mode == BASELINE_MODE:
                    answers[(level.round, level.concurrency)] = {r.index: r.text for r in level.requests if r.ok}
                level.summary = summarize_level(level, baseline=None)  # for the progress line; redone at the end
                report.levels.append(level)
                log(_progress_line(level))
    return _summarized(report)


@contextlib.contextmanager
def _clients(options: ServingBenchOptions) -> Iterator:
    """A function that runs the clients of one server start and returns its levels: in a process
    of their own (kept for the whole benchmark), or on this thread."""
    if options.clients == "thread":
        yield functools.partial(run_clients, options=options)
        return
    import concurrent.futures
    import multiprocessing

    # spawn, not fork: this process holds the engine's threads (a forked child inherits their locks)
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
        yield lambda **level: pool.submit(run_clients, options=options, **level).result()


def run_clients(**level) -> list[LevelResult]:
    """_run_levels (its keyword arguments: one mode's levels on a running server) from a caller
    without an event loop: this thread, or the clients' process."""
    return asyncio.run(_run_levels(**level))


def _schedule(
    options: ServingBenchOptions, modes: list[str], *, per_level: bool
) -> list[tuple[int, str, tuple[int, ...]]]:
    """(round, mode, concurrency levels) per server start, in running order: every mode of a level
    back to back (per_level: a server per level), or each mode once for all levels (replicas,
    whose deployment is slow to start)."""
    runs = []
    for round_index in range(options.rounds):
        if per_level:
            for concurrency in options.concurrency:
                runs += [(round_index, mode, (concurrency,)) for mode in _mode_order(modes, round_index)]
        else:
            runs += [(round_index, mode, options.concurrency) for mode in _mode_order(modes, round_index)]
    return runs


@contextlib.contextmanager
def _running_mode(engine, options: ServingBenchOptions, *, compute, speculative_config: dict | None) -> Iterator[str]:
    """The shared engine switched to the mode, served on a free loopback port; yields the base URL.
    compute: the thread that loaded the engine and that sets it up and steps it."""
    from quickdraft.server import QuickdraftServer

    compute.run(engine.set_speculative_config, speculative_config)
    # Each level starts from an empty prefix cache: the modes share one engine and ask the same
    # prompts, so a later mode would otherwise skip the prefills of an earlier one.
    compute.run(engine.reset_prefix_cache)
    server = QuickdraftServer(
        server_config(options, speculative_config=speculative_config), engine=engine, compute=compute
    )
    with running_server(server) as base_url:
        yield base_url


def _mode_order(modes: list[str], round_index: int) -> list[str]:
    """The modes in the order round `round_index` runs them: rotated by one each round, ceiling
    (which sends off's answers) right after off."""
    rotating = [mode for mode in modes if mode != CEILING_MODE]
    shift = round_index % len(rotating)
    order = rotating[shift:] + rotating[:shift]
    if CEILING_MODE in modes:
        order.insert(order.index(BASELINE_MODE) + 1, CEILING_MODE)
    return order


def _summarized(report: ServingBenchReport) -> ServingBenchReport:
    """Every level's summary against "off" of the same round and concurrency (the same prompts)."""
    for level in sorted(report.levels, key=lambda x: MODES.index(x.mode)):  # off first
        baseline = None if level.mode == BASELINE_MODE else report.level(BASELINE_MODE, level.concurrency, level.round)
        level.summary = summarize_level(level, baseline=baseline)
    return report


@contextlib.contextmanager
def ray_instance() -> Iterator[None]:
    """A local Ray instance for the benchmark's deployments (they come and go, Ray stays)."""
    import ray

    ray.init(include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


@contextlib.contextmanager
def running_replicas(options: ServingBenchOptions, *, speculative_config: dict | None) -> Iterator[str]:
    """options.replicas fresh replicas (empty prefix caches) of the mode's server; yields the base URL."""
    from quickdraft.server.replicas import ReplicatedServer

    config = server_config(options, speculative_config=speculative_config)
    config.port = 0  # a free one
    server = ReplicatedServer(config, replica_options(options))
    try:
        yield server.base_url
    finally:
        server.stop()


async def _run_levels(
    options: ServingBenchOptions,
    *,
    base_url: str,
    prompts: list[BenchPrompt],
    mode: str,
    concurrency: tuple[int, ...],
    round_index: int,
    predictions: dict[int, dict[int, str]] | None = None,
) -> list[LevelResult]:
    """A warm-up request, then the given concurrency levels of one mode on a running server.
    predictions: per concurrency, the `prediction` of each request (ceiling; see run_level)."""
    import httpx

    async with httpx.AsyncClient(base_url=base_url, timeout=options.request_timeout_seconds) as client:
        warmup = await stream_completion(
            client,
            prompt=BenchPrompt(question_id=-1, category="warmup", text=WARMUP_PROMPT),
            index=-1,
            max_tokens=WARMUP_MAX_TOKENS,
            model=options.request_model(0),
        )
    if not warmup.ok:
        raise RuntimeError(f"the {mode} server failed its warm-up request: {warmup.error}")
    return [
        await run_level(
            base_url=base_url,
            prompts=prompts,
            mode=mode,
            concurrency=clients,
            options=options,
            round_index=round_index,
            predictions=(predictions or {}).get(clients),
        )
        for clients in concurrency
    ]


def _progress_line(level: LevelResult) -> str:
    s = level.summary
    line = (
        f"[quickdraft] round {level.round + 1}, {level.mode}, concurrency {level.concurrency}: "
        f"{s['requests_ok']}/{level.planned} "
        f"requests, {_fmt(s['tokens_per_second'], '{:.1f}')} tok/s, TTFT p50 {_fmt(s['ttft_p50'], '{:.0f}', 1e3)}"
        f" ms, TPOT p50 {_fmt(s['tpot_p50'], '{:.1f}', 1e3)} ms"
    )
    if level.stopped_by_time_limit:
        line += " (time limit reached)"
    return line


def machine_description(device: str) -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    parts = [
        f"{platform.system()} {platform.release()}",
        f"{cpu}, {os.cpu_count()} CPUs",
        f"{torch.get_num_threads()} torch threads",
        f"torch {torch.__version__}",
        f"Python {platform.python_version()}",
    ]
    if str(device).startswith("cuda") and torch.cuda.is_available():
        parts.append(f"GPU {torch.cuda.get_device_name(torch.device(device))}")
    return ", ".join(parts)


def _header(options: ServingBenchOptions, *, engine, num_prompts: int) -> str:
    model = options.model or "embedded Gemma 3 270M (GGUF Q4_K_M; dtype auto keeps it as stored)"
    return (
        f"Serving benchmark: {model}, {options.dtype}, KV cache {options.kv_cache_dtype}, {options.device}, "
        f"max_model_len {engine.max_model_len}, "
        f"{options.num_slots} cache slots{_replicas_text(options)}; greedy streamed completions of "
        f"{options.max_tokens} tokens at most, "
        f"{options.requests_per_client} per client; first turns of {num_prompts} Spec-Bench questions from "
        f"{options.questions.name}; always-on = {json.dumps(options.speculative_config, sort_keys=True)}; "
        f"{_lora_text(options)}"
        f"clients in {_clients_text(options)}; "
        f"{time.strftime('%Y-%m-%d %H:%M')}"
    )


def _lora_text(options: ServingBenchOptions) -> str:
    if not options.lora_modules:
        return ""
    names = ", ".join(options.request_model(i) for i in range(len(options.lora_modules)))
    return f"requests run LoRA adapters in turn ({names}; max_loras {options.max_loras}); "


def _clients_text(options: ServingBenchOptions) -> str:
    return "a process of their own" if options.clients == "process" else "the server's process (main thread)"


def replica_options(options: ServingBenchOptions):
    """The deployment of each mode: options.replicas replicas, cores / N CPUs each (ReplicaOptions' default)."""
    from quickdraft.server.replicas import ReplicaOptions

    return ReplicaOptions(replicas=options.replicas or 1, routing=options.routing)


def _replicas_text(options: ServingBenchOptions) -> str:
    if options.replicas is None:
        return ""
    cpus = replica_options(options).replica_cpus()
    return f" per replica, {options.replicas} replicas on Ray Serve ({cpus:g} CPUs each, {options.routing} routing)"


# ---- report ---------------------------------------------------------------------------------
def _fmt(value: float | None, pattern: str, scale: float = 1.0) -> str:
    return "-" if value is None else pattern.format(value * scale)


def _exact_cell(summary: dict, *, mode: str) -> str:
    if mode == BASELINE_MODE:
        return "(reference)"
    if summary["exact"] is None:
        return "n/a"
    if summary["exact"]:
        return f"yes ({summary['compared']})"
    return f"NO ({len(summary['differing'])} of {summary['compared']} differ)"


def mode_exactness(report: ServingBenchReport, mode: str) -> str:
    """yes / NO / n/a over every level of a mode, against plain decoding."""
    levels = [x for x in report.levels if x.mode == mode]
    compared = sum(x.summary["compared"] for x in levels)
    differing = sum(len(x.summary["differing"]) for x in levels)
    if not compared:
        return "n/a (nothing to compare)"
    return f"yes ({compared} requests)" if not differing else f"NO ({differing} of {compared} requests differ)"


def throughput_table(report: ServingBenchReport) -> str:
    by_round = report.options.rounds > 1
    lines = [
        "| concurrency | mode | tok/s | vs off | "
        + ("vs off by round | " if by_round else "")
        + "TTFT p50 ms | TTFT p90 ms | TPOT p50 ms | TPOT p90 ms | requests | exact vs off |",
        "|---" * (11 if by_round else 10) + "|",
    ]
    for level in _table_order(report):
        s = level.summary
        requests = f"{s['requests_ok']}/{level.planned}" + (" (time limit)" if level.stopped_by_time_limit else "")
        rounds = ""
        if by_round:
            ratios = ", ".join(_fmt(r, "{:.2f}") for r in s["round_ratios"])
            rounds = "- | " if level.mode == BASELINE_MODE else f"{ratios} | "
        lines.append(
            f"| {level.concurrency} | {level.mode} | {_fmt(s['tokens_per_second'], '{:.1f}')} | "
            f"{'1.00x' if level.mode == BASELINE_MODE else _fmt(s['throughput_vs_off'], '{:.2f}x')} | {rounds}"
            f"{_fmt(s['ttft_p50'], '{:.0f}', 1e3)} | {_fmt(s['ttft_p90'], '{:.0f}', 1e3)} | "
            f"{_fmt(s['tpot_p50'], '{:.1f}', 1e3)} | {_fmt(s['tpot_p90'], '{:.1f}', 1e3)} | {requests} | "
            f"{_exact_cell(s, mode=level.mode)} |"
        )
    return "\n".join(lines)


def speculation_table(report: ServingBenchReport) -> str:
    lines = [
        "| concurrency | mode | acceptance rate | tokens per target forward | plain-decoding steps | "
        "mean draft length |",
        "|---" * 6 + "|",
    ]
    for level in _table_order(report):
        if level.mode == BASELINE_MODE:
            continue
        s = level.summary
        lines.append(
            f"| {level.concurrency} | {level.mode} | {_fmt(s['acceptance_rate'], '{:.2f}')} | "
            f"{_fmt(s['tokens_per_forward'], '{:.2f}')} | {_fmt(s['plain_step_share'], '{:.0%}')} | "
            f"{_fmt(s['mean_draft_length'], '{:.2f}')} |"
        )
    return "\n".join(lines)


def _table_order(report: ServingBenchReport) -> list[LevelResult]:
    """The rounds pooled, by concurrency, then in mode order."""
    return sorted(report.pooled(), key=lambda x: (x.concurrency, MODES.index(x.mode)))


def summary_markdown(report: ServingBenchReport) -> str:
    parts = [f"# {report.header}"]
    if report.command:
        parts.append(f"`{report.command}`")
    parts.append(f"Machine: {report.machine}")
    parts += [
        "## Throughput and latency per concurrency (client side)",
        throughput_table(report),
        "tok/s: output tokens of the level's finished requests / the level's wall time (every round's "
        "tokens / their wall times added); vs off: against plain decoding at the same concurrency (vs off by "
        "round: each round's own ratio, the modes of a level run back to back); TTFT: request sent to first "
        "token; TPOT: first to last token / tokens after the first (median and p90 over requests); exact vs "
        "off: every request's greedy tokens "
        "equal plain decoding's answer to the same prompt (requests compared).",
        "## Speculation (the server's figures)",
        speculation_table(report),
        "plain-decoding steps and mean draft length: adaptive speculation's choices per decoding step "
        "(zeros included in the mean); always-on drafts every step it can."
        + (
            " ceiling: every request brings off's answer to it as its `prediction` (chains of up to 16 of "
            "off's own tokens): what a drafter that is always right reaches here, a bound on any drafter's "
            "ratio at these step costs; its acceptance rate below 1 is where off's text re-encodes to "
            "other tokens than off's."
            if CEILING_MODE in report.options.modes
            else ""
        ),
        "## Exact vs off, per mode",
        "\n".join(
            f"- {mode}: {mode_exactness(report, mode)}" for mode in report.options.modes if mode != BASELINE_MODE
        ),
    ]
    notes = _notes(report)
    if notes:
        parts += ["## Notes", "\n".join(f"- {note}" for note in notes)]
    return "\n\n".join(parts) + "\n"


def _notes(report: ServingBenchReport) -> list[str]:
    notes = []
    limit = report.options.time_limit_seconds
    for level in report.levels:
        where = f" (round {level.round + 1})" if report.options.rounds > 1 else ""
        if level.stopped_by_time_limit:
            notes.append(
                f"time limit ({limit:g} s per level) reached{where}: {level.mode} at concurrency "
                f"{level.concurrency} sent {len(level.requests)} of {level.planned} requests"
            )
        if level.summary["errors"]:
            first = next(r.error for r in level.requests if not r.ok)
            notes.append(
                f"{level.mode} at concurrency {level.concurrency}{where}: {level.summary['errors']} requests "
                f"failed (first: {first})"
            )
    if report.skipped_question_ids:
        notes.append(
            f"{len(report.skipped_question_ids)} questions left out: first turn + max_tokens exceed the "
            f"context (question ids {report.skipped_question_ids})"
        )
    return notes


def report_json(report: ServingBenchReport) -> dict:
    options = asdict(report.options)
    options["questions"] = str(options["questions"])
    options["concurrency"] = list(options["concurrency"])
    return dict(
        header=report.header,
        command=report.command,
        machine=report.machine,
        options=options,
        prompts=report.prompts,
        skipped_question_ids=report.skipped_question_ids,
        exact_vs_off={mode: mode_exactness(report, mode) for mode in report.options.modes if mode != BASELINE_MODE},
        levels=[dict(_level_json(x), round=x.round, requests=[asdict(r) for r in x.requests]) for x in report.levels],
        pooled=[_level_json(x) for x in _table_order(report)],  # the rounds together: the tables' rows
    )


def _level_json(level: LevelResult) -> dict:
    return dict(
        mode=level.mode,
        concurrency=level.concurrency,
        planned=level.planned,
        wall_seconds=level.wall_seconds,
        stopped_by_time_limit=level.stopped_by_time_limit,
        summary=level.summary,
    )


def write_report(report: ServingBenchReport, out_dir: Path) -> list[Path]:
    """Write summary.md and results.json; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    summary_path, json_path = out_dir / SUMMARY_FILE, out_dir / JSON_FILE
    summary_path.write_text(summary_markdown(report))
    json_path.write_text(json.dumps(report_json(report), indent=1) + "\n")
    return [summary_path, json_path]


def default_out_dir() -> Path:
    return Path("results") / f"serve-{time.strftime('%Y%m%d-%H%M%S')}"
