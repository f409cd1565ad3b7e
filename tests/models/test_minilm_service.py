"""The MiniLM embedding service over HTTP: uvicorn on 127.0.0.1 in a thread, httpx as the client;
and `python -m examples.minilm` as a process of its own."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import anyio
import numpy as np
import pytest

import engine

for _module in ("starlette", "uvicorn", "httpx", "tokenizers"):
    pytest.importorskip(_module, reason="needs the models extra: pip install '.[models]'")

import httpx  # noqa: E402
import uvicorn  # noqa: E402

from examples.minilm.service import create_app  # noqa: E402

from .conftest import MIN_COSINE, cosine  # noqa: E402

# A wide window: concurrent requests in these tests certainly meet in one run.
WINDOW_MS = 100.0
MAX_BODY = 64 * 1024
STARTUP_S = 60.0  # generous bound for the server to come up (not a performance figure)


REFERENCE_TEXTS = ["Hello, world!", "中文 🙂", "", "A pipelined engine overlaps host and device work."]


@pytest.fixture(scope="module")
def expected(minilm_encoder):
    """The sync API's vectors for REFERENCE_TEXTS, computed before the server drives the encoder."""
    return minilm_encoder.encode(REFERENCE_TEXTS)


@pytest.fixture(scope="module")
def service(minilm_encoder, expected):
    """The service's base URL; the server runs for the module and is stopped after it."""
    app = create_app(minilm_encoder, window_ms=WINDOW_MS, max_texts=8, max_body_bytes=MAX_BODY)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))  # a free port, held until uvicorn takes the socket
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + STARTUP_S
    while not server.started:
        assert thread.is_alive(), "the server exited during startup"
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(STARTUP_S)
        sock.close()
        assert not thread.is_alive(), "the server did not stop"


def post(url: str, body: bytes | str, **kw) -> httpx.Response:
    return httpx.post(f"{url}/embed", content=body, headers={"content-type": "application/json"}, timeout=60, **kw)


def test_embed_returns_the_encoders_vectors(service, expected):
    r = post(service, json.dumps({"texts": REFERENCE_TEXTS}))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["dim"] == 384 and body["model"] == "all-MiniLM-L6-v2"
    got = np.asarray(body["embeddings"], np.float32)
    assert got.shape == (len(REFERENCE_TEXTS), 384)
    assert cosine(got, expected).min() >= MIN_COSINE
    bare_list = np.asarray(post(service, json.dumps(REFERENCE_TEXTS[:2])).json()["embeddings"], np.float32)
    assert cosine(bare_list, expected[:2]).min() >= MIN_COSINE


def test_empty_list_gives_no_vectors(service):
    r = post(service, '{"texts": []}')
    assert r.status_code == 200 and r.json()["embeddings"] == []


@pytest.mark.anyio
async def test_concurrent_requests_share_runs_and_each_gets_its_own_rows(service):
    texts = [[f"request {i} says hello", "the same second text", "🙂" * (i + 1)][: 1 + i % 3] for i in range(10)]
    async with httpx.AsyncClient(base_url=service, timeout=60) as client:
        before = (await client.get("/health")).json()
        answers: dict[int, np.ndarray] = {}

        async def one(i: int) -> None:
            r = await client.post("/embed", json={"texts": texts[i]})
            assert r.status_code == 200, r.text
            answers[i] = np.asarray(r.json()["embeddings"], np.float32)

        async with anyio.create_task_group() as tg:
            for i in range(len(texts)):
                tg.start_soon(one, i)
        after = (await client.get("/health")).json()
        singles = {}
        for i in (0, 4, 9):  # one at a time: nothing to share a run with
            r = await client.post("/embed", json={"texts": texts[i]})
            singles[i] = np.asarray(r.json()["embeddings"], np.float32)
    assert after["requests"] - before["requests"] == len(texts)
    assert after["texts"] - before["texts"] == sum(len(t) for t in texts)
    assert after["runs"] - before["runs"] < len(texts)  # micro-batched
    for i, rows in singles.items():
        assert answers[i].shape == (len(texts[i]), 384)
        assert cosine(answers[i], rows).min() >= MIN_COSINE  # its own rows, not a neighbour's


BAD_REQUESTS = [
    ('{"texts": ["unterminated', 400, "malformed JSON"),
    (b"\xff\xfe not utf-8", 400, "malformed JSON"),
    ('{"texts": "one string"}', 422, "must be a list of strings, got a string"),
    ('{"texts": ["ok", 3]}', 422, "texts[1] must be a string, got a number"),
    ('{"texts": [null]}', 422, "texts[0] must be a string, got null"),
    ('{"sentences": ["x"]}', 422, "missing field 'texts'"),
    ('{"texts": ["x"], "extra": 1}', 422, "unexpected fields ['extra']"),
    ("42", 422, "got a number"),
    (json.dumps({"texts": ["t"] * 9}), 413, "9 texts in one request; at most 8"),
    (json.dumps({"texts": ["fine", "word " * 300]}), 413, "texts[1] has 302 tokens; at most 256"),
    (json.dumps({"texts": ["x" * (MAX_BODY + 10)]}), 413, f"exceeds the limit of {MAX_BODY} bytes"),
]


