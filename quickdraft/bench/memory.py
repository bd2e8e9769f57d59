"""Peak memory of a stretch of work: process RSS sampled by a thread, or CUDA's own counter."""

from __future__ import annotations

import os
import resource
import sys
import threading


def current_rss_bytes() -> int:
    """Resident set size of this process now (Linux /proc; peak RSS elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


class PeakMemory:
    """`with PeakMemory(device) as watch: ...` then `watch.peak_bytes`.

    On CPU a thread samples RSS every `interval` seconds (a read of /proc, negligible next to a
    decode step); on CUDA the allocator's peak counter is reset and read.
    """

    def __init__(self, device: str = "cpu", *, interval: float = 0.01):
        self.cuda = str(device).startswith("cuda")
        self.interval = interval
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PeakMemory:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            self.peak_bytes = current_rss_bytes()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak_bytes = max(self.peak_bytes, current_rss_bytes())

    def __exit__(self, *exc) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            self.peak_bytes = torch.cuda.max_memory_allocated()
        else:
            self._stop.set()
            self._thread.join()
            self.peak_bytes = max(self.peak_bytes, current_rss_bytes())
