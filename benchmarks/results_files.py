"""Where a benchmark script leaves its figures: `results.json` (every row) and `summary.md`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def save_results(out: Path | None, *, rows: Any, report: str) -> None:
    """Write rows and report under `out` (made if missing); nothing when out is None."""
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    (out / "summary.md").write_text(report)


def totals(rows: list[dict], *fields: str) -> list[float]:
    """Each field summed over rows (a config's requests), in the order asked."""
    return [sum(row[name] for row in rows) for name in fields]
