"""AsyncRuntime: the async face of a prepared runtime, on anyio (asyncio and trio alike).

It drives any engine.backend.Backend (engine.Runtime, engine.distributed's
DistributedRuntime, ...) through that protocol and nothing else.

    async with AsyncRuntime(rt) as art:
        fut = await art.dispatch(x, w)   # admitted, staged, orchestrated; the device may still run
        y = await fut
        y = await art.call(x, w)
        async for y in art.stream(batches):
            ...

How a dispatch flows. The arguments are bound first (TypeError / ValueError
raise here, before admission). Then a slot is leased: at once when one is free
and nobody is queued, else the dispatch waits in the admission queue and the
slot is handed to it when a run ahead releases one. The run is then staged and
orchestrated and dispatch returns its RunFuture.

Priorities and timeouts. dispatch(..., priority=p, timeout=t): among waiting
dispatches a higher priority is admitted first, FIFO within a priority; a
priority step is worth `priority_aging` seconds of waiting, which bounds
starvation (the rule is in scheduler._admission). timeout bounds the wait for
admission: a dispatch not admitted within t seconds raises TimeoutError and
nothing of it reached the device. The names priority and timeout belong to
dispatch: a program parameter so named is passed positionally.

Where orchestration runs. By default on the loop thread, synchronously: it is
short Python (staging copies and a few submits), and doing it inline avoids a
thread hop per run. A dispatch that had to wait is launched by the completion
pump in the same wake-up that freed its slot, so a waiter's run starts without
waiting for its task to be scheduled and runs enter the task graph in
admission order. With orchestrate_in_thread=True staging and orchestration run
in a worker thread instead (scheduler._launch), in admission order, one batch
per thread hop: for programs whose orchestration is heavy enough to delay
other work on the loop. Binding always runs on the loop (it is validation).
The loop never waits for the device: completions arrive through the
notifier's fd (scheduler._pump), and an awaiter that finds its run already
done on the device finishes it on the spot (RunFuture._finish_if_done), with
every other run completed by then; the only blocking wait is the error path
of an orchestration that raised half-way, which waits for the tasks it
already started.

Cancellation. A dispatch cancelled while waiting for admission leaves no
trace. RunFuture.cancel() after admission skips device work not yet started;
work in progress finishes, the slot is released when the device lets go, the
result is discarded and other runs are untouched. call() and stream() cancel
their own runs when they are cancelled (fail_after, move_on_after, ...).
Under trio dispatch() and call() are checkpoints; under asyncio they are
cancellation points when they suspend (see _dispatch_checkpoint).

Use from a plain thread: run an event loop in a blocking portal and call
through it, e.g.

    with anyio.from_thread.start_blocking_portal() as portal, \\
            portal.wrap_async_context_manager(AsyncRuntime(rt)) as art:
        y = portal.call(art.call, x)

and from a worker thread started by the loop (anyio.to_thread.run_sync),
anyio.from_thread.run(art.call, x). RunFuture and AsyncRuntime methods belong
to the loop thread.

One AsyncRuntime drives a runtime at a time. While it does, submit runs
through it (from threads as above) rather than through Runtime.submit(): slots
that synchronous runs free are not announced on the notifier, so async
waiters would only see them at the next async completion.
"""

from __future__ import annotations

import math
import weakref
from functools import partial
from typing import Any, Callable

import anyio
from anyio.lowlevel import checkpoint_if_cancelled

_get_async_backend: Callable[[], Any] | None
try:  # the running backend's own checkpoint, looked up once per AsyncRuntime instead of per dispatch
    from anyio._core._eventloop import get_async_backend as _get_async_backend
except ImportError:  # pragma: no cover - a future anyio that moved it: the public function works too
    _get_async_backend = None

from engine.backend import Backend, CompletionSource
from engine.errors import ClosedError, RunCancelledError
from scheduler._admission import Admission
from scheduler._futures import RunFuture
from scheduler._launch import Job, Launched, ThreadLauncher
from scheduler._metrics import Histogram, Metrics, RunRecord, Stats
from scheduler._pump import CompletionPump
from scheduler._signal import running_asyncio_loop
from scheduler._stream import RunStream, Source

