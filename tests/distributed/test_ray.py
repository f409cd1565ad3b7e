"""engine.distributed on Ray: chip workers as actors of a real multi-node cluster on this machine.

The cluster (ray.cluster_utils.Cluster) has two nodes, each with its own
raylet and object store, so "spread" placement puts the two workers on
different nodes and every byte a run moves crosses between nodes as it would
between machines. The runtimes use the default channel ("auto": a socket to
the worker on the driver's node, the head node, and plain actor calls to the
other) unless a test says "actor" or "compiled"; a killed worker is tested
on the default only (Ray 2.60's compiled graphs can abort the driver then). The tests marked slow
(a removed node, per-worker options, "pack") run with --run-slow.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
import time

import anyio
import numpy as np
import pytest

import engine
import engine.distributed as dist
from scheduler import AsyncRuntime
from tests.distributed import programs as P
from tests.distributed.conftest import (BINDABLE, assert_follows_senders, callers_and_submitters, mlp_reference, randn,
                                        sync_calls_then_submits)

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

DETECT = 20.0  # seconds: the bound on noticing a dead actor (Ray reports it within about a second)
NODE_DETECT = 60.0  # seconds: a removed node is noticed by Ray's node health check
B = 16


@pytest.fixture(scope="module")
def cluster():
    if ray.is_initialized():
        ray.shutdown()
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    second = c.add_node(num_cpus=2, resources={"second": 1})
    c.wait_for_nodes()
    ray.init(address=c.address, logging_level="ERROR", log_to_driver=False)
    baseline = ray.cluster_resources()
    yield c, second, baseline
    ray.shutdown()
    c.shutdown()


def _ray(prog: dist.DistributedProgram, **kwargs) -> dist.DistributedRuntime:
    kwargs.setdefault("workers", 2)
    kwargs.setdefault("worker_threads", 1)
    transport = kwargs.pop("transport", None) or dist.RayTransport()
    return prog.prepare(transport=transport, **kwargs)


def _assert_nothing_left(drt: dist.DistributedRuntime) -> None:
    """Every actor dead; the placement group removed and its reserved resources gone from the cluster."""
    transport = drt._transport
    assert isinstance(transport, dist.RayTransport)
    for actor in transport.actors:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.node_id.remote(), timeout=DETECT)
    pg = transport.placement_group
    if pg is not None:
        assert ray.util.placement_group_table(pg)["state"] == "REMOVED"
        _wait_for_no_bundles(pg.id.hex())


def _region_files() -> set[int]:
    """The memory files of RayTransport regions this process has open, by inode."""
    files = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:ray-region-"):
                files.add(os.stat(f"/proc/self/fd/{fd}").st_ino)
        except OSError:  # closed meanwhile
            pass
    return files


def _wait_for_no_bundles(pg_hex: str) -> None:
    """The raylets report a removed group's bundle resources gone a moment later."""
    deadline = time.monotonic() + DETECT
    while [k for k in ray.cluster_resources() if pg_hex in k] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [k for k in ray.cluster_resources() if pg_hex in k] == []


@pytest.fixture(scope="module")
def dp(cluster):
    drt = _ray(P.dp_mlp, depth=2, bounds={"B": B})
    yield drt
    drt.close()
    _assert_nothing_left(drt)


@pytest.fixture(scope="module")
def weights():
    rng = np.random.default_rng(0)
    return randn(rng, P.D, P.H, scale=0.1), randn(rng, P.H, P.D, scale=0.1)


def test_spread_places_the_workers_on_different_nodes(dp, cluster):
    transport = dp._transport
    nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert len(set(transport.node_ids)) == 2 and set(transport.node_ids) <= nodes
    assert dp.health() == [True, True]
    assert ray.util.placement_group_table(transport.placement_group)["strategy"] == "SPREAD"
    # The worker on the driver's node is reached through a socket, the other through actor calls.
    here = ray.get_runtime_context().get_node_id()
    assert transport.socket_workers == [i for i, n in enumerate(transport.node_ids) if n == here]
    assert len(transport.socket_workers) == 1


