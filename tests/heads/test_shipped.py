"""Shipped heads are found by name for the target they were trained on, whatever its dtype."""

from __future__ import annotations

import json

import pytest

import quickdraft.heads as shipped
from quickdraft import LLM


def test_signature_is_the_same_in_every_dtype_and_differs_between_models(tiny_checkpoints):
    fp32 = LLM(str(tiny_checkpoints["gemma3"]), max_model_len=64).engine.model
    bf16 = LLM(str(tiny_checkpoints["gemma3"]), max_model_len=64, dtype="bfloat16").engine.model
    other = LLM(str(tiny_checkpoints["llama"]), max_model_len=64).engine.model
    assert shipped.target_signature(fp32) == shipped.target_signature(bf16)
    assert shipped.target_signature(fp32) != shipped.target_signature(other)
    assert shipped.target_signature(fp32).startswith("gemma3_text-4x64-v320-")


def test_heads_resolve_by_name_for_their_target_only(tiny_checkpoints, tmp_path, monkeypatch):
    from tests.drafters.test_eagle import random_head

    model = LLM(str(tiny_checkpoints["gemma3"]), max_model_len=64).engine.model
    random_head(tmp_path / "eagle3-tiny")
    manifest = {"heads": [{"name": "eagle3", "target": shipped.target_signature(model), "dir": "eagle3-tiny"}]}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    monkeypatch.setattr(shipped, "HEADS_ROOT", tmp_path)
    monkeypatch.setattr(shipped, "MANIFEST", tmp_path / "manifest.json")
    assert shipped.resolve_head_dir(None, method="eagle3", model=model) == tmp_path / "eagle3-tiny"
    assert shipped.resolve_head_dir("eagle3", method="eagle3", model=model) == tmp_path / "eagle3-tiny"
    other = LLM(str(tiny_checkpoints["llama"]), max_model_len=64).engine.model
    with pytest.raises(ValueError, match="no eagle3 head is shipped"):
        shipped.resolve_head_dir(None, method="eagle3", model=other)
    with pytest.raises(FileNotFoundError, match="'medusa-x' not found"):
        shipped.resolve_head_dir("medusa-x", method="medusa", model=model)
    # and the drafter loads it by name, keeping greedy output exact
    llm = LLM(str(tiny_checkpoints["gemma3"]), max_model_len=128, speculative_config={"method": "eagle3", "top_k": 1})
    assert llm.engine.speculator.drafter.head.config.draft_vocab_size == 200


def test_head_dtype_is_validated():
    import torch

    assert shipped.head_compute_dtype(None, default=torch.float32) == torch.float32
    assert shipped.head_compute_dtype("bfloat16", default=torch.float32) == torch.bfloat16
    with pytest.raises(ValueError, match="head_dtype"):
        shipped.head_compute_dtype("int8", default=torch.float32)


def test_shipped_heads_are_small_and_say_how_they_were_made():
    entries = shipped.shipped_heads()
    assert entries, "the package ships at least the eagle3 head for the embedded model"
    for entry in entries:
        folder = shipped.HEADS_ROOT / entry["dir"]
        weights = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
        assert 0 < weights <= 16 * 1024 * 1024, f"{entry['dir']}: {weights} bytes"
        manifest = json.loads((folder / "manifest.json").read_text())
        assert manifest["method"] == entry.get("method", entry["name"])
        assert manifest["command"].startswith("quickdraft train-head") and manifest["reproduce"]
        assert "Spec-Bench" in manifest["data"] and isinstance(manifest["options"]["seed"], int)
        assert manifest["report"]["val_chain_acceptance_length"] > 1.0
