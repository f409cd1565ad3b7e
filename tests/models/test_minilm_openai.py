"""The official openai client against the MiniLM service's /v1 (uvicorn on loopback in a thread)."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

for _module in ("starlette", "uvicorn", "httpx", "tokenizers", "prometheus_client", "openai"):
    pytest.importorskip(_module, reason="needs the models and test extras: pip install '.[models,test]'")

import openai  # noqa: E402

from examples.minilm.service import create_app  # noqa: E402

from ._minilm_http import serve  # noqa: E402
from .conftest import MAX_ABS_DIFF, MIN_COSINE, cosine  # noqa: E402

API_KEY = "tk-openai-test-key"
MODEL = "all-MiniLM-L6-v2"
TEXTS = ["The quick brown fox jumps over the lazy dog.", "中文 🙂", "", "Embeddings from an OpenAI client."]


@pytest.fixture(scope="module")
def expected(minilm_encoder):
    return minilm_encoder.encode(TEXTS), sum(len(t) for t in minilm_encoder.tokenize(TEXTS))


@pytest.fixture(scope="module")
def url(minilm_encoder, expected):
    with serve(create_app(minilm_encoder, api_key=API_KEY)) as served:
        yield served.url


@pytest.fixture(scope="module")
def client(url):
    # No retries: a refusal must surface as the error it is (the client retries 5xx and 429 by default).
    with openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=60) as c:
        yield c


def assert_close(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape
    assert cosine(got, want).min() >= MIN_COSINE
    assert np.abs(got - want).max() <= MAX_ABS_DIFF


def test_float(client, expected):
    r = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert r.model == MODEL and r.object == "list"
    assert [d.index for d in r.data] == list(range(len(TEXTS)))
    assert_close(np.asarray([d.embedding for d in r.data], np.float32), expected[0])
    assert r.usage.prompt_tokens == r.usage.total_tokens == expected[1]


def test_base64_asked_for_is_returned_as_is(client, expected):
    r = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="base64")
    encoded = [d.embedding for d in r.data]
    assert all(isinstance(e, str) for e in encoded)  # the client leaves an explicit format alone
    assert_close(np.stack([np.frombuffer(base64.b64decode(e), "<f4") for e in encoded]), expected[0])


def test_the_default_is_base64_on_the_wire_decoded_by_the_client(client, expected):
    raw = client.embeddings.with_raw_response.create(model=MODEL, input=TEXTS)
    sent = json.loads(raw.http_request.content)
    assert sent["encoding_format"] == "base64"  # what the client asks for when the caller did not choose
    r = raw.parse()
    assert all(isinstance(d.embedding, list) for d in r.data)  # decoded back to floats (numpy's frombuffer)
    assert_close(np.asarray([d.embedding for d in r.data], np.float32), expected[0])


def test_one_string_and_the_alias(client, expected):
    r = client.embeddings.create(model="sentence-transformers/all-MiniLM-L6-v2", input=TEXTS[0],
                                 encoding_format="float", dimensions=384, user="u-1")
    assert len(r.data) == 1 and r.model == MODEL
    assert_close(np.asarray([r.data[0].embedding], np.float32), expected[0][:1])


def test_models(client):
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_errors_map_to_the_clients_exceptions(client, url):
    with pytest.raises(openai.NotFoundError) as e:
        client.embeddings.create(model="text-embedding-3-small", input=["x"])
    assert e.value.status_code == 404 and e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=MODEL, input=["x"], dimensions=256)
    assert e.value.code == "unsupported_value" and e.value.param == "dimensions"
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=MODEL, input=[[101, 7592, 102]])
    assert e.value.code == "unsupported_input"
    with pytest.raises(openai.UnprocessableEntityError) as e:
        client.embeddings.create(model=MODEL, input=["x", None])  # type: ignore[list-item]
    assert e.value.code == "invalid_type"
    with openai.OpenAI(base_url=f"{url}/v1", api_key="tk-not-the-key", max_retries=0) as stranger:
        with pytest.raises(openai.AuthenticationError) as e:
            stranger.embeddings.create(model=MODEL, input=["x"])
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    assert "tk-not-the-key" not in str(e.value) and API_KEY not in str(e.value)


@pytest.mark.anyio
async def test_the_async_client_concurrently(url, expected):
    import anyio

    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=60) as c:
        got: dict[int, np.ndarray] = {}

        async def one(i: int) -> None:
            r = await c.embeddings.create(model=MODEL, input=[TEXTS[i]])
            got[i] = np.asarray(r.data[0].embedding, np.float32)

        async with anyio.create_task_group() as tg:
            for i in range(len(TEXTS)):
                tg.start_soon(one, i)
    assert_close(np.stack([got[i] for i in range(len(TEXTS))]), expected[0])
