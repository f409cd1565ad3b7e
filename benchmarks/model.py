"""Whole model: all-MiniLM-L6-v2 sentence embeddings on the engine against sentence-transformers on torch.

encode: sentences per second at batch 1, 8 and 32, every sentence 128 tokens, the
  engine with `--threads` pool workers against sentence-transformers' encode() with
  torch.set_num_threads(--threads), in one process. Both sides tokenize inside the
  timed call. Repetitions alternate engine and torch, so load from elsewhere on the
  machine hits both alike. Two shapes of call:
    one batch   encode(batch): one run, waited for (what a latency-bound caller does);
    stream      encode(N sentences, batch_size=b): N / b runs, pipelined by the engine
                (depth 2), one forward after the other by torch.
service: the HTTP service (python -m examples.minilm) in a subprocess under a bounded
  closed-loop load from this process (--clients concurrent clients, --requests in all,
  a few sentences each): requests per second and p50/p99 latency, with the engine
  pipelined (depth 2) and not (depth 1). The service's pool has the engine's default
  workers (one per core) unless --service-workers says otherwise.

    python benchmarks/model.py [--quick] [--threads 2] [--service-workers N] [--no-service] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))  # examples/ is not installed: it is code a user copies

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model comes from its package, never a hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from _common import print_table, write_json  # noqa: E402

SEQ_LEN = 128
BATCHES = (1, 8, 32)
_WORDS = ("time year people way day man thing woman life child world school state family student group country "
          "problem hand part place case week company system program question work government number night point "
          "home water room mother area money story fact month lot right study book eye job word business issue "
          "side kind head house service friend father power hour game line end member law car city community name "
          "president team minute idea kid body information back parent face others level office door health person "
          "art war history party result change morning reason research girl guy moment air teacher force "
          "education").split()


def sentences(n: int, tokens: int, seed: int = 0) -> list[str]:
    """n different texts of at least `tokens` tokens (the encoders truncate them to exactly that)."""
    out = []
    for i in range(n):
        k = 7 * i + 3 + seed
        out.append(" ".join(_WORDS[(k + j * (i % 5 + 1)) % len(_WORDS)] for j in range(tokens + 8)))
    return out


def interleaved(fns: dict[str, Callable[[], Any]], reps: int, warmup: int = 1) -> dict[str, float]:
    """Median seconds per call of each fn, the calls taken in turn so both see the same machine."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def bench_encode(threads: int, reps: int, stream_batches: int) -> list[dict[str, Any]]:
    import torch
    from sentence_transformers import SentenceTransformer

    from examples.minilm import MiniLMEncoder

    torch.set_num_threads(threads)
    rows = []
    with MiniLMEncoder(workers=threads, max_batch=max(BATCHES), max_seq_length=SEQ_LEN, depth=2) as enc:
        st = SentenceTransformer(str(enc.model_dir), device="cpu")
        st.max_seq_length = SEQ_LEN
        texts = sentences(max(BATCHES) * stream_batches, SEQ_LEN)
        assert {len(t) for t in enc.tokenize(texts)} == {SEQ_LEN}
        for b in BATCHES:
            one, many = texts[:b], texts[:b * stream_batches]
            calls = {"engine_one": lambda: enc.encode(one), "torch_one": lambda: st.encode(one, batch_size=b)}
            if stream_batches > 1:
                calls["engine_stream"] = lambda: enc.encode(many, batch_size=b)
                calls["torch_stream"] = lambda: st.encode(many, batch_size=b)
            with torch.inference_mode():
                t = interleaved(calls, reps)
            row = {"batch": b, "seq_len": SEQ_LEN, "engine_one_sps": b / t["engine_one"],
                   "torch_one_sps": b / t["torch_one"], "one_ratio": t["torch_one"] / t["engine_one"]}
            if stream_batches > 1:
                row.update({"stream_sentences": len(many), "engine_stream_sps": len(many) / t["engine_stream"],
                            "torch_stream_sps": len(many) / t["torch_stream"],
                            "stream_ratio": t["torch_stream"] / t["engine_stream"]})
            rows.append(row)
    return rows


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_service(workers: int | None, depth: int) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "examples.minilm", "--port", str(port), "--depth", str(depth), "--window-ms", "2",
           "--max-seq-length", str(SEQ_LEN), "--log-level", "warning"]
    if workers is not None:
        cmd += ["--workers", str(workers)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    import httpx

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the service exited: {proc.stderr.read() if proc.stderr else ''}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the service did not start within 120 s")


async def _load(url: str, requests: int, clients: int, texts_per_request: int) -> dict[str, float]:
    import anyio
    import httpx

    pool = sentences(64, 48, seed=1)
    bodies = [{"texts": [pool[(i * 5 + j) % len(pool)][: 80 + 40 * j] for j in range(texts_per_request)]}
              for i in range(requests)]
    latencies: list[float] = []
    next_index = 0
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        await client.post("/embed", json=bodies[0])  # warm the server's first run
        before = (await client.get("/health")).json()

        async def worker() -> None:
            nonlocal next_index
            while next_index < requests:
                body = bodies[next_index]
                next_index += 1
                t0 = time.perf_counter()
                r = await client.post("/embed", json=body)
                latencies.append(time.perf_counter() - t0)
                r.raise_for_status()

        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for _ in range(clients):
                tg.start_soon(worker)
        elapsed = time.perf_counter() - t0
        after = (await client.get("/health")).json()
    lat = sorted(latencies)
    runs = after["runs"] - before["runs"]
    return {
        "requests": requests, "clients": clients, "texts_per_request": texts_per_request,
        "requests_per_s": requests / elapsed, "texts_per_s": requests * texts_per_request / elapsed,
        "p50_ms": 1e3 * lat[len(lat) // 2], "p99_ms": 1e3 * lat[min(len(lat) - 1, int(0.99 * len(lat)))],
        "texts_per_run": (after["texts"] - before["texts"]) / max(runs, 1),
    }


def bench_service(workers: int | None, requests: int, clients: int, texts_per_request: int) -> list[dict[str, Any]]:
    import anyio

    rows = []
    for depth in (2, 1):
        proc, url = _start_service(workers, depth)
        try:
            figures = anyio.run(_load, url, requests, clients, texts_per_request)
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        rows.append({"depth": depth, **figures})
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions and requests (well under a minute)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="engine pool workers and torch threads (default: all cores)")
    ap.add_argument("--service-workers", type=int, default=None,
                    help="the service's engine pool workers (default: the engine's, one per core)")
    ap.add_argument("--no-service", action="store_true", help="skip the HTTP service load")
    ap.add_argument("--json", default=None, help="where to write the figures (default: benchmarks/results/)")
    args = ap.parse_args(argv)

    reps, stream_batches = (2, 1) if args.quick else (7, 4)  # quick: no stream figures
    requests, clients, per_request = (24, 4, 2) if args.quick else (200, 8, 4)
    figures: dict[str, Any] = {"threads": args.threads, "seq_len": SEQ_LEN, "reps": reps}
    figures["encode"] = bench_encode(args.threads, reps, stream_batches)
    print(f"all-MiniLM-L6-v2, {SEQ_LEN} tokens per sentence, {args.threads} threads each "
          "(engine pool workers / torch.set_num_threads), sentences per second (median)")
    headers = ["batch", "engine", "torch", "engine/torch"]
    if stream_batches > 1:
        headers += ["engine stream", "torch stream", "engine/torch"]
    print_table(headers, [[r["batch"], r["engine_one_sps"], r["torch_one_sps"], r["one_ratio"]]
                          + ([r["engine_stream_sps"], r["torch_stream_sps"], r["stream_ratio"]]
                             if stream_batches > 1 else []) for r in figures["encode"]])
    if stream_batches > 1:
        print(f"(stream: {stream_batches} batches per encode() call)")
    if not args.no_service:
        figures["service_workers"] = args.service_workers or max(1, (os.cpu_count() or 1) - 1)
        figures["service"] = bench_service(args.service_workers, requests, clients, per_request)
        by_depth = {r["depth"]: r for r in figures["service"]}
        figures["service_depth2_over_depth1"] = by_depth[2]["requests_per_s"] / by_depth[1]["requests_per_s"]
        print()
        chars = f"{80}-{80 + 40 * (per_request - 1)} characters"
        print(f"service: {requests} requests of {per_request} sentences ({chars}) from {clients} concurrent clients "
              f"(closed loop, same machine), {figures['service_workers']} engine workers")
        print_table(["depth", "requests/s", "sentences/s", "p50 ms", "p99 ms", "sentences per run"],
                    [[r["depth"], r["requests_per_s"], r["texts_per_s"], r["p50_ms"], r["p99_ms"],
                      r["texts_per_run"]] for r in figures["service"]])
        print(f"pipelined over depth 1: {figures['service_depth2_over_depth1']:.2f}x requests/s")
    path = write_json("model", figures, args.json)
    print(f"\nwrote {path}")
    return figures


if __name__ == "__main__":
    main()