def test_data_parallel_matches_numpy_and_moves_only_what_runs_read_and_write(dp, weights):
    """The worker on the other node gets the bytes its Call reads and sends back what it wrote; the worker beside
    the driver addresses the host's regions in place: nothing crosses for it."""
    w1, w2 = weights
    assert dp._transport.sharing_workers == dp._transport.socket_workers
    copying = [i for i in range(2) if i not in dp._transport.sharing_workers]
    assert len(copying) == 1
    rng = np.random.default_rng(1)
    for b in (B, 7, 1):  # uneven shards; at 1 worker 1 gets no rows
        x = randn(rng, b, P.D)
        before = dp.transfer_stats()
        y = dp(x, w1, w2)
        after = dp.transfer_stats()
        np.testing.assert_allclose(y, mlp_reference(x, w1, w2), rtol=1e-4, atol=1e-5)
        moved_in = after["bytes_to_workers"] - before["bytes_to_workers"]
        moved_out = after["bytes_from_workers"] - before["bytes_from_workers"]
        rows = [len(s) for s in np.array_split(np.arange(b), 2)]
        shard_bytes = [r * P.D * 4 for r in rows]
        # a copying worker with rows: its shard of x and both weights (host arguments here) go in, its y comes back
        assert moved_in == sum(shard_bytes[i] + w1.nbytes + w2.nbytes for i in copying if rows[i])
        assert moved_out == sum(shard_bytes[i] for i in copying)


def test_resident_weights_never_cross(cluster, weights):
    w1, w2 = weights
    drt = _ray(P.dp_mlp_resident, depth=2, bounds={"B": B})
    try:
        w1s = [drt.alloc_tensor((P.D, P.H), init=w1, worker_id=i) for i in range(2)]
        w2s = [drt.alloc_tensor((P.H, P.D), init=w2, worker_id=i) for i in range(2)]
        np.testing.assert_array_equal(w2s[1].to_numpy(), w2)
        x = randn(np.random.default_rng(2), B, P.D)
        before = drt.transfer_stats()
        for _ in range(3):
            y = drt(x, w1s, w2s)
            np.testing.assert_allclose(y, mlp_reference(x, w1, w2), rtol=1e-4, atol=1e-5)
        after = drt.transfer_stats()
        # only the copying worker's shard of x (the other worker shares the host's regions): never a weight
        shard = x.nbytes // 2
        assert len(drt._transport.sharing_workers) == 1
        assert after["bytes_to_workers"] - before["bytes_to_workers"] == 3 * shard
        assert after["bytes_from_workers"] - before["bytes_from_workers"] == 3 * shard
        assert drt.memory_stats(worker_id=1)["bytes_in_use"] >= w1.nbytes + w2.nbytes
        for t in (*w1s, *w2s):
            drt.free_tensor(t)
    finally:
        drt.close()
    _assert_nothing_left(drt)


def test_pipeline_parallel_stages_hand_over_through_the_host(cluster):
    """Captured (the other Ray tests are not): the first run on each slot records, the rest replay."""
    rng = np.random.default_rng(3)
    wa, wb = randn(rng, P.D, P.D, scale=0.1), randn(rng, P.D, P.D, scale=0.1)
    drt = _ray(P.pipeline, depth=3, bounds={"B": B}, capture=True)
    try:
        drt.set_tracing(True)
        xs = [randn(rng, B, P.D) for _ in range(6)]
        handles = [drt.submit(x, wa, wb) for x in xs]  # three in flight at once
        for x, h in zip(xs, handles):
            expected = 2.0 * (x.astype(np.float64) @ wa) @ wb
            np.testing.assert_allclose(h.result(timeout=DETECT), expected, rtol=1e-4, atol=1e-4)
        _spans, events = drt.drain_trace()
        for run in {e[0] for e in events}:  # per run: stage 1 and the scaling on 0, then stage 2 on 1, in order
            ev = sorted((e for e in events if e[0] == run), key=lambda e: e[1])
            assert [e[2] for e in ev] == [0, 0, 1]
            assert ev[0][4] <= ev[1][3] + 1_000_000 and ev[1][4] <= ev[2][3] + 1_000_000  # clocks: 1 ms slack
        stats = drt.capture_stats()
        assert (stats["misses"], stats["hits"]) == (3, 3)
    finally:
        drt.close()


def test_a_replay_sends_each_runs_scalar_over_ray(cluster):
    """A Scalar passed straight into a sub-program (engine.distributed.capture): one recording per slot, every
    later run a replay with its own value."""
    drt = _ray(P.widens, depth=2, bounds={"B": B}, capture=True)
    try:
        x = np.ones((B, P.D), np.float32)
        for n in range(1, 7):
            np.testing.assert_array_equal(drt(x, n=n), n * x)
        stats = drt.capture_stats()
        assert (stats["misses"], stats["hits"]) == (2, 4)
    finally:
        drt.close()


def test_host_callbacks_run_on_the_driver_with_the_workers_outputs(cluster):
    rng = np.random.default_rng(4)
    w = randn(rng, P.KD, P.N, scale=0.1)
    drt = _ray(P.tp_matmul, bounds={"B": 8}, callbacks={"gather": P.gather})
    try:
        x = randn(rng, 8, P.KD)
        np.testing.assert_allclose(drt(x, w), x.astype(np.float64) @ w, rtol=1e-4, atol=1e-4)
    finally:
        drt.close()


