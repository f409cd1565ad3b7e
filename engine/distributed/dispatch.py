"""The dispatcher: moves sealed runs' submissions through the graph to the workers and back.

It owns the dependency tracker, one outbox per worker and the host-callback
thread, and it completes runs: a run whose last submission is back is
taken out of the graph under the lock, then delivered outside it
(RunRecord.complete: outputs out of the slot's region, the slot released)
and announced on the notifier. Its entry points run on whichever thread
calls them: seal() and cancel() on the launching thread, on_message() and
on_exit() on the transport's receiving thread, and callback completions on
the callback thread. All state changes happen under one lock; messages
leave through the outboxes after the lock is released, in the order they
were queued. The thread that reads the replies never waits to send: a
worker whose request pipe is full may be waiting for its own replies to be
read. It sends what goes out at once and leaves the rest to a sender
thread (started the first time it is needed).
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable

from engine.distributed.errors import WorkerDiedError
from engine.distributed.graph import DONE, HOST, SENT, WAITING, DependencyTracker, Submission
from engine.distributed.memory import host_view
from engine.distributed.program import WRITE
from engine.distributed.protocol import Call, Done, MemoryOp, Result
from engine.distributed.runs import RunRecord
from engine.distributed.transport import Transport
from engine.errors import ClosedError, KernelError
from engine.tensor import Allocation

__all__ = ["Dispatcher"]


class Dispatcher:
    def __init__(self, transport: Transport, workers: int, post: Callable[[int], None],
                 now_ns: Callable[[], int]) -> None:
        self._transport = transport
        # Per worker: with shared memory a worker's later submission may follow an earlier one without
        # waiting for its reply (the worker's engine orders them, and both see the same bytes). A worker
        # that copies bytes must wait: the later one's inputs leave the host only once the earlier one's
        # outputs are back in it. Known once the transport started (see workers_started). Indexed by
        # executor: the last entry is the host callbacks' (HOST is -1), as before per-worker sharing.
        self._same_worker_shortcut = [False] * (workers + 1)
        self._post = post  # announces a completed run id on the notifier
        self._now = now_ns
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # some submission completed (quiesce waits on it)
        # Threads waiting on _changed: notifying a Condition over a plain lock costs a few microseconds even
        # with nobody waiting (it checks ownership by trying the lock), and every run notifies twice.
        self._watchers = 0
        self._tracker = DependencyTracker()
        self._seq = itertools.count(1)
        self._sent: dict[int, Submission] = {}  # by seq: on a worker, reply pending
        self._rpcs: dict[int, Future[Any]] = {}
        self._runs: dict[int, RunRecord] = {}  # sealed, not yet complete
        self._completed: list[RunRecord] = []  # complete, not yet delivered (see _deliver)
        self._undelivered = 0  # complete runs whose delivery has not ended
        self._outboxes: list[deque[Any]] = [deque() for _ in range(workers)]
        self._flush_locks = [threading.Lock() for _ in range(workers)]
        self._host_queue: queue.SimpleQueue[Submission | None] = queue.SimpleQueue()
        self._broken: WorkerDiedError | None = None
        self._closed = False
        self.events: list[tuple[int, int, int, int, int, str, bool]] | None = None  # task events while tracing
        self._host_thread = threading.Thread(target=self._serve_callbacks, name="tandem-host-callbacks",
                                             daemon=True)
        self._host_thread.start()
        self._sender_queue: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._sender: threading.Thread | None = None

    def workers_started(self) -> None:
        """The transport started its workers: which of them share the host's memory is known now."""
        transport = self._transport
        self._same_worker_shortcut = [*(transport.shares_memory_with(w) for w in range(len(self._outboxes))),
                                      transport.shares_memory]

    @property
    def broken(self) -> WorkerDiedError | None:
        return self._broken

    # -- runs ----------------------------------------------------------------------------------
    def seal(self, run: RunRecord, subs: list[Submission]) -> None:
        """The run's orchestration is over: its submissions enter the graph, the ready ones leave."""
        work: deque[Submission] = deque()
        with self._lock:
            run.sealed_ns = self._now()
            if self._broken is not None or self._closed:
                run.error = self._broken or ClosedError("the runtime is closed")
                self._complete_run(run)
            else:
                self._runs[run.id] = run
                run.remaining = len(subs)
                run.waiting = subs
                for sub in subs:
                    for pred in self._tracker.add(sub):
                        if pred.state == SENT and pred.worker == sub.worker and self._same_worker_shortcut[pred.worker]:
                            continue  # already queued to the same executor, which orders the two itself
                        pred.succs.append(sub)
                        sub.blocking += 1
                    if sub.blocking == 0:
                        work.append(sub)
                self._advance(work)
                if run.remaining == 0:
                    self._complete_run(run)
        self._deliver()
        self._flush()

    def cancel(self, run: RunRecord) -> bool:
        """Skips the run's submissions not yet sent; the run completes once those sent are back."""
        with self._lock:
            if run.done_ns >= 0:  # complete already (perhaps not delivered yet): its outcome stands
                return False
            if not run.cancelled:
                run.cancelled = True
                self._skip_waiting(run)
        self._deliver()
        self._flush()
        return True

    def read_until(self, run: RunRecord, timeout: float | None) -> bool | None:
        """A waiter inside the transport's caller_reads() reads the replies until its run is done (True) or
        the timeout passed (False); None for any other waiter, who waits for the run as usual."""
        return self._transport.read_until(lambda: run.done, timeout)

    def wait_idle(self) -> None:
        """Blocks until every sealed run completed and was delivered."""
        with self._changed:
            self._watch(lambda: not self._runs and self._undelivered == 0)

    def _advance(self, work: deque[Submission]) -> None:
        """Sends (or skips) every submission in `work` and whatever that releases in turn. Lock held."""
        while work:
            sub = work.popleft()
            if sub.state != WAITING:
                continue
            run = sub.run
            if run.error is not None or run.cancelled:
                self._finish(sub, None, work)
                continue
            sub.state = SENT
            if sub.worker == HOST:
                self._host_queue.put(sub)
            else:
                sub.seq = next(self._seq)
                self._sent[sub.seq] = sub
                key, dims, args, access = sub.payload
                self._outboxes[sub.worker].append(Call(sub.seq, key, dims, args, access))
            keep = []
            for succ in sub.succs:  # those on the same executor need not wait for the reply
                if succ.worker == sub.worker and self._same_worker_shortcut[succ.worker]:
                    succ.blocking -= 1
                    if succ.blocking == 0:
                        work.append(succ)
                else:
                    keep.append(succ)
            sub.succs = keep

    def _finish(self, sub: Submission, error: BaseException | None, work: deque[Submission]) -> None:
        """sub is complete (done, failed or skipped): release what it held back. Lock held."""
        sub.state = DONE
        self._tracker.remove(sub)
        for succ in sub.succs:
            succ.blocking -= 1
            if succ.blocking == 0:
                work.append(succ)
        sub.succs = []
        run = sub.run
        if sub.start_ns >= 0:
            if run.first_start_ns < 0 or sub.start_ns < run.first_start_ns:
                run.first_start_ns = sub.start_ns
            run.last_end_ns = max(run.last_end_ns, sub.end_ns)
            run.busy_ns += max(0, sub.end_ns - sub.start_ns)
            if self.events is not None:
                self.events.append((run.id, sub.index, sub.worker, sub.start_ns, sub.end_ns, sub.name,
                                    error is None))
        if error is not None and run.error is None and not run.cancelled:
            run.error = error
            self._skip_waiting(run, work)
        run.remaining -= 1
        if run.remaining == 0 and run.done_ns < 0:
            self._complete_run(run)
        if self._watchers:
            self._changed.notify_all()

    def _skip_waiting(self, run: RunRecord, work: deque[Submission] | None = None) -> None:
        """A failed or cancelled run: its submissions not yet sent never will be. Lock held."""
        own = work is None
        work = deque() if work is None else work
        for sub in run.waiting:
            if sub.state == WAITING:
                self._finish(sub, None, work)
        if own:
            self._advance(work)
        if run.remaining == 0 and run.done_ns < 0:
            self._complete_run(run)

    def _complete_run(self, run: RunRecord) -> None:
        """Every submission of the run is back: out of the graph now, delivered by _deliver(). Lock held."""
        run.done_ns = self._now()
        run.waiting = []
        self._runs.pop(run.id, None)
        self._completed.append(run)
        self._undelivered += 1

    def _deliver(self) -> None:
        """Completes the runs taken out of the graph since the last call; never with the lock held.

        Delivery copies outputs and releases slots, which must not hold up
        the threads that feed the graph; the order of runs is kept per call.
        """
        if not self._completed:  # whoever completes a run later calls this after it (read without the lock)
            return
        with self._lock:
            runs, self._completed = self._completed, []
        if not runs:
            return
        waited = False  # a sync caller's run: its caller may be reading replies on another thread
        try:
            for run in runs:
                try:
                    run.complete()
                finally:
                    if run.notify:
                        self._post(run.id)
                    else:
                        waited = True
        finally:
            with self._lock:
                self._undelivered -= len(runs)
                if self._watchers:
                    self._changed.notify_all()
            if waited:
                self._transport.completed_here()

    def _watch(self, predicate: Callable[[], bool]) -> None:
        """Waits on _changed until predicate() holds. Lock held."""
        self._watchers += 1
        try:
            self._changed.wait_for(predicate)
        finally:
            self._watchers -= 1

    # -- the workers' replies ----------------------------------------------------------------------
    def on_message(self, worker: int, msg: Any) -> None:
        """A reply from a worker (on the transport's thread)."""
        if isinstance(msg, Done):
            work: deque[Submission] = deque()
            with self._lock:
                sub = self._sent.pop(msg.seq, None)
                if sub is None or sub.state != SENT:  # its run was failed by a worker's death meanwhile
                    return
                sub.start_ns, sub.end_ns = msg.first_start_ns, msg.last_end_ns
                self._finish(sub, None if msg.error is None else _run_error(sub, msg.error), work)
                self._advance(work)
            self._deliver()
            self._flush(block=False)
        elif isinstance(msg, Result):
            with self._lock:
                fut = self._rpcs.pop(msg.seq, None)
            if fut is not None:
                if msg.error is not None:
                    fut.set_exception(msg.error)
                else:
                    fut.set_result(msg.value)

    def on_exit(self, worker: int, reason: str) -> None:
        """A worker is gone: fail every run in flight and every memory call; the runtime is broken."""
        with self._lock:
            if self._broken is None:
                self._broken = WorkerDiedError(f"{reason}; the runs in flight failed and the runtime is broken "
                                               "(close() it)", worker)
            error = self._broken
            for run in list(self._runs.values()):
                if run.error is None:
                    run.error = error
                for sub in run.waiting:
                    if sub.state != DONE:
                        sub.state = DONE
                        self._tracker.remove(sub)
                self._complete_run(run)
            self._sent.clear()
            rpcs, self._rpcs = self._rpcs, {}
            self._changed.notify_all()
        self._deliver()
        for fut in rpcs.values():
            fut.set_exception(error)

    # -- host callbacks --------------------------------------------------------------------------------
    def _serve_callbacks(self) -> None:
        """The host-callback thread: callbacks in the order they were released."""
        while True:
            sub = self._host_queue.get()
            if sub is None:
                return
            if sub.state != SENT:  # its run was failed meanwhile
                continue
            fn, args = sub.payload
            error: BaseException | None = None
            start = self._now()
            try:
                fn(*[host_view(t, bool(tag & WRITE)) for t, tag in args])
            except BaseException as e:  # the run's error; this thread serves on
                error = KernelError(sub.run.id, sub.index, sub.name, f"{type(e).__name__}: {e}")
            end = self._now()
            work: deque[Submission] = deque()
            with self._lock:
                if sub.state == SENT:
                    sub.start_ns, sub.end_ns = start, end
                    self._finish(sub, error, work)
                    self._advance(work)
            self._deliver()
            self._flush()

    # -- memory calls ----------------------------------------------------------------------------------
    def rpc(self, worker: int, op: str, *args: Any) -> Any:
        """A synchronous memory call on one worker (after the work queued to it before)."""
        fut: Future[Any] = Future()
        with self._lock:
            if self._broken is not None:
                raise self._broken
            if self._closed:
                raise ClosedError("the runtime is closed")
            seq = next(self._seq)
            self._rpcs[seq] = fut
            self._outboxes[worker].append(MemoryOp(seq, op, args))
        self._flush()
        return fut.result()

    def quiesce(self, alloc: Allocation) -> None:
        """Waits until no submission still to complete touches `alloc`."""
        with self._changed:
            self._watch(lambda: self._broken is not None or not self._tracker.busy(alloc))
            if self._broken is not None:
                raise self._broken

    def take_events(self) -> list[tuple[int, int, int, int, int, str, bool]]:
        """The submission events recorded so far (tracing), and a fresh record."""
        with self._lock:
            events = self.events or []
            if self.events is not None:
                self.events = []
        return events

    # -- sending -------------------------------------------------------------------------------------
    def _flush(self, block: bool = True) -> None:
        """Sends what the outboxes hold. block=False: on the replies' thread, which must not wait."""
        for w, box in enumerate(self._outboxes):
            if box and not self._flush_worker(w, block):
                self._hand_to_sender(w)

    def _flush_worker(self, w: int, block: bool) -> bool:
        """Sends worker w's outbox in order; False when something is left for a thread that may wait."""
        box, lock = self._outboxes[w], self._flush_locks[w]
        while box:  # again after releasing: another thread may have queued meanwhile
            if not lock.acquire(blocking=block):
                return True  # the holder sends it: it looks at the box again after releasing
            try:
                while box:  # popping and sending are one step per worker: order is kept
                    try:
                        if not self._transport.send(w, box[0], block):
                            return False
                    except (OSError, ValueError):
                        pass  # the worker is gone: on_exit fails what it held
                    box.popleft()
            finally:
                lock.release()
        return True

    def _hand_to_sender(self, w: int) -> None:
        with self._lock:
            if self._sender is None and not self._closed:
                self._sender = threading.Thread(target=self._send_waiting, name="tandem-sender", daemon=True)
                self._sender.start()
        self._sender_queue.put(w)

    def _send_waiting(self) -> None:
        """The sender thread: flushes outboxes that the replies' thread could not send without waiting."""
        while True:
            w = self._sender_queue.get()
            if w is None:
                return
            self._flush_worker(w, True)

    def close(self) -> None:
        """Stops the callback thread (after the callback under way) and fails memory calls left."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            rpcs, self._rpcs = self._rpcs, {}
        self._host_queue.put(None)
        if self._host_thread is not threading.current_thread():
            self._host_thread.join()
        self._sender_queue.put(None)
        if self._sender is not None and self._sender is not threading.current_thread():
            self._sender.join()
        for fut in rpcs.values():
            fut.set_exception(ClosedError("the runtime is closed"))


def _run_error(sub: Submission, error: BaseException) -> BaseException:
    """A worker's error as the error of the distributed run (KernelErrors name the run and submission)."""
    where = f"{sub.name} on chip worker {sub.worker}"
    if isinstance(error, KernelError):
        return KernelError(sub.run.id, sub.index, f"{where}: {error.kernel}", error.message)
    if hasattr(error, "add_note"):  # Python 3.11+
        error.add_note(f"(raised by {where}, run {sub.run.id}, submission {sub.index})")
    return error
