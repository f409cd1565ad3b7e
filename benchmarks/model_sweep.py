"""all-MiniLM-L6-v2 against its peers, fairly: each engine alone in its own process, over a sweep of shapes.

Engines (each a fresh subprocess; the parent runs them one after another, never together, so
no engine's threads take cores from another's):
  tandem     examples.minilm.MiniLMEncoder with its defaults (captured runs, the default pool)
  tandem-wN  the same with workers=N (--tandem-workers N; to compare pool sizes)
  torch      sentence-transformers encode() on torch eager, torch.set_num_threads(cores)
  ort        ONNX Runtime, CPU provider, default graph optimisations, intra-op threads = cores, on
             the model exported by torch.onnx.export (in a process of its own, once); mean pooling
             and normalisation in numpy, as sentence-transformers does them

Every call is encode(texts) -> normalised embeddings, tokenization included, on texts of exactly
seq_len tokens (seq_len - 2 common words and [CLS], [SEP]) that no engine was tuned on. The sweep is
seq_len {16, 64, 128, 256} x batch {1, 8, 32}: batch 1 reports latency percentiles over many calls,
larger batches sentences per second (batch / median call). `--rounds` repeats the whole sweep with
the engines in rotated order and keeps each shape's median over rounds (the machine is shared).
At every shape each engine's embeddings of the timed batch are compared with torch's: Tandem's
must stay within cosine 1 - 1e-6 and 1e-5 per element (what it achieves is about 1e-12 and 3e-7,
so a kernel that changes the numerics, such as a tanh GELU for the exact one, fails the sweep);
the peers, a sanity check of the same model, within cosine 0.999. The JSON keeps each shape's
worst cosine and largest difference.

Against the machine: the model's FLOPs per sentence (matmuls and attention products) times
sentences/s, over the machine's large-sgemm rate (numpy float32 2048 x 2048 matmul, all cores,
in a process of its own each round).

    python benchmarks/model_sweep.py [--quick] [--rounds 2] [--engines tandem,torch,ort]
                                     [--tandem-workers 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))  # examples/ is not installed: it is code a user copies

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model comes from its package, never a hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from _common import print_table, run_worker, write_json  # noqa: E402

SEQ_LENS = (16, 64, 128, 256)
BATCHES = (1, 8, 32)
QUICK_SEQ_LENS = (16, 64)
QUICK_BATCHES = (1, 8)
# all-MiniLM-L6-v2: 6 layers, width 384, feed-forward 1536.
LAYERS, HIDDEN, FF = 6, 384, 1536


def model_flops(seq_len: int) -> int:
    """FLOPs of one sentence of seq_len tokens: per layer and token the four matmuls (QKV, output,
    the two feed-forward ones) and the attention products (QK^T and PV over seq_len keys)."""
    per_token = 2 * HIDDEN * (4 * HIDDEN + 2 * FF) + 4 * seq_len * HIDDEN
    return LAYERS * seq_len * per_token


def sgemm_gflops(n: int = 2048, calls: int = 10) -> float:
    """The machine's large-sgemm rate: numpy's float32 n x n matmul on all cores, best of `calls`."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((n, n), dtype=np.float32), rng.standard_normal((n, n), dtype=np.float32)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(calls))
    return 2 * n ** 3 / best / 1e9


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
_WORDS = ("river garden window yellow music letter winter market silver bridge forest doctor orange "
          "island camera planet summer dinner engine rabbit castle ticket pencil mirror button jacket "
          "rocket guitar tomato butter kitten monkey pocket basket ladder candle carpet bottle wallet").split()


def texts(n: int, seq_len: int, seed: int) -> list[str]:
    """n different texts of seq_len - 2 words each (one token per word for this model's vocabulary)."""
    out = []
    for i in range(n):
        k = 11 * i + 5 + seed
        out.append(" ".join(_WORDS[(k + j * (i % 7 + 2)) % len(_WORDS)] for j in range(seq_len - 2)))
    return out