def test_async_dispatch_over_ray_is_unchanged(dp, weights):
    w1, w2 = weights
    rng = np.random.default_rng(5)
    xs = [randn(rng, B, P.D) for _ in range(8)]

    async def main():
        async with AsyncRuntime(dp) as art:
            futs = [await art.dispatch(x, w1, w2) for x in xs]
            return [await f for f in futs]

    for x, y in zip(xs, anyio.run(main)):
        np.testing.assert_allclose(y, mlp_reference(x, w1, w2), rtol=1e-4, atol=1e-5)


def test_tracing_has_one_lane_per_worker(dp, weights):
    w1, w2 = weights
    dp.set_tracing(True)
    try:
        dp(randn(np.random.default_rng(6), B, P.D), w1, w2)
        _spans, events = dp.drain_trace()
    finally:
        dp.set_tracing(False)
    assert sorted(e[2] for e in events) == [0, 1]
    now = time.monotonic_ns()
    assert all(0 < e[3] <= e[4] <= now for e in events)  # on the driver's clock


def test_the_compiled_graph_channel_runs_the_same_programs(cluster, weights):
    w1, w2 = weights
    rng = np.random.default_rng(9)
    drt = _ray(P.dp_mlp, depth=2, bounds={"B": B}, transport=dist.RayTransport(channel="compiled"))
    try:
        xs = [randn(rng, b, P.D) for b in (B, 7, 1, B)]
        handles = [drt.submit(x, w1, w2) for x in xs]  # two batches under way per worker
        for x, h in zip(xs, handles):
            np.testing.assert_allclose(h.result(timeout=DETECT), mlp_reference(x, w1, w2), rtol=1e-4, atol=1e-5)
        assert drt.transfer_stats()["executions"] >= 2
    finally:
        drt.close()
    _assert_nothing_left(drt)


def test_a_kernel_error_names_the_worker_and_leaves_the_runtime_usable(cluster):
    drt = _ray(P.fails_on_worker, bounds={"B": 4})
    try:
        with pytest.raises(engine.KernelError, match="on chip worker 1"):
            drt(np.ones((4, P.D), np.float32))
        assert not drt.broken and drt.health() == [True, True]
        with pytest.raises(engine.KernelError):
            drt(np.ones((4, P.D), np.float32))
    finally:
        drt.close()


def test_a_killed_worker_fails_the_runs_in_flight_and_close_leaves_nothing(cluster):
    drt = _ray(P.slow, depth=2)
    try:
        h1 = drt.submit(np.zeros(2, np.float32), 2_000_000_000)  # 2 s on each worker
        h2 = drt.submit(np.zeros(2, np.float32), 2_000_000_000)
        time.sleep(0.2)
        os.kill(drt.pids[1], signal.SIGKILL)  # the actor's process (the cluster runs on this machine)
        t0 = time.monotonic()
        for h in (h1, h2):
            with pytest.raises(dist.WorkerDiedError, match="chip worker 1") as info:
                h.result(timeout=DETECT)
            assert info.value.worker == 1
        assert time.monotonic() - t0 < DETECT
        assert drt.broken and drt.health()[1] is False
        with pytest.raises(dist.WorkerDiedError):
            drt.submit(np.zeros(2, np.float32), 1)
    finally:
        drt.close()
    _assert_nothing_left(drt)


def test_startup_without_the_resources_times_out_and_cleans_up(cluster):
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="could not place 2 chip workers"):
        _ray(P.dp_mlp, bounds={"B": 4}, startup_timeout=2.0,
             transport=dist.RayTransport(worker_options={"resources": {"tpu_pod": 1}}))
    assert time.monotonic() - t0 < 15
    mine = [pg for pg in ray.util.placement_group_table().values() if pg["bundles"][0].get("tpu_pod")]
    assert len(mine) == 1 and mine[0]["state"] == "REMOVED"
    _wait_for_no_bundles(mine[0]["placement_group_id"])


def test_a_worker_setup_error_is_reraised_and_nothing_is_left(cluster):
    from tests.distributed import refuses_worker

    transport = dist.RayTransport()
    with pytest.raises(RuntimeError, match="refuses to load in a Ray chip worker"):
        _ray(refuses_worker.uses_fill, transport=transport)
    for actor in transport.actors:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.node_id.remote(), timeout=DETECT)
    assert ray.util.placement_group_table(transport.placement_group)["state"] == "REMOVED"
    _wait_for_no_bundles(transport.placement_group.id.hex())


