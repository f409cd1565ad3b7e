"""The planning pass of prepare(): what a distributed program needs, found by running it at its bounds.

The orchestration runs once on stand-in tensors at the bounds, with nothing
behind them and nothing sent anywhere. It yields the sub-programs to
register on the workers (with the largest dims each was submitted with: its
bounds), the shared scratch a slot needs, and the device scratch each
sub-program's own orchestration carves (from a planning pass of that
program, as engine.Runtime does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from engine import _native
from engine.distributed.memory import SharedAllocation
from engine.distributed.orchestrator import NO_BOUNDS, Orchestrator, Registry
from engine.distributed.program import NO_HOST_CALLBACKS, DistributedProgram, PerWorker
from engine.orchestration import ScratchArena
from engine.port import TaskPort
from engine.program import Program
from engine.run import Run
from engine.specs import Scalar, TensorSpec
from engine.tensor import Allocation, DeviceTensor, contiguous_strides

__all__ = ["Plan", "plan"]

_NOTHING = 1 << 62  # the size of a stand-in allocation: nothing behind it is ever touched


@dataclass(frozen=True)
class Plan:
    programs: tuple[Program, ...]  # registered on every worker; a Call names one by its index here
    bounds: tuple[dict[str, int], ...]
    scratch: tuple[int, ...]  # device scratch per run of each program on a worker
    shared_scratch: int  # orch.scratch() bytes per slot


class _Recorder(Registry):
    """The registry during planning: every program submitted, with the largest dims it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.order: list[Program] = []
        self.dims: dict[int, dict[str, int]] = {}

    def bounds(self, program: Program) -> Mapping[str, int]:
        return NO_BOUNDS

    def key(self, program: Program, dims: dict[str, int]) -> int:
        seen = self.dims.get(id(program))
        if seen is None:
            self.order.append(program)
            seen = self.dims[id(program)] = {}
        for sym, v in dims.items():
            seen[sym] = max(seen.get(sym, 0), v)
        return -1


def _shape(spec: TensorSpec, dims: Mapping[str, int]) -> tuple[int, ...]:
    return tuple(d if isinstance(d, int) else dims[d] for d in spec.shape)


def plan(prog: DistributedProgram, workers: int, bounds: dict[str, int], threads: int) -> Plan:
    dims = {s: bounds[s] for s in prog.symbols}
    args: list[Any] = []
    for p in prog.params:  # each parameter its own stand-in allocation, as in a real run
        spec: Any = p.spec
        if isinstance(spec, Scalar):
            args.append(spec.type())
        elif isinstance(spec, PerWorker):
            shape = _shape(spec.spec, dims)
            args.append(tuple(DeviceTensor(_stand_in(i), 0, shape, contiguous_strides(shape), spec.spec.dtype)
                              for i in range(workers)))
        else:
            shape = _shape(spec, dims)
            args.append(DeviceTensor(SharedAllocation(None, _NOTHING, "planning", -1, None),
                                     0, shape, contiguous_strides(shape), spec.dtype))
    recorder = _Recorder()
    region = SharedAllocation(None, _NOTHING, "planning", -1, None)
    callbacks: dict[str, tuple[tuple[int, ...], Any]] = {name: (tags, None) for name, tags in prog.callbacks.items()}
    orch = Orchestrator(None, workers, callbacks, recorder, None, region, ScratchArena(region, 0, None), dims)
    try:
        prog.invoke(orch, args)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{prog.name}: the planning pass at the bounds {bounds} failed: {e}") from e
    orch.seal()

    programs = list(recorder.order) + [p for p in prog.programs if id(p) not in recorder.dims]
    sub_bounds, scratch = [], []
    for sub in programs:
        if sub.callbacks:
            raise ValueError(f"sub-program {sub.name} declares host callbacks {sorted(sub.callbacks)}; in a "
                             "distributed program host callbacks run through orch.submit_sub()")
        b = dict(recorder.dims.get(id(sub), {}))
        missing = [s for s in sub.symbols if s not in b]
        if missing:
            raise ValueError(f"sub-program {sub.name} was never submitted by the planning pass at the bounds, so "
                             f"its symbols {missing} have no bounds")
        sub_bounds.append(b)
        scratch.append(_plan_device_scratch(sub, b, threads))
    return Plan(tuple(programs), tuple(sub_bounds), tuple(scratch), orch.scratch_used)


def _stand_in(worker: int = 0) -> Allocation:
    """A planning pass's stand-in for device memory: nothing behind it is ever touched."""
    return Allocation(None, _native.Buffer(0, 0, 0, _NOTHING), "planning", worker)


def _plan_device_scratch(sub: Program, bounds: dict[str, int], threads: int) -> int:
    """The scratch one run of `sub` carves at its bounds (engine.Runtime's planning pass, on a worker's pool)."""
    port = TaskPort(None, None, threads, no_callbacks=NO_HOST_CALLBACKS)
    args: list[Any] = []
    for p in sub.params:
        if isinstance(p.spec, TensorSpec):
            shape = _shape(p.spec, bounds)
            args.append(DeviceTensor(_stand_in(), 0, shape, contiguous_strides(shape), p.spec.dtype))
        else:
            args.append(p.spec.type())
    run = Run(port, None, {s: bounds[s] for s in sub.symbols}, ScratchArena(_stand_in()))
    try:
        sub.invoke(run, args)
    except (TypeError, ValueError) as e:
        raise type(e)(f"sub-program {sub.name}: the planning pass at the bounds {bounds} failed: {e}") from e
    return run.scratch_used
