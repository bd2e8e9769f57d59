"""PNG plots of a Spec-Bench report: speedup by task, acceptance by draft position."""

from __future__ import annotations

import textwrap
from pathlib import Path


def _pyplot():
    try:
        import matplotlib
    except ImportError as err:
        raise RuntimeError(f"plots need matplotlib ({err}): pip install 'quickdraft[bench]'") from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_speedup_by_task(summaries: dict[str, dict[str, dict]], path: Path, *, title: str) -> None:
    """Grouped bars: one group per task (and overall), one bar per run."""
    plt = _pyplot()
    runs = list(summaries)
    tasks = list(next(iter(summaries.values()))) if summaries else []
    width = 0.8 / max(1, len(runs))
    # The plot area grows with the bars; the legend sits in its own column on the right, so
    # long run names or 8+ runs never squeeze the axes.
    fig, ax = plt.subplots(figsize=(max(7.0, 0.22 * len(runs) * len(tasks) + 2.0) + 3.2, 5.0))
    for i, run in enumerate(runs):
        xs = [t + (i - (len(runs) - 1) / 2) * width for t in range(len(tasks))]
        ax.bar(xs, [summaries[run][task]["speedup"] for task in tasks], width=width, label=_wrap(run))
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(tasks)), tasks, rotation=20, ha="right")
    ax.set_ylabel("speedup over plain decoding")
    _title(ax, title)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_acceptance_by_position(curves: dict[str, list[float]], path: Path, *, title: str) -> None:
    """One line per run: share of drafts reaching depth k whose accepted path reached it."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for run, rates in curves.items():
        ax.plot(range(1, len(rates) + 1), rates, marker="o", label=_wrap(run))
    ax.set_xlabel("draft position (depth)")
    ax.set_ylabel("acceptance rate at position")
    ax.set_ylim(0, 1.05)
    _title(ax, title)
    if curves:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    else:
        ax.text(0.5, 0.5, "no run reported per-position acceptance", ha="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _wrap(label: str) -> str:
    return "\n".join(textwrap.wrap(label, 28)) or label


def _title(ax, title: str) -> None:
    ax.set_title("\n".join(textwrap.wrap(title, 110)), fontsize=8)
