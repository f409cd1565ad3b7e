"""Types of engine._native, the pybind11 extension bound in native/bindings/*.cpp.

Written by hand from the bindings; tests/native/test_stub.py checks it against
the built module (names, property or method, parameter names, defaults), so a
binding changed without this file fails there.

Conventions. An integer parameter takes anything with __index__ (ints, bools,
numpy integers), never a float: SupportsIndex. A float parameter also takes
ints and anything with __float__. A "host buffer" is any object exporting the
buffer protocol, C-contiguous where the binding says so. Parameters the
binding leaves unnamed (arg0 in pybind11's signature) are positional-only.
"""

from collections.abc import Callable, Sequence
from typing import Any, Final, SupportsFloat, SupportsIndex, TypeVar, overload

import numpy as np
from typing_extensions import Buffer as _BufferProtocol, TypeAlias

# numpy's stubs give ndarray __buffer__ only for Python >= 3.12, so under the
# project's python_version (3.10) an array is no Buffer to a type checker: name it too.
_HostBuffer: TypeAlias = _BufferProtocol | np.ndarray[Any, Any]
_Float: TypeAlias = SupportsFloat | SupportsIndex
# call_kernel takes lists (pybind11's py::list: a tuple is refused), and lists are
# invariant, so its element types are type variables: list[tuple[ndarray, int, int]]
# and list[int] are accepted as they are.
_HostBufferT = TypeVar("_HostBufferT", bound=_HostBuffer)
_ScalarT = TypeVar("_ScalarT", bound=int | float)

ABI_VERSION: Final[int]
"""TD_ABI_VERSION of tandem/kernel_abi.h: the kernel ABI this core was built with."""
MAX_DIMS: Final[int]
"""TD_MAX_DIMS: the most dimensions a tensor argument may have."""

# errors.cpp. Besides these, the core's InvalidArgument raises ValueError and
# TypeMismatch raises TypeError.
class DeviceMemoryError(MemoryError): ...
class ClosedError(RuntimeError): ...
class StaleLeaseError(ValueError): ...

# device.cpp

class Buffer:
    """A handle to one device allocation: (device_uid, id, addr, size)."""

    def __init__(self, device_uid: SupportsIndex, id: SupportsIndex, addr: SupportsIndex, size: SupportsIndex) -> None: ...
    @property
    def device_uid(self) -> int: ...
    @property
    def id(self) -> int: ...
    @property
    def addr(self) -> int: ...
    @property
    def size(self) -> int: ...
    def __repr__(self) -> str: ...
    def __eq__(self, other: object, /) -> bool: ...  # NotImplemented (so False) for a non-Buffer
    def __hash__(self) -> int: ...

class Device:
    """The embedded cpu device: a native memory arena. capacity 0 means unlimited."""

    def __init__(self, capacity: SupportsIndex = 0) -> None: ...
    @property
    def uid(self) -> int: ...
    def alloc(self, nbytes: SupportsIndex, align: SupportsIndex = 64) -> Buffer: ...
    def free(self, buf: Buffer) -> None: ...
    def copy_h2d(self, dst: Buffer, offset: SupportsIndex, src: _HostBuffer) -> None: ...
    def copy_d2h(self, dst: _HostBuffer, src: Buffer, offset: SupportsIndex) -> None: ...
    def copy_d2d(
        self, dst: Buffer, dst_offset: SupportsIndex, src: Buffer, src_offset: SupportsIndex, nbytes: SupportsIndex
    ) -> None: ...
    def check(self, buf: Buffer) -> None: ...
    def resolve(self, addr: SupportsIndex, nbytes: SupportsIndex) -> Buffer: ...
    def stats(self) -> dict[str, int]:
        """capacity, bytes_in_use, peak_bytes, live_allocations, total_allocations,
        h2d_bytes, d2h_bytes, d2d_bytes, mapped_regions."""
    def __repr__(self) -> str: ...

# accessor.cpp

