"""Kernel builds: a lock left by a build that was killed does not block later builds."""

from __future__ import annotations

from quickdraft.kernels.build import _build_lock


def test_a_build_lock_left_by_a_killed_build_is_removed(tmp_path):
    build_dir = tmp_path / "quickdraft_some_kernel"
    build_dir.mkdir()
    (build_dir / "lock").touch()  # what torch leaves when its builder dies mid-build
    with _build_lock(build_dir):
        assert not (build_dir / "lock").exists()
