"""Building the C++ kernels: on first use, with torch.utils.cpp_extension, cached in torch's
extensions directory (``TORCH_EXTENSIONS_DIR`` if set).  A kernel that cannot be built or whose
CPU check fails is None, and its caller runs portable torch code instead (logged once)."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import re
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"


def load_kernel(name: str, *, source: str, extra_cflags: tuple[str, ...] = (), what: str) -> ModuleType | None:
    """The compiled module `name` built from csrc/`source`, or None (disabled, no compiler,
    build error, or `module.cpu_supported()` false).  `what` names the fallback in the log."""
    if os.environ.get("QUICKDRAFT_DISABLE_CPU_KERNEL", "0") not in ("", "0"):
        logger.info("%s: disabled by QUICKDRAFT_DISABLE_CPU_KERNEL, using %s", name, what)
        return None
    try:
        from torch.utils import cpp_extension

        full_name = build_name(name)
        build_dir = Path(cpp_extension._get_build_directory(full_name, verbose=False))
        with _build_lock(build_dir):
            # torch rebuilds when a source or a flag changes, but not for a header: their hash is a flag.
            module = cpp_extension.load(
                name=full_name,
                sources=[str(CSRC / source)],
                extra_cflags=["-O3", "-fopenmp", "-DNDEBUG", f"-DQD_HEADERS={_headers_hash()}", *extra_cflags],
                extra_ldflags=["-fopenmp"],
                build_directory=str(build_dir),
                verbose=False,
            )
    except Exception as exc:  # no compiler, build error, import error, ...
        logger.warning("%s: building the C++ kernel failed, using %s: %s", name, what, exc)
        return None
    if not module.cpu_supported():
        logger.warning("%s: this CPU lacks the instructions of the C++ kernel, using %s", name, what)
        return None
    return module


def build_name(name: str) -> str:
    """The extension's name, which names its build directory. The torch version is part of it
    (an in-place torch upgrade would not rebuild), and so is the ninja that builds: ninja 1.11 (a
    system's) and 1.13 (the venv's, first on PATH when the venv is activated) read each other's
    build logs as stale, so processes started both ways rebuilt every kernel in turn (~35 s each,
    minutes on a 2-core machine, seen as a server's first request timing out)."""
    ninja = shutil.which("ninja") or "none"
    ninja_tag = hashlib.sha256(os.path.realpath(ninja).encode()).hexdigest()[:8]
    torch_tag = re.sub(r"\W", "_", torch.__version__)
    return f"quickdraft_{name}_torch{torch_tag}_ninja{ninja_tag}"


@contextlib.contextmanager
def _build_lock(build_dir: Path) -> Iterator[None]:
    """Held while a kernel is built or loaded.  torch marks a build in progress with a `lock`
    file that a process killed mid-build (a server stopped while starting) leaves behind, and
    every later build then waits for it forever.  Ours is an flock, which the OS releases when
    its holder dies: a torch lock file found while holding it belongs to no live build."""
    with open(build_dir.parent / f".{build_dir.name}.quickdraft-lock", "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = build_dir / "lock"
            if stale.exists():
                logger.warning("%s: removing a lock file left by an interrupted build", build_dir.name)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _headers_hash() -> str:
    digest = hashlib.sha256()
    for header in sorted(CSRC.glob("*.h")):
        digest.update(header.read_bytes())
    return digest.hexdigest()[:16]


class LazyKernel:
    """A kernel built on first use, once, even when several threads ask together."""

    def __init__(self, name: str, *, source: str, extra_cflags: tuple[str, ...] = (), what: str):
        self._args = dict(name=name, source=source, extra_cflags=extra_cflags, what=what)
        self._lock = threading.Lock()
        self._loaded = False
        self._module: ModuleType | None = None

    def get(self) -> ModuleType | None:
        if self._loaded:  # the common case, several times per layer: no lock once loaded
            return self._module
        with self._lock:
            if not self._loaded:
                self._module = load_kernel(**self._args)
                self._loaded = True
            return self._module
