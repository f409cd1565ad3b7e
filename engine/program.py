"""Programs: an orchestration function plus the declared signature of its parameters."""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from engine.specs import Scalar, TensorSpec

if TYPE_CHECKING:
    from engine.runtime import Runtime

__all__ = ["Program", "ProgramBase", "program", "Param", "check_callback_name"]


@dataclass(frozen=True)
class Param:
    name: str
    spec: Any  # TensorSpec | Scalar, or a level's own spec (engine.distributed.PerWorker)
    keyword_only: bool = False

    @property
    def is_tensor(self) -> bool:
        return isinstance(self.spec, TensorSpec)

    @property
    def symbols(self) -> tuple[str, ...]:
        return tuple(getattr(self.spec, "symbols", ()))


class ProgramBase(ABC):
    """What every kind of program shares: the function, its parsed signature, its symbols, invoke().

    A subclass says what it is called in errors and which parameter specs it
    takes, and declares its host callbacks (callback_names, callback_arity).
    """

    _what = "program"  # how errors name it
    _decorator = "@engine.program"
    _receives = "the engine.Run"  # what the first parameter receives
    _spec_types: tuple[type, ...] = (TensorSpec, Scalar)
    _spec_names = "In, Out, InOut or Scalar"
    _spec_forms = "In(...), Out(...), InOut(...) or Scalar(type)"
    _defaults_note = " (an omitted Out is allocated; others are required)"

    def __init__(self, fn: Callable[..., Any]) -> None:
        if not callable(fn):
            raise TypeError(f"{self._decorator} needs a function, not {type(fn).__name__}")
        self.fn = fn
        self.name: str = getattr(fn, "__qualname__", repr(fn))
        self.params: tuple[Param, ...] = self._parse_signature(fn)
        self._keyword_only = any(p.keyword_only for p in self.params)
        self.param_names: frozenset[str] = frozenset(p.name for p in self.params)
        self.symbols: tuple[str, ...] = tuple(dict.fromkeys(s for p in self.params for s in p.symbols))

    def invoke(self, ctx: Any, values: Sequence[Any]) -> Any:
        """Calls the orchestration function with its context and one value per declared parameter."""
        if not self._keyword_only:  # the usual signature: no sorting per run
            return self.fn(ctx, *values)
        pos = [v for p, v in zip(self.params, values) if not p.keyword_only]
        kw = {p.name: v for p, v in zip(self.params, values) if p.keyword_only}
        return self.fn(ctx, *pos, **kw)

    @property
    @abstractmethod
    def callback_names(self) -> tuple[str, ...]:
        """The host callbacks the program declares (bound at prepare)."""

    @abstractmethod
    def callback_arity(self, name: str) -> int | None:
        """How many tensors callback `name` takes (None: any number)."""

    def _parse_signature(self, fn: Callable[..., Any]) -> tuple[Param, ...]:
        where = f"{self._what} {self.name}"
        # Annotations are evaluated objects (In(...) etc.); resolve string annotations too.
        try:
            hints = inspect.get_annotations(fn, eval_str=True)
        except Exception as e:  # a broken annotation names itself in the error
            raise TypeError(f"{where}: cannot evaluate annotations: {e}") from e
        params = list(inspect.signature(fn).parameters.values())
        if not params:
            raise TypeError(f"{where}: the first parameter must receive {self._receives}")
        out: list[Param] = []
        for p in params[1:]:
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise TypeError(f"{where}: parameter '{p.name}': *args and **kwargs are not allowed")
            if p.default is not p.empty:
                raise TypeError(f"{where}: parameter '{p.name}': defaults are not allowed{self._defaults_note}")
            spec = hints.get(p.name, p.annotation)
            if spec is p.empty:
                raise TypeError(f"{where}: parameter '{p.name}' needs an annotation: {self._spec_names}")
            if spec is Scalar:
                spec = Scalar()
            if not isinstance(spec, self._spec_types):
                raise TypeError(f"{where}: parameter '{p.name}' is annotated {spec!r}; expected {self._spec_forms}")
            out.append(Param(p.name, spec, p.kind == p.KEYWORD_ONLY))
        return tuple(out)

    def __repr__(self) -> str:
        sig = ", ".join(f"{p.name}: {p.spec!r}" for p in self.params)
        return f"<{type(self).__name__} {self.name}({sig})>"


class Program(ProgramBase):
    """An orchestration function with a declared signature; prepare() it once, run it many times."""

    def __init__(self, fn: Callable[..., Any], callbacks: Mapping[str, int] | Sequence[str] | None = None) -> None:
        super().__init__(fn)
        self.callbacks: dict[str, int | None] = _parse_callbacks(self.name, callbacks)

    @property
    def callback_names(self) -> tuple[str, ...]:
        return tuple(self.callbacks)

    def callback_arity(self, name: str) -> int | None:
        return self.callbacks[name]

    def prepare(self, *, device: str = "cpu", workers: int | None = None, depth: int = 2,
                bounds: Mapping[str, int] | None = None, callbacks: Mapping[str, Callable[..., Any]] | None = None,
                memory_limit: int | None = None, scratch_bytes: int | None = None,
                spin_us: int | None = None, capture: bool = False, capture_limit: int = 256) -> "Runtime":
        """Does all setup once (device, pool, `depth` slots) and returns a Runtime.

        workers: pool workers (default: one per core; the host thread that
        waits for a run works beside them, so no core is kept for it; pass
        fewer to leave cores to other work).
        spin_us: how long idle pool workers poll for work before sleeping
        (default 200; 0 when other processes compete for the cores).
        capture: record the orchestration once per capture key and replay it
        natively after (engine.capture says what a captured program may do);
        capture_limit: how many recordings the runtime keeps (least recently
        used dropped first).
        """
        from engine.runtime import Runtime

        return Runtime(self, device=device, workers=workers, depth=depth, bounds=bounds, callbacks=callbacks,
                       memory_limit=memory_limit, scratch_bytes=scratch_bytes, spin_us=spin_us, capture=capture,
                       capture_limit=capture_limit)


def program(fn: Callable[..., Any] | None = None, *,
            callbacks: Mapping[str, int] | Sequence[str] | None = None) -> Any:
    """Decorator: turns an orchestration function into a Program.

    The first parameter receives the engine.Run; every other parameter is
    annotated with In(...), Out(...), InOut(...) or Scalar(type). Host callbacks
    the program calls with run.host(name, ...) are declared as
    callbacks={name: number_of_tensors}.
    """
    if fn is None:
        return lambda f: Program(f, callbacks)
    return Program(fn, callbacks)


def check_callback_name(program_what: str, name: Any) -> str:
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"{program_what}: callback name {name!r} must be an identifier")
    return name


def _parse_callbacks(name: str, callbacks: Mapping[str, int] | Sequence[str] | None) -> dict[str, int | None]:
    if callbacks is None:
        return {}
    if isinstance(callbacks, str):
        raise TypeError(f"program {name}: callbacks must be a mapping or a list of names, not a string")
    items = callbacks.items() if isinstance(callbacks, Mapping) else ((c, None) for c in callbacks)
    out: dict[str, int | None] = {}
    for cname, arity in items:
        check_callback_name(f"program {name}", cname)
        if arity is not None and (isinstance(arity, bool) or not isinstance(arity, int) or arity < 0):
            raise ValueError(f"program {name}: callback '{cname}' arity must be a non-negative int")
        out[cname] = arity
    return out
