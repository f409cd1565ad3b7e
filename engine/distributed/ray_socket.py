"""A chip worker on the driver's node, reached through a Unix-domain socket instead of Ray's actor calls.

A plain Ray actor call costs about 0.9 ms per round trip on the driver's own
node (2-core VM, Ray 2.60), three times a Compiled Graph step; a socket
between two processes of one machine costs tens of microseconds and, unlike
a Compiled Graph's channels, does not busy-poll and fails cleanly (EOF)
when the worker dies. So RayTransport's default channel connects each
worker actor that Ray placed on the driver's node through one socket and
uses actor calls only across nodes. The socket lives in Linux's abstract
namespace (nothing on disk to clean up); the driver accepts only the worker
process it asked, checked by its pid (SO_PEERCRED). Once connected, the
driver hands the worker its regions' memory files (fds over SCM_RIGHTS,
offer_regions/take_regions): the worker maps them in place of its copies, so
a run's tensor bytes never cross the socket, as with the process transport.

A message is a ray_wire Wire: a 16-byte header (the head's and the array
descriptions' lengths), the head, the descriptions, then each array's bytes,
written with one gathered send where the socket takes it.

Each end polls for SPIN_US before it sleeps on its socket (as the process
transport's ends do), so a reply that comes back within that time finds
its reader awake. The worker side (serve) reads a batch, runs it, and
writes its replies without ever blocking on the write: a reply the socket
cannot take at once goes to a writer thread, so the worker always goes
back to reading and a driver sending its next batch never waits on a
worker waiting on it.
"""

from __future__ import annotations

import array
import logging
import os
import pickle
import socket
import struct
import threading
import uuid
from collections import deque
from typing import Any, Callable

import numpy as np

from engine import _native
from engine.distributed.ray_wire import Wire
from engine.distributed.transport import WakePipe
from engine.distributed.worker import DEFAULT_SPIN_US

__all__ = ["Listener", "connect", "offer_regions", "take_regions", "answer_regions", "send_wire", "recv_wire", "serve",
           "wait_readable"]

log = logging.getLogger(__name__)

_HEADER = struct.Struct("!QQ")  # the head's length, the array descriptions' length (0: no arrays apart)
_IOV_MAX = 512  # buffers per sendmsg (Linux allows 1024)
_SOCKET_BYTES = 4 << 20  # send and receive buffers: a batch rarely waits for the peer to read
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_FDS = struct.Struct("!I")  # how many region fds ride on this message
_FDS_PER_MESSAGE = 250  # Linux takes at most 253 fds (SCM_MAX_FD) in one message
# Either end polls this long for the next message before it sleeps, as the process transport's ends do: a
# message that finds its reader asleep pays a wake-up first (tens of microseconds under a hypervisor).
SPIN_US = DEFAULT_SPIN_US


class Listener:
    """The driver's end before a worker connects: a listening socket with a fresh abstract name."""

    def __init__(self) -> None:
        self.address = f"\0tandem-ray-{os.getpid()}-{uuid.uuid4().hex}"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.bind(self.address)
            self._sock.listen(1)
        except BaseException:
            self._sock.close()
            raise

    def accept(self, pid: int, timeout: float) -> socket.socket:
        """The connection of process `pid`; TimeoutError when it does not connect within `timeout` s, and
        ConnectionError when another process does."""
        self._sock.settimeout(max(timeout, 0.001))
        try:
            conn, _ = self._sock.accept()
        except socket.timeout:
            raise TimeoutError(f"the worker process {pid} did not connect within {timeout:.1f} s") from None
        peer, _, _ = _PEERCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
        if peer != pid:
            conn.close()
            raise ConnectionError(f"process {peer} connected in place of the worker process {pid}")
        conn.settimeout(None)
        _tune(conn)
        return conn

    def close(self) -> None:
        self._sock.close()


def connect(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(address)
    except BaseException:
        sock.close()
        raise
    _tune(sock)
    return sock


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCKET_BYTES)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCKET_BYTES)