@pytest.mark.parametrize("given", ["address=", "RAY_ADDRESS", "ray_current_cluster"])
def test_an_unreachable_address_fails_fast_with_a_clear_error(given, tmp_path):
    """However the address reaches ray.init: passed, in RAY_ADDRESS, or left in the file a killed `ray start` or
    test cluster leaves behind (where ray.init itself would wait minutes)."""
    address = "'127.0.0.1:9'" if given == "address=" else "None"
    code = ("import time, engine.distributed as dist\n"
            "from tests.distributed import programs as P\n"
            "t = time.monotonic()\n"
            "try:\n"
            "    P.dp_mlp.prepare(workers=2, bounds={'B': 4}, startup_timeout=5,\n"
            f"                     transport=dist.RayTransport(address={address}))\n"
            "except ConnectionError as e:\n"
            "    print('ConnectionError', round(time.monotonic() - t), e)\n")
    # Ray's own temp dir (and its ray_current_cluster) is left alone: this one is the test's.
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_TMPDIR", "TMPDIR")}
    env["RAY_TMPDIR"] = str(tmp_path)
    if given == "RAY_ADDRESS":
        env["RAY_ADDRESS"] = "127.0.0.1:9"
    elif given == "ray_current_cluster":
        (tmp_path / "ray").mkdir()
        (tmp_path / "ray" / "ray_current_cluster").write_text("127.0.0.1:9")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert out.stdout.startswith("ConnectionError"), out.stderr[-2000:]
    assert "no Ray cluster answers at 127.0.0.1:9" in out.stdout
    if given != "address=":
        assert given in out.stdout  # where the address came from
    assert int(out.stdout.split()[1]) < 15


def test_bad_options_are_refused_before_anything_starts():
    with pytest.raises(ValueError, match="placement must be 'spread' or 'pack'"):
        dist.RayTransport(placement="scatter")
    with pytest.raises(ValueError, match="channel must be"):
        dist.RayTransport(channel="grpc")
    with pytest.raises(TypeError, match="worker_options"):
        dist.RayTransport(worker_options=["num_cpus"])
    with pytest.raises(ValueError, match="follow_sender"):
        dist.RayTransport(follow_sender=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="worker_options has 1 entries for 2 workers"):
        _ray(P.dp_mlp, bounds={"B": 4}, transport=dist.RayTransport(worker_options=[{}]))


def test_a_transport_serves_one_runtime(cluster):
    transport = dist.RayTransport()
    drt = _ray(P.dp_mlp, bounds={"B": 4}, transport=transport)
    drt.close()
    with pytest.raises(RuntimeError, match="serves one runtime"):
        _ray(P.dp_mlp, bounds={"B": 4}, transport=transport)


# -- slow: run with --run-slow -------------------------------------------------------------------------
@pytest.mark.slow
def test_pack_places_both_workers_on_one_node(cluster, weights):
    # half a CPU each: the module's runtime holds a CPU of each node, and both must fit on one node
    drt = _ray(P.dp_mlp, bounds={"B": 4}, transport=dist.RayTransport(placement="pack",
                                                                     worker_options={"num_cpus": 0.5}))
    try:
        assert len(set(drt._transport.node_ids)) == 1
        x = randn(np.random.default_rng(7), 4, P.D)
        np.testing.assert_allclose(drt(x, *weights), mlp_reference(x, *weights), rtol=1e-4, atol=1e-5)
    finally:
        drt.close()
    _assert_nothing_left(drt)


@pytest.mark.slow
def test_per_worker_options_with_the_compiled_channel(cluster, weights):
    _c, second, _baseline = cluster
    opts = [{}, {"resources": {"second": 1}}]  # worker 1 must land on the second node
    drt = _ray(P.dp_mlp, bounds={"B": B}, transport=dist.RayTransport(worker_options=opts, channel="compiled"))
    try:
        assert drt._transport.node_ids[1] == second.node_id
        x = randn(np.random.default_rng(8), B, P.D)
        np.testing.assert_allclose(drt(x, *weights), mlp_reference(x, *weights), rtol=1e-4, atol=1e-5)
    finally:
        drt.close()
    _assert_nothing_left(drt)


@pytest.mark.slow
def test_a_removed_node_fails_the_runs_that_need_it(cluster):
    c, _second, _baseline = cluster
    doomed = c.add_node(num_cpus=1, resources={"doomed": 1})
    c.wait_for_nodes()
    drt = _ray(P.slow, depth=2, transport=dist.RayTransport(worker_options=[{}, {"resources": {"doomed": 1}}]))
    try:
        assert drt._transport.node_ids[1] == doomed.node_id
        h = drt.submit(np.zeros(2, np.float32), 5_000_000_000)
        time.sleep(0.2)
        t0 = time.monotonic()
        c.remove_node(doomed)
        with pytest.raises(dist.WorkerDiedError, match="chip worker 1"):
            h.result(timeout=NODE_DETECT)
        assert time.monotonic() - t0 < NODE_DETECT
        assert drt.broken
    finally:
        drt.close()