# -- the engines, each a factory of encode(texts) -> embeddings, run inside its worker process -------------
def _tandem(workers: int | None) -> Callable[[list[str]], np.ndarray]:
    from examples.minilm import MiniLMEncoder

    enc = MiniLMEncoder() if workers is None else MiniLMEncoder(workers=workers)
    return enc.encode


def _torch() -> Callable[[list[str]], np.ndarray]:
    import torch
    from sentence_transformers import SentenceTransformer

    from examples.minilm.weights import default_model_dir

    torch.set_num_threads(os.cpu_count() or 1)
    st = SentenceTransformer(str(default_model_dir()), device="cpu")

    def encode(batch: list[str]) -> np.ndarray:
        with torch.inference_mode():
            return st.encode(batch, batch_size=len(batch), normalize_embeddings=True)

    return encode


def export_onnx(path: Path) -> None:
    """all-MiniLM-L6-v2's transformer as ONNX (last hidden state; batch and sequence dynamic)."""
    import torch
    from transformers import AutoModel

    from examples.minilm.weights import default_model_dir

    class Encoder(torch.nn.Module):  # keyword arguments: the model's positional order varies by version
        def __init__(self) -> None:
            super().__init__()
            self.bert = AutoModel.from_pretrained(str(default_model_dir())).eval()

        def forward(self, input_ids: Any, attention_mask: Any, token_type_ids: Any) -> Any:
            return self.bert(input_ids=input_ids, attention_mask=attention_mask,
                             token_type_ids=token_type_ids).last_hidden_state

    ids = torch.ones((2, 16), dtype=torch.int64)
    dyn = {0: "batch", 1: "seq"}
    with torch.no_grad():
        torch.onnx.export(Encoder(), (ids, torch.ones_like(ids), torch.zeros_like(ids)), str(path), dynamo=False,
                          input_names=["input_ids", "attention_mask", "token_type_ids"],
                          output_names=["last_hidden_state"], opset_version=17,
                          dynamic_axes={"input_ids": dyn, "attention_mask": dyn, "token_type_ids": dyn,
                                        "last_hidden_state": dyn})


def _ort(onnx_path: Path) -> Callable[[list[str]], np.ndarray]:
    import onnxruntime as ort

    from examples.minilm.weights import default_model_dir, load_tokenizer

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = os.cpu_count() or 1
    session = ort.InferenceSession(str(onnx_path), opts, providers=["CPUExecutionProvider"])
    tok = load_tokenizer(default_model_dir(), 256)
    tok.enable_padding()

    def encode(batch: list[str]) -> np.ndarray:
        enc = tok.encode_batch(batch)
        ids = np.array([e.ids for e in enc], dtype=np.int64)
        mask = np.array([e.attention_mask for e in enc], dtype=np.int64)
        (hidden,) = session.run(None, {"input_ids": ids, "attention_mask": mask,
                                       "token_type_ids": np.zeros_like(ids)})
        m = mask[:, :, None].astype(np.float32)
        pooled = (hidden * m).sum(axis=1) / np.maximum(m.sum(axis=1), 1e-9)
        return pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)

    return encode


def _time_calls(fn: Callable[[], Any], min_calls: int, min_s: float, max_s: float) -> list[float]:
    fn()
    fn()  # warm: first-shape work (recording a capture key, allocator growth) is not what is measured
    times: list[float] = []
    start = time.perf_counter()
    while True:
        t0 = time.perf_counter()
        fn()
        t = time.perf_counter()
        times.append(t - t0)
        spent = t - start
        if (len(times) >= min_calls and spent >= min_s) or spent >= max_s:
            return times


