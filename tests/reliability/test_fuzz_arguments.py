"""Property: corrupted arguments give TypeError or ValueError, never a crash, a hang or a wrong answer.

Four surfaces are fuzzed:

* a program call (sync, handle, async) whose arguments are corrupted at random:
  shapes, dtypes, wrong kinds of object, freed / foreign / mis-shaped device
  tensors, bad scalars, arity, read-only or aliased outputs, torch tensors;
  valid variations (layouts, resident tensors, strided device views) must give
  the exact reference answer instead;
* kernel calls inside an orchestration (run.submit / run.host / run.scratch)
  with corrupted tensors, scalars and keywords;
* the device-memory handle (malloc, free, copy_to, copy_from, alloc_tensor,
  free_tensor) with random values;
* the native device and host accessor directly, as a state machine checked
  against a model (forged, stale and interior handles, out-of-range spans).

After each example the runtime must be usable and its counters back at their
baseline; an error must leave the caller's output arrays untouched.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import anyio
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule

import engine
from engine import In, InOut, Out, Scalar
from engine import _native
from engine import kernels as K
from scheduler import AsyncRuntime

from .conftest import assert_back_to, counters, record, size

try:
    import torch
except ImportError:  # the sanitizer venv has no torch
    torch = None

ALLOWED = (TypeError, ValueError)
BOUND = 8
EXAMPLES = size(200, 2000, sanitized=40)

fuzz = settings(max_examples=EXAMPLES, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])


@engine.program
def target(run: engine.Run, x: In(("B", 4)), w: In((4, 3)), s: InOut(("B", 3)), y: Out(("B", 3)),
           ids: In(("B",), "int32"), alpha: Scalar(float), n: Scalar(int)):
    h = run.scratch(("B", 3))
    run.submit(K.matmul, x, w, out=h)
    run.submit(K.scale, h, out=h, alpha=alpha)
    run.submit(K.fill, out=y, value=n)
    run.submit(K.add, h, y, out=y)
    c = run.scratch(("B",))
    run.submit(K.cast, ids, out=c)
    run.submit(K.add, y, c.reshape(run.dims["B"], 1), out=y)
    run.submit(K.add, s, y, out=s)


PARAMS = ["x", "w", "s", "y", "ids", "alpha", "n"]
TENSORS = {"x": ((None, 4), np.float32), "w": ((4, 3), np.float32), "s": ((None, 3), np.float32),
           "y": ((None, 3), np.float32), "ids": ((None,), np.int32)}


def reference(x: np.ndarray, w: np.ndarray, s: np.ndarray, ids: np.ndarray, alpha: float, n: int):
    """The program in float32, step by step as the kernels compute it (exact for small integers)."""
    h = (x.astype(np.float32) @ w.astype(np.float32)).astype(np.float32)
    h = (np.float32(alpha) * h).astype(np.float32)
    y = np.full(h.shape, np.float32(n), np.float32)
    y = (h + y).astype(np.float32)
    y = (y + ids.astype(np.float32)[:, None]).astype(np.float32)
    return (s.astype(np.float32) + y).astype(np.float32), y


class World:
    """One prepared runtime, a second one (for foreign tensors) and resident tensors, shared by examples."""

    def __init__(self) -> None:
        self.rt = target.prepare(depth=2, workers=2, bounds={"B": BOUND})
        self.other = target.prepare(depth=1, workers=1, bounds={"B": BOUND})
        self.w_dev = self.rt.alloc_tensor((4, 3), "float32", init=np.arange(12, dtype=np.float32).reshape(4, 3) % 3)
        self.big = self.rt.alloc_tensor((8, 6), "float32", init=(np.arange(48, dtype=np.float32).reshape(8, 6) % 5))
        self.freed = self.rt.alloc_tensor((4, 3), "float32")
        self.rt.free_tensor(self.freed)
        self.foreign = self.other.alloc_tensor((4, 3), "float32")
        self.wrong_shape = self.rt.alloc_tensor((3, 4), "float32")
        self.wrong_dtype = self.rt.alloc_tensor((4, 3), "int32")
        self.raw = self.rt.malloc(64)
        self.s_dev = self.rt.alloc_tensor((8, 3), "float32", init=np.full((8, 3), 2.0, np.float32))
        self.ids_dev = self.rt.alloc_tensor((8,), "int32", init=np.arange(8, dtype=np.int32) - 4)
        self.base = counters(self.rt)

    def close(self) -> None:
        self.rt.close()
        self.other.close()


@pytest.fixture(scope="module")
def world():
    w = World()
    yield w
    w.close()


# -- corruptions ---------------------------------------------------------------------------------
# Each takes (world, args, rng, param) and returns (new value or DELETE, expectation): "error" when
# the call must be refused, "ok" when it must succeed with the reference answer.
DELETE = object()


def _shape_of(name: str, b: int) -> tuple[int, ...]:
    shape, _ = TENSORS[name]
    return tuple(b if d is None else d for d in shape)


def bad_shape(world: World, args: dict, rng: np.random.Generator, p: str) -> tuple[Any, str]:
    v = args[p]
    shape = list(v.shape)
    how = rng.choice(["grow", "shrink", "zero", "extra_axis", "drop_axis", "beyond_bound", "other_b"])
    fixed = [i for i, d in enumerate(TENSORS[p][0]) if d is not None]
    symbolic = [i for i, d in enumerate(TENSORS[p][0]) if d is None]
    if how == "grow" and fixed:
        shape[fixed[0]] += int(rng.integers(1, 4))
    elif how == "shrink" and fixed and shape[fixed[0]] > 1:
        shape[fixed[0]] -= 1
    elif how == "zero":
        shape[int(rng.integers(len(shape)))] = 0
    elif how == "extra_axis":
        shape.insert(int(rng.integers(len(shape) + 1)), int(rng.integers(1, 3)))
    elif how == "drop_axis" and len(shape) > 1:
        shape.pop(int(rng.integers(len(shape))))
    elif how == "beyond_bound" and symbolic:
        shape[symbolic[0]] = BOUND + int(rng.integers(1, 5))
    elif symbolic:  # another value of B than the other arguments bind
        shape[symbolic[0]] = (shape[symbolic[0]] % BOUND) + 1
    else:
        shape.append(1)
    if tuple(shape) == tuple(v.shape):
        shape.append(2)
    return np.zeros(shape, np.asarray(v).dtype if isinstance(v, np.ndarray) else np.float32), "error"


WRONG_DTYPES = [np.float64, np.float16, np.int32, np.int64, np.uint8, np.bool_, np.complex64, object, ">f4", "U2",
                "datetime64[s]", [("a", "<f4")], np.int8, np.uint16]


def bad_dtype(world: World, args: dict, rng: np.random.Generator, p: str) -> tuple[Any, str]:
    want = np.dtype(TENSORS[p][1])
    choices = [d for d in WRONG_DTYPES if np.dtype(d) != want]
    dt = choices[int(rng.integers(len(choices)))]
    shape = args[p].shape if hasattr(args[p], "shape") else _shape_of(p, 2)
    return np.zeros(shape, dt), "error"


def _odd_objects(world: World, rng: np.random.Generator, like: Any) -> list[Any]:
    arr = np.asarray(like) if isinstance(like, np.ndarray) else np.zeros(3, np.float32)
    return [arr.tolist(), tuple(arr.ravel().tolist()), "tensor", b"\x00" * 16, 3, 1.5, {"data": arr}, object(),
            np.float32(1.0), np.array(1.0, np.float32), memoryview(np.ascontiguousarray(arr)), bytearray(16),
            world.raw, (i for i in range(3)), np.ndarray, Ellipsis, slice(None), True]


def wrong_kind(world: World, args: dict, rng: np.random.Generator, p: str) -> tuple[Any, str]:
    objs = _odd_objects(world, rng, args.get(p))
    if p in ("alpha", "n"):  # plain numbers are what a scalar takes
        objs = [o for o in objs if type(o) not in (int, float)]
    return objs[int(rng.integers(len(objs)))], "error"


def device_tensor(world: World, args: dict, rng: np.random.Generator, p: str) -> tuple[Any, str]:
    """A DeviceTensor standing for the argument: valid (resident, strided view) or not (freed, foreign, ...)."""
    b = args["_b"]
    common = [(world.freed, "error"), (world.foreign, "error")]
    options = {
        "w": [(world.w_dev, "ok"), (world.big[1:8:2, 0:6:2], "ok"), (world.big[0:4, 1:4], "ok"),
              (world.wrong_shape, "error"), (world.wrong_dtype, "error"), (world.big[0:4, 0:4], "error")],
        "x": [(world.big[0:b, 1:5], "ok"), (world.big[8 - b:8, 0:6:2][:, 0:3], "error"), (world.wrong_dtype, "error")],
        "s": [(world.s_dev[0:b], "ok"), (world.s_dev[0:b, 0:2], "error"), (world.wrong_dtype, "error")],
        "ids": [(world.ids_dev[0:b], "ok"), (world.big[0, 0:b], "error"), (world.ids_dev[0:1], "error" if b != 1 else "ok")],
    }[p] + common
    tensor, expect = options[int(rng.integers(len(options)))]
    if expect == "ok":
        args["_values"][p] = tensor.to_numpy()  # the reference reads the device values
    return tensor, expect


def bad_scalar(world: World, args: dict, rng: np.random.Generator, p: str) -> tuple[Any, str]:
    if p == "alpha":
        options: list[tuple[Any, str]] = [
            ("2", "error"), (None, "error"), (1j, "error"), (np.float32(2.0), "error"), (True, "error"),
            (float("nan"), "error"), (float("inf"), "error"), (-float("inf"), "error"), (10**400, "error"),
            ([2.0], "error"), (3, "ok"), (-2.0, "ok"), (0.0, "ok"), (np.float64(2.0), "ok"),
        ]
    else:
        options = [
            (1.5, "error"), ("1", "error"), (None, "error"), (True, "error"), (np.int64(2), "error"),
            (2**64, "error"), (-(2**63) - 1, "error"), (10**40, "error"), (2.0, "error"),
            (-3, "ok"), (0, "ok"), (2**20, "ok"),
        ]
    return options[int(rng.integers(len(options)))]


def layout(world: World, args: dict, rng: np.random.Generator, p: str) -> tuple[Any, str]:
    """Valid layouts (Fortran, reversed, strided, read-only inputs) or invalid ones (read-only outputs)."""
    v = np.asarray(args[p])
    how = rng.choice(["fortran", "reversed", "strided", "readonly"])
    if how == "fortran":
        return np.array(v, order="F", copy=True), "ok"
    if how == "reversed":  # negative strides over a copy
        return v[::-1].copy()[::-1], "ok"
    if how == "strided":
        big = np.zeros(v.shape + (2,), v.dtype)
        big[..., 1] = v
        return big[..., 1], "ok"
    out = v.copy()
    out.flags.writeable = False
    return out, ("error" if p in ("s", "y") else "ok")


def alias(world: World, args: dict, rng: np.random.Generator, p: str) -> tuple[Any, str]:
    """Outputs sharing memory with each other (refused) or with an input (a well-defined answer)."""
    b = args["x"].shape[0]
    how = rng.choice(["y_is_s", "y_in_s", "y_views_x", "s_views_x"])
    if how == "y_is_s":
        args["y"] = args["s"]
        return args["s"], "error"
    if how == "y_in_s":
        wide = np.zeros((b, 6), np.float32)
        wide[:, 1:4] = args["s"]
        args["s"] = wide[:, 1:4]
        args["y"] = wide[:, 2:5]
        return args["y"], "error"
    holder = np.zeros((b, 5), np.float32)
    holder[:, :4] = args["x"]
    args["x"] = holder[:, :4]
    if how == "y_views_x":
        args["y"] = holder[:, 1:4]
        return args["y"], "ok"
    holder[:, 1:4] = args["s"]
    args["x"] = holder[:, :4].copy()  # the input's values as they are before the run
    args["_x_alias"] = holder
    args["s"] = holder[:, 1:4]
    return args["s"], "ok"


def torch_tensor(world: World, args: dict, rng: np.random.Generator, p: str) -> tuple[Any, str]:
    v = np.asarray(args[p])
    how = rng.choice(["same", "grad", "double", "meta", "noncontig"])
    if how == "same":
        return torch.from_numpy(v.copy()), "ok"
    if how == "grad" and v.dtype == np.float32 and p not in ("s", "y"):
        return torch.from_numpy(v.copy()).requires_grad_(True), "ok"
    if how == "noncontig" and v.ndim == 2:
        t = torch.from_numpy(np.ascontiguousarray(v.T)).T
        return t, "ok"
    if how == "meta":
        return torch.empty(v.shape, dtype=torch.float32 if v.dtype == np.float32 else torch.int32,
                           device="meta"), "error"
    return torch.from_numpy(v.astype(np.float64)), "error"


def missing(world: World, args: dict, rng: np.random.Generator, p: str) -> tuple[Any, str]:
    return DELETE, "ok" if p == "y" else "error"


CORRUPTIONS: dict[str, Callable] = {
    "shape": bad_shape, "dtype": bad_dtype, "kind": wrong_kind, "device": device_tensor, "layout": layout,
    "missing": missing,
}
if torch is not None:
    CORRUPTIONS["torch"] = torch_tensor


def applicable(kind: str, p: str) -> bool:
    if p in ("alpha", "n"):
        return kind in ("kind", "missing")
    if kind == "device":
        return p in ("w", "x", "s", "ids")
    return True


def _valid_args(rng: np.random.Generator) -> dict:
    b = int(rng.integers(1, BOUND + 1))
    return {
        "_b": b,
        "_values": {},  # values of device tensors standing for arguments, read before the call
        "x": rng.integers(-3, 4, (b, 4)).astype(np.float32),
        "w": rng.integers(-3, 4, (4, 3)).astype(np.float32),
        "s": rng.integers(-3, 4, (b, 3)).astype(np.float32),
        "y": np.full((b, 3), -55.0, np.float32) if rng.random() < 0.5 else None,
        "ids": rng.integers(-3, 4, (b,)).astype(np.int32),
        "alpha": float(rng.integers(-2, 3)),
        "n": int(rng.integers(-3, 4)),
    }


def _as_np(v: Any) -> np.ndarray:
    if torch is not None and isinstance(v, torch.Tensor):
        return v.detach().numpy()
    if isinstance(v, engine.DeviceTensor):
        return v.to_numpy()
    return np.asarray(v)


def _snapshot(v: Any) -> Any:
    if isinstance(v, np.ndarray) or (torch is not None and isinstance(v, torch.Tensor)):
        try:
            return _as_np(v).copy()
        except (TypeError, RuntimeError):  # e.g. a tensor on the meta device: the call must refuse it anyway
            return None
    return v


def _call(world: World, route: str, pos: list, kw: dict) -> Any:
    rt = world.rt
    if route == "call":
        return rt(*pos, **kw)
    if route == "submit":
        return rt.submit(*pos, **kw).result(60)

    async def main() -> Any:
        async with AsyncRuntime(rt) as art:
            return await art.call(*pos, **kw)

    return anyio.run(main)


@fuzz
@given(seed=st.integers(0, 2**32 - 1),
       plan=st.lists(st.tuples(st.sampled_from(sorted(CORRUPTIONS) + ["scalar", "alias"]), st.sampled_from(PARAMS)),
                     min_size=0, max_size=3, unique_by=lambda t: t[1]),
       arity=st.sampled_from(["none", "none", "none", "extra_positional", "unknown_keyword", "duplicate_keyword",
                              "by_keyword"]),
       route=st.sampled_from(["call", "call", "submit", "async"]))
def test_corrupted_call_arguments_raise_type_or_value_errors_only(world, seed, plan, arity, route):
    rng = np.random.default_rng(seed)
    args = _valid_args(rng)
    effective: dict[str, str] = {}  # param -> corruption, one each
    for kind, p in plan:
        if kind == "scalar":
            p = "alpha" if p in ("x", "w", "s", "alpha") else "n"
        elif kind == "alias":
            p = "alias"
        elif not applicable(kind, p):
            continue
        effective.setdefault(p, kind)
    if "alias" in effective:  # the aliasing itself decides x, s and y
        for p in ("x", "s", "y"):
            effective.pop(p, None)
    expect = "ok"
    for p, kind in sorted(effective.items(), key=lambda kv: kv[0] != "alias"):
        if p == "alias":
            _, e = alias(world, args, rng, p)
        elif kind == "scalar":
            args[p], e = bad_scalar(world, args, rng, p)
        else:
            v = args[p]
            if kind in ("layout", "torch", "shape", "dtype") and not isinstance(v, np.ndarray):
                continue  # an omitted output
            value, e = CORRUPTIONS[kind](world, args, rng, p)
            args[p] = None if value is DELETE else value
        if e == "error":
            expect = "error"

    # the reference, from the values as they are before the call
    snapshot = {k: _snapshot(v) for k, v in args.items() if not k.startswith("_")}
    snapshot.update(args["_values"])
    pos = [args[p] for p in PARAMS]
    kw: dict = {}
    if arity == "extra_positional":
        pos.append(np.zeros(3, np.float32))
        expect = "error"
    elif arity == "unknown_keyword":
        kw["z"] = 1
        expect = "error"
    elif arity == "duplicate_keyword":
        kw["x"] = pos[0]
        expect = "error"
    elif arity == "by_keyword":
        kw = dict(zip(PARAMS, pos))
        pos = []

    outputs = {k: args[k] for k in ("s", "y") if isinstance(args[k], np.ndarray)}
    before = {k: np.array(v, copy=True) for k, v in outputs.items()}
    try:
        result = _call(world, route, pos, kw)
    except ALLOWED as e:
        assert expect == "error", f"a valid call was refused: {type(e).__name__}: {e}\nplan {plan}, arity {arity}"
        assert str(e), "errors say what is wrong"
        for k, v in outputs.items():  # rejected: nothing written back into the caller's arrays
            if k == "s" and "_x_alias" in args:
                continue
            np.testing.assert_array_equal(v, before[k], err_msg=f"{k} was written although the call failed")
        record(calls_refused=1)
    else:
        assert expect == "ok", f"a corrupted call was accepted: plan {plan}, arity {arity}"
        want_s, want_y = reference(snapshot["x"], snapshot["w"], snapshot["s"], snapshot["ids"],
                                   snapshot["alpha"], snapshot["n"])
        got_s, got_y = (_as_np(r) for r in result)
        np.testing.assert_array_equal(got_s, want_s, err_msg=f"s: plan {plan}")
        np.testing.assert_array_equal(got_y, want_y, err_msg=f"y: plan {plan}")
        record(calls_accepted=1)
    record(inputs_fuzzed=1)
    assert_back_to(world.rt, world.base)


def test_fuzzed_runtime_still_computes_after_everything(world):
    rng = np.random.default_rng(7)
    a = _valid_args(rng)
    s0 = a["s"].copy()
    s, y = world.rt(a["x"], a["w"], a["s"], None, a["ids"], a["alpha"], a["n"])
    want_s, want_y = reference(a["x"], a["w"], s0, a["ids"], a["alpha"], a["n"])
    np.testing.assert_array_equal(s, want_s)
    np.testing.assert_array_equal(y, want_y)
    assert_back_to(world.rt, world.base)


# -- kernel calls inside an orchestration -------------------------------------------------------
KERNEL_PLAN: dict[str, Any] = {}


@engine.program(callbacks={"cb": 1})
def orchestrated(run: engine.Run, x: In(("B", 4)), w: In((4, 3)), y: Out(("B", 3))):
    h = run.scratch(("B", 3))
    run.submit(K.matmul, x, w, out=h)
    corrupt = KERNEL_PLAN.get("corrupt")
    if corrupt is not None and not run.planning:
        corrupt(run, x, w, h, y)
    run.submit(K.relu, h, out=y)


def _kernel_corruptions(world: "KWorld") -> list[tuple[str, Callable]]:
    rt2_t = world.foreign
    freed = world.freed
    res = world.res
    return [
        ("numpy input", lambda r, x, w, h, y: r.submit(K.matmul, np.ones((2, 4), np.float32), w, out=h)),
        ("int input", lambda r, x, w, h, y: r.submit(K.relu, 3, out=h)),
        ("None input", lambda r, x, w, h, y: r.submit(K.add, h, None, out=h)),
        ("no out", lambda r, x, w, h, y: r.submit(K.relu, h)),
        ("numpy out", lambda r, x, w, h, y: r.submit(K.relu, h, out=np.zeros((2, 3), np.float32))),
        ("freed input", lambda r, x, w, h, y: r.submit(K.matmul, x, freed, out=h)),
        ("freed out", lambda r, x, w, h, y: r.submit(K.fill, out=freed, value=1.0)),
        ("foreign input", lambda r, x, w, h, y: r.submit(K.matmul, x, rt2_t, out=h)),
        ("shape mismatch", lambda r, x, w, h, y: r.submit(K.add, x, h, out=h)),
        ("matmul inner dim", lambda r, x, w, h, y: r.submit(K.matmul, h, w, out=h)),
        ("dtype mismatch", lambda r, x, w, h, y: r.submit(K.add, h, r.scratch(("B", 3), "int32"), out=h)),
        ("overlapping out", lambda r, x, w, h, y: r.submit(K.matmul, h[:, 0:1], res[0:1, :], out=h)),
        ("partial overlap", lambda r, x, w, h, y: r.submit(K.add, res[0:2, 0:2], res[0:2, 0:2], out=res[1:3, 0:2])),
        ("scalar str", lambda r, x, w, h, y: r.submit(K.scale, h, out=h, alpha="2")),
        ("scalar None", lambda r, x, w, h, y: r.submit(K.scale, h, out=h, alpha=None)),
        ("scalar complex", lambda r, x, w, h, y: r.submit(K.scale, h, out=h, alpha=1j)),
        ("scalar nan", lambda r, x, w, h, y: r.submit(K.scale, h, out=h, alpha=math.nan)),
        ("scalar inf", lambda r, x, w, h, y: r.submit(K.scale, h, out=h, alpha=math.inf)),
        ("scalar bool", lambda r, x, w, h, y: r.submit(K.scale, h, out=h, alpha=True)),
        ("scalar list", lambda r, x, w, h, y: r.submit(K.scale, h, out=h, alpha=[1.0])),
        ("int scalar 2**64", lambda r, x, w, h, y: r.submit(K.fill, out=h, value=2**64)),
        ("int scalar -2**63-1", lambda r, x, w, h, y: r.submit(K.fill, out=h, value=-(2**63) - 1)),
        ("int scalar huge", lambda r, x, w, h, y: r.submit(K.fill, out=h, value=10**400)),
        ("int32 fill range", lambda r, x, w, h, y: r.submit(K.fill, out=r.scratch((2,), "int32"), value=2**40)),
        ("choice", lambda r, x, w, h, y: r.submit(K.gelu, h, out=h, approximate="fast")),
        ("bool param str", lambda r, x, w, h, y: r.submit(K.matmul, x, w, out=h, transpose_b="yes")),
        ("unknown keyword", lambda r, x, w, h, y: r.submit(K.relu, h, out=h, bogus=1)),
        ("extra input", lambda r, x, w, h, y: r.submit(K.relu, h, h, out=h)),
        ("missing input", lambda r, x, w, h, y: r.submit(K.add, h, out=h)),
        ("range param", lambda r, x, w, h, y: r.submit(K.attention, h, h, h, out=h, kv_len=0)),
        ("not a kernel", lambda r, x, w, h, y: r.submit("matmul", x, w, out=h)),
        ("host kernel non-tensor", lambda r, x, w, h, y: r.submit(engine.host_kernel(lambda a, out: None), "x", out=h)),
        ("unknown callback", lambda r, x, w, h, y: r.host("nope", h)),
        ("callback arity", lambda r, x, w, h, y: r.host("cb", h, h)),
        ("callback reads foreign", lambda r, x, w, h, y: r.host("cb", h, reads=[x])),
        ("callback freed", lambda r, x, w, h, y: r.host("cb", freed)),
        ("scratch too big", lambda r, x, w, h, y: r.scratch((10**6, 10**6))),
        ("scratch negative", lambda r, x, w, h, y: r.scratch((-1, 3))),
        ("scratch float dim", lambda r, x, w, h, y: r.scratch((1.5, 3))),
        ("scratch unknown symbol", lambda r, x, w, h, y: r.scratch(("Q", 3))),
        ("scratch dtype", lambda r, x, w, h, y: r.scratch((2,), "float64")),
        ("reshape", lambda r, x, w, h, y: h.reshape(7)),
        ("view index type", lambda r, x, w, h, y: h["a"]),
    ]


class KWorld:
    def __init__(self) -> None:
        self.rt = orchestrated.prepare(depth=2, workers=2, bounds={"B": BOUND}, callbacks={"cb": lambda a: None})
        self.other = orchestrated.prepare(depth=1, workers=1, bounds={"B": BOUND}, callbacks={"cb": lambda a: None})
        self.res = self.rt.alloc_tensor((4, 3), "float32", init=np.ones((4, 3), np.float32))
        self.freed = self.rt.alloc_tensor((4, 3), "float32")
        self.rt.free_tensor(self.freed)
        self.foreign = self.other.alloc_tensor((4, 3), "float32")
        self.base = counters(self.rt)


@pytest.fixture(scope="module")
def kworld():
    w = KWorld()
    yield w
    KERNEL_PLAN.clear()
    w.rt.close()
    w.other.close()


@fuzz
@given(case=st.integers(0, 10**6), seed=st.integers(0, 2**32 - 1), route=st.sampled_from(["call", "submit", "async"]))
def test_corrupted_kernel_calls_in_an_orchestration_raise_type_or_value_errors_only(kworld, case, seed, route):
    cases = _kernel_corruptions(kworld)
    name, corrupt = cases[case % len(cases)]
    rng = np.random.default_rng(seed)
    b = int(rng.integers(1, BOUND + 1))
    x = rng.integers(-3, 4, (b, 4)).astype(np.float32)
    w = rng.integers(-3, 4, (4, 3)).astype(np.float32)
    y = np.full((b, 3), -5.0, np.float32)
    KERNEL_PLAN["corrupt"] = corrupt
    rt = kworld.rt
    try:
        if route == "call":
            rt(x, w, y)
        elif route == "submit":
            rt.submit(x, w, y).result(60)
        else:
            async def main() -> None:
                async with AsyncRuntime(rt) as art:
                    await art.call(x, w, y)

            anyio.run(main)
    except ALLOWED as e:
        assert str(e)
    else:
        pytest.fail(f"kernel corruption {name!r} was accepted")
    finally:
        KERNEL_PLAN.pop("corrupt", None)
    np.testing.assert_array_equal(y, -5.0, err_msg=f"{name}: the output was written although the run failed")
    # still usable and exact
    np.testing.assert_array_equal(rt(x, w, y), np.maximum(x @ w, 0))
    record(inputs_fuzzed=1)
    assert_back_to(rt, kworld.base)


def test_a_float_kernel_scalar_beyond_the_float_range_is_a_value_error(kworld):
    KERNEL_PLAN["corrupt"] = lambda r, x, w, h, y: r.submit(K.scale, h, out=h, alpha=10**400)
    try:
        with pytest.raises(ValueError):
            kworld.rt(np.ones((2, 4), np.float32), np.ones((4, 3), np.float32))
    finally:
        KERNEL_PLAN.pop("corrupt", None)
        assert_back_to(kworld.rt, kworld.base)


# -- the device-memory handle ---------------------------------------------------------------------
WEIRD = [0, -1, 1, 3, 4, 63, 64, 65, 4096, 2**31, 2**62, 2**63, 2**64, 10**30, -(2**63), 1.0, 2.5, "8", None, True,
         [4], (4,), (2, 3), (0,), (-1, 2), (2**40, 2**40), (2**64,), ((2,),), np.int64(8), np.float32(4.0), object()]
DTYPE_WEIRD = ["float32", "int32", "uint8", "bfloat16", "float64", "complex64", None, 3, object, np.float32, "nope"]


@fuzz
@given(ops=st.lists(st.tuples(st.sampled_from(["malloc", "free", "copy_to", "copy_from", "alloc_tensor",
                                               "free_tensor", "to_numpy"]),
                              st.integers(0, len(WEIRD) - 1), st.integers(0, len(DTYPE_WEIRD) - 1),
                              st.integers(0, 7)), min_size=1, max_size=12))
def test_memory_handle_with_random_values_raises_clear_errors_only(world, ops):
    rt = world.rt
    live_bufs: list = []
    live_tensors: list = []
    freed_bufs: list = []
    big_view = world.big[1:3]
    for op, wi, di, pick in ops:
        value, dtype = WEIRD[wi], DTYPE_WEIRD[di]
        host = [np.zeros(0, np.float32), np.ones(4, np.float32), np.ones(64, np.float32), np.ones((2, 3), np.int32),
                np.ones(8, np.float32)[::2], np.zeros(3, np.complex64), [1.0, 2.0], "x"][pick]
        bufs = live_bufs + freed_bufs + [world.w_dev, None, value]
        tensors = live_tensors + [world.freed, world.foreign, big_view, np.zeros(3), value]
        try:
            if op == "malloc":
                live_bufs.append(rt.malloc(value))
            elif op == "free":
                b = bufs[pick % len(bufs)]
                rt.free(b)
                live_bufs.remove(b)
                freed_bufs.append(b)
            elif op == "copy_to":
                rt.copy_to(bufs[pick % len(bufs)], host)
            elif op == "copy_from":
                rt.copy_from(host, bufs[pick % len(bufs)])
            elif op == "alloc_tensor":
                live_tensors.append(rt.alloc_tensor(value, dtype, init=host if pick % 3 == 0 else None))
            elif op == "free_tensor":
                t = tensors[pick % len(tensors)]
                if t is big_view:
                    continue  # freeing a view frees the whole resident, which other examples use
                rt.free_tensor(t)
                live_tensors.remove(t)
            else:
                t = tensors[pick % len(tensors)]
                if not isinstance(t, engine.DeviceTensor):
                    continue  # to_numpy is a DeviceTensor method
                arr = t.to_numpy()
                assert isinstance(arr, np.ndarray) and arr.shape == t.shape
        except (TypeError, ValueError, engine.DeviceMemoryError) as e:
            if isinstance(e, engine.DeviceMemoryError):
                # only an impossible size may exhaust an unlimited device
                assert op in ("malloc", "alloc_tensor"), f"{op}: {e}"
            assert str(e)
        record(inputs_fuzzed=1)
    for b in live_bufs:
        rt.free(b)
    for t in live_tensors:
        rt.free_tensor(t)
    assert_back_to(rt, world.base)


# -- the native device and accessor, against a model ----------------------------------------------------
class DeviceMachine(RuleBasedStateMachine):
    """Random allocations, frees and copies on a native Device and HostAccessor, compared with a model.

    Handles are real, freed (stale), forged (random fields) or interior; spans are in range or not.
    The device must refuse every bad one with ValueError and change nothing; good copies round-trip.
    """

    live = Bundle("live")

    def __init__(self) -> None:
        super().__init__()
        self.capacity = 1 << 16
        self.device = _native.Device(self.capacity)
        self.acc = _native.HostAccessor(self.device)
        self.model: dict[int, tuple[Any, np.ndarray]] = {}  # id -> (buffer, contents)
        self.freed: list = []
        self.mapped: dict[int, tuple[int, np.ndarray]] = {}  # device base -> (size, host view)

    def gone(self, buf: Any) -> bool:
        """A bundle entry that is not (or no longer) a live allocation of the model."""
        return buf is None or buf.id not in self.model

    def refused(self, fn: Callable[[], Any]) -> None:
        before = self.device.stats()
        with pytest.raises((ValueError, TypeError)):
            fn()
        after = self.device.stats()
        for k in ("bytes_in_use", "live_allocations", "mapped_regions", "h2d_bytes", "d2h_bytes", "d2d_bytes"):
            assert after[k] == before[k], (k, before, after)
        record(inputs_fuzzed=1)

    @rule(target=live, n=st.integers(1, 4096), align=st.sampled_from([1, 8, 64, 256, 4096]),
          fill=st.integers(0, 255))
    def alloc(self, n, align, fill):
        try:
            buf = self.device.alloc(n, align)
        except engine.DeviceMemoryError:
            assert self.device.stats()["bytes_in_use"] + n > self.capacity
            return None
        assert buf.addr % align == 0 and buf.size == n
        data = np.full(n, fill, np.uint8)
        self.device.copy_h2d(buf, 0, data)
        self.model[buf.id] = (buf, data)
        return buf

    @rule(buf=consumes(live))
    def free(self, buf):
        if self.gone(buf):
            return
        self.unmap_all_of(buf)
        self.device.free(buf)
        del self.model[buf.id]
        self.freed.append(buf)

    def unmap_all_of(self, buf) -> None:
        if any(buf.addr <= base < buf.addr + buf.size for base in self.mapped):
            self.acc.close()  # closes every mapping; re-add the others
            keep = {b: v for b, v in self.mapped.items() if not buf.addr <= b < buf.addr + buf.size}
            self.mapped.clear()
            for base, (size, view) in keep.items():
                self.acc.add(base, size, view)
                self.mapped[base] = (size, view)

    @rule(buf=live, offset=st.integers(0, 4200), n=st.integers(0, 4200), value=st.integers(0, 255))
    def copy_in(self, buf, offset, n, value):
        if self.gone(buf):
            return
        data = np.full(n, value, np.uint8)
        if offset + n <= buf.size:
            self.device.copy_h2d(buf, offset, data)
            self.model[buf.id][1][offset:offset + n] = value
        else:
            self.refused(lambda: self.device.copy_h2d(buf, offset, data))

    @rule(buf=live, offset=st.integers(0, 4200), n=st.integers(0, 4200))
    def copy_out(self, buf, offset, n):
        if self.gone(buf):
            return
        out = np.zeros(n, np.uint8)
        if offset + n <= buf.size:
            self.device.copy_d2h(out, buf, offset)
            np.testing.assert_array_equal(out, self.model[buf.id][1][offset:offset + n])
        else:
            self.refused(lambda: self.device.copy_d2h(out, buf, offset))

    @rule(dst=live, src=live, doff=st.integers(0, 4200), soff=st.integers(0, 4200), n=st.integers(0, 4200))
    def copy_d2d(self, dst, src, doff, soff, n):
        if self.gone(dst) or self.gone(src):
            return
        if doff + n <= dst.size and soff + n <= src.size:
            self.device.copy_d2d(dst, doff, src, soff, n)
            chunk = self.model[src.id][1][soff:soff + n].copy()
            self.model[dst.id][1][doff:doff + n] = chunk
        else:
            self.refused(lambda: self.device.copy_d2d(dst, doff, src, soff, n))

    @rule(data=st.data())
    def bad_handle(self, data):
        choices = []
        if self.freed:
            choices.append(("stale", data.draw(st.sampled_from(self.freed))))
        if self.model:
            b = data.draw(st.sampled_from([v[0] for v in self.model.values()]))
            if b.size > 1:
                choices.append(("interior", _native.Buffer(b.device_uid, b.id, b.addr + 1, b.size - 1)))
            choices.append(("wrong size", _native.Buffer(b.device_uid, b.id, b.addr, b.size + 1)))
            choices.append(("wrong id", _native.Buffer(b.device_uid, b.id + 1000, b.addr, b.size)))
        choices.append(("forged", _native.Buffer(data.draw(st.integers(0, 2**64 - 1)), data.draw(st.integers(0, 2**64 - 1)),
                                                data.draw(st.integers(0, 2**64 - 1)), data.draw(st.integers(0, 2**64 - 1)))))
        choices.append(("other device", _native.Buffer(self.device.uid ^ 1, 1, 4096, 16)))
        _, buf = data.draw(st.sampled_from(choices))
        host = np.zeros(8, np.uint8)
        op = data.draw(st.sampled_from(["free", "check", "h2d", "d2h", "d2d"]))
        if op == "free":
            self.refused(lambda: self.device.free(buf))
        elif op == "check":
            self.refused(lambda: self.device.check(buf))
        elif op == "h2d":
            self.refused(lambda: self.device.copy_h2d(buf, 0, host))
        elif op == "d2h":
            self.refused(lambda: self.device.copy_d2h(host, buf, 0))
        elif self.model:
            good = next(iter(self.model.values()))[0]
            self.refused(lambda: self.device.copy_d2d(good, 0, buf, 0, 1))

    @rule(buf=live, offset=st.integers(-64, 4200), n=st.integers(0, 4200))
    def resolve(self, buf, offset, n):
        if self.gone(buf):
            return
        addr = buf.addr + offset
        if 0 <= offset < buf.size and n <= buf.size - offset:
            assert self.device.resolve(addr, n) == buf
        elif not 0 <= offset < buf.size:
            # another live allocation may own that address: then resolve names it, else refuses
            try:
                owner = self.device.resolve(addr, n)
            except ValueError:
                return
            assert owner.id in self.model and owner.addr <= addr < owner.addr + owner.size
        else:
            self.refused(lambda: self.device.resolve(addr, n))

    def owner(self, addr: int, n: int) -> Any:
        """The live allocation of the model wholly holding [addr, addr + n), or None."""
        for b, _ in self.model.values():
            if b.addr <= addr and addr + n <= b.addr + b.size and addr < b.addr + b.size:
                return b
        return None

    @rule(buf=live, offset=st.integers(0, 4200), n=st.integers(0, 4200))
    def map_region(self, buf, offset, n):
        if self.gone(buf):
            return
        base = buf.addr + offset
        view = np.zeros(max(n, 1), np.uint8)
        overlaps = any(base < b + s and b < base + n for b, (s, _) in self.mapped.items())
        if n > 0 and offset + n <= buf.size and not overlaps:
            self.acc.add(base, n, view)
            self.mapped[base] = (n, view)
        elif n == 0 or overlaps or self.owner(base, n) is None:
            self.refused(lambda: self.acc.add(base, n, view))
        # else: past buf, inside whichever allocation the system placed next to it; what happens
        # then depends on addresses, and hypothesis needs each step to depend on its draws only



    @precondition(lambda self: bool(self.mapped))
    @rule(data=st.data())
    def accessor_io(self, data):
        base = data.draw(st.sampled_from(list(self.mapped)))  # insertion order: the same on every replay
        size, view = self.mapped[base]
        addr = base + data.draw(st.integers(-8, size + 8))
        n = data.draw(st.integers(0, size + 8))
        host = np.zeros(max(n, 1), np.uint8)
        region = next(((b, s) for b, (s, _) in self.mapped.items() if b <= addr < b + s), None)
        if region is not None and n <= region[0] + region[1] - addr:
            self.acc.read(addr, host, n)
            buf = self.owner(addr, max(n, 1))
            rel = addr - buf.addr
            np.testing.assert_array_equal(host[:n], self.model[buf.id][1][rel:rel + n])
        else:
            self.refused(lambda: self.acc.read(addr, host, n))
        # whole-region transfers both ways
        buf = self.owner(base, size)
        contents = self.model[buf.id][1]
        rel = base - buf.addr
        view[:size] = data.draw(st.integers(0, 255))
        self.acc.stage_in(base)  # host view -> device
        contents[rel:rel + size] = view[:size]
        view[:size] = 0
        self.acc.copy_back(base)  # device -> host view
        np.testing.assert_array_equal(view[:size], contents[rel:rel + size])

    @precondition(lambda self: bool(self.mapped))
    @rule(data=st.data(), reuse=st.booleans())
    def free_under_a_mapping(self, data, reuse):
        """Freeing memory a region still maps: every transfer through that region fails closed."""
        base = data.draw(st.sampled_from(list(self.mapped)))
        size, view = self.mapped[base]
        buf = self.owner(base, size)
        self.device.free(buf)
        del self.model[buf.id]
        self.freed.append(buf)
        if reuse:  # a new allocation may take the same address; the region must still refuse
            nb = self.device.alloc(buf.size, 64)
            self.model[nb.id] = (nb, np.zeros(nb.size, np.uint8))
            self.device.copy_h2d(nb, 0, self.model[nb.id][1])
        host = np.zeros(size, np.uint8)
        self.refused(lambda: self.acc.read(base, host, size))
        self.refused(lambda: self.acc.stage_in(base))
        self.refused(lambda: self.acc.copy_back(base))
        self.unmap_all_of(buf)

    @invariant()
    def counters_match_the_model(self):
        s = self.device.stats()
        assert s["live_allocations"] == len(self.model)
        assert s["bytes_in_use"] == sum(b.size for b, _ in self.model.values())
        assert s["mapped_regions"] == len(self.mapped) == self.acc.mapping_count()

    def teardown(self):
        self.acc.close()
        assert self.device.stats()["mapped_regions"] == 0
        for b, _ in list(self.model.values()):
            self.device.free(b)
        assert self.device.stats()["bytes_in_use"] == 0
        record(leak_checks=1)


DeviceMachine.TestCase.settings = settings(max_examples=size(60, 600, sanitized=25), stateful_step_count=40,
                                           deadline=None, suppress_health_check=[HealthCheck.too_slow])
test_native_device_and_accessor_against_a_model = DeviceMachine.TestCase
