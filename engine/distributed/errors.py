"""The error of the distributed level."""

from __future__ import annotations

from engine.errors import ClosedError

__all__ = ["WorkerDiedError"]


class WorkerDiedError(ClosedError):
    """A chip worker process died (killed, crashed, or its pipe broke).

    The runs in flight fail with it, and from then on the runtime is broken:
    every later call raises it too. It is a ClosedError (hence a RuntimeError)
    because a broken runtime takes no more work, exactly like a closed one;
    close() still stops every process and removes the shared memory.
    """

    def __init__(self, message: str, worker: int = -1, exitcode: int | None = None) -> None:
        super().__init__(message)
        self.worker = worker
        self.exitcode = exitcode

    def __reduce__(self) -> tuple[type[WorkerDiedError], tuple[str, int, int | None]]:  # picklable with its fields
        return (type(self), (str(self), self.worker, self.exitcode))
