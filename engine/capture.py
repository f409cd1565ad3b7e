"""Captured runs: a program's orchestration recorded once per capture key and replayed natively.

With ``prepare(capture=True)`` the first run of each capture key runs the
program's function as usual and records what it submitted: every task (its
kernel, scalars, access tags and tensor arguments, each relative to the memory
it lies in: a parameter's slot buffer or the resident tensor passed for it,
the slot's scratch, or a resident tensor the function reached by itself).
Later runs with the same key skip the function: one native call enters the
recorded tasks into the task graph, moved to this run's slot and arguments,
with the GIL released. Dependencies are tracked as for submitted tasks, so a
replayed run that writes a resident KV cache still orders after the run that
wrote it before.

The capture key is what the orchestration can depend on:

- the values of the symbolic dims;
- for each tensor parameter, whether a host array or a resident tensor was
  passed, and for a resident tensor its strides and whether (and where) it
  lies in the same allocation as an earlier tensor argument;
- the value of every Scalar parameter the function *read*.

During a recording each Scalar parameter is a stand-in for its value. Passed
straight into a kernel's scalar (``alpha=s``) it is not read: each replay
passes that run's value (checked by the kernel's validation, as a submit
would). Anything else the function does with it reads it (a comparison, an
``if``, arithmetic, ``int()``, slicing, formatting, hashing), and then its
value is part of the key: a run with another value records anew. A replay is
therefore never stale for Scalars.

What a captured program must not do, and what happens if it does:

- Read ``run.id`` (it differs per run): CaptureError.
- Read device data in its orchestration (``DeviceTensor.to_numpy()``): CaptureError.
- Keep a Scalar stand-in beyond its orchestration: using it later raises CaptureError.
- Tell a stand-in apart by type (``isinstance(s, int)`` is False for it;
  ``isinstance(s, numbers.Integral)`` and ``numbers.Real`` are True).
- Depend on anything but its arguments and dims. Tensors it reaches by
  itself (globals, closures) are recorded by identity: rebinding such a name
  to another tensor is not seen by a replay (pass tensors that change as
  arguments); a recording whose tensor was freed since is dropped and
  recorded again. Python side effects of the function (prints, counters,
  caches) happen when a key is recorded, not on replays.

Recordings are kept per runtime, at most ``capture_limit`` of them, the least
recently used dropped first; ``Runtime.capture_stats()`` counts hits, misses,
entries, evictions and invalidations.
"""

from __future__ import annotations

import math
import numbers
import operator
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable, Generic, Protocol, Sequence, TypeVar

from engine import _native
from engine.errors import CaptureError
from engine.orchestration import ScratchArena
from engine.port import TaskPort
from engine.run import Run
from engine.specs import Scalar, TensorSpec
from engine.tensor import Allocation, DeviceTensor

if TYPE_CHECKING:
    from engine.binding import BoundCall
    from engine.program import Param, Program
    from engine.slots import Slot

__all__ = ["Capture", "RecordingTable", "TableEntry", "ScalarReads", "ScalarStandIn", "scalar_params", "stand_ins"]

_PLANS_PER_RECORDING = 64  # materialized base tables kept per recording (slots x resident-argument placements)

Base = tuple[int, int, int]  # (address, allocation id, origin) of one replay base
_NO_PATCHES: list[tuple[int, list[Any]]] = []  # read only: shared by the replays that patch nothing


# -- Scalar stand-ins ------------------------------------------------------------------------------
class ScalarReads:
    """What the Scalar stand-ins of one recording report to: the parameters read, and whether the recorded
    orchestration is over (a stand-in used after it raises)."""

    def __init__(self, reads: set[int] | None = None) -> None:
        self.reads: set[int] = set(reads or ())
        self.closed = False


