"""Element types the engine knows, and conversion from numpy/torch/str names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["DType", "DTYPES", "float32", "float16", "bfloat16", "int32", "int64", "uint8", "as_dtype"]


# eq=False: the six DTypes below are the only instances, so identity is equality,
# and the generated field-by-field __eq__ would cost a microsecond per comparison.
@dataclass(frozen=True, eq=False)
class DType:
    name: str
    code: int  # td_dtype in kernel_abi.h
    itemsize: int
    numpy: np.dtype  # host storage type (bfloat16 is stored as uint16 bits)
    is_float: bool

    def __str__(self) -> str:
        return self.name

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return as_dtype, (self.name,)  # unpickles to the same singleton, which identity equality needs

    def __repr__(self) -> str:
        return f"engine.{self.name}"


float32 = DType("float32", 0, 4, np.dtype(np.float32), True)
float16 = DType("float16", 1, 2, np.dtype(np.float16), True)
bfloat16 = DType("bfloat16", 2, 2, np.dtype(np.uint16), True)
int32 = DType("int32", 3, 4, np.dtype(np.int32), False)
int64 = DType("int64", 4, 8, np.dtype(np.int64), False)
uint8 = DType("uint8", 5, 1, np.dtype(np.uint8), False)

DTYPES: dict[str, DType] = {d.name: d for d in (float32, float16, bfloat16, int32, int64, uint8)}
_BY_NUMPY = {np.dtype(np.float32): float32, np.dtype(np.float16): float16, np.dtype(np.int32): int32,
             np.dtype(np.int64): int64, np.dtype(np.uint8): uint8}


def as_dtype(value: Any) -> DType:
    """The engine dtype named by a DType, a name, a numpy dtype or a torch dtype.

    Raises TypeError for anything the engine does not support.
    """
    if isinstance(value, DType):
        return value
    known = _BY_NUMPY.get(value) if isinstance(value, np.dtype) else None
    if known is not None:  # the common case first: an array's own dtype
        return known
    if isinstance(value, str):
        try:
            return DTYPES[value]
        except KeyError:
            raise TypeError(f"unknown dtype {value!r}; expected one of {sorted(DTYPES)}") from None
    mod = type(value).__module__
    if mod.startswith("torch"):
        name = str(value).removeprefix("torch.")
        if name in DTYPES:
            return DTYPES[name]
        raise TypeError(f"unsupported torch dtype {value}; expected one of {sorted(DTYPES)}")
    try:
        npd = np.dtype(value)
    except TypeError:
        raise TypeError(f"unknown dtype {value!r}; expected one of {sorted(DTYPES)}") from None
    try:
        return _BY_NUMPY[npd]
    except KeyError:
        raise TypeError(f"unsupported dtype {npd}; expected one of {sorted(DTYPES)}") from None
