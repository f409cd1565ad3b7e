"""The service's life: readiness (ServiceState) and a uvicorn server that drains before it stops.

Shutting down: DrainingServer (what `python -m examples.minilm` runs) turns
SIGTERM into: /ready answers 503, keep serving for shutdown_delay seconds,
stop accepting, finish every accepted request (within uvicorn's
timeout_graceful_shutdown), then the lifespan closes the batcher and the
runtime, and the process exits with status 0.
"""

from __future__ import annotations

import logging
import math
import signal
import time
from types import FrameType
from typing import Any

import uvicorn

from examples.minilm.batching import MicroBatcher

__all__ = ["DrainingServer", "ServiceState"]

log = logging.getLogger("examples.minilm.service")


class ServiceState:
    """Where the service is in its life, for /ready: starting, ready, draining, stopping, stopped.

    begin_drain() is the shutdown signal's hook (DrainingServer calls it):
    from then on /ready answers 503 while the requests already accepted, and
    any that arrive during the shutdown delay, are still served.
    """

    def __init__(self, batcher: MicroBatcher) -> None:
        self.phase = "starting"
        self._batcher = batcher
        self._art: Any = None

    def begin_drain(self) -> None:
        if self.phase in ("starting", "ready"):
            self.phase = "draining"

    def opened(self, art: Any) -> None:
        """The lifespan opened the runtime (art) and started the batcher."""
        self._art = art
        if self.phase == "starting":
            self.phase = "ready"

    def closing(self) -> None:
        """The lifespan shutdown began: uvicorn has finished with the requests."""
        self.phase = "stopping"

    def closed(self) -> None:
        self.phase = "stopped"

    def unready_reason(self) -> str | None:
        """Why the service should not get traffic now (None: it is ready)."""
        if self.phase == "starting":
            return "starting: the engine runtime is not open yet"
        if self.phase == "draining":
            return "draining: shutting down, finishing the requests already accepted"
        if self.phase in ("stopping", "stopped"):
            return "shutting down: the batcher and the engine runtime are closing"
        if self._art is None or self._art.closed:
            return "the engine runtime is closed"
        if not self._batcher.running:
            return "the batcher is not running"
        return None


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a readiness-aware shutdown, and exit status 0 after a graceful one.

    The first SIGTERM or SIGINT calls state.begin_drain() (/ready answers
    503) and keeps serving for shutdown_delay seconds, time for a load
    balancer to take the instance out; then uvicorn's shutdown runs: it stops
    accepting connections, waits for the requests in flight (at most the
    config's timeout_graceful_shutdown, after which it cancels them) and
    only then runs the lifespan shutdown. A second signal ends the delay at
    once; a SIGINT after that forces the exit, as in uvicorn. Unlike
    uvicorn.Server the caught signal is not raised again after the shutdown,
    so a graceful stop exits with status 0.
    """

    def __init__(self, config: uvicorn.Config, *, state: ServiceState, shutdown_delay: float = 0.0) -> None:
        if not 0 <= shutdown_delay < math.inf:
            raise ValueError(f"shutdown_delay must be a finite number of seconds >= 0, got {shutdown_delay}")
        super().__init__(config)
        self.state = state
        self.shutdown_delay = shutdown_delay
        self._stop_at: float | None = None
        self._announced = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler: it only sets flags (on_tick, on the loop, logs and acts).
        if self._stop_at is None and not self.should_exit:
            self.state.begin_drain()
            self._stop_at = time.monotonic() + self.shutdown_delay
            if self.shutdown_delay <= 0:
                self.should_exit = True
        else:
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self._stop_at is not None:
            if not self._announced:
                self._announced = True
                log.info("shutting down: /ready answers 503; accepting connections for %.1f s more, then finishing "
                         "the requests in flight", max(0.0, self._stop_at - time.monotonic()))
            if time.monotonic() >= self._stop_at:
                self.should_exit = True
        return await super().on_tick(counter)
