"""Property: random programs run captured give bit-identical results to the same programs run uncaptured."""

from __future__ import annotations

import gc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import engine
from engine import In, InOut, Out, Scalar
from engine import kernels as K

TARGETS = ("s0", "s1", "y", "kv")
SOURCES = ("x", "s0", "s1", "y", "kv")

op = st.one_of(
    st.tuples(st.just("scale_a"), st.sampled_from(SOURCES), st.sampled_from(TARGETS)),  # a passed through
    st.tuples(st.just("scale_k"), st.sampled_from(SOURCES), st.sampled_from(TARGETS)),  # k read: a branch
    st.tuples(st.just("add"), st.sampled_from(SOURCES), st.sampled_from(TARGETS)),
    st.tuples(st.just("relu"), st.sampled_from(SOURCES), st.sampled_from(TARGETS)),
    st.tuples(st.just("matmul"), st.sampled_from(SOURCES), st.sampled_from(TARGETS)),
    st.tuples(st.just("halves"), st.sampled_from(TARGETS), st.sampled_from(TARGETS)),
)
runs = st.lists(st.tuples(st.integers(1, 6),                       # B
                          st.sampled_from([0.5, -1.25, 2.0, 3.0]),  # a
                          st.integers(0, 3)),                       # k
                min_size=2, max_size=6)


def make_program(ops: list[tuple[str, str, str]]) -> engine.Program:
    @engine.program
    def prog(run: engine.Run, x: In(("B", 8)), w: In((8, 8)), kv: InOut((6, 8)), y: Out(("B", 8)),
             a: Scalar(float), k: Scalar(int)):
        B = run.dims["B"]
        t = {"x": x, "y": y, "s0": run.scratch(("B", 8)), "s1": run.scratch(("B", 8)), "kv": kv[0:B]}
        for name in ("s0", "s1", "y"):
            run.submit(K.fill, out=t[name], value=0.25)
        for kind, src, dst in ops:
            if kind == "scale_a":
                run.submit(K.scale, t[src], out=t[dst], alpha=a)
            elif kind == "scale_k":
                if k >= 2:
                    run.submit(K.scale, t[src], out=t[dst], alpha=float(k))
                else:
                    run.submit(K.copy, t[src], out=t[dst])
            elif kind == "add":
                run.submit(K.add, t[src], t[dst], out=t[dst])
            elif kind == "relu":
                run.submit(K.relu, t[src], out=t[dst])
            elif kind == "matmul" and src != dst:
                run.submit(K.matmul, t[src], w, out=t[dst], beta=0.5)
            elif kind == "halves":  # views: each half of the rows on its own
                for part_src, part_dst in zip(run.split(t[src], 2), run.split(t[dst], 2)):
                    run.submit(K.add, part_src, part_dst, out=part_dst)
        run.submit(K.add, y, t["s1"], out=y)

    return prog


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(op, min_size=1, max_size=12), sequence=runs, seed=st.integers(0, 2**16))
def test_random_programs_replay_bit_identically(ops, sequence, seed, device_spy):
    prog = make_program(ops)
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((8, 8)) * 0.3).astype(np.float32)
    kv0 = rng.standard_normal((6, 8)).astype(np.float32)
    xs = [rng.standard_normal((B, 8)).astype(np.float32) for B, _, _ in sequence]
    results = {}
    for capture in (False, True):
        with prog.prepare(bounds={"B": 6}, depth=2, workers=2, capture=capture) as rt:
            wd = rt.alloc_tensor((8, 8), init=w)
            kv = rt.alloc_tensor((6, 8), init=kv0)
            handles = [rt.submit(x, wd, kv, a=a, k=k) for x, (_, a, k) in zip(xs, sequence)]
            outs = [h.result()[1] for h in handles]  # (kv, y)
            results[capture] = (outs, kv.to_numpy(), rt.capture_stats())
    (plain, kv_plain, _), (captured, kv_captured, stats) = results[False], results[True]
    for a_, b_ in zip(plain, captured):
        np.testing.assert_array_equal(a_, b_)
    np.testing.assert_array_equal(kv_plain, kv_captured)
    assert stats["hits"] + stats["misses"] == len(sequence) and stats["misses"] >= 1
    gc.collect()
    for dev in device_spy:
        assert dev.stats()["live_allocations"] == 0  # everything back after close


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_a_branch_on_a_scalar_takes_the_right_path_for_every_value(k):
    prog = make_program([("scale_k", "x", "s1")])
    x = np.arange(8, dtype=np.float32).reshape(1, 8)
    with prog.prepare(bounds={"B": 1}, capture=True) as rt:
        kv = rt.alloc_tensor((6, 8), init=np.zeros((6, 8), np.float32))
        w = rt.alloc_tensor((8, 8), init=np.eye(8, dtype=np.float32))
        for other in (0, 1, 2, 3):  # record every key first, then ask for k
            rt(x, w, kv, a=1.0, k=other)
        _, y = rt(x, w, kv, a=1.0, k=k)
        assert rt.capture_stats()["misses"] == 4
    expected = x * (k if k >= 2 else 1) + 0.25  # s1 = x * factor, y = its fill + s1
    np.testing.assert_array_equal(y, expected)
