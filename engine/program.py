"""Programs: an orchestration function plus the declared signature of its parameters."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from engine.specs import Scalar, TensorSpec

if TYPE_CHECKING:
    from engine.runtime import Runtime

__all__ = ["Program", "program", "Param"]


@dataclass(frozen=True)
class Param:
    name: str
    spec: TensorSpec | Scalar
    keyword_only: bool = False

    @property
    def is_tensor(self) -> bool:
        return isinstance(self.spec, TensorSpec)


class Program:
    """An orchestration function with a declared signature; prepare() it once, run it many times."""

    def __init__(self, fn: Callable[..., Any], callbacks: Mapping[str, int] | Sequence[str] | None = None) -> None:
        self.fn = fn
        self.name = getattr(fn, "__qualname__", repr(fn))
        self.params: tuple[Param, ...] = _parse_signature(fn)
        self._keyword_only = any(p.keyword_only for p in self.params)
        self.param_names: frozenset[str] = frozenset(p.name for p in self.params)
        self.callbacks: dict[str, int | None] = _parse_callbacks(self.name, callbacks)
        self.symbols: tuple[str, ...] = tuple(dict.fromkeys(
            s for p in self.params if isinstance(p.spec, TensorSpec) for s in p.spec.symbols))

    def invoke(self, run: Any, values: Sequence[Any]) -> Any:
        """Calls the orchestration function with one value per declared parameter."""
        if not self._keyword_only:  # the usual signature: no sorting per run
            return self.fn(run, *values)
        pos = [v for p, v in zip(self.params, values) if not p.keyword_only]
        kw = {p.name: v for p, v in zip(self.params, values) if p.keyword_only}
        return self.fn(run, *pos, **kw)

    def prepare(self, *, device: str = "cpu", workers: int | None = None, depth: int = 2,
                bounds: Mapping[str, int] | None = None, callbacks: Mapping[str, Callable[..., Any]] | None = None,
                memory_limit: int | None = None, scratch_bytes: int | None = None,
                spin_us: int | None = None) -> "Runtime":
        """Does all setup once (device, pool, `depth` slots) and returns a Runtime.

        spin_us: how long idle pool workers poll for work before sleeping
        (default 200; 0 when other processes compete for the cores).
        """
        from engine.runtime import Runtime

        return Runtime(self, device=device, workers=workers, depth=depth, bounds=bounds, callbacks=callbacks,
                       memory_limit=memory_limit, scratch_bytes=scratch_bytes, spin_us=spin_us)

    def __repr__(self) -> str:
        sig = ", ".join(f"{p.name}: {p.spec!r}" for p in self.params)
        return f"<Program {self.name}({sig})>"


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


def _parse_signature(fn: Callable[..., Any]) -> tuple[Param, ...]:
    if not callable(fn):
        raise TypeError(f"@engine.program needs a function, not {type(fn).__name__}")
    name = getattr(fn, "__qualname__", repr(fn))
    sig = inspect.signature(fn)
    # Annotations are evaluated objects (In(...) etc.); resolve string annotations too.
    try:
        hints = inspect.get_annotations(fn, eval_str=True)
    except Exception as e:  # a broken annotation names itself in the error
        raise TypeError(f"program {name}: cannot evaluate annotations: {e}") from e
    params = list(sig.parameters.values())
    if not params:
        raise TypeError(f"program {name}: the first parameter must receive the engine.Run")
    out: list[Param] = []
    for p in params[1:]:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise TypeError(f"program {name}: parameter '{p.name}': *args and **kwargs are not allowed")
        if p.default is not p.empty:
            raise TypeError(f"program {name}: parameter '{p.name}': defaults are not allowed "
                            "(an omitted Out is allocated; others are required)")
        spec = hints.get(p.name, p.annotation)
        if spec is p.empty:
            raise TypeError(f"program {name}: parameter '{p.name}' needs an annotation: In, Out, InOut or Scalar")
        if isinstance(spec, type) and spec is Scalar:
            spec = Scalar()
        if not isinstance(spec, (TensorSpec, Scalar)):
            raise TypeError(f"program {name}: parameter '{p.name}' is annotated {spec!r}; "
                            "expected In(...), Out(...), InOut(...) or Scalar(type)")
        out.append(Param(p.name, spec, p.kind == p.KEYWORD_ONLY))
    return tuple(out)


def _parse_callbacks(name: str, callbacks: Mapping[str, int] | Sequence[str] | None) -> dict[str, int | None]:
    if callbacks is None:
        return {}
    if isinstance(callbacks, str):
        raise TypeError(f"program {name}: callbacks must be a mapping or a list of names, not a string")
    items = callbacks.items() if isinstance(callbacks, Mapping) else ((c, None) for c in callbacks)
    out: dict[str, int | None] = {}
    for cname, arity in items:
        if not isinstance(cname, str) or not cname.isidentifier():
            raise ValueError(f"program {name}: callback name {cname!r} must be an identifier")
        if arity is not None and (isinstance(arity, bool) or not isinstance(arity, int) or arity < 0):
            raise ValueError(f"program {name}: callback '{cname}' arity must be a non-negative int")
        out[cname] = arity
    return out
