"""The HTTP embedding service under load: Tandem's example service against sentence-transformers behind Starlette.

Services (each started alone in its own process on a free port, waited for on /health, stopped
before the next starts, so no two services ever share the cores):
  tandem-d1  python -m examples.minilm --depth 1 --workers W     (micro-batched, no pipelining)
  tandem-d2  python -m examples.minilm --depth 2 --workers W     (micro-batched, two runs in flight)
  plain      python benchmarks/_plain_service.py --threads W     (one encode() per request in a worker
             thread, torch with W intra-op threads, anyio's default 40 threads)
W is the number of cores unless --threads says otherwise: the engine's pool workers and torch's
threads alike. Every service answers the same OpenAI-style endpoint, POST /v1/embeddings with
{"input": [str, ...], "model": "all-MiniLM-L6-v2"}, and encodes the response the same way
(Starlette's JSONResponse of 384 floats per text); both run on uvicorn with the same HTTP parser.

The load comes from this process: raw HTTP/1.1 over keep-alive connections (asyncio streams, the
request bytes serialized once before the clock starts, responses checked for status 200 and, for
a sample, parsed and checked for one 384-float embedding per text). Its CPU time is reported per
request (it shares the machine's cores with the service). Every request carries 1 to 3 texts
drawn (seeded) from a fixed corpus of 48 sentences of 6 to 53 tokens; every service gets the
same requests in the same order.
  closed loop  N concurrent clients (1, 4, 16, 32), each sending its next request when the previous
               one is answered: requests per second, p50 / p99 latency;
  open loop    Poisson arrivals at fixed rates (25/50/75/100 % of the plain service's measured
               closed-loop capacity, the best of its client counts in the first round), latency
               measured from each request's *scheduled* send time, so a service that falls behind
               is charged its queueing (no coordinated omission).
Each point runs --warmup seconds unmeasured, then --duration seconds measured (an open-loop point
at least long enough for --min-requests requests). --reps rounds, the services in rotated order
each round (plain first in the first round: its capacity sets the open-loop rates); throughput is
the median over rounds, latency percentiles are over the requests of all rounds. The service's
CPU (from /proc) is reported per point: cores busy in all, and in its main (event loop) thread;
and what other processes took meanwhile: a point during which they took more than
--max-other-load cores is measured again (up to --retries times), after waiting for a quiet
machine. For the Tandem service, texts per engine run come from its /health counters.

    python benchmarks/service.py [--quick] [--reps 3] [--duration 5] [--clients 1,4,16,32]
                                 [--loads 0.25,0.5,0.75,1] [--services tandem-d1,tandem-d2,plain]
                                 [--threads W] [--window-ms MS] [--capacity RPS] [--json PATH]

(--services also takes tandem-dN for another depth and plain-lN for the plain service with at most
N encode() calls at once.)
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import math
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from _common import print_table, write_json  # noqa: E402
from _progress import Progress  # noqa: E402

MODEL_NAME = "all-MiniLM-L6-v2"
ENDPOINT = "/v1/embeddings"
DIM = 384
SERVICES = ("tandem-d1", "tandem-d2", "plain")
CLIENTS = (1, 4, 16, 32)
LOADS = (0.25, 0.5, 0.75, 1.0)
MAX_OPEN_CONNECTIONS = 256  # the open loop's most requests outstanding at once (each on its own connection)
IDLE_REUSE_S = 2.0  # an open-loop connection idle longer is not reused (uvicorn closes idle ones after 5 s)

# Realistic sentences of varied length: search queries, support tickets, reviews, news and documentation.
CORPUS = (
    "How do I reset my password?",
    "Best hiking trails near Lake Tahoe",
    "The package arrived two days late.",
    "cheap flights from Berlin to Lisbon in May",
    "Is the museum open on public holidays?",
    "What is the difference between a virus and a bacterium?",
    "My order number is 48213 and it still shows as processing.",
    "Great coffee, friendly staff, but the music was far too loud.",
    "Refund request for a duplicate charge on my credit card",
    "The meeting has been moved to Thursday at 3 pm.",
    "Python list comprehension with an if and an else clause",
    "Symptoms of vitamin D deficiency in adults",
    "The battery lasts about a day and a half with normal use, which is better than my old phone.",
    "Our quarterly revenue grew by twelve percent, driven mostly by subscriptions in Europe and Asia.",
    "After the update, the app crashes every time I try to upload a photo from the gallery.",
    "The city council voted on Tuesday to expand the bike lane network along the river by four miles.",
    "Please make sure all visitors sign in at the front desk and wear their badge at all times.",
    "The hotel room was clean and quiet, although the breakfast buffet closed earlier than advertised.",
    "Researchers found that regular moderate exercise can improve sleep quality in older adults.",
    "Can I change the delivery address after the order has been shipped, or do I need to cancel it?",
    "The function returns None when the key is missing instead of raising a KeyError as documented.",
    "Heavy rain is expected across the northern region tonight, with possible flooding in low areas.",
    "I have been a customer for six years and this is the first time I have had a problem like this.",
    "To install the package, run pip install with the extras you need and restart the kernel.",
    "The central bank kept interest rates unchanged on Wednesday, citing persistent uncertainty about "
    "inflation and a labour market that remains tighter than expected, and signalled that any cut "
    "would depend on the data over the coming months.",
    "I ordered the blue jacket in size medium, but I received a black one in size large, and the "
    "return label that was supposed to be in the box was missing, so I could not send it back.",
    "The library provides a simple interface for reading and writing files in several formats, "
    "handles compression transparently, and streams large datasets without loading them into memory.",
    "Volunteers spent the weekend cleaning up the beach, collecting more than two tons of plastic, "
    "glass and fishing gear that had washed ashore after last month's storms.",
    "When the connection drops during a transfer, the client retries three times with exponential "
    "backoff and then reports an error, but the partial file is left on disk and must be removed.",
    "The new exhibition brings together more than two hundred paintings, drawings and letters, many "
    "of which have never been shown in public, tracing the artist's life from her early years in "
    "Paris to her final decade in a small village on the coast.",
    "Thanks for the quick reply. Unfortunately the steps you suggested did not fix the issue: the "
    "printer still shows as offline, even though it is connected to the same network as the laptop "
    "and I can print a test page from its own menu.",
    "The study followed nearly four thousand participants over ten years and found that those who ate "
    "more fruit, vegetables and whole grains had a lower risk of heart disease, even after accounting "
    "for age, smoking, income and physical activity.",
    "Configure the scheduler with a maximum of eight concurrent jobs; any job submitted beyond that "
    "limit waits in a queue ordered by priority and then by submission time, and a job that waits "
    "longer than its timeout fails with a clear error message.",
    "Shipping was fast.",
    "Where can I find the user manual?",
    "The train was cancelled again.",
    "Translate good morning into Japanese",
    "The soup was cold and the bread was stale, but the dessert almost made up for it.",
    "Employees who work remotely more than three days a week must register their home office with HR.",
    "The software license allows use on up to three devices per household, but not for commercial "
    "purposes, and it cannot be transferred to another person without written consent.",
    "Over the past decade, the small coastal town has turned itself into a destination for food "
    "lovers, with a weekly market, a cooking school and a dozen restaurants that source almost all "
    "of their ingredients from farms and fishing boats within twenty miles.",
    "Error 503 when calling the API from the staging environment",
    "Which plants are safe for cats?",
    "The quarterly report is attached; please review the figures in section three before Friday.",
    "A slow leak in the kitchen ceiling turned out to be a cracked pipe in the upstairs bathroom.",
    "Students can borrow up to ten books at a time and renew them online twice, unless another "
    "reader has placed a hold on them.",
    "The committee concluded that the bridge is structurally sound but recommended replacing the "
    "expansion joints and resurfacing the deck within the next five years to avoid costly repairs.",
    "how to make sourdough starter from scratch",
)


# -- the requests ----------------------------------------------------------------------------------
def request_texts(count: int, seed: int) -> list[list[str]]:
    """`count` requests of 1 to 3 texts each, drawn from CORPUS (seeded: every service gets the same)."""
    rng = random.Random(seed)
    return [[rng.choice(CORPUS) for _ in range(rng.randint(1, 3))] for _ in range(count)]


def http_request(path: str, body: bytes, host: str) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def request_body(texts: list[str]) -> bytes:
    return json.dumps({"input": texts, "model": MODEL_NAME}).encode()


def check_embeddings(body: bytes, n_texts: int) -> None:
    """Raises unless `body` holds n_texts embeddings of DIM floats (the response's shape, not its values)."""
    rows = [d["embedding"] for d in json.loads(body)["data"]]
    if len(rows) != n_texts or any(len(r) != DIM for r in rows):
        raise ValueError(f"expected {n_texts} embeddings of {DIM} floats, got {[len(r) for r in rows]}")


# -- the services ----------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def service_command(name: str, port: int, threads: int, window_ms: float | None) -> list[str]:
    if name.startswith("tandem-d"):
        cmd = [sys.executable, "-m", "examples.minilm", "--port", str(port), "--depth", name[len("tandem-d"):],
               "--workers", str(threads), "--log-level", "warning"]
        return cmd + (["--window-ms", str(window_ms)] if window_ms is not None else [])
    if name == "plain" or name.startswith("plain-l"):  # plain-lN: at most N encode() calls at once
        limit = ["--limit", name[len("plain-l"):]] if name != "plain" else []
        return [sys.executable, str(BENCH / "_plain_service.py"), "--port", str(port), "--threads", str(threads),
                "--log-level", "warning", *limit]
    raise ValueError(f"unknown service {name!r}; known: {', '.join(SERVICES)}")


def shown_command(cmd: list[str]) -> list[str]:
    """A service's command line as the JSON records it: `python`, paths from the repository, no port."""
    out = ["python"]
    for i, arg in enumerate(cmd[1:], 1):
        if cmd[i - 1] == "--port":
            arg = "PORT"
        elif Path(arg).is_absolute() and Path(arg).is_relative_to(ROOT):
            arg = str(Path(arg).relative_to(ROOT))
        out.append(arg)
    return out


def _get(port: int, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def _post(port: int, path: str, body: bytes, timeout: float = 60.0) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


class Service:
    """One service process: started on a free port, ready once /health answers 200, stopped on exit."""

    def __init__(self, name: str, threads: int, window_ms: float | None, start_timeout: float = 180.0) -> None:
        self.name = name
        self.port = free_port()
        self.command = service_command(name, self.port, threads, window_ms)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        try:
            self._wait_ready(start_timeout)
            status, body = _post(self.port, ENDPOINT, request_body(["warm up", "a second text"]))
            if status != 200:
                raise RuntimeError(f"{name}: POST {ENDPOINT} answered {status}: {body[:500]!r}")
            check_embeddings(body, 2)
        except BaseException:
            self.stop()
            raise
        self.start_s = time.perf_counter() - t0

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read() if self.proc.stderr else ""
                raise RuntimeError(f"{self.name} exited with code {self.proc.returncode}: {err[-3000:]}")
            try:
                if _get(self.port, "/health", timeout=2)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} did not answer /health within {timeout:.0f} s")

    def health(self) -> dict[str, Any]:
        try:
            return json.loads(_get(self.port, "/health")[1])
        except (OSError, ValueError):
            return {}

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far: the whole process, and its main thread (the event loop)."""
        tick = os.sysconf("SC_CLK_TCK")

        def read(path: str) -> float:
            fields = Path(path).read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / tick  # utime, stime

        pid = self.proc.pid
        try:
            return {"process": read(f"/proc/{pid}/stat"), "main": read(f"/proc/{pid}/task/{pid}/stat")}
        except OSError:
            return {"process": math.nan, "main": math.nan}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # uvicorn shuts down cleanly on SIGINT
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stderr:
            self.proc.stderr.close()

    def __enter__(self) -> "Service":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -- the client ------------------------------------------------------------------------------------
class Connection:
    """One keep-alive HTTP/1.1 connection: a request's bytes out, the status and body back."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, port: int) -> "Connection":
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(reader, writer)

    async def request(self, data: bytes) -> tuple[int, bytes]:
        self.writer.write(data)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        lower = head.lower()
        i = lower.find(b"\r\ncontent-length:")
        if i >= 0:
            j = lower.index(b"\r\n", i + 2)
            return status, await self.reader.readexactly(int(lower[i + 17:j]))
        if b"\r\ntransfer-encoding: chunked" in lower:
            chunks = []
            while True:
                size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
                chunk = await self.reader.readexactly(size + 2)
                if size == 0:
                    return status, b"".join(chunks)
                chunks.append(chunk[:-2])
        raise ValueError(f"a response without a length: {head[:200]!r}")

    def close(self) -> None:
        self.writer.close()


class Load:
    """The requests of one load point, serialized once, and the outcome of every request sent."""

    def __init__(self, port: int, texts: list[list[str]]) -> None:
        self.port = port
        self.texts = texts
        self.requests = [http_request(ENDPOINT, request_body(t), f"127.0.0.1:{port}") for t in texts]
        self.records: list[tuple[float, float, bool, int]] = []  # (start or scheduled time, end, ok, texts)
        self.errors: dict[str, int] = {}
        self._checked = 0

    async def send(self, conn: Connection | None, i: int, t_start: float) -> Connection | None:
        """Request i on conn (a new connection if None); the connection to reuse, or None if it broke."""
        k = i % len(self.requests)
        ok = False
        try:
            if conn is None:
                conn = await Connection.open(self.port)
            status, body = await conn.request(self.requests[k])
            if status != 200:
                self._error(f"HTTP {status}")
            else:
                if self._checked % 32 == 0:  # a sample of the answers is parsed and checked
                    check_embeddings(body, len(self.texts[k]))
                self._checked += 1
                ok = True
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, KeyError) as e:
            self._error(type(e).__name__)
            if conn is not None:
                conn.close()
            conn = None
        self.records.append((t_start, time.perf_counter(), ok, len(self.texts[k])))
        return conn

    def _error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1


