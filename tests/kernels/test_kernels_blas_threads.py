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
    import os, time, resource
    import numpy as np
    from engine import _native

    def thread_cpu():
        ticks = {}
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            ticks[int(tid)] = int(fields[11]) + int(fields[12])  # utime + stime
        return ticks

    n = 1024
    a = np.random.default_rng(0).standard_normal((n, n)).astype(np.float32)
    out = np.empty((n, n), np.float32)
    args = [(a, 0, 1), (a, 0, 1), (out, 0, 2)]
    _native.call_kernel("matmul", args, [0, 1.0, 0.0])  # warm up (OpenBLAS buffers)
    before = thread_cpu()
    r0, w0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for _ in range(4):
        _native.call_kernel("matmul", args, [0, 1.0, 0.0])
    r1, w1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    after = thread_cpu()
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    me = os.getpid()  # the main thread, which makes the calls
    others = sum(after.get(t, 0) - before.get(t, 0) for t in after if t != me) / os.sysconf("SC_CLK_TCK")
    print(cpu / (w1 - w0), others, w1 - w0)
    """
)


def test_matmul_runs_on_the_calling_thread_only():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENBLAS", "OMP_", "GOTO"))}
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert proc.returncode == 0, proc.stderr
    ratio, others, wall = map(float, proc.stdout.split())
    # One busy thread: process CPU time tracks wall time, and no other thread
    # (OpenBLAS's own pool included) accumulates any meaningful CPU time.
    assert ratio < 1.25, (ratio, wall)
    assert others < 0.1 * wall, (others, wall)


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
