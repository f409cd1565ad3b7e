"""Property: programs that write and read column slices (of matrices, of heads) give the sequential answer.

Dependency tracking orders two tasks only when their views may share a byte:
column slices of the same rows do not, though their byte extents overlap, so
they run in parallel. These random programs mix rectangles of rows and columns
and head slices over scratch and a resident tensor, run on two workers,
captured and not, against numpy applying the same steps in order.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import engine
from engine import In, InOut, Out
from engine import kernels as K

R, C = 6, 16
TENSORS = ("m", "s", "y")

rect = st.tuples(st.integers(0, R - 1), st.integers(1, R), st.integers(0, C - 1), st.integers(1, C))
op = st.tuples(st.sampled_from(["scale", "add", "heads"]), st.sampled_from(TENSORS), st.sampled_from(TENSORS),
               rect, rect, st.sampled_from([0.5, 2.0, -1.0]))


def window(r: tuple[int, int, int, int], rows: int, cols: int) -> tuple[slice, slice]:
    """A rectangle of at most rows x cols, anchored by r (its shape the smaller of r's and what fits)."""
    r0, h, c0, w = r
    return slice(r0, min(R, r0 + min(h, rows))), slice(c0, min(C, c0 + min(w, cols)))


def plan(ops: list) -> list[tuple]:
    """Steps (kind, src, dst, src index, dst index, alpha): same shapes, never a partial alias of src and dst."""
    steps = []
    for kind, src, dst, rs, rd, alpha in ops:
        if kind == "heads":  # [2, 3, 16] viewed as 4 heads of 4 columns: one head from src into another of dst
            hs, hd = rs[2] % 4, rd[2] % 4
            if src == dst and hs == hd:
                continue
            steps.append(("heads", src, dst, hs, hd, alpha))
            continue
        si = window(rs, R, C)
        rows, cols = si[0].stop - si[0].start, si[1].stop - si[1].start
        di = window(rd, rows, cols)
        h, w = di[0].stop - di[0].start, di[1].stop - di[1].start
        si = (slice(si[0].start, si[0].start + h), slice(si[1].start, si[1].start + w))
        if src == dst and si != di:
            a, b = np.zeros((R, C), bool), np.zeros((R, C), bool)
            a[si], b[di] = True, True
            if (a & b).any():
                continue
        steps.append((kind, src, dst, si, di, alpha))
    return steps


def reference(steps: list[tuple], m: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    t = {"m": m.copy(), "s": x.copy(), "y": np.full((R, C), 0.25, np.float32)}
    for kind, src, dst, si, di, alpha in steps:
        if kind == "heads":
            a = t[src].reshape(2, 3, C)[:, :, 4 * si:4 * si + 4].copy()
            d = t[dst].reshape(2, 3, C)[:, :, 4 * di:4 * di + 4]
            d[...] = a * np.float32(alpha)
        elif kind == "scale":
            t[dst][di] = t[src][si] * np.float32(alpha)
        else:
            t[dst][di] = t[src][si] + t[dst][di]
    return t["m"], t["y"]


def make_program(steps: list[tuple]) -> engine.Program:
    @engine.program
    def prog(run: engine.Run, x: In((R, C)), m: InOut((R, C)), y: Out((R, C))):
        t = {"m": m, "s": run.scratch((R, C)), "y": y}
        run.submit(K.copy, x, out=t["s"])
        run.submit(K.fill, out=y, value=0.25)
        for kind, src, dst, si, di, alpha in steps:
            if kind == "heads":
                a = t[src].reshape(2, 3, C)[:, :, 4 * si:4 * si + 4]
                d = t[dst].reshape(2, 3, C)[:, :, 4 * di:4 * di + 4]
                run.submit(K.scale, a, out=d, alpha=alpha)
            elif kind == "scale":
                run.submit(K.scale, t[src][si], out=t[dst][di], alpha=alpha)
            else:
                run.submit(K.add, t[src][si], t[dst][di], out=t[dst][di])

    return prog


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(op, min_size=1, max_size=24), seed=st.integers(0, 2**16))
def test_column_and_head_slices_give_the_sequential_answer(ops, seed):
    steps = plan(ops)
    prog = make_program(steps)
    rng = np.random.default_rng(seed)
    m0 = rng.standard_normal((R, C)).astype(np.float32)
    xs = [rng.standard_normal((R, C)).astype(np.float32) for _ in range(3)]
    for capture in (False, True):
        with prog.prepare(workers=2, depth=2, capture=capture) as rt:
            m = rt.alloc_tensor((R, C), init=m0)
            expected_m = m0
            handles = [rt.submit(x, m) for x in xs]  # runs in flight together: m orders them
            for x, h in zip(xs, handles):
                expected_m, expected_y = reference(steps, expected_m, x)
                _, y = h.result()
                np.testing.assert_array_equal(y, expected_y)
            np.testing.assert_array_equal(m.to_numpy(), expected_m)
