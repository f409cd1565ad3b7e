"""Distributed programs: an orchestration over chip workers plus its declared signature.

    @engine.distributed.program(callbacks={"gather": ("in", "in", "out")})
    def tp(orch, x: In(("B", 64)), w: PerWorker(In((64, 32))), y: Out(("B", 64))):
        parts = [orch.scratch(("B", 32)) for _ in range(orch.workers)]
        for i, p in enumerate(parts):
            orch.submit(matmul_program, x, w[i], p, worker=i)
        orch.submit_sub("gather", *parts, y)

The parameters are declared with the single-device specs (In, Out, InOut,
Scalar). PerWorker(spec) declares a parameter that takes one resident tensor
per chip worker (a list or tuple, the i-th pinned to worker i).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

from engine.program import Param, Program, ProgramBase, check_callback_name
from engine.specs import In, InOut, Out, Scalar, TensorSpec

if TYPE_CHECKING:
    from engine.distributed.runtime import DistributedRuntime
    from engine.distributed.transport import Transport

__all__ = ["DistributedProgram", "PerWorker", "program", "READ", "WRITE", "READWRITE"]

READ, WRITE, READWRITE = 1, 2, 3

# Why run.host() fails inside a sub-program: host callbacks belong to the distributed orchestration.
NO_HOST_CALLBACKS = ("sub-programs of a distributed program have no host callbacks; use orch.submit_sub() in the "
                     "distributed orchestration")
_TAGS: dict[Any, int] = {"in": READ, "out": WRITE, "inout": READWRITE, In: READ, Out: WRITE, InOut: READWRITE}


class PerWorker:
    """A parameter that takes one resident tensor per chip worker: PerWorker(In((384, 1536))).

    The argument is a sequence of `workers` DeviceTensors of the runtime,
    the i-th resident on worker i, all of the declared shape and dtype. The
    orchestration receives it as a tuple.
    """

    __slots__ = ("spec",)

    def __init__(self, spec: TensorSpec) -> None:
        if not isinstance(spec, TensorSpec):
            raise TypeError(f"PerWorker takes In(...), Out(...) or InOut(...), not {spec!r}")
        self.spec = spec

    @property
    def symbols(self) -> tuple[str, ...]:
        return self.spec.symbols

    def __repr__(self) -> str:
        return f"PerWorker({self.spec!r})"


class DistributedProgram(ProgramBase):
    """An orchestration over chip workers with a declared signature; prepare() it once, run it many times."""

    _what = "distributed program"
    _decorator = "@engine.distributed.program"
    _receives = "the orchestrator"
    _spec_types = (TensorSpec, Scalar, PerWorker)
    _spec_names = "In, Out, InOut, PerWorker or Scalar"
    _spec_forms = "In(...), Out(...), InOut(...), PerWorker(...) or Scalar(type)"
    _defaults_note = ""

    def __init__(self, fn: Callable[..., Any], callbacks: Mapping[str, Sequence[Any]] | None = None,
                 programs: Iterable[Program] = ()) -> None:
        super().__init__(fn)
        self.callbacks: dict[str, tuple[int, ...]] = _parse_callbacks(self.name, callbacks)
        self.programs: tuple[Program, ...] = tuple(programs)
        for p in self.programs:
            if not isinstance(p, Program):
                raise TypeError(f"distributed program {self.name}: programs= takes engine programs, not {p!r}")

    @property
    def callback_names(self) -> tuple[str, ...]:
        return tuple(self.callbacks)

    def callback_arity(self, name: str) -> int | None:
        return len(self.callbacks[name])

    def prepare(self, *, workers: int, depth: int = 2, bounds: Mapping[str, int] | None = None,
                callbacks: Mapping[str, Callable[..., Any]] | None = None, worker_threads: int | None = None,
                memory_limit: int | None = None, scratch_bytes: int | None = None, start_method: str = "spawn",
                startup_timeout: float = 60.0, transport: "Transport | None" = None,
                capture: bool = False, capture_limit: int = 256) -> "DistributedRuntime":
        """Starts `workers` chip-worker processes once, registers every sub-program, returns the runtime.

        worker_threads: executors per worker, its serving thread and
        worker_threads - 1 pool threads (default: the cores divided among the
        workers). memory_limit: device bytes per worker.
        scratch_bytes: shared scratch per slot for orch.scratch() (default:
        measured by a planning pass at the bounds). start_method: "spawn" or
        "forkserver" (never fork: the host has threads). transport: how
        workers are reached (default: a ProcessTransport of `workers` local
        processes started with start_method; RayTransport(...) places them
        on Ray actors, on one machine or across a cluster). A failure at any
        point of setup stops every process already started, removes the
        shared memory and re-raises the original error.

        capture: record the orchestration once per capture key and slot and
        replay its submissions after (engine.distributed.capture says what a
        captured program may do; a Scalar passed straight into a sub-program
        is replayed with each run's value, one the function reads is part of
        the key);
        capture_limit: how many recordings the runtime keeps.
        """
        from engine.distributed.runtime import DistributedRuntime

        return DistributedRuntime(self, workers=workers, depth=depth, bounds=bounds, callbacks=callbacks,
                                  worker_threads=worker_threads, memory_limit=memory_limit,
                                  scratch_bytes=scratch_bytes, start_method=start_method,
                                  startup_timeout=startup_timeout, transport=transport, capture=capture,
                                  capture_limit=capture_limit)


def program(fn: Callable[..., Any] | None = None, *, callbacks: Mapping[str, Sequence[Any]] | None = None,
            programs: Iterable[Program] = ()) -> Any:
    """Decorator: turns an orchestration function into a DistributedProgram.

    The first parameter receives the Orchestrator (`orch`). callbacks
    declares the host callbacks that orch.submit_sub(name, *tensors) runs,
    each with the access tag of every tensor it takes: "in", "out" or
    "inout" (or In, Out, InOut themselves); the functions are bound at
    prepare(callbacks=...). programs lists single-device programs that the
    planning pass at the bounds does not submit but runs may (they are
    registered on every worker at prepare too).
    """
    if fn is None:
        return lambda f: DistributedProgram(f, callbacks, programs)
    return DistributedProgram(fn, callbacks, programs)


def tensor_spec(p: Param) -> TensorSpec:
    """The tensor spec of a tensor parameter (the inner one of a PerWorker)."""
    spec: Any = p.spec
    return spec.spec if isinstance(spec, PerWorker) else spec


def _parse_callbacks(name: str, callbacks: Mapping[str, Sequence[Any]] | None) -> dict[str, tuple[int, ...]]:
    if callbacks is None:
        return {}
    if not isinstance(callbacks, Mapping):
        raise TypeError(f"distributed program {name}: callbacks must map names to access tags, "
                        "e.g. {'gather': ('in', 'in', 'out')}")
    out: dict[str, tuple[int, ...]] = {}
    for cname, tags in callbacks.items():
        check_callback_name(f"distributed program {name}", cname)
        if isinstance(tags, str) or not isinstance(tags, Sequence):
            raise TypeError(f"distributed program {name}: callback '{cname}' needs a sequence of access tags "
                            f"('in', 'out', 'inout'), not {tags!r}")
        access = []
        for t in tags:
            try:
                access.append(_TAGS[t])
            except (KeyError, TypeError):
                raise ValueError(f"distributed program {name}: callback '{cname}': access tag {t!r} is not "
                                 "'in', 'out' or 'inout'") from None
        out[cname] = tuple(access)
    return out
