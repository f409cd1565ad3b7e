"""Pipelining: depth-bounded runs in flight, FIFO admission, slot leases, cross-run ordering."""

import threading
import time

import numpy as np
import pytest

import engine
from engine import In, InOut, Out, Scalar
from engine import _native
from engine.slots import StaleLeaseError

from .conftest import Gate, k_copy


# -- the slot table: with accessors (Runtime) or by depth alone (DistributedRuntime) ------------------
def _table(kind, n):
    if kind == "by depth":
        return _native.SlotTable(n)
    device = _native.Device(0)
    return _native.SlotTable([_native.HostAccessor(device) for _ in range(n)])


@pytest.fixture(params=["with accessors", "by depth"])
def make_pool(request):
    return lambda n: _table(request.param, n)


def test_slot_pool_leases_each_slot_once_and_then_runs_dry(make_pool):
    pool = make_pool(3)
    assert pool.depth == 3 and pool.free_count == 3
    leases = [pool.try_lease() for _ in range(3)]
    assert sorted(index for index, _ in leases) == [0, 1, 2]
    assert pool.try_lease() is None
    assert pool.free_count == 0
    for l in leases:
        pool.release(*l)
    assert pool.free_count == 3


def test_release_advances_the_generation_and_a_stale_lease_is_rejected(make_pool):
    pool = make_pool(1)
    first = pool.try_lease()
    pool.release(*first)
    with pytest.raises(StaleLeaseError):
        pool.release(*first)  # released twice
    assert pool.free_count == 1
    second = pool.try_lease()
    assert second == (first[0], first[1] + 1)
    with pytest.raises(StaleLeaseError):
        pool.release(*first)  # a lease from an earlier run cannot release the new holder's slot
    assert pool.free_count == 0
    pool.release(*second)
    assert pool.free_count == 1
    assert issubclass(StaleLeaseError, ValueError)


def test_slots_are_handed_out_in_release_order(make_pool):
    pool = make_pool(3)
    a, b, c = (pool.try_lease() for _ in range(3))
    pool.release(*b)
    pool.release(*a)
    assert pool.try_lease()[0] == b[0]
    assert pool.try_lease()[0] == a[0]


def test_concurrent_lease_release_keeps_every_release_exactly_once(make_pool):
    pool = make_pool(4)
    errors, counts = [], [0] * 4
    lock = threading.Lock()

    def worker():
        for _ in range(2000):
            lease = pool.try_lease()
            if lease is None:
                continue
            with lock:
                counts[lease[0]] += 1
            pool.release(*lease)
            try:
                pool.release(*lease)
                errors.append("double release accepted")
            except StaleLeaseError:
                pass

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert pool.free_count == 4
    final = [pool.try_lease() for _ in range(4)]
    assert sorted(g for _, g in final) == sorted(counts)  # each slot's generation counts its releases
    assert sum(dict(final)[i] for i in range(4)) == sum(counts)


def test_a_slot_table_by_depth_has_no_accessors_and_wants_a_slot():
    table = _native.SlotTable(2)
    assert table.depth == 2 and table.accessor(0) is None and table.accessor(1) is None
    with pytest.raises(ValueError, match="at least one slot"):
        _native.SlotTable(0)
    with pytest.raises(TypeError):
        _native.SlotTable(-1)


def test_native_slot_table_rejects_a_bad_construction_and_names_its_slots():
    device = _native.Device(0)
    with pytest.raises(ValueError, match="at least one slot"):
        _native.SlotTable([])
    acc = _native.HostAccessor(device)
    with pytest.raises(ValueError, match="shares its accessor"):
        _native.SlotTable([acc, acc])
    with pytest.raises((TypeError, ValueError)):
        _native.SlotTable([None])
    table = _native.SlotTable([acc, _native.HostAccessor(device)])
    assert table.accessor(0) is acc
    with pytest.raises(ValueError, match="out of range"):
        table.accessor(2)
    with pytest.raises(StaleLeaseError, match="no such slot"):
        table.release(5, 0)


