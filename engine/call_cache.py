"""The hit path of calls shaped like an earlier one: they skip binding, and launching derives nothing again.

Binding a call's arguments (engine.binding) and turning them into slot views,
staging regions and copy-backs come out the same whenever the call looks the
same, yet cost more of a small run's host time than the engine's own work.
This cache remembers, per *call signature*, what binding and launching derived,
and a runtime reuses it: an uncaptured run then only stages its arrays and
calls the orchestration function, a captured one (engine.capture) also skips
the capture key and looks its replay up by slot and Scalar values.

The signature is engine.binding.call_signature's (what binding's outcome
depends on: argument kinds, array shapes and dtypes, resident tensors, scalar
types). Per call, resident tensors are re-checked for having been freed and
Scalar values are checked by their specs (and, captured, go to the capture key
lookup, which bakes in the values the orchestration read and patches the others).

Anything else (torch tensors, other array types, arrays staged through a copy,
two host outputs that could overlap, a key no longer recorded) takes the full
path, which raises binding's errors and records what it must. The cache keeps
`size` signatures (a captured runtime as many as it keeps recordings: a program
called N ways needs N of each; a decoder's steps differ by position in both),
the oldest dropped first, and is emptied when the runtime closes.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Mapping, Sequence


import numpy as np

from engine.binding import BoundCall, argument_sources, binds_as_is, call_signature
from engine.dtypes import DType
from engine.slots import slot_view
from engine.specs import Scalar, TensorSpec
from engine.tensor import DeviceTensor

if TYPE_CHECKING:
    from engine import _native
    from engine.capture import Recorded
    from engine.program import Program
    from engine.slots import Slot

__all__ = ["CallCache", "CachedBinding", "CachedCall"]


class CachedCall:
    """What binding and launching one call signature derived: reused by every call with that signature."""

    __slots__ = ("sources", "in_order", "scalars", "hosts", "outputs", "device_args", "dims", "base_key",
                 "_copy_backs", "_staging", "_copy_back_args", "_replays", "_replays_limit")

    def __init__(self, sources: list[int], scalars: list[tuple[int, Scalar, str]],
                 hosts: list[tuple[int, str, tuple[int, ...], Any, int, bool, bool, bool, DType]],
                 outputs: list[tuple[str, Any]], device_args: list[tuple[int, DeviceTensor]],
                 dims: dict[str, int], base_key: tuple[Any, ...] | None, replays_limit: int) -> None:
        self.sources = sources  # per parameter: its index in args + kwargs values, -1 where omitted
        self.in_order = sources == list(range(len(sources)))  # each parameter given, in declaration order
        self.scalars = scalars  # (parameter index, spec, name)
        # (parameter index, name, shape, numpy dtype, nbytes, reads, writes, given, dtype): given False for
        # an omitted Out, which each call allocates
        self.hosts = hosts
        self.outputs = outputs  # in declaration order: ("device", tensor) / ("host", host index)
        # (parameter index, DeviceTensor) of every resident argument: the capture key's, checked live per call
        self.device_args = device_args
        self.dims = dims  # the symbols' values: what an uncaptured run's orchestration gets as run.dims
        self.base_key = base_key  # the capture key's part fixed by the signature; None uncaptured
        self._copy_backs: dict[int, list[tuple[int, int]]] = {}  # slot index -> (replay base, buffer address)
        # slot index -> per host parameter (parameter index, buffer address, nbytes, reads, slot view)
        self._staging: dict[int, list[tuple[int, int, int, bool, DeviceTensor]]] = {}
        # slot index -> (native argument of the slot view, buffer address) per host parameter written
        self._copy_back_args: dict[int, list[tuple[_native.TensorArg, int]]] = {}
        # (slot index, the Scalar values) -> (recording, its plan on that slot), for recordings without scalar
        # patches: valid while the capture table still holds the recording (Capture.rehit checks)
        self._replays: dict[tuple[Any, ...], tuple["Recorded", "_native.ReplayPlan"]] = {}
        # One signature replays at most the runtime's capture_limit recordings on each of its slots (a decoder
        # step: one per position); beyond that its Scalar values keep changing, and the table starts over.
        self._replays_limit = replays_limit

    def replay_key(self, slot_index: int, values: list[Any]) -> tuple[Any, ...]:
        key: list[Any] = [slot_index]
        for i, _, _ in self.scalars:
            v = values[i]
            key.append(v.hex() if type(v) is float else v)  # floats by their bits, as capture keys are
        return tuple(key)

    def replayed(self, key: tuple[Any, ...]) -> "tuple[Recorded, _native.ReplayPlan] | None":
        return self._replays.get(key)

    def remember(self, key: tuple[Any, ...], recorded: "Recorded", plan: "_native.ReplayPlan") -> None:
        replays = self._replays
        if len(replays) >= self._replays_limit:
            replays.clear()
        replays[key] = (recorded, plan)

    def host_arrays(self, values: list[Any]) -> list[np.ndarray]:
        """Per host parameter, this call's array: the caller's, or a new one for an omitted Out."""
        return [values[h[0]] if h[7] else np.empty(h[2], h[3]) for h in self.hosts]

    def outputs_of(self, hosts: list[np.ndarray]) -> list[Any]:
        """The call's outputs in declaration order, its host arrays being `hosts` (host_arrays())."""
        return [x if kind == "device" else hosts[x] for kind, x in self.outputs]

    def staging(self, slot: "Slot") -> list[tuple[int, int, int, bool, DeviceTensor]]:
        """Per host parameter, in order: (parameter index, slot buffer address, nbytes, reads, the slot view at
        the call's shape)."""
        hit = self._staging.get(slot.index)
        if hit is None:
            hit = []
            for h in self.hosts:
                view, addr = slot_view(slot, h[1], h[2], h[8])
                hit.append((h[0], addr, h[4], h[5], view))
            self._staging[slot.index] = hit
        return hit

    def copy_back_args(self, slot: "Slot") -> list[tuple[_native.TensorArg, int]]:
        """(native argument of the slot view, buffer address) per host parameter the run writes."""
        hit = self._copy_back_args.get(slot.index)
        if hit is None:
            hit = self._copy_back_args[slot.index] = [(view._native_arg(), addr) for h, (_, addr, _, _, view)
                                                      in zip(self.hosts, self.staging(slot)) if h[6]]
        return hit

    def copy_backs(self, slot: "Slot", tensor_base: Mapping[int, int]) -> list[tuple[int, int]]:
        hit = self._copy_backs.get(slot.index)
        if hit is None:
            hit = self._copy_backs[slot.index] = [(tensor_base[h[0]], slot.buffers[h[1]].addr)
                                                   for h in self.hosts if h[6]]
        return hit