class ScalarStandIn:
    """A Scalar parameter's value during a recording: it notes when the orchestration reads it."""

    __slots__ = ("_value", "_param", "_name", "_recorder")

    def __init__(self, value: Any, param: int, name: str, recorder: ScalarReads) -> None:
        self._value = value
        self._param = param
        self._name = name
        self._recorder = recorder

    def _read(self) -> Any:
        recorder = self._recorder
        if recorder.closed:
            raise CaptureError(f"Scalar parameter '{self._name}' was kept beyond its recorded orchestration; "
                               "a captured program uses its Scalars only while it orchestrates")
        recorder.reads.add(self._param)
        return self._value

    def __repr__(self) -> str:
        return repr(self._read())

    def __str__(self) -> str:
        return str(self._read())

    def __format__(self, spec: str) -> str:
        return format(self._read(), spec)

    def __bool__(self) -> bool:
        return bool(self._read())

    def __int__(self) -> int:
        return int(self._read())

    def __float__(self) -> float:
        return float(self._read())

    def __complex__(self) -> complex:
        return complex(self._read())

    def __index__(self) -> int:
        return operator.index(self._read())

    def __hash__(self) -> int:
        return hash(self._read())

    def __round__(self, ndigits: int | None = None) -> Any:
        return round(self._read(), ndigits)

    def __trunc__(self) -> int:
        return math.trunc(self._read())

    def __floor__(self) -> int:
        return math.floor(self._read())

    def __ceil__(self) -> int:
        return math.ceil(self._read())

    def __neg__(self) -> Any:
        return -self._read()

    def __pos__(self) -> Any:
        return +self._read()

    def __abs__(self) -> Any:
        return abs(self._read())

    def __invert__(self) -> Any:
        return ~self._read()

    def __getattr__(self, name: str) -> Any:  # .real, .imag, .is_integer(), .bit_length(), ...
        return getattr(self._read(), name)


def _plain(x: Any) -> Any:
    return x._read() if isinstance(x, ScalarStandIn) else x


def _binary(op: Callable[[Any, Any], Any]) -> tuple[Callable[..., Any], Callable[..., Any]]:
    def forward(self: ScalarStandIn, other: Any) -> Any:
        return op(self._read(), _plain(other))

    def reflected(self: ScalarStandIn, other: Any) -> Any:
        return op(_plain(other), self._read())

    return forward, reflected


for _name, _op in (("add", operator.add), ("sub", operator.sub), ("mul", operator.mul),
                   ("truediv", operator.truediv), ("floordiv", operator.floordiv), ("mod", operator.mod),
                   ("divmod", divmod), ("pow", pow), ("lshift", operator.lshift), ("rshift", operator.rshift),
                   ("and", operator.and_), ("or", operator.or_), ("xor", operator.xor)):
    _fwd, _rev = _binary(_op)
    setattr(ScalarStandIn, f"__{_name}__", _fwd)
    setattr(ScalarStandIn, f"__r{_name}__", _rev)
for _name, _op in (("eq", operator.eq), ("ne", operator.ne), ("lt", operator.lt), ("le", operator.le),
                   ("gt", operator.gt), ("ge", operator.ge)):
    setattr(ScalarStandIn, f"__{_name}__", _binary(_op)[0])


class IntStandIn(ScalarStandIn):
    __slots__ = ()


class FloatStandIn(ScalarStandIn):
    __slots__ = ()


# Numbers the way the numeric tower sees them (an isinstance check against int itself cannot be).
numbers.Integral.register(IntStandIn)
numbers.Real.register(FloatStandIn)


def scalar_params(params: Sequence["Param"]) -> tuple[tuple[int, "Param"], ...]:
    """(index, parameter) of a program's Scalar parameters."""
    return tuple((i, p) for i, p in enumerate(params) if isinstance(p.spec, Scalar))


def stand_ins(scalars: Sequence[tuple[int, "Param"]], args: list[Any], recorder: ScalarReads) -> None:
    """Replaces each Scalar parameter's value in `args` by its stand-in for a recording (reads reported to
    `recorder`)."""
    for i, p in scalars:
        cls = FloatStandIn if p.spec.type is float else IntStandIn  # bool is an int
        args[i] = cls(args[i], i, p.name, recorder)


