"""Data-parallel, tensor-parallel and chained programs on 2 chip workers, against numpy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.distributed import programs as P
from tests.distributed.conftest import mlp_reference, randn

B = 24


@pytest.fixture(scope="module")
def weights():
    rng = np.random.default_rng(7)
    return randn(rng, P.D, P.H, scale=0.2), randn(rng, P.H, P.D, scale=0.2)


@pytest.fixture(scope="module")
def dp(prepare):
    return prepare(P.dp_mlp, depth=2, bounds={"B": B})


@pytest.fixture(scope="module")
def dp_resident(prepare):
    return prepare(P.dp_mlp_resident, depth=2, bounds={"B": B})


@pytest.fixture(scope="module")
def tp(prepare):
    return prepare(P.tp_matmul, depth=2, bounds={"B": B}, callbacks={"gather": P.gather})


@pytest.fixture(scope="module")
def chain(prepare):
    return prepare(P.chain, depth=3, bounds={"B": B}, callbacks={"double": P.double})


# -- data parallel -------------------------------------------------------------------------------------
def test_data_parallel_mlp_matches_numpy(dp, weights):
    w1, w2 = weights
    rng = np.random.default_rng(1)
    for b in (B, 7, 1):  # the last shard sizes differ; B=1 leaves worker 1 without rows
        x = randn(rng, b, P.D)
        y = dp(x, w1, w2)
        assert y.shape == (b, P.D) and y.dtype == np.float32
        np.testing.assert_allclose(y, mlp_reference(x, w1, w2), rtol=1e-4, atol=1e-5)


def test_data_parallel_runs_each_shard_on_its_worker(dp, weights):
    w1, w2 = weights
    x = randn(np.random.default_rng(2), B, P.D)
    dp.set_tracing(True)
    try:
        dp(x, w1, w2)
        _spans, events = dp.drain_trace()
    finally:
        dp.set_tracing(False)
    assert sorted(e[2] for e in events) == [0, 1]
    assert {e[5] for e in events} == {"mlp_shard"}
    assert all(e[6] for e in events)


def test_outputs_are_written_into_the_callers_arrays(dp, weights):
    w1, w2 = weights
    x = randn(np.random.default_rng(3), B, P.D)
    y = np.zeros((B, P.D), np.float32)
    assert dp(x, w1, w2, y) is y
    np.testing.assert_allclose(y, mlp_reference(x, w1, w2), rtol=1e-4, atol=1e-5)
    # A non-contiguous output array is filled through a copy.
    wide = np.zeros((B, 2 * P.D), np.float32)
    out = wide[:, ::2]
    assert dp(x, w1, w2, y=out) is out
    np.testing.assert_allclose(wide[:, ::2], mlp_reference(x, w1, w2), rtol=1e-4, atol=1e-5)
    assert not wide[:, 1::2].any()


def test_torch_inputs_give_torch_outputs(dp, weights):
    w1, w2 = weights
    x = randn(np.random.default_rng(4), 5, P.D)
    y = dp(torch.from_numpy(x), torch.from_numpy(w1), torch.from_numpy(w2))
    assert isinstance(y, torch.Tensor)
    np.testing.assert_allclose(y.numpy(), mlp_reference(x, w1, w2), rtol=1e-4, atol=1e-5)


def test_many_runs_in_flight_keep_their_own_data(dp, weights):
    w1, w2 = weights
    rng = np.random.default_rng(5)
    xs = [randn(rng, B, P.D) for _ in range(12)]
    handles = [dp.submit(x, w1, w2) for x in xs]  # depth 2: submit reaps the oldest as needed
    for x, h in zip(xs, handles):
        np.testing.assert_allclose(h.result(timeout=30), mlp_reference(x, w1, w2), rtol=1e-4, atol=1e-5)
    assert dp.memory_stats()["free_slots"] == 2


def test_bad_arguments_raise_before_anything_runs(dp, weights):
    w1, w2 = weights
    x = randn(np.random.default_rng(6), B, P.D)
    with pytest.raises(TypeError, match="dtype"):
        dp(x.astype(np.float64), w1, w2)
    with pytest.raises(TypeError, match="w1"):
        dp(x, w2, w2)
    with pytest.raises(ValueError, match="exceeds its bound"):
        dp(np.zeros((B + 1, P.D), np.float32), w1, w2)
    with pytest.raises(TypeError, match="takes 4 arguments"):
        dp(x, w1, w2, x, x)
    assert dp.memory_stats()["free_slots"] == 2


# -- resident weights per worker --------------------------------------------------------------------------
@pytest.fixture
def replicas(dp_resident, weights):
    """(w1s, w2s): the weights resident on every worker; whatever the lists hold at the end is freed."""
    drt = dp_resident
    w1, w2 = weights
    w1s = [drt.alloc_tensor(w1.shape, "float32", init=w1, worker_id=i) for i in range(drt.workers)]
    w2s = [drt.alloc_tensor(w2.shape, "float32", init=w2, worker_id=i) for i in range(drt.workers)]
    yield w1s, w2s
    for t in w1s + w2s:
        drt.free_tensor(t)


def test_resident_weights_per_worker(dp_resident, weights, replicas):
    drt = dp_resident
    w1, w2 = weights
    w1s, w2s = replicas
    for i in range(drt.workers):
        assert drt.memory_stats(worker_id=i)["live_allocations"] >= 2
        np.testing.assert_array_equal(w1s[i].to_numpy(), w1)
    x = randn(np.random.default_rng(8), B, P.D)
    for _ in range(3):
        np.testing.assert_allclose(drt(x, w1s, w2s), mlp_reference(x, w1, w2), rtol=1e-4, atol=1e-5)
    # Different weights per worker: each shard uses its own worker's copy.
    drt.free_tensor(w2s[1])
    w2s[1] = drt.alloc_tensor(w2.shape, "float32", init=2 * w2, worker_id=1)
    y = drt(x, w1s, w2s)
    half = B // 2
    np.testing.assert_allclose(y[:half], mlp_reference(x[:half], w1, w2), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(y[half:], mlp_reference(x[half:], w1, 2 * w2), rtol=1e-4, atol=1e-5)


def test_resident_tensor_on_the_wrong_worker_raises_value_error(dp_resident, weights, replicas):
    drt = dp_resident
    w1, w2 = weights
    w1s, w2s = replicas
    x = randn(np.random.default_rng(9), B, P.D)
    with pytest.raises(ValueError, match="resident on worker 1, not on worker 0"):
        drt(x, w1s[::-1], w2s)
    with pytest.raises(TypeError, match="one per worker"):
        drt(x, w1s[:1], w2s)
    with pytest.raises(TypeError, match="one resident tensor per worker"):
        drt(x, w1, w2s)
    assert drt.memory_stats()["free_slots"] == 2
    np.testing.assert_allclose(drt(x, w1s, w2s), mlp_reference(x, w1, w2), rtol=1e-4, atol=1e-5)


def test_calls_shaped_like_an_earlier_one_bind_from_the_cache_with_every_check(dp_resident, weights, replicas):
    drt = dp_resident
    w1, w2 = weights
    w1s, w2s = replicas
    x = randn(np.random.default_rng(11), B, P.D)
    for _ in range(2):
        np.testing.assert_allclose(drt(x, w1s, w2s), mlp_reference(x, w1, w2), rtol=1e-4, atol=1e-5)
    assert len(drt._binds._shapes) >= 1  # the signature was learned: later calls bind from it
    x2 = randn(np.random.default_rng(12), B, P.D)  # new values, same shape: the cached binding sees them
    np.testing.assert_allclose(drt(x2, w1s, w2s), mlp_reference(x2, w1, w2), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="resident on worker 0, not on worker 1"):
        drt(x, w1s, [w2s[0], w2s[0]])  # the first replica as before, the second is checked per call
    drt.free_tensor(w1s[0])
    with pytest.raises(ValueError, match="freed"):
        drt(x, w1s, w2s)  # a cached signature still checks its resident tensors are alive
    assert drt.memory_stats()["free_slots"] == 2
    w1s[0] = drt.alloc_tensor(w1.shape, "float32", init=w1, worker_id=0)
    np.testing.assert_allclose(drt(x, w1s, w2s), mlp_reference(x, w1, w2), rtol=1e-4, atol=1e-5)


def test_orchestration_passing_a_resident_to_another_worker_runs_nothing(prepare):
    drt = prepare(P.pinned_wrong, depth=2, bounds={"B": 4})
    acc = drt.alloc_tensor((4, P.D), "float32", init=np.ones((4, P.D), np.float32), worker_id=0)
    with pytest.raises(ValueError, match="resident on worker 0, so it cannot be passed to a program on worker 1"):
        drt(np.ones((4, P.D), np.float32), acc)
    np.testing.assert_array_equal(acc.to_numpy(), np.ones((4, P.D), np.float32))
    assert drt.memory_stats()["free_slots"] == 2
    on1 = drt.alloc_tensor((4, P.D), "float32", init=np.ones((4, P.D), np.float32), worker_id=1)
    drt(np.ones((4, P.D), np.float32), on1)
    np.testing.assert_array_equal(on1.to_numpy(), np.full((4, P.D), 2.0, np.float32))


def test_workers_of_two_threads_share_the_work_between_the_serving_thread_and_a_pool_thread(prepare, weights):
    # worker_threads=2: the serving thread runs tasks when it has no message, a pool thread at any time, and
    # completions come back from either (the tests above use one thread: the serving thread alone).
    drt = prepare(P.dp_mlp, depth=3, bounds={"B": B}, worker_threads=2)
    assert drt.worker_threads == 2
    w1, w2 = weights
    rng = np.random.default_rng(13)
    xs = [randn(rng, B, P.D) for _ in range(40)]
    handles = [drt.submit(x, w1, w2) for x in xs]  # three in flight: calls arrive while tasks run
    for x, h in zip(xs, handles):
        np.testing.assert_allclose(h.result(timeout=60), mlp_reference(x, w1, w2), rtol=1e-4, atol=1e-5)
    assert drt.memory_stats()["free_slots"] == 3


# -- tensor parallel ------------------------------------------------------------------------------------------
def test_tensor_parallel_matmul_gathers_column_shards(tp):
    rng = np.random.default_rng(10)
    w = randn(rng, P.KD, P.N)
    for b in (B, 3):
        x = randn(rng, b, P.KD)
        np.testing.assert_allclose(tp(x, w), x @ w, rtol=1e-4, atol=1e-4)


def test_gather_waits_for_both_shards(tp):
    rng = np.random.default_rng(11)
    w = randn(rng, P.KD, P.N)
    xs = [randn(rng, B, P.KD) for _ in range(8)]
    tp.set_tracing(True)
    try:
        handles = [tp.submit(x, w) for x in xs]
        for x, h in zip(xs, handles):
            np.testing.assert_allclose(h.result(timeout=30), x @ w, rtol=1e-4, atol=1e-4)
        _spans, events = tp.drain_trace()
    finally:
        tp.set_tracing(False)
    by_run: dict[int, dict[str, tuple[int, int]]] = {}
    for run_id, _index, worker, t0, t1, name, ok in events:
        assert ok
        by_run.setdefault(run_id, {})[f"{name}@{worker}"] = (t0, t1)
    assert len(by_run) == len(xs)
    for tasks in by_run.values():
        gather_start = tasks["callback:gather@-1"][0]
        assert tasks["matmul@0"][1] <= gather_start and tasks["matmul@1"][1] <= gather_start


# -- dependencies across workers and the host ---------------------------------------------------------------
def test_worker_host_worker_chain_is_ordered(chain):
    rng = np.random.default_rng(12)
    xs = [randn(rng, B, P.D) for _ in range(10)]
    handles = [chain.submit(x) for x in xs]
    for x, h in zip(xs, handles):
        np.testing.assert_allclose(h.result(timeout=30), x * 3.0 * 2.0 * 0.5, rtol=1e-6)


def test_resident_accumulator_applies_runs_in_dispatch_order(prepare):
    drt = prepare(P.accumulate, depth=2, bounds={"B": 4})
    for worker in range(drt.workers):
        acc = drt.alloc_tensor((4, P.D), "float32", init=np.zeros((4, P.D), np.float32), worker_id=worker)
        handles = [drt.submit(np.full((4, P.D), float(k), np.float32), acc, worker) for k in range(1, 21)]
        for h in handles:
            h.result(timeout=30)
        np.testing.assert_array_equal(acc.to_numpy(), np.full((4, P.D), sum(range(1, 21)), np.float32))
        assert handles[-1].result() is acc  # a resident InOut comes back as itself
        drt.free_tensor(acc)


def test_repeated_submissions_are_still_checked_every_run(prepare):
    drt = prepare(P.scaled_on, depth=2, bounds={"B": 4})
    x = np.ones((4, P.D), np.float32)
    acc = drt.alloc_tensor((4, P.D), "float32", init=np.zeros((4, P.D), np.float32), worker_id=0)
    for factor in (1.0, 2.0, 3.0):  # same layout every run: the scalar still comes from this run
        out_acc, y = drt(x, acc, None, factor, 0)
        assert out_acc is acc
        np.testing.assert_array_equal(y, factor * x)
    np.testing.assert_array_equal(acc.to_numpy(), 3.0 * x)
    with pytest.raises(ValueError, match="resident on worker 0, so it cannot be passed to a program on worker 1"):
        drt(x, acc, None, 1.0, 1)
    stale = drt.alloc_tensor((4, P.D), "float32", init=np.zeros((4, P.D), np.float32), worker_id=0)
    drt(x, stale, None, 1.0, 0)
    drt.free_tensor(stale)
    with pytest.raises(ValueError, match="freed"):
        drt(x, stale, None, 1.0, 0)
    np.testing.assert_array_equal(acc.to_numpy(), 3.0 * x)  # nothing ran for the rejected runs
    assert drt.memory_stats()["free_slots"] == 2
