"""Micro-batching: concurrent requests share engine runs.

Each request hands over its tokenized texts and awaits its own rows. One
batcher task gathers requests into runs of at most `max_batch` texts: it keeps
at most `depth` runs in flight (so while the device is busy, requests pile up
and the next run goes out full), and once a slot is free it waits at most
`window_s` after the oldest waiting request before dispatching what it has.
A request never straddles two runs.

Which requests go first: the one of lowest rank, rank = arrival time -
priority * priority_aging (ties in arrival order), the rule of the
scheduler's admission queue (scheduler._admission): a priority step is worth
priority_aging seconds of waiting, so a low priority waits at most that long
per step behind later, higher ones. priority_aging=None: strict priorities.

Protecting latency: with max_queued set, a request that would take the
texts waiting past it is refused at once (Overloaded, with a Retry-After
estimate from the recent throughput) instead of waiting without bound; a
request with a timeout that is not dispatched in time raises TimeoutError, and
nothing of it reached the engine.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import anyio
import anyio.abc
import numpy as np

__all__ = ["BatchStats", "MicroBatcher", "Overloaded"]

# Retry-After bounds, in seconds: HTTP's header takes whole seconds; past a minute a client should rather give up.
_MIN_RETRY_S = 1
_MAX_RETRY_S = 60
_RATE_HALF_LIFE_RUNS = 8  # the throughput estimate behind Retry-After forgets old runs at this pace


class Overloaded(Exception):
    """The batcher's queue is full: the request was refused without waiting. retry_after: seconds to wait."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class _Encoder(Protocol):
    max_batch: int

    async def dispatch(self, token_lists: Sequence[np.ndarray]) -> Any: ...


@dataclass
class BatchStats:
    runs: int = 0
    texts: int = 0  # texts dispatched
    requests: int = 0  # requests dispatched
    rejected: int = 0  # requests refused with Overloaded
    timed_out: int = 0  # requests not dispatched within their timeout


class _Request:
    __slots__ = ("tokens", "arrived", "taken", "done", "result", "error", "abandoned")

    def __init__(self, tokens: Sequence[np.ndarray], arrived: float) -> None:
        self.tokens = tokens
        self.arrived = arrived
        self.taken = anyio.Event()  # put into a run: its timeout no longer applies
        self.done = anyio.Event()
        self.result: np.ndarray | None = None
        self.error: BaseException | None = None
        self.abandoned = False  # the caller went away before it was taken: skip it


