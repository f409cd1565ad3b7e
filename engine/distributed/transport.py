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
    shares_memory_with(worker)        whether that worker does (once started)
    transfer_stats() -> dict          what crossed between host and workers (counters)
    caller_reads() -> context         optional: the calling thread reads the replies it waits for
    read_until(done, timeout)         optional: reads replies on the calling thread until done()
    completed_here()                  optional: runs completed on this thread (wakes a reading caller)

and receives through two callbacks, called on the transport's own threads:
on_message(worker, message) for every reply (in order per worker), and
on_exit(worker, reason) when a worker is gone for any reason other than
stop().

ProcessTransport runs each worker as a local process (spawn or forkserver:
never fork, the host has threads) connected by multiprocessing.Pipe (an
AF_UNIX socket pair), with the regions in POSIX shared memory that every
worker maps, so a run's tensor bytes never travel through the pipe.
engine.distributed.ray_transport.RayTransport places workers on Ray actors,
possibly on other machines (shares_memory is False): a worker on another
node keeps a copy of each region, a Call carries the bytes of the region
views it reads, and its Done brings back the views it wrote, which land in
the host's region before on_message; a worker on the driver's node maps the
host's regions as a worker process does.
"""

from __future__ import annotations

import abc
import contextlib
import multiprocessing
import os
import secrets
import select
import signal
import threading
import time
from multiprocessing import connection
from multiprocessing.shared_memory import SharedMemory
from typing import Any, Callable, ContextManager, Sequence

from engine import _native
from engine.distributed.errors import WorkerDiedError
from engine.distributed.protocol import Codec, Ready, Setup, SetupFailed, Stop, decode, encode
from engine.distributed.wire import recv_message, send_message
from engine.distributed.worker import DEFAULT_SPIN_US
from engine.validation import check_flag

__all__ = ["Region", "Transport", "ProcessTransport", "WakePipe", "SenderCpu", "OnMessage", "OnExit", "describe_exit"]

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

    def shares_memory_with(self, worker: int) -> bool:
        """Whether `worker` addresses the regions' bytes in place, once started (a transport may share memory
        with some of its workers only)."""
        return self.shares_memory

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

    def caller_reads(self) -> ContextManager[bool]:
        """While in it, the calling thread reads the replies it waits for itself (read_until), rather than
        being woken by the transport's thread: whether it got that role (one thread at a time). A
        transport without the ability gives False and changes nothing."""
        return contextlib.nullcontext(False)

    def read_until(self, done: Callable[[], bool], timeout: float | None) -> bool | None:
        """On the thread inside caller_reads(): reads and hands over replies until done() (True) or the
        timeout passed (False). None: this thread does not read, the caller waits as usual."""
        return None

    def completed_here(self) -> None:
        """The calling thread completed runs: a caller reading its replies on another thread, whose run may be
        among them with no reply of its own left to come (its last submission a host callback, or its last
        reply read by another thread), looks again now. Nothing by default."""


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

    A thread that sends a run and then waits for it (DistributedRuntime's
    `drt(x)`) reads its replies itself: inside caller_reads() its sends do
    not wake the receiving thread, which leaves the reply connections to it
    (it watches only worker exits then), and its wait polls the connections
    and hands each reply to the dispatcher on its own thread. The run then
    completes where its caller waits: the hand-off from the receiving thread
    to the caller (a sleeping thread's wake-up) is gone. Any other thread's
    send gives the connections back to the receiving thread; both may read
    then, one message at a time (the read lock), each re-checking that a
    message is still there once the other has read one.

    follow_sender: the receiving thread, woken by a request, moves to the
    CPU of the thread that sent it (os.sched_setaffinity on itself, to that
    one CPU, and again whenever a later sender runs elsewhere). That thread
    is usually the one the reply goes back to (an event loop awaiting the
    run), and a thread woken on another CPU costs its waker a cross-CPU
    interrupt, which under a hypervisor halting idle vCPUs is tens of
    microseconds: with the two on different CPUs an awaited round trip took
    about twice as long. Only this transport's own thread is moved; False
    leaves it wherever the scheduler puts it.

    pin_workers: with two workers or more, each chip worker process is
    bound to CPUs of its own when every worker's threads fit on the CPUs
    this process may use (worker i: the i-th `threads` of them, in order;
    see worker_cpus), so two workers never share a CPU while another has
    none of theirs. Unbound, the scheduler at times put both workers of a
    data-parallel step on one CPU: the step took 0.30 ms instead of 0.135 in
    about one stream of three (2 workers on 2 vCPUs, B = 64). The host's
    threads stay unbound (they run on any CPU, beside the workers). A single
    worker, workers whose threads outnumber the CPUs, or False: unbound.
    """

    def __init__(self, workers: int, start_method: str = "spawn", spin_us: int = DEFAULT_SPIN_US,
                 follow_sender: bool = True, pin_workers: bool = True) -> None:
        if start_method not in ("spawn", "forkserver"):
            raise ValueError(f"start_method must be 'spawn' or 'forkserver' (never 'fork': the host has threads), "
                             f"not {start_method!r}")
        if isinstance(spin_us, bool) or not isinstance(spin_us, int) or spin_us < 0:
            raise ValueError(f"spin_us must be an int >= 0, got {spin_us!r}")
        self._follower = SenderCpu(follow_sender)  # the receiving thread's CPU follows the requests that wake it
        self.pin_workers = check_flag("pin_workers", pin_workers)
        self.workers = workers
        self.start_method = start_method
        self.spin_us = spin_us
        self.follow_sender = follow_sender
        # Each literal, so the context's type (SpawnContext or ForkServerContext) has Process and Pipe.
        self._ctx = (multiprocessing.get_context("spawn") if start_method == "spawn"
                     else multiprocessing.get_context("forkserver"))
        # Names under /dev/shm say whose they are: tandem_<host pid>_<random>_<n>.
        self.prefix = f"tandem_{os.getpid()}_{secrets.token_hex(4)}"
        self._regions: list[_SharedRegion] = []
        self._procs: list[Any] = []
        self._conns: list[connection.Connection] = []
        # Each connection's descriptor, -1 once stop() closed it (under its send lock): read per message,
        # where Connection.fileno() and .closed are Python calls each.
        self._fds: list[int] = []
        self._codecs: list[Codec] = []  # per worker: its messages' encoding (a Codec remembers what it sent)
        self._send_locks: list[threading.Lock] = []
        self._gone: set[int] = set()
        self._thread: threading.Thread | None = None
        self._wake = WakePipe()  # wakes the receiving thread
        # Requests sent and replies received per worker (each list has one writer: a worker's senders under its
        # send lock, the receiving thread): a reply is due while one exceeds the other.
        self._requests: list[int] = []
        self._replies: list[int] = []
        self._receiver_asleep = False  # the receiving thread sleeps with no reply due: a request wakes it
        # Reading replies: one thread at a time reads (and hands over) a whole message. `_reads` counts the
        # messages read: a reader that sees it move by more than its own reads since its wait re-checks
        # that a message is still there before reading (the readiness its wait saw may be another's by now).
        self._read_lock = threading.Lock()
        self._reads = 0
        self._open: list[bool] = []  # per worker: its reply connection is open (not hung up, not stopped)
        self._reply_fds: list[tuple[int, int]] = []  # (fd, worker) of each open reply connection
        self._role = CallerRole()  # the one thread inside caller_reads()
        # Wakes that thread in read_until when its run completed on another thread (completed_here)
        self._caller_wake = WakePipe()
        # False while the caller reads the replies: the receiving thread watches only exits and its wake pipe
        self._receiver_reads = True
        self._receiver_quiet = False  # the receiving thread is (about to be) in such a wait
        self._stopping = False
        self._stopped = False
        self._stop_lock = threading.Lock()
        self._on_message: OnMessage = lambda worker, msg: None  # start() sets both
        self._on_exit: OnExit = lambda worker, reason: None

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
        cpus = worker_cpus(len(setups), max((s.threads for s in setups), default=1), allowed_cpus()) \
            if self.pin_workers else [()] * len(setups)
        for i, setup in enumerate(setups):
            parent, child = self._ctx.Pipe(duplex=True)
            proc = self._ctx.Process(target=worker_main, args=(child, self.spin_us, cpus[i]),
                                     name=f"tandem-chip-worker-{i}", daemon=True)
            self._procs.append(proc)
            self._conns.append(parent)
            self._fds.append(parent.fileno())
            self._codecs.append(Codec())
            self._send_locks.append(threading.Lock())
            self._requests.append(0)
            self._replies.append(0)
            self._open.append(True)
            try:
                proc.start()
            finally:
                child.close()  # the worker has its own copy now (or never will)
            parent.send_bytes(encode(setup))  # read once the worker has imported the engine: all start in parallel
        readies = [self._await_ready(i, deadline, timeout) for i in range(len(setups))]
        self._on_message, self._on_exit = on_message, on_exit  # for whichever thread reads a reply
        self._reply_fds = [(conn.fileno(), i) for i, conn in enumerate(self._conns)]
        self._thread = threading.Thread(target=self._receive, name="tandem-transport", daemon=True)
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

    def _receive(self) -> None:
        """The receiving thread: every reply in order (unless a caller reads them), then each worker's exit."""
        exits_watched = {proc.sentinel: i for i, proc in enumerate(self._procs)}  # a sentinel leaves once reaped
        while True:
            replies = self._reply_fds
            tail = [*exits_watched, self._wake.fd]
            if self._receiver_reads:
                self._receiver_quiet = False
                spin = self.spin_us if self._reply_due() else 0
                if spin == 0:
                    self._receiver_asleep = True
                    if self._reply_due():  # a request sent before its sender could see this thread asleep
                        spin = self.spin_us
                fds, timeout_ms = [fd for fd, _ in replies] + tail, -1
            else:  # the caller reads the replies: exits and the wake pipe only (a request by anyone else wakes it)
                self._receiver_quiet = self._receiver_asleep = True
                # While a caller reads, a look now and then as well; an idle runtime's thread sleeps.
                replies, fds, spin = [], tail, 0
                timeout_ms = _QUIET_LOOK_MS if self._role.holder is not None or self._reply_due() else -1
            seen = self._reads
            # One reply per readiness: the next is reported at once by the next wait.
            ready = _native.wait_readable(fds, spin, timeout_ms)
            self._receiver_asleep = False
            if not ready and not self._receiver_reads and self._role.holder is None and self._reply_due():
                self._receiver_reads = True  # replies nobody is reading (not expected: every path hands back)
            exits = []
            for k in ready:
                if k < len(replies):
                    # A caller that took the connections over during the wait reads what came meanwhile itself
                    # (it began with nothing else due: every reply from then on answers what it sent or later).
                    if self._receiver_reads:
                        seen += self._take_reply(replies[k][1], seen)
                    continue
                fd = fds[k]
                if fd == self._wake.fd:
                    self._wake.drain()
                    if self._stopping:
                        return
                    self._follower.follow()
                else:
                    exits.append(exits_watched[fd])
            for i in exits:  # after every reply the worker sent before it went
                proc = self._procs[i]
                while self._open[i] and self._take_reply(i, -1):  # -1: looks before each read
                    pass
                del exits_watched[proc.sentinel]
                with self._read_lock:
                    self._close_reply(i)
                # The sentinel fires as the process closes its fds, a moment before it can be
                # reaped: wait for that moment so the exit code is known (and no zombie stays).
                proc.join(5.0)
                self._gone.add(i)
                if not self._stopping:
                    self._on_exit(i, f"chip worker {i} (pid {proc.pid}) {describe_exit(proc.exitcode)}")

    def _take_reply(self, i: int, seen: int) -> bool:
        """Reads worker i's next reply and hands it over, if one is there; whether it read one.

        `seen`: the read count when this reader's wait began plus its own reads since. When the
        count has moved further, another reader may have taken the message the wait reported:
        look again first.
        """
        with self._read_lock:
            if not self._open[i]:
                return False
            fd = self._fds[i]
            if self._reads != seen and not _native.wait_readable([fd], 0, 0):
                return False
            try:
                msg = self._codecs[i].decode(recv_message(fd))
            except (EOFError, OSError):  # hung up: its sentinel reports the exit
                self._close_reply(i)
                return False
            except BaseException as e:  # a reply the host cannot take: never leave runs hanging
                self._fail_reply(i, e)
                if not isinstance(e, Exception):
                    raise  # an interrupt of the reading caller: the runtime is broken, and it is said
                return False
            self._reads += 1
            self._replies[i] += 1
            try:
                self._on_message(i, msg)
            except BaseException as e:
                self._fail_reply(i, e)
                if not isinstance(e, Exception):
                    raise
            return True

    def _close_reply(self, i: int) -> None:  # under the read lock
        self._open[i] = False
        self._reply_fds = [(fd, w) for fd, w in self._reply_fds if w != i]

    def _fail_reply(self, i: int, e: BaseException) -> None:
        self._close_reply(i)
        self._gone.add(i)
        self._on_exit(i, f"chip worker {i}: its reply could not be handled ({type(e).__name__}: {e})")

    # -- a caller reading its own replies ------------------------------------------------------------
    def caller_reads(self) -> ContextManager[bool]:
        return CallerReads(self._begin_caller, self._end_caller)

    def _begin_caller(self) -> bool:
        if not self._role.take():
            return False  # another thread reads: this one waits as usual
        if not self._reply_due():  # nothing else is due: leave the connections to this thread
            self._receiver_reads = False
            if not self._receiver_quiet:  # it may be asleep on the connections: our reply would wake it
                self._wake_receiver()
        return True

    def _end_caller(self) -> None:
        self._role.give_back()
        self._hand_back()

    def read_until(self, done: Callable[[], bool], timeout: float | None) -> bool | None:
        if self._role.holder != threading.get_ident():
            return None
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        spin = self.spin_us  # polls while replies come, sleeps between looks once none came (a reply wakes it)
        while not done():
            replies = self._reply_fds
            if not replies or self._stopping:
                return None  # nothing left to read: the receiving thread reports the exits
            look_ms = _CALLER_LOOK_MS
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                look_ms = min(look_ms, max(1, int(left * 1e3)))
            seen = self._reads
            # A look at most this long: an interrupt is seen between looks. A run that completes without a
            # reply to this thread (its last submission a host callback, a reply the receiving thread took, a
            # worker's exit) wakes it through _caller_wake (completed_here).
            fds = [fd for fd, _ in replies]
            fds.append(self._caller_wake.fd)
            ready = _native.wait_readable(fds, spin, look_ms)
            for k in ready:
                if k < len(replies):
                    seen += self._take_reply(replies[k][1], seen)
                else:
                    self._caller_wake.drain()
            spin = self.spin_us if ready else 0
        return True

    def completed_here(self) -> None:
        holder = self._role.holder
        if holder is not None and holder != threading.get_ident():
            self._caller_wake.poke()

    def _hand_back(self) -> None:
        """The connections go back to the receiving thread if a reply is due that no caller reads."""
        if not self._receiver_reads and self._role.holder is None and self._reply_due():
            self._receiver_reads = True
            self._wake_receiver()

    def _wake_receiver(self) -> None:
        if not self._stopped:
            self._wake.poke()

    def _reply_due(self) -> bool:
        """A worker still alive owes a reply (read by the receiving thread; racing a sender is harmless)."""
        if self._requests == self._replies:  # the common answer, at C speed (a sync call asks twice)
            return False
        gone = self._gone
        return any(sent > got and i not in gone for i, (sent, got) in enumerate(zip(self._requests, self._replies)))

    def send(self, worker: int, message: Any, block: bool = True) -> bool:
        with self._send_locks[worker]:
            data = self._codecs[worker].encode(message)  # under the lock: a Codec is one thread's at a time
            fd = self._fds[worker]
            if fd < 0:  # stop() closes it under this lock: its fd number may be another file's by now
                raise OSError(f"chip worker {worker}: the transport is stopped")
            if not block:
                # Writable means the socket's send buffer is at most a quarter full (AF_UNIX),
                # so a message this small goes in without waiting for the worker.
                if len(data) > _NONBLOCKING_MAX or not _writable(fd):
                    return False
            send_message(fd, data)
            self._requests[worker] += 1  # every message sent here (a Call, a MemoryOp) has one reply
        if self._role.holder == threading.get_ident():
            pass  # the reply's reader is this thread
        elif not self._receiver_reads:  # another thread's reply: the receiving thread reads again
            self._receiver_reads = True
            self._wake_receiver()
        elif self._receiver_asleep:  # so it polls by the time the reply comes, instead of waking for it
            self._follower.note()
            self._wake_receiver()
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
            self._wake.poke()
            if self._thread is not None and self._thread is not threading.current_thread():
                self._thread.join()
            with self._read_lock:  # a caller between looks reads no connection from here on
                self._open = [False] * len(self._open)
                self._reply_fds = []
            for i, (lock, conn) in enumerate(zip(self._send_locks, self._conns)):
                with lock:  # a sender checks under it that the connection is open (the workers are gone by now:
                    self._fds[i] = -1  # a send under way has failed, not waiting on a reader)
                    conn.close()
            for proc in self._procs:
                if proc.pid is not None:
                    proc.close()
            for region in self._regions:
                region.destroy()
            self._wake.close()
            self._caller_wake.close()


