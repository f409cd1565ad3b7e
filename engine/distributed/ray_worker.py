"""The chip worker as a Ray actor: the same ChipHost as a worker process, fed batches by step().

The host sends each batch of protocol messages as one step(): an actor call,
one execution of a single-actor Compiled Graph (InputNode -> step), or a
message on a socket (below), as its channel says. step() applies the
bytes a Call reads to this worker's copy of the region, starts the Call on
its engine, serves memory calls at once, then waits until every Call of the
batch has completed and returns the replies, each Done with the region views
its Call wrote. With copies of the regions a batch never holds a Call that
depends on another one under way: the dispatcher sends a Call only once the
replies it depends on are back. A worker mapping the host's regions
(shares_memory_with) may get it at once, in the same batch or the next: its
engine orders the two, as a worker process's does.

A worker on the driver's node serves its batches on a Unix-domain socket
instead (serve_local, see ray_socket): the same step() on a thread of its
own, which the driver then uses for every batch of this worker. Over that
socket the driver first hands it its regions' memory files; mapped, they
replace the worker's copies, so its Calls carry no bytes and its Done none
back.

watch() runs in its own concurrency group and returns only when the actor
dies (it is never asked to): the host waits on it to learn of a death even
while no batch is under way.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import socket
import sys
import threading
from typing import Any

import numpy as np
import ray

from engine import _native
from engine.distributed import ray_socket
from engine.distributed.memory import descriptor_view, region_arguments
from engine.distributed.program import WRITE
from engine.distributed.protocol import Call, Done, Ready, Setup, SetupFailed, portable_error
from engine.distributed.ray_wire import Entry, Wire, pack, unpack
from engine.distributed.worker import ChipHost

__all__ = ["ChipActor"]

log = logging.getLogger(__name__)


@ray.remote(concurrency_groups={"watch": 1})  # type: ignore[call-overload]  # Ray's stubs lack the option
class ChipActor:
    def __init__(self) -> None:
        self._host: ChipHost | None = None
        self._never = threading.Event()

    def setup(self, setup: Setup, sys_path: list[str], main_path: str | None) -> Ready | SetupFailed:
        """Prepares the worker; the driver's import path first, as a spawned worker process gets it.

        Programs the driver defined in its main script (module __main__) are
        imported from that file under another name, as multiprocessing's
        spawn does: this process's own __main__ is Ray's.
        """
        for p in reversed(sys_path):
            if p and p not in sys.path and os.path.isdir(p):
                sys.path.insert(0, p)
        try:
            if any(p.module == "__main__" for p in setup.programs):
                setup = setup._replace(programs=tuple(
                    p._replace(module=_import_main(main_path)) if p.module == "__main__" else p
                    for p in setup.programs))
            self._host = ChipHost(setup, local_regions=True)
            return Ready(os.getpid(), self._host.workers, self._host.clock_offset_ns)
        except BaseException as e:
            return SetupFailed(portable_error(e))

    def engine_now_ns(self) -> int:
        assert self._host is not None
        return self._host.engine_now_ns()

    def set_clock_offset(self, offset_ns: int) -> None:
        """What to add to this worker's engine clock to get the driver's (the nodes' clocks differ)."""
        assert self._host is not None
        self._host.clock_offset_ns = offset_ns

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def serve_local(self, address: str) -> None:
        """Connects to the driver's socket at `address` and serves batches on it from a thread of this actor's
        until the driver hangs up (from then on the driver sends no step() call)."""
        host = self._host
        assert host is not None
        sock = ray_socket.connect(address)
        threading.Thread(target=_serve_local, args=(sock, host), name="tandem-ray-socket", daemon=True).start()

    def step(self, batch: Wire) -> Wire:
        """A batch's replies, once every Call of it has completed (both as ray_wire packs them)."""
        assert self._host is not None
        return pack(run_batch(self._host, batch))

    @ray.method(concurrency_group="watch")
    def watch(self) -> None:
        self._never.wait()


def _serve_local(sock: socket.socket, host: ChipHost) -> None:
    """A socket's serving thread: maps the regions the driver offers (its memory, so no Call carries bytes),
    answers whether it did, then serves batches until the driver hangs up."""
    try:
        fds = ray_socket.take_regions(sock, host.region_count)
    except (EOFError, OSError):
        sock.close()  # the driver gave up on this socket (it keeps actor calls)
        return
    try:
        host.map_regions(fds)
        mapped = True
    except Exception:  # the worker keeps its copies: Calls carry bytes, as over Ray
        log.exception("the driver's regions could not be mapped; this worker keeps copies of them")
        mapped = False
    finally:
        for fd in fds:
            os.close(fd)
    try:
        ray_socket.answer_regions(sock, mapped)
    except OSError:
        sock.close()
        return
    ray_socket.serve(sock, lambda batch: pack(run_batch(host, batch), apart=True))


def run_batch(host: ChipHost, batch: Wire) -> list[Entry]:
    """The replies to a batch, once every Call of it has completed: each Done with the region views its Call
    wrote."""
    replies: list[Entry] = []
    waiting: dict[int, Call] = {}
    for msg, reads in unpack(batch):
        if not isinstance(msg, Call):
            replies.append((host.handle(msg), ()))
            continue
        try:
            for i, data in reads:
                np.copyto(_view(host, msg.args[i], True), data)
        except BaseException as e:
            replies.append((Done(msg.seq, portable_error(e), -1, -1), ()))
            continue
        done = host.call(msg)
        if done is None:
            waiting[msg.seq] = msg
        else:
            replies.append((done, ()))
    fd = host.notifier_fd
    while waiting:
        host.run_queued()  # this thread is one of the worker's executors (see worker.serve)
        completed = host.completed()
        if not completed:  # the rest is on the pool threads: they announce each run they complete
            _native.wait_readable([fd], ray_socket.SPIN_US)  # polling first, as a worker process's serve() does
            continue
        for done in completed:
            msg = waiting.pop(done.seq)
            writes: tuple[tuple[int, np.ndarray], ...] = ()
            if done.error is None and host.local_regions:  # in the host's memory already when shared
                writes = tuple((i, np.array(_view(host, msg.args[i], False)))
                               for i in region_arguments(msg.args, msg.access, WRITE))
            replies.append((done, writes))
    return replies


def _view(host: ChipHost, desc: tuple[Any, ...], writable: bool) -> np.ndarray:
    """This worker's view of a region argument of a Call."""
    return descriptor_view(host.region_bytes(desc[1]), desc, writable)


_MAIN_ALIAS = "__tandem_driver_main__"


def _import_main(path: str | None) -> str:
    """Imports the driver's main script (its `if __name__ == "__main__":` block does not run); its module name."""
    if _MAIN_ALIAS in sys.modules:
        return _MAIN_ALIAS
    if not path or not os.path.isfile(path):
        raise ImportError(f"a sub-program is defined in the driver's main script ({path or 'no file'}), which this "
                          "node cannot import; define sub-programs in a module installed on every node")
    spec = importlib.util.spec_from_file_location(_MAIN_ALIAS, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[_MAIN_ALIAS] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[_MAIN_ALIAS]
        raise
    return _MAIN_ALIAS
