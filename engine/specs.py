"""Parameter specs of a program: In, Out, InOut (tensors) and Scalar."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from engine.dtypes import DType, as_dtype

Dim = Union[int, str]

__all__ = ["Dim", "TensorSpec", "In", "Out", "InOut", "Scalar", "ParamSpec"]


def check_shape(shape: object, where: str) -> tuple[Dim, ...]:
    """Validates a declared shape: a tuple of positive ints and symbol names."""
    if not isinstance(shape, (tuple, list)):
        raise TypeError(f"{where}: shape must be a tuple of ints and symbol names, not {type(shape).__name__}")
    if len(shape) == 0:
        raise ValueError(f"{where}: shape must have at least one dim")
    dims: list[Dim] = []
    for d in shape:
        if isinstance(d, bool) or not isinstance(d, (int, str)):
            raise TypeError(f"{where}: dim {d!r} must be an int or a symbol name")
        if isinstance(d, int) and d <= 0:
            raise ValueError(f"{where}: dim {d} must be positive")
        if isinstance(d, str) and not d.isidentifier():
            raise ValueError(f"{where}: symbol {d!r} must be an identifier")
        dims.append(d)
    return tuple(dims)


@dataclass(frozen=True)
class TensorSpec:
    """A tensor parameter: its declared shape, dtype and direction."""

    shape: tuple[Dim, ...]
    dtype: DType
    reads: bool
    writes: bool

    @property
    def kind(self) -> str:
        return {(True, False): "In", (False, True): "Out", (True, True): "InOut"}[(self.reads, self.writes)]

    @property
    def symbols(self) -> tuple[str, ...]:
        return tuple(d for d in self.shape if isinstance(d, str))

    def __repr__(self) -> str:
        return f"{self.kind}({self.shape}, {self.dtype.name!r})"


def In(shape: tuple[Dim, ...], dtype: object = "float32") -> TensorSpec:
    """A tensor the program reads: copied to the device before the run."""
    return TensorSpec(check_shape(shape, "In"), as_dtype(dtype), True, False)


def Out(shape: tuple[Dim, ...], dtype: object = "float32") -> TensorSpec:
    """A tensor the program writes: copied back after the run (allocated when omitted)."""
    return TensorSpec(check_shape(shape, "Out"), as_dtype(dtype), False, True)


def InOut(shape: tuple[Dim, ...], dtype: object = "float32") -> TensorSpec:
    """A tensor read and written: copied in before and back after the run."""
    return TensorSpec(check_shape(shape, "InOut"), as_dtype(dtype), True, True)


@dataclass(frozen=True)
class Scalar:
    """A Python number passed through to the orchestration function."""

    type: type = float

    def __post_init__(self) -> None:
        if self.type not in (int, float, bool):
            raise TypeError(f"Scalar type must be int, float or bool, not {self.type!r}")

    def check(self, name: str, value: object) -> object:
        if type(value) is self.type:  # the common case: exactly the declared type (bool is not int here)
            return value
        ok = isinstance(value, bool) if self.type is bool else (
            isinstance(value, self.type) and not isinstance(value, bool)
            or (self.type is float and isinstance(value, int) and not isinstance(value, bool))
        )
        if not ok:
            raise TypeError(f"parameter '{name}': expected a {self.type.__name__}, got {type(value).__name__}")
        if self.type is float and isinstance(value, (int, float)):  # always so once ok; says so to the checker
            try:
                return float(value)
            except OverflowError:  # an int beyond the float range: a bad value
                raise ValueError(f"parameter '{name}': {type(value).__name__} value is too large for a float") from None
        return value


ParamSpec = Union[TensorSpec, Scalar]
