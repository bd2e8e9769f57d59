"""Giving freed heap back to the OS after a load."""

from __future__ import annotations

import ctypes


def return_free_heap() -> None:
    """Give a load's freed temporaries back to the OS: glibc keeps freed heap pages resident
    (~70 MB of the embedded model's weight load; ~190 MB of parsing its 262k-token
    tokenizer.json, whose merges the Rust parser builds as strings first)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
