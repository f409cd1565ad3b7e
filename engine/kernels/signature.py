"""Kernel signatures: what a kernel reads, writes and takes as scalars.

A :class:`Kernel` names a kernel in the device's registry and declares its
arguments. ``kernel.bind(inputs, out, scalars)`` validates one call against the
declaration (using only the :class:`~engine.tensor_protocol.TensorLike`
protocol) and returns a :class:`Call` in the order the native kernel expects:

* tensors: the inputs, then the optional tensors that were given, then ``out``;
* access: ``READ`` for inputs, ``WRITE`` for ``out`` (``READWRITE`` when the
  kernel also reads it, e.g. ``matmul`` with ``beta != 0``);
* scalars: in declaration order, as ``int`` (ints, bools, choices) or ``float``.

Errors: a wrong arity, tensor shape or dtype raises ``TypeError`` naming the
kernel and the argument; a bad scalar or a forbidden alias (``out`` sharing
memory with a tensor the kernel reads, other than the exact same view for
kernels that declare ``inplace``) raises ``ValueError``.

A user kernel declares its signature the same way::

    scale_rows = Kernel(
        "scale_rows", inputs=["x", "w"], out="out",
        scalars={"alpha": Param(float, 1.0)},
        check=lambda b: b.expect_shape("out", b["x"].shape),
    )
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Union

from engine.dtypes import DType
from engine.tensor_protocol import TensorLike

__all__ = ["READ", "WRITE", "READWRITE", "REQUIRED", "Param", "Kernel", "Binding", "Call", "MAX_DIMS"]

READ = 1  # td_access values (kernel_abi.h)
WRITE = 2
READWRITE = 3
MAX_DIMS = 8  # TD_MAX_DIMS


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()
"""Default of a scalar that every call must pass."""

ScalarValue = Union[int, float]
ParamKind = Union[type, str, tuple[str, ...]]


def _bad_scalar(kernel: str, name: str, value: Any, why: str) -> ValueError:
    return ValueError(f"{kernel}: scalar '{name}' {why}, got {value!r}")


class Param:
    """A scalar parameter.

    ``kind`` is ``int``, ``float``, ``bool``, ``"number"`` (an int or a float,
    passed on as given) or a tuple of strings (one of them; the kernel receives
    its index). ``gt`` / ``ge`` / ``le`` bound numeric values; ``nullable``
    admits ``None``, passed to the kernel as ``none_value`` unless the check
    function resolves it; ``finite`` rejects inf and NaN for floats.
    """

    __slots__ = ("kind", "default", "gt", "ge", "le", "nullable", "none_value", "finite")

    def __init__(
        self,
        kind: ParamKind,
        default: Any = REQUIRED,
        *,
        gt: float | None = None,
        ge: float | None = None,
        le: float | None = None,
        nullable: bool = False,
        none_value: ScalarValue = -1,
        finite: bool = True,
    ) -> None:
        if isinstance(kind, tuple):
            if not kind or not all(isinstance(c, str) for c in kind):
                raise ValueError("a choice parameter needs a non-empty tuple of strings")
        elif kind not in (int, float, bool, "number"):
            raise ValueError(f"unsupported scalar kind {kind!r}; use int, float, bool, 'number' or a tuple of choices")
        self.kind = kind
        self.gt, self.ge, self.le = gt, ge, le
        self.nullable = nullable or default is None
        self.none_value = none_value
        self.finite = finite
        self.default = default
        if default is not REQUIRED and default is not None:
            self.validate("default", "<declaration>", default)

    @property
    def required(self) -> bool:
        return self.default is REQUIRED

    def describe(self) -> str:
        if isinstance(self.kind, tuple):
            return " | ".join(repr(c) for c in self.kind)
        return self.kind if isinstance(self.kind, str) else self.kind.__name__

    def validate(self, name: str, kernel: str, value: Any) -> Any:
        """The value as Python would pass it on (bool, int, float or choice str); ValueError if bad."""
        if value is None:
            if self.nullable:
                return None
            raise _bad_scalar(kernel, name, value, f"expects {self.describe()}")
        kind = self.kind
        if isinstance(kind, tuple):
            if not isinstance(value, str) or value not in kind:
                raise _bad_scalar(kernel, name, value, f"must be one of {', '.join(repr(c) for c in kind)}")
            return value
        if kind is bool:
            if isinstance(value, (bool, numbers.Integral)) and value in (0, 1):
                return bool(value)
            raise _bad_scalar(kernel, name, value, "expects a bool")
        vt = type(value)
        # Plain int and float first: the numbers ABC checks cost a microsecond each.
        integral = vt is int or (vt is not float and vt is not bool and isinstance(value, numbers.Integral))
        if vt is bool or not (integral or vt is float or isinstance(value, numbers.Real)):
            raise _bad_scalar(kernel, name, value, f"expects {self.describe()}")
        if kind is int:
            if not integral:
                raise _bad_scalar(kernel, name, value, "expects an int")
            v: ScalarValue = int(value)
        else:
            try:
                v = float(value) if kind is float or not integral else int(value)
            except OverflowError:  # an int beyond the float range is a bad value, not a crash
                raise _bad_scalar(kernel, name, value, "is beyond the float range") from None
        if isinstance(v, float) and self.finite and not math.isfinite(v):
            raise _bad_scalar(kernel, name, value, "must be finite")
        if self.gt is not None and not v > self.gt:
            raise _bad_scalar(kernel, name, value, f"must be > {self.gt}")
        if self.ge is not None and not v >= self.ge:
            raise _bad_scalar(kernel, name, value, f"must be >= {self.ge}")
        if self.le is not None and not v <= self.le:
            raise _bad_scalar(kernel, name, value, f"must be <= {self.le}")
        return v

    def to_native(self, value: Any) -> ScalarValue:
        """The value as the kernel receives it: an int or a float."""
        if value is None:
            return self.none_value
        if isinstance(self.kind, tuple):
            return self.kind.index(value)
        if self.kind is bool:
            return int(bool(value))
        if self.kind is int:
            return int(value)
        if self.kind is float:
            return float(value)
        return value if isinstance(value, (int, float)) else float(value)

    def __repr__(self) -> str:
        default = "" if self.required else f", default={self.default!r}"
        return f"Param({self.describe()}{default})"


class Call:
    """One validated kernel call, in the native kernel's argument order.

    tensors: the TensorLike arguments; access: td_access per tensor (1 read,
    2 write, 3 read-write); scalars: ints and floats in declaration order;
    names: each tensor's argument name.
    """

    __slots__ = ("kernel", "tensors", "access", "scalars", "names")

    def __init__(self, kernel: Kernel, tensors: list[TensorLike], access: list[int], scalars: list[ScalarValue],
                 names: list[str]) -> None:
        self.kernel = kernel
        self.tensors = tensors
        self.access = access
        self.scalars = scalars
        self.names = names

    def __repr__(self) -> str:
        return f"Call({self.kernel.name}, names={self.names}, access={self.access}, scalars={self.scalars})"


class Binding:
    """A call under validation, handed to a kernel's check function.

    ``b[name]`` is a tensor or a scalar value; ``b.get(name)`` is ``None`` for
    an optional tensor that was not given. A check may replace scalar values in
    ``b.scalars`` (e.g. resolve a ``None`` default from shapes) and set
    ``b.out_access`` to ``READWRITE``. The ``expect_*`` helpers raise
    ``TypeError`` naming the kernel, the argument and both shapes or dtypes.
    """

    def __init__(self, kernel: Kernel, tensors: dict[str, TensorLike], scalars: dict[str, Any]) -> None:
        self.kernel = kernel
        self.tensors = tensors
        self.scalars = scalars
        self.out_access = WRITE

    def __getitem__(self, name: str) -> Any:
        if name in self.tensors:
            return self.tensors[name]
        if name in self.scalars:
            return self.scalars[name]
        raise KeyError(f"{self.kernel.name}: no argument named {name!r}")

    def get(self, name: str) -> TensorLike | None:
        return self.tensors.get(name)

    # Errors --------------------------------------------------------------
    def type_error(self, message: str) -> TypeError:
        return TypeError(f"{self.kernel.name}: {message}")

    def value_error(self, message: str) -> ValueError:
        return ValueError(f"{self.kernel.name}: {message}")

    # Dtype rules ----------------------------------------------------------
    def expect_dtype(self, name: str, allowed: Sequence[DType]) -> DType:
        dt = self.tensors[name].dtype
        if dt not in allowed:
            names = ", ".join(d.name for d in allowed)
            raise self.type_error(f"argument '{name}' has dtype {dt}, expected {names}")
        return dt

    def expect_same_dtype(self, name: str, like: str, *, also: Sequence[DType] = ()) -> DType:
        """``name`` has the dtype of ``like`` (or one of ``also``)."""
        dt, ref = self.tensors[name].dtype, self.tensors[like].dtype
        if dt is not ref and dt != ref and dt not in also:
            alt = "".join(f" or {d}" for d in also if d != ref)
            raise self.type_error(f"argument '{name}' has dtype {dt}, expected {ref} (the dtype of '{like}'){alt}")
        return dt

    # Shape rules ----------------------------------------------------------
    def expect_shape(
        self,
        name: str,
        expected: Sequence[int] | Iterable[Sequence[int]],
        *,
        why: str | Callable[[], str] = "",
    ) -> None:
        """``name`` has shape ``expected`` (one shape, or a list of acceptable shapes).

        ``why`` explains the expectation in the message; a callable is only
        evaluated when the check fails.
        """
        shape = tuple(self.tensors[name].shape)
        if shape == expected:
            return
        options = [tuple(expected)] if _is_shape(expected) else [tuple(s) for s in expected]  # type: ignore[arg-type]
        if shape not in options:
            want = " or ".join(str(o) for o in options)
            reason = why() if callable(why) else why
            raise self.type_error(f"argument '{name}' has shape {shape}, expected {want}{f' ({reason})' if reason else ''}")

    def expect_ndim(self, name: str, at_least: int, at_most: int = MAX_DIMS) -> int:
        shape = self.tensors[name].shape
        if not at_least <= len(shape) <= at_most:
            shape = tuple(shape)
            want = f"at least {at_least}" if at_most == MAX_DIMS else f"{at_least} to {at_most}"
            if at_least == at_most:
                want = str(at_least)
            raise self.type_error(f"argument '{name}' has shape {shape}, expected {want} dims")
        return len(shape)

    def expect_broadcast(self, name: str, target: Sequence[int], *, target_desc: str) -> None:
        """``name`` broadcasts (numpy rules, right-aligned) to ``target``."""
        shape = tuple(self.tensors[name].shape)
        if broadcast_shapes(shape, tuple(target)) != tuple(target):
            raise self.type_error(
                f"argument '{name}' has shape {shape}, which does not broadcast to {tuple(target)} ({target_desc})"
            )


# Types seen to have every TensorLike attribute: later arguments of those types skip the five lookups.
_TENSOR_TYPES: set[type] = set()


def _is_tensor(x: Any) -> bool:
    """isinstance(x, TensorLike), without the runtime-protocol check's cost (~15 us per call)."""
    ok = (hasattr(x, "shape") and hasattr(x, "dtype") and hasattr(x, "strides") and hasattr(x, "overlaps")
          and hasattr(x, "same_view"))
    if ok and not isinstance(x, type):  # remember classes whose instances carry the attributes themselves
        if all(hasattr(type(x), a) for a in ("shape", "dtype", "strides", "overlaps", "same_view")):
            _TENSOR_TYPES.add(type(x))
    return ok


