"""An OpenAI-compatible embedding service: Starlette on uvicorn, micro-batched onto the engine.

    POST /v1/embeddings   {"model": "all-MiniLM-L6-v2", "input": "text" | ["text", ...],
                           "encoding_format": "float" | "base64", "dimensions": 384, "user": "..."}
        200 {"object": "list", "data": [{"object": "embedding", "index": i, "embedding": [...]}, ...],
             "model": "all-MiniLM-L6-v2", "usage": {"prompt_tokens": n, "total_tokens": n}}
    GET  /v1/models, /v1/models/{model}   the one model served
    GET  /health    liveness: 200 while the process serves
    GET  /ready     readiness: 200 once the runtime is open and the batcher runs, 503 before and while draining
    GET  /metrics   Prometheus text: the runtime's tandem_* metrics and the service's minilm_* metrics

Every request validates and tokenizes its own texts, then awaits its rows
from the MicroBatcher, which shares engine runs between concurrent requests.
A refused request gets its status and an OpenAI-shaped error body
{"error": {"message", "type", "param", "code"}} and touches nothing else.

Headers: `Authorization: Bearer <key>` on /v1/* when the service has an API
key; `X-Request-Timeout: <seconds>`, a deadline for reaching the engine (504
past it, and nothing of the request ran); `X-Priority: <int in [-100, 100]>`,
higher is dispatched first. examples/minilm/README.md describes every field,
status, header and metric.

The modules: openai_api (parsing and error bodies), front (API key, HTTP
metrics), service_metrics (minilm_* metrics), lifecycle (readiness and the
draining uvicorn server), batching (the MicroBatcher); this one wires them.

    python -m examples.minilm --port 8000
"""

from __future__ import annotations

import logging
import math
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator

import anyio
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from examples.minilm.batching import MicroBatcher, Overloaded
from examples.minilm.front import Front
from examples.minilm.lifecycle import DrainingServer, ServiceState
from examples.minilm.model import MiniLMEncoder
from examples.minilm.openai_api import (MODEL_ALIASES, MODEL_NAME, PRIORITY_HEADER, PRIORITY_RANGE, TIMEOUT_HEADER,
                                        ApiError, encode_row, http_error, model_card, model_not_found,
                                        parse_priority, parse_request, parse_timeout, read_body)
from examples.minilm.service_metrics import BatcherCollector, ObservedEncoder, ServiceMetrics
from scheduler.prometheus import RuntimeCollector

__all__ = ["DEFAULT_QUEUE_FACTOR", "DrainingServer", "MODEL_ALIASES", "MODEL_NAME", "PRIORITY_HEADER",
           "PRIORITY_RANGE", "ServiceState", "TIMEOUT_HEADER", "create_app"]

log = logging.getLogger(__name__)

DEFAULT_QUEUE_FACTOR = 8  # max_queue defaults to this many full runs of texts waiting