# -- sharing the regions ------------------------------------------------------------------------------
def offer_regions(sock: socket.socket, fds: list[int], timeout: float) -> bool:
    """The driver's half of the handshake that follows connecting: sends the regions' memory (memfd fds, by
    index) and returns whether the worker mapped them in place of its own copies (its one-byte answer).
    TimeoutError when it does not answer within `timeout` s, EOFError or OSError when it hung up."""
    chunks = [fds[k:k + _FDS_PER_MESSAGE] for k in range(0, len(fds), _FDS_PER_MESSAGE)] or [[]]
    for chunk in chunks:  # no regions: one message saying so
        rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", chunk))] if chunk else []
        sock.sendmsg([_FDS.pack(len(chunk))], rights, socket.MSG_NOSIGNAL)  # 4 bytes: all sent, or an OSError
    sock.settimeout(max(timeout, 0.001))
    try:
        answer = sock.recv(1)
    except socket.timeout:
        raise TimeoutError(f"the worker did not answer the regions' offer within {timeout:.1f} s") from None
    finally:
        sock.settimeout(None)
    if not answer:
        raise EOFError("the worker closed its socket instead of answering the regions' offer")
    return answer == b"\x01"


def take_regions(sock: socket.socket, count: int) -> list[int]:
    """The worker's half: the fds of the driver's `count` regions (see offer_regions), which it then maps and
    answers with answer_regions()."""
    fds: list[int] = []
    try:
        while True:
            data, got, flags, _ = socket.recv_fds(sock, _FDS.size, _FDS_PER_MESSAGE, socket.MSG_WAITALL)
            fds.extend(got)
            if len(data) < _FDS.size:
                raise EOFError("the driver closed its socket during the regions' offer")
            if flags & socket.MSG_CTRUNC or len(got) != _FDS.unpack(data)[0]:
                raise ConnectionError(f"the regions' offer lost fds (got {len(got)}, flags {flags:#x})")
            if len(fds) >= count:
                break
        if len(fds) != count:
            raise ConnectionError(f"the driver offered {len(fds)} regions, this worker has {count}")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds


def answer_regions(sock: socket.socket, mapped: bool) -> None:
    sock.sendall(b"\x01" if mapped else b"\x00")


# -- messages -----------------------------------------------------------------------------------------
def _buffers(wire: Wire) -> list[Any]:
    """The buffers of one message, in the order they cross."""
    if isinstance(wire, bytes):
        return [_HEADER.pack(len(wire), 0), wire]
    head, arrays = wire
    arrays = [a if a.flags.c_contiguous else np.ascontiguousarray(a) for a in arrays]
    meta = pickle.dumps([(a.dtype.str, a.shape) for a in arrays], protocol=pickle.HIGHEST_PROTOCOL)
    return [_HEADER.pack(len(head), len(meta)), head, meta, *(a.data.cast("B") for a in arrays if a.nbytes)]


def _send(sock: socket.socket, bufs: list[Any], flags: int = 0,
          deferred: list[BaseException] | None = None) -> list[Any]:
    """Sends bufs (gathered); what is left when the socket would block (only with MSG_DONTWAIT). A peer gone
    is an OSError, never a SIGPIPE. With `deferred`, see send_wire."""
    views = [memoryview(b).cast("B") for b in bufs]
    flags |= socket.MSG_NOSIGNAL
    while views:
        try:
            sent = sock.sendmsg(views[:_IOV_MAX], [], flags)
        except BlockingIOError:
            return views
        except KeyboardInterrupt as e:  # raised before the call sent anything
            _defer(e, deferred)
            continue
        while sent:
            n = len(views[0])
            if sent >= n:
                sent -= n
                views.pop(0)
            else:
                views[0] = views[0][sent:]
                sent = 0
        while views and not len(views[0]):
            views.pop(0)
    return []


def send_wire(sock: socket.socket, wire: Wire, deferred: list[BaseException] | None = None) -> None:
    """Writes one message, blocking until the socket took all of it. OSError when the peer is gone.

    With `deferred`, a KeyboardInterrupt while the socket is full is put there and the write goes on, so an
    interrupt never leaves half a message in the stream.
    """
    _send(sock, _buffers(wire), 0, deferred)


