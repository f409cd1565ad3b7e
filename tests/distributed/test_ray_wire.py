"""ray_wire: a batch and its replies come back as they were sent, inline or with their arrays apart."""

from __future__ import annotations

import numpy as np
import pytest

from engine.distributed.protocol import Call, Done, MemoryOp
from engine.distributed.ray_wire import INLINE_BYTES, pack, unpack


def _entries(n_floats: int):
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal(n_floats).astype(np.float32), rng.standard_normal(3).astype(np.float32)
    call = Call(7, 1, {"B": 4}, (("s", 0, 0, (n_floats,), (1,), "f32"), ("v", 2.5), ("s", 0, 64, (3,), (1,), "f32")),
                (1, 0, 3))
    return [(call, ((0, a), (2, b))), (MemoryOp(8, "stats", ()), ()),
            (Done(9, ValueError("boom on worker 1"), 10, 20), ())]


@pytest.mark.parametrize("n_floats, inline", [(16, True), (INLINE_BYTES // 4 - 3, True), (INLINE_BYTES // 4, False)])
def test_entries_round_trip(n_floats, inline):
    sent = _entries(n_floats)
    wire = pack(sent)
    assert isinstance(wire, bytes) is inline  # small batches as one bytes object (Ray's fast path)
    got = unpack(wire)
    assert [type(m) for m, _ in got] == [Call, MemoryOp, Done]
    assert got[0][0] == sent[0][0] and got[1][0] == sent[1][0]
    err = got[2][0].error
    assert isinstance(err, ValueError) and str(err) == "boom on worker 1" and got[2][0][1:][1:] == (10, 20)
    assert [i for i, _ in got[0][1]] == [0, 2]
    for (_, x), (_, y) in zip(sent[0][1], got[0][1]):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(x, y)
    assert got[1][1] == () and got[2][1] == ()
