"""Property: a random program gives exactly what a sequential numpy executor gives, at every depth.

Programs are random DAGs of elementwise and matmul tasks over random strided
views of host parameters, resident tensors and scratch (tests/reliability/
programs.py). Each one is prepared at depth 1, 2 and 3 and run several times
back to back (pipelined: the runs share a resident state tensor, so their order
matters), through Runtime.submit, the blocking call, or an AsyncRuntime with
orchestration on the loop or in a thread. Every output, the resident state and
the runtime's counters are checked after each depth.
"""

from __future__ import annotations

import anyio
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler import AsyncRuntime

from .conftest import assert_back_to, counters, record, size
from .programs import RunInputs, Spec, build_program, host_array, make_runs, reference, small_ints, specs

ROUTES = ["submit", "call", "async-loop", "async-thread"]
DEPTHS = (1, 2, 3)

fuzz_settings = settings(
    max_examples=size(40, 400, sanitized=12),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _args(spec: Spec, run: RunInputs, residents: dict, layouts: dict, rng: np.random.Generator,
          outs: dict) -> list:
    args = []
    for d in spec.params:
        if d.kind in ("resident", "state"):
            args.append(residents[d.name])
        elif d.kind == "out":
            if d.name in spec.omit:
                args.append(None)
            else:
                out = host_array(rng, np.full((run.b, d.cols), -77.0, np.float32), layouts[d.name])
                outs[d.name] = out
                args.append(out)
        else:
            arr = host_array(rng, run.host[d.name], layouts[d.name])
            if d.kind == "inout":
                outs[d.name] = arr
            args.append(arr)
    args.append(run.k)
    return args


def _collect(spec: Spec, result: object, outs: dict) -> dict:
    """The outputs by name: the passed arrays (filled in place) and the returned ones (omitted Outs)."""
    writes = [d for d in spec.params if d.kind in ("inout", "out", "state")]
    values = result if len(writes) > 1 else (result,)
    assert isinstance(values, tuple) and len(values) == len(writes), (result, writes)
    got = {}
    for d, v in zip(writes, values):
        if d.kind == "state":
            continue  # the resident itself: compared after the last run
        if d.name in outs:
            assert v is outs[d.name], f"{d.name}: the passed array must come back"
        got[d.name] = np.asarray(v)
    return got


def _run_all(rt, spec: Spec, runs: list[RunInputs], residents: dict, layouts: dict, route: str,
             rng: np.random.Generator) -> list[dict]:
    calls = []
    for r in runs:
        outs: dict = {}
        calls.append((_args(spec, r, residents, layouts, rng, outs), outs))
    if route == "call":
        return [_collect(spec, rt(*args), outs) for args, outs in calls]
    if route == "submit":
        handles = [rt.submit(*args) for args, _ in calls]  # pipelined: up to depth in flight
        return [_collect(spec, h.result(60), outs) for h, (_, outs) in zip(handles, calls)]

    async def main() -> list:
        async with AsyncRuntime(rt, orchestrate_in_thread=route == "async-thread") as art:
            futs = [await art.dispatch(*args) for args, _ in calls]
            return [_collect(spec, await f, outs) for f, (_, outs) in zip(futs, calls)]

    return anyio.run(main)


@fuzz_settings
@given(spec=specs(), seed=st.integers(0, 2**32 - 1), route=st.sampled_from(ROUTES),
       workers=st.integers(1, 3))
def test_random_programs_match_the_numpy_reference_at_every_depth(spec: Spec, seed: int, route: str,
                                                                  workers: int) -> None:
    prog = build_program(spec)
    rng = np.random.default_rng(seed)
    runs = make_runs(spec, rng)
    layouts = {d.name: str(rng.choice(["c", "c", "fortran", "strided"])) for d in spec.params}
    init = {d.name: small_ints(rng, (d.rows, d.cols)) for d in spec.params if d.kind in ("resident", "state")}
    want_outs, want_residents = reference(spec, runs, init)

    for depth in DEPTHS:
        with prog.prepare(depth=depth, workers=workers, bounds={"B": spec.bmax}) as rt:
            base = counters(rt)
            residents = {n: rt.alloc_tensor(a.shape, "float32", init=a) for n, a in init.items()}
            with_residents = counters(rt)
            got = _run_all(rt, spec, runs, residents, layouts, route, rng)
            for i, (g, w) in enumerate(zip(got, want_outs)):
                for name in w:
                    np.testing.assert_array_equal(
                        g[name], w[name], err_msg=f"depth {depth}, route {route}, run {i}, output {name}\n"
                        + spec.describe())
            for name, t in residents.items():
                np.testing.assert_array_equal(t.to_numpy(), want_residents[name],
                                              err_msg=f"depth {depth}, route {route}, resident {name}\n"
                                              + spec.describe())
            assert_back_to(rt, with_residents)
            for t in residents.values():
                rt.free_tensor(t)
            assert_back_to(rt, base)
        assert rt.closed
    record(programs_fuzzed=1, dispatches=len(DEPTHS) * spec.n_runs,
           dispatches_survived=len(DEPTHS) * spec.n_runs, inputs_fuzzed=len(DEPTHS) * spec.n_runs)