class HostAccessor:
    """A per-run table mapping device regions to host views."""

    def __init__(self, device: Device | None) -> None: ...
    def add(self, device_base: SupportsIndex, size: SupportsIndex, host_view: _HostBuffer | None) -> None: ...
    def map(self, device_base: SupportsIndex, size: SupportsIndex, host_view: _HostBuffer, copy_in: bool) -> None: ...
    def read(self, device_addr: SupportsIndex, dst: _HostBuffer, nbytes: SupportsIndex) -> None: ...
    def write(self, device_addr: SupportsIndex, src: _HostBuffer, nbytes: SupportsIndex) -> None: ...
    def stage_in(self, device_base: SupportsIndex) -> None: ...
    def copy_back(self, device_base: SupportsIndex) -> None: ...
    def close(self) -> None: ...
    def mapping_count(self) -> int: ...
    def mapped_bytes(self) -> int: ...

# slots.cpp

class SlotTable:
    """Pipeline slots, one per accessor (or `depth` without): each leased to one run at a time."""

    @overload
    def __init__(self, accessors: Sequence[HostAccessor]) -> None: ...
    @overload
    def __init__(self, depth: SupportsIndex) -> None: ...
    @property
    def depth(self) -> int: ...
    @property
    def free_count(self) -> int: ...
    def accessor(self, index: SupportsIndex) -> HostAccessor | None:
        """None for a slot of a table built by depth."""
    def try_lease(self) -> tuple[int, int] | None:
        """(index, generation) of a free slot, or None when every slot is leased."""
    def release(self, index: SupportsIndex, generation: SupportsIndex) -> None: ...
    def wait_free(self, timeout: _Float | None = None) -> bool: ...

# kernels.cpp

def call_kernel(name: str, tensors: list[tuple[_HostBufferT, int, int]], scalars: list[_ScalarT]) -> None:
    """Runs a built-in kernel synchronously over (buffer, dtype_code, access) tuples and int/float scalars."""

def builtin_kernel_names() -> list[str]: ...
def packed_matmul_whole_vectors() -> bool: ...

# engine.cpp

class Kernel:
    """A kernel registered in an engine (made by Engine, no constructor)."""

    @property
    def name(self) -> str: ...
    @property
    def is_host(self) -> bool: ...
    def __repr__(self) -> str: ...

class TensorArg:
    """A tensor argument: a strided view plus its tracked byte range."""

    def __init__(
        self,
        addr: SupportsIndex,
        dtype: SupportsIndex,
        shape: Sequence[SupportsIndex],
        strides: Sequence[SupportsIndex],
        alloc_id: SupportsIndex,
        begin: SupportsIndex,
        end: SupportsIndex,
    ) -> None: ...
    @property
    def addr(self) -> int: ...
    @property
    def alloc_id(self) -> int: ...
    @property
    def byte_range(self) -> tuple[int, int]:
        """(begin, end)."""
    def may_overlap(self, other: TensorArg) -> bool:
        """Whether the views may share a byte, were they in one allocation (False only when surely not)."""

class TaskObserver:
    """Told about every task an engine executes while attached (Engine.add_observer); native only, no constructor."""

class TraceRecorder(TaskObserver):
    """A task observer that records each executed task until drained."""

    def __init__(self) -> None: ...
    def drain(self) -> list[tuple[int, int, int, int, int, str, bool]]:
        """(run_id, task_index, worker, start_ns, end_ns, kernel name, ok) of each task recorded since the last drain."""
    @property
    def dropped(self) -> int:
        """Events lost because memory ran out."""

class RunLog:
    """Timing records of launched runs, written by each run as it completes."""

    def __init__(self, window: SupportsIndex) -> None: ...
    @property
    def window(self) -> int: ...
    def record(
        self,
        dispatch_ns: SupportsIndex,
        admit_ns: SupportsIndex,
        launch_ns: SupportsIndex,
        sealed_ns: SupportsIndex,
        first_start_ns: SupportsIndex,
        last_end_ns: SupportsIndex,
        done_ns: SupportsIndex,
        kind: SupportsIndex,
        busy_ns: SupportsIndex = -1,
    ) -> None:
        """kind: 0 completed, 1 failed, 2 cancelled (anything else raises ValueError); busy_ns: the run's task
        time summed, -1 unknown."""
    def recent(self) -> list[tuple[int, int, int, int, int, int, int, int, int]]:
        """(dispatch, admit, launch, sealed, first_start, last_end, done, kind, busy) of the most recent runs, oldest
        first."""
    def summary(
        self,
    ) -> tuple[
        tuple[int, int, int, int], tuple[int, int, int, int], tuple[int, int, int, int], tuple[int, int, int, int],
        float | None,
    ]:
        """((p50, p90, p99, samples) in ns of admission_wait, orchestration, device and latency, overlap ratio or
        None) over the window, as stats() reports them."""
    def launched(self) -> None: ...
    def counts(self) -> tuple[int, int, int, int]:
        """(launched, completed, failed, cancelled) of every run so far."""
    def since(self, seq: SupportsIndex) -> tuple[int, list[tuple[int, int, int, int, int, int, int, int, int]]]:
        """(first, records): the records numbered seq and later still in the window, oldest first."""
    @property
    def recorded(self) -> int:
        """Records ever written: the next record's number."""
    @staticmethod
    def histogram_bounds_ns() -> tuple[int, ...]:
        """Upper bounds (ns) of the histograms' buckets; one more bucket holds what lies above."""
    def histograms(self) -> dict[str, tuple[tuple[int, ...], int, int]]:
        """{name: (bucket counts, sum_ns, count)} over every run: admission_wait, orchestration, device, latency."""