@pytest.mark.parametrize("body,status,message", BAD_REQUESTS, ids=[f"{s}-{m[:24]}" for _, s, m in BAD_REQUESTS])
def test_bad_requests_get_a_clear_4xx_and_the_service_keeps_serving(service, body, status, message):
    r = post(service, body)
    assert r.status_code == status, r.text
    assert message in r.json()["error"]
    ok = post(service, '{"texts": ["still serving"]}')
    assert ok.status_code == 200 and len(ok.json()["embeddings"]) == 1


def test_wrong_method_and_path(service):
    assert httpx.get(f"{service}/embed", timeout=60).status_code == 405
    assert httpx.post(f"{service}/nothing", content=b"{}", timeout=60).status_code == 404
    assert httpx.get(f"{service}/health", timeout=60).json()["status"] == "ok"


def test_a_chunked_body_past_the_limit_is_refused_while_streaming(service):
    chunks = (b'{"texts": ["' + b"y" * (MAX_BODY // 2), b"y" * MAX_BODY, b'"]}')
    r = httpx.post(f"{service}/embed", content=iter(chunks), timeout=60)  # no content-length: chunked
    assert r.status_code == 413 and "exceeds the limit" in r.json()["error"]
    assert post(service, '{"texts": ["still serving"]}').status_code == 200


async def _refused_dispatch(token_lists):
    raise RuntimeError("the device is on fire")


class _RunThatFails:
    """A real run's future whose outcome is a kernel's failure, as a failing kernel's would be."""

    def __init__(self, fut) -> None:
        self._fut = fut

    def __await__(self):
        yield from self._fut.__await__()  # the run really executes on the engine ...
        raise engine.KernelError(self._fut.run_id, 0, "matmul", "the kernel blew up")  # ... and fails


def _failing_run(real_dispatch):
    async def dispatch(token_lists):
        return _RunThatFails(await real_dispatch(token_lists))

    return dispatch


@pytest.mark.parametrize("fail", ["dispatch", "run"])
def test_an_encoder_failure_is_a_500_for_its_request_and_the_service_keeps_serving(service, minilm_encoder,
                                                                                    monkeypatch, fail):
    before = httpx.get(f"{service}/health", timeout=60).json()
    broken = _refused_dispatch if fail == "dispatch" else _failing_run(minilm_encoder.dispatch)
    monkeypatch.setattr(minilm_encoder, "dispatch", broken)  # the batcher looks it up per run
    r = post(service, '{"texts": ["this one fails"]}')
    assert r.status_code == 500, r.text
    expected_message = "the device is on fire" if fail == "dispatch" else "(kernel 'matmul') failed"
    assert r.json()["error"].startswith("embedding failed: ") and expected_message in r.json()["error"]
    monkeypatch.undo()
    ok = post(service, '{"texts": ["still serving"]}')
    assert ok.status_code == 200 and len(ok.json()["embeddings"]) == 1
    after = httpx.get(f"{service}/health", timeout=60).json()
    assert after["requests"] - before["requests"] == (1 if fail == "dispatch" else 2)  # a refused run counts none


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_python_dash_m_serves_and_exits_cleanly_on_sigterm(expected):
    port = _free_port()
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(
        [sys.executable, "-m", "examples.minilm", "--port", str(port), "--workers", "1", "--max-batch", "8"],
        cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_S
        while True:
            assert proc.poll() is None, f"the service exited during startup:\n{proc.stdout.read()}"
            assert time.monotonic() < deadline, "the service did not start serving"
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:  # not listening yet
                time.sleep(0.1)
        r = post(url, json.dumps({"texts": REFERENCE_TEXTS}))
        assert r.status_code == 200, r.text
        got = np.asarray(r.json()["embeddings"], np.float32)
        assert got.shape == (len(REFERENCE_TEXTS), 384)
        assert cosine(got, expected).min() >= MIN_COSINE
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=STARTUP_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    # Graceful: the lifespan closed the encoder and uvicorn finished. uvicorn (0.29 on) then
    # re-raises the signal it caught, so the status is SIGTERM's, as for any program SIGTERM ends.
    assert proc.returncode in (0, -signal.SIGTERM), out
    assert "Application shutdown complete" in out and "Finished server process" in out, out
    assert "Traceback" not in out and "ERROR" not in out, out
