"""The chip-worker process: one device and one worker pool that every registered program shares.

A worker prepares once (Setup: its pool, the shared regions it maps, the
single-device programs it runs) and then serves requests until Stop or until
the host hangs up. A Call runs one registered program with arguments given
by reference: views of the shared regions (the run's host tensors, mapped
here and used in place: no staging copy) and resident tensors of this
worker's device. Its orchestration runs on this process's main thread with
an engine.Run; the tasks run on the pool; completions come back through the
engine's notifier and are reported as Done, in completion order. Resident
tensors, shared regions and scratch all live on one device, so any program
uses any of them and the engine's own tracker orders work that shares them.
"""

from __future__ import annotations

import importlib
import mmap
import os
import select
import signal
import time
from multiprocessing import connection
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import numpy as np

from engine import _native
from engine.distributed.program import NO_HOST_CALLBACKS
from engine.distributed.protocol import (Call, Codec, Done, MemoryOp, ProgramSpec, Ready, RegionSpec, Result, Setup,
                                         SetupFailed, Stop, decode, encode, portable_error)
from engine.distributed.wire import recv_message, send_message
from engine.dtypes import as_dtype
from engine.errors import KernelError, RunCancelledError
from engine.orchestration import ScratchArena
from engine.port import TaskPort
from engine.program import Program
from engine.run import Run
from engine.tensor import Allocation, DeviceTensor

__all__ = ["main", "serve", "ChipHost", "resolve_program", "DEFAULT_SPIN_US"]

# How long an idle worker polls for the next request before sleeping: the engine pool's default.
DEFAULT_SPIN_US = 200

# Ids the worker's engine tracks shared regions by: far above the device's own ids (which count from 1).
_SHARED_ID_BASE = 1 << 48


