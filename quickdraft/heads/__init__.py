"""Draft heads shipped inside the package, found by name for the model they were trained on.

``manifest.json`` lists each head: its method name, the target it drafts for (the name of
the target's model directory, e.g. the embedded model's converted cache directory), its
folder here, and how it was made (command, data, seed, measured figures).
"""

from __future__ import annotations

import json
from pathlib import Path

HEADS_ROOT = Path(__file__).resolve().parent
MANIFEST = HEADS_ROOT / "manifest.json"


def shipped_heads() -> list[dict]:
    if not MANIFEST.is_file():
        return []
    return json.loads(MANIFEST.read_text()).get("heads", [])


def shipped_head_dir(name: str, *, model_dir: str | None) -> Path | None:
    """The shipped head called `name` for the target loaded from `model_dir`, or None."""
    target = Path(model_dir).name if model_dir else None
    for entry in shipped_heads():
        if entry["name"] == name and entry["target"] == target:
            return HEADS_ROOT / entry["dir"]
    return None
