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
- the value (and type) of every Scalar parameter.

Scalars are baked in: unlike single-device capture (engine.capture), which
replays a Scalar passed straight into a kernel with each run's value, a
distributed recording holds the values it was made with, and a run with
another value records anew. A program whose Scalar changes on every run
gains nothing from capture (each run records); leave capture off for it.

What a captured program must not do, and what happens if it does:

- Read ``orch.run_id`` while recording (it differs per run): CaptureError.
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

from typing import TYPE_CHECKING, Any

from engine.capture import RecordingTable
from engine.distributed.graph import Submission
from engine.distributed.memory import SharedAllocation, none_freed
from engine.specs import Scalar
from engine.tensor import DeviceTensor

if TYPE_CHECKING:
    from engine.binding import BoundCall
    from engine.distributed.runs import RunRecord
    from engine.tensor import Allocation

__all__ = ["DistributedCapture", "Recording"]


class Recording:
    """One slot's submissions for one capture key, and the resident allocations they (and the key) name."""

    __slots__ = ("subs", "allocs")

    def __init__(self, subs: list[Submission], allocs: tuple["Allocation", ...]) -> None:
        # (worker, name, accesses, payload) per submission, in submission order
        self.subs = tuple((s.worker, s.name, tuple(s.accesses), s.payload) for s in subs)
        self.allocs = allocs  # held: the ids in the key stay theirs while the recording lives

    def live(self) -> bool:
        return none_freed(self.allocs)

    def replay(self, run: "RunRecord") -> list[Submission]:
        """This run's submissions, as the recorded orchestration made them."""
        return [Submission(run, i, worker, name, list(accesses), payload)
                for i, (worker, name, accesses, payload) in enumerate(self.subs)]


class DistributedCapture(RecordingTable[Recording]):
    """A runtime's recordings by (capture key, slot), their order of use, and counters."""

    @staticmethod
    def key(call: "BoundCall") -> tuple[Any, ...]:
        """The capture key of a bound call (see the module docstring)."""
        parts: list[Any] = [tuple(sorted(call.dims.items()))]
        for a in call.args:
            v = a.value
            if isinstance(a.param.spec, Scalar):
                parts.append((type(v), v.hex() if type(v) is float else v))  # floats by their bits: NaN matches
            elif isinstance(v, DeviceTensor):
                parts.append(_resident(v))
            elif type(v) is tuple:  # a PerWorker parameter's replicas
                parts.append(tuple(map(_resident, v)))
            else:  # host arrays are staged into the slot: only their shape reaches the orchestration
                parts.append(a.shape)
        return tuple(parts)

    def lookup(self, key: tuple[Any, ...], slot: int) -> Recording | None:
        """The recording to replay, or None (the run records); drops one whose resident memory was freed."""
        with self._lock:
            entry = self._table.get((key, slot))
            if entry is not None:
                if entry.live():
                    self._table.move_to_end((key, slot))
                    self.hits += 1
                    return entry
                del self._table[(key, slot)]
                self.invalidations += 1
            self.misses += 1
            return None

    def record(self, key: tuple[Any, ...], slot: int, call: "BoundCall", subs: list[Submission]) -> None:
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
        recording = Recording(subs, tuple(allocs.values()))
        with self._lock:
            self._table[(key, slot)] = recording
            self._table.move_to_end((key, slot))
            while len(self._table) > self._limit:
                self._table.popitem(last=False)
                self.evictions += 1

    def clear(self) -> None:
        with self._lock:
            self._table.clear()


def _resident(t: DeviceTensor) -> tuple[Any, ...]:
    """A resident view's part of the key: the view's own identity key (allocation id, offset, shape, strides,
    dtype), made once per view."""
    return t._key if t._key is not None else t._make_key()
