"""The baseline of benchmarks/service.py: sentence-transformers behind Starlette, as a user writes it without Tandem.

    POST /v1/embeddings  {"input": str | [str, ...], "model": "all-MiniLM-L6-v2"}
        200 {"object": "list", "data": [{"object": "embedding", "index": i, "embedding": [...]}, ...],
             "model": ..., "usage": {"prompt_tokens": n, "total_tokens": n}}
    GET  /health         {"status": "ok", "requests": n, "texts": n}

Each request runs one `model.encode(texts)` in a worker thread (Starlette's
run_in_threadpool, anyio's default limiter of 40 threads unless --limit says
otherwise): no batching across requests, no pipelining. torch runs with
--threads intra-op threads (default: one per core). The same OpenAI-style
endpoint and JSON as the Tandem service, so both do the same HTTP and JSON
work per request.

    python benchmarks/_plain_service.py --port 8001 [--threads 2] [--limit 40]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

MODEL_NAME = "all-MiniLM-L6-v2"


def create_app(model: Any, *, limit: int | None = None) -> Any:
    import anyio.to_thread
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    counts = {"requests": 0, "texts": 0}

    async def lifespan(app: Any) -> Any:
        if limit is not None:
            anyio.to_thread.current_default_thread_limiter().total_tokens = limit
        yield

    def encode(texts: list[str]) -> list[list[float]]:
        return model.encode(texts, batch_size=max(1, len(texts)), convert_to_numpy=True).tolist()

    async def embeddings(request: Request) -> Response:
        try:
            payload = json.loads(await request.body())
            texts = payload["input"]
        except (ValueError, KeyError, TypeError):
            return JSONResponse({"error": "the body is {\"input\": str | [str], \"model\": ...}"}, status_code=400)
        if isinstance(texts, str):
            texts = [texts]
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            return JSONResponse({"error": "'input' must be a string or a list of strings"}, status_code=422)
        vectors = await run_in_threadpool(encode, texts) if texts else []
        counts["requests"] += 1
        counts["texts"] += len(texts)
        tokens = sum(len(t.split()) for t in texts)  # an estimate: the benchmark reads no usage
        return JSONResponse({"object": "list", "model": payload.get("model", MODEL_NAME),
                             "data": [{"object": "embedding", "index": i, "embedding": v}
                                      for i, v in enumerate(vectors)],
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", **counts})

    return Starlette(routes=[Route("/v1/embeddings", embeddings, methods=["POST"]),
                             Route("/health", health, methods=["GET"])], lifespan=lifespan)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8001)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch intra-op threads")
    ap.add_argument("--limit", type=int, default=None,
                    help="most encode() calls at once (default: anyio's thread limiter, 40)")
    ap.add_argument("--max-seq-length", type=int, default=None, help="the model's max_seq_length (default: its own)")
    ap.add_argument("--log-level", default="warning")
    args = ap.parse_args(argv)

    import torch
    import uvicorn
    from sentence_transformers import SentenceTransformer

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from examples.minilm.weights import default_model_dir

    torch.set_num_threads(args.threads)
    model = SentenceTransformer(str(default_model_dir()), device="cpu")
    if args.max_seq_length is not None:
        model.max_seq_length = args.max_seq_length
    model.encode(["warm up"])
    uvicorn.run(create_app(model, limit=args.limit), host=args.host, port=args.port, log_level=args.log_level,
                access_log=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
