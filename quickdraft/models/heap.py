"""A process's memory after a model load: freed heap given back, loaded objects kept out of
Python's full garbage collections."""

from __future__ import annotations

import contextlib
import ctypes
import gc
from collections.abc import Iterator


def return_free_heap() -> None:
    """Give a load's freed temporaries back to the OS: glibc keeps freed heap pages resident
    (~70 MB of the embedded model's weight load; ~190 MB of parsing its 262k-token
    tokenizer.json, whose merges the Rust parser builds as strings first)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def freeze_loaded_objects() -> None:
    """Exempt what the process holds once its engine is loaded (torch's and the tokenizer's modules,
    the engine: ~220k objects) from Python's full garbage collections: each scanned them all, a
    pause of ~105 ms for every request in flight (measured: one per ~1,000 decoded tokens at batch
    1).  For processes whose engine lives as long as they do (servers), as vLLM does after start."""
    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def loaded_objects_frozen() -> Iterator[None]:
    """freeze_loaded_objects for a stretch of work (a benchmark's runs on one engine), unfrozen
    after so that the engine can be freed."""
    freeze_loaded_objects()
    try:
        yield
    finally:
        gc.unfreeze()
