"""Binding one call's arguments to a program's signature.

Everything here runs before anything reaches the device: a bad argument
raises TypeError or ValueError and leaves the runtime untouched.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol, Sequence

import numpy as np

from engine.hostarrays import as_numpy_view, host_dtype, is_host_array, is_torch
from engine.program import Param
from engine.specs import Scalar, TensorSpec
from engine.tensor import DeviceTensor

__all__ = ["BindCache", "BoundArg", "BoundCall", "Signature", "argument_sources", "bind_call", "binds_as_is",
           "call_signature"]


class Signature(Protocol):
    """What binding reads of a program."""

    @property
    def name(self) -> str: ...

    @property
    def params(self) -> tuple[Param, ...]: ...

    @property
    def param_names(self) -> frozenset[str]: ...

_TooHardError = getattr(getattr(np, "exceptions", np), "TooHardError")  # numpy.exceptions from 1.25


@dataclass(slots=True)
class BoundArg:
    param: Param
    value: Any  # what the caller passed (None for an omitted Out)
    shape: tuple[int, ...] = ()
    host: np.ndarray | None = None  # contiguous numpy view staged through the slot
    writeback: np.ndarray | None = None  # caller's non-contiguous array, filled after the run


@dataclass(slots=True)
class BoundCall:
    args: list[BoundArg]
    dims: dict[str, int]
    torch_kind: bool
    outputs: list[int] = field(default_factory=list)  # indices of Out / InOut args
    # (signature, positional count, keyword names) for a captured runtime's call cache (engine.call_cache)
    signature: tuple[Any, ...] | None = None


def bind_call(check_tensor: Callable[[Any, str], None], prog: Signature, args: tuple[Any, ...],
              kwargs: Mapping[str, Any], bounds: Mapping[str, int]) -> BoundCall:
    """Binds one call's arguments to prog's parameters: shapes, dtypes, symbols, outputs.

    check_tensor(t, what) raises when a DeviceTensor argument may not be
    used (another runtime's, freed, ...).
    """
    params = prog.params
    if len(args) > len(params):
        raise TypeError(f"{prog.name}() takes {len(params)} arguments but {len(args)} were given")
    if not params:
        return BoundCall([], {}, False, [])
    given: list[Any]  # one value per parameter, None where none was passed
    if kwargs:
        values: dict[str, Any] = {}
        for p, v in zip(params, args):
            values[p.name] = v
        names = prog.param_names
        for k, v in kwargs.items():
            if k not in names:
                raise TypeError(f"{prog.name}() got an unexpected argument '{k}'")
            if k in values:
                raise TypeError(f"{prog.name}() got multiple values for argument '{k}'")
            values[k] = v
        given = [values.get(p.name) for p in params]
    else:
        given = list(args)
        if len(given) < len(params):
            given += [None] * (len(params) - len(given))

    dims: dict[str, int] = {}
    dim_source: dict[str, str] = {}
    bound: list[BoundArg] = []
    written: list[tuple[str, np.ndarray]] = []  # host arrays the run writes back into
    torch_kind = "torch" in sys.modules and any(is_torch(v) for v in given)
    outputs: list[int] = []  # indices of Out / InOut parameters
    omitted = False
    for p, v in zip(params, given):
        spec = p.spec
        if isinstance(spec, TensorSpec) and spec.writes:
            outputs.append(len(bound))
        if v is None:
            if isinstance(spec, TensorSpec) and spec.writes and not spec.reads:
                bound.append(BoundArg(p, None))
                omitted = True
                continue
            raise TypeError(f"{prog.name}() missing argument '{p.name}' ({spec!r})")
        if isinstance(spec, Scalar):
            bound.append(BoundArg(p, spec.check(p.name, v)))
            continue
        if type(v) is np.ndarray:  # the common case first
            dtype = host_dtype(v)
            shape = v.shape
        elif isinstance(v, DeviceTensor):
            check_tensor(v, f"parameter '{p.name}'")
            shape, dtype = v.shape, v.dtype
        elif is_host_array(v):
            dtype = host_dtype(v)
            shape = tuple(int(d) for d in v.shape)
        else:
            raise TypeError(f"parameter '{p.name}': expected a numpy array, a CPU torch tensor or a DeviceTensor, "
                            f"not {type(v).__name__}")
        if dtype != spec.dtype:
            raise TypeError(f"parameter '{p.name}': expected dtype {spec.dtype.name}, got {dtype.name}")
        if len(shape) != len(spec.shape):
            raise TypeError(f"parameter '{p.name}': expected {len(spec.shape)} dims {spec.shape}, got shape {shape}")
        for axis, (want, got) in enumerate(zip(spec.shape, shape)):
            if got <= 0:
                raise ValueError(f"parameter '{p.name}': dim {axis} is {got}; dims must be positive (shape {shape})")
            if isinstance(want, int):
                if want != got:
                    raise TypeError(f"parameter '{p.name}': dim {axis} must be {want}, got {got} (shape {shape})")
                continue
            if want in dims and dims[want] != got:
                raise TypeError(f"parameter '{p.name}': symbol '{want}' is {got} here but {dims[want]} "
                                f"in '{dim_source[want]}'")
            if want not in dims:
                if got > bounds[want]:
                    raise ValueError(f"parameter '{p.name}': {want}={got} exceeds its bound {bounds[want]} "
                                     "(set at prepare)")
                dims[want], dim_source[want] = got, p.name
        arg = BoundArg(p, v, shape)
        if not isinstance(v, DeviceTensor):
            view = as_numpy_view(v)
            flags = view.flags  # a new flags object per access: read it once
            if spec.writes and not flags.writeable:
                raise ValueError(f"parameter '{p.name}': output array is read-only")
            if spec.writes:
                for other, oview in written:
                    if _overlap(view, oview):
                        raise ValueError(f"parameters '{other}' and '{p.name}' are outputs sharing memory: "
                                         "the run would write both into the same elements")
                written.append((p.name, view))
            if flags.c_contiguous and (flags.writeable or spec.writes):
                arg.host = view
            else:  # staged through a contiguous (and writable) copy; outputs are copied back after the run
                arg.host = np.array(view, order="C", copy=True)
                if spec.writes:
                    arg.writeback = view
        bound.append(arg)

    for arg in bound if omitted else ():  # omitted Outs: shapes from the dims bound by the other arguments
        spec = arg.param.spec
        if isinstance(spec, TensorSpec) and arg.value is None:
            missing = [d for d in spec.shape if isinstance(d, str) and d not in dims]
            if missing:
                raise TypeError(f"parameter '{arg.param.name}' was omitted and symbol(s) {missing} are bound by no "
                                "other argument: pass the output")
            arg.shape = tuple(d if isinstance(d, int) else dims[d] for d in spec.shape)
    return BoundCall(bound, dims, torch_kind, outputs)


def _overlap(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two arrays share an element (exactly; a problem too hard to solve counts as sharing)."""
    if not np.may_share_memory(a, b):
        return False
    try:
        return bool(np.shares_memory(a, b, max_work=100_000))  # type: ignore[arg-type]  # numpy's stub: -1 or 0 only
    except _TooHardError:
        return True


# -- the hit path: calls shaped like an earlier one ---------------------------------------------------------
_SCALAR_TYPES = (int, float, bool)


def call_signature(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[Any, ...] | None:
    """What binding's outcome depends on, and nothing it does not, or None for a call of other kinds.

    The number of positional arguments and the keyword names in order; per
    host array: exactly numpy.ndarray, its shape and dtype, C-contiguous and
    writable (staged as it is: no copy, no write-back); per DeviceTensor: the
    view itself (immutable; whether it is still alive is checked per call);
    per scalar: its type (its value is checked per call by its spec).
    """
    # Every call of a cached runtime computes this: one loop over args and kwargs values, no helper calls.
    tokens: list[Any] = [len(args)]
    for v in (args + tuple(kwargs.values())) if kwargs else args:
        t = type(v)
        if t is np.ndarray:
            flags = v.flags
            if not (flags.c_contiguous and flags.writeable):
                return None
            tokens.append((v.shape, v.dtype))
        elif t is DeviceTensor:
            tokens.append(v)
        elif t in _SCALAR_TYPES:
            tokens.append(t)
        else:
            return None
    if kwargs:
        tokens.extend(kwargs)  # the keyword names, in order
    return tuple(tokens)


class _Shape:
    """What bind_call derived for one call signature: per parameter, how to bind its value again."""

    __slots__ = ("params", "dims", "outputs")

    def __init__(self, call: BoundCall, n_args: int, kw_names: tuple[str, ...]) -> None:
        # (parameter, its index in args + kwargs values or -1 where omitted, shape, kind)
        self.params: list[tuple[Param, int, tuple[int, ...], str]] = []
        sources = argument_sources([a.param for a in call.args], n_args, kw_names)
        for a, source in zip(call.args, sources):
            p = a.param
            kind = ("scalar" if isinstance(p.spec, Scalar) else "omitted" if a.value is None
                    else "device" if isinstance(a.value, DeviceTensor) else "host")
            self.params.append((p, source, a.shape, kind))
        self.dims = call.dims
        self.outputs = call.outputs

    def bind(self, check_tensor: Callable[[Any, str], None], flat: tuple[Any, ...]) -> BoundCall:
        args: list[BoundArg] = []
        for p, source, shape, kind in self.params:
            if kind == "host":
                v = flat[source]
                args.append(BoundArg(p, v, shape, v))
            elif kind == "scalar":
                args.append(BoundArg(p, p.spec.check(p.name, flat[source])))
            elif kind == "device":
                v = flat[source]
                check_tensor(v, f"parameter '{p.name}'")
                args.append(BoundArg(p, v, shape))
            else:
                args.append(BoundArg(p, None, shape))
        return BoundCall(args, dict(self.dims), False, self.outputs)


class BindCache:
    """bind_call with a memory: a call whose call_signature() was bound before binds from what that derived.

    The checks that depend on the values themselves still run per call:
    scalars through their specs, DeviceTensors for being alive and owned.
    Not cached (every such call takes the full path): calls with other
    kinds of arguments, arrays staged through a copy, and calls with two host
    outputs or more (whether they share memory is checked per call).
    """

    def __init__(self, size: int = 64) -> None:
        self._size = size
        self._shapes: OrderedDict[tuple[Any, ...], _Shape] = OrderedDict()

    def bind(self, check_tensor: Callable[[Any, str], None], prog: Signature, args: tuple[Any, ...],
             kwargs: Mapping[str, Any], bounds: Mapping[str, int]) -> BoundCall:
        sig = call_signature(args, kwargs)
        if sig is not None:
            shape = self._shapes.get(sig)
            if shape is not None:
                return shape.bind(check_tensor, args + tuple(kwargs.values()) if kwargs else args)
        call = bind_call(check_tensor, prog, args, kwargs, bounds)
        if sig is not None and binds_as_is(call):
            shapes = self._shapes
            shapes[sig] = _Shape(call, len(args), tuple(kwargs))
            if len(shapes) > self._size:
                shapes.popitem(last=False)
        return call

    def clear(self) -> None:
        self._shapes.clear()


def argument_sources(params: Sequence[Param], n_args: int, kw_names: Sequence[str]) -> list[int]:
    """Per parameter, its index in a call's args followed by its kwargs values (keyword names in
    kw_names' order); -1 where it was omitted."""
    position = {name: n_args + k for k, name in enumerate(kw_names)}
    return [i if i < n_args else position.get(p.name, -1) for i, p in enumerate(params)]


def binds_as_is(call: BoundCall) -> bool:
    """Whether another call with the same call_signature() binds to the same outcome: every host array is
    staged as it is (no copy, no write-back) and at most one is an output (whether two share memory is
    checked per call)."""
    host_outputs = 0
    for a in call.args:
        spec = a.param.spec
        if not isinstance(spec, TensorSpec) or a.value is None or isinstance(a.value, DeviceTensor):
            continue
        if a.host is not a.value or a.writeback is not None:  # staged through a copy
            return False
        if spec.writes:
            host_outputs += 1
    return host_outputs <= 1 and not call.torch_kind
