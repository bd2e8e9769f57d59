"""The engine loop without HTTP: admission, rejection, abort, stop."""

from __future__ import annotations

import queue
import threading
import time

import pytest

from quickdraft.config import EngineConfig
from quickdraft.engine.engine import Engine
from quickdraft.sampling_params import SamplingParams
from quickdraft.server.engine_loop import Admitted, EngineLoop, Failed, LoopStopped, Progress, Rejected, Submission
from quickdraft.server.metrics import ServerMetrics

TIMEOUT = 20.0


@pytest.fixture
def loop(tiny_checkpoints):
    engine = Engine(EngineConfig(model=str(tiny_checkpoints["llama"]), max_model_len=64, max_num_seqs=2))
    engine_loop = EngineLoop(engine=engine, metrics=ServerMetrics(model="m", method="none"))
    engine_loop.start()
    yield engine_loop
    engine_loop.stop(timeout=TIMEOUT)


def submit(loop, request_id, *, prompt_token_ids=(5, 6, 7), **params) -> queue.Queue:
    events: queue.Queue = queue.Queue()
    loop.submit(
        Submission(
            request_id=request_id,
            prompts=[list(prompt_token_ids)],
            params=SamplingParams(temperature=0, **params),
            scenario="default",
            submitted_at=0.0,
            deliver=events.put,
        )
    )
    return events


def drain_until_finished(events: queue.Queue) -> list:
    received = [events.get(timeout=TIMEOUT)]
    while not (isinstance(received[-1], Progress) and received[-1].finished) and not isinstance(
        received[-1], (Rejected, Failed)
    ):
        received.append(events.get(timeout=TIMEOUT))
    return received


def slow_down(engine) -> None:
    forward = engine.runner.forward

    def slow_forward(*args, **kwargs):
        time.sleep(0.05)
        return forward(*args, **kwargs)

    engine.runner.forward = slow_forward


def test_requests_are_admitted_streamed_and_released(loop):
    streams = [submit(loop, f"r{i}", max_tokens=6) for i in range(4)]  # 4 requests, 2 slots
    for events in streams:
        received = drain_until_finished(events)
        assert isinstance(received[0], Admitted)
        tokens = [t for event in received[1:] for t in event.token_ids]
        assert tokens == received[-1].output.outputs[0].token_ids and len(tokens) == 6
    assert loop.call(lambda engine: (len(engine._requests), engine.cache.num_free_slots)).result(TIMEOUT) == (0, 2)


def test_a_bad_prompt_is_rejected_alone(loop):
    bad = submit(loop, "bad", prompt_token_ids=[1, 10**9])
    good = submit(loop, "good", max_tokens=3)
    assert isinstance(bad.get(timeout=TIMEOUT), Rejected)
    assert drain_until_finished(good)[-1].finish_reason == "length"


def test_abort_frees_the_slot_and_stop_fails_the_rest(loop):
    first = submit(loop, "long", max_tokens=50, ignore_eos=True)
    assert isinstance(first.get(timeout=TIMEOUT), Admitted)
    loop.abort("long")
    assert loop.call(lambda engine: engine.cache.num_free_slots).result(TIMEOUT) == 2
    loop.call(slow_down).result(TIMEOUT)  # so "cut" is surely still running when the loop stops
    waiting = submit(loop, "cut", max_tokens=50, ignore_eos=True)
    assert isinstance(waiting.get(timeout=TIMEOUT), Admitted)
    loop.stop(timeout=TIMEOUT)
    assert not loop.is_alive
    events = []
    while not waiting.empty():
        events.append(waiting.get())
    assert events and isinstance(events[-1], Failed) and events[-1].status == 503
    with pytest.raises(LoopStopped):
        submit(loop, "late")


