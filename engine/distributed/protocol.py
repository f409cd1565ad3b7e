"""The messages between the host and a chip worker.

Every message is a small NamedTuple pickled through the transport. Tensor
*data* never travels in a per-run message: a run's arguments are described by
reference (a shared region and a byte offset, or a resident allocation id)
and the worker reads and writes the bytes in place.

Argument descriptors of a Call, one per parameter of the sub-program:
    ("s", region, offset, shape, strides, dtype)  a view of shared region `region`
    ("d", alloc_id, offset, shape, strides, dtype) a view of a resident allocation
    ("v", value)                                   a scalar
offset is in bytes, strides in elements, dtype a DType name.
"""

from __future__ import annotations

import pickle
import struct
import traceback
from typing import Any, NamedTuple

__all__ = ["ProgramSpec", "RegionSpec", "Setup", "Ready", "SetupFailed", "Call", "Done", "MemoryOp", "Result",
           "Stop", "portable_error", "plain", "from_plain", "encode", "decode", "Codec", "ScalarArgs", "with_scalars"]


class ProgramSpec(NamedTuple):
    """A registered sub-program: where the worker imports it from, and how it is sized."""

    module: str
    qualname: str
    bounds: dict[str, int]
    scratch_bytes: int


class RegionSpec(NamedTuple):
    # Shadows tuple.index (spec.index(x) is unusable); renaming it means changing its reader,
    # engine/distributed/worker.py (ChipHost._attach), which is being rewritten elsewhere.
    index: int  # type: ignore[assignment]
    name: str
    size: int


class Setup(NamedTuple):
    """The first message a worker receives: everything it prepares once."""

    worker: int  # which worker this is, 0-based (not `index`: that would shadow tuple.index)
    threads: int
    memory_limit: int
    programs: tuple[ProgramSpec, ...]
    regions: tuple[RegionSpec, ...]


class Ready(NamedTuple):
    pid: int
    threads: int
    clock_offset_ns: int  # add to a worker engine timestamp to get the host clock (time.monotonic_ns)


class SetupFailed(NamedTuple):
    error: BaseException


class Call(NamedTuple):
    """Run registered program `program` once with these arguments.

    access: per argument, what the program does with it (0 for a scalar,
    READ | WRITE bits of engine.distributed.program for a tensor): a
    transport without shared memory ships what is read and returns what is
    written.
    """

    seq: int
    program: int
    dims: dict[str, int]
    args: tuple[tuple[Any, ...], ...]
    access: tuple[int, ...]


class Done(NamedTuple):
    """A Call finished (error None) or failed; times on the host clock (-1: nothing ran)."""

    seq: int
    error: BaseException | None
    first_start_ns: int
    last_end_ns: int


class MemoryOp(NamedTuple):
    """A synchronous memory call: op in alloc / free / write / read / stats."""

    seq: int
    op: str
    args: tuple[Any, ...]


class Result(NamedTuple):
    seq: int
    error: BaseException | None
    value: Any


class Stop(NamedTuple):
    pass


