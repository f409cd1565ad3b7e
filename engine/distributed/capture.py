"""Captured distributed runs: an orchestration recorded once per capture key and slot, replayed after.

With ``DistributedProgram.prepare(capture=True)`` the first run of each
capture key on each pipeline slot calls the orchestration function as usual
and keeps what it submitted: every sub-program call (its worker, its
registered program, its argument descriptors) and host callback (its
function and the run's tensors it is given), and the memory each touches.
Later runs with the same key on the same slot skip the function: the kept
submissions enter the dependency graph as this run's, so they order after
earlier runs' work on the same memory exactly as submitted ones do. A
recording is per slot because a run's tensors are views of its slot's region.

The capture key is what the orchestration can depend on:

- the values of the symbolic dims;
- for each tensor parameter, whether host arrays or resident tensors were
  passed, and which resident tensors (the allocation, offset, shape, strides
  and dtype of each, and of each replica of a PerWorker parameter);
- the value of every Scalar parameter the function *read*.

Scalars work as in single-device capture (engine.capture): while a key is
recorded each Scalar parameter is a stand-in for its value. Passed straight
into a sub-program's Scalar (``orch.submit(prog, x, y, factor, worker=0)``)
it is not read: each replay sends that run's value, checked by the
sub-program's Scalar spec as a submit would check it. Anything else the
function does with it reads it (``worker=s``, a comparison, an ``if``,
arithmetic, ``int()``, a shape), and then its value is part of the key: a run
with another value records anew. A replay is never stale for Scalars.

What a captured program must not do, and what happens if it does:

- Read ``orch.run_id`` while recording (it differs per run): CaptureError.
- Keep a Scalar stand-in beyond its orchestration: using it later raises
  CaptureError. A stand-in is not an ``int`` or ``float`` to ``isinstance``
  (``numbers.Integral`` / ``numbers.Real`` it is).
- Depend on anything but its arguments and dims: resident tensors it reaches
  by itself (globals, closures) are kept by identity, so rebinding such a name
  is not seen by a replay (pass tensors that change as arguments); a
  recording whose resident tensor was freed since is dropped and recorded
  again. Python side effects of the function happen when a key is recorded,
  not on replays.

Recordings are kept per runtime, at most ``capture_limit`` (slot and key
pairs), the least recently used dropped first; ``capture_stats()`` counts
hits, misses, entries, evictions and invalidations.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from engine.capture import RecordingTable, ScalarReads, scalar_params, stand_ins
from engine.distributed.graph import Submission
from engine.distributed.memory import SharedAllocation, none_freed
from engine.distributed.protocol import with_scalars
from engine.specs import Scalar
from engine.tensor import DeviceTensor

if TYPE_CHECKING:
    from engine.binding import BoundCall
    from engine.distributed.runs import RunRecord
    from engine.program import Param
    from engine.tensor import Allocation

__all__ = ["DistributedCapture", "Recording", "PassedScalar"]

# A Scalar parameter passed straight into a sub-program: (the submission's argument descriptor index,
# the sub-program's parameter, the orchestration's parameter index).
PassedScalar = tuple[int, "Param", int]


class Recording:
    """One slot's submissions for one capture key, and the resident allocations they (and the key) name."""

    __slots__ = ("subs", "allocs", "key", "dropped")

    def __init__(self, subs: list[Submission], passed: dict[int, tuple[PassedScalar, ...]],
                 allocs: tuple["Allocation", ...]) -> None:
        # (worker, name, accesses, payload, the Scalars it passes through) per submission, in submission order
        self.subs = tuple((s.worker, s.name, tuple(s.accesses), s.payload, passed.get(i, ()))
                          for i, s in enumerate(subs))
        self.allocs = allocs  # held: the ids in the key stay theirs while the recording lives
        self.key: tuple[Any, ...] = ()
        self.dropped = False

    def live(self) -> bool:
        return none_freed(self.allocs)

    def replay(self, run: "RunRecord", values: Sequence[Any]) -> list[Submission]:
        """This run's submissions, as the recorded orchestration made them with this run's parameter values
        (ValueError / TypeError from a sub-program's Scalar spec, as a submit would raise, before any)."""
        subs = []
        for i, (worker, name, accesses, payload, passed) in enumerate(self.subs):
            if passed:
                key, dims, descs, access = payload
                # Sent as the recorded descriptors' body and the values (protocol.ScalarArgs).
                payload = (key, dims, with_scalars(descs, [(index, p.spec.check(p.name, values[source]))
                                                           for index, p, source in passed]), access)
            subs.append(Submission(run, i, worker, name, list(accesses), payload))
        return subs