def test_native_slot_table_wait_free_blocks_until_a_release_or_the_timeout():
    device = _native.Device(0)
    table = _native.SlotTable([_native.HostAccessor(device)])
    held = table.try_lease()
    assert table.wait_free(0.02) is False
    threading.Timer(0.05, lambda: table.release(*held)).start()
    assert table.wait_free(5.0) is True
    assert table.free_count == 1


def test_a_leased_run_holds_its_slot_until_it_completes_and_frees_it_before_it_turns_done():
    device = _native.Device(0)
    eng = _native.Engine(device, 1)
    try:
        table = _native.SlotTable([_native.HostAccessor(device) for _ in range(2)])
        gate = threading.Event()

        def blocker():
            gate.wait(10)

        kernel = eng.register_host_kernel("blocker", blocker)
        a, a_id, a_slot = eng.begin_run_leased(False, table)
        b, b_id, b_slot = eng.begin_run_leased(True, table)
        assert {a_slot, b_slot} == {0, 1} and (a.slot, b.slot) == (a_slot, b_slot)
        assert (a.id, b.id) == (a_id, b_id)
        assert eng.begin_run_leased(False, table) is None and table.free_count == 0
        plain = eng.begin_run(False)
        assert plain.slot == -1  # a run begun without a table holds no slot
        eng.seal(plain)
        eng.submit(a, kernel, [], [])
        eng.seal(a)
        assert not a.done and table.free_count == 0
        # An admitted run abandoned before any task: cancelled and sealed, it completes and frees its slot.
        b.cancel()
        eng.seal(b)
        assert b.done and table.free_count == 1
        gate.set()
        assert a.wait(10)
        assert table.free_count == 2  # freed before a turned done
        assert eng.drain_completed() == [b.id]  # only the notifying run was announced
    finally:
        gate.set()
        eng.close(True)


def test_stop_admitting_refuses_new_runs_without_losing_a_slot_and_wait_idle_waits_for_sealing():
    device = _native.Device(0)
    eng = _native.Engine(device, 1)
    try:
        table = _native.SlotTable([_native.HostAccessor(device) for _ in range(2)])
        open_run, _, _ = eng.begin_run_leased(False, table)
        eng.stop_admitting()
        with pytest.raises(engine.ClosedError):
            eng.begin_run_leased(False, table)
        with pytest.raises(engine.ClosedError):
            eng.begin_run(False)
        assert table.free_count == 1  # the refused lease went back
        assert eng.wait_idle(0.02) is False  # a begun run is not sealed yet
        threading.Timer(0.05, lambda: eng.seal(open_run)).start()
        assert eng.wait_idle(5.0) is True
        assert open_run.done and table.free_count == 2
    finally:
        eng.close(True)


# -- depth and admission -------------------------------------------------------------------------
def gated_runtime(prepared, depth, workers=2, log=None):
    gate = Gate()
    gk = gate.kernel()

    @engine.program
    def prog(run, x: In((4,)), y: Out((4,)), key: Scalar(int)):
        if not run.planning:
            gate.record("admitted", key)
        run.submit(gk, x, out=y, key=key)

    return prepared(prog, depth=depth, workers=workers), gate


def test_up_to_depth_runs_are_in_flight_and_the_next_submit_blocks_until_the_oldest_is_released(prepared):
    rt, gate = gated_runtime(prepared, depth=2)
    x = np.zeros(4, np.float32)
    try:
        h1 = rt.submit(x, key=1)
        h2 = rt.submit(x, key=2)  # does not block: depth is 2
        assert rt.memory_stats()["free_slots"] == 0
        got = {}
        t = threading.Thread(target=lambda: got.setdefault("h3", rt.submit(x, key=3)))
        t.start()
        t.join(0.1)
        assert t.is_alive(), "a third submit did not block at depth 2"
        gate.open(2)  # the newer run completes ...
        assert h2.wait(10)
        t.join(0.1)
        assert t.is_alive(), "admitted before the oldest run was released"
        gate.open(1)  # ... the oldest is what admission waits for
        t.join(10)
        assert not t.is_alive()
        gate.open(3)
        np.testing.assert_array_equal(got["h3"].result(10), x + 3)
        np.testing.assert_array_equal(h1.result(10), x + 1)
        np.testing.assert_array_equal(h2.result(10), x + 2)
    finally:
        gate.open_all()
    ev = gate.events
    assert ev.index(("end", 1)) < ev.index(("admitted", 3))


