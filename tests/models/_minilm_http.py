"""Helpers of the MiniLM service tests: the app on uvicorn in a thread over loopback, a gate that holds
engine runs, and a metrics scrape parsed into samples."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import anyio
import httpx
import numpy as np
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from examples.minilm.service import DrainingServer

STARTUP_S = 60.0  # generous bound for a server to come up or stop (not a performance figure)


@dataclass
class Served:
    url: str
    server: DrainingServer
    thread: threading.Thread
    app: Any

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(STARTUP_S)
        assert not self.thread.is_alive(), "the server did not stop"


@contextmanager
def serve(app: Any, *, graceful_timeout: float | None = None, shutdown_delay: float = 0.0) -> Iterator[Served]:
    """The app on uvicorn (its lifespan on) in a daemon thread on a free loopback port; stopped on exit.

    Logging is left to the test process (log_config=None): uvicorn's records reach pytest's caplog.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))  # a free port, held until uvicorn takes the socket
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_config=None, lifespan="on",
                            timeout_graceful_shutdown=graceful_timeout)  # type: ignore[arg-type]  # float s work
    server = DrainingServer(config, state=app.state.service, shutdown_delay=shutdown_delay)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    served = Served(f"http://127.0.0.1:{port}", server, thread, app)
    try:
        deadline = time.monotonic() + STARTUP_S
        while not server.started:
            assert thread.is_alive(), "the server exited during startup"
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)
        yield served
    finally:
        if thread.is_alive():
            served.stop()
        sock.close()


def wait_for(condition: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def scrape(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """/metrics as {(sample name, labels): value}."""
    r = httpx.get(f"{url}/metrics", timeout=60)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain; version="), r.headers
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def sample(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


class RunGate:
    """Holds the engine runs the service dispatches until released, and records every dispatch.

    Each run really executes on the engine; only its completion is held back
    from the batcher, which keeps its pipeline slot meanwhile, exactly as a
    long run would. Install with monkeypatch (the batcher looks dispatch up on
    every run): monkeypatch.setattr(encoder, "dispatch", gate.dispatch).
    """

    def __init__(self, encoder: Any) -> None:
        self._real = encoder.dispatch
        self._open = threading.Event()
        self.dispatched: list[list[np.ndarray]] = []  # each run's token lists, in dispatch order
        self.delivering = 0  # runs dispatched through the gate whose outcome the batcher has not had yet

    async def dispatch(self, token_lists: Any) -> Any:
        fut = await self._real(token_lists)
        self.dispatched.append([np.asarray(t) for t in token_lists])
        self.delivering += 1
        return _Held(fut, self)

    def release(self) -> None:
        self._open.set()

    def runs_with(self, tokens: np.ndarray) -> list[int]:
        """The numbers of the dispatched runs that carried this token sequence."""
        return [i for i, run in enumerate(self.dispatched) if any(np.array_equal(t, tokens) for t in run)]


class _Held:
    def __init__(self, fut: Any, gate: RunGate) -> None:
        self._fut = fut
        self._gate = gate

    def __await__(self) -> Any:
        return self._wait().__await__()

    async def _wait(self) -> Any:
        try:
            while not self._gate._open.is_set():
                await anyio.sleep(0.002)
            return await self._fut
        finally:
            self._gate.delivering -= 1
