"""Whole model: all-MiniLM-L6-v2 sentence embeddings on the engine against sentence-transformers on torch.

encode: sentences per second at batch 1, 8 and 32, every sentence 128 tokens, the
  engine with `--threads` pool workers against sentence-transformers' encode() with
  torch.set_num_threads(--threads), in one process. Both sides tokenize inside the
  timed call. Repetitions alternate engine and torch, so load from elsewhere on the
  machine hits both alike. Two shapes of call:
    one batch   encode(batch): one run, waited for (what a latency-bound caller does);
    stream      encode(N sentences, batch_size=b): N / b runs, pipelined by the engine
                (depth 2), one forward after the other by torch.
The HTTP service (python -m examples.minilm) under load, at depth 1 and 2 and against
sentence-transformers behind Starlette, is measured by benchmarks/service.py
(`tandem bench service`), each service alone in its own process.

    python benchmarks/model.py [--quick] [--threads 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import statistics
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


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions and requests (well under a minute)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="engine pool workers and torch threads (default: all cores)")
    ap.add_argument("--no-service", action="store_true", help=argparse.SUPPRESS)  # accepted: the service part moved
    ap.add_argument("--json", default=None, help="where to write the figures (default: benchmarks/results/)")
    args = ap.parse_args(argv)

    reps, stream_batches = (2, 1) if args.quick else (7, 4)  # quick: no stream figures
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
    print("\n(the HTTP service under load: benchmarks/service.py, `tandem bench service`)")
    path = write_json("model", figures, args.json)
    print(f"\nwrote {path}")
    return figures


if __name__ == "__main__":
    main()