class DistributedCapture(RecordingTable[Recording]):
    """A runtime's recordings by (capture key, slot), their order of use, and counters."""

    def __init__(self, limit: int, params: Sequence["Param"]) -> None:
        super().__init__(limit)
        self._scalar_params = scalar_params(params)  # (index, parameter) of the orchestration's Scalars

    @staticmethod
    def base_key(call: "BoundCall", slot: int) -> tuple[Any, ...]:
        """The part of a run's capture key that binding fixes (see the module docstring), and the slot."""
        parts: list[Any] = [slot, tuple(sorted(call.dims.items()))]
        for a in call.args:
            v = a.value
            if isinstance(a.param.spec, Scalar):
                continue  # in the key only if the orchestration reads it
            if isinstance(v, DeviceTensor):
                parts.append(_resident(v))
            elif type(v) is tuple:  # a PerWorker parameter's replicas
                parts.append(tuple(map(_resident, v)))
            else:  # host arrays are staged into the slot: only their shape reaches the orchestration
                parts.append(a.shape)
        return tuple(parts)

    def lookup(self, base_key: tuple[Any, ...], values: Sequence[Any]) -> Recording | None:
        """The recording to replay, or None (the run records); drops one whose resident memory was freed."""
        for key, entry in self._candidates(base_key, values):
            if entry.live():
                self._hit(key)
                return entry
            self._drop(key, invalidated=True)
        self._miss()
        return None

    def values(self, call: "BoundCall") -> list[Any]:
        """The parameters' values a lookup, a replay and a recording read: the Scalars' (none without any)."""
        return [a.value for a in call.args] if self._scalar_params else []

    def stand_ins(self, fn_args: list[Any]) -> ScalarReads:
        """Replaces the Scalars in fn_args by stand-ins for a recording; what they read is reported to the
        returned ScalarReads (closed by the caller once the orchestration is over)."""
        reads = ScalarReads()
        stand_ins(self._scalar_params, fn_args, reads)
        return reads

    def record(self, base_key: tuple[Any, ...], reads: ScalarReads, values: Sequence[Any], call: "BoundCall",
               subs: list[Submission], passed: dict[int, tuple[PassedScalar, ...]]) -> None:
        """Keeps a run's submissions (after its orchestration returned) for later runs with its key and slot."""
        allocs: dict[int, Allocation] = {}
        for a in call.args:  # the key names these by id
            for t in (a.value if type(a.value) is tuple else (a.value,)):
                if isinstance(t, DeviceTensor):
                    allocs[id(t._alloc)] = t._alloc
        for sub in subs:  # and the submissions touch these (a tensor reached by the function itself, too)
            for alloc, _b, _e, _w in sub.accesses:
                if not isinstance(alloc, SharedAllocation):
                    allocs[id(alloc)] = alloc
        read = tuple(sorted(reads.reads))
        # A Scalar read anywhere is in the key: its recorded value is the one every replay has.
        kept: dict[int, tuple[PassedScalar, ...]] = {}
        for index, scalars in passed.items():
            unread = tuple(s for s in scalars if s[2] not in reads.reads)
            if unread:
                kept[index] = unread
        self._store(base_key, read, values, Recording(subs, kept, tuple(allocs.values())))


def _resident(t: DeviceTensor) -> tuple[Any, ...]:
    """A resident view's part of the key: the view's own identity key (allocation id, offset, shape, strides,
    dtype), made once per view."""
    return t._key if t._key is not None else t._make_key()
