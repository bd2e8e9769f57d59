"""Tables (markdown), per-question JSON and plots of a Spec-Bench report, written to a folder."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from quickdraft.bench.backends import BenchSampling
from quickdraft.bench.plots import plot_acceptance_by_position, plot_speedup_by_task
from quickdraft.bench.runner import MB, BenchOptions, BenchReport, RunReport, summarize_report
from quickdraft.bench.specbench import QuestionResult, TurnRecord

SUMMARY_FILE = "summary.md"
JSON_FILE = "results.json"
SPEEDUP_PLOT = "speedup_by_task.png"
ACCEPTANCE_PLOT = "acceptance_by_position.png"


def default_out_dir() -> Path:
    return Path("results") / f"specbench-{time.strftime('%Y%m%d-%H%M%S')}"


def _fmt(value: float | None, pattern: str, *, scale: float = 1.0) -> str:
    return "-" if value is None else pattern.format(value * scale)


def task_table(report: BenchReport, cell: Callable[[dict], str]) -> str:
    """A row per finished run, a column per task (then overall): cell(summary row)."""
    runs = [r for r in report.runs if r.summary]
    if not runs:
        return "(no run finished)"
    tasks = list(runs[0].summary)
    lines = ["| run | " + " | ".join(tasks) + " |", "|---" * (len(tasks) + 1) + "|"]
    for run in runs:
        lines.append(f"| {run.name} | " + " | ".join(cell(run.summary[t]) for t in tasks) + " |")
    return "\n".join(lines)


def leaderboard_table(report: BenchReport) -> str:
    """Spec-Bench's leaderboard: speedup over plain decoding (mean accepted tokens) per task."""
    return task_table(report, lambda row: f"{row['speedup']:.2f}x ({_fmt(row['mean_accepted_tokens'], '{:.2f}')})")


def peak_memory_mb(report: BenchReport, run: RunReport) -> float | None:
    """Peak memory during the run, above what the process held before the run's model was loaded."""
    if run.peak_memory_bytes is None:
        return None
    if report.options.device.startswith("cuda"):
        return run.peak_memory_bytes / MB
    return (run.peak_memory_bytes - run.memory_base_bytes) / MB


def details_table(report: BenchReport) -> str:
    """Overall figures per run: throughput, exactness, latency, memory."""
    lines = [
        "| run | tok/s | speedup | vs reference | exact match | mean accepted | acceptance rate | "
        "TTFT ms | TPOT ms | peak MB | drafter MB |",
        "|---" * 11 + "|",
    ]
    for run in report.runs:
        if not run.summary:
            continue
        row = run.summary["overall"]
        if run.reference == run.name:
            exact = "(reference)"
        elif not report.options.sampling.greedy:
            exact = "n/a (sampled)"
        else:
            exact = f"{_fmt(row['exact_match'], '{:.0%}')} vs {run.reference}"
        drafter = None if run.drafter_memory_bytes is None else run.drafter_memory_bytes / MB
        lines.append(
            f"| {run.name} | {row['tokens_per_second']:.1f} | {row['speedup']:.2f}x | "
            f"{_fmt(row['speedup_vs_reference'], '{:.2f}x')} | {exact} | "
            f"{_fmt(row['mean_accepted_tokens'], '{:.2f}')} | {_fmt(row['acceptance_rate'], '{:.2f}')} | "
            f"{_fmt(row['ttft'], '{:.0f}', scale=1e3)} | {_fmt(row['tpot'], '{:.1f}', scale=1e3)} | "
            f"{_fmt(peak_memory_mb(report, run), '{:.0f}')} | {_fmt(drafter, '{:+.0f}')} |"
        )
    return "\n".join(lines)


def ttft_table(report: BenchReport) -> str:
    """Mean time to first token per task, first turns / later turns where a task has them (a later
    turn's prompt starts with the conversation so far: its prefix-cache hit should make it as
    quick in every run as in plain decoding's)."""

    def cell(row: dict) -> str:
        first, later = row["ttft_first_turns"], row["ttft_later_turns"]
        return f"{first * 1e3:.0f}" + ("" if later is None else f" / {later * 1e3:.0f}")

    return task_table(report, cell)