def create_app(encoder: MiniLMEncoder, *, window_ms: float = 2.0, max_texts: int | None = None,
               max_body_bytes: int = 1 << 20, max_queue: int | None = None, priority_aging: float | None = 1.0,
               api_key: str | None = None, request_timeout: float | None = None) -> Starlette:
    """The service over an encoder (which it drives while the app runs; do not encode() meanwhile).

    max_texts: most inputs per request (default and at most the encoder's max_batch).
    Texts longer than the encoder's max_seq_length tokens are refused, not truncated.
    max_queue: most texts waiting for the engine; a request past it gets 503
    at once (default DEFAULT_QUEUE_FACTOR * max_batch; 0: no bound).
    priority_aging: seconds of waiting one X-Priority step is worth (None: strict).
    api_key: when set, /v1/* requests need `Authorization: Bearer <api_key>`.
    request_timeout: the deadline in seconds of requests without
    X-Request-Timeout, and the largest one a request may ask for (None: none).

    app.state.service is the ServiceState (begin_drain()), app.state.batcher
    the MicroBatcher and app.state.registry the Prometheus registry.
    """
    limit = encoder.max_batch if max_texts is None else max_texts
    if not 1 <= limit <= encoder.max_batch:
        raise ValueError(f"max_texts must be in [1, {encoder.max_batch}] (the encoder's max_batch), got {max_texts}")
    if max_queue is None:
        max_queue = DEFAULT_QUEUE_FACTOR * encoder.max_batch
    if max_queue < 0:
        raise ValueError(f"max_queue must be >= 0 (0: no bound), got {max_queue}")
    if api_key is not None and not api_key:
        raise ValueError("api_key must not be empty (None: no key)")
    if request_timeout is not None and not 0 < request_timeout < math.inf:
        raise ValueError(f"request_timeout must be a positive number of seconds or None, got {request_timeout}")

    registry = CollectorRegistry()
    metrics = ServiceMetrics(registry, encoder.max_batch)
    batcher = MicroBatcher(ObservedEncoder(encoder, metrics), window_s=window_ms / 1000.0, depth=encoder.runtime.depth,
                           max_queued=max_queue or None, priority_aging=priority_aging)
    registry.register(BatcherCollector(batcher))
    state = ServiceState(batcher)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with encoder.open_async(), anyio.create_task_group() as tg:
            await tg.start(batcher.run)
            art = encoder.async_runtime
            collector = RuntimeCollector(art)
            registry.register(collector)
            state.opened(art)
            try:
                yield
            finally:
                state.closing()
                registry.unregister(collector)
                tg.cancel_scope.cancel()  # the batcher stops; requests still waiting (none, normally) get 503
        state.closed()

    async def embeddings(request: Request) -> Response:
        started = time.monotonic()
        try:
            priority = parse_priority(request.headers.get(PRIORITY_HEADER))
            timeout = parse_timeout(request.headers.get(TIMEOUT_HEADER), request_timeout)
            body = await read_body(request, max_body_bytes)
            texts, encoding = parse_request(body, limit)
            tokens = encoder.tokenize(texts, truncate=False)
            for i, t in enumerate(tokens):
                if len(t) > encoder.max_seq_length:
                    raise ApiError(413, f"input[{i}] has {len(t)} tokens; at most {encoder.max_seq_length} are "
                                        "accepted (longer texts are refused, not truncated)", param="input",
                                   code="context_length_exceeded")
            wait = None if timeout is None else max(0.0, timeout - (time.monotonic() - started))
            try:
                vectors = await batcher.embed(tokens, priority=priority, timeout=wait)
            except Overloaded as e:
                log.debug("refused an embeddings request: %s", e)
                raise ApiError(503, f"The service is overloaded: {e}. Retry after {e.retry_after} s.",
                               type="server_error", code="overloaded",
                               headers={"Retry-After": str(e.retry_after)}) from None
            except TimeoutError:
                raise ApiError(504, f"The request was not dispatched to the engine within its deadline of "
                                    f"{timeout:g} s; nothing of it ran.", type="server_error",
                               code="deadline_exceeded") from None
            except Exception as e:
                if not batcher.running:  # the lifespan is closing the batcher
                    raise ApiError(503, "The service is shutting down.", type="server_error",
                                   code="shutting_down") from None
                log.error("an embeddings request failed: %s", e)  # a failed run: this request's, the service goes on
                raise ApiError(500, f"embedding failed: {e}", type="server_error", code="embedding_failed") from None
        except ApiError as e:
            return e.response()
        n_tokens = sum(len(t) for t in tokens)
        metrics.request_texts.observe(len(texts))
        metrics.tokens.inc(n_tokens)
        data = [{"object": "embedding", "index": i, "embedding": encode_row(row, encoding)}
                for i, row in enumerate(vectors)]
        return JSONResponse({"object": "list", "data": data, "model": MODEL_NAME,
                             "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}})

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [model_card()]})

    async def model(request: Request) -> JSONResponse:
        name = request.path_params["model"]
        if name not in MODEL_ALIASES:
            return model_not_found(name).response()
        return JSONResponse(model_card())

    async def health(request: Request) -> JSONResponse:
        s = batcher.stats
        capture = encoder.runtime.capture_stats()
        return JSONResponse({"status": "ok", "phase": state.phase, "runs": s.runs, "texts": s.texts,
                             "requests": s.requests, "tokens": s.tokens, "padded_tokens": s.padded_tokens,
                             "capture": {k: capture[k] for k in ("hits", "misses", "entries", "evictions")}})

    async def ready(request: Request) -> JSONResponse:
        reason = state.unready_reason()
        if reason is not None:
            return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)
        return JSONResponse({"status": "ready"})

    async def metrics_page(request: Request) -> Response:
        # On the loop thread: the runtime collector reads the AsyncRuntime, which belongs to it.
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    app = Starlette(
        routes=[Route("/v1/embeddings", embeddings, methods=["POST"]),
                Route("/v1/models", models, methods=["GET"]),
                Route("/v1/models/{model:path}", model, methods=["GET"]),
                Route("/health", health, methods=["GET"]),
                Route("/ready", ready, methods=["GET"]),
                Route("/metrics", metrics_page, methods=["GET"])],
        middleware=[Middleware(Front, metrics=metrics, api_key=api_key)],
        exception_handlers={HTTPException: http_error},  # type: ignore[dict-item]
        lifespan=lifespan)
    app.state.batcher = batcher
    app.state.service = state
    app.state.registry = registry
    return app


