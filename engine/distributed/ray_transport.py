"""RayTransport: chip workers as Ray actors, on one machine or across a cluster.

    import engine.distributed as dist
    drt = dp_mlp.prepare(workers=2, transport=dist.RayTransport(placement="spread"))

Each chip worker is a Ray actor (engine.distributed.ray_worker.ChipActor)
running the same ChipHost as a worker process: its own device, its own pool.
The actors are placed through one placement group (one bundle per worker;
"spread" puts them on different nodes where possible, "pack" on as few as
possible); `worker_options` passes actor options (num_cpus, resources,
scheduling_strategy, ...) to all workers (a dict) or to each (a list).

Data path. The host's regions are memory files (memfd). A worker on another
node has its own copy of each slot's region; the host's copy is the
reference: a Call carries the compact bytes of the region views it reads,
its Done brings back the views it wrote, which the host writes into its
region before handing the Done on. A worker on the driver's node maps the
host's regions instead (their fds cross its socket when it connects), so its
Calls carry no bytes and its kernels write the host's memory, as a worker
process's do; if it cannot map them it keeps copies and its socket carries
the bytes (sharing_workers says which map them). Resident tensors stay on
their worker and never cross; a run whose arguments are all resident moves
no tensor bytes (transfer_stats() counts what moved). A worker runs a batch of
messages per call and replies once every Call of it has completed; messages
queued meanwhile form the next batch. One thread at a time drives the
workers (executes their batches and takes the replies): a sync call
(`drt(x)`) drives its own run on its thread when no other does, so no
thread has to wake it; otherwise one pump thread serves every worker.

Channels, chosen by measurement (benchmarks/README.md, 2-core VM, Ray 2.60).
"auto" (the default) reaches each worker Ray placed on the driver's node
through a Unix-domain socket (ray_socket) and the others by plain actor
calls: with the regions shared (Data path), a small sync run 0.09-0.19 ms on
the driver's node (0.36-0.65x a bare Compiled Graph step beside it, where an
actor call costs 0.94-1.25 ms, 3.2-4.2x) and 0.38-0.50x the bare step at
1-4 MB a run, whose arrays the bare step copies through its channel; and
the socket tells of a worker's death at once (its end closes).
"actor" makes every batch a plain actor call (on another node 0.72-1.2x
the bare step: the network's and Ray's cost, not the channel's).
"compiled" sends batches through one Ray Compiled Graph per worker: a small
sync run 0.24 ms on the driver's node, 1.05 ms on another (0.79x / 0.87x
the bare step: a small batch crosses as one bytes object, see ray_wire),
and 1.7-2.6x the streaming throughput of "actor" at 256 KB per run, but its
channels busy-poll (an idle worker actor and a waiting driver each burn a
core), Ray keeps their buffers in the object store after teardown, and when
a worker died, Ray 2.60 once aborted the driver process (a failed check in
its mutable-object reader registration, in one of four runs of the
killed-worker test). A worker death must never take the caller's process
with it, so it is not the default.

Faults. A worker whose actor or node dies fails the runs that need it with
WorkerDiedError (through on_exit): a dead actor is seen within about a
second (behind a socket: as soon as the driver reads it); a node that
disappears within Ray's node health check (about 30 s by default). stop()
tears the graphs down, shuts the sockets (a worker's serving thread ends, a
driver reading one wakes), kills every actor, waits until Ray reports them
dead and removes the placement group. Ray itself is connected with
ray.init(address) when it is not initialized yet, and stays connected for
the process (ray.shutdown() ends it).
"""

from __future__ import annotations

import logging
import mmap
import os
import socket
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable, ContextManager, Mapping, Sequence

import numpy as np

from engine.distributed import ray_socket
from engine.distributed.errors import WorkerDiedError
from engine.distributed.memory import descriptor_view, region_arguments
from engine.distributed.program import READ
from engine.distributed.protocol import Call, Ready, Setup, SetupFailed
from engine.distributed.ray_wire import Entry, Wire, pack, unpack
from engine.distributed.transport import (CallerReads, CallerRole, OnExit, OnMessage, Region, SenderCpu, Transport,
                                          WakePipe)


__all__ = ["RayTransport"]

log = logging.getLogger(__name__)

_PLACEMENTS = {"spread": "SPREAD", "pack": "PACK"}
_CHANNELS = ("auto", "actor", "compiled")
_CHANNEL_BYTES = 64 << 10  # a compiled graph channel's first buffer
_UNDER_WAY = 2  # batches under way per worker (a compiled graph's in-flight executions)