def worker(engine: str, shapes: list[tuple[int, int]], quick: bool, onnx_path: str | None) -> dict[str, Any]:
    """Runs in the engine's own process: the sweep's figures and each shape's embeddings."""
    if engine == "torch":
        encode = _torch()
    elif engine == "ort":
        assert onnx_path is not None
        encode = _ort(Path(onnx_path))
    elif engine == "tandem":
        encode = _tandem(None)
    elif engine.startswith("tandem-w"):
        encode = _tandem(int(engine[len("tandem-w"):]))
    else:
        raise SystemExit(f"unknown engine {engine!r}")
    rows, embeddings = [], []
    for seq_len, batch in shapes:
        batch_texts = texts(batch, seq_len, seed=seq_len)
        embeddings.append(np.asarray(encode(batch_texts), dtype=np.float64).tolist())
        latency = batch == 1
        times = _time_calls(lambda: encode(batch_texts), min_calls=(20 if quick else 40) if latency else 3,
                            min_s=0.3 if quick else 1.5, max_s=4 if quick else 12)
        times.sort()
        row: dict[str, Any] = {"seq_len": seq_len, "batch": batch, "calls": len(times),
                               "median_ms": 1e3 * statistics.median(times),
                               "sentences_per_s": batch / statistics.median(times)}
        if latency:
            row.update({f"p{q}_ms": 1e3 * times[min(len(times) - 1, int(q / 100 * len(times)))] for q in (50, 90, 99)})
        rows.append(row)
    return {"engine": engine, "rows": rows, "embeddings": embeddings}


def _run_worker(engine: str, shapes: list[tuple[int, int]], quick: bool, onnx_path: Path | None) -> dict[str, Any]:
    args = ["--worker", engine, "--shapes", ",".join(f"{s}x{b}" for s, b in shapes)]
    if quick:
        args.append("--quick")
    if onnx_path is not None:
        args += ["--onnx", str(onnx_path)]
    return run_worker(__file__, args)


# How close to torch's embeddings each engine must be, at every shape: (cosine at least, |difference| at most).
TANDEM_TOLERANCE = (1 - 1e-6, 1e-5)
PEER_TOLERANCE = (0.999, 1.0)