async def closed_loop(load: Load, clients: int, warmup: float, duration: float) -> tuple[float, float]:
    """`clients` clients, each with its own connection, back to back; (start, end) of the measured window."""
    conns: list[Connection | None] = [await Connection.open(load.port) for _ in range(clients)]
    t_measure = time.perf_counter() + warmup
    t_stop = t_measure + duration

    async def client(c: int) -> None:
        i = c
        while (t := time.perf_counter()) < t_stop:
            conns[c] = await load.send(conns[c], i, t)
            i += clients

    await asyncio.gather(*(client(c) for c in range(clients)))
    for conn in conns:
        if conn is not None:
            conn.close()
    return t_measure, t_stop


async def open_loop(load: Load, rate: float, warmup: float, duration: float, seed: int,
                    drain: float) -> tuple[float, float, int]:
    """Poisson arrivals at `rate` per second; (start, end) of the measured window and the requests still
    unanswered `drain` seconds after the last scheduled send (counted as errors)."""
    rng = random.Random(seed)
    t0 = time.perf_counter() + 0.05
    t_measure, t_stop = t0 + warmup, t0 + warmup + duration
    idle: list[tuple[float, Connection]] = []  # (when last answered, connection), the most recent last
    slots = asyncio.Semaphore(MAX_OPEN_CONNECTIONS)
    tasks: set[asyncio.Task[None]] = set()

    def reusable() -> Connection | None:
        while idle:
            since, conn = idle.pop()
            if time.perf_counter() - since < IDLE_REUSE_S:
                return conn
            conn.close()  # the server may be closing it (keep-alive timeout): not a failure to charge it
        return None

    async def fire(i: int, t_sched: float) -> None:
        async with slots:
            conn = await load.send(reusable(), i, t_sched)
            if conn is not None:
                idle.append((time.perf_counter(), conn))

    t, i = t0, 0
    while True:
        t += rng.expovariate(rate)
        if t >= t_stop:
            break
        delay = t - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        task = asyncio.ensure_future(fire(i, t))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        i += 1
    unanswered = 0
    if tasks:
        _, pending = await asyncio.wait(set(tasks), timeout=drain)
        unanswered = len(pending)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    for _, conn in idle:
        conn.close()
    return t_measure, t_stop, unanswered


