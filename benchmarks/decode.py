"""Streaming decode: tokens per second at pipeline depth 2 against depth 1, and the overlap figure.

The decoder of examples/decoder (4 layers, width 256) streams greedy tokens
with `Decoder.astream`. Each token goes through a realistic host step: it is
detokenised (toy vocabulary, incremental) and sent as a server-sent-event
frame through an anyio memory stream to a client task that writes it out.
At depth 1 step N+1 is orchestrated only after step N has finished; at depth
2 it is orchestrated (and the host step of token N-1 runs) while step N is on
the device.

Both depths run side by side in one process, their repetitions interleaved
(alternating which goes first) so that both see the same machine. Figures per depth:
- tokens/s over whole streams (median of the repetitions);
- T_host: CPU time of the event-loop thread per token (orchestration,
  completion handling, the host step and the client), from time.thread_time;
- T_device: device busy time per step, averaged over the measured steps (a
  stream's prefill step is longer than its decode steps: the mean, not the
  median, is what bounds the stream's tokens/s). On one device worker (the
  default) it is each step's task time summed, which the engine measures for
  every run whether or not anyone traces (AsyncRuntime.run_records, busy_ns),
  so the measured streams run untraced: tracing costs the worker time between
  tasks (3-4% of tokens/s here), which would count against Tandem in the
  figure. With several workers tasks may overlap, and the union of their
  intervals comes from the engine's trace (Runtime.set_tracing) instead;
- orchestration per step (p50 over the measured steps: staging and orchestration, from
  the run records; traced, from the host spans) and the host step alone;
- completion wake-ups: how often a completed step wrote the engine's notifier fd and how long
  the device thread spent in those writes (engine stats notifier_writes / notifier_write_ns).
  With the event loop asleep in epoll while the device runs, each write must wake a sleeping
  CPU; under a hypervisor that costs the writer tens of us, between two steps' tasks, so it
  is device time the bound below (from the task intervals) does not count. On a KVM guest whose
  idle driver is `haltpoll`, /sys/module/haltpoll/parameters/guest_halt_poll_ns says how long an
  idle vCPU polls before it halts (printed with the figures; see README, "On a VM").
The overlap figure is depth 2's tokens/s over the bound 1 / max(T_host, T_device),
taken per repetition over that repetition's own T's (the median of the repetitions):
the machine's speed moves between repetitions, and a bound from one window over
tokens/s from another would measure that; the speedup is depth 2's tokens/s over depth 1's
(also given per interleaved repetition). Both depths must stream identical tokens.

Against what a user would run instead (not with --quick, or with --peers): Hugging Face
transformers' GPT2LMHeadModel configured to the same architecture and loaded with the same
weights (examples/decoder/transformers_peer.py), greedy `generate` with its KV cache, torch on
as many threads as cores, against Tandem's `Decoder.generate` with its defaults. Each side runs
in a fresh process of its own, the parent running them one after another in rotated order over
rounds; tokens/s is new tokens over the whole call (prefill included), the median of the
calls; both must produce the same tokens for every prompt.

    python benchmarks/decode.py [--quick] [--tokens N] [--prompt-len P] [--reps R] [--workers W]
                                [--peers | --no-peers] [--rounds R] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))

import anyio  # noqa: E402
import numpy as np  # noqa: E402
from _common import cpu_idle, print_table, repeat, run_worker, write_json  # noqa: E402

from examples.decoder import Decoder, DecoderConfig, init_weights  # noqa: E402
from examples.decoder.vocab import Detokenizer, ToyVocab  # noqa: E402


class StreamRecord:
    """What one measured stream produced and how long its parts took."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.host_step_ns: list[int] = []
        self.wall_s = 0.0
        self.cpu_s = 0.0


