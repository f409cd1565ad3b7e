"""MicroBatcher's run-forming policy at depth 2: holding a partial run while runs are in flight, and cutting the
waiting requests into runs by length (benchmarks/README.md, the service benchmark, measures why)."""

from __future__ import annotations

from typing import Any

import anyio
import numpy as np
import pytest

from examples.minilm.batching import MicroBatcher
from tests.models.test_minilm_batching import FakeEncoder, start

pytestmark = pytest.mark.anyio


def text(first_id: int, length: int) -> np.ndarray:
    """One tokenized text of `length` tokens whose first id names it (FakeRun's rows are first ids)."""
    return np.array([first_id] + [0] * (length - 1), np.int32)


async def ask(tg: Any, batcher: MicroBatcher, *texts: np.ndarray) -> None:
    tg.start_soon(batcher.embed, list(texts))
    await anyio.wait_all_tasks_blocked()


async def finish(enc: FakeEncoder, k: int) -> None:
    enc.runs[k].release()
    await anyio.wait_all_tasks_blocked()


async def test_waiting_requests_are_cut_into_runs_by_length_when_slots_are_free():
    enc = FakeEncoder(max_batch=8)
    async with anyio.create_task_group() as tg:
        batcher = await start(tg, enc, 3600.0)
        # Eight texts fill a run's worth: the window ends, both slots are free.
        for i, length in ((1, 200), (2, 8), (3, 190), (4, 6), (5, 7), (6, 180), (7, 9), (8, 5)):
            await ask(tg, batcher, text(i, length))
        # One run would pad all eight to 200 tokens; two cost less: the long ones and the short ones, each in
        # rank order, the run holding the first request first.
        assert [r.tokens for r in enc.runs] == [[1, 3, 6], [2, 4, 5, 7, 8]]
        for k in range(2):
            await finish(enc, k)
        tg.cancel_scope.cancel()
    assert (batcher.stats.runs, batcher.stats.texts) == (2, 8)
    assert batcher.stats.tokens == 605 and batcher.stats.padded_tokens == 3 * 200 + 5 * 9


async def test_texts_of_one_length_stay_in_one_run():
    enc = FakeEncoder(max_batch=4)
    async with anyio.create_task_group() as tg:
        batcher = await start(tg, enc, 3600.0)
        for i in range(1, 5):
            await ask(tg, batcher, text(i, 12))
        assert [r.tokens for r in enc.runs] == [[1, 2, 3, 4]]  # a second run would only add its fixed cost
        await finish(enc, 0)
        tg.cancel_scope.cancel()


async def start_learned(tg: Any, enc: FakeEncoder, seconds: float) -> MicroBatcher:
    """A batcher (no window, depth 2) that has run one 10-token text taking `seconds`: its estimate of what a
    run costs."""
    batcher = await start(tg, enc, 0.0)
    await ask(tg, batcher, text(1, 10))
    await anyio.sleep(seconds)
    await finish(enc, 0)
    return batcher


async def test_a_partial_run_is_held_while_another_is_in_flight():
    enc = FakeEncoder(max_batch=8)
    async with anyio.create_task_group() as tg:
        batcher = await start_learned(tg, enc, 0.5)  # long enough for the steps below to fit in a hold
        await ask(tg, batcher, text(2, 10))  # the device is idle: out at once
        assert [r.tokens for r in enc.runs] == [[1], [2]]
        for i in (3, 4, 5):  # a slot is free, but a run is in flight and these would not fill one
            await ask(tg, batcher, text(i, 10))
        assert len(enc.runs) == 2
        await finish(enc, 1)  # the run in flight is done: what waited goes out together
        assert [r.tokens for r in enc.runs[2:]] == [[3, 4, 5]]
        await finish(enc, 2)
        tg.cancel_scope.cancel()


async def test_a_held_run_goes_once_the_run_in_flight_is_overdue():
    enc = FakeEncoder(max_batch=8)
    async with anyio.create_task_group() as tg:
        batcher = await start_learned(tg, enc, 0.3)
        await ask(tg, batcher, text(2, 10))  # in flight, and it never finishes
        await ask(tg, batcher, text(3, 10))
        assert len(enc.runs) == 2  # held ...
        with anyio.fail_after(5):  # ... for at most 1.5 times what a run like it took: not for ever
            while len(enc.runs) < 3:
                await anyio.sleep(0.005)
        assert enc.runs[2].tokens == [3]
        for k in (1, 2):
            await finish(enc, k)
        tg.cancel_scope.cancel()


async def test_with_one_slot_free_the_first_requests_length_group_goes_and_the_rest_waits_its_turn():
    enc = FakeEncoder(max_batch=4)
    async with anyio.create_task_group() as tg:
        batcher = await start_learned(tg, enc, 0.5)
        await ask(tg, batcher, text(2, 10))  # the device is idle: out at once, into one slot
        for i, length in ((3, 6), (4, 200), (5, 7), (6, 190)):  # held until they fill a run
            await ask(tg, batcher, text(i, length))
        # A full run cannot grow, so it goes; by length the candidates are [3, 5] and [4, 6], and the group
        # of the first request takes the free slot. The long ones stay first in line.
        assert [r.tokens for r in enc.runs[2:]] == [[3, 5]]
        await ask(tg, batcher, text(7, 5))
        await finish(enc, 1)
        assert len(enc.runs) == 3  # a slot is free again, but [3, 5] is in flight and three texts wait: held
        await finish(enc, 2)  # both slots free: the long ones, then the short one behind them
        assert [r.tokens for r in enc.runs[3:]] == [[4, 6], [7]]
        for k in (3, 4):
            await finish(enc, k)
        tg.cancel_scope.cancel()


async def test_priorities_still_choose_which_group_goes_first():
    enc = FakeEncoder(max_batch=4)
    async with anyio.create_task_group() as tg:
        batcher = MicroBatcher(enc, window_s=3600.0, depth=2, priority_aging=None)
        await tg.start(batcher.run)
        tg.start_soon(lambda: batcher.embed([text(1, 6)]))
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(lambda: batcher.embed([text(2, 6)]))
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(lambda: batcher.embed([text(3, 200)], priority=1))
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(lambda: batcher.embed([text(4, 190)], priority=1))
        await anyio.wait_all_tasks_blocked()
        assert [r.tokens for r in enc.runs] == [[3, 4], [1, 2]]  # the higher priority's run is dispatched first
        for k in range(2):
            await finish(enc, k)
        tg.cancel_scope.cancel()