def machine_cpu() -> list[float]:
    """Seconds the machine's cores spent so far: busy (user, nice, system, irq, softirq), idle (with iowait),
    and stolen by the hypervisor (a shared VM)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return [math.nan] * 3
    tick = os.sysconf("SC_CLK_TCK")
    user, nice, system, idle, iowait, irq, softirq, steal = fields
    return [(user + nice + system + irq + softirq) / tick, (idle + iowait) / tick, steal / tick]


def wait_quiet(max_busy: float, timeout: float) -> float:
    """Waits (up to `timeout` s) for half a second in which the machine's cores are busy less than `max_busy`
    cores in all (between points the service idles: what is busy then is other work); the last reading."""
    if timeout <= 0:
        return math.nan
    deadline = time.monotonic() + timeout
    while True:
        before, t0 = machine_cpu(), time.perf_counter()
        time.sleep(0.5)
        busy = (machine_cpu()[0] - before[0]) / (time.perf_counter() - t0)
        if not busy >= max_busy or time.monotonic() > deadline:  # nan (no /proc/stat): do not wait
            return busy


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return math.nan
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def measure(service: Service, mode: str, level: float, texts: list[list[str]], warmup: float, duration: float,
            seed: int) -> dict[str, Any]:
    """One load point against a running service: throughput, latency, errors, CPU, texts per run."""
    load = Load(service.port, texts)
    health0, cpu0, client0, machine0 = service.health(), service.cpu(), time.process_time(), machine_cpu()
    wall0 = time.perf_counter()
    if mode == "closed":
        t_measure, t_stop = asyncio.run(closed_loop(load, int(level), warmup, duration))
        unanswered = 0
    else:
        t_measure, t_stop, unanswered = asyncio.run(open_loop(load, level, warmup, duration, seed,
                                                             drain=max(10.0, duration)))
    wall = time.perf_counter() - wall0
    client_cpu = time.process_time() - client0
    machine = [b - a for a, b in zip(machine0, machine_cpu())]
    cpu1, health1 = service.cpu(), service.health()
    window = [r for r in load.records if t_measure <= r[0] < t_stop]
    done = sorted(e - s for s, e, ok, _ in window if ok)
    measured_for = t_stop - t_measure
    out: dict[str, Any] = {
        "requests": len(window), "ok": len(done), "errors": len(window) - len(done) + unanswered,
        "error_kinds": dict(load.errors, **({"unanswered": unanswered} if unanswered else {})),
        "requests_per_s": len(done) / measured_for,
        "texts_per_s": sum(n for _, _, ok, n in window if ok) / measured_for,
        "p50_ms": 1e3 * percentile(done, 0.50), "p90_ms": 1e3 * percentile(done, 0.90),
        "p99_ms": 1e3 * percentile(done, 0.99), "mean_ms": 1e3 * statistics.fmean(done) if done else math.nan,
        "service_cores": (cpu1["process"] - cpu0["process"]) / wall,
        "service_main_thread_cores": (cpu1["main"] - cpu0["main"]) / wall,
        "client_cpu_us_per_request": 1e6 * client_cpu / max(1, len(load.records)),
        "client_cores": client_cpu / wall,
        "latencies_s": done,  # pooled over rounds by summarize(), not written out
        "machine_idle_cores": machine[1] / wall, "machine_steal_cores": machine[2] / wall,
        # what else ran meanwhile: the machine's busy cores less the service's and this process's
        "other_cores": max(0.0, machine[0] / wall - (cpu1["process"] - cpu0["process"]) / wall - client_cpu / wall),
    }
    if "runs" in health1 and "runs" in health0:
        runs = health1["runs"] - health0["runs"]
        out["texts_per_run"] = (health1["texts"] - health0["texts"]) / runs if runs else math.nan
        out["requests_per_run"] = (health1["requests"] - health0["requests"]) / runs if runs else math.nan
    if "padded_tokens" in health1 and "padded_tokens" in health0:  # MicroBatcher's BatchStats, when /health has them
        tokens = health1["tokens"] - health0["tokens"]
        out["padded_over_real_tokens"] = (health1["padded_tokens"] - health0["padded_tokens"]) / tokens if tokens \
            else math.nan
    if "capture" in health1 and "capture" in health0:  # the engine's captured runs: replays over all runs
        hits = health1["capture"]["hits"] - health0["capture"]["hits"]
        misses = health1["capture"]["misses"] - health0["capture"]["misses"]
        out["replayed"] = hits / (hits + misses) if hits + misses else math.nan
    return out


def measure_quiet(service: Service, mode: str, level: float, texts: list[list[str]], args: argparse.Namespace,
                  seed: int) -> dict[str, Any]:
    """measure(), taken again (up to --retries times) when other work took more than --max-other-load cores
    meanwhile; each attempt first waits for the machine to be quiet. The attempts' other loads are kept."""
    others = []
    duration = args.duration if mode == "closed" else max(args.duration, args.min_requests / level)
    for _ in range(args.retries + 1):
        wait_quiet(args.max_other_load, timeout=args.quiet_timeout)
        out = measure(service, mode, level, texts, args.warmup, duration, seed)
        others.append(round(out["other_cores"], 3))
        if not out["other_cores"] > args.max_other_load:
            break
    out["attempts_other_cores"] = others
    return out