async def stream_with_host_step(dec: Decoder, vocab: ToyVocab, prompt: list[int], n: int) -> StreamRecord:
    """One greedy stream; each token is detokenised and sent to a client task as an SSE frame."""
    record = StreamRecord()
    sink = io.BytesIO()  # stands in for the client's socket
    send, receive = anyio.create_memory_object_stream[str](max_buffer_size=64)

    async def client() -> None:
        async with receive:
            async for frame in receive:
                sink.write(frame.encode())

    detok = Detokenizer(vocab)
    t0, c0 = time.perf_counter(), time.thread_time()
    async with anyio.create_task_group() as tg:
        tg.start_soon(client)
        async with send:
            async for token in dec.astream(prompt, n):
                h0 = time.perf_counter_ns()
                piece = detok.push(token)
                await send.send(f"data: {json.dumps({'id': token, 'text': piece})}\n\n")
                record.host_step_ns.append(time.perf_counter_ns() - h0)
                record.tokens.append(token)
    record.wall_s, record.cpu_s = time.perf_counter() - t0, time.thread_time() - c0
    assert sink.getvalue().count(b"data: ") == n
    return record


def orchestration_per_run(spans: list[tuple]) -> list[int]:
    """Per run: its staging and orchestration host spans (ns) summed, from Runtime.drain_trace()."""
    by_run: dict[int, int] = defaultdict(int)
    for run_id, _slot, name, start, end in spans:
        if name in ("staging", "orchestration"):
            by_run[run_id] += end - start
    return list(by_run.values())


def device_busy_per_run(events: list[tuple]) -> list[int]:
    """Per run: the union of its task intervals (ns), from Runtime.drain_trace() task events."""
    by_run: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for run_id, _task, _worker, start, end, _kernel, _ok in events:
        by_run[run_id].append((start, end))
    busy = []
    for intervals in by_run.values():
        total, reach = 0, None
        for start, end in sorted(intervals):
            if reach is None or start > reach:
                total += end - start
                reach = end
            elif end > reach:
                total += end - reach
                reach = end
        busy.append(total)
    return busy


class DepthRun:
    """One decoder at one pipeline depth and what its measured streams recorded."""

    def __init__(self, dec: Decoder, vocab: ToyVocab, prompts: list[list[int]], n: int) -> None:
        self.dec, self.vocab, self.prompts, self.n = dec, vocab, prompts, n
        self.records: list[StreamRecord] = []
        self.tokens_per_s: list[float] = []
        self.overlap: list[float] = []  # per repetition: tokens/s over that repetition's own bound
        self.traced = dec.runtime.workers > 1  # tasks may overlap: their union comes from the trace
        self.measuring = False
        self.busy_ns: list[int] = []  # per measured step: its device busy time
        self.orchestration_ns: list[int] = []  # per measured step: staging and orchestration
        self._seq = 0  # the next run record to read
        self._wakeups = (0, 0)  # the engine's (notifier_writes, notifier_write_ns) when measuring began

    def _engine_wakeups(self) -> tuple[int, int]:
        stats = self.dec.runtime._engine.stats()  # type: ignore[union-attr]  # reaches in on purpose
        return stats["notifier_writes"], stats["notifier_write_ns"]

    def start_measuring(self) -> None:
        """From here on, repetitions count (warm-up before)."""
        self.measuring = True
        self._wakeups = self._engine_wakeups()
        if self.traced:
            self.dec.runtime.set_tracing(True)

    async def one_rep(self) -> float:
        """Streams every prompt once; tokens/s over them.

        Measuring, also the repetition's overlap figure: its tokens/s over
        1 / max(T_host, T_device) of the same streams, i.e. max(host CPU, device
        busy) over the wall time, so a machine that runs slower for one
        repetition moves both sides of the ratio alike.
        """
        rt = self.dec.runtime
        art = self.dec._async_runtime()  # reaches in on purpose: the decoder's AsyncRuntime
        if self.traced:
            rt.drain_trace()  # what came before this repetition
        tokens, wall, cpu = 0, 0.0, 0.0
        for prompt in self.prompts:
            rec = await stream_with_host_step(self.dec, self.vocab, prompt, self.n)
            tokens += len(rec.tokens)
            wall += rec.wall_s
            cpu += rec.cpu_s
            if self.measuring:
                self.records.append(rec)
        runs = art.run_records(self._seq)
        if runs:
            self._seq = runs[-1].seq + 1
        if not self.measuring:
            return tokens / wall
        if self.traced:
            spans, events = rt.drain_trace()
            busy, orchestration = device_busy_per_run(events), orchestration_per_run(spans)
        else:
            busy = [r.busy_ns for r in runs]
            orchestration = [r.sealed_ns - r.launch_ns for r in runs]
        if len(busy) != tokens:
            raise SystemExit(f"FAILED: {tokens} tokens but {len(busy)} step records (the run records' window "
                             "is too small for a repetition?)")
        self.busy_ns += busy
        self.orchestration_ns += orchestration
        self.overlap.append(max(cpu, sum(busy) / 1e9) / wall)
        self.tokens_per_s.append(tokens / wall)
        return tokens / wall

    def figures(self) -> dict[str, Any]:
        stats = self.dec.stats()
        writes, write_ns = self._engine_wakeups()
        steps = len(self.busy_ns)  # one run record (or traced run) per measured step
        tps = self.tokens_per_s
        n_tokens = sum(len(r.tokens) for r in self.records)
        return {
            "depth": self.dec.depth,
            "tokens_per_s": {"median": statistics.median(tps), "min": min(tps), "max": max(tps), "reps": len(tps)},
            "t_host_ms": sum(r.cpu_s for r in self.records) / n_tokens * 1e3,
            "t_device_ms": statistics.fmean(self.busy_ns) / 1e6,
            "t_device_from": "trace" if self.traced else "run records",
            "orchestration_ms_p50": statistics.median(self.orchestration_ns) / 1e6,
            "host_step_us_p50": statistics.median(ns for r in self.records for ns in r.host_step_ns) / 1e3,
            "scheduler_overlap_ratio": stats.overlap_ratio,
            "steps": steps,
            # Announcing a completed step to the event loop asleep in epoll: time the device thread spent
            # writing the notifier's fd (not in T_device: it falls between the steps' tasks).
            "wakeups_per_step": (writes - self._wakeups[0]) / steps,
            "wakeup_us_per_step": (write_ns - self._wakeups[1]) / steps / 1e3,
            "overlap_per_rep": self.overlap,
        }


