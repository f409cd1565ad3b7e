"""@engine.distributed.program: signatures, callback declarations, the dependency graph (no processes)."""

from __future__ import annotations

import pytest

import engine
import engine.distributed as dist
from engine import In, InOut, Out, Scalar
from engine.distributed.graph import DependencyTracker, Submission
from engine.distributed.program import READ, READWRITE, WRITE
from tests.distributed import programs as P


def test_signature_and_callbacks_are_parsed():
    prog = P.tp_matmul
    assert isinstance(prog, dist.DistributedProgram)
    assert [p.name for p in prog.params] == ["x", "w", "y"]
    assert prog.symbols == ("B",)
    assert prog.callbacks == {"gather": (READ, READ, WRITE)}
    resident = P.dp_mlp_resident
    assert isinstance(resident.params[1].spec, dist.PerWorker)

    @dist.program(callbacks={"cb": (In, Out, InOut, "inout")})
    def tags(orch, x: In((4,))):
        pass

    assert tags.callbacks == {"cb": (READ, WRITE, READWRITE, READWRITE)}
    assert "tags(x: In((4,), 'float32'))" in repr(tags)


@pytest.mark.parametrize("fn, error, match", [
    (lambda orch, x: None, TypeError, "needs an annotation|is annotated"),
    (lambda orch, *xs: None, TypeError, r"\*args"),
    (lambda: None, TypeError, "first parameter"),
])
def test_bad_signatures(fn, error, match):
    with pytest.raises(error, match=match):
        dist.program(fn)


def test_bad_declarations():
    with pytest.raises(TypeError, match="PerWorker takes"):
        dist.PerWorker(Scalar(int))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="access tag 'rw'"):
        dist.program(callbacks={"cb": ("rw",)})(lambda orch: None)
    with pytest.raises(TypeError, match="sequence of access tags"):
        dist.program(callbacks={"cb": "in"})(lambda orch: None)
    with pytest.raises(ValueError, match="identifier"):
        dist.program(callbacks={"not a name": ("in",)})(lambda orch: None)
    with pytest.raises(TypeError, match="programs= takes engine programs"):
        dist.program(programs=[lambda run: None])(lambda orch: None)


def test_defaults_are_rejected():
    def f(orch, x: In((4,)) = None):  # type: ignore[assignment]
        pass

    with pytest.raises(TypeError, match="defaults are not allowed"):
        dist.program(f)


def test_sub_programs_with_callbacks_are_rejected_at_prepare():
    @dist.program
    def outer(orch, y: Out((4,))):
        orch.submit(_with_callback, y, worker=0)

    with pytest.raises(ValueError, match="declares host callbacks"):
        outer.prepare(workers=1)


@engine.program(callbacks={"cb": 1})
def _with_callback(run, y: Out((4,))):
    run.host("cb", y)


# -- the dependency graph -------------------------------------------------------------------------------------
class _Alloc:
    pass


def _sub(i: int, *accesses) -> Submission:
    return Submission(None, i, 0, f"s{i}", list(accesses), None)  # type: ignore[arg-type]


def test_tracker_read_write_rules():
    a, b = _Alloc(), _Alloc()
    tr = DependencyTracker()
    w0 = _sub(0, (a, 0, 64, True))
    assert tr.add(w0) == []
    r1 = _sub(1, (a, 0, 32, False))
    r2 = _sub(2, (a, 32, 64, False))
    assert tr.add(r1) == [w0]  # read after write
    assert tr.add(r2) == [w0]
    other = _sub(3, (b, 0, 64, True), (a, 64, 128, True))
    assert tr.add(other) == []  # another allocation, disjoint bytes of this one
    w4 = _sub(4, (a, 16, 48, True))
    assert set(map(id, tr.add(w4))) == {id(w0), id(r1), id(r2)}  # write after read and after write
    tr.remove(w0)
    tr.remove(r1)
    tr.remove(r2)
    assert tr.add(_sub(5, (a, 0, 8, False))) == []  # nothing left before it but disjoint w4
    assert tr.busy(a) and tr.busy(b)
    tr.remove(other)
    assert not tr.busy(b)