# -- a sync call driving its own run -----------------------------------------------------------------------
@pytest.mark.parametrize("channel", ["auto", "actor", "compiled"])
def test_a_sync_call_drives_its_run_on_its_own_thread(cluster, channel):
    """drt(x) executes its batches and takes their replies on the calling thread (no hand-off to the pump and
    back); a submitted run's are taken by the pump, and the two alternate freely, on every channel."""
    drt = _ray(P.slow, depth=2, transport=dist.RayTransport(channel=channel))
    try:
        assert len(drt._transport.socket_workers) == (1 if channel == "auto" else 0)
        seen = sync_calls_then_submits(drt, DETECT)
        zeros, ones = np.zeros(2, np.float32), np.ones(2, np.float32)
        with drt._transport.caller_reads() as reads:  # a timed wait leaves the run to the pump
            assert reads is True
            h = drt.submit(zeros, 100_000_000)
            assert h.wait(0.01) is False
            np.testing.assert_array_equal(h.result(timeout=DETECT), ones)
        assert len(seen) == 2 and threading.get_ident() not in seen
        np.testing.assert_array_equal(drt(zeros, 1), ones)  # the pump may still be finishing its round: it drives
        # The pump lets go of the driver role only after handing on the run's last reply: once it has, with
        # nothing left to send, the next call is the caller's to drive.
        deadline = time.monotonic() + DETECT
        while drt._transport._driver is not None and time.monotonic() < deadline:
            time.sleep(0.001)
        seen.clear()
        np.testing.assert_array_equal(drt(zeros, 1), ones)  # back to the caller
        assert set(seen) == {threading.get_ident()}
    finally:
        drt.close()
    _assert_nothing_left(drt)


@pytest.mark.parametrize("channel", ["auto", "compiled"])
def test_sync_callers_and_submitters_lose_no_reply(cluster, channel):
    """Two callers driving their runs and a submitter served by the pump, for a few seconds, on the compiled
    channel (where two threads executing graphs at once would hang Ray) and on the default's mix of a socket
    and actor calls: every run gets its result."""
    drt = _ray(P.slow, depth=4, transport=dist.RayTransport(channel=channel))
    try:
        assert min(callers_and_submitters(drt, 3.0, DETECT)) > 0
    finally:
        drt.close()
    _assert_nothing_left(drt)


@pytest.mark.parametrize("behind", ["actor calls", "a socket"])
def test_a_worker_killed_while_a_sync_call_drives_fails_it(cluster, behind):
    """The caller waits for its batch when the actor dies: the call fails with WorkerDiedError (from the execution
    it drives, where a socket's end tells before Ray does, or the watcher), and close() leaves nothing."""
    drt = _ray(P.slow, depth=2, transport=_on_the_drivers_node() if behind == "a socket" else None)
    try:
        sockets = drt._transport.socket_workers
        victim = next(i for i in range(2) if (i in sockets) == (behind == "a socket"))
        drt(np.zeros(2, np.float32), 1)
        killer = threading.Timer(0.3, os.kill, (drt.pids[victim], signal.SIGKILL))
        killer.start()
        t0 = time.monotonic()
        with pytest.raises(dist.WorkerDiedError, match=f"chip worker {victim}"):
            drt(np.zeros(2, np.float32), 5_000_000_000)  # 5 s: killed long before
        assert time.monotonic() - t0 < DETECT
        killer.join()
        assert drt.broken
    finally:
        drt.close()
    _assert_nothing_left(drt)


def test_close_from_another_thread_drains_a_sync_call_it_drives(cluster):
    """close() while another thread drives its own run: the run completes with its result, then close() stops the
    workers; the caller's thread and close() both return."""
    drt = _ray(P.slow, depth=2)
    got: list[object] = []
    caller = threading.Thread(target=lambda: got.append(drt(np.zeros(2, np.float32), 300_000_000)), daemon=True)
    try:
        drt(np.zeros(2, np.float32), 1)
        caller.start()
        time.sleep(0.1)  # the call is under way, driven by its thread
        drt.close()
        caller.join(DETECT)
        assert not caller.is_alive()
        assert len(got) == 1
        np.testing.assert_array_equal(got[0], np.ones(2, np.float32))
    finally:
        drt.close()
    _assert_nothing_left(drt)