def measure(cfg: DecoderConfig, weights: dict[str, np.ndarray], vocab: ToyVocab, workers: int,
            prompts: list[list[int]], n: int, reps: int) -> tuple[dict[int, dict[str, Any]], dict[str, float], bool]:
    """Depth 1 and depth 2 side by side, their repetitions interleaved so both see the same machine.

    Returns the figures per depth, the per-repetition speedup (depth 2 over
    depth 1, via _common.repeat) and whether both depths streamed the same tokens.
    """
    runs = {depth: DepthRun(Decoder(cfg, weights, depth=depth, workers=workers), vocab, prompts, n)
            for depth in (1, 2)}
    order = [1, 2]

    def pair() -> float:
        """One repetition at each depth (alternating which goes first); their throughput ratio."""
        order.reverse()
        tps = {depth: portal.call(runs[depth].one_rep) for depth in order}
        return tps[2] / tps[1]

    # The event loop runs in the portal's thread: every stream's host work happens there.
    with anyio.from_thread.start_blocking_portal() as portal, contextlib.ExitStack() as stack:
        for run in runs.values():
            stack.enter_context(portal.wrap_async_context_manager(run.dec))
        # Warm-up, outside the figures: the first streams record each step's orchestration (capture),
        # the second ones learn each step's call signature; from the third on a step replays from its call.
        pair()
        pair()
        for run in runs.values():
            run.start_measuring()
        speedup = repeat(pair, reps, warmup=0)
        figures = {depth: run.figures()
                   for depth, run in runs.items()}
    same = all(a.tokens == b.tokens for a, b in zip(runs[1].records, runs[2].records))
    return figures, speedup, same


# -- against transformers ------------------------------------------------------------------------------
PEERS = ("tandem", "transformers")