__all__ = ["AsyncRuntime"]


def _dispatch_checkpoint() -> "Callable[[], Any] | None":
    """What dispatch() and call() await first on the running backend (None: nothing).

    Under trio every await of the API is a checkpoint, so a dispatch in a
    cancelled scope raises before admission. Under asyncio a coroutine that
    does not suspend is no cancellation point (asyncio.Queue.put on a queue
    with room is not one either), and anyio's check costs about a microsecond
    per dispatch there, a tenth of a small run's whole cost: a dispatch that
    has to wait for a slot is cancellable as always, and one that finds a slot
    free launches; a cancellation of its task lands at the next suspension.
    """
    if running_asyncio_loop() is not None:
        return None
    if _get_async_backend is not None:
        return _get_async_backend().checkpoint_if_cancelled
    return checkpoint_if_cancelled


_NEW, _OPEN, _CLOSING, _CLOSED = range(4)

# Runtimes driven by an open AsyncRuntime: two pumps on one notifier would
# steal each other's completions.
_driven: "weakref.WeakSet[Backend[Any]]" = weakref.WeakSet()


class AsyncRuntime:
    """An async context manager over a prepared runtime (any engine.backend.Backend).

    orchestrate_in_thread: stage and orchestrate in a worker thread instead of
    on the loop thread (see the module docstring).
    close_runtime: aclose() also closes the runtime (by default it stays open
    for synchronous use or another AsyncRuntime).
    metrics_window: how many recent runs stats() percentiles cover.
    priority_aging: seconds of waiting one priority step is worth in the
    admission queue (None: strict priorities, which can starve; see the
    module docstring).
    """

    def __init__(self, runtime: "Backend[Any]", *, orchestrate_in_thread: bool = False, close_runtime: bool = False,
                 metrics_window: int = 10_000, priority_aging: float | None = 1.0) -> None:
        if not isinstance(runtime, Backend):
            raise TypeError(f"AsyncRuntime wraps a prepared runtime (from program.prepare(); any "
                            f"engine.backend.Backend), not {type(runtime).__name__}")
        aging_ns = None
        if priority_aging is not None:
            if isinstance(priority_aging, bool) or not isinstance(priority_aging, (int, float)) \
                    or not 0 < priority_aging < math.inf:
                raise ValueError(f"priority_aging must be a positive number of seconds or None, got {priority_aging!r}")
            aging_ns = round(priority_aging * 1e9)
        self._rt = runtime
        self._threaded = bool(orchestrate_in_thread)
        self._close_runtime = bool(close_runtime)
        self._metrics = Metrics(metrics_window)
        self._finish = runtime.finish  # (run, id, payload) -> (result, error)
        self._on_done_early = self._complete_early  # bound once: every future holds it
        self._state = _NEW
        self._pending: dict[int, RunFuture] = {}  # runs in flight (holding a slot), by native run id
        # Runs admitted here notify their completion (the pump hears of them) and are this object's to finish.
        self._admission: Admission[Job, Any] = Admission(partial(runtime.try_admit, True), self._on_grant,
                                                         self._on_admission_failed, aging_ns=aging_ns)
        self._launcher: ThreadLauncher | None = None
        self._pump: CompletionPump | None = None
        self._tg: Any = None
        self._idle_event: anyio.Event | None = None
        self._closed_event: anyio.Event | None = None
        self._cancelling = False  # aclose(cancel_pending=True) is under way
        self._completions: CompletionSource | None = None
        self._loop: Any = None  # the asyncio loop, or None under trio
        self._now: Callable[[], int] = _zero_clock
        self._drain_completed: Callable[[], list[int]] = list  # the completion source's, once entered
        self._checkpoint: Callable[[], Any] | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    async def __aenter__(self) -> "AsyncRuntime":
        if self._state != _NEW:
            raise RuntimeError("an AsyncRuntime is entered once; make a new one over the Runtime")
        rt = self._rt
        rt.check_open()
        if rt in _driven:
            raise RuntimeError(f"{rt!r} is already driven by an open AsyncRuntime")
        # Hold the completion source: its fd must stay open while the pump watches it,
        # even if someone closes the runtime underneath.
        completions = self._completions = rt.completions()
        self._drain_completed = completions.drain_completed
        self._now = completions.now_ns
        self._loop = running_asyncio_loop()
        self._checkpoint = _dispatch_checkpoint()
        self._closed_event = anyio.Event()
        tg = anyio.create_task_group()
        await tg.__aenter__()
        try:
            self._pump = CompletionPump(completions.notifier_fd, self._on_completions)
            await self._pump.start(tg)
            if self._threaded:
                self._launcher = ThreadLauncher(self._launch_job, self._on_launched)
                await tg.start(self._launcher.run)
        except BaseException as e:
            if self._pump is not None:
                self._pump.stop()
            await tg.__aexit__(type(e), e, e.__traceback__)
            raise
        self._tg = tg
        _driven.add(rt)
        self._state = _OPEN
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> bool | None:
        """Closes; when the body raised (or was cancelled) the runs in flight are cancelled, not drained."""
        try:
            with anyio.CancelScope(shield=True):
                await self.aclose(cancel_pending=exc_type is not None)
        finally:
            # The pump and launcher tasks have stopped, so the task group exits at
            # once. It is not handed the body's exception: that propagates as is
            # rather than wrapped in an exception group.
            tg, self._tg = self._tg, None
            await tg.__aexit__(None, None, None)
        return None

    async def aclose(self, cancel_pending: bool = False) -> None:
        """Stops admitting, then drains the runs in flight (or cancels them). Idempotent.

        Dispatches still waiting for a slot raise engine.ClosedError; so does
        every dispatch afterwards. If aclose itself is cancelled while
        draining, it cancels the runs in flight and waits (shielded) for the
        device to let go of their slots before it re-raises.
        """
        if self._state == _NEW:
            self._state = _CLOSED
            return
        if self._state != _OPEN:
            assert self._closed_event is not None
            await self._closed_event.wait()
            return
        self._state = _CLOSING
        try:
            closed = ClosedError("the AsyncRuntime is closed")
            self._admission.fail_all(closed)
            if cancel_pending:
                self._cancel_everything(closed)
            try:
                await self._wait_idle()
            except BaseException:
                with anyio.CancelScope(shield=True):
                    self._cancel_everything(closed)
                    await self._wait_idle()
                raise
        finally:
            self._shutdown()
        if self._close_runtime:
            await anyio.to_thread.run_sync(self._rt.close)

    def _cancel_everything(self, error: BaseException) -> None:
        self._cancelling = True
        if self._launcher is not None:
            for job in self._launcher.withdraw_all():  # leased but never launched: no run exists
                assert job.lease is not None
                self._rt.abandon(job.lease)
                job.settle(None, error)
        for fut in list(self._pending.values()):
            fut.cancel()

    def _shutdown(self) -> None:
        if self._pump is not None:
            self._pump.stop()
        if self._launcher is not None:
            self._launcher.stop()
        _driven.discard(self._rt)
        self._state = _CLOSED
        assert self._closed_event is not None
        self._closed_event.set()

    @property
    def closed(self) -> bool:
        return self._state >= _CLOSING

    def _check_open(self) -> None:
        if self._state != _OPEN:
            if self._state == _NEW:
                raise RuntimeError("enter the AsyncRuntime first: async with AsyncRuntime(rt) as art")
            raise ClosedError("the AsyncRuntime is closed")

    # -- dispatching ---------------------------------------------------------------------------
    async def dispatch(self, *args: Any, priority: int = 0, timeout: float | None = None, **kwargs: Any) -> RunFuture:
        """Admits, binds, stages and orchestrates one run; returns its future (the device may still run).

        Waits while `depth` runs are in flight: higher `priority` first among
        waiters, FIFO within a priority (aged: see the module docstring).
        `timeout` (seconds) bounds that wait: past it TimeoutError, and
        nothing reached the device. Argument errors raise here before
        admission; so does an error raised by the program's orchestration
        function, after which the slot is released.
        """
        if self._checkpoint is not None:
            await self._checkpoint()
        started = self._start(args, kwargs, priority, timeout)
        if type(started) is RunFuture:
            return started
        return await self._admitted(started, timeout)  # type: ignore[arg-type]

    async def call(self, *args: Any, priority: int = 0, timeout: float | None = None, **kwargs: Any) -> Any:
        """dispatch() and await the future in one; cancelling the call cancels the run.

        priority and timeout are dispatch()'s: timeout bounds the wait for
        admission, not the run (wrap the call in anyio.fail_after for that).
        """
        # dispatch() inlined: a small run's round trip feels every coroutine layer.
        if self._checkpoint is not None:
            await self._checkpoint()
        started = self._start(args, kwargs, priority, timeout)
        fut = started if type(started) is RunFuture else \
            await self._admitted(started, timeout)  # type: ignore[arg-type]
        if not fut.done():
            try:
                await fut.wait_done()
            except BaseException:
                fut.cancel()
                raise
        return fut.result()

    def _start(self, args: tuple, kwargs: dict[str, Any], priority: int, timeout: float | None) -> "RunFuture | Job":
        """Binds; then launches at once when a slot is free and nobody waits, else queues a Job."""
        if self._state != _OPEN:
            self._check_open()
        if type(priority) is not int:
            _check_priority(priority)
        if timeout is not None:
            _check_timeout(timeout)
        call = self._rt.bind(args, kwargs)
        t0 = self._now()
        lease = self._admission.try_acquire()
        if lease is not None and not self._threaded:
            return self._launch_here(call, lease, t0)
        job = Job(call, t0, self._loop)
        if lease is not None:
            job.lease = lease
            assert self._launcher is not None
            self._launcher.submit(job)
        else:
            self._admission.enqueue(job, t0, priority)
        return job

    async def _admitted(self, job: Job, timeout: float | None = None) -> RunFuture:
        """Waits until the job was admitted and launched (or failed); TimeoutError if not admitted in time."""
        try:
            if timeout is None:
                await job.wait()
            else:
                with anyio.move_on_after(timeout):
                    await job.wait()
                if not job.settled:
                    if self._admission.remove(job):  # still waiting for a slot: nothing was leased
                        raise TimeoutError(
                            f"the dispatch was not admitted within its timeout of {timeout} s: {self.depth} runs "
                            f"in flight, {self._admission.waiting} dispatches waiting ahead or behind it")
                    await job.wait()  # admitted in time; its launch (in the worker thread) is under way
        except TimeoutError:
            raise
        except BaseException:
            self._abandon(job)
            raise
        return job.outcome()

    def stream(self, source: Source, *, ordered: bool = True, depth: int | None = None,
               priority: int = 0) -> RunStream:
        """An async iterator over the outputs of one run per source item.

        source: a sync or async iterable of argument tuples (or single
        arguments). Keeps `depth` runs in flight (default: the runtime's
        depth). ordered=True yields outputs in input order; ordered=False
        yields (index, output) pairs as runs complete. A failing item raises
        scheduler.StreamItemError carrying its index; leaving the loop early
        cancels the runs still in flight. priority: every item's dispatch
        priority (see dispatch()).
        """
        if type(priority) is not int:
            _check_priority(priority)
        return RunStream(self, source, ordered=ordered, depth=depth, priority=priority)

    def _launch_here(self, call: Any, lease: Any, t_dispatch: int) -> RunFuture:
        """Stages and orchestrates on the loop thread; registers the run with the pump."""
        try:
            native, run_id, payload = self._rt.launch(call, lease, t_dispatch, self._metrics.log)
        except BaseException:
            self._admission.refill()  # the failed launch released its slot
            raise
        fut = RunFuture(native, run_id, payload, self._loop, self._on_done_early)
        # No completion can be handled before this line: the pump runs on this thread.
        self._pending[run_id] = fut
        return fut

    def _on_grant(self, job: Job, lease: Any) -> None:
        """Admission handed `job` a slot (called on the loop thread, in FIFO order)."""
        if self._launcher is not None:
            job.lease = lease
            self._launcher.submit(job)
            return
        call = job.call
        assert call is not None
        try:
            fut = self._launch_here(call, lease, job.t_dispatch)
        except Exception as e:  # the orchestration's error belongs to that dispatch
            job.settle(None, e)
        else:
            job.settle(fut)

    def _on_admission_failed(self, job: Job, error: BaseException) -> None:
        job.settle(None, error)

    def _abandon(self, job: Job) -> None:
        """The dispatch waiting on `job` was cancelled (or failed): undo what can be undone."""
        if self._admission.remove(job):
            return  # never admitted: no trace
        if self._launcher is not None and self._launcher.withdraw(job):
            assert job.lease is not None  # admitted but not launched: nothing reached the device
            self._rt.abandon(job.lease)
            job.settle(None, RunCancelledError("the dispatch was cancelled before its launch"))
            self._admission.refill()
            return
        if job.future is not None:
            job.future.cancel()  # admitted and launched: cancel the run
        elif not job.settled:
            job.abandoned = True  # launching in the worker thread right now: cancelled when it lands

    # -- the worker-thread option ----------------------------------------------------------------
    def _launch_job(self, job: Job) -> Launched:
        """In the worker thread: stage and orchestrate one job."""
        try:
            assert job.call is not None and job.lease is not None
            return self._rt.launch(job.call, job.lease, job.t_dispatch, self._metrics.log, self._now())
        except BaseException as e:
            return e

    def _on_launched(self, results: list[tuple[Job, Launched]]) -> None:
        """On the loop thread: a batch of launches came back from the worker thread."""
        freed = False
        for job, res in results:
            if isinstance(res, BaseException):
                freed = True  # the failed launch released its slot
                job.settle(None, res)
                continue
            native, run_id, payload = res
            fut = RunFuture(native, run_id, payload, self._loop, self._on_done_early)
            if native.done:
                # The pump may already have drained this run's id (it was not
                # registered yet): finish it here.
                self._complete(fut)
                freed = True
            else:
                self._pending[run_id] = fut
            if job.abandoned or self._cancelling:
                fut.cancel()
            job.settle(fut)
        if freed:
            self._admission.refill()
        self._check_idle()

    # -- completions ------------------------------------------------------------------------------
    def _on_completions(self) -> None:
        """The pump woke up: finish every run completed since the last wake-up, then refill slots."""
        self._finish_completed()
        self._after_completions()

    def _finish_completed(self) -> None:
        """Finishes every run the notifier reported since it was last drained (and resets its fd)."""
        ids = self._drain_completed()
        if ids:
            pending = self._pending
            for rid in ids:
                fut = pending.pop(rid, None)
                if fut is not None:  # None: finished already (at registration, or by an awaiter)
                    self._complete(fut)

    def _complete_early(self, fut: RunFuture) -> None:
        """An awaiter found fut's run done on the device before the pump did: finish it now (loop thread).

        It finishes every run completed so far, as the pump would: with runs in
        flight, the ones dispatched after fut are mostly done too, and their
        awaiters then find them settled. fut's own id may reach the notifier a
        moment after its run turned done; then it is finished on its own.
        """
        self._finish_completed()
        if self._pending.pop(fut.run_id, None) is not None:  # its id was not queued yet
            self._complete(fut)
        if self._admission.waiting or self._idle_event is not None:
            self._after_completions()

    def _after_completions(self) -> None:
        """Slots may have freed: hand them to waiters; wake drain() when nothing is in flight."""
        if self._admission.waiting:
            self._admission.refill()
        if self._idle_event is not None:
            self._check_idle()

    def _complete(self, fut: RunFuture) -> None:
        """Finishes fut's run (outcome, write-backs) and settles fut (the run recorded its timings itself).

        An error in here (a bug) settles the future rather than escaping:
        escaping, it would be logged by the loop (the pump runs as a loop
        callback) or raised to one awaiter, and the future, already out of
        the pending table, would leave its other awaiters waiting forever.
        """
        try:
            try:
                result, error = self._finish(fut._native, fut.run_id, fut._payload)  # outcome and write-backs
            except Exception as e:  # a write-back into the caller's array failed: the run's error
                if not fut.cancelled():
                    self._metrics.writeback_failures += 1
                fut._settle_outcome(None, e)
                return
            fut._settle_outcome(result, error)
        except BaseException as e:  # noqa: BLE001
            fut._settle_outcome(None, e)

    def _check_idle(self) -> None:
        if self._idle_event is not None and self._is_idle():
            self._idle_event.set()
            self._idle_event = None

    def _is_idle(self) -> bool:
        return not self._pending and (self._launcher is None or self._launcher.idle)

    async def _wait_idle(self) -> None:
        while not self._is_idle():
            if self._idle_event is None:
                self._idle_event = anyio.Event()
            await self._idle_event.wait()

    async def drain(self) -> None:
        """Waits until no run is in flight: every admitted run has released its slot."""
        await self._wait_idle()

    # -- introspection -------------------------------------------------------------------------------
    @property
    def runtime(self) -> "Backend[Any]":
        """The runtime this drives (as passed in)."""
        return self._rt

    @property
    def depth(self) -> int:
        return self._rt.depth

    @property
    def orchestrate_in_thread(self) -> bool:
        return self._threaded

    @property
    def in_flight(self) -> int:
        """Runs admitted and not yet released (cancelled ones included until the device lets go)."""
        return len(self._pending)

    @property
    def waiting(self) -> int:
        """Dispatches waiting for a slot."""
        return self._admission.waiting

    def stats(self) -> Stats:
        """Counts and timing percentiles of the runs so far (see scheduler.Stats). Computed natively over the
        metrics window with the GIL released: 0.03 ms for 1,000 runs, 0.7 ms for the default 10,000."""
        return self._metrics.snapshot()

    def histograms(self) -> dict[str, Histogram]:
        """Durations of every run so far in fixed buckets: admission_wait, orchestration, device, latency.

        The same intervals as stats() (see scheduler.Stats), over every run
        rather than a window: what a metrics scrape exports
        (scheduler.prometheus).
        """
        return self._metrics.histograms()

    def run_records(self, since: int = 0) -> list[RunRecord]:
        """The finished runs numbered `since` and later that the stats() window still holds, oldest first.

        Read on from the last record's seq + 1; a gap in seq means runs left
        the window (metrics_window runs) before they were read.
        """
        return self._metrics.records(since)

    def now_ns(self) -> int:
        """The engine clock the run records and traces use (0 before the AsyncRuntime is entered)."""
        return self._now()

    def set_tracing(self, on: bool) -> None:
        """Starts (or stops) recording spans and task timings for export_trace()."""
        self._rt.set_tracing(on)

    def export_trace(self, path: Any) -> None:
        """Writes what was recorded since tracing started (or the last export) as Chrome trace JSON."""
        self._rt.export_trace(path)

    def __repr__(self) -> str:
        state = ("new", "open", "closing", "closed")[self._state]
        mode = "thread" if self._threaded else "loop"
        return f"<AsyncRuntime {state} orchestration={mode} in_flight={len(self._pending)} over {self._rt!r}>"


def _zero_clock() -> int:
    return 0


def _check_priority(priority: Any) -> None:
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise TypeError(f"priority must be an int, got {type(priority).__name__} {priority!r}")


def _check_timeout(timeout: Any) -> None:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 <= timeout < math.inf:
        raise ValueError(f"timeout must be None or a finite number of seconds >= 0, got {timeout!r}")
