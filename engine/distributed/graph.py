"""The host-side task graph: submissions and the dependencies between them.

A submission is one sub-program run on a chip worker or one host callback.
Each names the memory it touches, tagged read, write or read-write, as byte
ranges of allocations (a slot's shared region, or a resident allocation of
a worker). A new submission must follow every incomplete one it conflicts
with: read-after-write, write-after-read and write-after-write on
overlapping bytes. The tracker belongs to the runtime, not to a run, so the
rules hold across runs (a resident KV cache written by run N and read by run
N+1). Ranges are [first byte, last byte] spans, so two strided views that
interleave (column shards of one array) count as overlapping: conservative,
never wrong.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.distributed.runs import RunRecord
    from engine.tensor import Allocation

__all__ = ["Submission", "DependencyTracker", "HOST", "WAITING", "SENT", "DONE"]

HOST = -1  # the executor of host callbacks (chip workers are 0..N-1)
WAITING, SENT, DONE = range(3)

Access = tuple["Allocation", int, int, bool]  # allocation, begin, end, writes


class Submission:
    """One unit of work of a run, on one executor.

    blocking counts the predecessors that still hold it back; succs are the
    submissions it holds back. A predecessor stops holding a successor back
    when it is done, or as soon as it is sent when both run on the same
    executor: a chip worker orders conflicting work itself (its engine tracks
    the same byte ranges) and the host callback thread runs in FIFO order.
    """

    __slots__ = ("run", "index", "worker", "name", "accesses", "payload", "state", "blocking", "succs", "seq",
                 "start_ns", "end_ns", "ok")

    def __init__(self, run: "RunRecord", index: int, worker: int, name: str, accesses: list[Access],
                 payload: Any) -> None:
        self.run = run
        self.index = index  # its position in the run (the task index errors name)
        self.worker = worker
        self.name = name
        self.accesses = accesses
        self.payload = payload  # what the executor needs: a Call without its seq, or a callback and its views
        self.state = WAITING
        self.blocking = 0
        self.succs: list[Submission] = []
        self.seq = 0
        self.start_ns = -1
        self.end_ns = -1
        self.ok = True

    def __repr__(self) -> str:
        where = "host" if self.worker == HOST else f"worker {self.worker}"
        return f"<Submission run={self.run.id} #{self.index} {self.name} on {where} state={self.state}>"


class DependencyTracker:
    """The accesses of incomplete submissions, by allocation."""

    def __init__(self) -> None:
        self._records: dict[int, list[tuple[Submission, int, int, bool]]] = {}

    def add(self, sub: Submission) -> list[Submission]:
        """Records sub's accesses; returns the incomplete submissions it must follow (each once)."""
        preds: dict[int, Submission] = {}
        for alloc, begin, end, writes in sub.accesses:
            records = self._records.setdefault(id(alloc), [])
            for other, b, e, w in records:
                if other is not sub and (writes or w) and begin < e and b < end:
                    preds[id(other)] = other
            records.append((sub, begin, end, writes))
        return list(preds.values())

    def remove(self, sub: Submission) -> None:
        """sub is complete: it holds nothing back any more."""
        for alloc, _b, _e, _w in sub.accesses:
            key = id(alloc)
            records = self._records.get(key)
            if records is None:
                continue
            if len(records) == 1:  # the common case: nothing else in flight touches the allocation
                if records[0][0] is sub:
                    del self._records[key]
                continue
            records[:] = [r for r in records if r[0] is not sub]
            if not records:
                del self._records[key]

    def busy(self, alloc: "Allocation") -> bool:
        """True while an incomplete submission touches the allocation."""
        return id(alloc) in self._records

    def __len__(self) -> int:
        return sum(len(r) for r in self._records.values())