def wait_readable(*socks: socket.socket, poke: WakePipe | None = None) -> list[socket.socket]:
    """Waits until a message begins on any of socks, polling for SPIN_US first (see serve); those it began on.
    With `poke` also until it is poked: then it is drained, and the list may be empty. An interrupt here leaves
    the streams untouched. With no socket (a poke alone) it sleeps at once: nothing it waits for comes back as
    soon as a socket's message can."""
    fds = [s.fileno() for s in socks]
    if poke is not None:
        fds.append(poke.fd)
    spin = SPIN_US if socks else 0
    while True:
        ready = _native.wait_readable(fds, spin)  # empty: a signal came, its handler runs on returning
        if ready:
            if poke is not None and len(socks) in ready:
                poke.drain()
            return [socks[i] for i in ready if i < len(socks)]


def recv_wire(sock: socket.socket, deferred: list[BaseException] | None = None) -> Wire:
    """Reads one message. EOFError when the peer hung up before it began.

    With `deferred`, a KeyboardInterrupt in the middle of the message is put there and the read goes on, so an
    interrupt never leaves half a message in the stream (a read the handler interrupts consumed nothing).
    """
    head_len, meta_len = _HEADER.unpack(_read(sock, _HEADER.size, deferred, True))
    body = _read(sock, head_len + meta_len, deferred, False)
    if not meta_len:
        return body
    head, meta = body[:head_len], pickle.loads(body[head_len:])
    arrays = []
    for dtype, shape in meta:
        a = np.empty(shape, dtype)
        if a.nbytes:
            _read_into(sock, a.data.cast("B"), deferred)
        arrays.append(a)
    return head, arrays


def _read(sock: socket.socket, n: int, deferred: list[BaseException] | None, at_boundary: bool) -> bytes:
    buf = bytearray(n)
    _read_into(sock, memoryview(buf), deferred, at_boundary)
    return bytes(buf)


def _read_into(sock: socket.socket, view: memoryview, deferred: list[BaseException] | None,
               at_boundary: bool = False) -> None:
    got, n = 0, len(view)
    while got < n:
        try:
            k = sock.recv_into(view[got:])
        except KeyboardInterrupt as e:  # raised before the call read anything
            _defer(e, deferred)
            continue
        if not k:
            if got == 0 and at_boundary:
                raise EOFError("the peer closed the socket")
            raise ConnectionError("the peer closed the socket in the middle of a message")
        got += k
        at_boundary = False


def _defer(interrupt: KeyboardInterrupt, deferred: list[BaseException] | None) -> None:
    """Puts an interrupt that stopped a send or receive (before it moved a byte) in `deferred`, for the caller to
    retry the call and raise it once the message is whole; without `deferred` it is raised."""
    if deferred is None:
        raise interrupt
    deferred.append(interrupt)


# -- the worker's end ---------------------------------------------------------------------------------
def serve(sock: socket.socket, step: Callable[[Wire], Wire]) -> None:
    """Runs each batch the driver sends and writes back its replies, until the driver hangs up."""
    writer = _Writer(sock)
    fds = [sock.fileno()]
    try:
        while True:
            try:
                _native.wait_readable(fds, SPIN_US)
                batch = recv_wire(sock)
            except (EOFError, OSError):
                return
            writer.write(_buffers(step(batch)))
    except BaseException:  # a batch this worker could not run or answer: the driver sees the socket close
        log.exception("the socket's serving thread failed; closing the socket")
    finally:
        writer.close()
        sock.close()


class _Writer:
    """Writes replies in order; what the socket does not take at once is written by a thread of its own."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._queue: deque[list[Any]] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None

    def write(self, bufs: list[Any]) -> None:
        with self._cond:
            if self._queue:  # behind a reply still being written: keep the order
                self._queue.append(bufs)
                return
        try:
            left = _send(self._sock, bufs, socket.MSG_DONTWAIT)
        except OSError:
            return  # the driver is gone: the reader sees it next
        if left:
            with self._cond:
                self._queue.append(left)
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="tandem-ray-socket-writer", daemon=True)
                    self._thread.start()
                self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                bufs = self._queue[0]
            try:
                _send(self._sock, bufs)
            except OSError:
                with self._cond:
                    self._queue.clear()
                return
            with self._cond:
                self._queue.popleft()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(5.0)