_NONBLOCKING_MAX = 16 << 10
_QUIET_LOOK_MS = 50  # while a caller reads the replies, the receiving thread still looks this often
_CALLER_LOOK_MS = 2  # a reading caller's longest sleep between looks at its run


class WakePipe:
    """A pipe that a thread asleep on its connections watches beside them (`fd`), and any thread pokes to wake
    it. Non-blocking: a poke into a full pipe is dropped (the sleeper is woken already), and drain() takes
    what is there in one read. Closed once under a lock, so a poke never writes to a closed (perhaps reused) descriptor."""

    __slots__ = ("fd", "_w", "_lock")

    def __init__(self) -> None:
        self.fd, self._w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._lock = threading.Lock()

    def poke(self) -> None:
        with self._lock:
            if self._w >= 0:
                try:
                    os.write(self._w, b"!")
                except BlockingIOError:
                    pass

    def drain(self) -> None:
        with self._lock:  # closed meanwhile (a waiter that saw it ready as it closed): its number may be reused
            if self.fd < 0:
                return
            try:
                os.read(self.fd, 4096)  # one read, as one wait reported it: more pokes than that wake the next wait
            except BlockingIOError:
                pass

    def close(self) -> None:
        with self._lock:
            if self._w >= 0:
                os.close(self.fd)
                os.close(self._w)
                self.fd = self._w = -1


