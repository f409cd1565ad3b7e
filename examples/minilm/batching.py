"""Micro-batching: concurrent requests share engine runs.

Each request hands over its tokenized texts and awaits its own rows. One
batcher task gathers requests into runs of at most `max_batch` texts: it keeps
at most `depth` runs in flight (so while the device is busy, requests pile up
and the next run goes out full), and once a slot is free it waits at most
`window_s` after the oldest waiting request before dispatching what it has.
A request never straddles two runs.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import anyio
import anyio.abc
import numpy as np

__all__ = ["BatchStats", "MicroBatcher"]


class _Encoder(Protocol):
    max_batch: int

    async def dispatch(self, token_lists: Sequence[np.ndarray]) -> Any: ...


@dataclass
class BatchStats:
    runs: int = 0
    texts: int = 0
    requests: int = 0


class _Request:
    __slots__ = ("tokens", "arrived", "done", "result", "error", "abandoned")

    def __init__(self, tokens: Sequence[np.ndarray]) -> None:
        self.tokens = tokens
        self.arrived = anyio.current_time()
        self.done = anyio.Event()
        self.result: np.ndarray | None = None
        self.error: BaseException | None = None
        self.abandoned = False  # the caller went away: skip it if it has not been dispatched yet


class MicroBatcher:
    """Gathers concurrent embed() calls into engine runs. Start run() in a task group first."""

    def __init__(self, encoder: _Encoder, *, window_s: float = 0.002, depth: int = 2) -> None:
        if window_s < 0:
            raise ValueError(f"window_s must be >= 0, got {window_s}")
        self._encoder = encoder
        self._window = window_s
        self._max = encoder.max_batch
        self._slots = anyio.Semaphore(depth)
        self._queue: deque[_Request] = deque()
        self._queued_texts = 0
        self._arrived = anyio.Event()
        self._running = False
        self.stats = BatchStats()

    async def embed(self, tokens: Sequence[np.ndarray]) -> np.ndarray:
        """Embeddings [len(tokens), dim] for one request's tokenized texts (1 to max_batch of them)."""
        if not 1 <= len(tokens) <= self._max:
            raise ValueError(f"a request takes 1 to {self._max} texts, got {len(tokens)}")
        if not self._running:
            raise RuntimeError("the batcher is not running")
        req = _Request(tokens)
        self._queue.append(req)
        self._queued_texts += len(tokens)
        self._arrived.set()
        try:
            await req.done.wait()
        finally:
            req.abandoned = not req.done.is_set()
        if req.error is not None:
            raise req.error
        assert req.result is not None
        return req.result

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
            _settle(list(self._queue), error=RuntimeError("the embedding service is shutting down"))
            self._queue.clear()
            self._queued_texts = 0

    async def _next_batch(self) -> list[_Request]:
        while not self._queue:
            self._arrived = anyio.Event()
            await self._arrived.wait()
        deadline = self._queue[0].arrived + self._window
        while self._queued_texts < self._max:
            remaining = deadline - anyio.current_time()
            if remaining <= 0:
                break
            self._arrived = anyio.Event()
            with anyio.move_on_after(remaining):
                await self._arrived.wait()
        batch: list[_Request] = []
        n = 0
        while self._queue and n + len(self._queue[0].tokens) <= self._max:
            req = self._queue.popleft()
            self._queued_texts -= len(req.tokens)
            if req.abandoned:
                continue
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
        offset = 0
        for req in batch:
            req.result = out[offset:offset + len(req.tokens)]
            offset += len(req.tokens)
            req.done.set()


def _settle(batch: list[_Request], *, error: BaseException) -> None:
    for req in batch:
        if not req.done.is_set():
            req.error = error
            req.done.set()