def test_an_interrupt_of_a_driving_caller_leaves_its_run_to_the_pump(cluster, monkeypatch):
    """Ctrl-C while a sync call waits for its batches' actor calls (actor channel): the call raises
    KeyboardInterrupt, the executions stay under way and the pump takes their replies, so the runtime stays usable
    and loses nothing."""
    from engine.distributed import ray_socket

    drt = _ray(P.slow, depth=2, transport=dist.RayTransport(channel="actor"))
    try:
        assert drt._transport.socket_workers == []
        _interrupt_a_driving_caller(drt, monkeypatch, ray_socket, "wait_readable", 2)
    finally:
        monkeypatch.undo()
        drt.close()
    _assert_nothing_left(drt)


def _interrupt_a_driving_caller(drt: dist.DistributedRuntime, monkeypatch, module, name: str, written: int) -> None:
    """module.name raises KeyboardInterrupt the first time the main thread calls it: the sync call in it raises
    that, and the runtime stays usable, loses nothing (`slow` writes y[:written]) and completes every run."""
    zeros, ones = np.zeros(2, np.float32), np.ones(written, np.float32)
    np.testing.assert_array_equal(drt(zeros, 1)[:written], ones)
    real, interrupted = getattr(module, name), []

    def once_interrupted(*args, **kwargs):
        if not interrupted and threading.current_thread() is threading.main_thread():
            interrupted.append(True)
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, once_interrupted)
    with pytest.raises(KeyboardInterrupt):
        drt(zeros, 1)
    assert interrupted and not drt.broken
    for _ in range(3):
        np.testing.assert_array_equal(drt(zeros, 1)[:written], ones)
    idle = threading.Thread(target=drt._dispatcher.wait_idle, daemon=True)  # the interrupted run completes too
    idle.start()
    idle.join(DETECT)
    assert not idle.is_alive()


# -- the driver's node: workers behind a socket --------------------------------------------------------------
def _on_the_drivers_node(**kwargs) -> dist.RayTransport:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    # Half a CPU each: the module's `dp` runtime holds one of the head node's two.
    return dist.RayTransport(worker_options={"num_cpus": 0.5,
                                             "scheduling_strategy": NodeAffinitySchedulingStrategy(here, soft=False)},
                             **kwargs)


@pytest.mark.skipif(len(BINDABLE) < 2, reason="needs two CPUs this process may bind threads to")
@pytest.mark.parametrize("follow", [True, False])
def test_the_pump_moves_to_the_cpu_of_the_sender_that_woke_it(cluster, follow):
    """As the process transport's receiving thread: a run submitted wakes the pump, which moves to the
    submitting thread's CPU (it then wakes that thread on its own CPU); follow_sender=False leaves it."""
    drt = _ray(P.slow, depth=2, transport=_on_the_drivers_node(follow_sender=follow))
    try:
        assert drt._transport.socket_workers == [0, 1]
        assert_follows_senders(drt, drt._transport._pump, follow)
    finally:
        drt.close()
    _assert_nothing_left(drt)


@pytest.mark.parametrize("regions", ["shared", "copied"])
def test_workers_on_the_drivers_node_are_served_through_sockets(cluster, weights, monkeypatch, regions):
    """Both workers beside the driver: each has its socket (the driver waits on both at once) and the data-parallel
    MLP matches numpy (two pool threads a worker: the socket's thread waits for the pool's completions). Each
    worker maps the host's regions, so no byte crosses; a worker that cannot map them (here: the driver offers
    files of the wrong size) keeps its copies and the socket carries the bytes, as many as over Ray."""
    from engine.distributed import ray_socket

    if regions == "copied":
        real_offer = ray_socket.offer_regions

        def wrong_files(sock, fds, timeout):
            wrong = [os.memfd_create("wrong-size") for _ in fds]  # empty: no region's size
            try:
                return real_offer(sock, wrong, timeout)
            finally:
                for fd in wrong:
                    os.close(fd)

        monkeypatch.setattr(ray_socket, "offer_regions", wrong_files)
    w1, w2 = weights
    region_files = _region_files()  # earlier tests' runtimes may still hold theirs
    drt = _ray(P.dp_mlp, depth=3, bounds={"B": B}, worker_threads=2, transport=_on_the_drivers_node())
    try:
        assert len(_region_files() - region_files) == 3  # one memory file per slot, held by its mapping
        assert drt._transport.socket_workers == [0, 1]
        assert drt._transport.sharing_workers == ([0, 1] if regions == "shared" else [])
        x = randn(np.random.default_rng(2), B, P.D)
        before = drt.transfer_stats()
        np.testing.assert_allclose(drt(x, w1, w2), mlp_reference(x, w1, w2), rtol=1e-4, atol=1e-5)
        after = drt.transfer_stats()
        copied = regions == "copied"
        moved_in = after["bytes_to_workers"] - before["bytes_to_workers"]
        assert moved_in == copied * (x.nbytes + 2 * (w1.nbytes + w2.nbytes))
        assert after["bytes_from_workers"] - before["bytes_from_workers"] == copied * x.nbytes
        handles = [drt.submit(randn(np.random.default_rng(k), B, P.D), w1, w2) for k in range(8)]
        for k, h in enumerate(handles):
            xk = randn(np.random.default_rng(k), B, P.D)
            np.testing.assert_allclose(h.result(timeout=DETECT), mlp_reference(xk, w1, w2), rtol=1e-4, atol=1e-5)
    finally:
        drt.close()
    _assert_nothing_left(drt)
    assert drt._transport._poke is not None and drt._transport._poke.fd == -1  # closed
    del drt, handles, h
    gc.collect()  # the runtime; its finalizer then lets go of the transport, in a cycle with the dispatcher:
    gc.collect()
    assert not _region_files() - region_files  # the mappings went with the runtime
    if regions == "copied":
        return  # the rest does not depend on how the regions reach the workers
    slow = _ray(P.slow, depth=4, transport=_on_the_drivers_node())
    try:
        assert slow._transport.socket_workers == [0, 1]
        assert min(callers_and_submitters(slow, 2.0, DETECT)) > 0
    finally:
        slow.close()
    _assert_nothing_left(slow)