class SenderCpu:
    """A transport thread that follows the threads that wake it to their CPU (see ProcessTransport's
    follow_sender): a sender notes its CPU before it wakes the thread, which, woken, binds itself to that one
    CPU (os.sched_setaffinity), again whenever a later sender runs elsewhere. Where threads cannot be bound,
    or the binding is refused (the process's CPUs changed), it does nothing."""

    __slots__ = ("enabled", "_cpu", "_bound")

    def __init__(self, enabled: bool) -> None:
        self.enabled = check_flag("follow_sender", enabled) and hasattr(os, "sched_setaffinity")
        self._cpu = -1  # the last sender's (written by senders, read by the woken thread)
        self._bound = -1  # the one CPU the woken thread is bound to, -1 while it is not

    def note(self) -> None:
        """On a sender, before it wakes the thread."""
        if self.enabled:
            self._cpu = _native.current_cpu()

    def follow(self) -> None:
        """On the woken thread."""
        cpu = self._cpu
        if not self.enabled or cpu < 0 or cpu == self._bound:
            return
        try:
            os.sched_setaffinity(0, {cpu})  # 0: the calling thread
        except OSError:
            self.enabled = False
            return
        self._bound = cpu


class CallerRole:
    """Who is inside a transport's caller_reads(): one thread at a time, taken without waiting."""

    __slots__ = ("_token", "holder")

    def __init__(self) -> None:
        self._token = threading.Lock()
        self.holder: int | None = None  # the thread's ident

    def take(self) -> bool:
        if not self._token.acquire(blocking=False):
            return False
        self.holder = threading.get_ident()
        return True

    def give_back(self) -> None:
        self.holder = None
        self._token.release()


