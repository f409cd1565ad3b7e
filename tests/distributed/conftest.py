"""Fixtures for the distributed tests: runtimes prepared once per module, and cleanup checks.

Starting chip workers costs about a second (each spawned process imports the
engine), so a module prepares each runtime once (module scope) and closes it
at the end, checking that the workers were reaped and the shared memory
removed.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

import engine.distributed as dist

WORKERS = 2
THREADS = 1  # executors per worker (its serving thread alone): 2 workers on 2 cores


def shm_present(names: list[str]) -> list[str]:
    """Which of these shared-memory names still exist."""
    try:
        listing = set(os.listdir("/dev/shm"))
    except FileNotFoundError:  # not Linux
        return []
    return [n for n in names if n in listing]


def assert_reaped(pids: list[int]) -> None:
    """Every pid is gone and reaped: not our child any more (no zombie), not running."""
    for pid in pids:
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def assert_cleaned_up(drt: dist.DistributedRuntime) -> None:
    names = drt.shared_memory_names
    assert names, "the runtime reports its shared-memory names"
    assert drt.closed
    assert shm_present(names) == []
    assert_reaped(drt.pids)


@pytest.fixture(scope="module")
def prepare():
    """prepare(program, **kwargs) -> DistributedRuntime (2 workers, 1 thread each), closed at module end."""
    made: list[dist.DistributedRuntime] = []

    def make(prog: dist.DistributedProgram, **kwargs) -> dist.DistributedRuntime:
        kwargs.setdefault("workers", WORKERS)
        kwargs.setdefault("worker_threads", THREADS)
        drt = prog.prepare(**kwargs)
        made.append(drt)
        return drt

    yield make
    for drt in made:
        drt.close()
        assert_cleaned_up(drt)


def gelu(h: np.ndarray) -> np.ndarray:
    erf = np.vectorize(math.erf)
    return (0.5 * h * (1.0 + erf(h / math.sqrt(2.0)))).astype(np.float32)


def mlp_reference(x: np.ndarray, w1: np.ndarray, w2: np.ndarray) -> np.ndarray:
    return gelu(x.astype(np.float64) @ w1) @ w2


def randn(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)
