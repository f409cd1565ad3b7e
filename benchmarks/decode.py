"""Streaming decode: tokens per second at pipeline depth 2 against depth 1, and the overlap figure.

The decoder of examples/decoder (4 layers, width 256) streams greedy tokens
with `Decoder.astream`. Each token goes through a realistic host step: it is
detokenised (toy vocabulary, incremental) and sent as a server-sent-event
frame through an anyio memory stream to a client task that writes it out.
At depth 1 step N+1 is orchestrated only after step N has finished; at depth
2 it is orchestrated (and the host step of token N-1 runs) while step N is on
the device.

Figures, per depth, measured side by side in one process:
- tokens/s over whole streams (median of the repetitions);
- T_host: CPU time of the event-loop thread per token (orchestration,
  completion handling, the host step and the client), from time.thread_time;
- T_device: device busy time per step, the union of its task intervals from
  the engine's trace (Runtime.set_tracing / drain_trace);
- orchestration per step (scheduler stats, p50) and the host step alone.
The overlap figure is depth 2's tokens/s over the bound 1 / max(T_host, T_device)
(the T's of that same run); the speedup is depth 2's tokens/s over depth 1's.

    python benchmarks/decode.py [--quick] [--tokens N] [--prompt-len P] [--reps R] [--workers W] [--json PATH]
"""

from __future__ import annotations

import argparse
import io
import json
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
from _common import print_table, repeat, write_json  # noqa: E402

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


def measure_depth(cfg: DecoderConfig, weights: dict[str, np.ndarray], vocab: ToyVocab, depth: int, workers: int,
                  prompts: list[list[int]], n: int, reps: int) -> dict[str, Any]:
    """tokens/s over `reps` repetitions of streaming every prompt, and where the time went."""
    records: list[StreamRecord] = []

    async def one_rep() -> float:
        tokens, wall = 0, 0.0
        for prompt in prompts:
            rec = await stream_with_host_step(dec, vocab, prompt, n)
            records.append(rec)
            tokens += len(rec.tokens)
            wall += rec.wall_s
        return tokens / wall

    # The event loop runs in the portal's thread; every stream's host work happens there.
    dec = Decoder(cfg, weights, depth=depth, workers=workers)
    with anyio.from_thread.start_blocking_portal() as portal, portal.wrap_async_context_manager(dec):
        portal.call(one_rep)  # warm-up: first touches of every buffer, outside the figures
        records.clear()
        dec.runtime.set_tracing(True)
        dec.runtime.drain_trace()
        stats_before = dec.stats()
        tps = repeat(lambda: portal.call(one_rep), reps, warmup=0)
        _spans, events = dec.runtime.drain_trace()
        stats = dec.stats()
    busy = device_busy_per_run(events)
    n_tokens = sum(len(r.tokens) for r in records)
    return {
        "depth": depth,
        "tokens_per_s": tps,
        "t_host_ms": sum(r.cpu_s for r in records) / n_tokens * 1e3,
        "t_device_ms": statistics.median(busy) / 1e6,
        "orchestration_ms_p50": stats.orchestration.p50 * 1e3,
        "host_step_us_p50": statistics.median(ns for r in records for ns in r.host_step_ns) / 1e3,
        "scheduler_overlap_ratio": stats.overlap_ratio,
        "steps": stats.completed - stats_before.completed,
        "streams": [r.tokens for r in records[:len(prompts)]],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer and shorter streams (well under a minute)")
    ap.add_argument("--tokens", type=int, default=None, help="new tokens per stream (default: fill the cache)")
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--workers", type=int, default=1, help="device workers (a step is a chain of kernels)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

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

    by_depth = {}
    for depth in (1, 2):
        by_depth[depth] = measure_depth(cfg, weights, vocab, depth, args.workers, prompts, n, reps)
    if by_depth[1]["streams"] != by_depth[2]["streams"]:
        raise SystemExit("FAILED: depth 1 and depth 2 streamed different tokens")

    d1, d2 = by_depth[1], by_depth[2]
    speedup = d2["tokens_per_s"]["median"] / d1["tokens_per_s"]["median"]
    bound = 1e3 / max(d2["t_host_ms"], d2["t_device_ms"])
    serial = 1e3 / (d2["t_host_ms"] + d2["t_device_ms"])
    overlap = d2["tokens_per_s"]["median"] / bound
    figures: dict[str, Any] = {
        "model": {"layers": cfg.n_layers, "d_model": cfg.d_model, "heads": cfg.n_heads, "d_ff": cfg.d_ff,
                  "vocab": cfg.vocab, "max_len": cfg.max_len},
        "workers": args.workers, "prompt_len": args.prompt_len, "new_tokens": n, "streams_per_rep": n_prompts,
        "depths": [{k: v for k, v in d.items() if k != "streams"} for d in (d1, d2)],
        "speedup_depth2_over_depth1": speedup,
        "bound_tokens_per_s": bound,
        "serial_tokens_per_s": serial,
        "overlap_figure": overlap,
    }

    print(f"decoder {cfg.n_layers} layers x {cfg.d_model}, vocab {cfg.vocab}; {n_prompts} stream(s) of "
          f"{n} tokens after a {args.prompt_len}-token prompt, {reps} reps, {args.workers} device worker(s)")
    rows = [[d["depth"], d["tokens_per_s"]["median"], d["tokens_per_s"]["min"], d["tokens_per_s"]["max"],
             d["t_host_ms"], d["t_device_ms"], d["orchestration_ms_p50"], d["host_step_us_p50"]] for d in (d1, d2)]
    print_table(["depth", "tokens/s", "min", "max", "T_host ms", "T_device ms", "orchestration ms",
                 "host step us"], rows)
    print(f"speedup depth 2 / depth 1: {speedup:.2f}x")
    print(f"overlap figure: depth 2 reaches {overlap:.2f} of the bound 1/max(T_host, T_device) = {bound:.0f} "
          f"tokens/s (serial 1/(T_host + T_device) = {serial:.0f} tokens/s)")
    print("OK: depth 1 and depth 2 streamed the same tokens")
    out = write_json("decode", figures, args.json)
    print(f"wrote {out}")
    return figures


if __name__ == "__main__":
    main()
