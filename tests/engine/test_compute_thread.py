"""ComputeThread: one thread that runs an engine's work in order (engine/compute_thread.py)."""

from __future__ import annotations

import threading

import pytest
import torch

from quickdraft.engine.compute_thread import ComputeThread


def test_callables_run_in_order_on_its_one_thread():
    compute = ComputeThread(name="test-compute")
    seen = []
    futures = [compute.submit(lambda i=i: seen.append((i, threading.current_thread()))) for i in range(5)]
    for future in futures:
        future.result(timeout=10)
    assert [i for i, _ in seen] == list(range(5))
    assert {thread for _, thread in seen} == {compute.thread}
    assert compute.run(lambda: compute.run(lambda: 7)) == 7  # a nested run does not wait on itself
    compute.close()
    compute.thread.join(timeout=10)
    assert not compute.thread.is_alive()


def test_an_exception_reaches_the_caller_and_the_thread_goes_on():
    compute = ComputeThread()
    with pytest.raises(ValueError, match="bad input"):
        compute.run(lambda: (_ for _ in ()).throw(ValueError("bad input")))
    assert compute.run(lambda: 3) == 3
    compute.close()


def test_it_keeps_the_torch_thread_count_of_its_creator():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        compute = ComputeThread()
        assert compute.run(torch.get_num_threads) == 1
        compute.close()
    finally:
        torch.set_num_threads(before)
