"""The dispatcher's sending discipline: the replies' thread never waits to send, and order is kept."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

from engine import _native
from engine.distributed.dispatch import Dispatcher
from engine.distributed.graph import HOST, Submission
from engine.distributed.protocol import Call, Done, Ready
from engine.distributed.runs import RunRecord
from engine.distributed.transport import Region, Transport
from tests.distributed import programs as P


class _Refusing(Transport):
    """Records what is sent; refuses every send that must not wait (as a full socket would)."""

    workers = 2

    def __init__(self) -> None:
        self.sent: list[tuple[int, Any, str]] = []
        self.lock = threading.Lock()

    def create_region(self, nbytes: int) -> Region:
        raise NotImplementedError

    def start(self, setups, on_message, on_exit, timeout) -> list[Ready]:
        return []

    def send(self, worker: int, message: Any, block: bool = True) -> bool:
        if not block:
            return False
        with self.lock:
            self.sent.append((worker, message, threading.current_thread().name))
        return True

    def alive(self, worker: int) -> bool:
        return True

    def stop(self, timeout: float = 5.0) -> None:
        pass


class _Alloc:
    pass


def _record(d: Dispatcher) -> RunRecord:
    """A run's record holding a slot of a table of its own, as the runtime's admission makes it."""
    table = _native.SlotTable(1)
    lease = table.try_lease()
    assert lease is not None
    return RunRecord(1, False, d, 0, table, lease)


def test_work_released_by_a_reply_goes_out_through_the_sender_thread_in_order():
    transport = _Refusing()
    d = Dispatcher(transport, 2, lambda run_id: None, time.monotonic_ns)
    try:
        a = _Alloc()
        run = _record(d)
        first = Submission(run, 0, 1, "first", [(a, 0, 64, True)], (0, {}, (), ()))
        readers = [Submission(run, i, 0, f"r{i}", [(a, 0, 64, False)], (i, {}, (), ())) for i in range(1, 6)]
        d.seal(run, [first, *readers])
        assert [m.program for _w, m, _t in transport.sent] == [0]  # only `first` was ready
        d.on_message(1, Done(transport.sent[0][1].seq, None, 1, 2))  # on "the replies' thread"
        deadline = time.monotonic() + 10
        while len(transport.sent) < 6 and time.monotonic() < deadline:
            time.sleep(0.001)
        sent = transport.sent[1:]
        assert [m.program for _w, m, _t in sent] == [1, 2, 3, 4, 5]
        assert all(w == 0 and isinstance(m, Call) and t == "tandem-sender" for w, m, t in sent)
        for _w, m, _t in sent:
            d.on_message(0, Done(m.seq, None, 3, 4))
        assert run.wait(10) and run.error is None
    finally:
        d.close()


class _SharingWith(_Refusing):
    """A transport that shares the host's memory with worker 0 only (as RayTransport with a socket worker)."""

    shares_memory = False

    def shares_memory_with(self, worker: int) -> bool:
        return worker == 0


def test_a_worker_sharing_the_hosts_memory_gets_a_dependent_submission_before_the_reply_a_copying_one_after():
    """Two runs writing the same bytes on one worker: to a worker sharing the host's memory the second is sent at
    once (the worker's engine orders the two), to a worker with copies only once the first one's reply is back
    (its outputs must reach the host first)."""
    transport = _SharingWith()
    d = Dispatcher(transport, 2, lambda run_id: None, time.monotonic_ns)
    d.workers_started()
    try:
        for worker in (0, 1):
            a = _Alloc()
            runs = [_record(d) for _ in range(2)]
            for k, run in enumerate(runs):
                d.seal(run, [Submission(run, 0, worker, f"w{worker}r{k}", [(a, 0, 64, True)], (k, {}, (), ()))])
            sent = [m for w, m, _t in transport.sent if w == worker]
            assert [m.program for m in sent] == ([0, 1] if worker == 0 else [0])
            d.on_message(worker, Done(sent[0].seq, None, 1, 2))
            deadline = time.monotonic() + 10
            while len([m for w, m, _t in transport.sent if w == worker]) < 2 and time.monotonic() < deadline:
                time.sleep(0.001)
            sent = [m for w, m, _t in transport.sent if w == worker]
            assert [m.program for m in sent] == [0, 1]
            d.on_message(worker, Done(sent[1].seq, None, 3, 4))
            assert all(run.wait(10) and run.error is None for run in runs)
    finally:
        d.close()


def test_host_submissions_are_never_sent_to_a_worker():
    transport = _Refusing()
    d = Dispatcher(transport, 2, lambda run_id: None, time.monotonic_ns)
    try:
        calls: list[int] = []
        run = _record(d)
        sub = Submission(run, 0, HOST, "callback:cb", [], (lambda: calls.append(1), ()))
        d.seal(run, [sub])
        assert run.wait(10) and run.error is None and calls == [1]
        assert transport.sent == []
    finally:
        d.close()


@pytest.fixture(scope="module")
def fan(prepare):
    return prepare(P.fan_out, depth=3, bounds={"R": 256})


def test_a_reply_releasing_hundreds_of_submissions_does_not_stall(fan):
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((256, P.D)).astype(np.float32) for _ in range(6)]
    handles = [fan.submit(x) for x in xs]  # depth 3: up to 3 x 257 submissions in flight
    for x, h in zip(xs, handles):
        np.testing.assert_allclose(h.result(timeout=120), x, rtol=1e-6)


def test_every_reply_a_worker_sent_before_it_exited_is_delivered_before_its_exit(monkeypatch):
    import engine.distributed.worker as W
    from engine.distributed.protocol import Setup
    from engine.distributed.transport import ProcessTransport
    from tests.distributed import burst_worker

    monkeypatch.setattr(W, "main", burst_worker.burst_then_exit)  # the transport starts W.main in each process
    transport = ProcessTransport(1)
    got: list[int] = []
    exited: list[int] = []  # how many replies had arrived when the exit was reported
    gone = threading.Event()
    try:
        transport.start([Setup(0, 1, 0, (), ())], lambda i, msg: got.append(msg.seq),
                        lambda i, reason: (exited.append(len(got)), gone.set()), 30.0)
        assert gone.wait(30)
    finally:
        transport.stop()
    assert got == list(range(1, burst_worker.REPLIES + 1)) and exited == [burst_worker.REPLIES]