# -- recording ---------------------------------------------------------------------------------------
class _Site:
    """A task whose scalars come from Scalar parameters: re-validated with each replay's values."""

    __slots__ = ("task", "kernel", "inputs", "out", "scalars", "sources", "access")

    def __init__(self, task: int, kernel: Any, inputs: tuple[Any, ...], out: Any, scalars: dict[str, Any],
                 sources: dict[str, int], access: list[int]) -> None:
        self.task, self.kernel, self.inputs, self.out = task, kernel, inputs, out
        self.scalars, self.sources, self.access = scalars, sources, access

    def rebind(self, values: Sequence[Any]) -> Any:
        """The call with this run's parameter values (ValueError / TypeError as a submit would raise)."""
        scalars = dict(self.scalars)
        for name, param in self.sources.items():
            scalars[name] = values[param]
        return self.kernel.bind(self.inputs, self.out, scalars)


class Recorded:
    """One capture key's recording: the native tasks, the resident memory they reached, the scalar sites."""

    __slots__ = ("native", "abs_allocs", "abs_bases", "sites", "plans", "key", "dropped")

    def __init__(self, native: "_native.Recording", abs_allocs: list[Allocation], sites: list[_Site]) -> None:
        self.native = native
        self.abs_allocs = abs_allocs
        self.abs_bases: list[Base] = [(a.addr, a.id, 0) for a in abs_allocs]
        self.sites = sites
        # (slot, the resident arguments' (allocation id, offset)...) -> the recording materialized there:
        # a slot's replays with the same resident arguments reuse one (ids are never reused).
        self.plans: dict[tuple[Any, ...], _native.ReplayPlan] = {}
        self.key: tuple[Any, ...] = ()  # its key in the table
        self.dropped = False  # it left the table (evicted, invalidated, replaced, cleared)

    def live(self) -> bool:
        for alloc in self.abs_allocs:
            if alloc.freed:
                return False
        return True


class Recorder(ScalarReads):
    """Records one run's submissions as they are made, each tensor argument relative to its base."""

    def __init__(self, owner: Any, regions: list[tuple[int, int, int, int, int]], private: list[int],
                 first_abs: int, reads: set[int]) -> None:
        super().__init__(reads)
        self._owner = owner
        self._private = private  # the bases of this run's slot: its buffers for host arguments, its scratch
        # allocation id -> [(base, base address, origin, end of the base's range)]
        self._regions: dict[int, list[tuple[int, int, int, int]]] = {}
        for base, alloc_id, addr, origin, end in regions:
            self._regions.setdefault(alloc_id, []).append((base, addr, origin, end))
        self._abs: dict[int, tuple[int, int]] = {}  # allocation id -> (base, address)
        self._abs_allocs: list[Allocation] = []
        self._next_base = first_abs
        self.native = _native.Recording()
        self.sites: list[_Site] = []
        self.pending: tuple[Any, tuple[Any, ...], Any, dict[str, Any], dict[str, int]] | None = None

    def add(self, call: "_native.PreparedCall") -> None:
        refs = [self._ref(t) for t in call.tensors]
        pending, self.pending = self.pending, None
        if pending is not None:
            kernel, inputs, out, scalars, sources = pending
            self.sites.append(_Site(self.native.task_count, kernel, inputs, out, scalars, sources, call.access))
        self.native.add(call, refs)

    def _ref(self, t: "_native.TensorArg") -> tuple[int, int, int]:
        alloc_id = t.alloc_id
        begin, end = t.byte_range
        for base, addr, origin, limit in self._regions.get(alloc_id, ()):
            if origin <= begin and end <= limit:
                return base, addr, origin
        hit = self._abs.get(alloc_id)
        if hit is None:
            alloc = self._allocation(alloc_id)
            hit = self._abs[alloc_id] = (self._next_base, alloc.addr)
            self._abs_allocs.append(alloc)
            self._next_base += 1
        return hit[0], hit[1], 0

    def _allocation(self, alloc_id: int) -> Allocation:
        for alloc in list(self._owner._owned.values()):
            if alloc.id == alloc_id:
                if alloc.kind in ("slot", "scratch"):
                    raise CaptureError("the orchestration used a tensor of another run (a slot buffer or scratch "
                                       "that is not this run's); a captured program uses only this run's tensors "
                                       "and resident ones")
                return alloc
        raise CaptureError(f"the orchestration used memory (allocation {alloc_id}) this runtime does not own")

    def finish(self) -> Recorded:
        self.closed = True
        self.native.seal(self._private)
        for site in self.sites:  # a parameter read anywhere is in the key: its value is baked in
            site.sources = {name: p for name, p in site.sources.items() if p not in self.reads}
        return Recorded(self.native, self._abs_allocs, [s for s in self.sites if s.sources])


