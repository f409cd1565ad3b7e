"""Runs the OpenAI-compatible embedding service: python -m examples.minilm [--host 127.0.0.1] [--port 8000] ...

SIGTERM or SIGINT: /ready answers 503, connections are accepted for
--shutdown-delay more seconds, then no new ones; the requests already
accepted finish (at most --graceful-timeout seconds), the batcher and the
runtime close, and the process exits with status 0.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import sys
from typing import Any

API_KEY_ENV = "TANDEM_API_KEY"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m examples.minilm", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--workers", type=int, default=None, help="engine pool workers (default: one per core)")
    ap.add_argument("--depth", type=int, default=2, help="engine runs in flight (1 = no pipelining)")
    ap.add_argument("--window-ms", type=float, default=2.0, help="micro-batching window")
    ap.add_argument("--max-batch", type=int, default=32, help="most texts per engine run and per request")
    ap.add_argument("--max-seq-length", type=int, default=None, help="most tokens per text (default: the model's)")
    ap.add_argument("--seq-multiple", type=int, default=8,
                    help="pad each run's texts to a multiple of this many tokens: more runs replay a recording "
                         "(1: to the longest text exactly)")
    ap.add_argument("--max-queue", type=int, default=None,
                    help="most texts waiting for the engine; past it requests get 503 with Retry-After at once "
                         "(default: 8 x --max-batch; 0: no bound)")
    ap.add_argument("--request-timeout", type=float, default=None,
                    help="deadline in seconds for a request to reach the engine when it sends no X-Request-Timeout, "
                         "and the largest one it may ask for (default: none)")
    ap.add_argument("--priority-aging", type=float, default=1.0,
                    help="seconds of waiting one X-Priority step is worth (0: strict priorities)")
    ap.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body")
    ap.add_argument("--api-key", default=None,
                    help=f"require 'Authorization: Bearer <key>' on /v1/* (default: ${API_KEY_ENV}; prefer the "
                         "environment variable: arguments are visible to every user of the machine)")
    ap.add_argument("--graceful-timeout", type=float, default=30.0,
                    help="on shutdown, most seconds to wait for the requests in flight before cancelling them")
    ap.add_argument("--shutdown-delay", type=float, default=0.0,
                    help="on shutdown, seconds to keep accepting connections with /ready answering 503, so that "
                         "a load balancer sees the instance leave first")
    ap.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug", "trace"])
    args = ap.parse_args(argv)

    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    if args.api_key == "":
        ap.error("--api-key must not be empty")
    if args.graceful_timeout < 0 or args.shutdown_delay < 0:
        ap.error("--graceful-timeout and --shutdown-delay must be >= 0")
    if args.priority_aging < 0:
        ap.error("--priority-aging must be >= 0 (0: strict priorities)")
    if args.request_timeout is not None and not args.request_timeout > 0:
        ap.error("--request-timeout must be positive")

    import uvicorn

    from examples.minilm.model import MiniLMEncoder
    from examples.minilm.service import DEFAULT_QUEUE_FACTOR, MODEL_NAME, DrainingServer, create_app

    log = logging.getLogger("examples.minilm")
    max_queue = DEFAULT_QUEUE_FACTOR * args.max_batch if args.max_queue is None else args.max_queue
    if args.seq_multiple < 1:
        ap.error(f"--seq-multiple must be at least 1, got {args.seq_multiple}")
    with MiniLMEncoder(max_batch=args.max_batch, max_seq_length=args.max_seq_length, workers=args.workers,
                       depth=args.depth, seq_multiple=args.seq_multiple) as encoder:
        try:
            app = create_app(encoder, window_ms=args.window_ms, max_body_bytes=args.max_body_bytes,
                             max_queue=max_queue, priority_aging=args.priority_aging or None, api_key=api_key,
                             request_timeout=args.request_timeout)
        except ValueError as e:
            ap.error(str(e))
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                log_config=_log_config(args.log_level),
                                timeout_graceful_shutdown=args.graceful_timeout, lifespan="on")  # sets up logging
        log.info("serving %s on http://%s:%d: workers=%d depth=%d max_batch=%d max_seq_length=%d window_ms=%g "
                 "max_queue=%s request_timeout=%s priority_aging=%s max_body_bytes=%d graceful_timeout=%g "
                 "shutdown_delay=%g api_key=%s", MODEL_NAME, args.host, args.port, encoder.runtime.workers,
                 encoder.runtime.depth, encoder.max_batch, encoder.max_seq_length, args.window_ms,
                 max_queue or "unbounded", args.request_timeout, args.priority_aging or "strict",
                 args.max_body_bytes, args.graceful_timeout, args.shutdown_delay,
                 "required" if api_key else "off")
        server = DrainingServer(config, state=app.state.service, shutdown_delay=args.shutdown_delay)
        server.run()
    return 0


def _log_config(level: str) -> dict[str, Any]:
    """uvicorn's logging, with this package's loggers on its default handler."""
    from uvicorn.config import LOGGING_CONFIG

    cfg = copy.deepcopy(LOGGING_CONFIG)
    cfg["loggers"]["examples.minilm"] = {"handlers": ["default"], "level": level.upper(), "propagate": False}
    return cfg


if __name__ == "__main__":
    sys.exit(main())
