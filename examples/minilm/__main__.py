"""Runs the embedding service: python -m examples.minilm [--host 127.0.0.1] [--port 8000] ..."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m examples.minilm", description=__doc__)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--workers", type=int, default=None, help="engine pool workers (default: one per core)")
    ap.add_argument("--depth", type=int, default=2, help="engine runs in flight (1 = no pipelining)")
    ap.add_argument("--window-ms", type=float, default=2.0, help="micro-batching window")
    ap.add_argument("--max-batch", type=int, default=32, help="most texts per engine run and per request")
    ap.add_argument("--max-seq-length", type=int, default=None, help="most tokens per text (default: the model's)")
    ap.add_argument("--log-level", default="info")
    args = ap.parse_args(argv)

    import uvicorn

    from examples.minilm.model import MiniLMEncoder
    from examples.minilm.service import create_app

    with MiniLMEncoder(max_batch=args.max_batch, max_seq_length=args.max_seq_length, workers=args.workers,
                       depth=args.depth) as encoder:
        app = create_app(encoder, window_ms=args.window_ms)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())
