"""The program the stress test and the soak benchmark drive, and how to check one outcome.

Each run looks rows up in a table (the native `embedding` kernel), adds the
input, optionally spins on the device, and adds one in a Python host kernel.
`mode` injects a failure: 1 passes an id outside the table (the native kernel
fails), 2 makes the host kernel raise. Values are small integers, so a correct
output is exact.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np

import engine
from engine import In, Out, Scalar
from engine import kernels as K

ROWS, WIDTH, BOUND = 16, 8, 8
OK, NATIVE_FAIL, HOST_FAIL = 0, 1, 2


@engine.host_kernel(name="plus_one_or_raise")
def plus_one_or_raise(h: np.ndarray, out: np.ndarray, fail: int) -> None:
    if fail:
        raise RuntimeError("injected host-kernel failure")
    np.add(h, 1.0, out=out)


@engine.program
def lookup(run: engine.Run, x: In(("B", WIDTH)), ids: In(("B",), "int32"), table: In((ROWS, WIDTH)),
           y: Out(("B", WIDTH)), mode: Scalar(int), ns: Scalar(int)):
    h = run.scratch(("B", WIDTH))
    run.submit(K.embedding, ids, table, out=h)
    if ns > 0:
        run.submit(K.spin, ns=ns)
    run.submit(K.add, h, x, out=h)
    run.submit(plus_one_or_raise, h, out=y, fail=int(mode == HOST_FAIL))


def make_table(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(-4, 5, (ROWS, WIDTH)).astype(np.float32)


@dataclass
class Job:
    """One dispatch's arguments and what it must give."""

    x: np.ndarray
    ids: np.ndarray
    mode: int
    ns: int

    def args(self, table: Any) -> tuple:
        return (self.x, self.ids, table, None, self.mode, self.ns)

    def expected(self, table: np.ndarray) -> np.ndarray:
        return table[self.ids] + self.x + 1.0


def make_job(r: random.Random, fail_rate: float = 0.1, spin_rate: float = 0.2) -> Job:
    b = r.randint(1, BOUND)
    x = np.array([[r.randint(-3, 3) for _ in range(WIDTH)] for _ in range(b)], np.float32)
    ids = np.array([r.randrange(ROWS) for _ in range(b)], np.int32)
    mode = OK
    if r.random() < fail_rate:
        mode = r.choice([NATIVE_FAIL, HOST_FAIL])
        if mode == NATIVE_FAIL:
            ids[r.randrange(b)] = r.choice([-1, ROWS, ROWS + 7, -(2**31)])
    ns = r.choice([20_000, 100_000]) if r.random() < spin_rate else 0
    return Job(x, ids, mode, ns)


class Tally:
    """Outcomes seen; check() classifies one and fails loudly on anything wrong."""

    def __init__(self) -> None:
        self.ok = self.failed = self.cancelled = 0

    @property
    def total(self) -> int:
        return self.ok + self.failed + self.cancelled

    def result(self, job: Job, table: np.ndarray, y: Any) -> None:
        assert job.mode == OK, f"a run with an injected failure (mode {job.mode}) succeeded"
        np.testing.assert_array_equal(np.asarray(y), job.expected(table))
        self.ok += 1

    def error(self, job: Job, e: BaseException) -> None:
        if isinstance(e, engine.RunCancelledError):
            self.cancelled += 1
            return
        if not isinstance(e, engine.KernelError):
            raise AssertionError(f"unexpected error {type(e).__name__}: {e}") from e
        assert job.mode != OK, f"a correct run failed: {e}"
        want = "embedding" if job.mode == NATIVE_FAIL else "plus_one_or_raise"
        assert want in e.kernel, f"mode {job.mode} failed in {e.kernel!r}, not {want!r}"
        self.failed += 1
