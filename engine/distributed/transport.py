"""The transport: the one way the host reaches its chip workers.

The orchestration layer (dispatch, runtime) only ever calls this interface:

    create_region(nbytes) -> Region   host memory the workers address (one per slot)
    start(setups, on_message, on_exit, timeout) -> [Ready]
                                      start one worker per Setup, wait until every one is ready
    send(worker, message, block)      a protocol message to one worker (in order per worker);
                                      block=False sends only if that cannot wait
    alive(worker) -> bool             health
    stop(timeout)                     stop and reap every worker, remove every region
    shares_memory                     whether workers address the regions' bytes in place
    transfer_stats() -> dict          what crossed between host and workers (counters)

and receives through two callbacks, called on the transport's own threads:
on_message(worker, message) for every reply (in order per worker), and
on_exit(worker, reason) when a worker is gone for any reason other than
stop().

ProcessTransport runs each worker as a local process (spawn or forkserver:
never fork, the host has threads) connected by multiprocessing.Pipe (an
AF_UNIX socket pair), with the regions in POSIX shared memory that every
worker maps, so a run's tensor bytes never travel through the pipe.
engine.distributed.ray_transport.RayTransport places workers on Ray actors,
possibly on other machines: its regions are host buffers with a copy on each
worker (shares_memory is False), a Call carries the bytes of the region
views it reads, and its Done brings back the views it wrote, which land in
the host's region before on_message.
"""

from __future__ import annotations

import abc
import multiprocessing
import os
import secrets
import select
import signal
import threading
import time
from multiprocessing import connection
from multiprocessing.shared_memory import SharedMemory
from typing import Any, Callable, Sequence

from engine import _native
from engine.distributed.errors import WorkerDiedError
from engine.distributed.protocol import Ready, Setup, SetupFailed, Stop, decode, encode
from engine.distributed.wire import recv_message, send_message
from engine.distributed.worker import DEFAULT_SPIN_US

__all__ = ["Region", "Transport", "ProcessTransport", "OnMessage", "OnExit", "describe_exit"]

OnMessage = Callable[[int, Any], None]
OnExit = Callable[[int, str], None]


class Region(abc.ABC):
    """Host memory that workers read and write by reference: `size` bytes named `name`."""

    index: int
    name: str
    size: int

    @property
    @abc.abstractmethod
    def buf(self) -> memoryview:
        """The host's view of the bytes."""


class Transport(abc.ABC):
    """How the host starts, reaches, watches and stops its chip workers."""

    workers: int
    # Workers address the regions' bytes in place (shared memory): nothing is copied per Call, and a
    # worker's later Call may be sent before the reply to its earlier one (see Dispatcher).
    shares_memory: bool = True

    @abc.abstractmethod
    def create_region(self, nbytes: int) -> Region:
        """Host memory the workers will address (before start(): its spec goes into every Setup)."""

    @abc.abstractmethod
    def start(self, setups: Sequence[Setup], on_message: OnMessage, on_exit: OnExit, timeout: float) -> list[Ready]:
        """Starts one worker per Setup and waits until each is ready.

        Raises the worker's own setup error, WorkerDiedError when one exits
        first, or TimeoutError. The caller then calls stop().
        """

    @abc.abstractmethod
    def send(self, worker: int, message: Any, block: bool = True) -> bool:
        """Sends one message; messages to one worker arrive in the order sent. OSError when it is gone.

        With block=False the message is sent only if that cannot wait for the
        worker to read (the thread that reads the replies must never wait on
        a worker that may itself be waiting for its replies to be read);
        returns whether it was sent.
        """

    @abc.abstractmethod
    def alive(self, worker: int) -> bool:
        """False once the worker is known to be gone."""

    @abc.abstractmethod
    def stop(self, timeout: float = 5.0) -> None:
        """Stops every worker (asks, then terminates, then kills), reaps them, removes every region. Idempotent."""

    def transfer_stats(self) -> dict[str, int]:
        """Counters of region bytes copied to and from workers (zero where the memory is shared)."""
        return {"bytes_to_workers": 0, "bytes_from_workers": 0, "views_to_workers": 0, "views_from_workers": 0}


class _SharedRegion(Region):
    def __init__(self, index: int, shm: SharedMemory) -> None:
        self.index = index
        self.name = shm.name
        self.size = shm.size
        self._shm: SharedMemory | None = shm
        self._unlinked = False

    @property
    def buf(self) -> memoryview:
        assert self._shm is not None
        buf = self._shm.buf
        assert buf is not None
        return buf

    def destroy(self) -> None:
        shm = self._shm
        if shm is None:
            return
        if not self._unlinked:
            self._unlinked = True
            try:
                shm.unlink()  # first: the name goes even if a view still pins the mapping
            except FileNotFoundError:
                pass
        try:
            shm.close()
        except BufferError:
            # A host view still pins the mapping (the runtime drops its views after this when it
            # is being garbage collected). Keep the object: it unmaps itself once the views are gone.
            return
        self._shm = None


