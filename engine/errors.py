"""The engine's error types.

Argument problems raise the built-in TypeError (wrong arity, shape, dtype) and
ValueError (bad values, foreign or freed tensors, double frees).
"""

from __future__ import annotations

from engine import _native

ClosedError = _native.ClosedError
"""Raised by every call on a runtime after close() (a RuntimeError)."""

DeviceMemoryError = _native.DeviceMemoryError
"""Device memory exhausted (a MemoryError); the runtime stays usable."""


class KernelError(RuntimeError):
    """A task of one run failed; raised from that run's result only."""

    def __init__(self, run_id: int, task_index: int, kernel: str, message: str) -> None:
        self.run_id = run_id
        self.task_index = task_index
        self.kernel = kernel
        self.message = message
        super().__init__(f"run {run_id}: task {task_index} (kernel '{kernel}') failed: {message}")

    def __reduce__(self) -> tuple[type[KernelError], tuple[int, int, str, str]]:  # picklable across processes
        return (type(self), (self.run_id, self.task_index, self.kernel, self.message))


class RunCancelledError(RuntimeError):
    """The run was cancelled before it completed; its result was discarded."""


class CaptureError(RuntimeError):
    """A captured program did what a recording cannot replay faithfully (see engine.capture)."""


__all__ = ["CaptureError", "ClosedError", "DeviceMemoryError", "KernelError", "RunCancelledError"]