class _RecordingEngine:
    """The engine as a recording Run submits to: every submission is recorded, then entered as usual."""

    __slots__ = ("_engine", "_recorder")

    def __init__(self, engine: "_native.Engine", recorder: Recorder) -> None:
        self._engine = engine
        self._recorder = recorder

    @staticmethod
    def prepare_call(kernel: "_native.Kernel", tensors: Sequence["_native.TensorArg"], access: Sequence[int],
                     scalars: Sequence[Any] = ()) -> "_native.PreparedCall":
        return _native.Engine.prepare_call(kernel, tensors, access, scalars)

    def kernel(self, name: str) -> "_native.Kernel":
        return self._engine.kernel(name)

    def register_host_kernel(self, name: str, fn: Callable[..., Any]) -> "_native.Kernel":
        return self._engine.register_host_kernel(name, fn)

    def submit_prepared(self, run: "_native.Run", call: "_native.PreparedCall") -> None:
        self._recorder.add(call)
        self._engine.submit_prepared(run, call)

    def submit(self, run: "_native.Run", kernel: "_native.Kernel", tensors: Sequence["_native.TensorArg"],
               access: Sequence[int], scalars: Sequence[Any] = ()) -> None:
        self.submit_prepared(run, _native.Engine.prepare_call(kernel, tensors, access, scalars))


class RecordingRun(Run):
    """engine.Run while a capture key is recorded: Scalars arrive as stand-ins, submissions are recorded."""

    def __init__(self, port: TaskPort, native: "_native.Run", dims: dict[str, int], arena: ScratchArena,
                 recorder: Recorder) -> None:
        super().__init__(port, native, dims, arena)
        self._recorder = recorder

    @property
    def id(self) -> int:
        raise CaptureError("run.id differs from run to run, so a captured program cannot read it in its "
                           "orchestration (prepare without capture=True to use it)")

    def submit(self, kernel: Any, *inputs: DeviceTensor, out: DeviceTensor | None = None, **scalars: Any) -> None:
        sources: dict[str, int] | None = None
        for name, value in scalars.items():
            if isinstance(value, ScalarStandIn):  # passed straight through: replayed with each run's value
                if sources is None:
                    sources = {}
                sources[name] = value._param
                scalars[name] = value._value
        self._recorder.pending = (kernel, inputs, out, dict(scalars), sources) if sources else None
        try:
            super().submit(kernel, *inputs, out=out, **scalars)
        finally:
            self._recorder.pending = None


# -- the table -------------------------------------------------------------------------------------
class TableEntry(Protocol):
    """What a RecordingTable keeps: a recording that knows its key and whether it left the table."""

    key: tuple[Any, ...]
    dropped: bool


_Entry = TypeVar("_Entry", bound=TableEntry)


