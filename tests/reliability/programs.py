"""Random programs for property-based tests, and a numpy reference executor for them.

A random program declares tensors of two classes:

* row tensors, shape ("B", cols): host In / InOut / Out parameters and scratch
  from the slot's arena; "B" is bound per run (between bmin and bmax);
* fixed tensors, shape (rows, cols): host In weights, resident DeviceTensors
  passed for an In parameter, one resident DeviceTensor passed for an InOut
  parameter ("state": it carries over from run to run, so pipelined runs must
  execute in order), and fixed-shape scratch.

Its ops are elementwise (fill, relu, scale, copy, add, sub, mul, a host-kernel
add) and matmul (alpha, beta, transpose_b) over random strided views of those
tensors (row selections start::step, column selections c0:...:cstep, single
rows as broadcast vectors), in place where the kernel allows it.

Values are small integers and every op is checked, by interval arithmetic over
all runs, to stay below 2**22: every intermediate result is an integer that
float32 represents exactly, whatever order a kernel (or BLAS) sums in. So the
engine must match the sequential numpy reference exactly, not approximately:
any misordered, skipped, duplicated or misplaced task changes the answer.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
from hypothesis import strategies as st

import engine
from engine import In, InOut, Out, Scalar
from engine import kernels as K

LIMIT = float(2**22)  # values stay integers below this: exact in float32

ROW_KINDS = ("in", "inout", "out", "scratch")
FIXED_KINDS = ("weight", "resident", "state", "fscratch")
WRITABLE = frozenset({"inout", "out", "scratch", "state", "fscratch"})
PARAM_KINDS = ("in", "inout", "out", "weight", "resident", "state")  # in declaration order


@engine.host_kernel(name="host_add")
def host_add(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    np.add(a, b, out=out)


KERNELS = {"relu": K.relu, "scale": K.scale, "copy": K.copy, "add": K.add, "sub": K.sub, "mul": K.mul,
           "hadd": host_add, "matmul": K.matmul, "fill": K.fill}


@dataclass(frozen=True)
class Decl:
    name: str
    kind: str
    cols: int
    rows: int | None = None  # None: "B" rows (a row tensor)

    @property
    def is_row(self) -> bool:
        return self.rows is None


@dataclass(frozen=True)
class View:
    tensor: str
    c0: int
    cs: int
    w: int
    r0: int = 0  # fixed tensors only
    rs: int = 1
    h: int = 0
    vec_row: int | None = None  # a single row of a fixed tensor, as a 1-D vector

    def cols(self) -> slice:
        return slice(self.c0, self.c0 + (self.w - 1) * self.cs + 1, self.cs)

    def take(self, t: Any, rows: tuple[int, int] | None) -> Any:
        """This view of t (a numpy array or a DeviceTensor; both slice alike)."""
        if self.vec_row is not None:
            return t[self.vec_row, self.cols()]
        if self.h == 0:  # a row tensor: the op's row selection
            assert rows is not None
            return t[rows[0]::rows[1], self.cols()]
        return t[self.r0:self.r0 + (self.h - 1) * self.rs + 1:self.rs, self.cols()]


@dataclass(frozen=True)
class Op:
    kind: str
    out: View
    ins: tuple[View, ...] = ()
    rows: tuple[int, int] | None = None  # (start, step) for row-tensor views
    alpha: int = 1
    beta: int = 0
    transpose_b: bool = False
    value: int | None = None  # fill: None takes the run's scalar k


@dataclass
class Spec:
    bmin: int
    bmax: int
    decls: list[Decl]
    ops: list[Op]
    n_runs: int
    omit: frozenset[str] = field(default_factory=frozenset)  # Out params passed as None

    def decl(self, name: str) -> Decl:
        return next(d for d in self.decls if d.name == name)

    @property
    def params(self) -> list[Decl]:
        order = {k: i for i, k in enumerate(PARAM_KINDS)}
        return sorted((d for d in self.decls if d.kind in order), key=lambda d: order[d.kind])

    @property
    def scratch(self) -> list[Decl]:
        return [d for d in self.decls if d.kind in ("scratch", "fscratch")]

    def describe(self) -> str:
        lines = [f"B in [{self.bmin}, {self.bmax}], {self.n_runs} runs, omitted outs {sorted(self.omit)}"]
        lines += [f"  {d}" for d in self.decls]
        lines += [f"  {op}" for op in self.ops]
        return "\n".join(lines)


# -- bounds: keep every value an exact float32 integer ------------------------------------------
def _bound_after(spec_decls: list[Decl], ops: Sequence[Op], n_runs: int) -> float:
    decls = {d.name: d for d in spec_decls}
    bound = {n: 0.0 for n in decls}
    worst = 0.0
    for d in spec_decls:
        if d.kind == "state":
            bound[d.name] = 3.0
    for _ in range(n_runs):
        for d in spec_decls:
            if d.kind in ("in", "inout", "weight", "resident"):
                bound[d.name] = 3.0
            elif d.kind in ("out", "scratch", "fscratch"):
                bound[d.name] = 0.0
        for op in ops:
            o = op.out.tensor
            ins = [bound[v.tensor] for v in op.ins]
            if op.kind == "fill":
                new = float(abs(op.value) if op.value is not None else 5)
            elif op.kind in ("relu", "copy"):
                new = ins[0]
            elif op.kind == "scale":
                new = abs(op.alpha) * ins[0]
            elif op.kind in ("add", "sub", "hadd"):
                new = ins[0] + ins[1]
            elif op.kind == "mul":
                new = ins[0] * ins[1]
            else:  # matmul
                k = op.ins[0].w
                new = k * abs(op.alpha) * ins[0] * ins[1] + abs(op.beta) * bound[o]
            bound[o] = max(bound[o], new)
            worst = max(worst, bound[o])
    return worst


# -- generation ---------------------------------------------------------------------------------
def _col_view(draw: Any, d: Decl, w: int) -> View:
    c0 = draw(st.integers(0, d.cols - w))
    max_cs = 1 if w == 1 else min(3, (d.cols - 1 - c0) // (w - 1))
    cs = draw(st.integers(1, max(1, max_cs)))
    return View(d.name, c0, cs, w)


def _fixed_view(draw: Any, d: Decl, h: int, w: int) -> View:
    assert d.rows is not None
    v = _col_view(draw, d, w)
    r0 = draw(st.integers(0, d.rows - h))
    max_rs = 1 if h == 1 else min(3, (d.rows - 1 - r0) // (h - 1))
    rs = draw(st.integers(1, max(1, max_rs)))
    return View(d.name, v.c0, v.cs, w, r0, rs, h)


def _full(d: Decl) -> View:
    if d.is_row:
        return View(d.name, 0, 1, d.cols)
    assert d.rows is not None
    return View(d.name, 0, 1, d.cols, 0, 1, d.rows)


def _draw_op(draw: Any, decls: list[Decl], bmin: int) -> Op | None:
    """One random op, or None when the drawn shape has no fitting tensors."""
    kind = draw(st.sampled_from(["fill", "relu", "scale", "copy", "add", "sub", "mul", "hadd",
                                 "matmul", "matmul", "matmul"]))
    row_class = draw(st.booleans())
    cls = [d for d in decls if d.is_row == row_class]
    if not cls:
        return None
    rows = (draw(st.integers(0, bmin - 1)), draw(st.integers(1, 3))) if row_class else None
    max_cols = max(d.cols for d in cls)

    def pick(cands: list[Decl]) -> Decl | None:
        return draw(st.sampled_from(cands)) if cands else None

    if kind == "matmul":
        b = pick([d for d in decls if not d.is_row])
        if b is None:
            return None
        assert b.rows is not None
        tb = draw(st.booleans())
        # b [K, N] (or [N, K] with transpose_b) fixed; a [M, K] and out [M, N] from the class
        kdim = draw(st.integers(1, b.cols if tb else b.rows))
        ndim_ = draw(st.integers(1, b.rows if tb else b.cols))
        a = pick([d for d in cls if d.cols >= kdim])
        out = pick([d for d in cls if d.kind in WRITABLE and d.cols >= ndim_ and a is not None
                    and d.name not in (a.name, b.name)])
        if a is None or out is None:
            return None
        h = 0
        if not row_class:
            assert a.rows is not None and out.rows is not None
            h = draw(st.integers(1, min(a.rows, out.rows)))
        av = _col_view(draw, a, kdim) if row_class else _fixed_view(draw, a, h, kdim)
        bv = _fixed_view(draw, b, ndim_, kdim) if tb else _fixed_view(draw, b, kdim, ndim_)
        ov = _col_view(draw, out, ndim_) if row_class else _fixed_view(draw, out, h, ndim_)
        return Op("matmul", ov, (av, bv), rows, alpha=draw(st.sampled_from([1, -1, 2])),
                  beta=draw(st.sampled_from([0, 0, 1])), transpose_b=tb)

    w = draw(st.integers(1, max_cols))
    h = 0
    out = pick([d for d in cls if d.kind in WRITABLE and d.cols >= w])
    if out is None:
        return None
    if not row_class:
        assert out.rows is not None
        h = draw(st.integers(1, out.rows))

    def view_of(d: Decl) -> View:
        return _col_view(draw, d, w) if row_class else _fixed_view(draw, d, h, w)

    def fits(d: Decl) -> bool:
        return d.cols >= w and (row_class or (d.rows or 0) >= h)

    if kind == "fill":
        return Op("fill", view_of(out), (), rows, value=draw(st.one_of(st.none(), st.integers(-4, 4))))
    ov = view_of(out)
    if kind in ("relu", "scale", "copy"):
        if draw(st.booleans()):
            src = ov  # in place: the exact same view
        else:
            d = pick([d for d in cls if fits(d) and d.name != out.name])
            if d is None:
                return None
            src = view_of(d)
        return Op(kind, ov, (src,), rows, alpha=draw(st.sampled_from([-2, -1, 2, 3])))
    # binary: a and out of one shape; b the same shape or a broadcast row vector of a fixed tensor
    inplace = draw(st.sampled_from([None, 0, 1]))
    others = [d for d in cls if fits(d) and d.name != out.name]
    a = ov if inplace == 0 else (view_of(pick(others)) if others else None)
    if a is None:
        return None
    vectors = [d for d in decls if not d.is_row and d.cols >= w and d.name != out.name]
    if inplace == 1:
        b = ov
    elif vectors and draw(st.booleans()):
        d = pick(vectors)
        assert d is not None and d.rows is not None
        cv = _col_view(draw, d, w)
        b = View(d.name, cv.c0, cv.cs, w, vec_row=draw(st.integers(0, d.rows - 1)))
    elif others:
        b = view_of(pick(others))
    else:
        return None
    return Op(kind, ov, (a, b), rows)


@st.composite
def specs(draw: Any, max_ops: int = 20, max_runs: int = 5) -> Spec:
    bmin = draw(st.integers(1, 4))
    bmax = bmin + draw(st.integers(0, 3))
    cols = st.integers(1, 6)
    decls: list[Decl] = []
    counts = {"in": (1, 2), "inout": (0, 1), "out": (1, 2), "scratch": (0, 2),
              "weight": (0, 2), "resident": (0, 1), "state": (0, 1), "fscratch": (0, 1)}
    for kind, (lo, hi) in counts.items():
        for i in range(draw(st.integers(lo, hi))):
            rows = None if kind in ROW_KINDS else draw(st.integers(1, 6))
            decls.append(Decl(f"{kind}{i}", kind, draw(cols), rows))
    # Out parameters and scratch are written whole first: nothing reads memory no task wrote.
    ops: list[Op] = [Op("fill", _full(d), (), (0, 1) if d.is_row else None, value=draw(st.integers(-3, 3)))
                     for d in decls if d.kind in ("out", "scratch", "fscratch")]
    for _ in range(draw(st.integers(2, max_ops))):
        op = _draw_op(draw, decls, bmin)
        if op is not None:
            ops.append(op)
    n_runs = draw(st.integers(1, max_runs))
    while _bound_after(decls, ops, n_runs) > LIMIT:
        ops.pop()
    omit = frozenset(d.name for d in decls if d.kind == "out" and draw(st.booleans()))
    return Spec(bmin, bmax, decls, ops, n_runs, omit)


# -- the engine side ------------------------------------------------------------------------------
def build_program(spec: Spec) -> engine.Program:
    """An engine.Program whose orchestration submits spec.ops."""
    params = spec.params

    def annotation(d: Decl) -> Any:
        shape = ("B", d.cols) if d.is_row else (d.rows, d.cols)
        return {"in": In, "weight": In, "resident": In, "inout": InOut, "state": InOut, "out": Out}[d.kind](shape)

    names = [d.name for d in params] + ["k"]
    scratch = spec.scratch
    ops = spec.ops

    def orchestrate(run: engine.Run, *args: Any) -> None:
        env = dict(zip(names, args))
        k = env.pop("k")
        for d in scratch:
            env[d.name] = run.scratch(("B", d.cols) if d.is_row else (d.rows, d.cols))
        for op in ops:
            out = op.out.take(env[op.out.tensor], op.rows)
            ins = [v.take(env[v.tensor], op.rows) for v in op.ins]
            if op.kind == "fill":
                run.submit(K.fill, out=out, value=k if op.value is None else op.value)
            elif op.kind == "scale":
                run.submit(K.scale, *ins, out=out, alpha=float(op.alpha))
            elif op.kind == "matmul":
                run.submit(K.matmul, *ins, out=out, alpha=float(op.alpha), beta=float(op.beta),
                           transpose_b=op.transpose_b)
            else:
                run.submit(KERNELS[op.kind], *ins, out=out)

    sig = [inspect.Parameter("run", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    annotations: dict[str, Any] = {}
    for d in params:
        sig.append(inspect.Parameter(d.name, inspect.Parameter.POSITIONAL_OR_KEYWORD))
        annotations[d.name] = annotation(d)
    sig.append(inspect.Parameter("k", inspect.Parameter.POSITIONAL_OR_KEYWORD))
    annotations["k"] = Scalar(int)
    orchestrate.__signature__ = inspect.Signature(sig)  # type: ignore[attr-defined]
    orchestrate.__annotations__ = annotations
    orchestrate.__qualname__ = orchestrate.__name__ = "random_program"
    return engine.program(orchestrate)


# -- inputs and the reference ------------------------------------------------------------------------
def small_ints(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return rng.integers(-3, 4, size=shape).astype(np.float32)


def host_array(rng: np.random.Generator, values: np.ndarray, layout: str) -> np.ndarray:
    """values laid out as given: C-contiguous, Fortran order, or a strided view of a bigger array."""
    if layout == "fortran":
        return np.array(values, order="F", copy=True)  # a copy even when values is already Fortran-ordered
    if layout == "strided":
        big = np.full((values.shape[0] * 2, values.shape[1] + 3), -99.0, np.float32)
        view = big[::2, 1:1 + values.shape[1]]
        view[...] = values
        return view
    return values.copy()


@dataclass
class RunInputs:
    b: int
    k: int
    host: dict[str, np.ndarray]  # In / InOut / weight values (InOut: before the run)


def make_runs(spec: Spec, rng: np.random.Generator) -> list[RunInputs]:
    runs = []
    for _ in range(spec.n_runs):
        b = int(rng.integers(spec.bmin, spec.bmax + 1))
        host = {}
        for d in spec.params:
            if d.kind in ("in", "inout"):
                host[d.name] = small_ints(rng, (b, d.cols))
            elif d.kind == "weight":
                assert d.rows is not None
                host[d.name] = small_ints(rng, (d.rows, d.cols))
        runs.append(RunInputs(b, int(rng.integers(-5, 6)), host))
    return runs


def reference(spec: Spec, runs: list[RunInputs], residents: dict[str, np.ndarray]) -> tuple[list[dict], dict]:
    """Executes the ops of every run in order in numpy: (per-run outputs by name, final residents)."""
    residents = {n: a.copy() for n, a in residents.items()}
    outs = []
    for r in runs:
        env: dict[str, np.ndarray] = {}
        for d in spec.decls:
            if d.kind in ("in", "inout", "weight"):
                env[d.name] = r.host[d.name].copy()
            elif d.kind in ("resident", "state"):
                env[d.name] = residents[d.name]
            else:  # out and scratch: never read before written (the fill prologue)
                env[d.name] = np.full((r.b, d.cols) if d.is_row else (d.rows, d.cols), np.nan, np.float32)
        for op in spec.ops:
            out = op.out.take(env[op.out.tensor], op.rows)
            ins = [v.take(env[v.tensor], op.rows) for v in op.ins]
            if op.kind == "fill":
                out[...] = r.k if op.value is None else op.value
            elif op.kind == "relu":
                out[...] = np.maximum(ins[0], 0)
            elif op.kind == "scale":
                out[...] = op.alpha * ins[0]
            elif op.kind == "copy":
                out[...] = ins[0]
            elif op.kind in ("add", "hadd"):
                out[...] = ins[0] + ins[1]
            elif op.kind == "sub":
                out[...] = ins[0] - ins[1]
            elif op.kind == "mul":
                out[...] = ins[0] * ins[1]
            else:
                b = ins[1].T if op.transpose_b else ins[1]
                out[...] = op.alpha * (ins[0] @ b) + op.beta * out
        outs.append({d.name: env[d.name].copy() for d in spec.params if d.kind in ("inout", "out")})
    return outs, residents
