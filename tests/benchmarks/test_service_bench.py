"""`tandem bench service --quick`: benchmarks/service.py starts each service alone, loads it, and reports.

About 25 s: three services (Tandem at depth 1 and 2, the plain sentence-transformers one) started one
after the other, 16 closed-loop clients and one open-loop rate each for a second. No timing thresholds
(the machine is shared): only that every request succeeded and every figure and ratio is there, finite
and positive. The raw HTTP client is checked against a local server on its own.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
from typing import Any

import pytest

from tests.benchmarks.conftest import ROOT, tandem

sys.path.insert(0, str(ROOT / "benchmarks"))

import _suite  # noqa: E402
import service  # noqa: E402

SERVICES = ["plain", "tandem-d1", "tandem-d2"]  # plain first: its capacity sets the open-loop rates


def finite_positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


@pytest.mark.timeout(300)
def test_bench_service_quick(tmp_path):
    lacking = _suite.missing("service", quick=True)
    if lacking:
        pytest.skip(f"missing {', '.join(lacking)}")
    proc = tandem("bench", "service", "--quick", "--out", str(tmp_path), timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    entry = summary["benchmarks"]["service"]
    assert entry["status"] == "ok", entry
    assert entry["headlines"] and all(finite_positive(v) for v in entry["headlines"].values()), entry["headlines"]
    data = json.loads((tmp_path / "service.json").read_text())
    assert data["benchmark"] == "service" and data["environment"]["cores"] >= 1
    f = data["figures"]
    assert f["services"] == SERVICES
    assert f["commands"]["plain"][:2] == ["python", "benchmarks/_plain_service.py"]
    assert finite_positive(f["capacity_requests_per_s"])
    assert [p["clients"] for p in f["closed"]] == [16] and [p["fraction"] for p in f["open"]] == [0.5]
    for point in f["closed"] + f["open"]:
        assert list(point["results"]) == SERVICES
        for name, r in point["results"].items():
            assert r["errors"] == 0 and r["requests"] > 0, (name, r["error_kinds"] if "error_kinds" in r else r)
            for key in ("requests_per_s", "texts_per_s", "p50_ms", "p99_ms", "service_cores",
                        "client_cpu_us_per_request"):
                assert finite_positive(r[key]), (name, key, r[key])
            assert r["p99_ms"] >= r["p50_ms"]
            if name.startswith("tandem"):
                assert 1 <= r["texts_per_run"] <= 32  # the Tandem service's /health counts its runs
                assert r["padded_over_real_tokens"] >= 1 and 0 <= r["replayed"] <= 1  # and its tokens and replays
    assert f["ratios"] and all(finite_positive(v) for v in f["ratios"].values()), f["ratios"]
    assert "closed loop" in proc.stdout and "open loop" in proc.stdout


def test_the_raw_client_reads_sized_and_chunked_answers():
    async def main() -> list[tuple[int, bytes]]:
        answers = [b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 7\r\n\r\n[1,2,3]",
                   b"HTTP/1.1 503 Service Unavailable\r\nTransfer-Encoding: chunked\r\n\r\n"
                   b"4\r\nbusy\r\n2;x=y\r\n!!\r\n0\r\n\r\n"]

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            for answer in answers:  # one keep-alive connection, two requests
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                writer.write(answer)
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        conn = await service.Connection.open(port)
        body = service.request_body(["a"])
        data = service.http_request("/v1/embeddings", body, f"127.0.0.1:{port}")
        got = [await conn.request(data), await conn.request(data)]
        conn.close()
        server.close()
        await server.wait_closed()
        return got

    assert asyncio.run(main()) == [(200, b"[1,2,3]"), (503, b"busy!!")]


def test_every_service_gets_the_same_requests():
    a, b = service.request_texts(200, seed=3), service.request_texts(200, seed=3)
    assert a == b and a != service.request_texts(200, seed=4)
    assert all(1 <= len(r) <= 3 and all(t in service.CORPUS for t in r) for r in a)
    assert {len(r) for r in a} == {1, 2, 3}