class CachedBinding:
    """One call that matched a cached signature: its checked values (one per parameter) and the entry.

    It is also the finish payload's call (engine.base_runtime.finish_run): it keeps the caller's arrays
    alive while the run is in flight, and has no outputs to write back (only arrays staged as they are
    are cached).
    """

    __slots__ = ("entry", "values", "args", "kwargs")
    outputs: tuple[()] = ()

    def __init__(self, entry: CachedCall, values: list[Any], args: tuple[Any, ...], kwargs: Mapping[str, Any]):
        self.entry = entry
        self.values = values
        self.args = args  # kept for the full path, should the key no longer be recorded
        self.kwargs = kwargs


class CallCache:
    """A runtime's call signatures and what each derived."""

    def __init__(self, program: "Program", size: int, slots: int) -> None:
        self._program = program
        self._size = size
        self._replays_limit = size * slots
        self._entries: OrderedDict[tuple[Any, ...], CachedCall] = OrderedDict()

    def clear(self) -> None:
        self._entries.clear()

    def bind(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> "CachedBinding | tuple[Any, ...] | None":
        """A CachedBinding when the call matches a cached signature whose checks pass; else the call's
        signature to learn after the full path (None: not cacheable)."""
        sig = call_signature(args, kwargs)
        if sig is None:
            return None
        entry = self._entries.get(sig)
        if entry is None:
            return sig
        for _, t in entry.device_args:
            if t._alloc.freed:
                return sig  # the full path raises binding's error
        flat = args + tuple(kwargs.values()) if kwargs else args
        values = list(flat) if entry.in_order else [flat[i] if i >= 0 else None for i in entry.sources]
        for i, spec, name in entry.scalars:
            v = values[i]
            if type(v) is not spec.type:  # exactly the declared type passes as it is (Scalar.check's common case)
                values[i] = spec.check(name, v)
        return CachedBinding(entry, values, args, kwargs)

    def learn(self, sig: tuple[Any, ...], call: BoundCall, n_args: int, kw_names: Sequence[str],
              device_args: list[tuple[int, DeviceTensor]], base_key: tuple[Any, ...] | None) -> None:
        """Remembers a call that bound and launched through the full path (captured: and replayed)."""
        if not binds_as_is(call):  # another call like it might not bind the same: never cached
            return
        params = self._program.params
        sources = argument_sources(params, n_args, kw_names)
        scalars: list[tuple[int, Scalar, str]] = []
        hosts: list[tuple[int, str, tuple[int, ...], Any, int, bool, bool, bool, DType]] = []
        outputs: list[tuple[str, Any]] = []
        for i, (p, a) in enumerate(zip(params, call.args)):
            spec = p.spec
            if isinstance(spec, Scalar):
                scalars.append((i, spec, p.name))
                continue
            assert isinstance(spec, TensorSpec)
            value = a.value
            if isinstance(value, DeviceTensor):
                if spec.writes:
                    outputs.append(("device", value))
                continue
            if spec.writes:
                outputs.append(("host", len(hosts)))
            nbytes = spec.dtype.itemsize
            for d in a.shape:
                nbytes *= d
            hosts.append((i, p.name, a.shape, spec.dtype.numpy, nbytes, spec.reads, spec.writes, value is not None,
                          spec.dtype))
        entries = self._entries
        entries[sig] = CachedCall(sources, scalars, hosts, outputs, device_args, dict(call.dims), base_key,
                                  self._replays_limit)
        if len(entries) > self._size:
            entries.popitem(last=False)
