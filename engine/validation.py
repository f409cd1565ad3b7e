"""Checks of prepare()'s settings, shared by every runtime: each raises before anything is set up."""

from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping, Protocol

__all__ = ["check_positive_int", "check_non_negative_int", "check_optional", "check_bounds", "check_callbacks"]


class _Declares(Protocol):
    """What the checks read of a program: its name, its symbols and the host callbacks it declares."""

    name: str
    symbols: tuple[str, ...]

    def callback_arity(self, name: str) -> int | None: ...

    @property
    def callback_names(self) -> tuple[str, ...]: ...


def check_positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def check_flag(name: str, value: Any) -> bool:
    """An option that must be True or False (ValueError otherwise: 1 or "yes" are no flags)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def check_non_negative_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int")
    return value


def check_optional(*, positive: Mapping[str, Any] | None = None, non_negative: Mapping[str, Any] | None = None
                   ) -> None:
    """Settings that may be None (the default) or else a positive / non-negative int."""
    for name, value in (positive or {}).items():
        if value is not None:
            check_positive_int(name, value)
    for name, value in (non_negative or {}).items():
        if value is not None:
            check_non_negative_int(name, value)


def check_bounds(prog: _Declares, bounds: Mapping[str, int] | None) -> dict[str, int]:
    """The bounds of the program's symbols: positive ints, one for every symbol."""
    out = dict(bounds or {})
    for sym, v in out.items():
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"bound of '{sym}' must be an int, not {type(v).__name__}")
        if v <= 0:
            raise ValueError(f"bound of '{sym}' must be positive, got {v}")
    missing = [s for s in prog.symbols if s not in out]
    if missing:
        raise ValueError(f"{prog.name}: symbols {missing} need bounds: prepare(bounds={{{missing[0]!r}: ...}})")
    return out


def check_callbacks(prog: _Declares, callbacks: Mapping[str, Callable[..., Any]] | None
                    ) -> dict[str, Callable[..., Any]]:
    """The host callbacks bound at prepare: exactly the declared names, each callable with its tensor count.

    An unknown or a missing name fails here, at prepare, not at run time.
    """
    given = dict(callbacks or {})
    declared = prog.callback_names
    unknown = sorted(set(given) - set(declared))
    if unknown:
        raise ValueError(f"{prog.name}: unknown callbacks {unknown} (the program declares {sorted(declared)})")
    missing = sorted(set(declared) - set(given))
    if missing:
        raise ValueError(f"{prog.name}: callbacks {missing} are declared but not bound at prepare")
    for name, fn in given.items():
        if not callable(fn):
            raise TypeError(f"callback '{name}' must be callable, not {type(fn).__name__}")
        arity = prog.callback_arity(name)
        if arity is None:
            continue
        try:
            inspect.signature(fn).bind(*range(arity))
        except TypeError:
            raise TypeError(f"callback '{name}' must accept {arity} tensor arguments") from None
        except ValueError:  # no signature available (some builtins): accept
            pass
    return given
