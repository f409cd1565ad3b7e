"""MicroBatcher with a stand-in encoder whose runs finish when the test says so (no timing involved)."""

from __future__ import annotations

from typing import Any, Sequence

import anyio
import numpy as np
import pytest

from examples.minilm.batching import MicroBatcher, Overloaded

pytestmark = pytest.mark.anyio

WIDE = 3600.0  # a window no test waits out: runs go out when full (or with window 0, at once)


class FakeRun:
    """A dispatched run: awaiting it waits for release(), then gives one row per text (its first id)."""

    def __init__(self, tokens: Sequence[np.ndarray]) -> None:
        self.tokens = [int(t[0]) for t in tokens]
        self._released = anyio.Event()
        self._error: BaseException | None = None

    def release(self, error: BaseException | None = None) -> None:
        self._error = error
        self._released.set()

    def __await__(self) -> Any:
        return self._result().__await__()

    async def _result(self) -> np.ndarray:
        await self._released.wait()
        if self._error is not None:
            raise self._error
        return np.asarray(self.tokens, np.float32)[:, None]


class FakeEncoder:
    def __init__(self, max_batch: int = 4) -> None:
        self.max_batch = max_batch
        self.runs: list[FakeRun] = []

    async def dispatch(self, token_lists: Sequence[np.ndarray]) -> FakeRun:
        run = FakeRun(token_lists)
        self.runs.append(run)
        return run

    @staticmethod
    def padded_length(longest: int) -> int:
        return longest


def toks(*ids: int) -> list[np.ndarray]:
    return [np.array([i, 0], np.int32) for i in ids]


async def start(tg: Any, enc: FakeEncoder, window: float, depth: int = 2) -> MicroBatcher:
    batcher = MicroBatcher(enc, window_s=window, depth=depth)
    await tg.start(batcher.run)
    return batcher


async def test_requests_share_a_run_and_each_gets_its_own_rows():
    enc = FakeEncoder(max_batch=4)
    got: dict[str, np.ndarray] = {}
    async with anyio.create_task_group() as tg:
        batcher = await start(tg, enc, WIDE)

        async def ask(name: str, *ids: int) -> None:
            got[name] = await batcher.embed(toks(*ids))

        for name, ids in (("a", (1, 2)), ("b", (3,)), ("c", (4,))):  # the fourth text fills the run
            tg.start_soon(ask, name, *ids)
            await anyio.wait_all_tasks_blocked()  # arrivals in this order (trio starts tasks in any order)
        assert [r.tokens for r in enc.runs] == [[1, 2, 3, 4]]
        enc.runs[0].release()
        await anyio.wait_all_tasks_blocked()
        tg.cancel_scope.cancel()
    assert got["a"].ravel().tolist() == [1, 2] and got["b"].ravel().tolist() == [3] and got["c"].ravel().tolist() == [4]
    assert (batcher.stats.runs, batcher.stats.requests, batcher.stats.texts) == (1, 3, 4)


async def test_a_request_never_straddles_two_runs():
    enc = FakeEncoder(max_batch=4)
    async with anyio.create_task_group() as tg:
        batcher = await start(tg, enc, 0.0)
        for ids in ((1, 2, 3), (4, 5, 6)):
            tg.start_soon(batcher.embed, toks(*ids))
            await anyio.wait_all_tasks_blocked()
        assert [r.tokens for r in enc.runs] == [[1, 2, 3], [4, 5, 6]]
        for r in enc.runs:
            r.release()
        await anyio.wait_all_tasks_blocked()
        tg.cancel_scope.cancel()


async def test_at_most_depth_runs_in_flight_and_the_waiting_requests_go_out_together():
    enc = FakeEncoder(max_batch=8)
    async with anyio.create_task_group() as tg:
        batcher = await start(tg, enc, 0.0, depth=1)
        tg.start_soon(batcher.embed, toks(1))
        await anyio.wait_all_tasks_blocked()
        for i in (2, 3, 4):
            tg.start_soon(batcher.embed, toks(i))
            await anyio.wait_all_tasks_blocked()
        assert len(enc.runs) == 1  # the device is busy: the rest wait, and gather
        enc.runs[0].release()
        await anyio.wait_all_tasks_blocked()
        assert [r.tokens for r in enc.runs] == [[1], [2, 3, 4]]
        enc.runs[1].release()
        await anyio.wait_all_tasks_blocked()
        tg.cancel_scope.cancel()


async def test_a_failed_run_fails_its_requests_and_the_batcher_goes_on():
    enc = FakeEncoder(max_batch=2)
    outcomes: dict[int, Any] = {}
    async with anyio.create_task_group() as tg:
        batcher = await start(tg, enc, 0.0)

        async def ask(i: int) -> None:
            try:
                outcomes[i] = (await batcher.embed(toks(i))).ravel().tolist()
            except RuntimeError as e:
                outcomes[i] = str(e)

        tg.start_soon(ask, 1)
        await anyio.wait_all_tasks_blocked()
        enc.runs[0].release(RuntimeError("kernel failed"))
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(ask, 2)
        await anyio.wait_all_tasks_blocked()
        enc.runs[1].release()
        await anyio.wait_all_tasks_blocked()
        tg.cancel_scope.cancel()
    assert outcomes == {1: "kernel failed", 2: [2.0]}