class RecordingTable(Generic[_Entry]):
    """What a captured runtime of any level keeps: recordings by key under a lock, least recently used
    first, and the counters capture_stats() reports.

    A key is (base key, the parameters the recording read, their values): the base key is what binding
    fixes (a level's own choice), the rest what the orchestration read of its Scalars. Per base key the
    table knows which read sets its recordings have, so a run's candidates are one key per read set.
    """

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._lock = threading.Lock()  # runs launch from any thread
        self._table: OrderedDict[tuple[Any, ...], _Entry] = OrderedDict()
        # base key -> {read parameters: how many recordings have them}: the value tuples to look up
        self._read_sets: dict[tuple[Any, ...], dict[tuple[int, ...], int]] = {}
        self.hits = self.misses = self.evictions = self.invalidations = 0

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"hits": self.hits, "misses": self.misses, "entries": len(self._table),
                    "evictions": self.evictions, "invalidations": self.invalidations, "limit": self._limit}

    def clear(self) -> None:
        with self._lock:
            for entry in self._table.values():
                entry.dropped = True
            self._table.clear()
            self._read_sets.clear()

    def _candidates(self, base_key: tuple[Any, ...], values: Sequence[Any]) -> list[tuple[tuple[Any, ...], _Entry]]:
        """The recordings a run with this base key and these parameter values may replay, with their keys."""
        with self._lock:
            read_sets = self._read_sets.get(base_key)
            candidates = []
            for reads in read_sets or ():
                key = _table_key(base_key, reads, values)
                entry = self._table.get(key)
                if entry is not None:
                    candidates.append((key, entry))
        return candidates

    def _hit(self, key: tuple[Any, ...]) -> None:
        """A replay of `key`: counted, and its entry the most recently used."""
        with self._lock:
            if key in self._table:
                self._table.move_to_end(key)
            self.hits += 1

    def _miss(self) -> None:
        with self._lock:
            self.misses += 1

    def _store(self, base_key: tuple[Any, ...], reads: tuple[int, ...], values: Sequence[Any], entry: _Entry) -> None:
        """Keeps a recording that read `reads` of the parameters, whose values were `values`."""
        key = _table_key(base_key, reads, values)
        entry.key = key
        with self._lock:
            replaced = self._table.get(key)
            if replaced is None:
                sets = self._read_sets.setdefault(base_key, {})
                sets[reads] = sets.get(reads, 0) + 1
            else:
                replaced.dropped = True
            self._table[key] = entry
            self._table.move_to_end(key)
            while len(self._table) > self._limit:
                old, evicted = self._table.popitem(last=False)
                evicted.dropped = True
                self._forget(old)
                self.evictions += 1

    def _drop(self, key: tuple[Any, ...], invalidated: bool) -> None:
        with self._lock:
            dropped = self._table.pop(key, None)
            if dropped is not None:
                dropped.dropped = True
                self._forget(key)
                if invalidated:
                    self.invalidations += 1

    def _forget(self, key: tuple[Any, ...]) -> None:
        """key left the table: its read set goes when no recording of its base key has it. Lock held."""
        base_key, reads = key[0], key[1]
        sets = self._read_sets.get(base_key)
        if sets is None:
            return
        left = sets.get(reads, 0) - 1
        if left > 0:
            sets[reads] = left
        else:
            sets.pop(reads, None)
            if not sets:
                del self._read_sets[base_key]