# -- the benchmark ---------------------------------------------------------------------------------
def summarize(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over rounds (errors summed); latency percentiles over the rounds' requests pooled (a round's
    p99 rests on a few requests); every round's own figures kept."""
    keys = [k for k, v in samples[0].items() if isinstance(v, (int, float)) and k not in ("requests", "ok", "errors")]
    out: dict[str, Any] = {k: statistics.median(s[k] for s in samples) for k in keys}
    pooled = sorted(x for s in samples for x in s["latencies_s"])
    for name, q in (("p50_ms", 0.5), ("p90_ms", 0.9), ("p99_ms", 0.99)):
        out[name] = 1e3 * percentile(pooled, q)
    out["mean_ms"] = 1e3 * statistics.fmean(pooled) if pooled else math.nan
    out.update(requests=sum(s["requests"] for s in samples), errors=sum(s["errors"] for s in samples),
               rounds=[{k: v for k, v in s.items() if k != "latencies_s"} for s in samples])
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    services = list(dict.fromkeys(args.services))
    if args.capacity is None and args.loads and "plain" in services:
        services.remove("plain")
        services.insert(0, "plain")  # measured first in the first round: its capacity sets the open-loop rates
    texts = request_texts(4096, args.seed)
    points = len(args.clients) + len(args.loads)
    progress = Progress(args.reps * len(services) * (points + 1), "service")
    closed: dict[int, dict[str, list]] = {n: {s: [] for s in services} for n in args.clients}
    opened: dict[float, dict[str, list]] = {f: {s: [] for s in services} for f in args.loads}
    capacity = args.capacity
    commands: dict[str, list[str]] = {}
    starts: dict[str, list[float]] = {s: [] for s in services}
    for r in range(args.reps):
        for name in services[r % len(services):] + services[:r % len(services)]:
            progress.step(f"round {r + 1}: starting {name}")
            with Service(name, args.threads, args.window_ms) as svc:
                commands[name] = shown_command(svc.command)
                starts[name].append(svc.start_s)
                measure(svc, "closed", max(args.clients, default=4), texts, 0.0, args.warmup, args.seed)  # warm up
                for n in args.clients:
                    progress.step(f"round {r + 1}: {name}, {n} clients")
                    closed[n][name].append(measure_quiet(svc, "closed", n, texts, args, args.seed))
                if capacity is None and args.loads:  # plain runs first when there are open-loop points
                    capacity = max(closed[n]["plain" if "plain" in services else name][-1]["requests_per_s"]
                                   for n in args.clients)
                for f in args.loads:
                    progress.step(f"round {r + 1}: {name}, {f:.0%} of {capacity:.1f} requests/s")
                    opened[f][name].append(measure_quiet(svc, "open", f * capacity, texts, args, args.seed + r))
    progress.close()
    lengths = sorted(len(t.split()) for t in CORPUS)
    figures: dict[str, Any] = {
        "threads": args.threads, "window_ms": args.window_ms, "reps": args.reps, "duration_s": args.duration,
        "open_loop_min_requests": args.min_requests,
        "warmup_s": args.warmup, "seed": args.seed, "services": services, "commands": commands,
        "start_seconds": {s: statistics.median(v) for s, v in starts.items() if v},
        "corpus": {"sentences": len(CORPUS), "words_min": lengths[0], "words_median": lengths[len(lengths) // 2],
                   "words_max": lengths[-1]},
        "texts_per_request": [1, 3],
        "capacity_requests_per_s": capacity,
        "capacity_from": "--capacity" if args.capacity is not None else "plain's best closed-loop requests/s, round 1",
        "closed": [{"clients": n, "results": {s: summarize(v) for s, v in closed[n].items()}} for n in args.clients],
        "open": [{"fraction": f, "rate": f * capacity, "results": {s: summarize(v) for s, v in opened[f].items()}}
                 for f in args.loads] if capacity is not None else [],
    }
    figures["ratios"] = ratios(figures)
    return figures


def ratios(f: dict[str, Any]) -> dict[str, float]:
    """Headline ratios: Tandem (depth 2, then depth 1) over plain and depth 2 over depth 1 (>1: the first is
    better); open loop p99 as plain's over Tandem's (>1: Tandem's lower)."""
    out: dict[str, float] = {}
    pairs = [("tandem-d2", "plain"), ("tandem-d1", "plain"), ("tandem-d2", "tandem-d1")]
    for point in f["closed"]:
        res = point["results"]
        for a, b in pairs:
            if a in res and b in res:
                out[f"{point['clients']} clients: {a} over {b}, requests/s"] = (
                    res[a]["requests_per_s"] / res[b]["requests_per_s"])
    for point in f["open"]:
        res = point["results"]
        for a, b in pairs:
            if a in res and b in res and res[a]["p99_ms"] > 0:
                out[f"open loop {point['fraction']:.0%} of plain's capacity: p99 of {b} over {a}"] = (
                    res[b]["p99_ms"] / res[a]["p99_ms"])
    return out


def print_tables(f: dict[str, Any]) -> None:
    print(f"all-MiniLM-L6-v2 HTTP service, {f['threads']} engine workers / torch threads, requests of 1-3 texts "
          f"from {f['corpus']['sentences']} sentences ({f['corpus']['words_min']}-{f['corpus']['words_max']} words); "
          f"{f['reps']} rounds of {f['duration_s']:g} s per point (open loop: at least "
          f"{f['open_loop_min_requests']} requests); throughput: median of the rounds, latency: over all of them")
    rows = []
    for point in f["closed"]:
        for s, r in point["results"].items():
            rows.append([point["clients"], s, r["requests_per_s"], r["texts_per_s"], r["p50_ms"], r["p99_ms"],
                         r["errors"], r.get("texts_per_run", ""), r.get("padded_over_real_tokens", ""),
                         r.get("replayed", ""), r["service_cores"], r["service_main_thread_cores"],
                         r["client_cpu_us_per_request"]])
    print("\nclosed loop (N clients, each sends its next request when answered)")
    print_table(["clients", "service", "requests/s", "texts/s", "p50 ms", "p99 ms", "errors", "texts/run",
                 "padded/real", "replayed", "svc cores", "svc loop cores", "client us/req"], rows)
    if f["open"]:
        print(f"\nopen loop (Poisson arrivals; latency from the scheduled send; loads are fractions of "
              f"{f['capacity_requests_per_s']:.1f} requests/s: {f['capacity_from']})")
        rows = []
        for point in f["open"]:
            for s, r in point["results"].items():
                rows.append([f"{point['fraction']:.0%}", point["rate"], s, r["requests_per_s"], r["p50_ms"],
                             r["p90_ms"], r["p99_ms"], r["errors"], r.get("texts_per_run", ""),
                             r.get("replayed", ""), r["service_cores"]])
        print_table(["load", "offered/s", "service", "requests/s", "p50 ms", "p90 ms", "p99 ms", "errors",
                     "texts/run", "replayed", "svc cores"], rows)
    if f["ratios"]:
        print()
        print_table(["ratio", "value"], [[k, v] for k, v in f["ratios"].items()])


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="one round, 16 clients and 50 %% load, 1 s points, no waiting for a quiet machine (about 20 s)")
    ap.add_argument("--reps", type=int, default=3, help="rounds over the services (default 3)")
    ap.add_argument("--duration", type=float, default=5.0, help="measured seconds per point (default 5)")
    ap.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds before each point (default 1)")
    ap.add_argument("--min-requests", type=int, default=250,
                    help="open loop: a point lasts long enough for this many requests per round (default 250)")
    ap.add_argument("--clients", default=",".join(map(str, CLIENTS)), help="closed-loop client counts")
    ap.add_argument("--loads", default=",".join(map(str, LOADS)),
                    help="open-loop rates as fractions of the plain service's capacity ('' for none)")
    ap.add_argument("--capacity", type=float, default=None,
                    help="requests/s the open-loop fractions refer to (default: measured on the plain service)")
    ap.add_argument("--services", default=",".join(SERVICES), help=f"some of {','.join(SERVICES)}")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="engine pool workers and torch threads (default: one per core)")
    ap.add_argument("--window-ms", type=float, default=None, help="the Tandem service's batching window "
                    "(default: the service's own)")
    ap.add_argument("--max-other-load", type=float, default=0.3,
                    help="cores other processes may take during a point before it is measured again (default 0.3)")
    ap.add_argument("--retries", type=int, default=2, help="re-measurements of a disturbed point (default 2)")
    ap.add_argument("--quiet-timeout", type=float, default=60.0,
                    help="most seconds to wait for a quiet machine before each point (default 60)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="where to write the figures (default: benchmarks/results/)")
    args = ap.parse_args(argv)
    if args.quick:
        args.reps, args.duration, args.warmup, args.retries, args.quiet_timeout = 1, 1.0, 0.3, 0, 0.0
        args.min_requests = 0
        if args.clients == ",".join(map(str, CLIENTS)):
            args.clients = "16"
        if args.loads == ",".join(map(str, LOADS)):
            args.loads = "0.5"
    args.clients = [int(x) for x in _floats(args.clients)]
    args.loads = _floats(args.loads)
    args.services = [s.strip() for s in args.services.split(",") if s.strip()]
    if args.loads and args.capacity is None and not args.clients:
        ap.error("the open loop's rates are fractions of a capacity measured in the closed loop: give --clients "
                 "or --capacity")
    for s in args.services:
        if not (s in SERVICES or (s[:8] == "tandem-d" and s[8:].isdigit()) or (s[:7] == "plain-l" and s[7:].isdigit())):
            ap.error(f"unknown service {s!r}; known: {', '.join(SERVICES)}")
    figures = run(args)
    print_tables(figures)
    path = write_json("service", figures, args.json)
    print(f"\nwrote {path}")
    return figures


if __name__ == "__main__":
    main()