class _HostRegion(Region):
    """The host's copy of a slot's region: a memory file (memfd) the host maps, which a worker on the driver's
    node maps too (its fd crosses the worker's socket); a worker elsewhere keeps a copy of its own."""

    def __init__(self, index: int, nbytes: int) -> None:
        self.index = index
        self.name = f"ray-region-{index}"
        self.size = max(1, nbytes)
        self.fd: int | None = None  # open until the workers started (one may map it); the mapping keeps its own
        if hasattr(os, "memfd_create"):
            self.fd = os.memfd_create(self.name, os.MFD_CLOEXEC)
            try:
                os.ftruncate(self.fd, self.size)
                # The array keeps the mapping (and the descriptor mmap holds): both go once no view of the region
                # is left.
                self.base = np.frombuffer(mmap.mmap(self.fd, self.size), np.uint8)
            except BaseException:
                os.close(self.fd)
                raise
        else:  # no memory files (not Linux): no worker shares the host's memory, and none needs to
            self.base = np.zeros(self.size, np.uint8)

    def close_file(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    @property
    def buf(self) -> memoryview:
        return self.base.data


class _Execution:
    """One batch under way on one worker: what the pump needs when its replies come back."""

    __slots__ = ("worker", "ref", "sock", "calls", "sent_bytes", "sent_views", "future")

    def __init__(self, worker: int, ref: Any, sock: socket.socket | None, calls: dict[int, Call], sent_bytes: int,
                 sent_views: int) -> None:
        self.worker = worker
        self.ref = ref  # an actor call's or a compiled graph's result (None on a socket)
        self.sock = sock  # the worker's socket, its replies next in line there (None across Ray)
        self.calls = calls
        self.sent_bytes = sent_bytes
        self.sent_views = sent_views
        # An actor call's result as a future, once a driver waited on it: its completion pokes the driver asleep
        # (see RayTransport._first_back).
        self.future: Future[Any] | None = None

    def back(self, readable: list[socket.socket]) -> bool:
        """Its replies can be taken without waiting: its socket is readable, or its actor call has completed."""
        return self.sock in readable if self.sock is not None else self.future is not None and self.future.done()


class RayTransport(Transport):
    """Chip workers as Ray actors: pass it as DistributedProgram.prepare(transport=...).

    address: the Ray cluster to connect to (None: what ray.init() finds or
    starts; ignored when Ray is connected already); one nobody answers at,
    given or found, raises ConnectionError at start(). placement: "spread" or
    "pack". worker_options: Ray actor options for every worker (a dict) or
    per worker (a sequence of dicts, one per worker); a worker given its own
    scheduling_strategy is placed by it rather than by the placement group.
    channel: "auto" (the default: a Unix-domain socket to each worker on the
    driver's node, plain actor calls to the others), "actor" (plain actor
    calls to every worker) or "compiled" (a Ray Compiled Graph per worker:
    see the module docstring for its costs and Ray's failure on a worker's
    death). A transport serves one runtime. follow_sender: the pump thread,
    woken by a message, moves to its sender's CPU, as ProcessTransport's
    receiving thread does (on a 2-vCPU VM, with the pump and an awaiting
    event loop on different CPUs, an awaited round trip to a socket worker
    took 214-378 us against 117-140 on one CPU); False leaves it where the
    scheduler puts it.
    """

    shares_memory = False

    def __init__(self, address: str | None = None, *, placement: str = "spread",
                 worker_options: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
                 channel: str = "auto", follow_sender: bool = True) -> None:
        try:
            import ray  # noqa: F401  (optional: the `ray` extra)
        except ImportError:
            raise ImportError("RayTransport needs Ray: pip install 'tandem[ray]'") from None
        if channel not in _CHANNELS:
            raise ValueError(f"channel must be 'auto' (a socket to the driver's node's workers, actor calls to the "
                             f"others), 'actor' (plain actor calls) or 'compiled' (a Ray Compiled Graph per worker), "
                             f"not {channel!r}")
        if placement not in _PLACEMENTS:
            raise ValueError(f"placement must be 'spread' or 'pack', not {placement!r}")
        follower = SenderCpu(follow_sender)  # the pump's CPU follows the senders that wake it (checks the option)
        if address is not None and not isinstance(address, str):
            raise TypeError(f"address must be a string such as 'ray://host:10001' or 'host:6379', not {address!r}")
        if worker_options is not None and not isinstance(worker_options, Mapping):
            if isinstance(worker_options, (str, bytes)) or not isinstance(worker_options, Sequence) or not all(
                    isinstance(o, Mapping) for o in worker_options):
                raise TypeError("worker_options must be a dict of Ray actor options or a list of them (one per "
                                f"worker), not {worker_options!r}")
        self.address = address
        self.placement = placement
        self.channel = channel
        self.follow_sender = follow_sender
        self._follower = follower
        self._worker_options = worker_options
        self.workers = 0
        self._regions: list[_HostRegion] = []
        self._bases: list[np.ndarray] = []  # the regions' bytes, by index (fixed once started)
        self._actors: list[Any] = []
        self._watches: dict[Any, int] = {}  # a watch() ref -> its worker: it resolves when the actor dies
        self._dags: list[Any] = []
        self._sockets: list[socket.socket | None] = []  # per worker: its socket when it is on the driver's node
        self._shared: list[bool] = []  # per worker: it maps the host's regions (through its socket)
        self._outboxes: list[deque[Any]] = []  # per worker, in order; guarded by _wake
        self._wake = threading.Condition()  # a message was queued, the driver role was given back, or stop()
        # The driver role: the one thread that executes batches and takes their replies (the pump, or a sync
        # caller inside caller_reads()), by thread id; guarded by _wake. Only the driver touches these two:
        self._driver: int | None = None
        self._under_way: deque[_Execution] = deque()  # executions in the order they were started
        # While the driver sleeps on its sockets' replies, a message queued for a worker with room for another
        # batch wakes it through this pipe, so the batch goes out while the others run (see _first_back).
        self._poke: WakePipe | None = None
        self._driver_sleeps = False
        self._busy: list[int] = []  # executions under way per worker
        self._role = CallerRole()  # the one thread inside caller_reads()
        self._on_message: OnMessage | None = None
        self._stop_asked = False
        self._pump: threading.Thread | None = None
        self._watcher: threading.Thread | None = None
        self._pg: Any = None
        self._gone: set[int] = set()
        self._lock = threading.Lock()  # _gone, the counters, starting and stopping
        self._on_exit: OnExit | None = None
        self._started = False
        self._stopped = False
        self._stats = {"bytes_to_workers": 0, "bytes_from_workers": 0, "views_to_workers": 0,
                       "views_from_workers": 0, "executions": 0}
        self.node_ids: list[str] = []  # the Ray node of each worker, once started

    @property
    def actors(self) -> list[Any]:
        """The workers' Ray actor handles (dead ones after stop())."""
        return list(self._actors)

    @property
    def placement_group(self) -> Any:
        """The placement group the workers were placed by (None when every worker has its own strategy)."""
        return self._pg

    # -- regions -------------------------------------------------------------------------------
    def create_region(self, nbytes: int) -> Region:
        region = _HostRegion(len(self._regions), nbytes)
        self._regions.append(region)
        return region

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self, setups: Sequence[Setup], on_message: OnMessage, on_exit: OnExit, timeout: float) -> list[Ready]:
        import ray
        from ray.dag import InputNode
        from ray.util.placement_group import placement_group

        from engine.distributed.ray_worker import ChipActor

        actor_class: Any = ChipActor  # a Ray actor class (its type is the decorated class to checkers)

        with self._lock:
            if self._started:
                raise RuntimeError("a RayTransport serves one runtime; make a new one for another")
            self._started = True
        deadline = time.monotonic() + timeout
        n = self.workers = len(setups)
        options = self._options(n)
        self._on_exit = on_exit
        if not ray.is_initialized():
            target = _ray_init_target(self.address)
            if target is not None:
                _probe(*target, _left(deadline))  # ray.init waits minutes on an address nobody answers
            ray.init(address=self.address, logging_level=logging.ERROR, log_to_driver=False,
                     ignore_reinit_error=True)
        placed = [i for i in range(n) if "scheduling_strategy" not in options[i]]
        if placed:
            bundles = [_bundle(options[i]) for i in placed]
            self._pg = placement_group(bundles, strategy=_PLACEMENTS[self.placement], name="")
            ready, _ = ray.wait([self._pg.ready()], timeout=_left(deadline))
            if not ready:
                raise TimeoutError(f"Ray could not place {len(placed)} chip workers (bundles {bundles}) within "
                                   f"startup_timeout={timeout} s; the cluster has {ray.available_resources()} "
                                   "available")
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            for b, i in enumerate(placed):
                options[i] = {**options[i], "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    self._pg, placement_group_bundle_index=b)}
        for i in range(n):
            # No restarts: a restarted actor would have lost its resident tensors; the runtime reports a death.
            opts = {"num_cpus": 1, **options[i], "max_restarts": 0}
            self._actors.append(actor_class.options(**opts).remote())
        path = list(sys.path) if os.getcwd() in sys.path else [os.getcwd(), *sys.path]
        main_path = getattr(sys.modules.get("__main__"), "__file__", None)
        setup_refs = [a.setup.remote(s, path, main_path) for a, s in zip(self._actors, setups)]
        readies = [self._await_ready(i, ref, deadline, timeout) for i, ref in enumerate(setup_refs)]
        for i, actor in enumerate(self._actors):  # the workers' clocks onto the driver's (nodes differ)
            offset = _clock_offset(actor, deadline)
            ray.get(actor.set_clock_offset.remote(offset), timeout=_left(deadline))
            readies[i] = readies[i]._replace(clock_offset_ns=offset)
        self.node_ids = ray.get([a.node_id.remote() for a in self._actors], timeout=_left(deadline))
        self._sockets = [None] * n
        self._shared = [False] * n
        if self.channel == "auto":
            self._connect_local(readies, deadline)
        for region in self._regions:  # offered to every worker that can map them: the mappings keep the memory
            region.close_file()
        self._watches = {a.watch.remote(): i for i, a in enumerate(self._actors)}
        for actor in self._actors:
            if self.channel == "compiled":
                with InputNode() as inp:
                    dag = actor.step.bind(inp)
                # A channel grows by itself when a batch is larger than its first buffer.
                self._dags.append(dag.experimental_compile(_max_inflight_executions=_UNDER_WAY,
                                                           _buffer_size_bytes=_CHANNEL_BYTES))
            else:
                self._dags.append(None)
        self._outboxes = [deque() for _ in range(n)]
        self._busy = [0] * n
        if self.channel != "compiled":
            self._poke = WakePipe()
        self._bases = [r.base for r in self._regions]
        self._on_message = on_message
        self._pump = threading.Thread(target=self._serve, name="tandem-ray-pump", daemon=True)
        self._pump.start()
        self._watcher = threading.Thread(target=self._watch, name="tandem-ray-watcher", daemon=True)
        self._watcher.start()
        return readies

    def _connect_local(self, readies: list[Ready], deadline: float) -> None:
        """A socket to each worker on the driver's node (ray_socket); one that cannot connect keeps actor calls."""
        import ray

        if (self.address or "").startswith("ray://"):
            return  # a Ray client's driver is on no node of the cluster
        fds = [r.fd for r in self._regions if r.fd is not None]
        if len(fds) < len(self._regions):
            return  # no memory files, so not Linux: no abstract sockets either
        here = ray.get_runtime_context().get_node_id()
        for i, actor in enumerate(self._actors):
            if self.node_ids[i] != here:
                continue
            listener = sock = None
            try:
                try:
                    listener = ray_socket.Listener()
                    ray.get(actor.serve_local.remote(listener.address), timeout=_left(deadline))
                    sock = listener.accept(readies[i].pid, _left(deadline))
                    self._shared[i] = ray_socket.offer_regions(sock, fds, _left(deadline))
                    self._sockets[i], sock = sock, None
                except Exception as e:  # another network or pid namespace, no abstract sockets: keep actor calls
                    log.info("chip worker %d keeps Ray actor calls: no socket to it (%s)", i, _first_line(e))
            finally:
                if listener is not None:
                    listener.close()
                if sock is not None:
                    sock.close()

    @property
    def socket_workers(self) -> list[int]:
        """The workers reached through a socket on the driver's node (channel "auto")."""
        return [i for i, s in enumerate(self._sockets) if s is not None]

    def shares_memory_with(self, worker: int) -> bool:
        return worker < len(self._shared) and self._shared[worker]  # none before start()

    @property
    def sharing_workers(self) -> list[int]:
        """The socket workers that address the host's regions in place: no Call to them carries region bytes."""
        return [i for i, shared in enumerate(self._shared) if shared]

    def _options(self, n: int) -> list[dict[str, Any]]:
        opts = self._worker_options
        if opts is None:
            return [{} for _ in range(n)]
        if isinstance(opts, Mapping):
            return [dict(opts) for _ in range(n)]
        if len(opts) != n:
            raise ValueError(f"worker_options has {len(opts)} entries for {n} workers (one per worker, or one dict "
                             "for all)")
        return [dict(o) for o in opts]

    def _await_ready(self, i: int, ref: Any, deadline: float, timeout: float) -> Ready:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        try:
            msg = ray.get(ref, timeout=_left(deadline))
        except GetTimeoutError:
            raise TimeoutError(f"chip worker {i} (a Ray actor) was not ready within startup_timeout={timeout} s") \
                from None
        except RayActorError as e:
            raise WorkerDiedError(f"chip worker {i} (a Ray actor) died during startup: {_first_line(e)}", i,
                                  None) from None
        if isinstance(msg, SetupFailed):
            raise msg.error
        assert isinstance(msg, Ready)
        return msg

    def _serve(self) -> None:
        """The pump: drives every worker's batches whenever no sync caller does (see _drive_once)."""
        me = threading.get_ident()
        while True:
            with self._wake:
                self._wake.wait_for(self._pump_may_drive)
                if self._stop_asked and not self._under_way:
                    return
                self._driver = me
            self._follower.follow()
            try:
                self._drive_once()
            finally:
                with self._wake:
                    self._driver = None

    def _pump_may_drive(self) -> bool:  # under _wake
        return self._driver is None and (self._stop_asked or bool(self._under_way) or self._sendable())

    def _sendable(self) -> bool:  # under _wake
        busy = self._busy
        return any(box and busy[w] < _UNDER_WAY for w, box in enumerate(self._outboxes))

    def _drive_once(self) -> None:
        """One round of the driver: every worker's queued messages out, one execution's replies in.

        Whoever drives is the only thread executing graphs: Ray's compiled graphs hang when two threads of
        one driver execute them concurrently (Ray 2.60), and executions never block, so every worker with
        messages has its batch under way before the driver waits for the oldest one's replies. A worker
        has up to two batches under way, so that it starts the next as soon as it has replied to one (a
        batch's Calls depend on one under way only on a worker sharing the host's memory, whose engine
        orders them: for a worker with copies the dispatcher releases a Call only once what it depends on
        is back); messages queued meanwhile go out together as the batch after. A waiting driver wakes
        for such messages (a sender pokes its WakePipe), so their batch is on its worker before the
        replies it waited for come back: with a 200 us step streamed at depth 2 to a socket worker,
        2.8-3.4k against 1.7-2.4k runs/s. An actor call completing pokes the same pipe (see _first_back).
        """
        compiled = self.channel == "compiled"
        under_way, busy = self._under_way, self._busy
        with self._wake:
            taken = []
            for w, box in enumerate(self._outboxes):
                if box and busy[w] < _UNDER_WAY:
                    taken.append((w, list(box)))
                    box.clear()
        deferred: list[BaseException] = []  # an interrupt while a socket was full: raised once all is sent
        for k, (w, msgs) in enumerate(taken):
            if w in self._gone:
                continue
            sock, ref = self._sockets[w], None
            batch, calls, sent_bytes, sent_views = self._pack(msgs, sock is not None, self._shared[w])
            try:
                if sock is not None:
                    ray_socket.send_wire(sock, batch, deferred)
                elif compiled:
                    ref = self._dags[w].execute(batch)
                else:
                    ref = self._actors[w].step.remote(batch)
            except Exception as e:
                self._lost(w, f"chip worker {w} (Ray actor on node {self._node(w)}) failed: {_first_line(e)}")
                continue
            except BaseException:  # an interrupt cut this batch short: its runs fail rather than hang
                self._lost(w, f"chip worker {w}: a batch to it was cut short by an interrupt")
                with self._wake:
                    for v, rest in reversed(taken[k + 1:]):  # the others' batches go out with the next round
                        self._outboxes[v].extendleft(reversed(rest))
                raise
            under_way.append(_Execution(w, ref, sock, calls, sent_bytes, sent_views))
            busy[w] += 1
        if deferred:
            raise deferred[0]  # every batch is under way: the next driver takes their replies
        if not under_way:
            return
        ex = self._first_back(under_way, compiled)
        if ex is None:
            return  # the next round sends what was queued
        w = ex.worker
        try:
            if ex.sock is not None:
                replies = ray_socket.recv_wire(ex.sock, deferred)
            elif compiled:
                replies = ex.ref.get(timeout=-1)
            else:
                assert ex.future is not None  # an actor call's, done: _first_back returned it
                replies = ex.future.result()
        except Exception as e:
            self._done_with(ex)
            if ex.sock is not None and isinstance(e, (EOFError, ConnectionError)):
                self._lost(w, f"chip worker {w} (Ray actor on the driver's node) is gone: its socket closed (the "
                              "actor died, or its serving thread failed: see the actor's log)")
            else:
                self._lost(w, f"chip worker {w} (Ray actor on node {self._node(w)}) failed: {_first_line(e)}")
            return
        except BaseException:  # an interrupt of a driving caller
            # A compiled graph's result is read once, and a socket's message was cut (recv_wire defers the
            # interrupts it can): these replies are lost, and it is said.
            if compiled or ex.sock is not None:
                self._done_with(ex)
                self._lost(w, f"chip worker {w}: its replies were lost to an interrupt of the thread reading them")
            raise  # an actor call's result stays under way for the next driver
        self._done_with(ex)
        self._take_replies(ex, replies)
        if deferred:
            raise deferred[0]

    def _first_back(self, under_way: deque[_Execution], compiled: bool) -> _Execution | None:
        """The execution whose replies to take next, once they are there (an interrupt while waiting leaves
        every execution under way); None when there is a batch to send first."""
        if compiled:  # a compiled graph's results are read in execution order
            return under_way[0]
        socks = {e.sock for e in under_way if e.sock is not None}
        # The oldest execution that is back, or None when a message queued meanwhile can go out (its batch then
        # runs on its worker while this driver waits for the others' replies). The driver sleeps on the sockets
        # and its WakePipe, which a sender poking it wakes and so does an actor call completing (a callback of
        # the call's future, on Ray's thread): whatever mix of the two is under way, no reply waits behind
        # another, and nothing polls (ray.wait with looks for queued batches kept 1% of a core busy through a
        # long remote run, against 0.35% now; a 200 us step streamed to another node 0.91-1.06k against
        # 0.81-0.87k runs/s).
        self._driver_sleeps = True
        try:
            with self._wake:
                if self._sendable():  # queued before its sender could see this driver asleep
                    return None
            for e in under_way:
                if e.sock is None and e.future is None:
                    e.future = e.ref.future()
                    e.future.add_done_callback(self._poke_driver)
            back = next((e for e in under_way if e.back([])), None)  # completed before this driver slept
            if back is not None:
                return back
            readable = ray_socket.wait_readable(*socks, poke=self._poke)
        finally:
            self._driver_sleeps = False
        return next((e for e in under_way if e.back(readable)), None)

    def _poke_driver(self, _: Any = None) -> None:
        """Wakes the driver if it sleeps in _first_back (also called by Ray, on its own thread, when an actor call
        completes)."""
        if self._driver_sleeps and self._poke is not None:
            self._poke.poke()

    def _done_with(self, ex: _Execution) -> None:
        self._under_way.remove(ex)
        self._busy[ex.worker] -= 1

    def _pack(self, msgs: list[Any], apart: bool, shared: bool) -> tuple[Wire, dict[int, Call], int, int]:
        """A batch of messages, each Call with the compact bytes of the region views it reads unless the worker
        shares the regions; the Calls whose writes will come back, by seq (apart: see ray_wire.pack)."""
        bases = self._bases
        batch: list[Entry] = []
        calls: dict[int, Call] = {}
        sent_bytes = sent_views = 0
        for m in msgs:
            reads: tuple[tuple[int, np.ndarray], ...] = ()
            if isinstance(m, Call) and not shared:
                calls[m.seq] = m
                reads = tuple((k, np.ascontiguousarray(_view(bases, m.args[k], False)))
                              for k in region_arguments(m.args, m.access, READ))
                sent_views += len(reads)
                sent_bytes += sum(r.nbytes for _, r in reads)
            batch.append((m, reads))
        return pack(batch, apart), calls, sent_bytes, sent_views

    def _take_replies(self, ex: _Execution, replies: Any) -> None:
        """Writes what an execution's Calls wrote into the host's regions, then hands every reply on."""
        w = ex.worker
        on_message = self._on_message
        assert on_message is not None
        bases = self._bases
        got_bytes = got_views = 0
        try:
            for reply, writes in unpack(replies):
                if writes:
                    call = ex.calls[reply.seq]
                    for k, data in writes:
                        np.copyto(_view(bases, call.args[k], True), data)
                        got_views += 1
                        got_bytes += data.nbytes
                on_message(w, reply)
        except BaseException as e:  # a reply the host cannot take: never leave runs hanging
            self._lost(w, f"chip worker {w}: its reply could not be handled ({type(e).__name__}: {e})")
            if not isinstance(e, Exception):
                raise  # an interrupt of a driving caller: the runtime is broken, and it is said
            return
        finally:
            del replies  # a compiled graph's arrays are views of its channel buffer: let go before the next
        with self._lock:
            s = self._stats
            s["executions"] += 1
            s["bytes_to_workers"] += ex.sent_bytes
            s["views_to_workers"] += ex.sent_views
            s["bytes_from_workers"] += got_bytes
            s["views_from_workers"] += got_views

    def _watch(self) -> None:
        """Learns of actors that die while no batch is under way (a pump learns of it from its execution)."""
        import ray

        pending = dict(self._watches)
        while pending and not self._stopped:
            done, _ = ray.wait(list(pending), num_returns=1, timeout=0.5)
            for ref in done:
                i = pending.pop(ref)
                try:
                    ray.get(ref)
                    reason = "returned"
                except Exception as e:
                    reason = _first_line(e)
                self._lost(i, f"chip worker {i} (Ray actor on node {self._node(i)}) died: {reason}")

    def _lost(self, i: int, reason: str) -> None:
        with self._lock:
            if self._stopped or i in self._gone:
                return
            self._gone.add(i)
        assert self._on_exit is not None
        self._on_exit(i, reason)

    def _node(self, i: int) -> str:
        return self.node_ids[i][:12] if i < len(self.node_ids) else "?"

    def send(self, worker: int, message: Any, block: bool = True) -> bool:
        """Queues the message for worker's pump: never waits."""
        if worker in self._gone or self._stopped:
            raise OSError(f"chip worker {worker} is gone")
        wakes = self._role.holder != threading.get_ident()  # a caller inside caller_reads() drives its own
        if wakes:
            self._follower.note()
        with self._wake:
            self._outboxes[worker].append(message)
            if wakes:
                self._wake.notify()
        self._poke_driver()
        return True

    # -- a sync caller driving its own run -------------------------------------------------------------
    def caller_reads(self) -> ContextManager[bool]:
        """While in it, this thread's sends do not wake the pump: the thread executes its batches and takes
        their replies itself when it waits (read_until), so no thread has to wake another on the way."""
        return CallerReads(self._role.take, self._end_caller)  # a thread that cannot take it waits as usual

    def _end_caller(self) -> None:
        self._role.give_back()
        with self._wake:
            self._hand_to_pump()  # whatever this thread queued and did not drive

    def _hand_to_pump(self) -> None:  # under _wake: wakes the pump only when there is work for it
        if self._pump_may_drive():
            self._wake.notify()

    def read_until(self, done: Callable[[], bool], timeout: float | None) -> bool | None:
        """Drives batches on this thread until done(), when this thread is inside caller_reads(), waits
        without a timeout, and no other thread drives; else None (wait as usual: the pump drives)."""
        me = threading.get_ident()
        if self._role.holder != me:
            return None
        with self._wake:
            # A timed wait leaves driving to the pump, as a driver's read cannot be cut short; so does a
            # caller when the pump drives already or the transport stops.
            if timeout is not None or self._driver is not None or self._stop_asked:
                self._hand_to_pump()  # this thread's sends did not wake it
                return None
            self._driver = me
        try:
            while not done():
                with self._wake:
                    if self._stop_asked or (not self._under_way and not self._sendable()):
                        break  # what the run waits for is not this thread's to drive (or the pump finishes)
                self._drive_once()
        finally:
            with self._wake:
                self._driver = None
                self._hand_to_pump()  # what is left
        return True if done() else None

    def alive(self, worker: int) -> bool:
        return self._started and not self._stopped and worker not in self._gone

    def transfer_stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self._stats)

    def stop(self, timeout: float = 5.0) -> None:
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        try:
            if self._started:
                self._stop_workers(timeout)
        finally:
            for region in self._regions:  # the mappings stay while a view of them lives
                region.close_file()

    def _stop_workers(self, timeout: float) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        deadline = time.monotonic() + timeout
        with self._wake:
            self._stop_asked = True
            self._wake.notify()
        pump = self._pump
        if pump is not None:  # a pump still waiting on an execution (a kernel that does not return) ends with the kill
            pump.join(_left(deadline))
        for sock in self._sockets:
            if sock is not None:  # the worker's serving thread ends; a pump still reading it wakes
                _quietly(sock.shutdown, socket.SHUT_RDWR)
        if pump is None or not pump.is_alive():
            for dag in self._dags:
                if dag is not None:
                    _quietly(dag.teardown)
        for actor in self._actors:
            _quietly(ray.kill, actor, no_restart=True)
        if self._watches:  # dead once Ray says so: then no actor is left behind
            _quietly(ray.wait, list(self._watches), num_returns=len(self._watches), timeout=max(1.0, _left(deadline)))
        if pump is not None:
            pump.join(1.0)
        for sock in self._sockets:
            if sock is not None:
                sock.close()
        if self._watcher is not None:
            self._watcher.join()
        if self._pg is not None:
            _quietly(remove_placement_group, self._pg)
        if self._poke is not None and (pump is None or not pump.is_alive()):  # else the pump may still wait on it
            self._poke.close()