class Capture(RecordingTable["Recorded"]):
    """A runtime's recordings, their keys and counters, and the replay of one run."""

    def __init__(self, program: "Program", limit: int) -> None:
        super().__init__(limit)
        self._program = program
        self._tensor_base = {i: b for b, i in enumerate(i for i, p in enumerate(program.params)
                                                         if isinstance(p.spec, TensorSpec))}
        self._scratch_base = len(self._tensor_base)
        self._scalar_params = scalar_params(program.params)
        self._symbols = program.symbols
        self._slot_bases: dict[int, list[Base]] = {}
        self.recording = threading.local()  # .active: a recording orchestrates on this thread

    def clear(self) -> None:
        super().clear()
        with self._lock:
            self._slot_bases.clear()

    # -- one run -----------------------------------------------------------------------------------
    def base_key(self, dims: dict[str, int], device_args: list[tuple[int, DeviceTensor]]) -> tuple[Any, ...]:
        """The part of a run's capture key that binding fixes: the dims, the resident arguments' layout."""
        return (tuple([dims[s] for s in self._symbols]), _device_layout(device_args) if device_args else ())

    def orchestrate(self, port: TaskPort, native: "_native.Run", slot: "Slot", call: "BoundCall",
                    fn_args: list[Any], device_args: list[tuple[int, DeviceTensor]],
                    copy_backs: list[tuple[int, int]]) -> tuple[Any, ...] | None:
        """Replays this run's key if it was recorded (returning the key's base_key; the copy backs, given
        as (parameter index, slot buffer address), are replayed too), else runs the function and records
        it (None: the caller submits the copy backs)."""
        base_key = self.base_key(call.dims, device_args)
        found = self._find_plain(base_key)
        force: set[int] = set()
        if found is None:
            found, force = self._find(base_key, [a.value for a in call.args])
        if found is not None:
            engine = port.engine
            assert engine is not None
            recorded, patches = found
            tensor_base = self._tensor_base
            engine.replay(native, self.plan(recorded, slot, device_args), patches,
                          [(tensor_base[i], addr) for i, addr in copy_backs])
            return base_key
        values = [a.value for a in call.args]
        recorded, reads = self._record(port, native, slot, call, fn_args, device_args, force)
        self._store(base_key, reads, values, recorded)
        return None

    @property
    def tensor_base(self) -> dict[int, int]:
        """Tensor parameter index -> its replay base."""
        return self._tensor_base

    def lookup(self, base_key: tuple[Any, ...], values: list[Any]
               ) -> tuple[Recorded, list[tuple[int, list[Any]]]] | None:
        """The recording of a run with this base key and parameter values and its scalar patches (a hit
        counted), or None, uncounted: the caller goes on to orchestrate(), which counts the miss."""
        found = self._find_plain(base_key)
        if found is None:
            found = self._find(base_key, values, count_miss=False)[0]
        return found

    def rehit(self, recorded: Recorded) -> bool:
        """Whether a recording found before is still the one its key replays (then a hit is counted)."""
        if recorded.dropped or (recorded.abs_allocs and not recorded.live()):
            return False
        self._hit(recorded.key)
        return True

    def _find_plain(self, base_key: tuple[Any, ...]) -> tuple[Recorded, list[tuple[int, list[Any]]]] | None:
        """The common case at once: a key whose recording read no Scalar and passes none through."""
        read_sets = self._read_sets.get(base_key)
        if read_sets is None or len(read_sets) != 1 or () not in read_sets:
            return None
        key = (base_key, (), ())
        entry = self._table.get(key)
        if entry is None or entry.sites or (entry.abs_allocs and not entry.live()):
            return None
        self._hit(key)
        return entry, _NO_PATCHES

    def _find(self, base_key: tuple[Any, ...], values: list[Any], count_miss: bool = True
              ) -> tuple[tuple[Recorded, list[tuple[int, list[Any]]]] | None, set[int]]:
        """(the recording and its scalar patches, or None; parameters a new recording must read)."""
        force: set[int] = set()
        for key, entry in self._candidates(base_key, values):
            if not entry.live():  # a resident tensor it reached was freed: record anew
                self._drop(key, invalidated=True)
                continue
            patches = []
            for site in entry.sites:
                bound = site.rebind(values)
                if list(bound.access) != site.access:  # the value changes what the kernel touches: read it
                    force.update(site.sources.values())
                    break
                patches.append((site.task, bound.scalars))
            else:
                self._hit(key)
                return (entry, patches), force
        if count_miss:
            self._miss()
        return None, force

    def _record(self, port: TaskPort, native: "_native.Run", slot: "Slot", call: "BoundCall", fn_args: list[Any],
                device_args: list[tuple[int, DeviceTensor]], force: set[int]) -> tuple[Recorded, tuple[int, ...]]:
        regions: list[tuple[int, int, int, int, int]] = []  # (base, alloc id, base address, origin, end)
        private = [self._scratch_base]
        devices = dict(device_args)
        for i, base in self._tensor_base.items():
            t = devices.get(i)
            if t is not None:
                begin, end = t._byte_range()
                regions.append((base, t._alloc.id, t._alloc.addr + begin, begin, end))
            else:
                buf = slot.buffers[self._program.params[i].name]
                regions.append((base, buf.id, buf.addr, 0, buf.size))
                private.append(base)
        if slot.scratch is not None:
            regions.append((self._scratch_base, slot.scratch.id, slot.scratch.addr, 0, slot.scratch.size))
        recorder = Recorder(port.owner, regions, private, self._scratch_base + 1, force)
        args = list(fn_args)
        stand_ins(self._scalar_params, args, recorder)
        arena = slot.arena
        arena.used = 0
        assert port.engine is not None
        run = RecordingRun(port.recording(_RecordingEngine(port.engine, recorder)), native, call.dims, arena,
                           recorder)
        self.recording.active = True
        try:
            self._program.invoke(run, args)
        finally:
            self.recording.active = False
            recorded = recorder.finish()
        return recorded, tuple(sorted(recorder.reads))

    def plan(self, recorded: Recorded, slot: "Slot", device_args: list[tuple[int, DeviceTensor]]
              ) -> "_native.ReplayPlan":
        """The recording materialized at this run's bases, built on a slot's first replay with these resident
        arguments."""
        where = (slot.index, *[(t._alloc.id, t._offset) for _, t in device_args]) if device_args else (slot.index,)
        plans = recorded.plans
        plan = plans.get(where)
        if plan is None:
            bases = self._bases(slot, device_args)
            bases.extend(recorded.abs_bases)
            plan = _native.ReplayPlan(recorded.native, bases)
            if len(plans) >= _PLANS_PER_RECORDING:  # resident arguments that keep changing: the oldest goes
                plans.pop(next(iter(plans)), None)
            plans[where] = plan
        return plan

    def _bases(self, slot: "Slot", device_args: list[tuple[int, DeviceTensor]]) -> list[Base]:
        """The replay's bases: the slot's buffers and scratch, the resident tensors passed for parameters."""
        cached = self._slot_bases.get(slot.index)
        if cached is None:
            cached = []
            for i in self._tensor_base:
                buf = slot.buffers[self._program.params[i].name]
                cached.append((buf.addr, buf.id, 0))
            scratch = slot.scratch
            cached.append((scratch.addr, scratch.id, 0) if scratch is not None else (0, 0, 0))
            self._slot_bases[slot.index] = cached
        bases = list(cached)
        for i, t in device_args:
            alloc, offset = t._alloc, t._offset
            bases[self._tensor_base[i]] = (alloc.addr + offset, alloc.id, offset)
        return bases


def _device_layout(device_args: list[tuple[int, DeviceTensor]]) -> tuple[Any, ...]:
    """The resident tensors' part of the key: their strides, and which share an allocation where."""
    if not device_args:
        return ()
    out = []
    for j, (i, t) in enumerate(device_args):
        shared, rel = -1, 0
        for i2, t2 in device_args[:j]:
            if t2._alloc is t._alloc:
                shared, rel = i2, t._offset - t2._offset
                break
        out.append((i, t._strides, shared, rel))
    return tuple(out)


def _table_key(base_key: tuple[Any, ...], reads: tuple[int, ...], values: Sequence[Any]) -> tuple[Any, ...]:
    """A recording's key in a RecordingTable: its base key, the parameters it read, their values."""
    return (base_key, reads, tuple([_key_value(values[i]) for i in reads]) if reads else ())


def _key_value(v: Any) -> Any:
    """A read value as a key: floats by their bits (0.0 and -0.0 differ; NaN equals itself)."""
    return v.hex() if type(v) is float else v