def test_a_server_loads_and_steps_its_engine_on_one_thread(tiny_checkpoints):
    """OpenMP keeps a worker pool per thread that starts parallel regions: an engine loaded on
    one thread and stepped on another decoded 1.6x slower (engine/compute_thread.py)."""
    from quickdraft.server import QuickdraftServer
    from tests.server.conftest import tiny_server_config

    loaded_on = []
    original = Engine.__init__

    def spy(self, *args, **kwargs):
        loaded_on.append(threading.current_thread())
        original(self, *args, **kwargs)

    Engine.__init__ = spy
    try:
        server = QuickdraftServer(tiny_server_config(tiny_checkpoints["llama"]))
    finally:
        Engine.__init__ = original
    server.engine_loop.start()
    try:
        stepped_on = server.engine_loop.call(lambda engine: threading.current_thread()).result(timeout=TIMEOUT)
        assert loaded_on == [stepped_on] and stepped_on is not threading.current_thread()
    finally:
        server.engine_loop.stop(timeout=TIMEOUT)
    assert not server.engine_loop.is_alive


def drain_completions(events: queue.Queue, n: int) -> list:
    """Events until n completions have finished (or a rejection or failure)."""
    received, finished = [], set()
    while len(finished) < n:
        event = events.get(timeout=TIMEOUT)
        received.append(event)
        if isinstance(event, (Rejected, Failed)):
            break
        if isinstance(event, Progress) and event.finished:
            finished.add(event.index)
    return received


def test_n_completions_run_as_children_and_stream_by_index(loop):
    events = submit(loop, "many", max_tokens=5, n=3, seed=4)  # 3 children, 2 slots
    received = drain_completions(events, 3)
    assert isinstance(received[0], Admitted)
    progress = [event for event in received if isinstance(event, Progress)]
    assert sorted(event.index for event in progress if event.finished) == [0, 1, 2]
    for index in range(3):
        tokens = [t for event in progress if event.index == index for t in event.token_ids]
        final = next(event for event in progress if event.index == index and event.finished)
        assert tokens == final.output.outputs[0].token_ids and len(tokens) == 5
        assert final.output.seed == 4 + index
    assert loop.call(lambda engine: (len(engine._requests), engine.cache.num_free_slots)).result(TIMEOUT) == (0, 2)
    assert loop.stats.tracked_requests == 0


def test_aborting_a_request_aborts_every_completion(loop):
    loop.call(slow_down).result(TIMEOUT)
    events = submit(loop, "many", max_tokens=50, ignore_eos=True, n=3, seed=1)
    assert isinstance(events.get(timeout=TIMEOUT), Admitted)
    loop.abort("many")
    assert loop.call(lambda engine: (len(engine._requests), engine.cache.num_free_slots)).result(TIMEOUT) == (0, 2)


def test_a_bad_request_of_n_is_rejected_with_no_child_left(loop):
    bad = submit(loop, "bad", prompt_token_ids=[1, 10**9], n=3)
    assert isinstance(bad.get(timeout=TIMEOUT), Rejected)
    assert loop.call(lambda engine: len(engine._requests)).result(TIMEOUT) == 0


def test_a_call_waiting_for_the_cache_runs_when_a_slot_frees(loop):
    """embed() with every slot generating waits (wait_for_cache): it runs after the steps that free
    a slot, or after an abort does; without waiting it fails at once; a stop ends it clearly."""
    from quickdraft.kv.cache import CacheFullError
    from quickdraft.pooling import PoolingParams

    def embed(engine):
        return engine.embed([[5, 6, 7, 8]], PoolingParams())

    expected = loop.call(embed).result(TIMEOUT)[0]
    loop.call(slow_down).result(TIMEOUT)
    for name in ("a", "b"):
        assert isinstance(submit(loop, name, max_tokens=40, ignore_eos=True).get(timeout=TIMEOUT), Admitted)
    with pytest.raises(CacheFullError):
        loop.call(embed).result(TIMEOUT)
    waiting = loop.call(embed, wait_for_cache=True)
    time.sleep(0.2)
    assert not waiting.done()  # both slots still generate
    loop.abort("a")
    assert waiting.result(TIMEOUT)[0].equal(expected)
    # the slot "a" left: every slot generates again
    assert isinstance(submit(loop, "c", max_tokens=40, ignore_eos=True).get(timeout=TIMEOUT), Admitted)
    stopped = loop.call(embed, wait_for_cache=True)
    time.sleep(0.2)
    assert not stopped.done()
    loop.stop(timeout=TIMEOUT)
    with pytest.raises(LoopStopped):
        stopped.result(TIMEOUT)