def test_back_pressure_admits_a_run_only_while_fewer_than_depth_are_in_flight(prepared):
    depth, n = 2, 8
    rt, gate = gated_runtime(prepared, depth=depth)
    x = np.zeros(4, np.float32)
    handles = {}

    def submitter():
        for k in range(1, n + 1):
            handles[k] = rt.submit(x, key=k)

    t = threading.Thread(target=submitter)
    t.start()
    try:
        # open the gates newest-first within each window so completion order differs from submission order
        for k in range(1, n + 1):
            assert gate.wait_started(k, 10), f"run {k} never started"
            if k % 2 == 1 and k + 1 <= n:
                assert gate.wait_started(k + 1, 10)
                gate.open(k + 1)
                time.sleep(0.01)
                gate.open(k)
        t.join(20)
        assert not t.is_alive()
    finally:
        gate.open_all()
        t.join(20)
    for k, h in handles.items():
        np.testing.assert_array_equal(h.result(10), x + k)
    ev = gate.events
    admitted = [k for what, k in ev if what == "admitted"]
    assert admitted == list(range(1, n + 1)), "runs were admitted out of submission order"
    # Back-pressure: a run is admitted only once k - depth of the runs before it ended. Which ones
    # is not fixed: a submit that arrives after run k - depth + 1 ended (its window's newer run,
    # opened first) takes the slot it freed at once, while run k - depth may still be executing.
    for k in range(depth + 1, n + 1):
        before = ev[:ev.index(("admitted", k))]
        ended = sum(1 for what, _ in before if what == "end")
        assert ended >= k - depth, f"run {k} was admitted with {k - 1 - ended} runs in flight: {ev}"


def test_blocked_submitters_are_admitted_first_come_first_served(prepared):
    rt, gate = gated_runtime(prepared, depth=1)
    x = np.zeros(4, np.float32)
    h0 = rt.submit(x, key=100)
    results, threads = {}, []
    try:
        for k in (1, 2, 3):
            t = threading.Thread(target=lambda k=k: results.setdefault(k, rt.submit(x, key=k)))
            t.start()
            t.join(0.1)  # give it time to block before the next one arrives
            assert t.is_alive()
            threads.append(t)
        gate.open_all()
        for t in threads:
            t.join(20)
    finally:
        gate.open_all()
    for k in (1, 2, 3):
        np.testing.assert_array_equal(results[k].result(10), x + k)
    h0.result(10)
    admitted = [k for what, k in gate.events if what == "admitted"]
    assert admitted == [100, 1, 2, 3]


def test_runs_in_flight_overlap_on_the_workers(prepared):
    barrier = threading.Barrier(2, timeout=10)

    @engine.host_kernel
    def meet(a, out):
        barrier.wait()  # both runs' tasks must be executing at the same time
        out[...] = a

    @engine.program
    def prog(run, x: In((4,)), y: Out((4,))):
        run.submit(meet, x, out=y)

    rt = prepared(prog, depth=2, workers=2)
    x1, x2 = np.ones(4, np.float32), np.full(4, 2, np.float32)
    h1, h2 = rt.submit(x1), rt.submit(x2)
    np.testing.assert_array_equal(h1.result(20), x1)
    np.testing.assert_array_equal(h2.result(20), x2)


def test_orchestration_of_the_next_run_proceeds_while_the_previous_executes(prepared):
    rt, gate = gated_runtime(prepared, depth=2)
    x = np.zeros(4, np.float32)
    try:
        h1 = rt.submit(x, key=1)
        assert gate.wait_started(1)
        h2 = rt.submit(x, key=2)  # returns although run 1 is still executing
        assert not h1.done
        assert ("admitted", 2) in gate.events
    finally:
        gate.open_all()
    np.testing.assert_array_equal(h2.result(10), x + 2)
    np.testing.assert_array_equal(h1.result(10), x + 1)


