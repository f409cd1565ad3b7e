"""An async HTTP embedding service: Starlette on uvicorn, micro-batched onto the engine.

    POST /embed   {"texts": ["a sentence", ...]}   (or a bare JSON list of strings)
        200 {"model": ..., "dim": 384, "embeddings": [[...], ...]}   unit vectors, in order
        400 malformed JSON; 422 not a list of strings; 413 too large (body, texts, tokens)
    GET /health   {"status": "ok", "runs": ..., "texts": ..., "requests": ...}

Every request validates and tokenizes its own texts, then awaits its rows
from the MicroBatcher, which shares engine runs between concurrent requests.
A bad request gets its 4xx and touches nothing else.

    python -m examples.minilm --port 8000
"""

from __future__ import annotations

import json
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import anyio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from examples.minilm.batching import MicroBatcher
from examples.minilm.model import MiniLMEncoder

__all__ = ["create_app"]

MODEL_NAME = "all-MiniLM-L6-v2"


class _Reject(Exception):
    """A request the service refuses: an HTTP status and a message for the client."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def create_app(encoder: MiniLMEncoder, *, window_ms: float = 2.0, max_texts: int | None = None,
               max_body_bytes: int = 1 << 20) -> Starlette:
    """The service over an encoder (which it drives while the app runs; do not encode() meanwhile).

    max_texts: most texts per request (default and at most the encoder's max_batch).
    Texts longer than the encoder's max_seq_length tokens are refused, not truncated.
    """
    limit = encoder.max_batch if max_texts is None else max_texts
    if not 1 <= limit <= encoder.max_batch:
        raise ValueError(f"max_texts must be in [1, {encoder.max_batch}] (the encoder's max_batch), got {max_texts}")
    batcher = MicroBatcher(encoder, window_s=window_ms / 1000.0, depth=encoder.runtime.depth)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with encoder.open_async(), anyio.create_task_group() as tg:
            await tg.start(batcher.run)
            try:
                yield
            finally:
                tg.cancel_scope.cancel()

    async def embed(request: Request) -> JSONResponse:
        try:
            texts = _parse_texts(await _read_body(request, max_body_bytes), limit)
            tokens = encoder.tokenize(texts, truncate=False)
            for i, t in enumerate(tokens):
                if len(t) > encoder.max_seq_length:
                    raise _Reject(413, f"texts[{i}] has {len(t)} tokens; at most {encoder.max_seq_length} "
                                       "are accepted")
        except _Reject as r:
            return JSONResponse({"error": r.message}, status_code=r.status)
        if not tokens:
            return _embeddings([])
        try:
            vectors = await batcher.embed(tokens)
        except Exception as e:  # a failed run: this request's problem is reported, the service goes on
            return JSONResponse({"error": f"embedding failed: {e}"}, status_code=500)
        return _embeddings(vectors.tolist())

    def _embeddings(rows: list[list[float]]) -> JSONResponse:
        return JSONResponse({"model": MODEL_NAME, "dim": encoder.dim, "embeddings": rows})

    async def health(request: Request) -> JSONResponse:
        s = batcher.stats
        return JSONResponse({"status": "ok", "runs": s.runs, "texts": s.texts, "requests": s.requests})

    app = Starlette(routes=[Route("/embed", embed, methods=["POST"]), Route("/health", health, methods=["GET"])],
                    lifespan=lifespan)
    app.state.batcher = batcher
    return app


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body, refused once it passes `limit` bytes (before reading it all, when declared)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _Reject(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _Reject(413, f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _parse_texts(body: bytes, limit: int) -> list[str]:
    try:
        payload: Any = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise _Reject(400, f"malformed JSON: {e}") from None
    if isinstance(payload, dict):
        if "texts" not in payload:
            raise _Reject(422, "missing field 'texts'; the body is {\"texts\": [string, ...]}")
        extra = sorted(set(payload) - {"texts"})
        if extra:
            raise _Reject(422, f"unexpected fields {extra}; the body is {{\"texts\": [string, ...]}}")
        texts = payload["texts"]
    else:
        texts = payload
    if not isinstance(texts, list):
        raise _Reject(422, f"'texts' must be a list of strings, got {_json_type(texts)}")
    if len(texts) > limit:
        raise _Reject(413, f"{len(texts)} texts in one request; at most {limit} are accepted")
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise _Reject(422, f"texts[{i}] must be a string, got {_json_type(t)}")
    return texts


def _json_type(value: Any) -> str:
    """The JSON name of a decoded value's type, for messages a client understands."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return {dict: "an object", list: "an array", str: "a string"}.get(type(value), type(value).__name__)
