"""Argument validation: every bad argument is rejected before anything reaches the device."""

import numpy as np
import pytest

import engine
from engine import In, InOut, Out, Scalar

from .conftest import k_add, k_scale


@engine.program
def prog(run, x: In(("B", "N")), w: In(("N", 4)), acc: InOut(("B", 4)), y: Out(("B", 4)), alpha: Scalar(float),
         steps: Scalar(int)):
    h = run.scratch(("B", 4))

    @engine.host_kernel
    def mm(a, b, out):
        np.matmul(a, b, out=out)

    run.submit(mm, x, w, out=h)
    run.submit(k_scale, h, out=y, factor=alpha)
    run.submit(k_add, acc, y, out=acc)


BOUNDS = {"B": 8, "N": 6}


@pytest.fixture
def rt(prepared):
    return prepared(prog, bounds=BOUNDS, depth=2)


def good_args(b=3, n=5):
    rng = np.random.default_rng(0)
    return dict(x=rng.standard_normal((b, n)).astype(np.float32), w=rng.standard_normal((n, 4)).astype(np.float32),
                acc=np.zeros((b, 4), np.float32), alpha=2.0, steps=1)


def check_good_call(rt, **overrides):
    a = {**good_args(), **overrides}
    acc0 = a["acc"].copy()
    acc_out, y = rt(a["x"], a["w"], a["acc"], alpha=a["alpha"], steps=a["steps"])  # declaration order
    assert acc_out is a["acc"]
    np.testing.assert_allclose(y, 2 * (a["x"] @ a["w"]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(a["acc"], acc0 + y, rtol=1e-5, atol=1e-5)


def rejects(rt, exc, *patterns, args=(), **kwargs):
    """Asserts the call raises exc mentioning every pattern, with no device traffic, and the runtime still works."""
    before = rt.memory_stats()
    with pytest.raises(exc) as ei:
        rt(*args, **kwargs)
    msg = str(ei.value)
    for p in patterns:
        assert p in msg, f"{p!r} not in {msg!r}"
    assert rt.memory_stats() == before, "a rejected call touched the device"
    with pytest.raises(exc):
        rt.submit(*args, **kwargs)
    assert rt.memory_stats() == before
    check_good_call(rt)
    return msg


def test_good_call(rt):
    check_good_call(rt)


def test_too_many_positional_arguments(rt):
    a = good_args()
    rejects(rt, TypeError, "6", "7", args=(a["x"], a["w"], a["acc"], None, 1.0, 1, 99))


def test_missing_arguments_name_the_parameter(rt):
    a = good_args()
    rejects(rt, TypeError, "'w'", args=(a["x"],), acc=a["acc"], alpha=1.0, steps=1)
    rejects(rt, TypeError, "'acc'", x=a["x"], w=a["w"], alpha=1.0, steps=1)
    rejects(rt, TypeError, "'alpha'", x=a["x"], w=a["w"], acc=a["acc"], steps=1)
    rejects(rt, TypeError, "'steps'", x=a["x"], w=a["w"], acc=a["acc"], alpha=1.0)
    rejects(rt, TypeError, "'x'", x=None, w=a["w"], acc=a["acc"], alpha=1.0, steps=1)


def test_unexpected_and_duplicate_keywords(rt):
    a = good_args()
    rejects(rt, TypeError, "'bogus'", **a, bogus=1)
    rejects(rt, TypeError, "'x'", args=(a["x"],), **a)


def test_wrong_dtype_names_the_parameter_and_the_expected_dtype(rt):
    a = good_args()
    a["w"] = a["w"].astype(np.float16)
    rejects(rt, TypeError, "'w'", "float32", "float16", **a)
    a = good_args()
    a["x"] = a["x"].astype(np.float64)  # not an engine dtype at all
    with pytest.raises(TypeError, match="float64"):
        rt(**a)


def test_wrong_fixed_dim_names_the_parameter_and_the_expected_dim(rt):
    a = good_args()
    a["w"] = np.zeros((5, 3), np.float32)
    rejects(rt, TypeError, "'w'", "4", "(5, 3)", **a)


def test_wrong_number_of_dims(rt):
    a = good_args()
    a["acc"] = np.zeros((3, 4, 1), np.float32)
    rejects(rt, TypeError, "'acc'", "2", **a)


def test_symbol_bound_two_ways_names_the_parameter_and_symbol(rt):
    a = good_args(b=3, n=5)
    a["acc"] = np.zeros((2, 4), np.float32)  # B is 3 from x
    msg = rejects(rt, TypeError, "'acc'", "'B'", **a)
    assert "3" in msg and "2" in msg
    a = good_args(b=3, n=5)
    a["w"] = np.zeros((4, 4), np.float32)  # N is 5 from x
    rejects(rt, TypeError, "'w'", "'N'", **a)


def test_passed_out_must_agree_with_the_symbols(rt):
    a = good_args(b=3)
    y = np.zeros((4, 4), np.float32)
    rejects(rt, TypeError, "'y'", "'B'", args=(a["x"], a["w"], a["acc"], y), alpha=1.0, steps=1)


def test_dim_beyond_its_bound_is_a_value_error_naming_the_bound(rt):
    a = good_args(b=9, n=5)
    rejects(rt, ValueError, "'x'", "B", "9", "8", **a)
    a = good_args(b=3, n=7)
    rejects(rt, ValueError, "N", "7", "6", **a)


def test_dims_at_the_bound_are_accepted(rt):
    a = good_args(b=8, n=6)
    _, y = rt(**a)
    np.testing.assert_allclose(y, 2 * a["x"] @ a["w"], rtol=1e-5, atol=1e-5)


def test_zero_sized_dim_is_a_value_error(rt):
    a = good_args(b=0)
    rejects(rt, ValueError, "'x'", **a)


def test_scalar_type_errors_name_the_parameter(rt):
    a = good_args()
    rejects(rt, TypeError, "'alpha'", **{**a, "alpha": "2.0"})
    rejects(rt, TypeError, "'steps'", **{**a, "steps": 1.5})
    rejects(rt, TypeError, "'steps'", **{**a, "steps": True})
    rejects(rt, TypeError, "'alpha'", **{**a, "alpha": np.zeros(2, np.float32)})


def test_non_array_arguments_are_type_errors(rt):
    a = good_args()
    rejects(rt, TypeError, "'w'", **{**a, "w": a["w"].tolist()})
    rejects(rt, TypeError, "'x'", **{**a, "x": 3.0})


def test_device_tensor_with_wrong_shape_or_dtype(rt):
    a = good_args()
    w_dev = rt.alloc_tensor((5, 3), "float32")
    rejects(rt, TypeError, "'w'", **{**a, "w": w_dev})
    w16 = rt.alloc_tensor((5, 4), "float16")
    rejects(rt, TypeError, "'w'", "float32", **{**a, "w": w16})


def test_read_only_output_is_a_value_error(rt):
    a = good_args()
    acc = a["acc"]
    acc.flags.writeable = False
    rejects(rt, ValueError, "'acc'", **a)


def test_torch_tensor_not_on_the_cpu_is_rejected(rt):
    torch = pytest.importorskip("torch")
    a = good_args()
    meta = torch.empty((5, 4), device="meta")
    before = rt.memory_stats()
    with pytest.raises(TypeError, match="cpu|CPU"):
        rt(**{**a, "w": meta})
    assert rt.memory_stats() == before
    check_good_call(rt)


def test_a_kernel_rejecting_its_arguments_during_orchestration_leaves_the_runtime_usable(prepared):
    @engine.program
    def bad(run, x: In((4,)), y: Out((4,)), mode: Scalar(int)):
        if mode == 1:
            run.submit(k_add, x, x, out=y, bogus=object())  # a scalar that is not a number
        elif mode == 2:
            run.submit(k_add, x, np.zeros(4, np.float32), out=y)  # a host array is not a device tensor
        else:
            run.submit(k_add, x, x, out=y)

    rt = prepared(bad, depth=1)
    x = np.ones(4, np.float32)
    for mode in (1, 2):
        with pytest.raises((TypeError, ValueError)):
            rt(x, mode=mode)
        assert rt.memory_stats()["free_slots"] == 1
    np.testing.assert_array_equal(rt(x, mode=0), 2 * x)


# -- non-contiguous host arrays are staged through contiguous copies ----------------------------
def test_non_contiguous_inputs(rt):
    rng = np.random.default_rng(1)
    big = rng.standard_normal((6, 10)).astype(np.float32)
    x = big[::2, 1:6]  # (3, 5), strided
    w = np.asfortranarray(rng.standard_normal((5, 4)).astype(np.float32))
    assert not x.flags.c_contiguous and not w.flags.c_contiguous
    big_before, w_before = big.copy(), w.copy()
    acc = np.zeros((3, 4), np.float32)
    _, y = rt(x, w, acc, alpha=1.0, steps=1)
    np.testing.assert_allclose(y, x @ w, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(big, big_before)
    np.testing.assert_array_equal(w, w_before)


def test_non_contiguous_outputs_are_filled_through_a_copy(rt):
    a = good_args(b=3)
    acc_parent = np.full((3, 8), 7, np.float32)
    acc = acc_parent[:, ::2]  # InOut, strided
    y_parent = np.full((6, 4), -1, np.float32)
    y = y_parent[::2]  # Out, strided
    assert not acc.flags.c_contiguous and not y.flags.c_contiguous
    got = rt(a["x"], a["w"], acc, y, alpha=1.0, steps=1)
    expect = a["x"] @ a["w"]
    assert got[0] is acc and got[1] is y
    np.testing.assert_allclose(y_parent[::2], expect, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(y_parent[1::2], -1)  # untouched between the strided rows
    np.testing.assert_allclose(acc_parent[:, ::2], 7 + expect, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(acc_parent[:, 1::2], 7)


def test_non_contiguous_outputs_through_submit(rt):
    a = good_args(b=2)
    y_parent = np.zeros((2, 8), np.float32)
    acc = np.zeros((4, 2), np.float32).T  # (2, 4), Fortran-ordered
    h = rt.submit(a["x"], a["w"], acc, y_parent[:, 4:], alpha=1.0, steps=1)
    h.result(10)
    expect = a["x"] @ a["w"]
    np.testing.assert_allclose(y_parent[:, 4:], expect, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(y_parent[:, :4], 0)
    np.testing.assert_allclose(acc, expect, rtol=1e-5, atol=1e-5)


def test_non_contiguous_torch_tensors(rt):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    x = torch.randn(5, 3).t()  # (3, 5)
    w = torch.randn(4, 5).t()  # (5, 4)
    acc = torch.zeros(4, 3).t()  # (3, 4), InOut
    acc_out, y = rt(x, w, acc, alpha=1.0, steps=1)
    assert acc_out is acc
    assert isinstance(y, torch.Tensor)
    torch.testing.assert_close(y, x @ w, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(acc, x @ w, rtol=1e-5, atol=1e-5)


def test_read_only_host_inputs_are_accepted(rt):
    """In arguments are only read: a read-only array (np.frombuffer, a write-protected array) is a valid input."""
    a = good_args(b=2, n=3)
    x = np.frombuffer(a["x"].tobytes(), dtype=np.float32).reshape(2, 3)
    w = a["w"].copy()
    w.flags.writeable = False
    assert not x.flags.writeable and x.flags.c_contiguous and not w.flags.writeable
    acc = np.zeros((2, 4), np.float32)
    _, y = rt(x, w, acc, alpha=1.0, steps=1)
    np.testing.assert_allclose(y, a["x"] @ a["w"], rtol=1e-5, atol=1e-5)


def test_omitted_output_whose_symbol_nothing_binds(prepared):
    @engine.program
    def fill(run, y: Out(("N",)), v: Scalar(float)):
        @engine.host_kernel
        def k(out, value):
            out[...] = value

        run.submit(k, out=y, v=v)

    rt = prepared(fill, bounds={"N": 8})
    np.testing.assert_array_equal(rt(np.zeros(5, np.float32), v=2.0), 2)
    before = rt.memory_stats()
    with pytest.raises(TypeError, match="'y'") as ei:
        rt(v=1.0)
    assert "N" in str(ei.value)
    assert rt.memory_stats() == before
    big = rt.alloc_tensor((9,), "float32")
    with pytest.raises(ValueError, match="8"):
        rt(big, v=1.0)
