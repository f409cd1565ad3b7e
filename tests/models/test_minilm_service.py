"""The MiniLM embedding service over HTTP (uvicorn on loopback in a thread, httpx as the client):
/v1/embeddings against the encoder's own vectors, every refusal's status and OpenAI-shaped body,
the API key, /health, /ready and /metrics."""

from __future__ import annotations

import base64
import json
import logging

import numpy as np
import pytest

import engine

for _module in ("starlette", "uvicorn", "httpx", "tokenizers", "prometheus_client"):
    pytest.importorskip(_module, reason="needs the models and test extras: pip install '.[models,test]'")

import httpx  # noqa: E402

from examples.minilm.service import create_app  # noqa: E402

from ._minilm_http import sample, scrape, serve  # noqa: E402
from .conftest import MAX_ABS_DIFF, MIN_COSINE, cosine  # noqa: E402

MAX_BODY = 64 * 1024
MAX_TEXTS = 8
API_KEY = "tk-test-6f1d0c3b9a7e4f25"  # a string that must never show in logs, metrics or answers
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MODEL = "all-MiniLM-L6-v2"

REFERENCE_TEXTS = ["Hello, world!", "中文 🙂", "", "A pipelined engine overlaps host and device work."]


@pytest.fixture(scope="module")
def expected(minilm_encoder):
    """The sync API's vectors and token counts for REFERENCE_TEXTS, before the server drives the encoder."""
    return minilm_encoder.encode(REFERENCE_TEXTS), [len(t) for t in minilm_encoder.tokenize(REFERENCE_TEXTS)]


@pytest.fixture(scope="module")
def app(minilm_encoder, expected):
    return create_app(minilm_encoder, max_texts=MAX_TEXTS, max_body_bytes=MAX_BODY, api_key=API_KEY)


@pytest.fixture(scope="module")
def service(app):
    with serve(app) as served:
        yield served.url


def post(url: str, body: bytes | str | dict, headers: dict[str, str] | None = None) -> httpx.Response:
    content = json.dumps(body) if isinstance(body, dict) else body
    return httpx.post(f"{url}/v1/embeddings", content=content,
                      headers={"content-type": "application/json", **AUTH, **(headers or {})}, timeout=60)


def embed(url: str, texts: list[str] | str, **fields) -> httpx.Response:
    return post(url, {"model": MODEL, "input": texts, **fields})


def rows(response: httpx.Response) -> np.ndarray:
    data = response.json()["data"]
    assert [d["index"] for d in data] == list(range(len(data)))
    assert all(d["object"] == "embedding" for d in data)
    return np.asarray([d["embedding"] for d in data], np.float32)


