"""Built-in kernels against numpy (torch where numpy has no equivalent), same shapes, one process.

Every BLAS and thread pool is pinned to one thread (OPENBLAS/OMP/MKL_NUM_THREADS=1
before numpy and torch load, threadpoolctl when installed, torch.set_num_threads(1));
tandem's own OpenBLAS runs each call on its calling thread. "ours" is
engine._native.call_kernel on arguments validated once by the kernel's
signature (the C++ kernel plus the Python-to-C++ call); "reference" is the
equivalent numpy expression as a user writes it (or the torch function). Short
samples alternate between the two; times are medians over the samples, and the
ratio is the median over adjacent pairs of reference time / our time (above 1:
ours is faster), which keeps load from other processes out of it.

The last part measures the engine's worker pool: a large matmul row-tiled by
the program (run.split) on 2 pool workers against 1, resident inputs.

    python benchmarks/kernel_bench.py [--quick] [--json PATH] [--only NAME[,NAME...]]
"""

from __future__ import annotations

import os

# Before numpy / torch load: their BLAS and OpenMP pools read these once.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import functools  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from _common import print_table, write_json  # noqa: E402

import engine  # noqa: E402
import engine.kernels as K  # noqa: E402
from engine import _native  # noqa: E402
from engine.dtypes import bfloat16  # noqa: E402
from engine.kernels.host import HostArray, native_args  # noqa: E402

torch.set_num_threads(1)
try:  # optional (the bench extra): also pins a numpy BLAS that ignored the environment
    import threadpoolctl

    _POOL_LIMIT: Any = threadpoolctl.threadpool_limits(1)
except ImportError:
    threadpoolctl = None
    _POOL_LIMIT = None


@dataclass
class Case:
    kernel: str
    shape: str
    dtype: str
    ours: Callable[[], Any]
    ref: Callable[[], Any]
    ref_name: str
    target: float | None = None  # minimum ratio the issue asks for
    result: dict[str, Any] = field(default_factory=dict)


def prepared(kernel: K.Kernel, *inputs: Any, out: Any = None, **scalars: Any) -> Callable[[], None]:
    """Validates once (as run.submit does), then returns the bare native call."""
    wrap = lambda x: HostArray(x) if isinstance(x, np.ndarray) else x  # noqa: E731
    call = kernel.bind(tuple(wrap(x) for x in inputs), wrap(out), {k: wrap(v) for k, v in scalars.items()})
    args, values, name = native_args(call), call.scalars, kernel.name
    fn = _native.call_kernel
    return lambda: fn(name, args, values)


def bf16(x: np.ndarray) -> HostArray:
    bits = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    return HostArray(bits, bfloat16)


def per_call(fn: Callable[[], Any], number: int) -> float:
    t0 = time.perf_counter()
    for _ in range(number):
        fn()
    return (time.perf_counter() - t0) / number


def calibrate(fn: Callable[[], Any], sample_s: float) -> int:
    fn()
    t = per_call(fn, 1)
    if t < sample_s / 20:  # re-time fast calls over a few iterations
        t = per_call(fn, max(1, int(sample_s / 20 / max(t, 1e-9))))
    return max(1, int(sample_s / max(t, 1e-9)))


def measure(case: Case, reps: int, sample_s: float) -> None:
    """Alternating short samples of both sides; the ratio is the median of adjacent pairs' ratios,
    so load from other processes hits both sides of each pair alike."""
    n_ours, n_ref = calibrate(case.ours, sample_s), calibrate(case.ref, sample_s)
    ours, ref = [], []
    for i in range(reps):  # alternate which side goes first, so drift within a pair cancels too
        if i % 2:
            ref.append(per_call(case.ref, n_ref))
            ours.append(per_call(case.ours, n_ours))
        else:
            ours.append(per_call(case.ours, n_ours))
            ref.append(per_call(case.ref, n_ref))
    ratio = statistics.median(r / o for r, o in zip(ref, ours))
    case.result = {
        "kernel": case.kernel, "shape": case.shape, "dtype": case.dtype, "reference": case.ref_name,
        "ours_us": {"median": statistics.median(ours) * 1e6, "min": min(ours) * 1e6, "max": max(ours) * 1e6},
        "reference_us": {"median": statistics.median(ref) * 1e6, "min": min(ref) * 1e6, "max": max(ref) * 1e6},
        "ratio": ratio, "target": case.target, "reps": reps,
        "met": None if case.target is None else ratio >= case.target,
    }  # fmt: skip