class MicroBatcher:
    """Gathers concurrent embed() calls into engine runs. Start run() in a task group first.

    max_queued: most texts waiting to be dispatched (None: no bound).
    priority_aging: seconds of waiting one priority step is worth (None: strict).
    """

    def __init__(self, encoder: _Encoder, *, window_s: float = 0.002, depth: int = 2,
                 max_queued: int | None = None, priority_aging: float | None = 1.0) -> None:
        if window_s < 0:
            raise ValueError(f"window_s must be >= 0, got {window_s}")
        if depth < 1:
            raise ValueError(f"depth must be positive, got {depth}")
        if max_queued is not None and max_queued < encoder.max_batch:
            raise ValueError(f"max_queued must be at least max_batch ({encoder.max_batch}) so that any request "
                             f"can be queued, got {max_queued}")
        if priority_aging is not None and not 0 < priority_aging < math.inf:
            raise ValueError(f"priority_aging must be a positive number of seconds or None, got {priority_aging}")
        self._encoder = encoder
        self._window = window_s
        self._max = encoder.max_batch
        self._max_queued = max_queued
        self._aging = priority_aging
        self._slots = anyio.Semaphore(depth)
        self._heap: list[tuple[float, int, _Request]] = []  # (rank, arrival number, request); lazily pruned
        self._numbers = itertools.count()
        self._queued_texts = 0  # texts of the live (not abandoned) requests waiting
        self._queued_requests = 0
        self._arrived = anyio.Event()
        self._running = False
        self._texts_per_s: float | None = None  # delivered texts per second, smoothed
        self._last_delivery: float | None = None
        self.stats = BatchStats()

    @property
    def queued_texts(self) -> int:
        """Texts waiting to be dispatched."""
        return self._queued_texts

    @property
    def queued_requests(self) -> int:
        """Requests waiting to be dispatched."""
        return self._queued_requests

    @property
    def running(self) -> bool:
        return self._running

    async def embed(self, tokens: Sequence[np.ndarray], *, priority: int = 0,
                    timeout: float | None = None) -> np.ndarray:
        """Embeddings [len(tokens), dim] for one request's tokenized texts (1 to max_batch of them).

        Higher priority is dispatched first (aged: see the module docstring).
        timeout: seconds to wait for dispatch; past it TimeoutError, and
        nothing of the request reached the engine. Overloaded when the queue
        is full.
        """
        if not 1 <= len(tokens) <= self._max:
            raise ValueError(f"a request takes 1 to {self._max} texts, got {len(tokens)}")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise TypeError(f"priority must be an int, got {type(priority).__name__}")
        if timeout is not None and not 0 <= timeout < math.inf:
            raise ValueError(f"timeout must be None or a finite number of seconds >= 0, got {timeout}")
        if not self._running:
            raise RuntimeError("the batcher is not running")
        if self._max_queued is not None and self._queued_texts + len(tokens) > self._max_queued:
            self.stats.rejected += 1
            raise Overloaded(f"{self._queued_texts} texts are waiting; the queue takes at most {self._max_queued}",
                             self._retry_after())
        now = anyio.current_time()
        req = _Request(tokens, now)
        rank = -float(priority) if self._aging is None else now - priority * self._aging
        heapq.heappush(self._heap, (rank, next(self._numbers), req))
        self._queued_texts += len(tokens)
        self._queued_requests += 1
        self._arrived.set()
        try:
            if timeout is not None:
                with anyio.move_on_after(timeout):
                    await req.taken.wait()
                if not req.taken.is_set():
                    self._abandon(req)
                    self.stats.timed_out += 1
                    raise TimeoutError(f"the request was not dispatched within its timeout of {timeout} s "
                                       f"({self._queued_texts} texts waiting)")
            await req.done.wait()
        finally:
            if not req.taken.is_set():
                self._abandon(req)
        if req.error is not None:
            raise req.error
        assert req.result is not None
        return req.result

    def _abandon(self, req: _Request) -> None:
        if not req.abandoned:
            req.abandoned = True
            self._queued_texts -= len(req.tokens)
            self._queued_requests -= 1

    def _retry_after(self) -> int:
        """Seconds until the queue has likely drained to half, from the recent throughput."""
        if not self._texts_per_s:
            return _MIN_RETRY_S
        return max(_MIN_RETRY_S, min(_MAX_RETRY_S, math.ceil(self._queued_texts / 2 / self._texts_per_s)))

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """The batching loop; runs until cancelled. Requests still waiting then fail."""
        self._running = True
        try:
            async with anyio.create_task_group() as tg:
                task_status.started()
                while True:
                    await self._slots.acquire()
                    batch = await self._next_batch()
                    if not batch:
                        self._slots.release()
                        continue
                    tokens = [t for r in batch for t in r.tokens]
                    try:
                        fut = await self._encoder.dispatch(tokens)
                    except Exception as e:  # e.g. the runtime closed: these requests fail, later ones may not
                        self._slots.release()
                        _settle(batch, error=e)
                        continue
                    self.stats.runs += 1
                    self.stats.texts += len(tokens)
                    self.stats.requests += len(batch)
                    tg.start_soon(self._deliver, fut, batch)
        finally:
            self._running = False
            waiting = [r for _, _, r in self._heap if not r.abandoned]
            for r in waiting:
                r.abandoned = True  # counted out here, not again by its embed()
            self._heap.clear()
            self._queued_texts = self._queued_requests = 0
            _settle(waiting, error=RuntimeError("the embedding service is shutting down"))

    def _prune(self) -> None:
        while self._heap and self._heap[0][2].abandoned:
            heapq.heappop(self._heap)

    async def _next_batch(self) -> list[_Request]:
        while True:
            self._prune()
            if self._heap:
                break
            self._arrived = anyio.Event()
            await self._arrived.wait()
        # The window runs from the oldest waiting request, whatever its rank.
        deadline = min(r.arrived for _, _, r in self._heap if not r.abandoned) + self._window
        while self._queued_texts < self._max:
            remaining = deadline - anyio.current_time()
            if remaining <= 0:
                break
            self._arrived = anyio.Event()
            with anyio.move_on_after(remaining):
                await self._arrived.wait()
        batch: list[_Request] = []
        n = 0
        while True:
            self._prune()
            if not self._heap or n + len(self._heap[0][2].tokens) > self._max:
                break  # in rank order: a request that does not fit is not overtaken by smaller ones behind it
            req = heapq.heappop(self._heap)[2]
            self._queued_texts -= len(req.tokens)
            self._queued_requests -= 1
            req.taken.set()
            batch.append(req)
            n += len(req.tokens)
        return batch

    async def _deliver(self, fut: Any, batch: list[_Request]) -> None:
        try:
            out = await fut
        except Exception as e:  # the run failed: its requests fail, the service goes on
            _settle(batch, error=e)
            return
        except BaseException:  # cancelled: the service is shutting down
            _settle(batch, error=RuntimeError("the embedding service is shutting down"))
            raise
        finally:
            self._slots.release()
        self._note_delivery(len(out))
        offset = 0
        for req in batch:
            req.result = out[offset:offset + len(req.tokens)]
            offset += len(req.tokens)
            req.done.set()

    def _note_delivery(self, texts: int) -> None:
        now = anyio.current_time()
        if self._last_delivery is not None and now > self._last_delivery:
            rate = texts / (now - self._last_delivery)
            keep = 0.5 ** (1 / _RATE_HALF_LIFE_RUNS)
            self._texts_per_s = rate if self._texts_per_s is None else keep * self._texts_per_s + (1 - keep) * rate
        self._last_delivery = now


def _settle(batch: list[_Request], *, error: BaseException) -> None:
    for req in batch:
        if not req.done.is_set():
            req.error = error
            req.done.set()
