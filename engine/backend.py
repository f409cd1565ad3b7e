"""The backend protocol: what a scheduler needs of a prepared runtime, and nothing more.

scheduler.AsyncRuntime is written against Backend alone. Every runtime of
the engine implements it through engine.base_runtime.BaseRuntime (the local
Runtime, engine.distributed's DistributedRuntime); another one plugs in by
implementing the base's hooks, or a test's fake by implementing this
protocol directly. A run moves through it as:

    bind(args, kwargs) -> BoundCall           validation: nothing reaches the device yet (a captured
                                              runtime's call shaped like one it replayed before:
                                              engine.call_cache.CachedBinding)
    try_admit(notify) -> Lease | None         one of `depth` slots, and the run's state; None: all are held
    launch(call, lease, ...) -> Launched      stage, orchestrate, seal: the device may run from here
    completions().drain_completed()           ids of notifying runs completed since the last drain
    finish(run, run_id, payload)              (result, error), outputs written back
    abandon(lease)                            a lease that will never be launched goes back

A notifying run (try_admit(True)) announces its completion on the
completion source: its fd becomes readable once per batch of completions.
The slot a run holds is free again by the time finish() returns (at the
latest); admission then finds it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Protocol, TypeVar, runtime_checkable

if TYPE_CHECKING:
    from engine import _native
    from engine.binding import BoundCall
    from engine.call_cache import CachedBinding

__all__ = ["Backend", "CompletionSource", "Launched", "Lease", "RunState", "RunT"]


@runtime_checkable
class RunState(Protocol):
    """The engine's record of one run (a native run, or a distributed run's record)."""

    @property
    def id(self) -> int: ...

    @property
    def done(self) -> bool:
        """True once the run completed (every task done or skipped) and its completion was announced."""

    def cancel(self) -> bool:
        """Skips the run's work not yet started; False when the run already completed."""

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until done (True) or the timeout passed (False)."""

    def times(self) -> dict[str, int]:
        """Timestamps (ns) on the backend's clock: created, sealed, first_start, last_end, done; busy_ns."""

    def outcome(self) -> tuple[Any, bool]:
        """(failure or None, cancelled) of a completed run; failure is an exception or the backend's own
        description of it (a native run's: task index, kernel, message)."""


# A level's run state: the native run of one device, a distributed run's record, ...
RunT = TypeVar("RunT", bound=RunState)

# What admission hands out: the run's state, its id, and the slot it holds.
Lease = tuple[RunT, int, int]

# What launching gives: the run's state, its id, and what finish() takes back.
Launched = tuple[RunT, int, Any]


@runtime_checkable
class CompletionSource(Protocol):
    """Where notifying runs announce their completion."""

    @property
    def notifier_fd(self) -> int:
        """Readable while completions are queued (once per batch)."""

    def drain_completed(self) -> list[int]:
        """The ids of the runs completed since the last drain (possibly none); resets the fd."""

    def now_ns(self) -> int:
        """The clock of every timestamp of the backend's runs."""


@runtime_checkable
class Backend(Protocol[RunT]):
    """A prepared runtime, as a scheduler drives it; RunT is the type of its runs' state."""

    @property
    def depth(self) -> int:
        """How many runs may be in flight at once (the slots)."""

    @property
    def closed(self) -> bool: ...

    def check_open(self) -> None:
        """Raises engine.ClosedError (or the reason the runtime is unusable) when runs cannot be admitted."""

    def completions(self) -> CompletionSource:
        """The completion source; it stays valid (its fd open) for as long as the caller holds it."""

    def bind(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> "BoundCall | CachedBinding":
        """Checks one call's arguments against the signature: TypeError / ValueError before admission."""

    def try_admit(self, notify: bool) -> "Lease[RunT] | None":
        """A lease of a free slot for a new run, or None when every slot is held. Never blocks.

        The caller must pass the lease to launch() or abandon(). notify: the run
        announces its completion on completions(). Raises ClosedError once closed.
        """

    def abandon(self, lease: "Lease[RunT]") -> None:
        """Gives back a lease that will not be launched: its slot frees, nothing reached the device."""

    def launch(self, call: "BoundCall | CachedBinding", lease: "Lease[RunT]", dispatch_ns: int, log: "_native.RunLog | None",
               launch_ns: int = 0) -> "Launched[RunT]":
        """Stages the inputs, runs the orchestration and seals the run; the device may still be running it.

        dispatch_ns: when the caller asked for the run; log: where the run
        records its timings as it completes (None: nowhere); launch_ns: when
        its orchestration started, if not at admission. When it raises, the
        lease is given back (the run is cancelled and its slot frees).
        """

    def finish(self, run: RunT, run_id: int, payload: Any) -> tuple[Any, BaseException | None]:
        """A completed run's (result, error), its outputs written back into the caller's arrays.

        Called once per launched run, after it is done. Raises when writing
        an output back fails (the caller's array is not writable any more):
        that is the run's error.
        """

    def set_tracing(self, on: bool) -> None: ...

    def export_trace(self, path: Any) -> None: ...

    def close(self) -> None: ...
