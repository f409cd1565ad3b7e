"""The `orch` object: what a distributed orchestration function receives for one run.

The orchestration describes the run's work; it touches no data itself.
Every orch.submit() and orch.submit_sub() is validated at once (a bad
argument raises TypeError or ValueError right there) and recorded. Nothing
reaches a worker until the orchestration function has returned: then the run
is sealed and its submissions enter the dependency graph together. So a run
whose orchestration raises leaves no trace, and a resident tensor passed to
a program on the wrong worker raises ValueError before anything runs.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from engine.binding import bind_call
from engine.capture import ScalarStandIn
from engine.distributed.graph import HOST, Submission
from engine.distributed.memory import SharedAllocation, none_freed
from engine.distributed.program import READ, WRITE
from engine.distributed.protocol import with_scalars
from engine.errors import CaptureError
from engine.hostarrays import is_host_array
from engine.orchestration import OrchestrationContext, ScratchArena
from engine.program import Program
from engine.specs import Scalar
from engine.tensor import DeviceTensor

if TYPE_CHECKING:
    from engine.distributed.capture import PassedScalar
    from engine.distributed.runs import RunRecord

__all__ = ["Orchestrator", "Registry", "NO_BOUNDS"]


class _NoBounds(dict[str, int]):
    """Bounds during the planning pass: none yet (the pass measures them)."""

    def __missing__(self, key: str) -> int:
        return sys.maxsize


NO_BOUNDS: Mapping[str, int] = _NoBounds()


class Registry:
    """The sub-programs a runtime registered on its workers: program -> (key, bounds).

    It also remembers validated submissions by the layout of their
    arguments (see _Bound): orchestration submits the same layouts run after
    run, and re-binding them is most of the host's work per submission.
    """

    _MAX_BOUND = 512

    def __init__(self, entries: Mapping[int, tuple[int, Program, dict[str, int]]] | None = None) -> None:
        self._entries: dict[int, tuple[int, Program, dict[str, int]]] = dict(entries or {})
        self.bound: dict[tuple[Any, ...], _Bound] = {}

    def remember(self, key: tuple[Any, ...], entry: "_Bound") -> None:
        if len(self.bound) >= self._MAX_BOUND:
            self.bound.clear()
        self.bound[key] = entry

    def bounds(self, program: Program) -> Mapping[str, int]:
        entry = self._entries.get(id(program))
        if entry is None:
            raise ValueError(f"program {program.name} was not registered at prepare: the planning pass at the "
                             "bounds did not submit it; list it in @engine.distributed.program(programs=[...])")
        return entry[2]

    def key(self, program: Program, dims: dict[str, int]) -> int:
        return self._entries[id(program)][0]


class Orchestrator(OrchestrationContext):
    """One run's orchestration context: submit sub-programs and host callbacks, carve shared scratch.

    owner: the DistributedRuntime (None while planning), whose memory the
    run's tensors must be; workers: how many chip workers there are; arena:
    the slot's shared scratch; dims: this run's symbols.
    """

    def __init__(self, owner: object | None, workers: int,
                 callbacks: Mapping[str, tuple[tuple[int, ...], Callable[..., Any] | None]], registry: Registry,
                 run: "RunRecord | None", region: SharedAllocation, arena: ScratchArena,
                 dims: dict[str, int], recording: bool = False) -> None:
        super().__init__(dims, arena)
        self._owner = owner
        self._workers = workers
        self._callbacks = callbacks
        self._registry = registry
        self._run = run
        self._region = region  # the slot's shared region (a stand-in while planning)
        self._subs: list[Submission] = []
        self._open = True
        self._recording = recording  # a captured runtime records this orchestration (engine.distributed.capture)
        # While recording: per submission index, the Scalar parameters it was passed straight through
        # (engine.distributed.capture.PassedScalar), so that replays send each run's value.
        self.passed: dict[int, tuple[PassedScalar, ...]] = {}

    @property
    def workers(self) -> int:
        """Chip workers: valid worker= values are 0 .. workers - 1."""
        return self._workers

    @property
    def planning(self) -> bool:
        """True during prepare()'s planning pass (nothing runs)."""
        return self._run is None

    @property
    def run_id(self) -> int:
        if self._recording:
            raise CaptureError("a captured program cannot read orch.run_id: its replays are other runs (prepare "
                               "without capture=True to use it)")
        return self._run.id if self._run is not None else 0

    # -- submissions ----------------------------------------------------------------------------
    def submit(self, program: Program, *args: Any, worker: int, **kwargs: Any) -> None:
        """Runs a single-device program on chip worker `worker` once this run is sealed.

        Arguments are tensors of this run (its parameters, orch.scratch(),
        views of either) or resident tensors of that worker, and scalars.
        Every Out must be passed. Access follows the program's In / Out /
        InOut tags.
        """
        self._check_open()
        if not self._recording:
            self._submit(program, worker, args, kwargs)
            return
        if isinstance(worker, ScalarStandIn):
            worker = worker._read()  # where the work goes is part of the key
        args, kwargs, passed = _passed_scalars(program, args, kwargs)
        index = len(self._subs)
        self._submit(program, worker, args, kwargs)
        if passed and len(self._subs) > index:  # noted once the submission is in (a refused one is not)
            self.passed[index] = passed

    def _submit(self, program: Program, worker: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        layout = _layout(program, worker, args, kwargs) if self._run is not None else None
        if layout is not None:
            hit = self._registry.bound.get(layout)
            if hit is not None and hit.live():
                descs = hit.with_scalars(args, kwargs)
                payload = (hit.key, hit.dims, descs, hit.access)
                self._subs.append(Submission(self._run, len(self._subs), worker, program.name,  # type: ignore[arg-type]
                                             list(hit.accesses), payload))
                return
        if not isinstance(program, Program):
            raise TypeError(f"orch.submit needs a program made with @engine.program, not {program!r}")
        w = self._check_worker(worker)
        for v in (*args, *kwargs.values()):
            if is_host_array(v):
                raise TypeError(f"orch.submit({program.name}): a host array cannot go to a worker directly; pass "
                                "the run's tensors, orch.scratch() tensors or resident tensors")
        call = bind_call(self._pinned_check(w), program, args, kwargs, self._registry.bounds(program))
        arg_descs: list[tuple[Any, ...]] = []
        arg_access: list[int] = []
        accesses = []
        for a in call.args:
            spec = a.param.spec
            if isinstance(spec, Scalar):
                arg_descs.append(("v", a.value))
                arg_access.append(0)
                continue
            t = a.value
            if t is None:
                raise TypeError(f"orch.submit({program.name}): pass output '{a.param.name}' (e.g. an "
                                "orch.scratch() tensor); sub-program outputs are not allocated")
            begin, end = t._byte_range()
            accesses.append((t._alloc, begin, end, spec.writes))
            arg_descs.append(_describe(t))
            arg_access.append((READ if spec.reads else 0) | (WRITE if spec.writes else 0))
        key = self._registry.key(program, call.dims)
        if self._run is not None:
            payload = (key, dict(call.dims), tuple(arg_descs), tuple(arg_access))
            self._subs.append(Submission(self._run, len(self._subs), w, program.name, list(accesses), payload))
            if layout is not None:
                self._registry.remember(layout, _Bound(program, key, dict(call.dims), tuple(arg_descs),
                                                       tuple(arg_access), accesses, args, kwargs))

    def submit_sub(self, name: str, *tensors: DeviceTensor) -> None:
        """Runs host callback `name` (bound at prepare) as fn(*arrays) once this run is sealed.

        The tensors are tensors of this run; the callback gets numpy views of
        their shared memory (read-only for "in" tags).
        """
        self._check_open()
        entry = self._callbacks.get(name)
        if entry is None:
            raise ValueError(f"orch.submit_sub: '{name}' is not a declared callback (declared: "
                             f"{sorted(self._callbacks)})")
        tags, fn = entry
        if len(tensors) != len(tags):
            raise TypeError(f"orch.submit_sub: callback '{name}' takes {len(tags)} tensors, got {len(tensors)}")
        accesses = []
        for i, t in enumerate(tensors):
            what = f"callback '{name}' argument {i}"
            if not isinstance(t, DeviceTensor):
                raise TypeError(f"{what}: expected a tensor of the run, not {type(t).__name__}")
            alloc = t._alloc
            if not isinstance(alloc, SharedAllocation) and alloc.owner is self._owner:
                raise ValueError(f"{what}: the tensor is resident on worker {alloc.worker}; host callbacks take "
                                 "the run's shared tensors")
            self._check_shared(t, what)
            begin, end = t._byte_range()
            accesses.append((alloc, begin, end, bool(tags[i] & WRITE)))
        if self._run is not None:
            payload = (fn, tuple(zip(tensors, tags)))
            self._subs.append(Submission(self._run, len(self._subs), HOST, f"callback:{name}", accesses, payload))

    # -- memory -------------------------------------------------------------------------------------
    def scratch(self, shape: Sequence[int | str], dtype: Any = "float32") -> DeviceTensor:
        """A tensor of this run's shared scratch (symbols resolve to this run's dims)."""
        self._check_open()
        return super().scratch(shape, dtype)

    # -- for the runtime ---------------------------------------------------------------------------
    def seal(self) -> list[Submission]:
        """Ends the orchestration: the recorded submissions, in submission order."""
        self._open = False
        subs, self._subs = self._subs, []
        return subs

    def _check_open(self) -> None:
        if not self._open:
            raise RuntimeError(f"the orchestration of run {self.run_id} is over: orch is used only inside it")

    def _check_worker(self, worker: Any) -> int:
        if isinstance(worker, bool) or not isinstance(worker, int):
            raise TypeError(f"orch.submit: worker must be an int, not {type(worker).__name__}")
        if not 0 <= worker < self._workers:
            raise ValueError(f"orch.submit: worker {worker} does not exist (workers: 0..{self._workers - 1})")
        return worker

    def _pinned_check(self, worker: int) -> Callable[[Any, str], None]:
        """The check bind_call runs on each tensor argument of a sub-program bound for `worker`."""

        def check(t: Any, what: str) -> None:
            if not isinstance(t, DeviceTensor):
                raise TypeError(f"{what}: expected a tensor, not {type(t).__name__}")
            alloc = t._alloc
            if isinstance(alloc, SharedAllocation):
                self._check_shared(t, what)
                return
            if alloc.kind != "planning":
                if alloc.owner is not self._owner:
                    raise ValueError(f"{what}: the tensor belongs to another runtime")
                if alloc.freed:
                    raise ValueError(f"{what}: the tensor was freed")
            if alloc.worker != worker:
                raise ValueError(f"{what}: the tensor is resident on worker {alloc.worker}, so it cannot be passed "
                                 f"to a program on worker {worker}")

        return check

    def _check_shared(self, t: DeviceTensor, what: str) -> None:
        alloc = t._alloc
        if not isinstance(alloc, SharedAllocation):
            raise ValueError(f"{what}: the tensor belongs to another runtime")
        if alloc.kind == "planning":
            return
        if alloc.owner is not self._owner:
            raise ValueError(f"{what}: the tensor belongs to another runtime")
        if alloc is not self._region:
            raise ValueError(f"{what}: the tensor belongs to another run (tensors of a run live as long as its "
                             "orchestration)")


class _Bound:
    """A validated submission, reusable by any later one whose arguments have the same layout.

    The layout key (see _layout) names every tensor argument by its
    allocation, offset, shape, strides and dtype, and every scalar by its
    type, so the same key means the same checks pass and the same
    descriptors result; only scalar values are taken anew (and checked).
    The entry holds its allocations, so their ids cannot be reused while it
    lives; one that was freed since makes the entry unusable (the full path
    then raises).
    """

    __slots__ = ("key", "dims", "descs", "access", "accesses", "allocs", "scalars")

    def __init__(self, program: Program, key: int, dims: dict[str, int], descs: tuple[tuple[Any, ...], ...],
                 access: tuple[int, ...], accesses: list[Any], args: tuple, kwargs: dict[str, Any]) -> None:
        self.key = key
        self.dims = dims
        self.descs = descs
        self.access = access
        self.accesses = tuple(accesses)
        self.allocs = tuple(a[0] for a in accesses)
        # (descriptor index, where the value comes from: a position or a keyword, its parameter)
        self.scalars: tuple[tuple[int, int | str, Any], ...] = tuple(
            (i, i if i < len(args) else p.name, p) for i, p in enumerate(program.params)
            if isinstance(p.spec, Scalar))

    def live(self) -> bool:
        return none_freed(self.allocs)

    def with_scalars(self, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], ...]:
        if not self.scalars:
            return self.descs
        patches = []
        for i, source, p in self.scalars:
            value = args[source] if isinstance(source, int) else kwargs[source]
            patches.append((i, p.spec.check(p.name, value)))
        return with_scalars(self.descs, patches)  # sent as self.descs' body and the values


