"""`quickdraft bench replicas`: multi-turn conversations against 1 replica and N replicas (Ray Serve).

Setups, each a fresh deployment (empty prefix caches) of the same model and speculative
config: 1 replica with the whole machine; N replicas (cores / N each) routed round-robin; N
replicas routed cache-aware. C clients each hold conversations (Spec-Bench multi-turn
questions, file order): turn 1 streamed, then turn 2, whose prompt is turn 1's prompt, its
answer and the second question, streamed too. Measured from the client: which replica
answered each turn (the `x-quickdraft-replica` header), the second turns' prefix-cache hits
(the server's `usage.prompt_tokens_details.cached_tokens` over their prompt tokens), TTFT of
first and second turns, and output tokens per second over the setup's wall time. Greedy, so
every setup must produce the same tokens (checked).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from quickdraft.bench.serving import machine_description, percentile, ray_instance, sse_chunks
from quickdraft.bench.specbench import conversation_prompt, load_questions

DEFAULT_QUESTIONS = Path("../shared/data/specbench/questions.dev.jsonl")
SERVED_MODEL_NAME = "bench"
REPLICA_HEADER = "x-quickdraft-replica"


@dataclass(kw_only=True)
class ReplicaBenchOptions:
    speculative_config: dict | None = None
    questions: Path = DEFAULT_QUESTIONS
    model: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = 2048
    replicas: int = 2
    conversations: int = 16
    concurrency: int = 4
    max_tokens: int = 64
    max_num_seqs: int = 8

    def __post_init__(self) -> None:
        self.questions = Path(self.questions)
        for name in ("replicas", "conversations", "concurrency", "max_tokens", "max_num_seqs"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.replicas < 2:
            raise ValueError(
                f"replicas must be >= 2 (1 replica is always measured as the baseline), got {self.replicas}"
            )

    def setups(self) -> list[tuple[str, int, str]]:
        """(name, replicas, routing) of each setup, the baseline first."""
        n = self.replicas
        return [
            ("1 replica", 1, "cache_aware"),
            (f"{n} replicas, round_robin", n, "round_robin"),
            (f"{n} replicas, cache_aware", n, "cache_aware"),
        ]


@dataclass
class TurnResult:
    conversation: int
    turn: int
    replica: str | None = None
    ttft: float | None = None
    seconds: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    error: str | None = None


async def stream_turn(client, *, prompt: str, conversation: int, turn: int, max_tokens: int) -> TurnResult:
    result = TurnResult(conversation=conversation, turn=turn)
    body = {
        "model": SERVED_MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    started = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            result.replica = response.headers.get(REPLICA_HEADER)
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode(errors='replace')[:300]}"
                return result
            async for chunk in sse_chunks(response):
                if "error" in chunk:
                    result.error = f"stream error: {chunk['error'].get('message')}"
                    break
                for choice in chunk.get("choices", []):
                    if choice.get("token_ids") and result.ttft is None:
                        result.ttft = time.perf_counter() - started
                    result.token_ids += choice.get("token_ids") or []
                    result.text += choice.get("text") or ""
                usage = chunk.get("usage")
                if usage:
                    result.prompt_tokens = usage["prompt_tokens"]
                    result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    except Exception as err:  # recorded, the setup goes on
        result.error = f"{type(err).__name__}: {err}"
    result.seconds = time.perf_counter() - started
    return result


async def run_conversations(
    base_url: str, *, questions, options: ReplicaBenchOptions
) -> tuple[list[TurnResult], float]:
    import httpx

    async with httpx.AsyncClient(base_url=base_url, timeout=600.0) as client:
        warmup = await stream_turn(client, prompt="User: Say hello.\nAssistant:", conversation=-1, turn=1, max_tokens=4)
        if warmup.error:
            raise RuntimeError(f"the warm-up request failed: {warmup.error}")
        started = time.perf_counter()

        async def one_client(first: int) -> list[TurnResult]:
            results = []
            for index in range(first, len(questions), options.concurrency):
                turns = questions[index].turns
                one = await stream_turn(
                    client,
                    prompt=conversation_prompt(turns[:1], []),
                    conversation=index,
                    turn=1,
                    max_tokens=options.max_tokens,
                )
                results.append(one)
                if one.error is not None or len(turns) < 2:
                    continue
                results.append(
                    await stream_turn(
                        client,
                        prompt=conversation_prompt(turns[:2], [one.text.strip()]),
                        conversation=index,
                        turn=2,
                        max_tokens=options.max_tokens,
                    )
                )
            return results

        per_client = await asyncio.gather(*(one_client(i) for i in range(options.concurrency)))
        wall = time.perf_counter() - started
    return sorted((r for rows in per_client for r in rows), key=lambda r: (r.conversation, r.turn)), wall


def summarize(turns: list[TurnResult], *, wall: float) -> dict:
    ok = [t for t in turns if t.error is None]
    first = {t.conversation: t for t in ok if t.turn == 1}
    second = [t for t in ok if t.turn == 2]
    prompt_tokens = sum(t.prompt_tokens for t in second)
    return {
        "turns": len(turns),
        "errors": len(turns) - len(ok),
        "replicas_used": len({t.replica for t in ok}),
        "second_turns": len(second),
        "second_turn_same_replica": sum(
            1 for t in second if t.conversation in first and first[t.conversation].replica == t.replica
        )
        / max(1, len(second)),
        "second_turn_prefix_hit_rate": sum(t.cached_tokens for t in second) / prompt_tokens if prompt_tokens else None,
        "ttft_first_p50": percentile([t.ttft for t in first.values() if t.ttft is not None], 0.5),
        "ttft_second_p50": percentile([t.ttft for t in second if t.ttft is not None], 0.5),
        "ttft_second_p90": percentile([t.ttft for t in second if t.ttft is not None], 0.9),
        "output_tokens_per_second": sum(len(t.token_ids) for t in ok) / wall if wall > 0 else None,
        "wall_seconds": wall,
    }


def run_replica_bench(options: ReplicaBenchOptions, *, log=print) -> dict:
    from quickdraft.server import ServerConfig
    from quickdraft.server.replicas import ReplicaOptions, ReplicatedServer

    questions = load_questions(options.questions, categories=("multi-turn",))[: options.conversations]
    report: dict = {
        "options": {**asdict(options), "questions": str(options.questions)},
        "machine": machine_description("cpu"),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "setups": [],
    }
    with ray_instance():
        outputs: dict[str, list[list[int]]] = {}
        for name, replicas, routing in options.setups():
            config = ServerConfig(
                model=options.model,
                served_model_name=SERVED_MODEL_NAME,
                dtype=options.dtype,
                port=0,
                max_model_len=options.max_model_len,
                max_num_seqs=options.max_num_seqs,
                speculative_config=options.speculative_config,
                log_level="warning",
            )
            # cores / replicas CPUs each: ReplicaOptions' default
            server = ReplicatedServer(config, ReplicaOptions(replicas=replicas, routing=routing))
            try:
                turns, wall = asyncio.run(run_conversations(server.base_url, questions=questions, options=options))
            finally:
                server.stop()
            summary = summarize(turns, wall=wall)
            outputs[name] = [t.token_ids for t in turns]
            report["setups"].append({"name": name, "replicas": replicas, "routing": routing, "summary": summary})
            log(f"[quickdraft] {name}: {json.dumps(summary)}")
        baseline = next(iter(outputs.values()))
        for setup in report["setups"]:
            setup["summary"]["same_tokens_as_1_replica"] = outputs[setup["name"]] == baseline
    return report


def summary_markdown(report: dict) -> str:
    options = report["options"]
    lines = [
        f"# Replicas and routing: {options['model'] or 'embedded Gemma 3 270M'} ({options['dtype']}), "
        f"speculation {json.dumps(options['speculative_config'])}",
        "",
        f"{options['conversations']} Spec-Bench multi-turn conversations ({Path(options['questions']).name}), "
        f"2 turns each, {options['concurrency']} concurrent clients, greedy, {options['max_tokens']} tokens per turn "
        f"at most, streamed completions. Machine: {report['machine']}. {report['date']}.",
        "",
        "| setup | 2nd turn on 1st turn's replica | 2nd-turn prefix-cache hit rate | TTFT 1st turn p50 | "
        "TTFT 2nd turn p50 / p90 | output tok/s | errors | same tokens |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for setup in report["setups"]:
        s = setup["summary"]
        hit = "-" if s["second_turn_prefix_hit_rate"] is None else f"{s['second_turn_prefix_hit_rate']:.0%}"
        lines.append(
            f"| {setup['name']} | {s['second_turn_same_replica']:.0%} | {hit} | {_ms(s['ttft_first_p50'])} | "
            f"{_ms(s['ttft_second_p50'])} / {_ms(s['ttft_second_p90'])} | {s['output_tokens_per_second']:.1f} | "
            f"{s['errors']} | {'yes' if s['same_tokens_as_1_replica'] else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f} ms"


def write_report(report: dict, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = out_dir / "summary.md"
    summary.write_text(summary_markdown(report))
    results = out_dir / "results.json"
    results.write_text(json.dumps(report, indent=2) + "\n")
    return [summary, results]
