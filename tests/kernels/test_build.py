"""Kernel builds: a lock left by a build that was killed does not block later builds."""

from __future__ import annotations

from pathlib import Path

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


def test_a_torch_lock_left_beside_the_skinny_linear_build_does_not_block_it():
    """A server stopped while its start-up builds ran left torch's lock file in this kernel's build
    directory, and every later process waited on it forever (CI stalled for 40 minutes)."""
    import threading

    import pytest
    from torch.utils import cpp_extension

    from quickdraft.kernels import cpu_linear

    if not cpu_linear.kernel_available():
        pytest.skip("the skinny_linear kernel does not run on this CPU")
    lock = Path(cpp_extension._get_build_directory(build_name(cpu_linear._EXT_NAME), verbose=False)) / "lock"
    lock.touch()
    cpu_linear._load_extension.cache_clear()
    loaded = []
    try:
        builder = threading.Thread(target=lambda: loaded.append(cpu_linear.kernel_available()), daemon=True)
        builder.start()
        builder.join(timeout=120)
        assert loaded == [True] and not lock.exists()
    finally:
        lock.unlink(missing_ok=True)
        cpu_linear._load_extension.cache_clear()
