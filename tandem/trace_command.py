"""`tandem trace PROGRAM`: a short pipelined run, its Chrome trace JSON, and a PNG timeline of it.

PROGRAM is a built-in name (see BUILTINS) or `module:function`, where the
function takes no arguments and returns `(program, prepare_kwargs, args)`:
an `engine.Program`, the keyword arguments of its `prepare()`, and the runs'
arguments, either an iterable of argument tuples or a callable that takes the
prepared Runtime and returns one (to allocate resident tensors first). The
first `--warmup` items run untraced; the next `--runs` are traced.
"""

from __future__ import annotations

import importlib
import itertools
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

import engine
from tandem.programs import D_IN, mlp, mlp_weights, spin
from tandem.timeline import overlap_summary, render_timeline

Source = tuple[engine.Program, dict[str, Any], Any]


def overlap_source() -> Source:
    """1 ms of Python orchestration, then a 1 ms `spin` task: depth 2 overlaps one run's host with another's device."""
    x = np.zeros(16, np.float32)
    return spin, {"depth": 2, "workers": 1}, itertools.repeat((x, 1e-3, 1_000_000))


def mlp_source() -> Source:
    """The demo MLP (384 -> 1536 -> 384, batch 32, one row tile per worker) with resident weights."""
    rng = np.random.default_rng(0)
    w1, w2 = mlp_weights(rng)
    batches = [rng.standard_normal((32, D_IN)).astype(np.float32) for _ in range(8)]

    def args(rt: engine.Runtime) -> Iterable[tuple[Any, ...]]:
        w1_dev = rt.alloc_tensor(w1.shape, "float32", init=w1)
        w2_dev = rt.alloc_tensor(w2.shape, "float32", init=w2)
        return ((batches[i % len(batches)], w1_dev, w2_dev) for i in itertools.count())

    return mlp, {"depth": 2, "bounds": {"B": 32}}, args


BUILTINS: dict[str, Callable[[], Source]] = {"overlap": overlap_source, "mlp": mlp_source}


class UsageError(ValueError):
    """PROGRAM names nothing usable (errors raised by the user's own code pass through untouched)."""


def load_source(spec: str) -> tuple[str, Source]:
    """(a short name for output files, the source) for a built-in name or `module:function`."""
    if spec in BUILTINS:
        return spec, BUILTINS[spec]()
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise UsageError(f"PROGRAM must be one of {', '.join(BUILTINS)} or module:function, not {spec!r}")
    try:
        fn: Any = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module.split(".")[0] and e.name != module:
            raise  # the module exists but imports something missing: show the real traceback
        raise UsageError(f"no module named {module!r}") from e
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise UsageError(f"{module} has no attribute {attr!r}")
        fn = getattr(fn, part)
    got = fn()
    if not (isinstance(got, tuple) and len(got) == 3 and isinstance(got[0], engine.Program)):
        raise UsageError(f"{spec} must return (engine.Program, prepare kwargs, args), got {type(got).__name__}")
    return attr.split(".")[-1], got


def record(source: Source, path: Path, *, runs: int, warmup: int, depth: int | None,
           workers: int | None) -> dict[str, Any]:
    """Prepares the program, runs `warmup` untraced then `runs` traced pipelined runs, writes the trace."""
    program, kwargs, args = source
    kwargs = dict(kwargs)
    if depth is not None:
        kwargs["depth"] = depth
    if workers is not None:
        kwargs["workers"] = workers
    with program.prepare(**kwargs) as rt:
        items = iter(args(rt) if callable(args) else args)

        def batch(n: int) -> int:
            handles = [rt.submit(*(a if isinstance(a, tuple) else (a,))) for a in itertools.islice(items, n)]
            for h in handles:
                h.result()
            return len(handles)

        batch(warmup)
        rt.set_tracing(True)
        t0 = time.perf_counter()
        traced = batch(runs)
        wall = time.perf_counter() - t0
        rt.export_trace(path)
        rt.set_tracing(False)
        return {"runs": traced, "wall_s": wall, "depth": rt.depth, "workers": rt.workers}


def main(spec: str, *, out: str | None, png: str | None, runs: int, warmup: int, depth: int | None,
         workers: int | None, plot: bool = True) -> int:
    name, source = load_source(spec)
    path = Path(out or f"trace_{name}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    info = record(source, path, runs=runs, warmup=warmup, depth=depth, workers=workers)
    if info["runs"] == 0:
        raise UsageError(f"{spec}: its arguments ran out after the {warmup} warm-up run(s): nothing was traced")
    s = overlap_summary(path)
    print(f"traced {info['runs']} runs of {name} at depth {info['depth']} on {info['workers']} pool worker(s) in "
          f"{info['wall_s'] * 1e3:.1f} ms: host busy {s['host_busy_ms']:.2f} ms, device busy "
          f"{s['device_busy_ms']:.2f} ms, both at once {s['overlap_ms']:.2f} ms "
          f"({100 * s['overlap_of_device']:.0f}% of the device's time)")
    print(f"wrote {path} (open it in Perfetto or chrome://tracing)")
    if not plot:
        return 0
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("matplotlib is not installed (pip install 'tandem-engine[bench]'): no PNG timeline")
        return 0
    image = render_timeline(path, png or path.with_suffix(".png"),
                            title=f"tandem trace {spec}: depth {info['depth']}, {info['workers']} worker(s)")
    print(f"wrote {image}")
    return 0