def test_each_run_in_flight_keeps_its_own_inputs(prepared):
    rt, gate = gated_runtime(prepared, depth=3)
    xs = [np.full(4, 10 * i, np.float32) for i in range(3)]
    try:
        hs = [rt.submit(x, key=i) for i, x in enumerate(xs)]
        for x in xs:
            x[...] = -1  # callers may reuse their arrays once submit returned: inputs were staged
    finally:
        gate.open_all()
    for i, h in enumerate(hs):
        np.testing.assert_array_equal(h.result(10), 10 * i + i)


# -- cross-run dependencies on resident tensors ----------------------------------------------------
@engine.host_kernel(name="slow_write_row")
def slow_write_row(x, out):
    v = x.copy()
    time.sleep(0.002)  # lets a wrongly unordered task interleave
    out[...] = v


@engine.host_kernel(name="slow_prefix_sum")
def slow_prefix_sum(cache, out):
    s = cache.sum(axis=0, keepdims=True)
    time.sleep(0.001)
    out[...] = s


@engine.host_kernel(name="slow_accumulate")
def slow_accumulate(state, x, out):
    v = state + x
    time.sleep(0.002)
    out[...] = v


T, D = 24, 8


@engine.program
def decode_step(run, x: In((1, D)), cache: InOut((T, D)), state: InOut((1, D)), y: Out((1, D)), pos: Scalar(int)):
    run.submit(slow_write_row, x, out=cache[pos:pos + 1])
    run.submit(slow_prefix_sum, cache[0:pos + 1], out=y)
    run.submit(slow_accumulate, state, x, out=state)


def test_kv_cache_resident_inout_is_updated_in_order_by_pipelined_runs(prepared):
    rt = prepared(decode_step, depth=4, workers=2)
    rng = np.random.default_rng(2)
    xs = [rng.standard_normal((1, D)).astype(np.float32) for _ in range(T)]
    cache = rt.alloc_tensor((T, D), "float32", init=np.zeros((T, D), np.float32))
    state = rt.alloc_tensor((1, D), "float32", init=np.zeros((1, D), np.float32))
    s0 = rt.memory_stats()
    handles = [rt.submit(x, cache, state, pos=i) for i, x in enumerate(xs)]  # no waiting in between
    ys = [h.result(30)[2] for h in handles]
    s1 = rt.memory_stats()
    xs_all = np.concatenate(xs)
    for i, y in enumerate(ys):
        np.testing.assert_allclose(y[0], xs_all[: i + 1].sum(axis=0), rtol=1e-5, atol=1e-5,
                                   err_msg=f"step {i} saw a cache out of order")
    np.testing.assert_allclose(cache.to_numpy(), xs_all, rtol=0, atol=0)
    np.testing.assert_allclose(state.to_numpy()[0], xs_all.sum(axis=0), rtol=1e-5, atol=1e-5)
    # only x in and y out crossed: the cache and the state stayed resident
    assert s1["h2d_bytes"] - s0["h2d_bytes"] == T * xs[0].nbytes
    assert s1["d2h_bytes"] - s0["d2h_bytes"] == T * D * 4


def test_pipelined_runs_over_a_shared_resident_tensor_match_sequential_execution(prepared):
    @engine.program
    def step(run, x: In((1, D)), state: InOut((1, D)), y: Out((1, D))):
        run.submit(slow_accumulate, state, x, out=state)
        run.submit(k_copy, state, out=y)

    rt_seq = prepared(step, depth=1, workers=1)
    rt_par = prepared(step, depth=4, workers=2)
    rng = np.random.default_rng(9)
    xs = [rng.standard_normal((1, D)).astype(np.float32) for _ in range(20)]
    s_seq = rt_seq.alloc_tensor((1, D), init=np.zeros((1, D), np.float32))
    s_par = rt_par.alloc_tensor((1, D), init=np.zeros((1, D), np.float32))
    expect = [rt_seq(x, s_seq)[1].copy() for x in xs]
    handles = [rt_par.submit(x, s_par) for x in xs]
    got = [h.result(30)[1] for h in handles]
    for e, g in zip(expect, got):
        np.testing.assert_array_equal(g, e)


