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
import selectors
import signal
import threading
import time
from multiprocessing import connection
from multiprocessing.shared_memory import SharedMemory
from typing import Any, Callable, Sequence

from engine.distributed.errors import WorkerDiedError
from engine.distributed.protocol import Ready, Setup, SetupFailed, Stop, decode, encode

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
    """Chip workers as local processes, a socket pair each for messages, POSIX shared memory for tensor bytes."""

    def __init__(self, workers: int, start_method: str = "spawn") -> None:
        if start_method not in ("spawn", "forkserver"):
            raise ValueError(f"start_method must be 'spawn' or 'forkserver' (never 'fork': the host has threads), "
                             f"not {start_method!r}")
        self.workers = workers
        self.start_method = start_method
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
            proc = self._ctx.Process(target=worker_main, args=(child,), name=f"tandem-chip-worker-{i}", daemon=True)
            self._procs.append(proc)
            self._conns.append(parent)
            self._send_locks.append(threading.Lock())
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
        sel = selectors.DefaultSelector()  # registered once: a wake-up costs one poll, not a new selector
        for i, conn in enumerate(self._conns):
            sel.register(conn, selectors.EVENT_READ, (False, i))
        for i, proc in enumerate(self._procs):
            sel.register(proc.sentinel, selectors.EVENT_READ, (True, i))
        sel.register(self._wake_r, selectors.EVENT_READ, None)

        def receive(i: int) -> bool:
            """One reply of worker i handled; False once its connection is done with."""
            conn = self._conns[i]
            try:
                on_message(i, decode(conn.recv_bytes()))
                return True
            except (EOFError, OSError):
                sel.unregister(conn)  # hung up: its sentinel reports the exit
            except BaseException as e:  # a reply the host cannot take: never leave runs hanging
                sel.unregister(conn)
                self._gone.add(i)
                on_exit(i, f"chip worker {i}: its reply could not be handled ({type(e).__name__}: {e})")
            return False

        try:
            while True:
                exits = []
                for key, _ in sel.select():
                    if key.data is None:
                        os.read(self._wake_r, 64)
                        if self._stopping:
                            return
                        continue
                    is_exit, i = key.data
                    if is_exit:
                        exits.append((key.fileobj, i))
                        continue
                    # One reply per readiness: the selector (level-triggered, registered once) reports the
                    # next at once. Connection.poll() would build and tear down a selector on every call.
                    receive(i)
                for sentinel, i in exits:  # after every reply the worker sent before it went
                    conn = self._conns[i]
                    while _registered(sel, conn) and conn.poll():
                        receive(i)
                    sel.unregister(sentinel)
                    if _registered(sel, conn):
                        sel.unregister(conn)
                    proc = self._procs[i]
                    # The sentinel fires as the process closes its fds, a moment before it can be
                    # reaped: wait for that moment so the exit code is known (and no zombie stays).
                    proc.join(5.0)
                    self._gone.add(i)
                    if not self._stopping:
                        on_exit(i, f"chip worker {i} (pid {proc.pid}) {describe_exit(proc.exitcode)}")
        finally:
            sel.close()

    def send(self, worker: int, message: Any, block: bool = True) -> bool:
        data = encode(message)
        conn = self._conns[worker]
        with self._send_locks[worker]:
            if not block:
                # Writable means the socket's send buffer is at most a quarter full (AF_UNIX),
                # so a message this small goes in without waiting for the worker.
                if len(data) > _NONBLOCKING_MAX or not _writable(conn):
                    return False
            conn.send_bytes(data)
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
            for conn in self._conns:
                conn.close()
            for proc in self._procs:
                if proc.pid is not None:
                    proc.close()
            for region in self._regions:
                region.destroy()
            os.close(self._wake_r)
            os.close(self._wake_w)


_NONBLOCKING_MAX = 16 << 10


def _writable(conn: connection.Connection) -> bool:
    poller = select.poll()
    poller.register(conn.fileno(), select.POLLOUT)
    return bool(poller.poll(0))


def _registered(sel: selectors.BaseSelector, fileobj: Any) -> bool:
    try:
        sel.get_key(fileobj)
    except KeyError:
        return False
    return True


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
