"""Micro-batching: concurrent requests share engine runs.

Each request hands over its tokenized texts and awaits its own rows. One
batcher task gathers requests into runs of at most `max_batch` texts: it keeps
at most `depth` runs in flight (so while the device is busy, requests pile up
and the next run goes out full), and once a slot is free it waits at most
`window_s` after the oldest waiting request before dispatching what it has.
A request never straddles two runs.

While runs are in flight, a run that would not be full is held back: the
device is busy anyway, so dispatching the few requests waiting now would only
cut the queue into more, smaller runs (each paying a run's fixed cost) without
finishing anything sooner. The hold lasts until the runs in flight are done
(or the waiting texts fill a run), bounded by their expected end: the batcher
measures the device's time per padded token on the runs it sees complete, and
stops holding once the runs in flight are well past the time they should have
taken (before the first run completes there is no estimate and no hold).
With several slots free at once, the waiting requests (the same ones, in
rank order, as without) are cut into up to that many runs by length: a run is
padded to its longest text, so short texts in a run with a long one cost as
much as long ones; grouping requests of similar length saves the padding, and
the cut is chosen to minimise padded tokens plus a fixed cost per run
(benchmarks/README.md, the service benchmark, has the measurements).

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
# A run's fixed cost (orchestration or replay, launching, the per-task overheads of a small run), in padded
# tokens: MiniLM on 2 workers runs about 0.12 ms per padded token and a run of a few tokens takes about 8 ms.
_RUN_COST_TOKENS = 64
# Attention's share of a token's cost grows with the sequence: per token, the matmuls take 2 * 384 * (4 * 384 +
# 2 * 1536) multiply-adds in MiniLM and the attention products 4 * 384 * S, i.e. S / 2300 of them.
_ATTENTION_TOKENS = 2300
_HOLD_SLACK = 1.5  # a held run waits at most this many times the expected remaining time of the runs in flight


class Overloaded(Exception):
    """The batcher's queue is full: the request was refused without waiting. retry_after: seconds to wait."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class _Encoder(Protocol):
    max_batch: int

    def padded_length(self, longest: int) -> int: ...

    async def dispatch(self, token_lists: Sequence[np.ndarray]) -> Any: ...


@dataclass
class BatchStats:
    runs: int = 0
    texts: int = 0  # texts dispatched
    requests: int = 0  # requests dispatched
    rejected: int = 0  # requests refused with Overloaded
    timed_out: int = 0  # requests not dispatched within their timeout
    tokens: int = 0  # tokens dispatched
    padded_tokens: int = 0  # tokens the runs computed: texts times their run's padded length


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
        self._depth = depth
        self._in_flight: dict[int, float] = {}  # runs dispatched and not done: their cost (see _cost)
        self._run_numbers = itertools.count()
        # The device's time per unit of cost, measured on completed runs (None until one completes): sums of
        # the time each completed run was served (from its dispatch or the previous completion, the later)
        # and of its cost, both decayed like the throughput estimate.
        self._served_s = 0.0
        self._served_cost = 0.0
        self._busy_since = 0.0  # when the runs in flight started being served
        self._last_done = -math.inf
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
                    for batch in await self._next_batches():
                        tokens = [t for r in batch for t in r.tokens]
                        try:
                            fut = await self._encoder.dispatch(tokens)
                        except Exception as e:  # e.g. the runtime closed: these requests fail, later ones may not
                            _settle(batch, error=e)
                            continue
                        number = next(self._run_numbers)
                        if not self._in_flight:
                            self._busy_since = anyio.current_time()
                        self._in_flight[number] = _cost(batch)
                        self.stats.runs += 1
                        self.stats.texts += len(tokens)
                        self.stats.requests += len(batch)
                        self.stats.tokens += sum(len(t) for t in tokens)
                        self.stats.padded_tokens += len(tokens) * self._encoder.padded_length(
                            max(len(t) for t in tokens))
                        tg.start_soon(self._deliver, fut, batch, number)
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

    async def _wait(self, timeout: float = math.inf) -> None:
        """Until a request arrives or a run completes (or `timeout` seconds pass)."""
        self._arrived = anyio.Event()
        with anyio.move_on_after(timeout):
            await self._arrived.wait()

    async def _next_batches(self) -> list[list[_Request]]:
        """The next runs to dispatch, at least one: once a slot is free and requests wait (see the module doc)."""
        while True:
            while len(self._in_flight) >= self._depth or not self._waiting():
                await self._wait()
            # The window runs from the oldest waiting request, whatever its rank.
            deadline = min(r.arrived for _, _, r in self._heap if not r.abandoned) + self._window
            while self._queued_texts < self._max and len(self._in_flight) < self._depth:
                remaining = deadline - anyio.current_time()
                if remaining <= 0:
                    break
                await self._wait(remaining)
            while self._in_flight and self._queued_texts < self._max:  # hold a run that would not be full
                remaining = self._hold_until() - anyio.current_time()
                if remaining <= 0:
                    break
                await self._wait(remaining)
            free = self._depth - len(self._in_flight)
            if free > 0 and self._waiting():
                return self._take(free)

    def _waiting(self) -> bool:
        self._prune()
        return bool(self._heap)

    def _hold_until(self) -> float:
        """When a held run stops waiting for the runs in flight: _HOLD_SLACK times their expected remaining
        time from now on, the expectation from the measured time per cost; -inf with nothing measured yet."""
        if self._served_cost <= 0:
            return -math.inf
        expected_end = self._busy_since + self._served_s / self._served_cost * sum(self._in_flight.values())
        now = anyio.current_time()
        return now + _HOLD_SLACK * max(0.0, expected_end - now)

    def _take(self, free: int) -> list[list[_Request]]:
        """Up to `free` runs of the waiting requests. The candidates are the requests that `depth` runs would
        take in rank order (each run takes the next requests while they fit; a request that does not fit is
        not overtaken by smaller ones behind it); they are cut into runs by length (_by_length), and the
        `free` runs holding the best ranks go out. The others stay queued, ahead of later arrivals of their
        rank: a request is passed only by requests less than `depth` runs behind it."""
        entries: list[tuple[float, int, _Request]] = []
        batches: list[list[_Request]] = [[]]
        n = 0
        while True:
            self._prune()
            if not self._heap:
                break
            size = len(self._heap[0][2].tokens)
            if n + size > self._max:
                if len(batches) == self._depth:
                    break
                batches.append([])
                n = 0
            entry = heapq.heappop(self._heap)
            entries.append(entry)
            batches[-1].append(entry[2])
            n += size
        if self._depth > 1:
            batches = _by_length([e[2] for e in entries], self._depth, self._max) or batches
        chosen = [b for b in batches if b][:free]
        taken = {id(r) for b in chosen for r in b}
        for rank, number, req in entries:
            if id(req) in taken:
                self._queued_texts -= len(req.tokens)
                self._queued_requests -= 1
                req.taken.set()
            else:
                heapq.heappush(self._heap, (rank, number, req))
        return chosen

    async def _deliver(self, fut: Any, batch: list[_Request], number: int) -> None:
        try:
            out = await fut
        except Exception as e:  # the run failed: its requests fail, the service goes on
            _settle(batch, error=e)
            return
        except BaseException:  # cancelled: the service is shutting down
            _settle(batch, error=RuntimeError("the embedding service is shutting down"))
            raise
        finally:
            self._run_done(number)
        self._note_delivery(len(out))
        offset = 0
        for req in batch:
            req.result = out[offset:offset + len(req.tokens)]
            offset += len(req.tokens)
            req.done.set()

    def _run_done(self, number: int) -> None:
        """A run left the device: its slot is free, and its time served goes into the time per cost."""
        cost = self._in_flight.pop(number)
        now = anyio.current_time()
        served = now - max(self._busy_since, self._last_done)  # runs are served in dispatch order, about
        self._last_done = now
        if self._in_flight:
            self._busy_since = now
        if served > 0:
            keep = 0.5 ** (1 / _RATE_HALF_LIFE_RUNS)
            self._served_s = keep * self._served_s + served
            self._served_cost = keep * self._served_cost + cost
        self._arrived.set()  # the batcher may be waiting for a slot, or holding a run for this one

    def _note_delivery(self, texts: int) -> None:
        now = anyio.current_time()
        if self._last_delivery is not None and now > self._last_delivery:
            rate = texts / (now - self._last_delivery)
            keep = 0.5 ** (1 / _RATE_HALF_LIFE_RUNS)
            self._texts_per_s = rate if self._texts_per_s is None else keep * self._texts_per_s + (1 - keep) * rate
        self._last_delivery = now


