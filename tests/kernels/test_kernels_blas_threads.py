"""OpenBLAS runs each matmul on its calling thread (the worker pool supplies
parallelism), and concurrent calls from several threads stay correct."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import numpy as np

import engine.kernels as K
from engine.dtypes import float32
from tests.kernels.harness import HostTensor, empty, run, tensor

PROBE = textwrap.dedent(
    """
    import time
    import numpy as np
    from engine import _native

    n = 1024
    a = np.random.default_rng(0).standard_normal((n, n)).astype(np.float32)
    out = np.empty((n, n), np.float32)
    args = [(a, 0, 1), (a, 0, 1), (out, 0, 2)]
    _native.call_kernel("matmul", args, [0, 1.0, 0.0])  # warm up (OpenBLAS buffers)
    # Freshly loaded OpenBLAS pools (ours and numpy's) spin for a while before
    # they park; that start-up spin is not work of ours, so let it pass.
    time.sleep(1.0)
    # Scheduler-accounted CPU clocks (not tick sampling): the whole process vs this thread.
    p0, t0 = time.process_time(), time.thread_time()
    for _ in range(8):
        _native.call_kernel("matmul", args, [0, 1.0, 0.0])
    p1, t1 = time.process_time(), time.thread_time()
    print(t1 - t0, (p1 - p0) - (t1 - t0))
    """
)


def test_matmul_runs_on_the_calling_thread_only():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENBLAS", "OMP_", "GOTO"))}
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert proc.returncode == 0, proc.stderr
    caller, others = map(float, proc.stdout.split())
    # All the work is on the calling thread; no other thread (OpenBLAS's own
    # pool included) does any. With OpenBLAS threading enabled, `others`
    # would be close to `caller`.
    assert caller > 0.05, caller
    assert others < 0.05 * caller, (caller, others)


def test_concurrent_calls_from_threads_are_correct(rng):
    a = tensor(rng.standard_normal((256, 300)), float32)
    b = tensor(rng.standard_normal((300, 200)), float32)
    out = empty((256, 200), float32)
    halves = [HostTensor(a.array[:128]), HostTensor(a.array[128:])]
    outs = [HostTensor(out.array[:128]), HostTensor(out.array[128:])]
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for _ in range(20):
                run(K.matmul, halves[i], b, out=outs[i])
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    np.testing.assert_allclose(out.array, a.array.astype(np.float64) @ b.array, rtol=1e-5, atol=1e-4)