def main(conn: connection.Connection, spin_us: int = DEFAULT_SPIN_US, cpus: tuple[int, ...] = ()) -> None:
    """The process entry point (the target the transport starts); spin_us: see serve(); cpus: the CPUs this
    worker is bound to (empty: unbound), before any thread of its pool starts (they inherit the binding)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the host decides when a worker stops
    if cpus:
        _bind_threads(cpus)
    host: ChipHost | None = None
    try:
        setup = decode(conn.recv_bytes())
        assert isinstance(setup, Setup), f"expected Setup, got {type(setup).__name__}"
        host = ChipHost(setup)
        conn.send_bytes(encode(Ready(os.getpid(), host.workers, host.clock_offset_ns)))
    except BaseException as e:
        try:
            conn.send_bytes(encode(SetupFailed(portable_error(e))))
        except Exception:
            pass
        if host is not None:
            host.close()
        return
    try:
        serve(conn, host, spin_us)
    finally:
        host.close()


def _bind_threads(cpus: tuple[int, ...]) -> None:
    """Binds every thread of this process to `cpus`: those started later inherit it from this one, and those the
    imports started (OpenBLAS's, say) are bound one by one."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # no /proc: this thread, and those it starts
        tids = [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:  # a thread gone meanwhile, or a CPU taken away (cpusets): that thread stays unbound
            pass


def serve(conn: connection.Connection, host: "ChipHost", spin_us: int = DEFAULT_SPIN_US) -> None:
    """Requests in, completions out, until Stop or the host hangs up.

    This thread is one of the worker's executors (ChipHost's engine is
    caller_runs): it orchestrates every message waiting, then runs the queued
    tasks itself until a message arrives, and reports what completed. A run
    on a one-thread worker so starts and finishes here, with no cross-thread
    wake-up. With nothing queued it waits for a message or for a pool thread
    (threads > 1) to complete a run: polling for spin_us first, as the pool's
    idle workers do, since a request that finds this process asleep pays a
    wake-up (tens of microseconds under a hypervisor) before it is even read.
    """
    conn_fd = conn.fileno()
    codec = Codec()
    fds = [conn_fd, host.notifier_fd]
    waiting = select.poll()  # "is a message waiting?" in one syscall (Connection.poll() builds a selector per call)
    waiting.register(conn_fd, select.POLLIN)
    while True:
        try:
            while waiting.poll(0):
                msg = codec.decode(recv_message(conn_fd))
                if isinstance(msg, Stop):
                    return
                reply = host.handle(msg)
                if reply is not None:
                    send_message(conn_fd, codec.encode(reply))
        except (EOFError, OSError):
            return
        host.run_queued(conn_fd)
        for done in host.completed():
            send_message(conn_fd, codec.encode(done))
        if not host.queued_tasks:  # else a message interrupted the tasks: read it, then go on
            _native.wait_readable(fds, spin_us)


class _Prepared:
    """A registered program with its bounds and a free list of scratch arenas (one per run in flight)."""

    __slots__ = ("program", "bounds", "scratch_bytes", "free_scratch")

    def __init__(self, program: Program, bounds: dict[str, int], scratch_bytes: int) -> None:
        self.program = program
        self.bounds = bounds
        self.scratch_bytes = scratch_bytes
        self.free_scratch: list[Allocation] = []


class ChipHost:
    """A worker's device, pool and registered programs; its runs submit through a TaskPort of its engine.

    local_regions: the regions are this process's own memory (a copy of the
    host's, kept by a transport that ships bytes) instead of the host's
    shared memory mapped by name.
    """

    def __init__(self, setup: Setup, local_regions: bool = False) -> None:
        self._local_regions = local_regions
        self._device = _native.Device(setup.memory_limit)
        # The serving thread is an executor too: a worker of `threads` starts threads - 1 pool threads.
        self._engine: Any = _native.Engine(self._device, setup.threads, caller_runs=True)
        # With no pool thread (threads=1) every task runs on the serving thread, inside run_queued(): a run
        # is done once that returns with nothing queued. completed() then looks at the pending runs instead
        # of draining the engine's notifier, whose eventfd costs a write and a read (syscalls) per run.
        self._announce = setup.threads > 1
        self.clock_offset_ns = time.monotonic_ns() - self._engine.now_ns()
        self._port = TaskPort(self, self._engine, self._engine.workers, no_callbacks=NO_HOST_CALLBACKS)
        self._allocs: dict[int, Allocation] = {}  # resident tensors and buffers, by device id
        # index -> (the shared memory mapped, or None for a local region; its bytes; its allocation)
        self._regions: dict[int, tuple[SharedMemory | mmap.mmap | None, np.ndarray, Allocation]] = {}
        self._programs = [_Prepared(resolve_program(p.module, p.qualname), dict(p.bounds), p.scratch_bytes)
                          for p in setup.programs]
        self._pending: dict[int, tuple[int, _Prepared, Allocation | None, Any]] = {}
        # Views by descriptor: runs repeat their argument layouts, and a view built once also keeps
        # its native argument. Cleared whenever memory is freed (device ids are never reused).
        self._views: dict[tuple[Any, ...], DeviceTensor] = {}
        for r in setup.regions:
            self._attach(r)

    @property
    def workers(self) -> int:
        return self._engine.workers

    @property
    def notifier_fd(self) -> int:
        return self._engine.notifier_fd

    @property
    def queued_tasks(self) -> int:
        return self._engine.queued_tasks

    def run_queued(self, stop_fd: int = -1) -> int:
        """Runs queued tasks on this thread until none is queued or stop_fd is readable; how many ran."""
        return self._engine.run_queued(stop_fd)

    def engine_now_ns(self) -> int:
        """The clock of this worker's run timestamps."""
        return self._engine.now_ns()

    def _attach(self, spec: RegionSpec) -> None:
        shm: SharedMemory | None = None
        if self._local_regions:
            base = np.zeros(spec.size, np.uint8)
        else:
            shm = SharedMemory(name=spec.name)
            assert shm.buf is not None  # attached: mapped until closed
            base = np.frombuffer(shm.buf, np.uint8)
        self._place_region(spec.index, shm, base)

    def _place_region(self, index: int, mapping: SharedMemory | mmap.mmap | None, base: np.ndarray) -> None:
        """Region `index` is `base` from now on (its bytes; `mapping` the memory behind it, closed with it)."""
        buf = _native.Buffer(self._device.uid, _SHARED_ID_BASE + index, base.ctypes.data, base.size)
        self._regions[index] = (mapping, base, Allocation(self, buf, "shared"))

    @property
    def local_regions(self) -> bool:
        """The regions are this process's copies (a transport ships their bytes), not the host's memory."""
        return self._local_regions

    @property
    def region_count(self) -> int:
        return len(self._regions)

    def map_regions(self, fds: list[int]) -> None:
        """Addresses the regions in the host's memory from now on, in place of this process's copies: `fds`
        are memory files (memfd) of the regions, by index, which the caller still owns. Only before any
        Call (a run's views would point at the copies)."""
        if not self._local_regions or self._pending or self._views:
            raise RuntimeError("chip worker: the regions can be mapped only before the first run, once")
        if len(fds) != len(self._regions):
            raise ValueError(f"chip worker: {len(fds)} region files for {len(self._regions)} regions")
        maps = []
        try:
            for index, fd in zip(sorted(self._regions), fds):
                size = self._regions[index][1].size
                if os.fstat(fd).st_size != size:
                    raise ValueError(f"chip worker: region {index}'s file has {os.fstat(fd).st_size} bytes, not "
                                     f"{size}")
                maps.append((index, mmap.mmap(fd, size)))
        except BaseException:
            for _, m in maps:
                m.close()
            raise
        for index, m in maps:
            self._place_region(index, m, np.frombuffer(m, np.uint8))
        self._local_regions = False

    def region_bytes(self, index: int) -> np.ndarray:
        """The bytes of region `index` as this worker addresses them."""
        return self._regions[index][1]

    # -- requests ---------------------------------------------------------------------------------
    def handle(self, msg: Any) -> Any:
        if isinstance(msg, Call):
            return self.call(msg)
        if isinstance(msg, MemoryOp):
            try:
                return Result(msg.seq, None, self.memory(msg.op, msg.args))
            except BaseException as e:
                return Result(msg.seq, portable_error(e), None)
        raise TypeError(f"chip worker: unknown message {type(msg).__name__}")

    def call(self, msg: Call) -> Done | None:
        """Starts one run of a registered program; None when it is under way (Done comes at completion)."""
        prep = self._programs[msg.program]
        try:
            values = [self._value(d) for d in msg.args]
        except BaseException as e:
            return Done(msg.seq, portable_error(e), -1, -1)
        scratch = prep.free_scratch.pop() if prep.free_scratch else self._new_scratch(prep)
        native = self._engine.begin_run(self._announce)
        try:
            arena = ScratchArena(scratch, 0, scratch.size if scratch is not None else 0)
            prep.program.invoke(Run(self._port, native, dict(msg.dims), arena), values)
        except BaseException as e:
            native.cancel()
            self._engine.seal(native)
            native.wait()  # its tasks already started release their memory first
            if scratch is not None:
                prep.free_scratch.append(scratch)
            return Done(msg.seq, portable_error(e), -1, -1)
        self._engine.seal(native)
        self._pending[native.id] = (msg.seq, prep, scratch, native)
        return None

    def _new_scratch(self, prep: _Prepared) -> Allocation | None:
        if prep.scratch_bytes <= 0:
            return None
        return Allocation(self, self._device.alloc(prep.scratch_bytes), "scratch")

    def _value(self, d: tuple[Any, ...]) -> Any:
        kind = d[0]
        if kind == "v":
            return d[1]
        view = self._views.get(d)
        if view is not None:
            return view
        _, key, offset, shape, strides, dtype = d
        alloc = self._regions[key][2] if kind == "s" else self._allocs.get(key)
        if alloc is None:
            raise ValueError(f"chip worker: no resident allocation {key} (freed?)")
        if len(self._views) >= 4096:
            self._views.clear()
        view = self._views[d] = DeviceTensor(alloc, offset, tuple(shape), tuple(strides), as_dtype(dtype))
        return view

    def completed(self) -> list[Done]:
        """Done for every run completed since the last call."""
        out = []
        offset = self.clock_offset_ns
        if self._announce:
            ids = self._engine.drain_completed()
        else:
            ids = [rid for rid, (_, _, _, native) in self._pending.items() if native.done]
        for rid in ids:
            entry = self._pending.pop(rid, None)
            if entry is None:  # a run whose orchestration failed: reported already
                continue
            seq, prep, scratch, native = entry
            if scratch is not None:
                prep.free_scratch.append(scratch)
            failure = native.failure()
            error: BaseException | None = None
            if failure is not None:
                error = KernelError(native.id, *failure)
            elif native.cancelled:
                error = RunCancelledError(f"run {native.id} was cancelled")
            t = native.times()
            first, last = t["first_start_ns"], t["last_end_ns"]
            out.append(Done(seq, error, first + offset if first >= 0 else -1, last + offset if last >= 0 else -1))
        return out

    # -- memory -----------------------------------------------------------------------------------
    def memory(self, op: str, args: tuple[Any, ...]) -> Any:
        if op == "alloc":
            nbytes, kind, init = args
            alloc = Allocation(self, self._device.alloc(nbytes), kind)
            if init is not None:
                self._device.copy_h2d(alloc.buf, 0, init)
            self._allocs[alloc.id] = alloc
            return alloc.id
        if op == "stats":
            return dict(self._device.stats())
        alloc = self._allocs[args[0]]
        self._engine.quiesce(alloc.id)  # runs in flight may still use it
        if op == "free":
            self._views.clear()
            del self._allocs[alloc.id]
            alloc.freed = True
            self._engine.forget_allocation(alloc.id)
            self._device.free(alloc.buf)
            return None
        if op == "write":
            _, offset, data = args
            self._device.copy_h2d(alloc.buf, offset, np.ascontiguousarray(data))
            return None
        if op == "read":
            _, offset, nbytes = args
            out = np.empty(nbytes, np.uint8)
            self._device.copy_d2h(out, alloc.buf, offset)
            return out
        raise ValueError(f"chip worker: unknown memory op {op!r}")

    def close(self) -> None:
        """Cancels what is still running, joins the pool, unmaps the regions."""
        self._engine.close(True)
        self._pending.clear()
        self._port.close()
        # A comprehension, so no loop variable keeps a mapping's bytes exported when it is closed.
        regions = [(alloc, shm) for shm, _, alloc in self._regions.values()]
        self._regions.clear()
        for alloc, shm in regions:
            alloc.freed = True
            if shm is not None:
                try:
                    shm.close()
                except BufferError:  # a view of its bytes is still alive: it unmaps once that view is gone
                    pass


def resolve_program(module: str, qualname: str) -> Program:
    """The engine Program named module:qualname (workers import programs; they are never pickled)."""
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not isinstance(obj, Program):
        raise TypeError(f"{module}.{qualname} is {type(obj).__name__}, not an engine program")
    return obj


def program_spec(prog: Program, bounds: dict[str, int], scratch_bytes: int) -> ProgramSpec:
    """How a worker finds `prog`: by its module and qualified name, checked here in the host first."""
    fn = prog.fn
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or "<locals>" in qualname:
        raise TypeError(f"sub-program {prog.name} must be defined at module level: chip workers import it "
                        f"by name")
    try:
        found = resolve_program(module, qualname)
    except (ImportError, AttributeError, TypeError) as e:
        raise TypeError(f"sub-program {prog.name}: chip workers import it as {module}.{qualname}, which "
                        f"fails here: {e}") from None
    if found is not prog:
        raise TypeError(f"sub-program {prog.name}: {module}.{qualname} is another object; chip workers import "
                        "programs by name, so define each one once at module level")
    return ProgramSpec(module, qualname, bounds, scratch_bytes)