class CallerReads:
    """A transport's caller_reads(): begin() says whether this thread got the reading role, end() gives it
    back. A plain class, as a sync call enters it every time (a generator-based context manager costs
    microseconds a call)."""

    __slots__ = ("_begin", "_end", "_got")

    def __init__(self, begin: Callable[[], bool], end: Callable[[], None]) -> None:
        self._begin = begin
        self._end = end
        self._got = False

    def __enter__(self) -> bool:
        self._got = self._begin()
        return self._got

    def __exit__(self, *exc: Any) -> None:
        if self._got:
            self._got = False
            self._end()


def allowed_cpus() -> list[int]:
    """The CPUs this process may run on, in order (empty where the platform does not say)."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def worker_cpus(workers: int, threads: int, allowed: Sequence[int]) -> list[tuple[int, ...]]:
    """Per worker, the CPUs it is bound to: its own `threads` of `allowed` when there are workers to keep apart
    (two or more) and every worker's threads fit, else none (an empty tuple: unbound). A single worker has
    nobody to share with, and bound it measured slower per run (its CPU no longer its to leave when the host's
    threads land there)."""
    if workers < 2 or workers * threads > len(allowed):
        return [()] * workers
    return [tuple(allowed[i * threads:(i + 1) * threads]) for i in range(workers)]


def _writable(fd: int) -> bool:
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
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