class ProcessTransport(Transport):
    """Chip workers as local processes, a socket pair each for messages, POSIX shared memory for tensor bytes.

    spin_us: how long a reader polls for its next message before sleeping,
    as the engine pool's idle workers do: an idle worker for the next
    request, the host's receiving thread for a reply while one is due. A
    message that finds its reader asleep waits for a wake-up first (tens of
    microseconds under a hypervisor). The receiving thread sleeps while no
    reply is due, so it takes no core from the orchestrating thread, and a
    request sent while it sleeps wakes it, so it is polling by the time the
    reply comes. 0: every reader sleeps at once.
    """

    def __init__(self, workers: int, start_method: str = "spawn", spin_us: int = DEFAULT_SPIN_US) -> None:
        if start_method not in ("spawn", "forkserver"):
            raise ValueError(f"start_method must be 'spawn' or 'forkserver' (never 'fork': the host has threads), "
                             f"not {start_method!r}")
        if isinstance(spin_us, bool) or not isinstance(spin_us, int) or spin_us < 0:
            raise ValueError(f"spin_us must be an int >= 0, got {spin_us!r}")
        self.workers = workers
        self.start_method = start_method
        self.spin_us = spin_us
        # Each literal, so the context's type (SpawnContext or ForkServerContext) has Process and Pipe.
        self._ctx = (multiprocessing.get_context("spawn") if start_method == "spawn"
                     else multiprocessing.get_context("forkserver"))
        # Names under /dev/shm say whose they are: tandem_<host pid>_<random>_<n>.
        self.prefix = f"tandem_{os.getpid()}_{secrets.token_hex(4)}"
        self._regions: list[_SharedRegion] = []
        self._procs: list[Any] = []
        self._conns: list[connection.Connection] = []
        self._send_locks: list[threading.Lock] = []
        self._gone: set[int] = set()
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = os.pipe()
        self._wake_lock = threading.Lock()  # the wake pipe stays open while a sender writes to it
        # Requests sent and replies received per worker (each list has one writer: a worker's senders under its
        # send lock, the receiving thread): a reply is due while one exceeds the other.
        self._requests: list[int] = []
        self._replies: list[int] = []
        self._receiver_asleep = False  # the receiving thread sleeps with no reply due: a request wakes it
        self._stopping = False
        self._stopped = False
        self._stop_lock = threading.Lock()

    # -- regions -----------------------------------------------------------------------------
    def create_region(self, nbytes: int) -> Region:
        shm = SharedMemory(name=f"{self.prefix}_{len(self._regions)}", create=True, size=max(1, nbytes))
        region = _SharedRegion(len(self._regions), shm)
        self._regions.append(region)
        return region

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self, setups: Sequence[Setup], on_message: OnMessage, on_exit: OnExit, timeout: float) -> list[Ready]:
        from engine.distributed.worker import main as worker_main

        deadline = time.monotonic() + timeout
        for i, setup in enumerate(setups):
            parent, child = self._ctx.Pipe(duplex=True)
            proc = self._ctx.Process(target=worker_main, args=(child, self.spin_us), name=f"tandem-chip-worker-{i}",
                                     daemon=True)
            self._procs.append(proc)
            self._conns.append(parent)
            self._send_locks.append(threading.Lock())
            self._requests.append(0)
            self._replies.append(0)
            try:
                proc.start()
            finally:
                child.close()  # the worker has its own copy now (or never will)
            parent.send_bytes(encode(setup))  # read once the worker has imported the engine: all start in parallel
        readies = [self._await_ready(i, deadline, timeout) for i in range(len(setups))]
        self._thread = threading.Thread(target=self._receive, args=(on_message, on_exit),
                                        name="tandem-transport", daemon=True)
        self._thread.start()
        return readies

    def _await_ready(self, i: int, deadline: float, timeout: float) -> Ready:
        proc, conn = self._procs[i], self._conns[i]
        ready = connection.wait([conn, proc.sentinel], timeout=max(0.0, deadline - time.monotonic()))
        if conn in ready:
            try:
                msg = decode(conn.recv_bytes())
            except (EOFError, OSError):
                msg = None
            if isinstance(msg, Ready):
                return msg
            if isinstance(msg, SetupFailed):
                raise msg.error
        if ready:  # the process ended (or hung up) before saying anything
            proc.join(1.0)
            raise WorkerDiedError(f"chip worker {i} {describe_exit(proc.exitcode)} during startup", i, proc.exitcode)
        raise TimeoutError(f"chip worker {i} was not ready within startup_timeout={timeout} s")

    def _receive(self, on_message: OnMessage, on_exit: OnExit) -> None:
        """The receiving thread: every reply in order, then each worker's exit."""
        # What it watches, fd -> (kind, worker): a reply connection leaves once hung up, a sentinel once reaped.
        watched: dict[int, tuple[int, int]] = {conn.fileno(): (_REPLY, i) for i, conn in enumerate(self._conns)}
        watched.update({proc.sentinel: (_EXIT, i) for i, proc in enumerate(self._procs)})
        watched[self._wake_r] = (_WAKE, -1)
        fds = list(watched)

        def unwatch(fd: int) -> None:
            nonlocal fds
            if watched.pop(fd, None) is not None:
                fds = list(watched)

        def receive(i: int) -> bool:
            """One reply of worker i handled; False once its connection is done with."""
            conn = self._conns[i]
            try:
                msg = decode(recv_message(conn.fileno()))
                self._replies[i] += 1
                on_message(i, msg)
                return True
            except (EOFError, OSError):
                unwatch(conn.fileno())  # hung up: its sentinel reports the exit
            except BaseException as e:  # a reply the host cannot take: never leave runs hanging
                unwatch(conn.fileno())
                self._gone.add(i)
                on_exit(i, f"chip worker {i}: its reply could not be handled ({type(e).__name__}: {e})")
            return False

        while True:
            exits = []
            spin = self.spin_us if self._reply_due() else 0
            if spin == 0:
                self._receiver_asleep = True
                if self._reply_due():  # a request sent before its sender could see this thread asleep
                    spin = self.spin_us
            # One reply per readiness: the next is reported at once by the next wait.
            ready = _native.wait_readable(fds, spin)
            self._receiver_asleep = False
            for fd in [fds[k] for k in ready]:
                entry = watched.get(fd)
                if entry is None:  # unwatched by a reply handled before it
                    continue
                kind, i = entry
                if kind == _WAKE:
                    os.read(self._wake_r, 64)
                    if self._stopping:
                        return
                elif kind == _EXIT:
                    exits.append(i)
                else:
                    receive(i)
            for i in exits:  # after every reply the worker sent before it went
                conn, proc = self._conns[i], self._procs[i]
                conn_fd = conn.fileno()
                while conn_fd in watched and conn.poll():
                    receive(i)
                unwatch(proc.sentinel)
                unwatch(conn_fd)
                # The sentinel fires as the process closes its fds, a moment before it can be
                # reaped: wait for that moment so the exit code is known (and no zombie stays).
                proc.join(5.0)
                self._gone.add(i)
                if not self._stopping:
                    on_exit(i, f"chip worker {i} (pid {proc.pid}) {describe_exit(proc.exitcode)}")

    def _reply_due(self) -> bool:
        """A worker still alive owes a reply (read by the receiving thread; racing a sender is harmless)."""
        gone = self._gone
        return any(sent > got and i not in gone for i, (sent, got) in enumerate(zip(self._requests, self._replies)))

    def send(self, worker: int, message: Any, block: bool = True) -> bool:
        data = encode(message)
        conn = self._conns[worker]
        with self._send_locks[worker]:
            if conn.closed:  # stop() closes it under this lock: its fd number may be another file's by now
                raise OSError(f"chip worker {worker}: the transport is stopped")
            if not block:
                # Writable means the socket's send buffer is at most a quarter full (AF_UNIX),
                # so a message this small goes in without waiting for the worker.
                if len(data) > _NONBLOCKING_MAX or not _writable(conn):
                    return False
            send_message(conn.fileno(), data)
            self._requests[worker] += 1  # every message sent here (a Call, a MemoryOp) has one reply
        if self._receiver_asleep:  # so it polls by the time the reply comes, instead of waking for it
            with self._wake_lock:
                if not self._stopped:
                    os.write(self._wake_w, b"r")
        return True

    def alive(self, worker: int) -> bool:
        if self._stopped or worker in self._gone:
            return False
        return self._procs[worker].is_alive()

    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def stop(self, timeout: float = 5.0) -> None:
        with self._stop_lock:
            if self._stopped:
                return
            self._stopped = True
            self._stopping = True
            for i, conn in enumerate(self._conns):
                try:
                    with self._send_locks[i]:
                        conn.send_bytes(encode(Stop()))
                except (OSError, ValueError):
                    pass
            deadline = time.monotonic() + timeout
            for proc in self._procs:
                if proc.pid is not None:
                    proc.join(max(0.0, deadline - time.monotonic()))
            for proc in self._procs:  # still running: a kernel that does not return
                if proc.pid is not None and proc.is_alive():
                    proc.terminate()
                    proc.join(1.0)
                    if proc.is_alive():
                        proc.kill()
                        proc.join()
            os.write(self._wake_w, b"x")
            if self._thread is not None and self._thread is not threading.current_thread():
                self._thread.join()
            for lock, conn in zip(self._send_locks, self._conns):
                with lock:  # a sender checks under it that the connection is open (the workers are gone by now:
                    conn.close()  # a send under way has failed, not waiting on a reader)
            for proc in self._procs:
                if proc.pid is not None:
                    proc.close()
            for region in self._regions:
                region.destroy()
            with self._wake_lock:
                os.close(self._wake_r)
                os.close(self._wake_w)


_NONBLOCKING_MAX = 16 << 10
_REPLY, _EXIT, _WAKE = 0, 1, 2  # what a watched fd of the receiving thread is


def _writable(conn: connection.Connection) -> bool:
    poller = select.poll()
    poller.register(conn.fileno(), select.POLLOUT)
    return bool(poller.poll(0))


def describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "is gone (exit status unknown)"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"was killed by {name}"
    return f"exited with code {exitcode}"