class PreparedCall:
    """A kernel call checked once (Engine.prepare_call); no constructor."""

    @property
    def kernel(self) -> Kernel: ...
    @property
    def tensor_count(self) -> int: ...
    @property
    def tensors(self) -> list[TensorArg]:
        """its tensor arguments (copies), in the kernel's order"""
    @property
    def access(self) -> list[int]: ...

class Recording:
    """The tasks of one run, relative to the bases they touched (engine.capture)."""

    def __init__(self) -> None: ...
    def add(self, call: PreparedCall, refs: Sequence[tuple[SupportsIndex, SupportsIndex, SupportsIndex]]) -> None:
        """Appends a submitted call; refs: (base index, the base's address, its origin) per tensor argument."""
    def seal(self, private_bases: Sequence[SupportsIndex]) -> None:
        """Ends the recording; the dependencies through private bases are computed once, here"""
    @property
    def sealed(self) -> bool: ...
    @property
    def task_count(self) -> int: ...
    @property
    def base_count(self) -> int: ...

class ReplayPlan:
    """A sealed recording materialized against one base table, for every replay on those bases."""

    def __init__(self, recording: Recording, bases: Sequence[tuple[SupportsIndex, SupportsIndex, SupportsIndex]]) -> None:
        """bases: (address, alloc id, origin) per base the recording names."""
    @property
    def task_count(self) -> int: ...
    @property
    def shared_accesses(self) -> int: ...

class Run:
    """One run: a group of tasks completing together (made by Engine.begin_run*, no constructor)."""

    @property
    def id(self) -> int: ...
    @property
    def done(self) -> bool: ...
    @property
    def sealed(self) -> bool: ...
    @property
    def cancelled(self) -> bool: ...
    @property
    def failed(self) -> bool: ...
    @property
    def task_count(self) -> int: ...
    @property
    def slot(self) -> int:
        """The pipeline slot the run holds, -1 for none."""
    def cancel(self) -> bool: ...
    def wait(self, timeout: _Float | None = None) -> bool: ...
    def failure(self) -> tuple[int, str, str] | None:
        """(task index, kernel, message) of the run's first failure, or None."""
    def times(self) -> dict[str, int]:
        """created_ns, sealed_ns, first_start_ns, last_end_ns, done_ns, busy_ns (-1: not yet)."""
    def attach_accessor(self, accessor: HostAccessor, /) -> None: ...
    def outcome(self) -> tuple[tuple[int, str, str] | None, bool]:
        """(failure or None, cancelled) of a completed run."""