def _passed_scalars(program: Any, args: tuple, kwargs: dict[str, Any]
                    ) -> tuple[tuple, dict[str, Any], tuple["PassedScalar", ...]]:
    """A recorded submission's arguments with the Scalar stand-ins given to the sub-program's Scalars replaced
    by their values, and where each came from: (argument descriptor index, sub-program parameter, the
    orchestration's parameter index). A stand-in given anywhere else is left to the checks (it is no tensor)."""
    if not isinstance(program, Program):
        return args, kwargs, ()
    params = program.params
    by_name = {p.name: i for i, p in enumerate(params)}
    passed: list[PassedScalar] = []
    plain_args = list(args)
    for i, v in enumerate(args):
        if isinstance(v, ScalarStandIn) and i < len(params) and isinstance(params[i].spec, Scalar):
            plain_args[i] = v._value
            passed.append((i, params[i], v._param))
    plain_kwargs = dict(kwargs)
    for name, v in kwargs.items():
        i = by_name.get(name, -1)
        if isinstance(v, ScalarStandIn) and i >= 0 and isinstance(params[i].spec, Scalar):
            plain_kwargs[name] = v._value
            passed.append((i, params[i], v._param))
    if not passed:
        return args, kwargs, ()
    return tuple(plain_args), plain_kwargs, tuple(passed)


def _layout(program: Any, worker: Any, args: tuple, kwargs: dict[str, Any]) -> tuple[Any, ...] | None:
    """The layout key of a submission, or None when an argument is neither a tensor nor a number."""
    key: list[Any] = [id(program), worker, len(args)]
    for v in args:
        if isinstance(v, DeviceTensor):
            key.append(v._key if v._key is not None else v._make_key())
        elif isinstance(v, (int, float)):
            key.append(type(v))
        else:
            return None
    for name, v in kwargs.items():
        if isinstance(v, DeviceTensor):
            key.append((name, v._key if v._key is not None else v._make_key()))
        elif isinstance(v, (int, float)):
            key.append((name, type(v)))
        else:
            return None
    return tuple(key)


def _describe(t: DeviceTensor) -> tuple[Any, ...]:
    """The argument descriptor of a tensor (see protocol)."""
    alloc = t._alloc
    key = alloc.region if isinstance(alloc, SharedAllocation) else alloc.id
    return ("s" if isinstance(alloc, SharedAllocation) else "d", key, t._offset, t.shape, t.strides, t.dtype.name)