def position_table(report: BenchReport) -> str:
    curves = {r.name: r.acceptance_by_position for r in report.runs if r.acceptance_by_position}
    if not curves:
        return "(no run drafted)"
    depth = max(len(c) for c in curves.values())
    lines = ["| run | " + " | ".join(str(k) for k in range(1, depth + 1)) + " |", "|---" * (depth + 1) + "|"]
    for name, curve in curves.items():
        cells = [f"{rate:.2f}" for rate in curve] + ["-"] * (depth - len(curve))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary_markdown(report: BenchReport) -> str:
    parts = [f"# {report.header}"]
    if report.command:
        parts.append(f"`{report.command}`")
    parts += [
        "## Speedup over quickdraft plain decoding (mean accepted tokens per target forward)",
        leaderboard_table(report),
        "## Overall per run",
        details_table(report),
        "speedup: quickdraft plain's time per generated token / the run's, on the same questions (for "
        "identical outputs: plain wall time / run wall time); vs reference: the same against the run named "
        "in exact match (a peer's own plain decoding); exact match: share of questions whose greedy tokens "
        "equal the reference's in every turn (not defined for sampled runs); peak MB: process "
        "memory above what it held before the run loaded its model (CUDA: allocator peak); drafter MB: "
        "peak above quickdraft plain's.",
        "## Time to first token by task, ms (first turns / later turns)",
        ttft_table(report),
        "## Acceptance by draft position (drafts reaching depth k whose accepted path reached it)",
        position_table(report),
    ]
    failed = [r for r in report.runs if r.error]
    if failed:
        parts.append("## Runs that did not finish")
        parts.append("\n".join(f"- {r.name}: {r.error}" for r in failed))
    return "\n\n".join(parts) + "\n"


def report_json(report: BenchReport) -> dict:
    options = asdict(report.options)
    options["questions"] = str(options["questions"])
    return dict(
        header=report.header,
        command=report.command,
        options=options,
        runs=[
            dict(
                name=r.name,
                engine=r.engine,
                setting=r.setting,
                reference=r.reference,
                error=r.error,
                seconds=r.seconds,
                peak_memory_bytes=r.peak_memory_bytes,
                memory_base_bytes=r.memory_base_bytes,
                peak_memory_mb=peak_memory_mb(report, r),
                drafter_memory_bytes=r.drafter_memory_bytes,
                summary=r.summary,
                acceptance_by_position=r.acceptance_by_position,
                questions=None if r.results is None else [q.to_dict() for q in r.results],
            )
            for r in report.runs
        ],
    )


def write_report(report: BenchReport, out_dir: Path) -> list[Path]:
    """Write summary.md, results.json and the two plots; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    summary = out_dir / SUMMARY_FILE
    summary.write_text(summary_markdown(report))
    written.append(summary)
    data = out_dir / JSON_FILE
    data.write_text(json.dumps(report_json(report), indent=1))
    written.append(data)
    return written + plot_results(out_dir)


def plot_results(out_dir: Path) -> list[Path]:
    """The two PNG plots, drawn from the folder's results.json (so old runs can be redrawn)."""
    data = json.loads((out_dir / JSON_FILE).read_text())
    runs = [r for r in data["runs"] if r["summary"]]
    speedups = {r["name"]: r["summary"] for r in runs if r["reference"] != r["name"]}
    plot_speedup_by_task(speedups, out_dir / SPEEDUP_PLOT, title=data["header"])
    plot_acceptance_by_position(
        {r["name"]: r["acceptance_by_position"] for r in runs if r["acceptance_by_position"]},
        out_dir / ACCEPTANCE_PLOT,
        title=data["header"],
    )
    return [out_dir / SPEEDUP_PLOT, out_dir / ACCEPTANCE_PLOT]


def load_report(out_dir: Path) -> BenchReport:
    """Rebuild a report from a results folder's results.json (figures recomputed from the
    per-question records), e.g. to redraw its tables and plots."""
    path = out_dir / JSON_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {JSON_FILE} in {out_dir}")
    data = json.loads(path.read_text())
    options = dict(data["options"])
    options["sampling"] = BenchSampling(**options["sampling"])
    options["categories"] = tuple(options["categories"]) if options["categories"] else None
    options["peers"] = tuple(options["peers"])
    runs = []
    for run in data["runs"]:
        results = None
        if run["questions"] is not None:
            results = [
                QuestionResult(
                    question_id=q["question_id"],
                    category=q["category"],
                    turns=[TurnRecord(**turn) for turn in q["turns"]],
                )
                for q in run["questions"]
            ]
        runs.append(
            RunReport(
                name=run["name"],
                engine=run["engine"],
                setting=run["setting"],
                reference=run["reference"],
                results=results,
                error=run["error"],
                peak_memory_bytes=run["peak_memory_bytes"],
                memory_base_bytes=run["memory_base_bytes"],
                seconds=run["seconds"],
            )
        )
    report = BenchReport(options=BenchOptions(**options), runs=runs, header=data["header"], command=data.get("command"))
    summarize_report(report)
    return report