def portable_error(e: BaseException) -> BaseException:
    """`e` if it survives pickling, else a RuntimeError carrying its type, message and traceback."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        return RuntimeError(f"{type(e).__name__}: {e}\n{tb}")


# Messages travel as (kind, fields): pickling a NamedTuple itself goes through copyreg and a class lookup by
# name on both ends, 4-5x the cost of its plain fields for the small messages every run sends.
_KINDS: tuple[type, ...] = (Setup, Ready, SetupFailed, Call, Done, MemoryOp, Result, Stop)
_KIND_OF = {kind: i for i, kind in enumerate(_KINDS)}


def plain(msg: Any) -> tuple[int, tuple[Any, ...]]:
    """A message as (kind, fields), which pickles without a class lookup."""
    return _KIND_OF[type(msg)], tuple(msg)


def from_plain(kind: int, fields: tuple[Any, ...]) -> Any:
    """The message plain() took apart."""
    return tuple.__new__(_KINDS[kind], fields)


def encode(msg: Any) -> bytes:
    """One message as bytes. Plain pickle: multiprocessing's Connection.send uses ForkingPickler,
    which copies its reducer table for every message (a measurable share of a small run)."""
    return pickle.dumps(plain(msg), protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes) -> Any:
    """The message encode() made."""
    return from_plain(*pickle.loads(data))


class ScalarArgs(tuple[tuple[Any, ...], ...]):
    """A Call's argument descriptors made from `base` (descriptors sent before) by giving some scalars
    ("v", value) new values: `patches`, (index, value) pairs. A Codec sends it as base's remembered body and the
    new values, so a sub-program called with a new Scalar each run is not pickled anew each run. Anything else
    pickles it as the plain tuple it is."""

    base: tuple[tuple[Any, ...], ...]
    patches: tuple[tuple[int, Any], ...]

    def __reduce__(self) -> Any:
        return tuple, (tuple(self),)


def with_scalars(base: tuple[tuple[Any, ...], ...], patches: list[tuple[int, Any]]) -> tuple[tuple[Any, ...], ...]:
    """base with ("v", value) at each patched index: a ScalarArgs that remembers where it came from."""
    descs = list(base)
    for index, value in patches:
        descs[index] = ("v", value)
    args = ScalarArgs(descs)
    args.base = base
    args.patches = tuple(patches)
    return args


# The two messages of every run skip most of pickle. A Done without an error is a fixed struct. A Call is
# its seq before its body (program, dims, args, access), and orchestration sends the same few bodies run
# after run: a Codec pickles a body once and unpickles a body's bytes once. A Call with new scalar values
# (ScalarArgs) is its seq, the values as fixed structs and its base's body. A pickle's first byte is PROTO
# (0x80), so the first byte tells the four formats apart.
_DONE_OK = struct.Struct("<Bqqq")  # tag, seq, first_start_ns, last_end_ns
_CALL_HEAD = struct.Struct("<Bq")  # tag, seq; the pickled body follows
_PATCHED_HEAD = struct.Struct("<BqH")  # tag, seq, patches; the patches, then the pickled body of their base
_INT_PATCH = struct.Struct("<HBq")  # index, kind, value
_FLOAT_PATCH = struct.Struct("<HBd")  # index, kind, value (the double's bits: NaN, -0.0 and inf travel exactly)
_INT, _FLOAT, _BOOL = 0, 1, 2
assert _INT_PATCH.size == _FLOAT_PATCH.size  # a patch's kind byte sits at the same place in either
_DONE_TAG, _CALL_TAG, _PATCHED_TAG = 1, 2, 3
_INT64 = (-(1 << 63), (1 << 63) - 1)
_BODIES_KEPT = 1024  # bodies a Codec remembers each way (more: it forgets them all and starts again)


class Codec:
    """encode() and decode() for one end of a connection, remembering the Call bodies it saw.

    Each end owns one (no state is shared between connections or runtimes). A
    body is remembered on the sending side by its args tuple, which a repeated
    submission passes as the very same object (the entry holds it, so its id
    stays its own), and checked field by field; on the receiving side by its
    bytes. A Call whose args are ScalarArgs sends its base's body and the new
    values (a bool, an int64 or a float each; other values: the whole Call
    pickled). Messages of other kinds, and a Done carrying an error, are
    pickled as encode() does.
    """

    __slots__ = ("_sent", "_received")

    def __init__(self) -> None:
        self._sent: dict[int, tuple[tuple[Any, ...], int, dict[str, int], tuple[int, ...], bytes]] = {}
        self._received: dict[bytes, tuple[Any, ...]] = {}

    def encode(self, msg: Any) -> bytes:
        kind = type(msg)
        if kind is Done:
            if msg.error is None:
                return _DONE_OK.pack(_DONE_TAG, msg.seq, msg.first_start_ns, msg.last_end_ns)
        elif kind is Call:
            seq, program, dims, args, access = msg
            if type(args) is ScalarArgs:
                patches = _pack_patches(args.patches)
                if patches is not None:
                    return _PATCHED_HEAD.pack(_PATCHED_TAG, seq, len(args.patches)) + patches + \
                        self._body(program, dims, args.base, access)
            return _CALL_HEAD.pack(_CALL_TAG, seq) + self._body(program, dims, args, access)
        return encode(msg)

    def _body(self, program: int, dims: dict[str, int], args: tuple[Any, ...], access: tuple[int, ...]) -> bytes:
        entry = self._sent.get(id(args))
        if entry is not None and entry[0] is args and entry[1] == program and entry[2] == dims and entry[3] == access:
            return entry[4]
        body = pickle.dumps((program, dims, tuple(args), access), protocol=pickle.HIGHEST_PROTOCOL)
        if len(self._sent) >= _BODIES_KEPT:
            self._sent.clear()
        self._sent[id(args)] = (args, program, dict(dims), access, body)
        return body

    def decode(self, data: bytes) -> Any:
        tag = data[0]
        if tag == _DONE_TAG:
            _, seq, first, last = _DONE_OK.unpack(data)
            return tuple.__new__(Done, (seq, None, first, last))
        if tag == _CALL_TAG:
            return tuple.__new__(Call, (_CALL_HEAD.unpack_from(data)[1], *self._fields(data[_CALL_HEAD.size:])))
        if tag == _PATCHED_TAG:
            _, seq, n = _PATCHED_HEAD.unpack_from(data)
            at = _PATCHED_HEAD.size
            program, dims, base, access = self._fields(data[at + n * _INT_PATCH.size:])
            args = list(base)
            for _ in range(n):
                index, kind, value = (_FLOAT_PATCH if data[at + 2] == _FLOAT else _INT_PATCH).unpack_from(data, at)
                args[index] = ("v", bool(value) if kind == _BOOL else value)
                at += _INT_PATCH.size
            return tuple.__new__(Call, (seq, program, dims, tuple(args), access))
        return decode(data)

    def _fields(self, body: bytes) -> tuple[Any, ...]:
        fields = self._received.get(body)
        if fields is None:
            fields = pickle.loads(body)
            if len(self._received) >= _BODIES_KEPT:
                self._received.clear()
            self._received[body] = fields
        return fields


def _pack_patches(patches: tuple[tuple[int, Any], ...]) -> bytes | None:
    """The patches as fixed structs, or None when one will not fit (a value that is not a plain bool, int64 or
    float, or more patches than the head counts: the Call then travels as a whole pickle)."""
    if len(patches) > 0xFFFF:
        return None
    out = []
    for index, value in patches:
        kind = type(value)
        if kind is float:
            out.append(_FLOAT_PATCH.pack(index, _FLOAT, value))
        elif kind is bool:
            out.append(_INT_PATCH.pack(index, _BOOL, value))
        elif kind is int and _INT64[0] <= value <= _INT64[1]:
            out.append(_INT_PATCH.pack(index, _INT, value))
        else:
            return None
    return b"".join(out)
