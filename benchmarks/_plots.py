"""PNG plots of the benchmarks' JSON (matplotlib, Agg backend, imported only when plotting).

`render(data, out_dir)` draws the plots for one benchmark's JSON document
(what _common.write_json wrote) and returns the files. Without matplotlib,
`unavailable()` says why and nothing is drawn: plots are optional, figures
are not. Re-render saved results with

    python benchmarks/_plots.py benchmarks/results/*.json [--out DIR]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path
from typing import Any, Callable

TANDEM = "#1f77b4"
PEER_COLORS = {"sequential": "#7f7f7f", "thread_pool": "#ff7f0e", "to_thread": "#2ca02c",
               "ray_compiled_graph": "#9467bd"}


def unavailable() -> str | None:
    """Why no plots can be drawn here, or None."""
    if importlib.util.find_spec("matplotlib") is None:
        return "matplotlib is not installed (pip install 'tandem-engine[bench]'): no plots"
    return None


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed, and no GUI toolkit imported
    import matplotlib.pyplot as plt

    return plt


def _footer(fig: Any, data: dict[str, Any]) -> None:
    env = data.get("environment", {})
    fig.text(0.01, 0.005, f"{env.get('cpu', '?')}, {env.get('cores', '?')} cores; commit {env.get('commit', '?')}; "
             f"{env.get('date', '')}", fontsize=7, color="#555555", ha="left", va="bottom")


def _save(fig: Any, data: dict[str, Any], path: Path) -> Path:
    _footer(fig, data)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=110)
    _plt().close(fig)
    return path


def overlap(data: dict[str, Any], out: Path) -> list[Path]:
    f = data["figures"]
    plt = _plt()
    files = []
    fig, ax = plt.subplots(figsize=(8.5, 4.5))
    depths = [d["depth"] for d in f["depths"]]
    ax.plot(depths, [d["runs_per_s"]["median"] for d in f["depths"]], "o-", color=TANDEM, lw=2.5, label="Tandem")
    if all("native_floor" in d for d in f["depths"]):  # JSON from before the floor was measured has none
        ax.plot(depths, [d["native_floor"]["runs_per_s"]["median"] for d in f["depths"]], "o:", color=TANDEM, lw=1.5,
                label="Tandem's native floor")
    for name, peer in f.get("peers", {}).items():
        if peer["available"]:
            ds = peer["depths"]
            ax.plot([d["depth"] for d in ds], [d["runs_per_s"]["median"] for d in ds], "s--",
                    color=PEER_COLORS.get(name), label=peer["label"], alpha=0.85)
    ax.axhline(f["bound_runs_per_s"], color="black", ls="--", lw=1)
    ax.text(depths[-1], f["bound_runs_per_s"], "bound 1/max(T_host, T_device) ", ha="right", va="bottom", fontsize=8)
    ax.axhline(f["serial_runs_per_s"], color="black", ls=":", lw=1)
    ax.text(depths[-1], f["serial_runs_per_s"], "serial 1/(T_host + T_device) ", ha="right", va="top", fontsize=8)
    ax.set_xticks(depths)
    ax.set_xlabel("pipeline depth (runs in flight)")
    ax.set_ylabel("runs per second (median)")
    ax.set_ylim(0, f["bound_runs_per_s"] * 1.15)
    ax.set_title(f"Overlap: T_host {f['host_ms']} ms, T_device {f['device_ms']} ms, {f['workers']} worker(s)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)  # beside: lines cross
    files.append(_save(fig, data, out / "overlap_throughput.png"))

    cdf = f.get("latency_cdf", {}).get("samples_ms", {})
    if cdf:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        labels = {"tandem": "Tandem", "native_floor": "Tandem's native floor",
                  **{k: v["label"] for k, v in f.get("peers", {}).items()}}
        for name, samples in cdf.items():
            xs = sorted(samples)
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            ax.step(xs, ys, where="post", lw=2.5 if name == "tandem" else 1.5, ls=":" if name == "native_floor" else "-",
                    color=TANDEM if name in ("tandem", "native_floor") else PEER_COLORS.get(name),
                    label=labels.get(name, name))
        ax.set_xlabel("run latency, ms (host step start to device step end)")
        ax.set_ylabel("fraction of runs")
        ax.set_title(f"Run latency CDF at depth {f['latency_cdf']['depth']} (sequential loop: no depth)")
        ax.legend(fontsize=8, loc="lower right")
        ax.grid(alpha=0.3)
        files.append(_save(fig, data, out / "overlap_latency_cdf.png"))
    return files


def kernels(data: dict[str, Any], out: Path) -> list[Path]:
    ks = data["figures"]["kernels"]
    plt = _plt()
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.24 * len(ks)))
    # Two rows may share kernel, shape and dtype (against numpy and against torch): name the reference too.
    labels = [f"{k['kernel']} {k['shape']} {k['dtype']} vs {k['reference']}"[:80] for k in ks]
    ratios = [k["ratio"] for k in ks]
    colors = ["#2ca02c" if r >= (k["target"] or 1.0) else "#d62728" for r, k in zip(ratios, ks)]
    y = list(range(len(ks)))[::-1]
    ax.barh(y, ratios, color=colors, alpha=0.8)
    targets = [(yy, k["target"]) for yy, k in zip(y, ks) if k["target"] is not None]
    if targets:
        ax.scatter([t for _, t in targets], [yy for yy, _ in targets], marker="|", s=120, color="black",
                   label="target", zorder=3)
        ax.legend(fontsize=8, loc="lower right")
    ax.axvline(1.0, color="black", lw=1)
    ax.set_xscale("log")
    ax.set_yticks(y)
    ax.set_yticklabels(labels, fontsize=7)
    ax.set_xlabel("reference time / Tandem time (above 1: Tandem is faster), log scale")
    ax.set_title("Kernels against numpy / torch, one thread each")
    return [_save(fig, data, out / "kernels_ratios.png")]


def dispatch(data: dict[str, Any], out: Path) -> list[Path]:
    f = data["figures"]
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    depths = [d["depth"] for d in f["depths"]]
    series = [("engine", "Tandem (AsyncRuntime)", TANDEM, "o-"), ("floor", "floor: bare futures via a native thread",
              "black", "o--"), ("python_thread_floor", "Python thread + call_soon_threadsafe", "#8c564b", "^:"),
              ("asyncio_to_thread", "asyncio.to_thread(rt)", PEER_COLORS["to_thread"], "s--"),
              ("thread_pool_executor", "ThreadPoolExecutor(rt)", PEER_COLORS["thread_pool"], "s--")]
    for key, label, color, style in series:
        if all(key in d for d in f["depths"]):
            ax.plot(depths, [1.0 / d[key]["median"] for d in f["depths"]], style, color=color, label=label,
                    lw=2.5 if key == "engine" else 1.5)
    ax.set_xscale("log", base=2)
    ax.set_xticks(depths)
    ax.set_xticklabels([str(d) for d in depths])
    ax.set_yscale("log")
    ax.set_xlabel("runs in flight")
    ax.set_ylabel("awaited dispatches per second (median)")
    ax.set_title(f"Dispatch of a one-noop program ({f.get('backend', 'asyncio')})")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    return [_save(fig, data, out / "dispatch_rate.png")]


def tasks(data: dict[str, Any], out: Path) -> list[Path]:
    f = data["figures"]
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    labels, values, colors = [], [], []
    for g in f["graphs"]:
        labels.append(f"Tandem {g['shape']}, native submit, {g['workers']} w")
        values.append(g["native_total_ns_per_task"]["median"])
        colors.append(TANDEM)
    p = f.get("peers")
    if p:
        labels.append(f"Tandem wide, from Python, {p['workers']} w")
        values.append(p["tandem_python_ns_per_task"]["median"])
        colors.append("#aec7e8")
        for name, peer in p["peers"].items():
            labels.append(f"{peer['label']}, {p['workers']} thread(s)")
            values.append(peer["ns_per_task"]["median"])
            colors.append(PEER_COLORS.get(name, "#7f7f7f"))
    y = list(range(len(values)))[::-1]
    ax.barh(y, values, color=colors)
    ax.set_yticks(y)
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("ns per noop task (median; lower is better), log scale")
    ax.set_title("Per-task overhead")
    return [_save(fig, data, out / "tasks_overhead.png")]


def _grouped_bars(ax: Any, groups: list[str], series: list[tuple[str, list[float], str]]) -> None:
    width = 0.8 / len(series)
    for i, (label, values, color) in enumerate(series):
        ax.bar([g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))], values, width,
               label=label, color=color)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups)
    ax.legend(fontsize=8)


def model(data: dict[str, Any], out: Path) -> list[Path]:
    f = data["figures"]
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    enc = f["encode"]
    series = [("Tandem, one batch", [r["engine_one_sps"] for r in enc], TANDEM),
              ("torch, one batch", [r["torch_one_sps"] for r in enc], "#d62728")]
    if all("engine_stream_sps" in r for r in enc):
        series += [("Tandem, stream", [r["engine_stream_sps"] for r in enc], "#aec7e8"),
                   ("torch, stream", [r["torch_stream_sps"] for r in enc], "#ff9896")]
    _grouped_bars(ax, [f"batch {r['batch']}" for r in enc], series)
    ax.set_ylabel("sentences per second (median)")
    ax.set_title(f"all-MiniLM-L6-v2, {f['seq_len']} tokens, {f['threads']} threads each")
    return [_save(fig, data, out / "model_encode.png")]


def model_sweep(data: dict[str, Any], out: Path) -> list[Path]:
    """Batch-1 p50 latency and batch > 1 throughput per sequence length, one line per engine."""
    f = data["figures"]
    plt = _plt()
    batches = sorted({s["batch"] for s in f["shapes"]})
    fig, axes = plt.subplots(1, len(batches), figsize=(4.2 * len(batches), 4))
    axes = list(axes) if len(batches) > 1 else [axes]
    colors = {"tandem": TANDEM, "torch": "#d62728", "ort": "#2ca02c"}
    for ax, b in zip(axes, batches):
        for e in f["engines"]:
            rows = [r for r in f["results"][e]["rows"] if r["batch"] == b]
            ys = [r["p50_ms"] if b == 1 else r["sentences_per_s"] for r in rows]
            color = colors.get(e, "#aec7e8" if e.startswith("tandem") else None)  # tandem-wN: a lighter blue
            ax.plot([r["seq_len"] for r in rows], ys, marker="o", label=e, color=color)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel("p50 latency, ms (lower is better)" if b == 1 else "sentences per second (higher is better)")
        ax.set_title(f"batch {b}")
        ax.legend()
    fig.suptitle(f"all-MiniLM-L6-v2, each engine in its own process, {f['cores']} cores")
    return [_save(fig, data, out / "model_sweep.png")]


def decode(data: dict[str, Any], out: Path) -> list[Path]:
    f = data["figures"]
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4.5))
    ds = f["depths"]
    ax.bar([str(d["depth"]) for d in ds], [d["tokens_per_s"]["median"] for d in ds], color=TANDEM, width=0.5)
    ax.axhline(f["bound_tokens_per_s"], color="black", ls="--", lw=1, label="bound 1/max(T_host, T_device)")
    ax.axhline(f["serial_tokens_per_s"], color="black", ls=":", lw=1, label="serial 1/(T_host + T_device)")
    ax.set_xlabel("pipeline depth")
    ax.set_ylabel("tokens per second (median)")
    ax.set_title(f"Streaming decode: depth 2 / depth 1 = {f['speedup_depth2_over_depth1']:.2f}x")
    ax.legend(fontsize=8, loc="lower right")
    plots = [_save(fig, data, out / "decode_tokens.png")]
    peers = f.get("transformers")
    if peers is not None:  # against transformers' GPT2LMHeadModel.generate, separate processes
        fig, ax = plt.subplots(figsize=(5, 4.5))
        rates = peers["tokens_per_s"]
        ax.bar(list(rates), list(rates.values()), color=[TANDEM, "gray"], width=0.5)
        ax.set_ylabel("tokens per second (median)")
        ax.set_title(f"Greedy decode: Tandem / transformers = {peers['tandem_over_transformers']:.2f}x")
        plots.append(_save(fig, data, out / "decode_vs_transformers.png"))
    return plots


def distributed(data: dict[str, Any], out: Path) -> list[Path]:
    f = data["figures"]
    plt = _plt()
    ray = f.get("ray")
    sweep = f.get("pipelining_sweep")  # results from before the batch sweep have none
    panels = 2 + (1 if sweep else 0) + (2 if ray else 0)
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4.5))
    a1, a2 = axes[0], axes[1]
    o = f["overhead"]
    bars = [("bare shm + pipe\n(sleeping reads)", o["bare_us"], "black")]
    if "bare_polling_us" in o:  # results from before the polling floor was measured have none
        bars.append(("bare shm + pipe\n(polling reads)", o["bare_polling_us"], "gray"))
    bars += [("drt(x)", o["sync_us"], TANDEM), ("await art.call", o["async_us"], "#aec7e8")]
    a1.bar([b[0] for b in bars], [b[1] for b in bars], color=[b[2] for b in bars])
    a1.set_ylabel("us per run (median)")
    a1.set_title("Per-run dispatch across processes")
    p = f["pipelining"]
    depths = [d["depth"] for d in p["depths"]]
    a2.plot(depths, [d["runs_per_s"] for d in p["depths"]], "o-", color=TANDEM, lw=2.5, label="Tandem")
    a2.axhline(p["bound_runs_per_s"], color="black", ls="--", lw=1, label="bound 1/max(T_host, T_worker)")
    a2.set_xticks(depths)
    a2.set_ylim(0, max(p["bound_runs_per_s"], *(d["runs_per_s"] for d in p["depths"])) * 1.15)
    a2.set_xlabel("pipeline depth")
    a2.set_ylabel("runs per second (median)")
    a2.set_title(f"Data-parallel MLP on {p['workers']} chip workers")
    a2.legend(fontsize=8, loc="lower right")
    if sweep:
        a5 = axes[2]
        pts = sweep["points"]
        batches = [q["batch"] for q in pts]
        a5.plot(batches, [q["fraction_of_bound"] for q in pts], "o-", color=TANDEM, lw=2.5, label="Tandem, depth 3")
        a5.plot(batches, [q["cpu_ceiling_over_bound"] for q in pts], "s--", color="gray", lw=1.5,
                label=f"what {sweep['cores']} cores allow at its CPU a run")
        a5.axhline(0.85, color="black", ls=":", lw=1, label="target 0.85")
        a5.set_xscale("log", base=2)
        a5.set_xticks(batches, [str(b) for b in batches])
        a5.minorticks_off()
        a5.set_ylim(0, 1.05)
        a5.set_xlabel("batch (split over the workers)")
        a5.set_ylabel("runs/s over 1/max(T_host, T_worker)")
        a5.set_title("Data-parallel MLP over batch sizes")
        a5.legend(fontsize=8, loc="lower right")
    if ray:
        r, sc = ray["overhead"], ray["scaling"]
        a3 = axes[-2]
        a3.bar(["Compiled Graph\nstep", "RayTransport\ndrt(x)", "RayTransport\nawait"],
               [r["cgraph_us"], r["sync_us"], r["async_us"]], color=["black", TANDEM, "#aec7e8"])
        a3.set_ylabel("us per run (median)")
        a3.set_title(f"Ray ({ray['channel']} channel): per-run overhead, driver's node")
        a4 = axes[-1]
        pts = sc["points"]
        a4.plot([q["gflop_per_run"] for q in pts], [q["two_over_one"]["median"] for q in pts], "o-", color=TANDEM,
                lw=2.5, label="two nodes over one")
        for q in pts:
            a4.annotate(f"B={q['batch']}", (q["gflop_per_run"], q["two_over_one"]["median"]), fontsize=8,
                        xytext=(4, -12), textcoords="offset points")
        a4.axhline(1.6, color="black", ls="--", lw=1, label="target 1.6x")
        a4.axhline(2.0, color="gray", ls=":", lw=1, label="two workers' ideal")
        a4.set_xscale("log")
        a4.set_xticks([q["gflop_per_run"] for q in pts], [f"{q['gflop_per_run']:.2g}" for q in pts])
        a4.minorticks_off()
        a4.set_ylim(0, 2.2)
        a4.set_xlabel(f"GFLOP per run (MLP {sc['width']}->{sc['hidden']}->{sc['width']})")
        a4.set_ylabel("runs/s, two nodes over one (median)")
        a4.set_title("Ray: data-parallel scaling, depth 3")
        a4.legend(fontsize=8, loc="lower right")
    return [_save(fig, data, out / "distributed.png")]


def capture(data: dict[str, Any], out: Path) -> list[Path]:
    f = data["figures"]
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.5))
    ws = f["workloads"]
    names = [w["workload"] for w in ws]
    _grouped_bars(a1, names, [("uncaptured", [w["uncaptured"]["orchestration_us"] for w in ws], "#aec7e8"),
                              ("captured", [w["captured"]["orchestration_us"] for w in ws], TANDEM)])
    a1.set_yscale("log")
    a1.set_ylabel("host launch per run, us (median, log)")
    a1.set_title("Orchestration: run every time or replayed")
    _grouped_bars(a2, names, [("uncaptured", [w["uncaptured"]["runs_per_s"] for w in ws], "#aec7e8"),
                              ("captured", [w["captured"]["runs_per_s"] for w in ws], TANDEM)])
    a2.set_ylabel("runs per second at depth 2 (median)")
    a2.set_title("Throughput")
    return [_save(fig, data, out / "capture.png")]


RENDERERS: dict[str, Callable[[dict[str, Any], Path], list[Path]]] = {
    "native_tasks": tasks, "overlap": overlap, "kernels": kernels, "dispatch": dispatch, "model": model,
    "decode": decode, "capture": capture, "distributed": distributed, "model_sweep": model_sweep,
}


def render(data: dict[str, Any], out_dir: Path) -> list[Path]:
    """The plots of one benchmark's JSON document, written into out_dir."""
    name = data["benchmark"]
    fn = RENDERERS.get(name) or RENDERERS.get(name.split("_")[0])  # dispatch_asyncio -> dispatch
    if fn is None:
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    return fn(data, out_dir)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, default=None, help="where to write the PNGs (default: beside each JSON)")
    args = ap.parse_args(argv)
    reason = unavailable()
    if reason:
        print(reason)
        return 1
    for path in args.files:
        for png in render(json.loads(path.read_text()), args.out or path.parent):
            print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
