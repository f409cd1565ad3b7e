"""A user's program for `tandem trace tests.benchmarks.traced_program:source` (the module:function form)."""

from __future__ import annotations

import itertools
from typing import Any, Iterable

import numpy as np

import engine
from engine import In, Out
from engine import kernels as K


@engine.program
def scale_add(run: engine.Run, x: In(("N",)), b: In(("N",)), y: Out(("N",))):
    h = run.scratch(("N",), "float32")
    run.submit(K.scale, x, out=h, alpha=2.0)
    run.submit(K.add, h, b, out=y)


def source() -> tuple[engine.Program, dict[str, Any], Any]:
    x = np.arange(1024, dtype=np.float32)

    def args(rt: engine.Runtime) -> Iterable[tuple[Any, ...]]:
        b = rt.alloc_tensor((1024,), "float32", init=np.ones(1024, np.float32))  # resident, as a user would
        return itertools.repeat((x, b))

    return scale_add, {"depth": 2, "workers": 1, "bounds": {"N": 1024}}, args
