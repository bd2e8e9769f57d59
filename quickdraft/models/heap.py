"""A process's memory after a model load: freed heap given back, loaded objects kept out of
Python's full garbage collections, weights in huge pages."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import mmap
from collections.abc import Iterator
from pathlib import Path

import torch


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


HUGE_PAGE_BYTES = 2 * 1024 * 1024
THP_ENABLED_FILE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def transparent_huge_pages() -> bool:
    """Whether this kernel backs a region marked madvise(MADV_HUGEPAGE) with 2 MB pages (Linux
    transparent huge pages in mode "always" or "madvise")."""
    try:
        mode = THP_ENABLED_FILE.read_text()
    except OSError:
        return False
    return ("[always]" in mode or "[madvise]" in mode) and hasattr(mmap, "MADV_HUGEPAGE")


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """[nbytes] uint8 of fresh anonymous memory starting on a 2 MB boundary and marked for
    transparent huge pages, so that the kernel backs it with 2 MB pages as it is first written.
    The tensor keeps its mapping alive.  Decoding streams every weight once per token: in 4 KB
    pages the embedded model's 250 MB are 61k pages, and the TLB misses of reading them cost
    ~10% of a decode step (measured; see docs/performance-log.md, "Weights in huge pages")."""
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    length = -(-max(nbytes, 1) // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    region = mmap.mmap(-1, length + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(region, dtype=torch.uint8)  # holds a reference to `region`
    start = -whole.data_ptr() % HUGE_PAGE_BYTES
    region.madvise(mmap.MADV_HUGEPAGE, start, length)
    return whole[start : start + nbytes]


def huge_page_bytes_at(address: int) -> int:
    """Bytes of the mapping holding `address` that the kernel backs with transparent huge pages
    (its `AnonHugePages` in /proc/self/smaps; 0 where that file is missing)."""
    inside = False
    try:
        with open("/proc/self/smaps") as smaps:
            for line in smaps:
                head = line.split(maxsplit=1)[0]
                if not head.endswith(":"):  # a mapping's first line: "start-end perms ..."
                    start, end = (int(x, 16) for x in head.split("-"))
                    inside = start <= address < end
                elif inside and head == "AnonHugePages:":
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