async def test_a_request_whose_caller_left_is_not_dispatched():
    enc = FakeEncoder(max_batch=8)
    async with anyio.create_task_group() as tg:
        batcher = await start(tg, enc, 0.0, depth=1)
        tg.start_soon(batcher.embed, toks(1))
        await anyio.wait_all_tasks_blocked()
        with anyio.move_on_after(0):  # the caller gives up while its request waits for a slot
            await batcher.embed(toks(2))
        tg.start_soon(batcher.embed, toks(3))
        await anyio.wait_all_tasks_blocked()
        enc.runs[0].release()
        await anyio.wait_all_tasks_blocked()
        assert [r.tokens for r in enc.runs] == [[1], [3]]
        enc.runs[1].release()
        await anyio.wait_all_tasks_blocked()
        tg.cancel_scope.cancel()


async def test_requests_waiting_at_shutdown_fail_and_bad_sizes_are_refused():
    enc = FakeEncoder(max_batch=2)
    errors: list[str] = []
    async with anyio.create_task_group() as outer:
        async with anyio.create_task_group() as tg:
            batcher = await start(tg, enc, WIDE)
            with pytest.raises(ValueError, match="1 to 2 texts"):
                await batcher.embed(toks(1, 2, 3))

            async def ask() -> None:
                try:
                    await batcher.embed(toks(9))
                except RuntimeError as e:
                    errors.append(str(e))

            outer.start_soon(ask)  # outlives the batcher's task group
            await anyio.wait_all_tasks_blocked()
            tg.cancel_scope.cancel()  # the batcher stops with the request still in its window
        await anyio.wait_all_tasks_blocked()
    assert errors == ["the embedding service is shutting down"]
    with pytest.raises(RuntimeError, match="not running"):
        await batcher.embed(toks(1))


async def _queue_behind_a_busy_run(tg: Any, batcher: MicroBatcher, requests: list[tuple[int, dict[str, Any]]],
                                   outcomes: dict[int, Any]) -> None:
    """Sends request 0 (it takes the only slot), then queues the others in turn; outcomes by first id."""

    async def ask(i: int, options: dict[str, Any]) -> None:
        try:
            outcomes[i] = (await batcher.embed(toks(i), **options)).ravel().tolist()
        except Exception as e:
            outcomes[i] = e

    tg.start_soon(ask, 0, {})
    await anyio.wait_all_tasks_blocked()
    for i, options in requests:
        tg.start_soon(ask, i, options)
        await anyio.wait_all_tasks_blocked()


async def test_higher_priority_requests_go_out_first_fifo_within_a_priority():
    enc = FakeEncoder(max_batch=2)
    outcomes: dict[int, Any] = {}
    async with anyio.create_task_group() as tg:
        batcher = MicroBatcher(enc, window_s=0.0, depth=1, priority_aging=None)
        await tg.start(batcher.run)
        await _queue_behind_a_busy_run(tg, batcher, [(1, {}), (2, {"priority": 3}), (3, {"priority": -1}),
                                                     (4, {"priority": 3}), (5, {})], outcomes)
        for k in range(4):
            enc.runs[k].release()
            await anyio.wait_all_tasks_blocked()
        tg.cancel_scope.cancel()
    assert [r.tokens for r in enc.runs] == [[0], [2, 4], [1, 5], [3]]


async def test_a_request_not_dispatched_within_its_timeout_reaches_nothing():
    enc = FakeEncoder(max_batch=4)
    outcomes: dict[int, Any] = {}
    async with anyio.create_task_group() as tg:
        batcher = MicroBatcher(enc, window_s=0.0, depth=1)
        await tg.start(batcher.run)
        await _queue_behind_a_busy_run(tg, batcher, [(1, {"timeout": 0.01}), (2, {"timeout": 3600.0})], outcomes)
        with anyio.fail_after(10):
            while 1 not in outcomes:
                await anyio.sleep(0.005)
        assert batcher.queued_texts == 1 and batcher.stats.timed_out == 1
        enc.runs[0].release()
        await anyio.wait_all_tasks_blocked()
        enc.runs[1].release()
        await anyio.wait_all_tasks_blocked()
        tg.cancel_scope.cancel()
    assert isinstance(outcomes[1], TimeoutError) and "within its timeout of 0.01 s" in str(outcomes[1])
    assert [r.tokens for r in enc.runs] == [[0], [2]]  # the timed-out request never reached the engine
    assert outcomes[2] == [2.0]


async def test_a_full_queue_refuses_at_once_with_a_retry_hint():
    enc = FakeEncoder(max_batch=2)
    outcomes: dict[int, Any] = {}
    async with anyio.create_task_group() as tg:
        batcher = MicroBatcher(enc, window_s=0.0, depth=1, max_queued=3)
        await tg.start(batcher.run)
        await _queue_behind_a_busy_run(tg, batcher, [(1, {}), (2, {}), (3, {})], outcomes)
        assert batcher.queued_texts == 3
        with pytest.raises(Overloaded, match="3 texts are waiting; the queue takes at most 3") as refused:
            await batcher.embed(toks(4))
        assert refused.value.retry_after >= 1 and batcher.stats.rejected == 1
        for k in range(3):
            enc.runs[k].release()
            await anyio.wait_all_tasks_blocked()
        assert batcher.queued_texts == 0
        tg.start_soon(batcher.embed, toks(5))  # room again
        await anyio.wait_all_tasks_blocked()
        enc.runs[3].release()
        await anyio.wait_all_tasks_blocked()
        tg.cancel_scope.cancel()
    assert [r.tokens for r in enc.runs] == [[0], [1, 2], [3], [5]]
    assert all(outcomes[i] == [float(i)] for i in range(4))
    with pytest.raises(ValueError, match="max_queued must be at least max_batch"):
        MicroBatcher(enc, max_queued=1)
