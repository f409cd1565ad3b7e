"""Soak: 100,000 runs through an AsyncRuntime; does the process grow?

Sixteen concurrent tasks dispatch runs of a small program (a native table
lookup, an add, optional device spin, a Python host kernel) with random
cancellations (future.cancel(), timeouts around call() and dispatch(), cancel
scopes) and randomly failing kernels (a native kernel given an id outside its
table, a host kernel that raises). Every surviving result is checked.

Reported: the process RSS after run 10,000 (the warm-up: caches, the metrics
window of the last 10,000 runs and the allocator's pools are full by then) and
after the last run, their ratio, and the device counters against their
baseline; RSS is also read after every further 10,000 runs, for the table. Before each reading the garbage collector runs and glibc returns
free heap pages (malloc_trim), so the figure is memory in use, not allocator
slack. A leak of even a few hundred bytes per run shows as several percent.

    python benchmarks/soak.py                 # 100,000 runs, RSS at 10,000 and 100,000
    python benchmarks/soak.py --quick         # 25,000 runs, RSS at 10,000 and 25,000 (CI)
    python benchmarks/soak.py --runs N --checkpoint M --backend trio --json PATH

Exits 1 when RSS grew by 5% or more between the two readings, a counter is
off its baseline, or a result was wrong.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import anyio  # noqa: E402

from _common import print_table, write_json  # noqa: E402

import engine  # noqa: E402
from scheduler import AsyncRuntime  # noqa: E402
# The program, jobs and outcome checks the stress test drives too.
from tests.reliability.stress_program import BOUND, Job, Tally, lookup, make_job, make_table  # noqa: E402

TASKS = 16
GROWTH_LIMIT = 1.05


def rss_bytes() -> int:
    """Resident set size now, after a collection and returning free heap pages to the system."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def peak_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


