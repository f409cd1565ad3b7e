"""Programs built from engine.kernels (the built-in native kernels), checked against numpy."""

import math

import numpy as np
import pytest

import engine
from engine import In, InOut, Out, Scalar
from engine import kernels as K

from .conftest import k_scale

RTOL = 1e-4

_erf = np.frompyfunc(math.erf, 1, 1)


def gelu_exact(x):
    return (0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)).astype(np.float64))).astype(np.float32)


def gelu_tanh(x):
    x = x.astype(np.float64)
    return (0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))).astype(np.float32)


def test_kernels_namespace_is_importable():
    assert engine.kernels is K
    for name in ("matmul", "add", "gelu", "noop", "spin"):
        k = getattr(K, name)
        assert hasattr(k, "bind") and k.name == name


# the program of DESIGN.md section 4
@engine.program
def mlp(run: engine.Run, x: In(("B", 384)), w1: In((384, 1536)), w2: In((1536, 384)), y: Out(("B", 384))):
    h = run.scratch(("B", 1536), "float32")
    run.submit(K.matmul, x, w1, out=h)
    run.submit(K.gelu, h, out=h)
    run.submit(K.matmul, h, w2, out=y)


@pytest.fixture(scope="module")
def mlp_weights():
    rng = np.random.default_rng(0)
    w1 = (rng.standard_normal((384, 1536)) / math.sqrt(384)).astype(np.float32)
    w2 = (rng.standard_normal((1536, 384)) / math.sqrt(1536)).astype(np.float32)
    return w1, w2


def mlp_ref(x, w1, w2):
    h = (x.astype(np.float64) @ w1.astype(np.float64)).astype(np.float32)
    return gelu_exact(h).astype(np.float64) @ w2.astype(np.float64)


def test_design_mlp_with_resident_weights_matches_numpy(prepared, mlp_weights):
    w1, w2 = mlp_weights
    rt = prepared(mlp, device="cpu", workers=None, depth=2, bounds={"B": 64})
    w1_dev = rt.alloc_tensor((384, 1536), "float32", init=w1)
    w2_dev = rt.alloc_tensor((1536, 384), "float32", init=w2)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((64, 384)).astype(np.float32)
    s0 = rt.memory_stats()
    y = rt(x, w1_dev, w2_dev)
    s1 = rt.memory_stats()
    np.testing.assert_allclose(y, mlp_ref(x, w1, w2), rtol=RTOL, atol=1e-4)
    assert s1["h2d_bytes"] - s0["h2d_bytes"] == x.nbytes
    assert s1["d2h_bytes"] - s0["d2h_bytes"] == y.nbytes


def test_design_mlp_pipelined_with_varying_batch(prepared, mlp_weights):
    w1, w2 = mlp_weights
    rt = prepared(mlp, depth=3, workers=2, bounds={"B": 64})
    w1_dev = rt.alloc_tensor((384, 1536), "float32", init=w1)
    w2_dev = rt.alloc_tensor((1536, 384), "float32", init=w2)
    rng = np.random.default_rng(2)
    xs = [rng.standard_normal((b, 384)).astype(np.float32) for b in (1, 17, 64, 5, 32, 2)]
    handles = [rt.submit(x, w1_dev, w2_dev) for x in xs]
    for x, h in zip(xs, handles):
        np.testing.assert_allclose(h.result(30), mlp_ref(x, w1, w2), rtol=RTOL, atol=1e-4)


def test_design_mlp_with_torch_inputs(prepared, mlp_weights):
    torch = pytest.importorskip("torch")
    w1, w2 = mlp_weights
    rt = prepared(mlp, bounds={"B": 64})
    x = torch.randn(8, 384, generator=torch.Generator().manual_seed(3))
    y = rt(x, torch.from_numpy(w1), torch.from_numpy(w2))
    assert isinstance(y, torch.Tensor)
    np.testing.assert_allclose(y.numpy(), mlp_ref(x.numpy(), w1, w2), rtol=RTOL, atol=1e-4)


@engine.program
def block(run, x: In(("B", 32)), w1: In((32, 64)), b1: In((64,)), w2: In((64, 32)), y: Out(("B", 32))):
    h = run.scratch(("B", 64))
    for xi, hi in zip(run.split(x), run.split(h)):  # tiled across the workers
        run.submit(K.matmul, xi, w1, out=hi)
    run.submit(K.add, h, b1, out=h)  # bias broadcast over rows, in place
    run.submit(K.gelu, h, out=h, approximate="tanh")
    run.submit(K.matmul, h, w2, out=y)
    run.submit(K.add, y, x, out=y)  # residual