@pytest.mark.parametrize("channel", ["auto", "actor", "mixed"])
def test_a_run_queued_while_the_driver_waits_for_a_reply_goes_out_at_once(cluster, channel):
    """The pump waits for a long run's replies (on the workers' sockets, on actor calls, or on both: a worker on
    each node); a second run submitted meanwhile is sent to the workers at once (the driver wakes for it, or looks
    for it), not when the first one's replies come back. Then both complete."""
    if channel == "mixed":
        drt = _ray(P.slow, depth=2)  # spread: one worker beside the driver (a socket), one on the other node
    else:
        drt = _ray(P.slow, depth=2, workers=1, transport=_on_the_drivers_node(channel=channel))
    transport = drt._transport
    n = drt.workers
    try:
        assert transport.sharing_workers == {"auto": [0], "actor": [], "mixed": transport.socket_workers}[channel]
        assert len(transport.socket_workers) == {"auto": 1, "actor": 0, "mixed": 1}[channel]
        first = drt.submit(np.zeros(2, np.float32), 2_000_000_000)  # spins 2 s on each worker
        deadline = time.monotonic() + DETECT
        while min(transport._busy) < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)  # the pump waits for the first one's replies by now
        second = drt.submit(np.zeros(2, np.float32), 1)
        sent_by = time.monotonic() + 1.0
        while min(transport._busy) < 2 and time.monotonic() < sent_by:
            time.sleep(0.005)
        assert transport._busy == [2] * n and not first.done  # under way beside the first, long before its replies
        assert list(first.result(timeout=DETECT)[:n]) == [1] * n and list(second.result(timeout=DETECT)[:n]) == [1] * n
    finally:
        drt.close()
    _assert_nothing_left(drt)


@pytest.mark.parametrize("long_on", ["actor call", "socket"])
def test_a_driver_waiting_on_sockets_and_actor_calls_takes_whichever_replies_first(cluster, long_on):
    """One worker beside the driver (a socket), one on the other node (actor calls): a short run on one completes
    while a 3 s run on the other, submitted before it, is still under way (the driver does not wait for the
    oldest execution first)."""
    drt = _ray(P.spin_on, depth=2)
    transport = drt._transport
    try:
        (socket_worker,) = transport.socket_workers
        actor_worker = 1 - socket_worker
        slow_w, fast_w = (actor_worker, socket_worker) if long_on == "actor call" else (socket_worker, actor_worker)
        for w in (0, 1):  # both paths warm
            assert drt(np.zeros(1, np.float32), 1, w)[0] == 1
        long = drt.submit(np.zeros(1, np.float32), 3_000_000_000, slow_w)
        deadline = time.monotonic() + DETECT
        while transport._busy[slow_w] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)  # the pump waits for the long run's reply by now
        assert drt.submit(np.zeros(1, np.float32), 1, fast_w).result(timeout=DETECT)[0] == 1
        assert not long.done  # the short run's reply was taken before the long one's came back
        assert long.result(timeout=DETECT)[0] == 1
    finally:
        drt.close()
    _assert_nothing_left(drt)