def _cost(batch: list[_Request]) -> float:
    """What a run of these requests costs the device, in padded tokens: every text is padded to the
    longest, attention grows with it, and every run has a fixed cost."""
    longest = max(len(t) for r in batch for t in r.tokens)
    texts = sum(len(r.tokens) for r in batch)
    return _RUN_COST_TOKENS + texts * longest * (1 + longest / _ATTENTION_TOKENS)


def _by_length(requests: list[_Request], runs: int, max_texts: int) -> list[list[_Request]] | None:
    """The requests cut into at most `runs` runs of at most max_texts texts, each run a range of them in order
    of their longest text, at the least total _cost; each run keeps the requests' rank order. None when no
    such cut holds them all."""
    reqs = sorted(requests, key=lambda r: max(len(t) for t in r.tokens))
    n = len(reqs)
    inf = math.inf
    # best[k][j]: least cost of the first j requests (by length) in k runs; cut[k][j]: where the last run starts.
    best = [[inf] * (n + 1) for _ in range(runs + 1)]
    cut = [[0] * (n + 1) for _ in range(runs + 1)]
    best[0][0] = 0.0
    longest = [max(len(t) for t in r.tokens) for r in reqs]
    for k in range(1, runs + 1):
        for j in range(1, n + 1):
            per_text = longest[j - 1] * (1 + longest[j - 1] / _ATTENTION_TOKENS)  # the last run's longest text
            texts = 0
            for i in range(j, 0, -1):  # the last run holds reqs[i - 1 : j]
                texts += len(reqs[i - 1].tokens)
                if texts > max_texts:
                    break
                c = best[k - 1][i - 1] + _RUN_COST_TOKENS + texts * per_text  # _cost(reqs[i - 1:j])
                if c < best[k][j]:
                    best[k][j], cut[k][j] = c, i - 1
    k = min(range(1, runs + 1), key=lambda k: best[k][n])
    if best[k][n] == inf:
        return None
    out: list[list[_Request]] = []
    j = n
    while k > 0:
        i = cut[k][j]
        out.append(reqs[i:j])
        j, k = i, k - 1
    rank = {id(r): i for i, r in enumerate(requests)}
    return sorted((sorted(run, key=lambda r: rank[id(r)]) for run in out if run), key=lambda run: rank[id(run[0])])


def _settle(batch: list[_Request], *, error: BaseException) -> None:
    for req in batch:
        if not req.done.is_set():
            req.error = error
            req.done.set()