def test_tiled_block_with_bias_tanh_gelu_and_residual(prepared):
    rt = prepared(block, bounds={"B": 48}, workers=2, depth=2)
    rng = np.random.default_rng(4)
    w1 = (rng.standard_normal((32, 64)) / 6).astype(np.float32)
    b1 = rng.standard_normal(64).astype(np.float32)
    w2 = (rng.standard_normal((64, 32)) / 8).astype(np.float32)
    for b in (48, 13, 1):
        x = rng.standard_normal((b, 32)).astype(np.float32)
        expect = gelu_tanh(x @ w1 + b1).astype(np.float64) @ w2 + x
        np.testing.assert_allclose(rt(x, w1, b1, w2), expect, rtol=RTOL, atol=1e-4)


def test_matmul_transpose_alpha_beta(prepared):
    @engine.program
    def prog(run, a: In((6, 5)), b: In((7, 5)), c: InOut((6, 7))):
        run.submit(K.matmul, a, b, out=c, transpose_b=True, alpha=0.5, beta=2.0)

    rt = prepared(prog)
    rng = np.random.default_rng(5)
    a = rng.standard_normal((6, 5)).astype(np.float32)
    b = rng.standard_normal((7, 5)).astype(np.float32)
    c = rng.standard_normal((6, 7)).astype(np.float32)
    expect = 0.5 * a @ b.T + 2.0 * c
    got = rt(a, b, c)
    assert got is c
    np.testing.assert_allclose(c, expect, rtol=RTOL, atol=1e-5)


def test_kernels_on_strided_views_and_mixed_with_host_kernels(prepared):
    @engine.program
    def prog(run, x: In((8, 12)), y: Out((8, 6))):
        g = run.scratch((8, 6))
        run.submit(K.gelu, x[:, ::2], out=g)  # a strided input view
        run.submit(k_scale, g, out=y, factor=3.0)  # a host kernel reading the built-in's output
        run.submit(K.add, y, x[:, 1::2], out=y)

    rt = prepared(prog, workers=2)
    x = np.random.default_rng(6).standard_normal((8, 12)).astype(np.float32)
    expect = 3.0 * gelu_exact(x[:, ::2]) + x[:, 1::2]
    np.testing.assert_allclose(rt(x), expect, rtol=RTOL, atol=1e-5)


def test_kernel_signature_errors_fail_at_prepare():
    @engine.program
    def bad_inner(run, a: In((4, 5)), b: In((6, 3)), c: Out((4, 3))):
        run.submit(K.matmul, a, b, out=c)

    with pytest.raises(TypeError, match="matmul"):
        bad_inner.prepare()

    @engine.program
    def bad_scalar(run, x: In((4,)), y: Out((4,))):
        run.submit(K.gelu, x, out=y, approximate="cubic")

    with pytest.raises(ValueError, match="gelu"):
        bad_scalar.prepare()


def test_noop_and_spin(prepared):
    @engine.program
    def prog(run, x: In((4,)), y: Out((4,)), ns: Scalar(int)):
        run.submit(K.noop)
        run.submit(K.spin, ns=ns)
        run.submit(K.add, x, x, out=y)

    rt = prepared(prog, workers=2)
    x = np.arange(4, dtype=np.float32)
    hs = [rt.submit(x, ns=100_000) for _ in range(4)]
    for h in hs:
        np.testing.assert_array_equal(h.result(10), 2 * x)


def test_builtin_kernel_steady_state_allocates_nothing(prepared):
    rt = prepared(block, bounds={"B": 16}, workers=2)
    rng = np.random.default_rng(7)
    args = [rng.standard_normal(s).astype(np.float32) for s in ((16, 32), (32, 64), (64,), (64, 32))]
    dev = [rt.alloc_tensor(a.shape, "float32", init=a) for a in args[1:]]
    rt(args[0], *dev)
    s = rt.memory_stats()
    before = (s["total_allocations"], s["bytes_in_use"])
    for _ in range(200):
        y = rt(args[0], *dev)
    s = rt.memory_stats()
    assert (s["total_allocations"], s["bytes_in_use"]) == before
    x, w1, b1, w2 = args
    np.testing.assert_allclose(y, gelu_tanh(x @ w1 + b1).astype(np.float64) @ w2 + x, rtol=RTOL, atol=1e-4)
