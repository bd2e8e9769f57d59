"""One thread for an engine's compute, whichever threads drive it.

OpenMP (torch's CPU parallelism, and our kernels' ``at::parallel_for``) keeps a pool of worker
threads for every thread that starts parallel regions. Once the pools hold more threads than
there are cores, libgomp stops spinning between regions (a spin count of 100, whatever
``GOMP_SPINCOUNT`` says) and wakes its workers through a futex for every region; a forward has
a few hundred. So an engine loaded in the main thread and stepped in a server's loop thread ran
a decode forward in 18-19 ms instead of 12 (2-core machine, embedded Gemma 3 270M): the server
decoded 1.6x slower than ``LLM.generate``. Loading the engine and running every step (and
switching its drafter) on one ComputeThread keeps a single pool, as in a one-thread program.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import torch

T = TypeVar("T")


class ComputeThread:
    """A daemon thread that runs the callables given to it, one after another, with the torch
    thread count of the thread that created it."""

    def __init__(self, *, name: str = "quickdraft-compute"):
        self._num_threads = torch.get_num_threads()
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self.thread.start()

    def submit(self, function: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        future: Future[T] = Future()
        self._tasks.put((future, function, args, kwargs))
        return future

    def run(self, function: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """function(*args, **kwargs) on this thread; its result, or its exception raised here."""
        if threading.current_thread() is self.thread:
            return function(*args, **kwargs)
        return self.submit(function, *args, **kwargs).result()

    def close(self) -> None:
        """The thread ends once the callables given before have run."""
        self._tasks.put(None)

    def _serve(self) -> None:
        torch.set_num_threads(self._num_threads)
        while (task := self._tasks.get()) is not None:
            future, function, args, kwargs = task
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(function(*args, **kwargs))
            except BaseException as err:  # handed to whoever waits on the future
                future.set_exception(err)
