"""The MiniLM service under load, made deterministic by holding engine runs (tests/models/_minilm_http.RunGate):
a full queue is a 503 with Retry-After at once, a missed deadline a 504 with nothing run, X-Priority orders
the dispatches, and concurrent requests share runs yet each gets its own rows."""

from __future__ import annotations

import time

import anyio
import numpy as np
import pytest

for _module in ("starlette", "uvicorn", "httpx", "tokenizers", "prometheus_client"):
    pytest.importorskip(_module, reason="needs the models and test extras: pip install '.[models,test]'")

import httpx  # noqa: E402

from examples.minilm.service import create_app  # noqa: E402

from ._minilm_http import RunGate, sample, scrape, serve, wait_for  # noqa: E402
from .conftest import MAX_ABS_DIFF, MIN_COSINE, cosine  # noqa: E402

pytestmark = pytest.mark.anyio
MODEL = "all-MiniLM-L6-v2"
MAX_QUEUE = 64  # two full runs of texts (max_batch 32)

SHARED = [[f"request {i} says hello", "the same second text", "🙂" * (i + 1)][: 1 + i % 3] for i in range(10)]


@pytest.fixture
def anyio_backend():
    return "asyncio"  # the client's loop; the server runs its own in a thread


@pytest.fixture(scope="module")
def expected(minilm_encoder):
    flat = minilm_encoder.encode([t for texts in SHARED for t in texts])
    out, at = [], 0
    for texts in SHARED:
        out.append(flat[at:at + len(texts)])
        at += len(texts)
    return out


@pytest.fixture(scope="module")
def app(minilm_encoder, expected):
    return create_app(minilm_encoder, window_ms=1.0, max_queue=MAX_QUEUE)


@pytest.fixture(scope="module")
def url(app):
    with serve(app) as served:
        yield served.url


@pytest.fixture
def gate(app, minilm_encoder, monkeypatch):
    g = RunGate(minilm_encoder)
    monkeypatch.setattr(minilm_encoder, "dispatch", g.dispatch)  # the batcher looks dispatch up per run
    yield g
    g.release()  # whatever happened, nothing stays held, and the next test starts from an idle batcher
    wait_for(lambda: app.state.batcher.queued_requests == 0 and g.delivering == 0, "an idle batcher")


