"""@engine.program: declared signatures, parameter specs and decoration-time errors."""

import numpy as np
import pytest

import engine
from engine import In, InOut, Out, Scalar

from .conftest import k_add, k_copy, k_scale


def test_program_decorator_returns_a_program_with_declared_params():
    @engine.program
    def prog(run: engine.Run, x: In(("B", 4)), w: In((4, 8), "float16"), s: InOut(("B", 8), engine.int32),
             y: Out(("B", "N")), alpha: Scalar(float), steps: Scalar(int), flag: Scalar(bool)):
        pass

    assert isinstance(prog, engine.Program)
    assert [p.name for p in prog.params] == ["x", "w", "s", "y", "alpha", "steps", "flag"]
    x, w, s, y, alpha, steps, flag = (p.spec for p in prog.params)
    assert (x.kind, x.shape, x.dtype) == ("In", ("B", 4), engine.float32)
    assert (w.kind, w.shape, w.dtype) == ("In", (4, 8), engine.float16)
    assert (s.kind, s.shape, s.dtype) == ("InOut", ("B", 8), engine.int32)
    assert (y.kind, y.shape, y.dtype) == ("Out", ("B", "N"), engine.float32)
    assert x.reads and not x.writes and y.writes and not y.reads and s.reads and s.writes
    assert (alpha.type, steps.type, flag.type) == (float, int, bool)
    assert prog.symbols == ("B", "N")
    assert prog.callbacks == {}
    assert "prog" in repr(prog)


def test_program_with_keyword_options_and_callbacks():
    @engine.program(callbacks={"log": 2, "tick": 0})
    def prog(run, x: In((4,))):
        pass

    assert isinstance(prog, engine.Program)
    assert prog.callbacks == {"log": 2, "tick": 0}

    @engine.program(callbacks=["a", "b"])
    def prog2(run, x: In((4,))):
        pass

    assert set(prog2.callbacks) == {"a", "b"}


def test_string_annotations_are_evaluated():
    def fn(run, x: "In((2, 3))", y: "Out((2, 3), 'int32')", k: "Scalar(int)"):
        pass

    prog = engine.program(fn)
    assert [p.spec.kind for p in prog.params[:2]] == ["In", "Out"]
    assert prog.params[1].spec.dtype == engine.int32
    assert prog.params[2].spec == Scalar(int)


def test_postponed_annotations_module_works(prepared):
    src = (
        "from __future__ import annotations\n"
        "import engine\n"
        "from engine import In, Out, Scalar\n"
        "@engine.program\n"
        "def prog(run, x: In(('B', 3)), y: Out(('B', 3)), f: Scalar(float)):\n"
        "    run.submit(k_scale, x, out=y, factor=f)\n"
    )
    ns = {"k_scale": k_scale}
    exec(compile(src, "<future>", "exec"), ns)
    prog = ns["prog"]
    assert [p.spec.kind for p in prog.params[:2]] == ["In", "Out"]
    rt = prepared(prog, bounds={"B": 4})
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(rt(x, f=2.0), 2 * x)


def test_bare_scalar_annotation_means_float():
    @engine.program
    def prog(run, x: In((2,)), a: Scalar):
        pass

    assert prog.params[1].spec == Scalar(float)


def test_dtype_names_numpy_and_engine_dtypes_are_accepted():
    assert In((2,), "float16").dtype == engine.float16
    assert In((2,), np.int64).dtype == engine.int64
    assert In((2,), np.dtype("uint8")).dtype == engine.uint8
    assert In((2,), engine.bfloat16).dtype == engine.bfloat16
    assert In((2,)).dtype == engine.float32  # the default