def _bundle(options: Mapping[str, Any]) -> dict[str, float]:
    """The placement-group bundle of one worker: the CPUs and custom resources its actor asks for."""
    bundle: dict[str, float] = {"CPU": float(options.get("num_cpus", 1))}
    if options.get("num_gpus"):
        bundle["GPU"] = float(options["num_gpus"])
    for name, amount in (options.get("resources") or {}).items():
        bundle[name] = float(amount)
    if options.get("memory"):
        bundle["memory"] = float(options["memory"])
    return bundle


def _view(bases: list[np.ndarray], desc: tuple[Any, ...], writable: bool) -> np.ndarray:
    """The host's view of a region argument of a Call."""
    return descriptor_view(bases[desc[1]], desc, writable)


def _ray_init_target(address: str | None) -> tuple[str, str] | None:
    """(the address ray.init(address) would connect to, where it came from), or None when it would start a
    local instance. With no address Ray takes RAY_ADDRESS, then the cluster `ray start` (or a test's
    ray.cluster_utils.Cluster) last wrote to ray_current_cluster in its temp dir: a leftover of one killed
    there names a cluster that no longer answers, and ray.init would wait minutes on it."""
    if address == "local":
        return None
    if address not in (None, "auto"):
        return address, "address="
    env = os.environ.get("RAY_ADDRESS")
    if env:
        return env, "RAY_ADDRESS"
    try:  # the file Ray itself reads (its reader is not public API: a Ray without it skips this look)
        from ray._private.utils import read_ray_address
        from ray._common.utils import get_ray_address_file
    except ImportError:
        return None
    found = read_ray_address()
    return (found, get_ray_address_file(None)) if found else None