def test_dependent_runs_on_a_worker_sharing_the_hosts_memory_apply_in_dispatch_order(cluster):
    """Runs updating a resident tensor on a worker that maps the host's regions go out without waiting for each
    other's replies (the worker's engine orders them): acc = 2 acc + x_k over 24 runs submitted back to back, then
    as many streamed by AsyncRuntime, gives exactly the value of that order."""
    drt = _ray(P.horner, depth=3, workers=1, bounds={"B": 2}, transport=_on_the_drivers_node())
    try:
        assert drt._transport.sharing_workers == [0]
        assert drt._dispatcher._same_worker_shortcut[0]  # the path under test: no wait for the reply
        acc = drt.alloc_tensor((2, P.D), init=np.zeros((2, P.D), np.float32), worker_id=0)
        xs = [np.full((2, P.D), k % 5, np.float32) for k in range(24)]
        expected = np.zeros((2, P.D), np.float32)
        for x in xs:
            expected = 2 * expected + x  # below 2**24 * 5: exact in float32
        for h in [drt.submit(x, acc, 0) for x in xs]:
            h.result(timeout=DETECT)
        np.testing.assert_array_equal(acc.to_numpy(), expected)
        streamed = drt.alloc_tensor((2, P.D), init=np.zeros((2, P.D), np.float32), worker_id=0)

        async def stream():
            async with AsyncRuntime(drt) as art:
                async for _ in art.stream([(x, streamed, 0) for x in xs], depth=3):
                    pass

        anyio.run(stream)
        np.testing.assert_array_equal(streamed.to_numpy(), expected)
    finally:
        drt.close()
    _assert_nothing_left(drt)


def test_an_interrupt_while_waiting_on_a_socket_leaves_the_run_to_the_pump(cluster, monkeypatch):
    """Ctrl-C while a sync call waits for its worker's socket: the call raises KeyboardInterrupt with nothing read
    from the socket, the pump takes the replies, and the runtime stays usable and loses nothing."""
    from engine.distributed import ray_socket

    drt = _ray(P.slow, depth=2, workers=1, transport=_on_the_drivers_node())
    try:
        assert drt._transport.socket_workers == [0]
        _interrupt_a_driving_caller(drt, monkeypatch, ray_socket, "wait_readable", 1)  # one worker writes y[0]
    finally:
        monkeypatch.undo()
        drt.close()
    _assert_nothing_left(drt)


@pytest.mark.parametrize("obstacle", ["unreachable", "other pid"])
def test_a_worker_that_cannot_reach_the_drivers_socket_keeps_actor_calls(cluster, monkeypatch, obstacle):
    """A worker on the driver's node that cannot connect (another network namespace) or whose connection comes
    from a pid other than the one it reported (another pid namespace) is served by actor calls instead: the
    runtime starts and its runs are right."""
    from engine.distributed import ray_socket

    if obstacle == "unreachable":
        real_init = ray_socket.Listener.__init__

        def unreachable(self):
            real_init(self)
            self.address += "-elsewhere"  # what the worker is told: nobody listens there

        monkeypatch.setattr(ray_socket.Listener, "__init__", unreachable)
    else:
        real_accept = ray_socket.Listener.accept
        monkeypatch.setattr(ray_socket.Listener, "accept", lambda self, pid, timeout: real_accept(self, pid + 1, timeout))
    drt = _ray(P.slow, depth=2, transport=_on_the_drivers_node())
    try:
        assert drt._transport.socket_workers == []
        np.testing.assert_array_equal(drt(np.zeros(2, np.float32), 1), np.ones(2, np.float32))
    finally:
        drt.close()
    _assert_nothing_left(drt)


def test_an_interrupt_that_cuts_a_batch_short_fails_its_runs_and_hangs_nothing(cluster, monkeypatch):
    """Ctrl-C inside a socket write that could not defer it (between two of its calls): that worker's runs fail
    with WorkerDiedError instead of waiting for replies that will never come, the other worker's batch still goes
    out, every run ends, and close() leaves nothing."""
    from engine.distributed import ray_socket

    drt = _ray(P.slow, depth=2, transport=_on_the_drivers_node())
    try:
        zeros = np.zeros(2, np.float32)
        np.testing.assert_array_equal(drt(zeros, 1), np.ones(2, np.float32))
        real_send, cut = ray_socket.send_wire, []

        def send_cut_once(sock, wire, deferred=None):
            if not cut and threading.current_thread() is threading.main_thread():
                cut.append(True)
                raise KeyboardInterrupt
            real_send(sock, wire, deferred)

        monkeypatch.setattr(ray_socket, "send_wire", send_cut_once)
        with pytest.raises(KeyboardInterrupt):
            drt(zeros, 1)
        assert cut and drt.broken
        with pytest.raises(dist.WorkerDiedError, match="cut short by an interrupt"):
            drt(zeros, 1)
        idle = threading.Thread(target=drt._dispatcher.wait_idle, daemon=True)  # every run has ended
        idle.start()
        idle.join(DETECT)
        assert not idle.is_alive()
    finally:
        monkeypatch.undo()
        drt.close()
    _assert_nothing_left(drt)
