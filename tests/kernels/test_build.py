"""Kernel builds: a lock left by a build that was killed does not block later builds."""

from __future__ import annotations

from quickdraft.kernels.build import _build_lock, build_name


def test_a_build_lock_left_by_a_killed_build_is_removed(tmp_path):
    build_dir = tmp_path / "quickdraft_some_kernel"
    build_dir.mkdir()
    (build_dir / "lock").touch()  # what torch leaves when its builder dies mid-build
    with _build_lock(build_dir):
        assert not (build_dir / "lock").exists()


def test_each_ninja_builds_in_a_directory_of_its_own(tmp_path, monkeypatch):
    """ninja 1.11 and 1.13 read each other's build logs as stale: a process started with the venv
    activated (its ninja first on PATH) and one started without would rebuild every kernel in turn."""
    names = []
    for version in ("1.11", "1.13"):
        folder = tmp_path / version
        folder.mkdir()
        ninja = folder / "ninja"
        ninja.write_text("#!/bin/sh\necho " + version + "\n")
        ninja.chmod(0o755)
        monkeypatch.setenv("PATH", str(folder))
        names.append(build_name("argmax_v2"))
    assert names[0] != names[1] and all(name.startswith("quickdraft_argmax_v2_torch") for name in names)
    assert build_name("argmax_v2") == names[1]  # the same ninja, the same directory


def test_every_cpu_kernel_is_built_up_front():
    """What servers run at start, so that no request waits for a first build."""
    from quickdraft.kernels import argmax, build_cpu_kernels, keyed_draw, token_mask

    known = {"quant_linear", "attention", "argmax", "keyed_draw", "token_mask", "draft_mixture", "skinny_linear"}
    missing = build_cpu_kernels()
    assert set(missing) <= known
    assert all(kernel._KERNEL._loaded for kernel in (argmax, keyed_draw, token_mask))  # built or found unusable
    assert ("argmax" in missing) == (not argmax.kernel_available())
