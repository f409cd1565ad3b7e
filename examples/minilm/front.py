"""The service's front door: the API key on /v1/*, and every request counted and timed.

A pure ASGI middleware (not Starlette's BaseHTTPMiddleware, which would wrap
every response body in another task): it sees each request before routing,
refuses a missing or wrong key with 401 without echoing it, and records the
route, method, status and duration of everything, refusals included.
"""

from __future__ import annotations

import hmac
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from examples.minilm.openai_api import ApiError
from examples.minilm.service_metrics import ServiceMetrics

__all__ = ["Front", "ROUTES", "route_label"]

ROUTES = ("/v1/embeddings", "/v1/models", "/health", "/ready", "/metrics")  # metric labels; anything else: "other"


class Front:
    """Pure ASGI middleware around the routes: checks the API key on /v1/* and counts and times every request."""

    def __init__(self, app: ASGIApp, *, metrics: ServiceMetrics, api_key: str | None) -> None:
        self.app = app
        self.metrics = metrics
        self._key = None if api_key is None else api_key.encode("utf-8")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        route = route_label(path)
        status = 500  # unless a response starts: an exception reaches Starlette's 500 handler
        started = time.perf_counter()

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        in_progress = self.metrics.in_progress.labels(route)
        in_progress.inc()
        try:
            refusal = self._refusal(scope) if path == "/v1" or path.startswith("/v1/") else None
            if refusal is not None:
                await refusal.response()(scope, receive, send_status)
            else:
                await self.app(scope, receive, send_status)
        finally:
            in_progress.dec()
            self.metrics.requests.labels(route, scope["method"], str(status)).inc()
            self.metrics.latency.labels(route).observe(time.perf_counter() - started)

    def _refusal(self, scope: Scope) -> ApiError | None:
        """The 401 of a request without the right key (None: let it through). Never echoes what was sent."""
        if self._key is None:
            return None
        header = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        if header is None:
            message = "You didn't provide an API key: send it as the header 'Authorization: Bearer <key>'."
        else:
            scheme, _, token = header.strip().partition(b" ")
            if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key):
                return None
            message = "Incorrect API key provided."
        return ApiError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def route_label(path: str) -> str:
    if path in ROUTES:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models/{model}"
    return "other"  # a bounded label set, whatever paths clients try