class Soak:
    def __init__(self, runs: int, checkpoint: int, seed: int) -> None:
        self.runs, self.checkpoint = runs, checkpoint
        self.rng = random.Random(seed)
        self.table = make_table(seed)
        self.started = 0
        self.tally = Tally()
        self.wrong: list[str] = []
        self.readings: list[tuple[int, int]] = []  # (runs started, rss bytes)
        self.paused: anyio.Event | None = None

    def outcome(self, job: Job, y: Any = None, error: BaseException | None = None) -> None:
        """Classifies one outcome; anything wrong is recorded (the soak reports it and exits 1)."""
        try:
            if error is None:
                self.tally.result(job, self.table, y)
            else:
                self.tally.error(job, error)
        except AssertionError as e:
            self.wrong.append(str(e))

    async def one(self, art: AsyncRuntime, r: random.Random) -> None:
        job = make_job(r, fail_rate=0.1, spin_rate=0.1)
        args = job.args(self.table_arg if r.random() < 0.5 else self.table)
        how = r.choice(["call", "call", "dispatch", "dispatch", "cancel", "timeout-call", "timeout-dispatch"])
        try:
            if how == "call":
                self.outcome(job, await art.call(*args))
            elif how == "dispatch":
                self.outcome(job, await (await art.dispatch(*args)))
            elif how == "cancel":
                fut = await art.dispatch(*args)
                await anyio.sleep(0)
                if fut.cancel():
                    self.tally.cancelled += 1
                else:
                    self.outcome(job, await fut)
            elif how == "timeout-call":
                with anyio.move_on_after(r.choice([0, 1e-4, 1e-3])) as scope:
                    y = await art.call(*args)
                if scope.cancelled_caught:
                    self.tally.cancelled += 1
                else:
                    self.outcome(job, y)
            else:
                fut = None
                with anyio.move_on_after(r.choice([0, 1e-4])):
                    fut = await art.dispatch(*args)
                if fut is None:
                    self.tally.cancelled += 1
                else:
                    self.outcome(job, await fut)
        except (engine.KernelError, engine.RunCancelledError) as e:
            self.outcome(job, error=e)

    async def worker(self, art: AsyncRuntime, seed: int) -> None:
        r = random.Random(seed)
        while self.started < self.runs:
            if self.paused is not None:
                await self.paused.wait()
                continue
            self.started += 1
            if self.started % self.checkpoint == 0 and self.started < self.runs:
                self.paused = anyio.Event()  # the others stop at their next run: read RSS with nothing in flight
                await art.drain()
                self.readings.append((self.started, rss_bytes()))
                print(f"  {self.started:>7} runs  rss {self.readings[-1][1] / 2**20:7.1f} MiB", flush=True)
                event, self.paused = self.paused, None
                event.set()
            await self.one(art, r)

    async def main(self, rt: engine.Runtime) -> dict[str, Any]:
        self.table_arg = rt.alloc_tensor(self.table.shape, "float32", init=self.table)
        base = {k: rt.memory_stats()[k] for k in ("bytes_in_use", "live_allocations", "mapped_regions",
                                                  "free_slots")}
        t0 = time.perf_counter()
        async with AsyncRuntime(rt) as art:
            async with anyio.create_task_group() as tg:
                for _ in range(TASKS):
                    tg.start_soon(self.worker, art, self.rng.randrange(2**32))
            await art.drain()
            elapsed = time.perf_counter() - t0
            # read as at the checkpoints: drained, the AsyncRuntime still open
            self.readings.append((self.started, rss_bytes()))
            print(f"  {self.started:>7} runs  rss {self.readings[-1][1] / 2**20:7.1f} MiB", flush=True)
            stats = art.stats()
        while rt._engine.stats()["runs_live"]:  # a run leaves the native table just after it is delivered
            await anyio.sleep(0.001)
        after = {k: rt.memory_stats()[k] for k in base}
        return {"elapsed_s": elapsed, "stats": stats, "base": base, "after": after,
                "engine": rt._engine.stats()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="25,000 runs, RSS at 10,000 and 25,000")
    ap.add_argument("--runs", type=int, default=None)
    ap.add_argument("--checkpoint", type=int, default=10_000, help="the run after which the first RSS is read")
    ap.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="where to write the JSON figures")
    args = ap.parse_args(argv)
    runs = args.runs or (25_000 if args.quick else 100_000)
    if not 0 < args.checkpoint < runs:
        ap.error("--checkpoint must be between 0 and --runs")
    soak = Soak(runs, args.checkpoint, args.seed)
    print(f"soak: {runs} runs from {TASKS} tasks ({args.backend}), RSS after run {args.checkpoint} and run {runs}")
    with lookup.prepare(depth=4, workers=2, bounds={"B": BOUND}) as rt:
        out = anyio.run(soak.main, rt, backend=args.backend)
        rt.free_tensor(soak.table_arg)
    (n0, rss0), (n1, rss1) = soak.readings[0], soak.readings[-1]
    ratio = rss1 / rss0
    stats = out["stats"]
    figures = {
        "runs": runs, "backend": args.backend, "tasks": TASKS,
        "rss_at": {str(n): b for n, b in soak.readings}, "rss_ratio": ratio, "peak_rss": peak_rss_bytes(),
        "ok": soak.tally.ok, "failed": soak.tally.failed, "cancelled": soak.tally.cancelled, "wrong": len(soak.wrong),
        "dispatched": stats.dispatched, "completed": stats.completed, "runs_failed": stats.failed,
        "runs_cancelled": stats.cancelled, "native_runs": out["engine"]["runs_started"],
        "counters_base": out["base"], "counters_after": out["after"], "elapsed_s": out["elapsed_s"],
        "runs_per_s": runs / out["elapsed_s"],
    }
    print_table(["runs", "rss MiB", "ratio to the first"], [[n, b / 2**20, b / rss0] for n, b in soak.readings])
    print(f"outcomes: {soak.tally.ok} ok, {soak.tally.failed} failed as injected, {soak.tally.cancelled} cancelled, "
          f"{len(soak.wrong)} wrong; {out['engine']['runs_started']} runs reached the engine; "
          f"{figures['runs_per_s']:.0f} dispatches/s")
    write_json("soak", figures, args.json)
    problems = []
    if ratio >= GROWTH_LIMIT:
        problems.append(f"RSS grew by {100 * (ratio - 1):.1f}% from run {n0} to run {n1} (limit 5%)")
    if out["after"] != out["base"]:
        problems.append(f"device counters off their baseline: {out['after']} != {out['base']}")
    if out["engine"]["runs_live"] or out["engine"]["queued"]:
        problems.append(f"engine not idle: {out['engine']}")
    if soak.wrong:
        problems.append(f"{len(soak.wrong)} wrong outcomes, first: {soak.wrong[0]}")
    if stats.dispatched != stats.completed + stats.failed + stats.cancelled:
        problems.append(f"runs unaccounted for: {stats}")
    for p in problems:
        print("FAIL:", p, file=sys.stderr)
    if not problems:
        print(f"OK: RSS ratio {ratio:.4f} (< {GROWTH_LIMIT}), counters at baseline, every surviving result exact")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
