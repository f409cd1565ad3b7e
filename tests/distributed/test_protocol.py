"""The per-run message encoding (engine.distributed.protocol.Codec): same messages out as in, bodies reused."""

from __future__ import annotations

import pickle
import struct

import pytest

from engine.distributed.protocol import (Call, Codec, Done, MemoryOp, Result, ScalarArgs, Stop, decode, encode,
                                         with_scalars)
from engine.errors import KernelError

ARGS = (("s", 0, 0, (16,), (1,), "float32"), ("s", 0, 64, (16,), (1,), "float32"), ("v", 2.5))


def _round_trip(msg: object) -> tuple[bytes, object]:
    data = Codec().encode(msg)
    return data, Codec().decode(data)


@pytest.mark.parametrize("msg", [
    Done(7, None, 123456789012345, 123456789022345),
    Done(8, None, -1, -1),
    Done(9, KernelError(3, 0, "copy", "bad"), -1, -1),
    Call(1, 0, {"B": 4}, ARGS, (1, 2, 0)),
    MemoryOp(2, "read", (5, 0, 64)),
    Result(2, None, b"\x00" * 8),
    Stop(),
], ids=lambda m: type(m).__name__)
def test_every_message_decodes_to_what_was_encoded(msg):
    data, back = _round_trip(msg)
    assert type(back) is type(msg)
    if isinstance(msg, Done) and msg.error is not None:
        assert (back.seq, back.first_start_ns, back.last_end_ns) == (msg.seq, msg.first_start_ns, msg.last_end_ns)
        assert isinstance(back.error, KernelError) and str(back.error) == str(msg.error)
    else:
        assert back == msg


def test_an_ok_done_is_a_fixed_struct_and_other_messages_stay_plain_pickles():
    done = Codec().encode(Done(7, None, 1, 2))
    assert len(done) == 25 and done[0] != 0x80
    assert Codec().encode(Done(7, RuntimeError("x"), 1, 2))[0] == 0x80  # an error travels pickled
    assert Codec().encode(Stop()) == encode(Stop())
    assert decode(encode(MemoryOp(3, "stats", ()))) == Codec().decode(Codec().encode(MemoryOp(3, "stats", ())))


def test_a_repeated_call_body_is_pickled_once_and_unpickled_once(monkeypatch):
    sender, receiver = Codec(), Codec()
    dumps, loads = [], []
    real_dumps, real_loads = pickle.dumps, pickle.loads
    monkeypatch.setattr(pickle, "dumps", lambda *a, **k: dumps.append(1) or real_dumps(*a, **k))
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: loads.append(1) or real_loads(*a, **k))
    dims = {"B": 4}
    for seq in range(1, 6):
        msg = receiver.decode(sender.encode(Call(seq, 3, dims, ARGS, (1, 2, 0))))
        assert msg == Call(seq, 3, {"B": 4}, ARGS, (1, 2, 0))
    assert (len(dumps), len(loads)) == (1, 1)


@pytest.mark.parametrize("change", ["program", "dims", "access", "args"])
def test_a_body_is_reused_only_when_every_field_is_the_same(change):
    sender, receiver = Codec(), Codec()
    first = Call(1, 3, {"B": 4}, ARGS, (1, 2, 0))
    receiver.decode(sender.encode(first))
    args = ARGS if change != "args" else (*ARGS[:2], ("v", 3.5))
    second = Call(2, 4 if change == "program" else 3, {"B": 8} if change == "dims" else {"B": 4}, args,
                  (1, 2, 2) if change == "access" else (1, 2, 0))
    assert receiver.decode(sender.encode(second)) == second


def test_a_dims_dict_changed_after_sending_is_not_taken_for_the_old_body():
    sender, receiver = Codec(), Codec()
    dims = {"B": 4}
    receiver.decode(sender.encode(Call(1, 3, dims, ARGS, (1, 2, 0))))
    dims["B"] = 8  # the same dict object, another value
    assert receiver.decode(sender.encode(Call(2, 3, dims, ARGS, (1, 2, 0)))).dims == {"B": 8}


def test_a_codec_remembers_a_bounded_number_of_bodies():
    sender, receiver = Codec(), Codec()
    kept = []
    for i in range(3000):
        args = (("v", i),)
        kept.append(args)  # alive, so every id stays distinct
        assert receiver.decode(sender.encode(Call(i, 0, {}, args, (0,)))).args == args
    assert len(sender._sent) <= 1024 and len(receiver._received) <= 1024


def _same(a: object, b: object) -> bool:
    """Equal, with floats by their bits and bools told from ints."""
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("values", [(3.5,), (-0.0,), (float("nan"),), (float("-inf"),), (True,), (False,), (7,),
                                    (-(1 << 63),), ((1 << 63) - 1,), (1 << 63,), (10 ** 400,), ("text",)])
def test_new_scalar_values_travel_as_patches_of_a_body_sent_before(values, monkeypatch):
    """A Call whose descriptors are another's with new scalars (ScalarArgs) decodes to the very values, types and
    float bits given; those that fit a fixed struct go as patches of the base's remembered body (one pickle of it
    each way, however many values follow), the others (an int past 64 bits, a str) as a whole pickle."""
    sender, receiver = Codec(), Codec()
    base = ARGS
    receiver.decode(sender.encode(Call(1, 3, {"B": 4}, base, (1, 2, 0))))
    dumps, loads = [], []
    real_dumps, real_loads = pickle.dumps, pickle.loads
    monkeypatch.setattr(pickle, "dumps", lambda *a, **k: dumps.append(1) or real_dumps(*a, **k))
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: loads.append(1) or real_loads(*a, **k))
    for seq in (2, 3):
        args = with_scalars(base, [(2, values[0])])
        assert type(args) is ScalarArgs and args == (*ARGS[:2], ("v", values[0]))
        data = sender.encode(Call(seq, 3, {"B": 4}, args, (1, 2, 0)))
        back = receiver.decode(data)
        assert type(back) is Call and back.seq == seq and _same(back.args, (*ARGS[:2], ("v", values[0])))
        assert type(back.args) is tuple
    fits = type(values[0]) in (float, bool) or (type(values[0]) is int and -(1 << 63) <= values[0] < (1 << 63))
    assert (len(dumps), len(loads)) == ((0, 0) if fits else (2, 1))  # the same value twice: the same bytes


def test_scalar_args_pickle_as_the_plain_tuple_they_are():
    args = with_scalars(ARGS, [(2, 9.0)])
    back = pickle.loads(pickle.dumps(args, protocol=pickle.HIGHEST_PROTOCOL))
    assert type(back) is tuple and back == (*ARGS[:2], ("v", 9.0))
