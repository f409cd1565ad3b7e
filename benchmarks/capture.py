"""Captured runs against uncaptured ones: the same programs prepared with and without capture=True.

Four workloads, each run captured and uncaptured in the same process, the
repetitions interleaved (alternating which goes first) so that both see the
same machine; each repetition prepares its runtime anew and runs it for 0.2 s
before measuring:

- tasks: a 200-task program of small kernels (a chain of elementwise and
  64x64 matmul steps over scratch, one pool worker);
- minilm: all-MiniLM-L6-v2 at batch 1 and 8 (needs the `models` extra), the
  ids already tokenized, weights resident;
- decoder: the streaming decoder's step (4 layers x 256), one token at a time;
- distributed: engine.distributed, a two-stage pipeline over 8 micro-batches
  on 2 chip workers (16 sub-program calls a run, tandem.programs'
  microbatch_pipeline), with a Scalar that changes on every run passed
  straight into the second stage: captured, each run replays with its value.

Figures per workload and mode:
- runs/s: pipelined runs at depth 2 (tokens/s for the decoder);
- orchestration: the host's launch of a run (staging plus the orchestration
  function, or the replay of its recording), median from the engine's trace;
- host per run: everything but kernel execution, for a run alone: its wall
  time from the call to the result, less the span its tasks ran (median);
- the captured over uncaptured ratios (above 1 is better for runs/s, below 1
  for the host costs).

    python benchmarks/capture.py [--quick] [--reps R] [--only tasks,minilm,decoder,distributed] [--json PATH]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
from _common import print_table, write_json  # noqa: E402

import engine  # noqa: E402
from tandem.programs import SMALL, microbatch_pipeline, small_tasks, warm_up  # noqa: E402  (`tandem demo` shows small_tasks)

MODES = (False, True)  # uncaptured, captured


class Workload:
    """One program, prepared in one mode, with the arguments of its runs."""

    name: str
    distinct = 1  # how many capture keys its runs cycle through (the warm-up records each once)

    def open(self, capture: bool) -> None: ...

    def close(self) -> None: ...

    def runtime(self) -> engine.Runtime: ...

    def args(self, i: int) -> tuple[tuple[Any, ...], dict[str, Any]]: ...


class TasksWorkload(Workload):
    def __init__(self) -> None:
        rng = np.random.default_rng(0)
        self.name = "tasks"
        self.x = rng.standard_normal((SMALL, SMALL)).astype(np.float32)
        self.w = (rng.standard_normal((SMALL, SMALL)) / 8).astype(np.float32)
        self.rt: engine.Runtime | None = None

    def open(self, capture: bool) -> None:
        self.rt = small_tasks.prepare(workers=1, depth=2, capture=capture)
        self.wd = self.rt.alloc_tensor((SMALL, SMALL), init=self.w)

    def close(self) -> None:
        assert self.rt is not None
        self.rt.close()

    def runtime(self) -> engine.Runtime:
        assert self.rt is not None
        return self.rt

    def args(self, i: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (self.x, self.wd), {}


class MiniLMWorkload(Workload):
    def __init__(self, batch: int) -> None:
        self.name = f"minilm b{batch}"
        self.batch = batch
        self.enc: Any = None

    def open(self, capture: bool) -> None:
        from examples.minilm.model import MiniLMEncoder

        self.enc = MiniLMEncoder(capture=capture, max_batch=max(8, self.batch))
        texts = [f"Question {i}: how far is the station from the old harbour?" for i in range(self.batch)]
        self.ids, self.mask = self.enc.pad(self.enc.tokenize(texts))

    def close(self) -> None:
        self.enc.close()

    def runtime(self) -> engine.Runtime:
        return self.enc.runtime

    def args(self, i: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (self.ids, self.mask, self.enc.params), {}


class DecoderWorkload(Workload):
    """One decode step per run, positions cycling over the first `span` positions of the cache."""

    def __init__(self, span: int = 48) -> None:
        self.name = "decoder"
        self.span = span
        self.distinct = span
        self.dec: Any = None

    def open(self, capture: bool) -> None:
        from examples.decoder import Decoder

        self.dec = Decoder(capture=capture, depth=2, workers=1)
        self.dec.generate([1, 2, 3, 4], 4)  # a sequence on the device to step over

    def close(self) -> None:
        self.dec.close()

    def runtime(self) -> engine.Runtime:
        return self.dec.runtime

    def args(self, i: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
        pos = 4 + i % self.span
        return self.dec._args((self.dec._next_ids[pos], pos))


class DistributedWorkload(Workload):
    """microbatch_pipeline on 2 chip workers, its weights resident on their stage's worker, a new alpha every run."""

    def __init__(self) -> None:
        rng = np.random.default_rng(0)
        self.name = "distributed"
        self.x = rng.standard_normal((SMALL, SMALL)).astype(np.float32)
        self.w = [(rng.standard_normal((SMALL, SMALL)) / 8).astype(np.float32) for _ in range(2)]
        self.rt: Any = None
        self.runs = 0  # alpha never repeats, not even across the measurements (each counts its runs from 0)

    def open(self, capture: bool) -> None:
        self.rt = microbatch_pipeline.prepare(workers=2, worker_threads=1, depth=2, bounds={"B": SMALL},
                                              capture=capture)
        self.wd = [self.rt.alloc_tensor((SMALL, SMALL), init=w, worker_id=i) for i, w in enumerate(self.w)]

    def close(self) -> None:
        self.rt.close()

    def runtime(self) -> Any:
        return self.rt

    def args(self, i: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
        self.runs += 1
        return (self.x, *self.wd), {"alpha": 1.0 + 1e-6 * self.runs}


def throughput(w: Workload, runs: int) -> float:
    rt = w.runtime()
    t0 = time.perf_counter()
    handles = []
    for i in range(runs):
        args, kwargs = w.args(i)
        handles.append(rt.submit(*args, **kwargs))
    for h in handles:
        h.result()
    return runs / (time.perf_counter() - t0)


def orchestration_us(w: Workload, runs: int) -> float:
    """Median staging + orchestration (or replay) per run, from the trace of pipelined runs."""
    rt = w.runtime()
    rt.set_tracing(True)
    rt.drain_trace()
    throughput(w, runs)
    spans, _ = rt.drain_trace()
    rt.set_tracing(False)
    per_run: dict[int, int] = {}
    for run_id, _, name, start, end in spans:
        if name in ("staging", "orchestration"):
            per_run[run_id] = per_run.get(run_id, 0) + end - start
    return statistics.median(per_run.values()) / 1e3


def host_per_run_us(w: Workload, runs: int) -> float:
    """Median of (wall time of a run alone) - (the span its tasks ran): everything but kernel execution."""
    rt = w.runtime()
    values = []
    for i in range(runs):
        args, kwargs = w.args(i)
        t0 = time.perf_counter_ns()
        h = rt.submit(*args, **kwargs)
        h.result()
        wall = time.perf_counter_ns() - t0
        t = h.times()
        device = t["last_end_ns"] - t["first_start_ns"] if t["first_start_ns"] >= 0 else 0
        values.append(wall - device)
    return statistics.median(values) / 1e3


def measure(w: Workload, capture: bool, runs: int) -> dict[str, Any]:
    w.open(capture)
    try:
        # A captured runtime records every key its runs use in the first of these.
        warm_up(lambda: throughput(w, max(4, w.distinct)))
        out = {"runs_per_s": throughput(w, runs), "orchestration_us": orchestration_us(w, runs),
               "host_per_run_us": host_per_run_us(w, max(10, runs // 4))}
        out["capture_stats"] = w.runtime().capture_stats()
    finally:
        w.close()
    return out


def compare(w: Workload, reps: int, runs: int) -> dict[str, Any]:
    samples: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    for r in range(reps):
        for capture in (MODES if r % 2 == 0 else MODES[::-1]):
            samples[capture].append(measure(w, capture, runs))
            print(f"  {w.name} rep {r + 1}/{reps} capture={capture}", file=sys.stderr, flush=True)
    out: dict[str, Any] = {"workload": w.name, "reps": reps, "runs": runs}
    for capture, ss in samples.items():
        mode = "captured" if capture else "uncaptured"
        out[mode] = {k: statistics.median(s[k] for s in ss) for k in ("runs_per_s", "orchestration_us",
                                                                        "host_per_run_us")}
        out[mode]["capture_stats"] = ss[-1]["capture_stats"]
    c, u = out["captured"], out["uncaptured"]
    out["runs_per_s_ratio"] = c["runs_per_s"] / u["runs_per_s"]
    out["orchestration_ratio"] = c["orchestration_us"] / u["orchestration_us"]
    out["host_per_run_ratio"] = c["host_per_run_us"] / u["host_per_run_us"]
    return out


WORKLOADS: dict[str, Callable[[], list[Workload]]] = {
    "tasks": lambda: [TasksWorkload()],
    "minilm": lambda: [MiniLMWorkload(1), MiniLMWorkload(8)],
    "decoder": lambda: [DecoderWorkload()],
    "distributed": lambda: [DistributedWorkload()],
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer runs and repetitions")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--only", default=",".join(WORKLOADS), help="comma-separated: " + ", ".join(WORKLOADS))
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    reps = args.reps or (2 if args.quick else 4)
    runs = 40 if args.quick else 200
    rows, results = [], []
    for name in args.only.split(","):
        if name not in WORKLOADS:
            ap.error(f"unknown workload {name!r}")
        if name == "minilm":
            try:
                import examples.minilm.model  # noqa: F401
                from examples.minilm.weights import default_model_dir

                default_model_dir()
            except Exception as e:  # the models extra is not installed
                print(f"minilm skipped: {type(e).__name__}: {e}")
                continue
        for w in WORKLOADS[name]():
            r = compare(w, reps, runs)
            results.append(r)
            u, c = r["uncaptured"], r["captured"]
            rows.append([w.name, f"{u['runs_per_s']:.0f}", f"{c['runs_per_s']:.0f}", f"{r['runs_per_s_ratio']:.2f}",
                         f"{u['orchestration_us']:.0f}", f"{c['orchestration_us']:.0f}",
                         f"{r['orchestration_ratio']:.3f}", f"{u['host_per_run_us']:.0f}",
                         f"{c['host_per_run_us']:.0f}", f"{r['host_per_run_ratio']:.2f}"])
    print(f"captured against uncaptured, {reps} interleaved reps of {runs} runs each (medians)")
    print_table(["workload", "runs/s", "runs/s capt.", "ratio", "orch. us", "orch. us capt.", "ratio",
                 "host/run us", "host/run us capt.", "ratio"], rows)
    path = write_json("capture", {"reps": reps, "runs": runs, "workloads": results}, args.json)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