def assert_close(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape
    assert cosine(got, want).min() >= MIN_COSINE
    assert np.abs(got - want).max() <= MAX_ABS_DIFF


def assert_error(r: httpx.Response, status: int, code: str | None, message: str = "", param: str | None = None,
                 type: str = "invalid_request_error") -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["type"] == type and error["code"] == code, error
    assert message in error["message"], error
    if param is not None:
        assert error["param"] == param, error
    return error


def test_embeddings_are_the_encoders_vectors_with_real_token_counts(service, expected):
    vectors, tokens = expected
    r = embed(service, REFERENCE_TEXTS)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == MODEL
    assert body["usage"] == {"prompt_tokens": sum(tokens), "total_tokens": sum(tokens)}  # [CLS] and [SEP] included
    assert_close(rows(r), vectors)
    assert rows(r).shape == (len(REFERENCE_TEXTS), 384)


def test_base64_is_the_little_endian_float32_bytes_of_the_same_vectors(service, expected):
    r = embed(service, REFERENCE_TEXTS, encoding_format="base64")
    assert r.status_code == 200, r.text
    encoded = [d["embedding"] for d in r.json()["data"]]
    assert all(isinstance(e, str) for e in encoded)
    got = np.stack([np.frombuffer(base64.b64decode(e), dtype="<f4") for e in encoded])
    assert_close(got, expected[0])
    floats = rows(embed(service, REFERENCE_TEXTS, encoding_format="float"))
    assert np.array_equal(got, floats)  # the same float32 values either way


def test_a_single_string_the_alias_dimensions_384_and_user(service, expected):
    r = post(service, {"model": "sentence-transformers/all-MiniLM-L6-v2", "input": REFERENCE_TEXTS[0],
                       "dimensions": 384, "user": "someone"})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == MODEL  # the served name, whichever alias was asked for
    assert r.json()["usage"]["prompt_tokens"] == expected[1][0]
    assert_close(rows(r), expected[0][:1])


def test_models(service):
    listed = httpx.get(f"{service}/v1/models", headers=AUTH, timeout=60).json()
    assert listed["object"] == "list" and [m["id"] for m in listed["data"]] == [MODEL]
    for name in (MODEL, "sentence-transformers/all-MiniLM-L6-v2"):
        card = httpx.get(f"{service}/v1/models/{name}", headers=AUTH, timeout=60)
        assert card.status_code == 200 and card.json()["id"] == MODEL
    assert_error(httpx.get(f"{service}/v1/models/gpt-4", headers=AUTH, timeout=60), 404, "model_not_found", "gpt-4")


def _body(**fields) -> str:
    return json.dumps({"model": MODEL, "input": ["ok"], **fields})


BAD_REQUESTS = [  # (body, headers, status, code, param, message)
    ('{"input": ["unterminated', {}, 400, "invalid_json", None, "could not parse the JSON body"),
    (b"\xff\xfe not utf-8", {}, 400, "invalid_json", None, "could not parse the JSON body"),
    ('["a list"]', {}, 400, "invalid_json", None, "must be a JSON object, got an array"),
    (_body(texts=["x"]), {}, 400, "unknown_parameter", "texts", "Unrecognized request argument supplied: texts"),
    ('{"input": ["x"]}', {}, 400, "missing_parameter", "model", "you must provide a model parameter"),
    ('{"model": 3, "input": ["x"]}', {}, 422, "invalid_type", "model", "model must be a string, got a number"),
    (_body(model="text-embedding-3-small"), {}, 404, "model_not_found", "model",
     "The model `text-embedding-3-small` does not exist"),
    (json.dumps({"model": MODEL}), {}, 400, "missing_parameter", "input", "you must provide an input parameter"),
    (_body(input=42), {}, 422, "invalid_type", "input", "input must be a string or an array of strings"),
    (_body(input={"text": "x"}), {}, 422, "invalid_type", "input", "got an object"),
    (_body(input=["ok", None]), {}, 422, "invalid_type", "input", "input[1] must be a string, got null"),
    (_body(input=["ok", 3]), {}, 422, "invalid_type", "input", "input[1] must be a string, got a number"),
    (_body(input=[101, 7592, 102]), {}, 400, "unsupported_input", "input", "token-id input is not supported"),
    (_body(input=[[101, 102], [7592]]), {}, 400, "unsupported_input", "input", "token-id input is not supported"),
    (_body(input=[]), {}, 400, "invalid_value", "input", "must not be an empty array"),
    (_body(input=["t"] * (MAX_TEXTS + 1)), {}, 413, "too_many_inputs", "input",
     f"{MAX_TEXTS + 1} inputs in one request; at most {MAX_TEXTS}"),
    (_body(input=["fine", "word " * 300]), {}, 413, "context_length_exceeded", "input",
     "input[1] has 302 tokens; at most 256"),
    (_body(input=["x" * (MAX_BODY + 10)]), {}, 413, "request_too_large", None, f"exceeds the limit of {MAX_BODY}"),
    (_body(encoding_format=3), {}, 422, "invalid_type", "encoding_format", "must be a string"),
    (_body(encoding_format="float16"), {}, 400, "invalid_value", "encoding_format", "'float' or 'base64'"),
    (_body(dimensions="384"), {}, 422, "invalid_type", "dimensions", "must be an integer, got a string"),
    (_body(dimensions=True), {}, 422, "invalid_type", "dimensions", "must be an integer, got a boolean"),
    (_body(dimensions=128), {}, 400, "unsupported_value", "dimensions", "dimensions=128 is not supported"),
    (_body(user=5), {}, 422, "invalid_type", "user", "user must be a string"),
    (_body(), {"X-Priority": "high"}, 400, "invalid_header", None, "X-Priority header must be an integer"),
    (_body(), {"X-Priority": "2.5"}, 400, "invalid_header", None, "X-Priority header must be an integer"),
    (_body(), {"X-Priority": "101"}, 400, "invalid_header", None, "in [-100, 100], got '101'"),
    (_body(), {"X-Request-Timeout": "soon"}, 400, "invalid_header", None, "X-Request-Timeout header must be"),
    (_body(), {"X-Request-Timeout": "0"}, 400, "invalid_header", None, "a positive number of seconds"),
    (_body(), {"X-Request-Timeout": "-1"}, 400, "invalid_header", None, "a positive number of seconds"),
    (_body(), {"X-Request-Timeout": "inf"}, 400, "invalid_header", None, "a positive number of seconds"),
    (_body(), {"X-Request-Timeout": "nan"}, 400, "invalid_header", None, "a positive number of seconds"),
]


@pytest.mark.parametrize("body,headers,status,code,param,message", BAD_REQUESTS,
                         ids=[f"{s}-{c}-{i}" for i, (_, _, s, c, _, _) in enumerate(BAD_REQUESTS)])
def test_a_bad_request_gets_its_status_in_openais_error_shape_and_nothing_else_changes(
        app, service, body, headers, status, code, param, message):
    before = app.state.batcher.stats.requests
    assert_error(post(service, body, headers), status, code, message, param)
    assert app.state.batcher.stats.requests == before  # refused before reaching the batcher
    ok = embed(service, ["still serving"])
    assert ok.status_code == 200 and len(ok.json()["data"]) == 1


def test_headers_in_range_are_accepted(service):
    for headers in ({"X-Priority": "-100", "X-Request-Timeout": "30"},
                    {"X-Priority": "100", "X-Request-Timeout": "2.5"}):
        r = post(service, _body(), headers)
        assert r.status_code == 200, r.text


def test_wrong_method_and_unknown_path_in_openais_error_shape(service):
    r = httpx.get(f"{service}/v1/embeddings", headers=AUTH, timeout=60)
    assert_error(r, 405, None, "Method not allowed (GET /v1/embeddings)")
    assert "POST" in r.headers["allow"]
    assert_error(httpx.post(f"{service}/v1/nothing", headers=AUTH, content=b"{}", timeout=60), 404, None,
                 "Invalid URL (POST /v1/nothing)")
    assert_error(httpx.get(f"{service}/nothing", timeout=60), 404, None, "Invalid URL (GET /nothing)")


def test_a_chunked_body_past_the_limit_is_refused_while_streaming(service):
    chunks = (b'{"model": "all-MiniLM-L6-v2", "input": ["' + b"y" * (MAX_BODY // 2), b"y" * MAX_BODY, b'"]}')
    r = httpx.post(f"{service}/v1/embeddings", content=iter(chunks), headers=AUTH, timeout=60)  # chunked
    assert_error(r, 413, "request_too_large", "exceeds the limit")
    assert embed(service, ["still serving"]).status_code == 200


def test_the_api_key_guards_v1_and_never_shows(service, caplog):
    caplog.set_level(logging.DEBUG)  # every record of the server thread too: uvicorn's access log, the service's
    body = _body()
    missing = httpx.post(f"{service}/v1/embeddings", content=body, timeout=60)
    assert_error(missing, 401, "invalid_api_key", "You didn't provide an API key")
    assert missing.headers["www-authenticate"] == "Bearer"
    wrong_token = "tk-wrong-0123456789"
    for headers in ({"Authorization": f"Bearer {wrong_token}"}, {"Authorization": f"Basic {API_KEY}"},
                    {"Authorization": f"Bearer {API_KEY}x"}, {"Authorization": f"Bearer {API_KEY[:-1]}"},
                    {"Authorization": API_KEY}):
        r = httpx.post(f"{service}/v1/embeddings", content=body, headers=headers, timeout=60)
        assert_error(r, 401, "invalid_api_key", "Incorrect API key provided.")
        assert wrong_token not in r.text and API_KEY not in r.text
    for path in ("/v1/models", "/v1/nothing"):  # the key is checked before the route: unknown paths too
        assert_error(httpx.get(f"{service}{path}", timeout=60), 401, "invalid_api_key")
    assert httpx.post(f"{service}/v1/embeddings", content=body, headers={"authorization": f"bearer {API_KEY}"},
                      timeout=60).status_code == 200  # the scheme is case-insensitive
    for path in ("/health", "/ready", "/metrics"):  # open without the key
        assert httpx.get(f"{service}{path}", timeout=60).status_code == 200
    metrics_text = httpx.get(f"{service}/metrics", timeout=60).text
    assert 'status="401"' in metrics_text
    assert API_KEY not in metrics_text and wrong_token not in metrics_text
    assert any(r.name == "uvicorn.access" for r in caplog.records), "the server's log was not captured"
    assert API_KEY not in caplog.text and wrong_token not in caplog.text


def test_health_and_ready(app, service, minilm_encoder):
    health = httpx.get(f"{service}/health", timeout=60)
    assert health.status_code == 200 and health.json()["status"] == "ok" and health.json()["phase"] == "ready"
    body = health.json()
    assert {"runs", "texts", "requests", "tokens", "padded_tokens"} <= set(body)
    assert body["padded_tokens"] >= body["tokens"] >= body["texts"]
    assert set(body["capture"]) == {"hits", "misses", "entries", "evictions"}
    for texts in (["a question about capture"], ["a question about capture"]):  # the same shape twice
        assert post(service, {"model": MODEL, "input": texts}).status_code == 200
    after = httpx.get(f"{service}/health", timeout=60).json()
    runs = after["runs"] - body["runs"]
    assert runs == 2 and after["tokens"] - body["tokens"] == 2 * len(minilm_encoder.tokenize(texts)[0])
    hits, misses = (after["capture"][k] - body["capture"][k] for k in ("hits", "misses"))
    assert hits + misses == runs and hits >= 1  # each run recorded or replayed; the second replayed
    ready = httpx.get(f"{service}/ready", timeout=60)
    assert ready.status_code == 200 and ready.json() == {"status": "ready"}


def test_metrics_count_the_requests_made(app, service):
    texts = [["one"], ["two", "three"], ["four", "five", "six"]]
    batcher = app.state.batcher
    runs_before = batcher.stats.runs
    before = scrape(service)
    usage = 0
    for t in texts:
        r = embed(service, t)
        assert r.status_code == 200, r.text
        usage += r.json()["usage"]["prompt_tokens"]
    assert_error(embed(service, ["ok", 3]), 422, "invalid_type")
    after = scrape(service)
    runs = batcher.stats.runs - runs_before

    def delta(name: str, **labels: str) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)

    route = {"route": "/v1/embeddings", "method": "POST"}
    assert delta("minilm_http_requests_total", status="200", **route) == len(texts)
    assert delta("minilm_http_requests_total", status="422", **route) == 1
    assert delta("minilm_http_requests_total", route="/metrics", method="GET", status="200") == 1  # the first scrape
    assert delta("minilm_http_request_duration_seconds_count", route="/v1/embeddings") == len(texts) + 1
    assert delta("minilm_http_request_duration_seconds_sum", route="/v1/embeddings") > 0
    assert sample(after, "minilm_http_requests_in_progress", route="/v1/embeddings") == 0
    assert sample(after, "minilm_http_requests_in_progress", route="/metrics") == 1  # the scrape itself
    n_texts = sum(len(t) for t in texts)
    assert delta("minilm_request_texts_count") == len(texts) and delta("minilm_request_texts_sum") == n_texts
    assert delta("minilm_request_texts_bucket", le="2.0") == 2  # requests of at most 2 texts
    assert delta("minilm_tokens_total") == usage
    assert delta("minilm_batcher_requests_total") == len(texts) and delta("minilm_batcher_texts_total") == n_texts
    assert delta("minilm_batcher_runs_total") == runs and delta("minilm_run_texts_count") == runs
    assert delta("minilm_run_texts_sum") == n_texts
    assert sample(after, "minilm_queued_texts") == 0 and sample(after, "minilm_queued_requests") == 0
    assert ("minilm_requests_rejected_total", frozenset()) in after
    assert ("minilm_requests_timed_out_total", frozenset()) in after
    # The runtime's own metrics, from scheduler.prometheus.RuntimeCollector: one engine run per batcher run.
    assert delta("tandem_runs_dispatched_total") == runs
    assert delta("tandem_runs_completed_total") == runs
    assert delta("tandem_run_latency_seconds_count") == runs
    assert sample(after, "tandem_pipeline_depth") == 2
    assert sample(after, "tandem_runs_in_flight") == 0


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
def test_an_encoder_failure_is_a_500_for_its_request_and_the_service_keeps_serving(app, service, minilm_encoder,
                                                                                    monkeypatch, fail):
    before = app.state.batcher.stats.requests
    broken = _refused_dispatch if fail == "dispatch" else _failing_run(minilm_encoder.dispatch)
    monkeypatch.setattr(minilm_encoder, "dispatch", broken)  # the batcher looks it up per run
    expected_message = "the device is on fire" if fail == "dispatch" else "(kernel 'matmul') failed"
    error = assert_error(embed(service, ["this one fails"]), 500, "embedding_failed", expected_message,
                         type="server_error")
    assert error["message"].startswith("embedding failed: ")
    monkeypatch.undo()
    ok = embed(service, ["still serving"])
    assert ok.status_code == 200 and len(ok.json()["data"]) == 1
    assert app.state.batcher.stats.requests - before == (1 if fail == "dispatch" else 2)  # a refused run counts none
    assert httpx.get(f"{service}/ready", timeout=60).status_code == 200
