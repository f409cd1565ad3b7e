"""Helpers for driving the native engine directly: device buffers as float32
vectors, tensor arguments over byte ranges of them, and a sequential numpy
reference executor for random task graphs."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engine import _native

READ, WRITE, READWRITE = 1, 2, 3
F32 = 0


def user_kernel_library() -> str:
    path = Path(_native.__file__).parent / "testing" / "libtandem_testkernels.so"
    assert path.exists(), f"test kernel library not built: {path}"
    return str(path)


def arg(buf: "_native.Buffer", start: int = 0, length: int | None = None) -> "_native.TensorArg":
    """A float32 vector view of elements [start, start + length) of buf."""
    n = buf.size // 4 if length is None else length
    return _native.TensorArg(buf.addr + 4 * start, F32, [n], [1], buf.id, 4 * start, 4 * (start + n))


def read_vec(device: "_native.Device", buf: "_native.Buffer") -> np.ndarray:
    out = np.empty(buf.size // 4, np.float32)
    device.copy_d2h(out, buf, 0)
    return out


def write_vec(device: "_native.Device", buf: "_native.Buffer", values: np.ndarray) -> None:
    device.copy_h2d(buf, 0, np.ascontiguousarray(values, dtype=np.float32))


@dataclass
class Op:
    kind: str  # "fill", "copy", "add_one"
    dst: int  # buffer index
    dst_start: int
    length: int
    src: int = -1
    src_start: int = 0
    value: float = 0.0


@dataclass
class RandomGraph:
    """Random ops over `nbufs` vectors of `size` floats; regions overlap often."""

    nbufs: int
    size: int
    ops: list[Op] = field(default_factory=list)

    @classmethod
    def make(cls, rng: random.Random, nbufs: int = 4, size: int = 64, nops: int = 30) -> "RandomGraph":
        g = cls(nbufs, size)
        for _ in range(nops):
            length = rng.randint(1, size // 2)
            dst = rng.randrange(nbufs)
            dst_start = rng.randint(0, size - length)
            kind = rng.choice(["fill", "copy", "add_one", "add_one"])
            if kind == "fill":
                g.ops.append(Op(kind, dst, dst_start, length, value=float(rng.randint(-9, 9))))
            else:
                src = rng.randrange(nbufs)
                src_start = rng.randint(0, size - length)
                if src == dst and abs(src_start - dst_start) < length:
                    src = (dst + 1) % nbufs  # kernels here do not support overlapping in/out
                g.ops.append(Op(kind, dst, dst_start, length, src=src, src_start=src_start))
        return g

    def reference(self, state: list[np.ndarray]) -> None:
        """Applies the ops in order, in numpy (the sequential semantics)."""
        for op in self.ops:
            d = state[op.dst][op.dst_start : op.dst_start + op.length]
            if op.kind == "fill":
                d[:] = op.value
            else:
                s = state[op.src][op.src_start : op.src_start + op.length].copy()
                d[:] = s + 1.0 if op.kind == "add_one" else s

    def submit(self, eng: "_native.Engine", run: "_native.Run", bufs: list, kernels: dict) -> None:
        for op in self.ops:
            dst = arg(bufs[op.dst], op.dst_start, op.length)
            if op.kind == "fill":
                eng.submit(run, kernels["fill"], [dst], [WRITE], [op.value])
            else:
                src = arg(bufs[op.src], op.src_start, op.length)
                eng.submit(run, kernels[op.kind], [src, dst], [READ, WRITE], [])