def cases(quick: bool) -> list[Case]:
    rng = np.random.default_rng(0)

    def f32(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    out: list[Case] = []
    add = out.append

    # -- matmul: numpy's sgemm (np.matmul into a preallocated out) ---------------------------
    for n in (256, 512, 1024):
        a, b, o, o2 = f32(n, n), f32(n, n), np.empty((n, n), np.float32), np.empty((n, n), np.float32)
        sgemm = functools.partial(np.matmul, a, b, out=o2)
        add(Case("matmul", f"{n}x{n}x{n}", "float32", prepared(K.matmul, a, b, out=o), sgemm, "np.matmul(a, b, out=)",
                 0.9))
    x, w = f32(16, 128, 384), f32(384, 1536)
    add(Case("matmul", "[16,128,384]@[384,1536]", "float32", prepared(K.matmul, x, w, out=np.empty((16, 128, 1536), np.float32)),
             lambda: x @ w, "x @ w"))  # fmt: skip
    q, kt = f32(24, 128, 64), f32(24, 64, 128)
    add(Case("matmul", "[24,128,64]@[24,64,128]", "float32", prepared(K.matmul, q, kt, out=np.empty((24, 128, 128), np.float32)),
             lambda: q @ kt, "q @ kt"))  # fmt: skip
    # matmul_packed: few rows against panel-packed weights (a batch-1 forward), vs numpy's sgemm on the
    # unpacked ones; the weights warm in cache here (in a model they stream from memory).
    for m, k, n in ((11, 384, 1152), (16, 1536, 384), (64, 384, 1536)):
        xa, wb = f32(m, k), f32(k, n)
        po, no = np.empty((m, n), np.float32), np.empty((m, n), np.float32)
        add(Case("matmul_packed", f"{m}x{k}x{n}", "float32", prepared(K.matmul_packed, xa, K.pack_panels(wb), out=po),
                 functools.partial(np.matmul, xa, wb, out=no), "np.matmul(a, b, out=)"))  # fmt: skip
    a16, b16 = f32(512, 512), f32(512, 512)
    ta, tb = torch.from_numpy(a16).to(torch.bfloat16), torch.from_numpy(b16).to(torch.bfloat16)
    add(Case("matmul", "512x512x512", "bfloat16",
             prepared(K.matmul, bf16(a16), bf16(b16), out=HostArray(np.empty((512, 512), np.uint16), bfloat16)),
             lambda: ta @ tb, "torch bf16 a @ b"))  # fmt: skip

    # -- elementwise, [512, 1024] float32 (2 MiB per tensor) ------------------------------------
    shape = (512, 1024)
    xa, xb, bias = f32(*shape), f32(*shape), f32(shape[-1])
    xd = np.abs(xb) + 0.5
    o = np.empty(shape, np.float32)
    tx = torch.from_numpy(xa)
    s = f"{shape[0]}x{shape[1]}"
    c = math.sqrt(2 / math.pi)
    for name, ours, ref, label in [
        ("add", prepared(K.add, xa, xb, out=o), lambda: xa + xb, "a + b"),
        ("add", prepared(K.add, xa, bias, out=o), lambda: xa + bias, "a + bias (row vector)"),
        ("sub", prepared(K.sub, xa, xb, out=o), lambda: xa - xb, "a - b"),
        ("mul", prepared(K.mul, xa, xb, out=o), lambda: xa * xb, "a * b"),
        ("div", prepared(K.div, xa, xd, out=o), lambda: xa / xd, "a / b"),
        ("scale", prepared(K.scale, xa, out=o, alpha=0.5), lambda: xa * np.float32(0.5), "x * 0.5"),
        ("relu", prepared(K.relu, xa, out=o), lambda: np.maximum(xa, 0), "np.maximum(x, 0)"),
        ("gelu", prepared(K.gelu, xa, out=o), lambda: torch.nn.functional.gelu(tx), "torch gelu (numpy has no erf)"),
        ("gelu tanh", prepared(K.gelu, xa, out=o, approximate="tanh"),
         lambda: 0.5 * xa * (1 + np.tanh(np.float32(c) * (xa + np.float32(0.044715) * xa**3))), "numpy tanh formula"),
        ("silu", prepared(K.silu, xa, out=o), lambda: xa / (1 + np.exp(-xa)), "x / (1 + np.exp(-x))"),
        ("tanh", prepared(K.tanh, xa, out=o), lambda: np.tanh(xa), "np.tanh(x)"),
        ("exp", prepared(K.exp, xa, out=o), lambda: np.exp(xa), "np.exp(x)"),
    ]:
        add(Case(name, s, "float32", ours, ref, label, 1.0))
    ta16 = torch.from_numpy(xa).to(torch.bfloat16)
    tb16 = torch.from_numpy(xb).to(torch.bfloat16)
    add(Case("add", s, "bfloat16", prepared(K.add, bf16(xa), bf16(xb), out=HostArray(np.empty(shape, np.uint16), bfloat16)),
             lambda: ta16 + tb16, "torch bf16 a + b"))  # fmt: skip
    add(Case("gelu", s, "float16",
             prepared(K.gelu, xa.astype(np.float16), out=np.empty(shape, np.float16)),
             lambda: torch.nn.functional.gelu(torch.from_numpy(xa.astype(np.float16))), "torch fp16 gelu"))  # fmt: skip

    # -- softmax and norms --------------------------------------------------------------------------
    rows = f32(2048, 512)
    ro = np.empty_like(rows)
    add(Case("softmax", "2048x512", "float32", prepared(K.softmax, rows, out=ro),
             lambda: (lambda e: e / e.sum(-1, keepdims=True))(np.exp(rows - rows.max(-1, keepdims=True))),
             "numpy exp(x - max) / sum", 1.0))  # fmt: skip
    trows = torch.from_numpy(rows)
    add(Case("softmax", "2048x512", "float32", prepared(K.softmax, rows, out=ro), lambda: torch.softmax(trows, -1),
             "torch.softmax"))
    scores, mask = f32(16, 128, 128), np.where(rng.random((16, 1, 128)) < 0.2, -np.inf, 0).astype(np.float32)
    add(Case("softmax", "[16,128,128]+mask[16,1,128]", "float32",
             prepared(K.softmax, scores, out=np.empty_like(scores), mask=mask, scale=0.125),
             lambda: (lambda z: (lambda e: e / e.sum(-1, keepdims=True))(np.exp(z - z.max(-1, keepdims=True))))(
                 scores * np.float32(0.125) + mask),
             "numpy masked softmax", 1.0))  # fmt: skip
    h = f32(2048, 768)
    g, be = f32(768), f32(768)
    ho = np.empty_like(h)
    eps = np.float32(1e-5)
    add(Case("layernorm", "2048x768", "float32", prepared(K.layernorm, h, g, be, out=ho),
             lambda: (h - h.mean(-1, keepdims=True)) / np.sqrt(h.var(-1, keepdims=True) + eps) * g + be,
             "numpy (x - mean) / sqrt(var + eps) * g + b", 1.0))  # fmt: skip
    th, tg, tbe = torch.from_numpy(h), torch.from_numpy(g), torch.from_numpy(be)
    add(Case("layernorm", "2048x768", "float32", prepared(K.layernorm, h, g, be, out=ho),
             lambda: torch.nn.functional.layer_norm(th, (768,), tg, tbe), "torch layer_norm"))
    add(Case("rmsnorm", "2048x768", "float32", prepared(K.rmsnorm, h, g, out=ho),
             lambda: h / np.sqrt((h * h).mean(-1, keepdims=True) + np.float32(1e-6)) * g,
             "numpy x / sqrt(mean(x^2) + eps) * g", 1.0))  # fmt: skip
    add(Case("l2_normalize", "2048x768", "float32", prepared(K.l2_normalize, h, out=ho),
             lambda: h / np.maximum(np.linalg.norm(h, axis=-1, keepdims=True), np.float32(1e-12)),
             "numpy x / max(norm(x), eps)", 1.0))  # fmt: skip
    hb = bf16(h)
    add(Case("layernorm", "2048x768", "bfloat16",
             prepared(K.layernorm, hb, g, be, out=HostArray(np.empty(h.shape, np.uint16), bfloat16)),
             lambda: torch.nn.functional.layer_norm(th.to(torch.bfloat16), (768,), tg, tbe), "torch bf16 layer_norm"))

    # -- reductions, pooling, gather -------------------------------------------------------------------
    red = np.empty(2048, np.float32)
    add(Case("sum", "2048x768", "float32", prepared(K.sum, h, out=red), lambda: h.sum(-1), "x.sum(-1)"))
    add(Case("mean", "2048x768", "float32", prepared(K.mean, h, out=red), lambda: h.mean(-1), "x.mean(-1)"))
    add(Case("max", "2048x768", "float32", prepared(K.max, h, out=red), lambda: h.max(-1), "x.max(-1)"))
    add(Case("argmax", "2048x768", "float32", prepared(K.argmax, h, out=np.empty(2048, np.int64)), lambda: h.argmax(-1),
             "x.argmax(-1)"))
    tok = f32(32, 128, 384)
    am = (rng.random((32, 128)) < 0.7).astype(np.int64)
    add(Case("mean_pool", "[32,128,384] mask[32,128]", "float32", prepared(K.mean_pool, tok, am, out=np.empty((32, 384), np.float32)),
             lambda: (tok * am[..., None]).sum(1) / np.maximum(am.sum(1), 1e-9)[:, None], "numpy masked mean"))  # fmt: skip
    table = f32(30522, 384)
    ids = rng.integers(0, 30522, (32, 128)).astype(np.int64)
    add(Case("embedding", "ids[32,128] table[30522,384]", "float32",
             prepared(K.embedding, ids, table, out=np.empty((32, 128, 384), np.float32)), lambda: table[ids], "table[ids]"))

    # -- attention: torch's scaled_dot_product_attention ----------------------------------------------
    qa, ka, va = f32(2, 8, 128, 32), f32(2, 8, 128, 32), f32(2, 8, 128, 32)
    oa = np.empty_like(qa)
    tq, tk, tv = (torch.from_numpy(t) for t in (qa, ka, va))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    add(Case("attention", "B2 H8 S128 D32", "float32", prepared(K.attention, qa, ka, va, out=oa),
             lambda: sdpa(tq, tk, tv), "torch sdpa", 0.8))
    add(Case("attention", "B2 H8 S128 D32 causal", "float32", prepared(K.attention, qa, ka, va, out=oa, causal=True),
             lambda: sdpa(tq, tk, tv, is_causal=True), "torch sdpa is_causal"))
    qd, kc, vc = f32(1, 12, 1, 64), f32(1, 12, 2048, 64), f32(1, 12, 2048, 64)
    tqd, tkc, tvc = torch.from_numpy(qd), torch.from_numpy(kc[:, :, :1024]), torch.from_numpy(vc[:, :, :1024])
    add(Case("attention", "decode Sq1 kv_len1024/2048 H12 D64", "float32",
             prepared(K.attention, qd, kc, vc, out=np.empty_like(qd), kv_len=1024),
             lambda: sdpa(tqd, tkc, tvc), "torch sdpa on k[:1024]"))  # fmt: skip

    # -- data movement -------------------------------------------------------------------------------------
    sq = f32(1024, 1024)
    add(Case("transpose", "1024x1024", "float32", prepared(K.transpose, sq, out=np.empty_like(sq)),
             lambda: np.ascontiguousarray(sq.T), "np.ascontiguousarray(x.T)"))
    add(Case("copy", "1024x1024", "float32", prepared(K.copy, sq, out=np.empty_like(sq)), lambda: sq.copy(), "x.copy()"))
    add(Case("cast", "1024x1024 f32->f16", "float16", prepared(K.cast, sq, out=np.empty(sq.shape, np.float16)),
             lambda: sq.astype(np.float16), "x.astype(float16)"))
    tsq = torch.from_numpy(sq)
    add(Case("cast", "1024x1024 f32->bf16", "bfloat16",
             prepared(K.cast, sq, out=HostArray(np.empty(sq.shape, np.uint16), bfloat16)),
             lambda: tsq.to(torch.bfloat16), "torch .to(bfloat16)"))  # fmt: skip
    return out


@engine.program
def _tiled_matmul(run: engine.Run, a: engine.In(("M", 1024)), b: engine.In((1024, 1024)),
                  out: engine.Out(("M", 1024))):
    # One row tile per pool worker: the tiles touch disjoint bytes of `out`, so they run concurrently.
    for at, ot in zip(run.split(a), run.split(out)):
        run.submit(K.matmul, at, b, out=ot)


def scaling(quick: bool) -> dict[str, Any]:
    """A row-tiled [rows, 1024] @ [1024, 1024] matmul through the engine: 2 pool workers vs 1."""
    rows = 1024 if quick else 2048
    rng = np.random.default_rng(1)
    a = rng.standard_normal((rows, 1024)).astype(np.float32)
    b = rng.standard_normal((1024, 1024)).astype(np.float32)
    out = np.empty((rows, 1024), np.float32)
    rts = {w: _tiled_matmul.prepare(workers=w, depth=1, bounds={"M": rows}) for w in (1, 2)}
    try:
        devs = {w: (rt.alloc_tensor(a.shape, "float32", init=a), rt.alloc_tensor(b.shape, "float32", init=b))
                for w, rt in rts.items()}  # resident inputs: the figure is the matmul, not the copies
        runs = {w: functools.partial(rt, devs[w][0], devs[w][1], out) for w, rt in rts.items()}
        for fn in runs.values():
            fn()
        reps = 5 if quick else 15
        one: list[float] = []
        two: list[float] = []
        for i in range(reps):  # alternate, so load from other processes hits both sides
            order = ((runs[1], one), (runs[2], two)) if i % 2 == 0 else ((runs[2], two), (runs[1], one))
            for fn, acc in order:
                t0 = time.perf_counter()
                fn()
                acc.append(time.perf_counter() - t0)
    finally:
        for rt in rts.values():
            rt.close()
    m1, m2 = statistics.median(one), statistics.median(two)
    flops = 2.0 * rows * 1024 * 1024
    return {
        "shape": f"[{rows},1024]@[1024,1024]",
        "one_thread_ms": m1 * 1e3,
        "two_threads_ms": m2 * 1e3,
        "speedup": m1 / m2,
        # Fastest repetition of each: the closest this run came to an idle host.
        "speedup_best": min(one) / min(two),
        "target": 1.7,
        "gflops_one": flops / m1 / 1e9,
        "gflops_two": flops / m2 / 1e9,
        "load_average": os.getloadavg()[0],
        "note": "the engine's worker pool: a program row-tiled with run.split, prepare(workers=2) vs workers=1",
    }


def pinning() -> dict[str, Any]:
    info: dict[str, Any] = {v: os.environ.get(v) for v in
                            ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_CORETYPE",
                             "OPENBLAS_L2_SIZE")}  # fmt: skip
    info["torch_threads"] = torch.get_num_threads()
    if threadpoolctl is not None:
        info["threadpools"] = [
            {k: p.get(k) for k in ("internal_api", "num_threads", "version", "filepath")}
            for p in threadpoolctl.threadpool_info()
        ]
    return info


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer and shorter samples")
    ap.add_argument("--json", default=None, help="where to write the JSON (default benchmarks/results/kernels.json)")
    ap.add_argument("--only", default=None, help="comma-separated kernel names to run")
    args = ap.parse_args(argv)
    reps, sample_s = (5, 0.004) if args.quick else (31, 0.008)

    selected = cases(args.quick)
    if args.only:
        names = set(args.only.split(","))
        selected = [c for c in selected if c.kernel in names]
    for case in selected:
        measure(case, reps, sample_s)

    rows = []
    for c in selected:
        r = c.result
        ok = "" if r["met"] is None else ("yes" if r["met"] else "NO")
        rows.append([c.kernel, c.shape, c.dtype, r["ours_us"]["median"], r["reference_us"]["median"], c.ref_name,
                     f"{r['ratio']:.2f}x", "" if c.target is None else f">= {c.target}x", ok])  # fmt: skip
    print("Kernels, one thread each; ratio = reference time / our time (higher is better)")
    print_table(["kernel", "shape", "dtype", "ours us", "ref us", "reference", "ratio", "target", "met"], rows)

    scale = scaling(args.quick) if not args.only or "matmul" in args.only.split(",") else None
    if scale is not None:
        print()
        print(f"Scaling ({scale['note']}):")
        print(f"  {scale['shape']}: 1 worker {scale['one_thread_ms']:.1f} ms ({scale['gflops_one']:.0f} GFLOP/s), "
              f"2 workers {scale['two_threads_ms']:.1f} ms ({scale['gflops_two']:.0f} GFLOP/s): "
              f"speed-up {scale['speedup']:.2f}x median, {scale['speedup_best']:.2f}x best of each "
              f"(target >= 1.7x on an idle host; load average {scale['load_average']:.2f})")  # fmt: skip

    pins = pinning()
    print()
    print("Thread pinning:", ", ".join(f"{k}={v}" for k, v in pins.items() if k != "threadpools"))
    figures = {"kernels": [c.result for c in selected], "scaling": scale, "pinning": pins, "quick": args.quick}
    path = write_json("kernels", figures, args.json)
    print(f"wrote {path}")
    return figures


if __name__ == "__main__":
    main()