def _is_shape(x: Any) -> bool:
    return isinstance(x, Sequence) and all(isinstance(d, numbers.Integral) for d in x)


def broadcast_shapes(a: Sequence[int], b: Sequence[int]) -> tuple[int, ...] | None:
    """numpy's broadcast of two shapes, or None when they do not broadcast."""
    n = max(len(a), len(b))
    pa = (1,) * (n - len(a)) + tuple(a)
    pb = (1,) * (n - len(b)) + tuple(b)
    out = []
    for x, y in zip(pa, pb):
        if x == y or y == 1:
            out.append(x)
        elif x == 1:
            out.append(y)
        else:
            return None
    return tuple(out)


CheckFn = Callable[[Binding], None]


class Kernel:
    """A kernel's registry name and declared signature.

    ``inputs``: tensors read, passed positionally. ``optional``: tensors read
    when given as keywords (at most one, so the native kernel can tell from
    the tensor count whether it is there). ``out``: the tensor written, passed
    as ``out=`` (``None`` for kernels without one). ``scalars``: keyword
    scalars, a ``Param`` each (a bare type means a required scalar of that
    kind). ``inplace``: inputs that ``out`` may be the exact same view of.
    ``check``: validates shapes and dtypes of a :class:`Binding`.
    """

    def __init__(
        self,
        name: str,
        inputs: Sequence[str] = (),
        *,
        out: str | None = "out",
        optional: Sequence[str] = (),
        scalars: Mapping[str, Param | ParamKind] | None = None,
        inplace: Sequence[str] = (),
        check: CheckFn | None = None,
        doc: str = "",
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError("a kernel needs a non-empty name")
        params = {k: v if isinstance(v, Param) else Param(v) for k, v in (scalars or {}).items()}
        names = list(inputs) + list(optional) + ([out] if out else []) + list(params)
        for n in names:
            if not isinstance(n, str) or not n.isidentifier():
                raise ValueError(f"kernel {name!r}: argument name {n!r} is not an identifier")
        if len(set(names)) != len(names):
            raise ValueError(f"kernel {name!r}: argument names repeat: {names}")
        if len(optional) > 1:
            raise ValueError(f"kernel {name!r}: at most one optional tensor is supported, got {list(optional)}")
        unknown = [n for n in inplace if n not in inputs]
        if unknown:
            raise ValueError(f"kernel {name!r}: inplace names {unknown} are not inputs")
        if inplace and not out:
            raise ValueError(f"kernel {name!r}: inplace needs an out tensor")
        self.name = name
        self.inputs: tuple[str, ...] = tuple(inputs)
        self.optional: tuple[str, ...] = tuple(optional)
        self.out = out
        self.scalars: dict[str, Param] = params
        self.inplace: tuple[str, ...] = tuple(inplace)
        self.check = check
        self._defaults = {n: p.default for n, p in params.items() if not p.required}
        self._plain_order: tuple[str, ...] = self.inputs + ((out,) if out else ())  # without the optional tensor
        self.__doc__ = doc or f"Kernel {self.signature}"

    @property
    def signature(self) -> str:
        parts = list(self.inputs)
        kw = []
        if self.out:
            kw.append(self.out)
        kw += [f"{n}=None" for n in self.optional]
        kw += [n if p.required else f"{n}={p.default!r}" for n, p in self.scalars.items()]
        if kw:
            parts.append("*")
            parts += kw
        return f"{self.name}({', '.join(parts)})"

    def __repr__(self) -> str:
        return f"<Kernel {self.signature}>"

    def bind(self, inputs: Sequence[Any], out: Any, scalars: Mapping[str, Any]) -> Call:
        """Validate one call; return it in native order. Raises TypeError / ValueError.

        Runs once per submitted task during orchestration, so it is kept lean:
        tensors are checked in native order without building a name map, and
        the Binding a check function reads is only made for kernels that have
        one.
        """
        k = self.name
        names = self.inputs
        if len(inputs) != len(names):
            want = ", ".join(names) or "none"
            raise TypeError(f"{k}: expected {len(names)} input tensor(s) ({want}), got {len(inputs)}")
        out_name = self.out
        if out_name is None:
            if out is not None:
                raise TypeError(f"{k}: takes no out tensor")
        elif out is None:
            raise TypeError(f"{k}: missing the out= tensor")

        params = self.scalars
        values = dict(self._defaults) if self._defaults else {}
        given: tuple[str, Any] | None = None  # the optional tensor, when passed
        if scalars:
            for key, value in scalars.items():
                param = params.get(key)
                if param is not None:
                    values[key] = param.validate(key, k, value)
                elif key in self.optional:
                    if value is not None:
                        given = (key, value)
                else:
                    raise TypeError(f"{k}: unexpected keyword argument '{key}'; signature is {self.signature}")
        if len(values) != len(params):
            missing = next(n for n in params if n not in values)
            raise TypeError(f"{k}: missing scalar '{missing}'")

        tensors = list(inputs)
        if given is None:
            order = list(self._plain_order)
        else:
            order = list(names)
            order.append(given[0])
            tensors.append(given[1])
            if out_name is not None:
                order.append(out_name)
        if out_name is not None:
            tensors.append(out)
        known = _TENSOR_TYPES
        for i, t in enumerate(tensors):
            if type(t) not in known and not _is_tensor(t):
                raise TypeError(f"{k}: argument '{order[i]}' must be a tensor, got {type(t).__name__}")
            if len(t.shape) > MAX_DIMS:
                raise TypeError(f"{k}: argument '{order[i]}' has shape {tuple(t.shape)}, more than {MAX_DIMS} dims")

        n_read = len(tensors) - (out_name is not None)
        access = [READ] * n_read
        if self.check is not None or out_name is not None:
            by_name = dict(zip(order, tensors))
            out_access = WRITE
            if self.check is not None:
                binding = Binding(self, by_name, values)
                self.check(binding)
                out_access = binding.out_access
            if out_name is not None:
                self._check_aliases(by_name)
                access.append(out_access)
        native = [p.to_native(values[n]) for n, p in params.items()] if params else []
        return Call(self, tensors, access, native, order)

    def _check_aliases(self, tensors: dict[str, TensorLike]) -> None:
        assert self.out is not None
        out = tensors[self.out]
        if 0 not in out.shape:  # an empty tensor has no elements to overlap (numpy gives it zero strides)
            for d, s in zip(out.shape, out.strides):
                if s == 0 and d > 1:
                    raise ValueError(f"{self.name}: argument '{self.out}' has a zero stride, so its elements overlap")
        for name in self.inputs + self.optional:
            t = tensors.get(name)
            if t is None or not out.overlaps(t):
                continue
            if name in self.inplace:
                if out.same_view(t):
                    continue
                raise ValueError(
                    f"{self.name}: '{self.out}' partially overlaps input '{name}'; in-place needs the exact same view"
                )
            raise ValueError(f"{self.name}: '{self.out}' overlaps input '{name}', which this kernel reads while writing")