async def until(condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await anyio.sleep(0.002)


class Client:
    """Requests in the background of a task group; their responses by name."""

    def __init__(self, http: httpx.AsyncClient, tg) -> None:
        self.http = http
        self.tg = tg
        self.responses: dict[str, httpx.Response] = {}

    async def post(self, texts: list[str], **headers: str) -> httpx.Response:
        return await self.http.post("/v1/embeddings", json={"model": MODEL, "input": texts},
                                    headers={k.replace("_", "-"): v for k, v in headers.items()})

    def start(self, name: str, texts: list[str], **headers: str) -> None:
        async def send() -> None:
            self.responses[name] = await self.post(texts, **headers)

        self.tg.start_soon(send)

    async def hold_both_slots(self, batcher) -> None:
        """Two held runs: the batcher's pipeline (depth 2) is full, later requests wait in its queue."""
        runs = batcher.stats.runs
        for name in ("held-1", "held-2"):
            self.start(name, [f"{name} text"])
            runs += 1
            await until(lambda: batcher.stats.runs == runs, f"the run of {name}")


async def test_past_max_queue_a_request_gets_503_with_retry_after_at_once(app, url, gate):
    batcher = app.state.batcher
    before = scrape(url)
    rejected = batcher.stats.rejected
    async with httpx.AsyncClient(base_url=url, timeout=60) as http, anyio.create_task_group() as tg:
        client = Client(http, tg)
        await client.hold_both_slots(batcher)
        for i in range(MAX_QUEUE // 8):
            client.start(f"queued-{i}", [f"queued {i} text {j}" for j in range(8)])
        await until(lambda: batcher.queued_texts == MAX_QUEUE, "a full queue")
        t0 = time.monotonic()
        refused = await client.post(["one text too many"])
        waited = time.monotonic() - t0
        gate.release()
    assert refused.status_code == 503, refused.text
    assert waited < 5.0  # refused at once, not after the held runs
    error = refused.json()["error"]
    assert error["type"] == "server_error" and error["code"] == "overloaded"
    assert f"at most {MAX_QUEUE}" in error["message"]
    assert int(refused.headers["retry-after"]) >= 1
    assert {n: r.status_code for n, r in client.responses.items()} == {n: 200 for n in client.responses}
    assert len(client.responses) == 2 + MAX_QUEUE // 8
    assert batcher.stats.rejected == rejected + 1
    after = scrape(url)
    assert sample(after, "minilm_requests_rejected_total") - sample(before, "minilm_requests_rejected_total") == 1
    status_503 = {"route": "/v1/embeddings", "method": "POST", "status": "503"}
    assert sample(after, "minilm_http_requests_total", **status_503) \
        - sample(before, "minilm_http_requests_total", **status_503) == 1


async def test_a_request_not_dispatched_before_its_deadline_gets_504_and_nothing_of_it_runs(
        app, url, gate, minilm_encoder):
    batcher = app.state.batcher
    tokens = minilm_encoder.tokenize(["this text misses its deadline"])[0]
    before, stats = scrape(url), (batcher.stats.requests, batcher.stats.texts, batcher.stats.timed_out)
    async with httpx.AsyncClient(base_url=url, timeout=60) as http, anyio.create_task_group() as tg:
        client = Client(http, tg)
        await client.hold_both_slots(batcher)
        t0 = time.monotonic()
        late = await client.post(["this text misses its deadline"], X_Request_Timeout="0.3")
        waited = time.monotonic() - t0
        gate.release()
    assert late.status_code == 504, late.text
    assert 0.3 <= waited < 10.0
    error = late.json()["error"]
    assert error["code"] == "deadline_exceeded" and "nothing of it ran" in error["message"]
    assert all(r.status_code == 200 for r in client.responses.values())
    # The engine never saw it: no run carried its tokens, and only the two held requests were dispatched.
    assert gate.runs_with(tokens) == []
    assert (batcher.stats.requests, batcher.stats.texts, batcher.stats.timed_out) == (
        stats[0] + 2, stats[1] + 2, stats[2] + 1)
    after = scrape(url)

    def delta(name: str, **labels: str) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)

    assert delta("tandem_runs_dispatched_total") == 2
    assert delta("minilm_requests_timed_out_total") == 1
    assert delta("minilm_http_requests_total", route="/v1/embeddings", method="POST", status="504") == 1
    # A deadline met is no refusal.
    assert (await _post_once(url, ["in time"], {"X-Request-Timeout": "30"})).status_code == 200


async def _post_once(url: str, texts: list[str], headers: dict[str, str]) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        return await http.post("/v1/embeddings", json={"model": MODEL, "input": texts}, headers=headers)


async def test_x_priority_orders_the_dispatches(app, url, gate, minilm_encoder):
    batcher = app.state.batcher
    # 20 texts each: no two share a run (max_batch 32), so the runs' order is the dispatch order.
    texts = {name: [f"{name} priority text {i}" for i in range(20)] for name in ("low", "default", "high")}
    first = {name: minilm_encoder.tokenize(t[:1])[0] for name, t in texts.items()}
    async with httpx.AsyncClient(base_url=url, timeout=60) as http, anyio.create_task_group() as tg:
        client = Client(http, tg)
        await client.hold_both_slots(batcher)
        queued = batcher.queued_requests
        for name, priority in (("low", "-5"), ("default", None), ("high", "5")):  # arrival order
            client.start(name, texts[name], **({"X_Priority": priority} if priority else {}))
            queued += 1
            await until(lambda: batcher.queued_requests == queued, f"{name} queued")
        gate.release()
    assert all(r.status_code == 200 for r in client.responses.values())
    runs = {name: gate.runs_with(tokens) for name, tokens in first.items()}
    assert all(len(r) == 1 for r in runs.values()), runs
    # high (priority 5) first; then default (0) before low (-5), which came first but is 5 priority steps behind.
    assert runs["high"][0] < runs["default"][0] < runs["low"][0], runs


async def test_concurrent_requests_share_runs_and_each_gets_its_own_rows(app, url, gate, expected):
    batcher = app.state.batcher
    async with httpx.AsyncClient(base_url=url, timeout=60) as http, anyio.create_task_group() as tg:
        client = Client(http, tg)
        await client.hold_both_slots(batcher)
        runs_before = batcher.stats.runs
        queued = batcher.queued_requests
        for i, texts in enumerate(SHARED):
            client.start(str(i), texts)
        await until(lambda: batcher.queued_requests == queued + len(SHARED), "every request queued")
        gate.release()
    assert batcher.stats.runs - runs_before < len(SHARED)  # micro-batched
    for i, texts in enumerate(SHARED):
        r = client.responses[str(i)]
        assert r.status_code == 200, r.text
        got = np.asarray([d["embedding"] for d in r.json()["data"]], np.float32)
        assert got.shape == (len(texts), 384)
        assert cosine(got, expected[i]).min() >= MIN_COSINE  # its own rows, not a neighbour's
        assert np.abs(got - expected[i]).max() <= MAX_ABS_DIFF
