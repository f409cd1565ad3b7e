"""The `tandem` command: `demo`, `bench` and `trace`.

Everything heavy (the engine, numpy, matplotlib, the benchmarks) is imported
inside the subcommand that needs it, so `tandem --help` is instant.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tandem import bench_command

BENCH_HELP = """\
Runs the benchmark scripts (a checkout's benchmarks/ folder, or the copy installed
with the package), each in its own process with a warm-up, several repetitions,
medians and spread: a table on the terminal, a JSON file with the figures and the
machine (CPU, cores, Python, numpy/torch, git commit or package version), PNG plots
(with matplotlib, the `bench` extra), and a progress bar.
Peers (a sequential loop, a ThreadPoolExecutor pipeline, asyncio.to_thread, and Ray
Compiled Graphs with the `ray` extra) run on the same work and are reported as
ratios to Tandem.

  tasks        per-task overhead of the worker pool (and Python pools, same calls)
  kernels      each built-in kernel against numpy / torch
  overlap      throughput against depth and 1/max(T_host, T_device), with peers
  dispatch     awaited dispatches per second against the machine's floor
  model        all-MiniLM-L6-v2 against sentence-transformers (the `models` extra)
  decode       streaming decode, depth 2 against depth 1
  capture      captured runs against uncaptured: a 200-task program, MiniLM, the decoder
  distributed  engine.distributed: dispatch overhead and pipelining
  all          all of the above, in that order

examples:
  tandem bench all --quick              # every benchmark, shortened
  tandem bench overlap kernels --out /tmp/bench
  tandem bench overlap --trace          # also a Chrome trace + PNG timeline

Output goes to --out; by default to benchmarks/results/ when run from a source
checkout, and to ./tandem-bench-results (in the current directory) when run from
an installed package.
"""

TRACE_HELP = """\
Prepares PROGRAM, runs a few pipelined runs untraced, then records --runs runs
with tracing on and writes the Chrome trace (open it in Perfetto or
chrome://tracing) and a PNG timeline of it: one lane per pipeline slot and per
pool worker, with the stretches where host and device were busy at once.

PROGRAM is one of
  overlap          1 ms of Python orchestration + a 1 ms `spin` task per run, depth 2, 1 worker
  mlp              the demo MLP (384->1536->384, batch 32) with resident weights, depth 2
  module:function  a function of yours, called with no arguments, returning
                   (program, prepare_kwargs, args): an engine.Program, the keyword
                   arguments of its prepare(), and the runs' argument tuples, as an
                   iterable or as a callable taking the Runtime (to allocate resident
                   tensors) and returning one

examples:
  tandem trace overlap
  tandem trace mlp --runs 20 --out /tmp/mlp.json
  tandem trace mypkg.pipelines:traced_program --depth 3
"""


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def bench(args: argparse.Namespace) -> int:
    try:
        scripts = bench_command.locate()
    except bench_command.ScriptsNotFound as e:
        print(f"tandem bench: {e}", file=sys.stderr)
        return 2
    return bench_command.run(args.names, scripts=scripts, out=Path(args.out) if args.out else None,
                             quick=args.quick, plots=not args.no_plots, ray=not args.no_ray, trace=args.trace)


def trace(args: argparse.Namespace) -> int:
    from tandem import trace_command

    try:
        return trace_command.main(args.program, out=args.out, png=args.png, runs=args.runs, warmup=args.warmup,
                                  depth=args.depth, workers=args.workers)
    except trace_command.UsageError as e:
        print(f"tandem trace: {e}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem", description="Tandem: an async pipelined execution engine")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run a small MLP at depth 1 and 2 and check it against numpy")
    demo.add_argument("--runs", type=positive, default=200)
    demo.add_argument("--batch", type=positive, default=32)

    b = sub.add_parser("bench", help="run benchmarks: tables, JSON, plots, peers side by side",
                       description=BENCH_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("names", nargs="+", choices=(*bench_command.NAMES, "all"), metavar="NAME",
                   help=f"one or more of {', '.join(bench_command.NAMES)}, all")
    b.add_argument("--quick", action="store_true",
                   help="fewer runs and repetitions")
    b.add_argument("--out", default=None,
                   help=f"folder for JSON, logs and plots (default: benchmarks/results in a checkout, "
                        f"./{bench_command.SHIPPED_DEFAULT_OUT} with an installed package)")
    b.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    b.add_argument("--no-ray", action="store_true",
                   help="skip the Ray peers (overlap's Compiled Graph, distributed's RayTransport) even if ray is "
                        "installed")
    b.add_argument("--trace", action="store_true",
                   help="also write a Chrome trace and PNG timeline of `tandem trace overlap` into the folder")

    t = sub.add_parser("trace", help="trace a short pipelined run: Chrome trace JSON and a PNG timeline",
                       description=TRACE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("program", metavar="PROGRAM", help="overlap, mlp, or module:function")
    t.add_argument("--runs", type=positive, default=12, help="traced runs (default 12)")
    t.add_argument("--warmup", type=non_negative, default=2, help="untraced runs first (default 2)")
    t.add_argument("--depth", type=positive, default=None, help="override the pipeline depth")
    t.add_argument("--workers", type=positive, default=None, help="override the pool's worker count")
    t.add_argument("--out", default=None, help="trace JSON path (default: trace_<name>.json)")
    t.add_argument("--png", default=None, help="timeline PNG path (default: the JSON path with .png)")

    args = parser.parse_args(argv)
    if args.command == "demo":
        from tandem.demo import main as demo_main

        return demo_main(runs=args.runs, batch=args.batch)
    if args.command == "bench":
        return bench(args)
    return trace(args)

