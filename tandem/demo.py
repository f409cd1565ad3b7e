"""`tandem demo`: the MLP prepared once, run at depth 1 and 2, checked against numpy."""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

import engine
from tandem.programs import D_HIDDEN, D_IN, mlp, mlp_weights


def reference(x: np.ndarray, w1: np.ndarray, w2: np.ndarray) -> np.ndarray:
    """The MLP in float64 numpy (tanh gelu), rounded to float32."""
    h = x.astype(np.float64) @ w1
    h = 0.5 * h * (1 + np.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3)))
    return (h @ w2).astype(np.float32)


def measure(rt: engine.Runtime, batches: list[np.ndarray], w1: Any, w2: Any
            ) -> tuple[float, list[np.ndarray], float, float]:
    """Runs/s, outputs, and the mean host and device time per run (seconds)."""
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
    rates: dict[int, float] = {}
    bound = 1.0
    for depth in (1, 2):
        with mlp.prepare(depth=depth, bounds={"B": batch}) as rt:
            w1_dev = rt.alloc_tensor(w1.shape, "float32", init=w1)  # resident: not copied per run
            w2_dev = rt.alloc_tensor(w2.shape, "float32", init=w2)
            measure(rt, batches[:10], w1_dev, w2_dev)  # warm-up
            before = rt.memory_stats()
            rate, outs, t_host, t_device = measure(rt, batches, w1_dev, w2_dev)
            after = rt.memory_stats()
            worst = max(float(np.max(np.abs(o - reference(x, w1, w2)))) for x, o in zip(batches[:8], outs[:8]))
            if worst > 1e-3:
                print(f"FAILED: depth {depth} output differs from numpy by {worst:.2e}")
                return 1
            if after["total_allocations"] != before["total_allocations"]:
                print("FAILED: steady-state runs allocated device memory")
                return 1
            rates[depth] = rate
            if depth == 1:  # host and device times measured without overlap
                bound = 1.0 / max(t_host, t_device)
                print(f"  T_host {t_host * 1e3:.3f} ms, T_device {t_device * 1e3:.3f} ms per run: "
                      f"bound 1/max = {bound:.1f} runs/s")
            print(f"  depth {depth}: {rate:8.1f} runs/s = {rate / bound:.2f} of the bound  (workers={rt.workers}, "
                  f"max |err| vs numpy {worst:.1e}, h2d per run {(after['h2d_bytes'] - before['h2d_bytes']) // runs} B)")
    print(f"  pipelining: depth 2 / depth 1 = {rates[2] / rates[1]:.2f}x; overlap figure (depth 2 over the bound) "
          f"= {rates[2] / bound:.2f}")
    print("OK: outputs match numpy; no device allocations in steady state")
    return 0