def _probe(address: str, source: str, timeout: float) -> None:
    """ConnectionError unless something accepts TCP connections at `address` ("host:port" or
    "ray://host:port") within `timeout` seconds; `source` says where the address came from."""
    target = address.split("://", 1)[-1]
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"address {address!r} (from {source}) is not of the form 'host:port' or 'ray://host:port'")
    try:
        socket.create_connection((host, int(port)), timeout=max(0.5, min(timeout, 10.0))).close()
    except OSError as e:
        raise ConnectionError(f"no Ray cluster answers at {address} (from {source}; {e})") from None


_CLOCK_PROBES = 8


def _clock_offset(actor: Any, deadline: float) -> int:
    """What to add to the worker's engine clock to get the driver's: the probe with the shortest round trip
    wins (Cristian's method), so the error is at most half that trip, not half of a slow first call's."""
    import ray

    best: tuple[int, int] | None = None
    for _ in range(_CLOCK_PROBES):
        t0 = time.monotonic_ns()
        remote_now = ray.get(actor.engine_now_ns.remote(), timeout=_left(deadline))
        t1 = time.monotonic_ns()
        if best is None or t1 - t0 < best[0]:
            best = (t1 - t0, (t0 + t1) // 2 - remote_now)
    assert best is not None
    return best[1]


def _left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def _quietly(fn: Any, *args: Any, **kwargs: Any) -> None:
    """Cleanup that must go on past a failure (an actor already dead, a graph already torn down)."""
    try:
        fn(*args, **kwargs)
    except Exception:
        pass