class Engine:
    """Worker pool, task graph and notifier of one runtime."""

    def __init__(self, device: Device, workers: SupportsIndex = 0, spin_us: SupportsIndex = 200,
                 caller_runs: bool = False) -> None: ...
    @property
    def device(self) -> Device: ...
    @property
    def workers(self) -> int: ...
    @property
    def caller_runs(self) -> bool: ...
    @property
    def queued_tasks(self) -> int: ...
    def run_queued(self, stop_fd: SupportsIndex = -1) -> int:
        """Runs queued tasks on this thread until none is queued or stop_fd is readable (asked between tasks: at least one runs if any is queued); how many ran."""
    @property
    def closed(self) -> bool: ...
    @property
    def notifier_fd(self) -> int: ...
    def now_ns(self) -> int: ...
    def kernel(self, name: str, /) -> Kernel: ...
    def has_kernel(self, name: str, /) -> bool: ...
    def kernel_names(self) -> list[str]: ...
    def register_host_kernel(self, name: str, fn: Callable[..., object]) -> Kernel:
        """fn is called as fn(*arrays, *scalars) on a worker thread, with the GIL; its result is ignored."""
    def load_kernel(self, path: str, symbol: str, name: str | None = None) -> Kernel: ...
    def begin_run(self, notify: bool = False) -> Run: ...
    def begin_run_leased(self, notify: bool, slots: SlotTable) -> tuple[Run, int, int] | None:
        """(run, run id, slot) of a run holding a free slot, or None when every slot is leased."""
    def stop_admitting(self) -> None: ...
    def wait_idle(self, timeout: _Float | None = None) -> bool: ...
    def submit(
        self,
        run: Run,
        kernel: Kernel,
        tensors: Sequence[TensorArg],
        access: Sequence[SupportsIndex],
        scalars: Sequence[int | float] = (),
    ) -> None: ...
    @staticmethod
    def prepare_call(
        kernel: Kernel, tensors: Sequence[TensorArg], access: Sequence[SupportsIndex], scalars: Sequence[int | float] = ()
    ) -> PreparedCall: ...
    def submit_prepared(self, run: Run, call: PreparedCall) -> None: ...
    def replay(
        self,
        run: Run,
        plan: ReplayPlan,
        patches: Sequence[tuple[SupportsIndex, Sequence[int | float]]] = (),
        copy_backs: Sequence[tuple[SupportsIndex, SupportsIndex]] = (),
    ) -> None:
        """Enters the tasks of a plan's recording into the run, at the plan's bases; patches replace some tasks'
        scalars; copy_backs: (private base, its slot buffer's address) per output to copy back after."""
    def submit_copy_back(self, run: Run, arg: TensorArg, device_base: SupportsIndex) -> None: ...
    def seal(self, run: Run) -> None: ...
    def launch_replay(
        self,
        run: Run,
        staged: Sequence[tuple[SupportsIndex, SupportsIndex, Any, bool]],
        plan: ReplayPlan,
        patches: Sequence[tuple[SupportsIndex, Sequence[int | float]]],
        copy_backs: Sequence[tuple[SupportsIndex, SupportsIndex]],
        log: RunLog | None,
        dispatch_ns: SupportsIndex = 0,
        launch_ns: SupportsIndex = 0,
    ) -> None: ...
    def seal_logged(self, run: Run, log: RunLog | None, dispatch_ns: SupportsIndex, launch_ns: SupportsIndex = 0) -> None: ...
    def quiesce(self, alloc_id: SupportsIndex) -> None: ...
    def forget_allocation(self, alloc_id: SupportsIndex) -> None: ...
    def close(self, cancel_pending: bool = False) -> None: ...
    def drain_completed(self) -> list[int]:
        """Ids of the notifying runs completed since the last drain."""
    def wait_completed(self, timeout: _Float | None = None) -> bool: ...
    def add_observer(self, observer: TaskObserver) -> bool:
        """Attaches a task observer: told about every task executed from now on. False when attached already."""
    def remove_observer(self, observer: TaskObserver) -> bool:
        """Detaches a task observer: no task completing after this returns reaches it. False when not attached."""
    def stats(self) -> dict[str, int]:
        """tasks_submitted, tasks_executed, tasks_skipped, runs_started, runs_completed, runs_live,
        tracker_records, tracker_allocations, queued, workers, notifier_writes (wake-ups of notifier_fd: one
        per batch of notifying runs completed), notifier_write_ns (time the completing threads spent in them),
        worker_wakeups (sleeping pool workers woken for queued tasks: none while a spinning worker takes them)."""

def wait_readable(fds: Sequence[SupportsIndex], spin_us: SupportsIndex, timeout_ms: SupportsIndex = -1) -> list[int]:
    """Indexes of the fds readable (or hung up): polls for up to spin_us, then sleeps up to timeout_ms (negative:
    no limit). Empty on timeout or when a signal interrupted the sleep. Releases the GIL."""

def current_cpu() -> int:
    """The CPU the calling thread runs on now (sched_getcpu), -1 where the system does not say."""