def agreement(a: list[list[float]], b: list[list[float]]) -> tuple[float, float]:
    """(worst row cosine, largest element difference) of two batches of embeddings."""
    x, y = np.asarray(a), np.asarray(b)
    cos = (x * y).sum(1) / (np.linalg.norm(x, axis=1) * np.linalg.norm(y, axis=1))
    return float(cos.min()), float(np.abs(x - y).max())


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"seq_len {QUICK_SEQ_LENS} x batch {QUICK_BATCHES}, "
                                                         "short timings, one round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--engines", default="tandem,torch,ort")
    ap.add_argument("--tandem-workers", type=int, default=None, help="also run tandem with workers=N")
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--shapes", help=argparse.SUPPRESS)
    ap.add_argument("--onnx", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.worker:
        shapes = [(int(s), int(b)) for s, b in (x.split("x") for x in args.shapes.split(","))]
        if args.worker == "export":
            export_onnx(Path(args.out))
            return {}
        if args.worker == "sgemm":
            Path(args.out).write_text(json.dumps({"gflops": sgemm_gflops()}))
            return {}
        Path(args.out).write_text(json.dumps(worker(args.worker, shapes, args.quick, args.onnx)))
        return {}

    seq_lens, batches = (QUICK_SEQ_LENS, QUICK_BATCHES) if args.quick else (SEQ_LENS, BATCHES)
    shapes = [(s, b) for s in seq_lens for b in batches]
    rounds = 1 if args.quick else args.rounds
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if args.tandem_workers is not None:
        engines.append(f"tandem-w{args.tandem_workers}")
    onnx_path: Path | None = None
    tmp = tempfile.TemporaryDirectory()
    try:
        if "ort" in engines:
            onnx_path = Path(tmp.name) / "all-MiniLM-L6-v2.onnx"
            print("exporting the model to ONNX (torch.onnx.export) ...", flush=True)
            subprocess.run([sys.executable, __file__, "--worker", "export", "--out", str(onnx_path),
                            "--shapes", "0x0"], check=True, cwd=ROOT)
        runs: dict[str, list[dict[str, Any]]] = {e: [] for e in engines}
        sgemm: list[float] = []
        for r in range(rounds):
            sgemm.append(_run_worker("sgemm", shapes, args.quick, None)["gflops"])
            order = engines[r % len(engines):] + engines[: r % len(engines)]
            for e in order:
                print(f"round {r + 1}/{rounds}: {e}", flush=True)
                runs[e].append(_run_worker(e, shapes, args.quick, onnx_path))
    finally:
        tmp.cleanup()

    reference = runs["torch"][0]["embeddings"] if "torch" in runs else None
    machine = statistics.median(sgemm)
    figures: dict[str, Any] = {"cores": os.cpu_count(), "rounds": rounds, "engines": engines,
                               "shapes": [{"seq_len": s, "batch": b} for s, b in shapes], "results": {},
                               "machine_sgemm_gflops": machine}
    for e, per_round in runs.items():
        merged = []
        for i, (s, b) in enumerate(shapes):
            rows = [pr["rows"][i] for pr in per_round]
            row = {"seq_len": s, "batch": b}
            for k in rows[0]:
                if k not in ("seq_len", "batch"):
                    row[k] = statistics.median(x[k] for x in rows)
            if reference is not None:
                row["cosine_vs_torch"], row["max_abs_diff_vs_torch"] = agreement(per_round[0]["embeddings"][i],
                                                                                 reference[i])
                min_cos, max_diff = TANDEM_TOLERANCE if e.startswith("tandem") else PEER_TOLERANCE
                if row["cosine_vs_torch"] < min_cos or row["max_abs_diff_vs_torch"] > max_diff:
                    raise SystemExit(f"{e} at seq_len {s} batch {b}: embeddings differ from torch's (cosine "
                                     f"{row['cosine_vs_torch']:.9f}, largest difference "
                                     f"{row['max_abs_diff_vs_torch']:.2e}; allowed {min_cos}, {max_diff})")
            row["model_gflops"] = row["sentences_per_s"] * model_flops(s) / 1e9
            row["fraction_of_sgemm"] = row["model_gflops"] / machine
            merged.append(row)
        figures["results"][e] = {"rows": merged}

    table = []
    for i, (s, b) in enumerate(shapes):
        line: list[Any] = [s, b]
        for e in engines:
            row = figures["results"][e]["rows"][i]
            line.append(f"p50 {row['p50_ms']:.2f} p99 {row['p99_ms']:.2f}" if b == 1
                        else f"{row['sentences_per_s']:.1f}/s")
        table.append(line)
    print("batch 1: latency in ms; larger batches: sentences per second")
    print_table(["seq", "batch", *engines], table)
    if "torch" in engines:
        print("\nratios to torch (b1: torch p50 / engine p50; else engine sentences/s / torch's; > 1: faster)")
        ratio_rows = []
        for i, (s, b) in enumerate(shapes):
            t = figures["results"]["torch"]["rows"][i]
            line = [s, b]
            for e in engines:
                row = figures["results"][e]["rows"][i]
                line.append(t["p50_ms"] / row["p50_ms"] if b == 1 else row["sentences_per_s"] / t["sentences_per_s"])
            ratio_rows.append(line)
        print_table(["seq", "batch", *engines], ratio_rows)
        figures["ratios_to_torch"] = [dict(zip(["seq_len", "batch", *engines], r)) for r in ratio_rows]
    print(f"\nmodel GFLOP/s as a fraction of the machine's large-sgemm rate ({machine:.0f} GFLOP/s)")
    print_table(["seq", "batch", *engines],
                [[s, b, *[figures["results"][e]["rows"][i]["fraction_of_sgemm"] for e in engines]]
                 for i, (s, b) in enumerate(shapes)])
    path = write_json("model_sweep", figures, args.json)
    print(f"wrote {path}")
    try:
        from _plots import render, unavailable

        if unavailable() is None:
            for p in render(json.loads(path.read_text()), path.parent):
                print(f"wrote {p}")
    except Exception as exc:  # a plot is optional; the figures are written
        print(f"no plot: {exc}")
    return figures


if __name__ == "__main__":
    main()