def test_resident_weights_only_per_run_inputs_cross_to_the_device(prepared):
    @engine.host_kernel
    def mm(a, b, out):
        np.matmul(a, b, out=out)

    @engine.program
    def layer(run, x: In(("B", 16)), w: In((16, 16)), y: Out(("B", 16))):
        run.submit(mm, x, w, out=y)

    rt = prepared(layer, bounds={"B": 8}, depth=3, workers=2)
    rng = np.random.default_rng(4)
    w = rng.standard_normal((16, 16)).astype(np.float32)
    w_dev = rt.alloc_tensor((16, 16), "float32", init=w)
    xs = [rng.standard_normal((b, 16)).astype(np.float32) for b in (8, 3, 5, 1, 8, 2) * 3]
    s0 = rt.memory_stats()
    handles = [rt.submit(x, w_dev) for x in xs]
    ys = [h.result(20) for h in handles]
    s1 = rt.memory_stats()
    assert s1["h2d_bytes"] - s0["h2d_bytes"] == sum(x.nbytes for x in xs)
    assert s1["d2h_bytes"] - s0["d2h_bytes"] == sum(y.nbytes for y in ys)
    for x, y in zip(xs, ys):
        np.testing.assert_allclose(y, x @ w, rtol=1e-4, atol=1e-4)


def test_every_run_releases_its_slot_exactly_once(prepared):
    """Successful, failing and aborted runs each advance their slot's generation by exactly one."""

    @engine.host_kernel(name="maybe_fail")
    def maybe_fail(a, out, mode):
        if mode == 1:
            raise RuntimeError("kernel failure")
        out[...] = a

    @engine.program
    def prog(run, x: In((4,)), y: Out((4,)), mode: Scalar(int)):
        if mode == 2 and not run.planning:
            raise KeyError("orchestration failure")
        run.submit(maybe_fail, x, out=y, mode=mode)

    rt = prepared(prog, depth=3, workers=2)
    table = rt._slot_table
    start = slot_generations(table)
    x = np.zeros(4, np.float32)
    handles, leases = [], 0
    for i in range(60):
        mode = (0, 0, 1, 2)[i % 4]
        leases += 1
        try:
            handles.append(rt.submit(x, mode=mode))
        except KeyError:
            pass
    for h in handles:
        h.wait(10)
        h.wait(10)  # waiting again does not release again
        h.exception()
    assert table.free_count == 3
    # slot_generations leases and releases each slot once itself
    assert slot_generations(table) - start - table.depth == leases


def slot_generations(table):
    """The sum of the slots' generations (read by leasing every slot, then giving each back)."""
    held = [table.try_lease() for _ in range(table.depth)]
    assert None not in held, "a slot is still leased"
    for index, generation in held:
        table.release(index, generation)
    return sum(generation for _, generation in held)


def test_a_prepared_call_is_checked_once_and_submits_like_a_plain_one():
    device = _native.Device(0)
    eng = _native.Engine(device, 1)
    try:
        calls = []
        kernel = eng.register_host_kernel("count", lambda k: calls.append(k))
        with pytest.raises(ValueError, match="access tags"):
            eng.prepare_call(kernel, [], [1])
        with pytest.raises(TypeError, match="scalar"):
            eng.prepare_call(kernel, [], [], ["x"])
        call = eng.prepare_call(kernel, [], [], [7])
        assert call.kernel.name == "count" and call.tensor_count == 0
        run = eng.begin_run(False)
        for _ in range(3):
            eng.submit_prepared(run, call)
        eng.submit(run, kernel, [], [], [8])
        eng.seal(run)
        assert run.wait(10) and run.task_count == 4
        assert sorted(calls) == [7, 7, 7, 8]
        with pytest.raises(ValueError, match="sealed"):
            eng.submit_prepared(run, call)
    finally:
        eng.close(True)
