"""`tandem demo`: the MLP prepared once at depth 1 and once at depth 2, each warmed up, then measured in
interleaved repetitions and checked against numpy; then a 200-task program run uncaptured and captured
(its orchestration recorded once and replayed natively)."""

from __future__ import annotations

import functools
import math
import statistics
import time
from typing import Any

import numpy as np

import engine
from tandem.programs import (D_HIDDEN, D_IN, SMALL, SMALL_TASKS, mlp, mlp_weights, small_tasks,
                             small_tasks_reference, warm_up)


def reference(x: np.ndarray, w1: np.ndarray, w2: np.ndarray) -> np.ndarray:
    """The MLP in float64 numpy (tanh gelu), rounded to float32."""
    h = x.astype(np.float64) @ w1
    h = 0.5 * h * (1 + np.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3)))
    return (h @ w2).astype(np.float32)


REPS = 3


def measure(rt: engine.Runtime, batches: list[np.ndarray], w1: Any, w2: Any
            ) -> tuple[float, list[np.ndarray], float, float]:
    """Runs/s, outputs, and per run the mean host time and device time (first task start to last task end),
    in seconds."""
    t0 = time.perf_counter()
    handles = [rt.submit(x, w1, w2) for x in batches]
    outs = [h.result() for h in handles]
    rate = len(batches) / (time.perf_counter() - t0)
    times = [h.times() for h in handles]
    t_host = sum(t["sealed_ns"] - t["created_ns"] for t in times) / len(times) / 1e9
    t_device = sum(t["last_end_ns"] - t["first_start_ns"] for t in times) / len(times) / 1e9
    return rate, outs, t_host, t_device


def main(runs: int = 200, batch: int = 32) -> int:
    rng = np.random.default_rng(0)
    w1, w2 = mlp_weights(rng)
    batches = [rng.standard_normal((batch, D_IN)).astype(np.float32) for _ in range(runs)]
    print(f"tandem demo: MLP {D_IN}->{D_HIDDEN}->{D_IN}, batch {batch}, {runs} runs on the 'cpu' device")
    with mlp.prepare(depth=1, bounds={"B": batch}) as rt1, mlp.prepare(depth=2, bounds={"B": batch}) as rt2:
        rts = {1: rt1, 2: rt2}
        weights = {d: (rt.alloc_tensor(w1.shape, "float32", init=w1),  # resident: not copied per run
                       rt.alloc_tensor(w2.shape, "float32", init=w2)) for d, rt in rts.items()}
        for d, rt in rts.items():
            warm_up(functools.partial(measure, rt, batches[:10], *weights[d]))
        before = {d: rt.memory_stats() for d, rt in rts.items()}
        samples: dict[int, list[tuple[float, list[np.ndarray], float, float]]] = {1: [], 2: []}
        for rep in range(REPS):  # interleaved, alternating which goes first: both see the same machine
            for d in (1, 2) if rep % 2 == 0 else (2, 1):
                samples[d].append(measure(rts[d], batches, *weights[d]))
        after = {d: rt.memory_stats() for d, rt in rts.items()}
        workers = rt2.workers
    rates = {d: statistics.median(s[0] for s in samples[d]) for d in rts}
    # Depth 1 does not overlap: its host and device times are each step's own.
    t_host = statistics.median(s[2] for s in samples[1])
    t_device = statistics.median(s[3] for s in samples[1])
    print(f"  per run at depth 1: host step {t_host * 1e3:.3f} ms, then device work {t_device * 1e3:.3f} ms "
          f"on {workers} workers")
    for d in rts:
        outs = samples[d][-1][1]
        worst = max(float(np.max(np.abs(o - reference(x, w1, w2)))) for x, o in zip(batches[:8], outs[:8]))
        if worst > 1e-3:
            print(f"FAILED: depth {d} output differs from numpy by {worst:.2e}")
            return 1
        if after[d]["total_allocations"] != before[d]["total_allocations"]:
            print("FAILED: steady-state runs allocated device memory")
            return 1
        h2d = (after[d]["h2d_bytes"] - before[d]["h2d_bytes"]) // (runs * REPS)
        print(f"  depth {d}: {rates[d]:8.1f} runs/s  (median of {REPS}, max |err| vs numpy {worst:.1e}, "
              f"h2d per run {h2d} B)")
    # The host and the device share this machine's cores, so no clean bound goes here: `tandem bench overlap`
    # measures the overlap against 1 / max(T_host, T_device) with a device of its own (one spinning worker).
    print(f"  pipelining: depth 2 / depth 1 = {rates[2] / rates[1]:.2f}x (run N+1's host step while run N is on "
          "the device)")
    if capture_demo(rng, runs) != 0:
        return 1
    print("OK: outputs match numpy; no device allocations in steady state; captured runs replay exactly")
    return 0


def capture_demo(rng: np.random.Generator, runs: int) -> int:
    """The 200-task program uncaptured and captured: host orchestration per run, runs/s, same outputs."""
    x = rng.standard_normal((SMALL, SMALL)).astype(np.float32)
    w = (rng.standard_normal((SMALL, SMALL)) / 8).astype(np.float32)
    print(f"tandem demo: a program of {SMALL_TASKS} small tasks, uncaptured and captured (prepare(capture=True))")
    results: dict[bool, tuple[float, float, np.ndarray]] = {}
    for capture in (False, True):
        with small_tasks.prepare(workers=1, depth=2, capture=capture) as rt:
            wd = rt.alloc_tensor(w.shape, "float32", init=w)
            for _ in range(5):  # warm-up (a captured runtime records its one key here)
                rt(x, wd)
            rt.set_tracing(True)
            t0 = time.perf_counter()
            handles = [rt.submit(x, wd) for _ in range(runs)]
            outs = [h.result() for h in handles]
            rate = runs / (time.perf_counter() - t0)
            spans, _ = rt.drain_trace()
            orch = sorted(e - s for _, _, name, s, e in spans if name == "orchestration")
            results[capture] = (rate, orch[len(orch) // 2] / 1e3, outs[-1])
            if any(not np.array_equal(o, outs[0]) for o in outs):
                print("FAILED: runs of the same arguments gave different outputs")
                return 1
            stats = rt.capture_stats()
        label = "captured  " if capture else "uncaptured"
        extra = f", replays {stats['hits']} of {stats['hits'] + stats['misses']} runs" if capture else ""
        print(f"  {label}: {rate:8.1f} runs/s, orchestration {results[capture][1]:8.1f} us per run{extra}")
    (rate_u, orch_u, out_u), (rate_c, orch_c, out_c) = results[False], results[True]
    if not np.array_equal(out_u, out_c):
        print("FAILED: the captured runs' outputs differ from the uncaptured ones")
        return 1
    worst = float(np.max(np.abs(out_c - small_tasks_reference(x, w))))
    if worst > 1e-3:
        print(f"FAILED: the program's output differs from numpy by {worst:.2e}")
        return 1
    print(f"  capture: orchestration {orch_u / orch_c:.1f}x less host time per run, {rate_c / rate_u:.2f}x the runs/s; "
          f"outputs bit-identical (max |err| vs numpy {worst:.1e})")
    return 0