@pytest.mark.parametrize("spec_factory", [In, Out, InOut])
def test_spec_shape_validation(spec_factory):
    with pytest.raises(ValueError):
        spec_factory(())  # no dims
    with pytest.raises(ValueError):
        spec_factory((4, 0))
    with pytest.raises(ValueError):
        spec_factory((-1,))
    with pytest.raises(TypeError):
        spec_factory((2.5,))
    with pytest.raises(TypeError):
        spec_factory((True, 4))
    with pytest.raises(TypeError):
        spec_factory("B")  # a bare string is not a shape
    with pytest.raises(TypeError):
        spec_factory(4)
    with pytest.raises(ValueError):
        spec_factory(("not a name",))
    with pytest.raises(TypeError):
        spec_factory((4,), "float64")  # unknown to the engine
    with pytest.raises(TypeError):
        spec_factory((4,), "nonsense")


def test_scalar_types():
    assert Scalar(int).type is int
    assert Scalar().type is float
    with pytest.raises(TypeError):
        Scalar(str)
    with pytest.raises(TypeError):
        Scalar(complex)


# -- malformed signatures fail at decoration time, naming the parameter ------------------------
def test_missing_annotation_names_the_parameter():
    with pytest.raises(TypeError, match="'weights'"):
        @engine.program
        def prog(run, x: In((4,)), weights):
            pass


def test_wrong_annotation_names_the_parameter():
    with pytest.raises(TypeError, match="'count'"):
        @engine.program
        def prog(run, x: In((4,)), count: int):
            pass

    with pytest.raises(TypeError, match="'y'"):
        @engine.program
        def prog2(run, y: np.ndarray):
            pass


def test_defaults_are_rejected_naming_the_parameter():
    with pytest.raises(TypeError, match="'alpha'"):
        @engine.program
        def prog(run, x: In((4,)), alpha: Scalar(float) = 1.0):
            pass


def test_var_args_and_var_kwargs_are_rejected_naming_the_parameter():
    with pytest.raises(TypeError, match="'rest'"):
        @engine.program
        def prog(run, x: In((4,)), *rest: In((4,))):
            pass

    with pytest.raises(TypeError, match="'extra'"):
        @engine.program
        def prog2(run, x: In((4,)), **extra: In((4,))):
            pass


def test_a_function_without_the_run_parameter_is_rejected():
    with pytest.raises(TypeError):
        @engine.program
        def prog():
            pass


def test_non_callable_is_rejected():
    with pytest.raises(TypeError):
        engine.program(42)


def test_unevaluable_string_annotation_names_itself():
    def fn(run, x: "NoSuchSpec((4,))"):
        pass

    with pytest.raises(TypeError, match="NoSuchSpec"):
        engine.program(fn)


def test_malformed_spec_inside_the_annotation_fails_at_decoration():
    with pytest.raises(ValueError):
        @engine.program
        def prog(run, x: In((4, 0))):
            pass


def test_keyword_only_parameter_is_rejected_or_works(prepared):
    """A keyword-only tensor parameter must either fail at decoration naming it, or run correctly."""
    try:
        @engine.program
        def prog(run, x: In((4,)), *, y: Out((4,))):
            run.submit(k_copy, x, out=y)
    except TypeError as e:
        assert "'y'" in str(e)
        return
    rt = prepared(prog)
    x = np.arange(4, dtype=np.float32)
    np.testing.assert_array_equal(rt(x), x)


@pytest.mark.parametrize("callbacks,exc", [
    ({"not a name": 1}, ValueError),
    ({"cb": -1}, ValueError),
    ({"cb": 1.5}, ValueError),
    ({"cb": True}, ValueError),
    ("cb", TypeError),
])
def test_malformed_callback_declarations_fail_at_decoration(callbacks, exc):
    with pytest.raises(exc):
        @engine.program(callbacks=callbacks)
        def prog(run, x: In((4,))):
            pass


def test_program_function_is_still_reachable_and_prepare_returns_a_runtime(prepared):
    @engine.program
    def prog(run, a: In((3,)), b: In((3,)), c: Out((3,))):
        run.submit(k_add, a, b, out=c)

    rt = prepared(prog)
    assert isinstance(rt, engine.Runtime)
    assert rt.program is prog
    a = np.ones(3, np.float32)
    np.testing.assert_array_equal(rt(a, a), 2 * a)