def peer_worker(engine: str, seed: int, prompts: list[list[int]], n: int, calls: int) -> dict[str, Any]:
    """In the engine's own process: tokens/s of `calls` greedy generations per prompt, and the tokens."""
    cfg = DecoderConfig()
    weights = init_weights(cfg, seed)
    if engine == "tandem":
        dec = Decoder(cfg, weights)
        generate, threads, close = dec.generate, dec.runtime.workers, dec.close
    else:
        import torch

        from examples.decoder.transformers_peer import gpt2_from_weights, gpt2_generate

        torch.set_num_threads(os.cpu_count() or 1)
        model = gpt2_from_weights(cfg, weights)
        threads = torch.get_num_threads()

        def generate(prompt: list[int], k: int) -> list[int]:
            return gpt2_generate(model, prompt, k)

        def close() -> None:
            pass

    try:
        tokens = [generate(p, n) for p in prompts]  # warm-up, and the tokens to compare
        rates = []
        for _ in range(calls):
            for p in prompts:
                t0 = time.perf_counter()
                generate(p, n)
                rates.append(n / (time.perf_counter() - t0))
    finally:
        close()
    return {"engine": engine, "threads": threads, "tokens_per_s": statistics.median(rates), "tokens": tokens}


def compare_peers(seed: int, prompts: list[list[int]], n: int, rounds: int, calls: int) -> dict[str, Any]:
    """Tandem against transformers, each in fresh processes, rounds in rotated order; tokens must agree."""
    runs: dict[str, list[dict[str, Any]]] = {e: [] for e in PEERS}
    for r in range(rounds):
        for e in PEERS[r % 2:] + PEERS[:r % 2]:
            runs[e].append(run_worker(__file__, ["--peer-worker", e, "--seed", str(seed), "--tokens", str(n),
                                                 "--prompt-len", str(len(prompts[0])), "--reps", str(calls),
                                                 "--prompts", json.dumps(prompts)]))
    ours, theirs = runs["tandem"][0]["tokens"], runs["transformers"][0]["tokens"]
    if ours != theirs:
        raise SystemExit(f"FAILED: Tandem and transformers generated different tokens: {ours} vs {theirs}")
    rates = {e: statistics.median(x["tokens_per_s"] for x in per) for e, per in runs.items()}
    return {"rounds": rounds, "calls_per_prompt": calls,
            "tokens_per_s": rates, "threads": {e: per[0]["threads"] for e, per in runs.items()},
            "tandem_over_transformers": rates["tandem"] / rates["transformers"], "tokens_identical": True}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer and shorter streams (well under a minute)")
    ap.add_argument("--tokens", type=int, default=None, help="new tokens per stream (default: fill the cache)")
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--workers", type=int, default=1, help="device workers (a step is a chain of kernels)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--peers", action=argparse.BooleanOptionalAction, default=None,
                    help="also against transformers' GPT2LMHeadModel in separate processes (default: unless --quick)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of the comparison with transformers")
    ap.add_argument("--json", default=None)
    ap.add_argument("--peer-worker", choices=PEERS, help=argparse.SUPPRESS)
    ap.add_argument("--prompts", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.peer_worker:
        figures = peer_worker(args.peer_worker, args.seed, json.loads(args.prompts), args.tokens, args.reps)
        Path(args.out).write_text(json.dumps(figures))
        return figures

    cfg = DecoderConfig()
    n = args.tokens if args.tokens is not None else (64 if args.quick else cfg.max_len - args.prompt_len)
    reps = args.reps if args.reps is not None else (3 if args.quick else 5)
    n_prompts = 1 if args.quick else 3
    if not 1 <= args.prompt_len or args.prompt_len + n > cfg.max_len:
        ap.error(f"prompt-len + tokens must fit the cache of {cfg.max_len} positions")
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(0, cfg.vocab, args.prompt_len).tolist() for _ in range(n_prompts)]
    weights = init_weights(cfg, args.seed)
    vocab = ToyVocab(cfg.vocab, args.seed)

    load_before = os.getloadavg()[0]
    by_depth, speedup_reps, same = measure(cfg, weights, vocab, args.workers, prompts, n, reps)
    load_after = os.getloadavg()[0]
    if not same:
        raise SystemExit("FAILED: depth 1 and depth 2 streamed different tokens")
    peers = None
    if args.peers if args.peers is not None else not args.quick:
        peers = compare_peers(args.seed, prompts, n, args.rounds, reps)

    d1, d2 = by_depth[1], by_depth[2]
    speedup = d2["tokens_per_s"]["median"] / d1["tokens_per_s"]["median"]
    bound = 1e3 / max(d2["t_host_ms"], d2["t_device_ms"])
    serial = 1e3 / (d2["t_host_ms"] + d2["t_device_ms"])
    overlap = statistics.median(d2["overlap_per_rep"])
    figures: dict[str, Any] = {
        "model": {"layers": cfg.n_layers, "d_model": cfg.d_model, "heads": cfg.n_heads, "d_ff": cfg.d_ff,
                  "vocab": cfg.vocab, "max_len": cfg.max_len},
        "workers": args.workers, "prompt_len": args.prompt_len, "new_tokens": n, "streams_per_rep": n_prompts,
        "depths": [d1, d2],
        "speedup_depth2_over_depth1": speedup,
        "speedup_per_rep": speedup_reps,
        "bound_tokens_per_s": bound,
        "serial_tokens_per_s": serial,
        "overlap_figure": overlap,
        # Pipelining needs a core for the device worker next to the host thread: load from
        # other processes on a small machine shrinks depth 2's advantage.
        "load_average_1m": {"before": load_before, "after": load_after},
    }
    if peers is not None:
        figures["transformers"] = peers

    idle = cpu_idle()  # how costly the completion wake-ups below are depends on it (see the module docstring)
    print(f"decoder {cfg.n_layers} layers x {cfg.d_model}, vocab {cfg.vocab}; {n_prompts} stream(s) of "
          f"{n} tokens after a {args.prompt_len}-token prompt, {reps} reps, {args.workers} device worker(s); "
          f"{os.cpu_count()} cores, 1-min load average {load_before:.1f} before, {load_after:.1f} after; "
          f"cpuidle {idle['driver']}, guest_halt_poll_ns {idle['guest_halt_poll_ns']}")
    rows = [[d["depth"], d["tokens_per_s"]["median"], d["tokens_per_s"]["min"], d["tokens_per_s"]["max"],
             d["t_host_ms"], d["t_device_ms"], d["orchestration_ms_p50"], d["host_step_us_p50"]] for d in (d1, d2)]
    print_table(["depth", "tokens/s", "min", "max", "T_host ms", "T_device ms", "orchestration ms",
                 "host step us"], rows)
    print(f"speedup depth 2 / depth 1: {speedup:.2f}x (per interleaved repetition: median "
          f"{speedup_reps['median']:.2f}, min {speedup_reps['min']:.2f}, max {speedup_reps['max']:.2f})")
    print(f"overlap figure: depth 2 reaches {overlap:.2f} of the bound 1/max(T_host, T_device) (median over "
          f"repetitions of each one's own bound; over all of them {bound:.0f} tokens/s, serial 1/(T_host + "
          f"T_device) = {serial:.0f} tokens/s)")
    print(f"completion wake-ups at depth 2: {d2['wakeups_per_step']:.2f} a step, {d2['wakeup_us_per_step']:.1f} us of "
          f"the device thread each step ({d2['wakeup_us_per_step'] / 1e3 / d2['t_device_ms']:.1%} of T_device; "
          "waking the event loop asleep in epoll, outside T_device)")
    print("OK: depth 1 and depth 2 streamed the same tokens")
    if peers is not None:
        rates, threads = peers["tokens_per_s"], peers["threads"]
        print_table(["engine", "tokens/s", "threads"],
                    [[e, rates[e], threads[e]] for e in PEERS])
        print(f"Tandem over transformers' GPT2LMHeadModel.generate: {peers['tandem_over_transformers']:.2f}x "
              f"(each in its own processes, {peers['rounds']} rounds); OK: the same tokens")
    out = write_json("decode", figures, args.json)
    print(f"wrote {out}")
    return figures


if __name__ == "__main__":
    main()
