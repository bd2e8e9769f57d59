"""The shared-memory collectives of CPU ranks: sums in rank order (the same bits on every rank,
whatever the tensor's size), gathers, buffer reuse over many calls, gloo for what does not fit,
a dead peer named instead of a hang, nothing left in /dev/shm."""

from __future__ import annotations

import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from quickdraft.distributed.group import SHARED_MEMORY_SWITCH
from quickdraft.distributed.shm import SHM_DIR, SharedMemoryCollectives, create_segment, shared_memory_supported
from tests.distributed.test_decoder import make_groups

pytestmark = pytest.mark.skipif(not shared_memory_supported(1 << 20), reason="needs x86-64 Linux with /dev/shm")


def ranks_over_one_segment(size: int, *, slot_bytes: int = 1 << 16) -> list[SharedMemoryCollectives]:
    path = create_segment(size, slot_bytes)
    try:
        return [SharedMemoryCollectives(path, rank=rank, size=size, slot_bytes=slot_bytes) for rank in range(size)]
    finally:
        os.unlink(path)


def run_ranks(ranks, call):
    """call(rank_object, rank) on every rank at once (threads: the waits yield to each other)."""
    with ThreadPoolExecutor(len(ranks)) as pool:
        return [f.result(timeout=60) for f in [pool.submit(call, r, i) for i, r in enumerate(ranks)]]


def test_sums_in_rank_order_and_gathers_over_many_calls():
    ranks = ranks_over_one_segment(3)
    generator = torch.Generator().manual_seed(0)
    inputs = [[torch.randn(rows, 40, generator=generator) for _ in range(3)] for rows in (1, 7, 3, 50, 2, 1) * 5]

    def work(shared, rank):
        sums, gathers = [], []
        for call in inputs:
            sums.append(shared.all_reduce(call[rank].clone()))
            gathers.append(shared.all_gather(call[rank] * 2))
        return sums, gathers

    results = run_ranks(ranks, work)
    for index, call in enumerate(inputs):
        expected = (call[0] + call[1]) + call[2]  # rank order, one rounding per addition
        for sums, gathers in results:
            assert torch.equal(sums[index], expected)
            assert all(torch.equal(got, x * 2) for got, x in zip(gathers[index], call))


def test_a_rows_sum_does_not_depend_on_the_other_rows():
    ranks = ranks_over_one_segment(3)
    rows = [torch.randn(64, 96, generator=torch.Generator().manual_seed(rank)) for rank in range(3)]

    def work(shared, rank):
        together = shared.all_reduce(rows[rank].clone())
        alone = [shared.all_reduce(rows[rank][i : i + 1].clone()) for i in range(0, 64, 9)]
        return together, alone

    for together, alone in run_ranks(ranks, work):
        assert all(torch.equal(together[i : i + 1], row) for i, row in zip(range(0, 64, 9), alone))


def test_a_dead_peer_is_named_not_waited_for():
    (shared,) = ranks_over_one_segment(2)[:1]
    exited = subprocess.Popen(["true"])
    exited.wait()
    shared.pids[1] = exited.pid  # rank 1 "was" that process
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=f"rank 1 \\(pid {exited.pid}\\) exited during a collective"):
        shared.all_reduce(torch.ones(4))
    assert time.monotonic() - started < 5


def test_groups_map_one_segment_and_fall_back_to_gloo(monkeypatch):
    before = set(SHM_DIR.iterdir())
    groups = make_groups(2)
    assert all(g.shared is not None for g in groups)
    assert set(SHM_DIR.iterdir()) == before  # unlinked once both ranks mapped it
    big = groups[0].shared.slot_bytes // 4 + 1  # one float more than a slot: gloo carries it
    with ThreadPoolExecutor(2) as pool:
        sums = list(pool.map(lambda g: g.all_reduce(torch.full((big,), g.rank + 1.0)), groups))
        small = list(pool.map(lambda g: g.all_reduce(torch.full((3,), g.rank + 1.0)), groups))
    assert all(torch.equal(s, torch.full((big,), 3.0)) for s in sums)
    assert all(torch.equal(s, torch.full((3,), 3.0)) for s in small)
    monkeypatch.setenv(SHARED_MEMORY_SWITCH, "0")
    assert all(g.shared is None for g in make_groups(2))
