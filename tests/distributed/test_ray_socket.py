"""ray_socket: the driver's channel to a Ray worker on its own node, without Ray (a socket pair and a thread)."""

from __future__ import annotations

import os
import signal
import socket
import threading

import numpy as np
import pytest

from engine.distributed import ray_socket
from engine.distributed.protocol import Call, Done
from engine.distributed.ray_wire import pack, unpack


@pytest.fixture
def pair():
    """(driver's end, worker's end) of a connected pair; the driver's end times out rather than hang a test."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.settimeout(30.0)
    yield a, b
    a.close()
    b.close()


def _echoing(sock: socket.socket) -> threading.Thread:
    """The worker's serve() with a step that sends each batch back as it came (its arrays apart)."""
    t = threading.Thread(target=ray_socket.serve, args=(sock, lambda batch: pack(unpack(batch), apart=True)),
                         daemon=True)
    t.start()
    return t


def _arrays_equal(sent, got):
    assert len(sent) == len(got)
    for (m1, d1), (m2, d2) in zip(sent, got):
        assert m1 == m2
        assert [i for i, _ in d1] == [i for i, _ in d2]
        for (_, x), (_, y) in zip(d1, d2):
            assert x.dtype == y.dtype and x.shape == y.shape
            np.testing.assert_array_equal(x, y)


def _call(seq: int) -> Call:
    return Call(seq, 1, {"B": 4}, (("s", 0, 0, (4,), (1,), "f32"), ("v", 2.5)), (1, 0))


def test_batches_and_their_arrays_cross_whole(pair):
    driver, worker = pair
    served = _echoing(worker)
    rng = np.random.default_rng(0)
    wide = rng.standard_normal((6, 5)).astype(np.float32)
    arrays = (
        (0, wide),
        (1, wide.T),  # not contiguous: arrives as a contiguous copy
        (2, np.array(3.5, np.float64)),  # 0-d
        (3, np.zeros((0, 4), np.int32)),  # empty
        (4, np.arange(7, dtype=np.uint8)),
    )
    for entries in ([(_call(1), ())], [(_call(2), arrays), (Done(3, None, 5, 6), ())]):
        for apart in (False, True):
            ray_socket.send_wire(driver, pack(entries, apart))
            _arrays_equal(entries, unpack(ray_socket.recv_wire(driver)))
    driver.shutdown(socket.SHUT_WR)  # the driver hangs up: serve() returns and closes its end
    served.join(10)
    assert not served.is_alive()
    assert worker.fileno() == -1


def test_a_batch_the_worker_cannot_run_closes_its_socket_and_is_logged(pair, caplog):
    """A failure escaping step() (not a Call's error: those are replies) ends serve(): it says why in the log
    and closes the socket, so the driver reads EOF instead of waiting forever."""
    driver, worker = pair

    def broken(batch):
        raise RuntimeError("no reply for this one")

    served = threading.Thread(target=ray_socket.serve, args=(worker, broken), daemon=True)
    served.start()
    ray_socket.send_wire(driver, pack([(_call(1), ())]))
    with pytest.raises(EOFError):
        ray_socket.recv_wire(driver)
    served.join(10)
    assert not served.is_alive()
    assert "serving thread failed" in caplog.text and "no reply for this one" in caplog.text


def test_large_batches_back_to_back_do_not_deadlock(pair):
    """Two batches larger than the sockets' buffers sent before any reply is read: the worker never blocks on
    writing a reply while the driver blocks on sending it the next batch (its writer thread takes the rest)."""
    driver, worker = pair
    _echoing(worker)
    big = [np.full(3 << 20, k, np.float32) for k in range(2)]  # 12 MB each; the buffers are 4 MB
    batches = [[(_call(k), ((0, big[k]),))] for k in range(2)]
    for b in batches:
        ray_socket.send_wire(driver, pack(b))
    for b in batches:  # in order
        _arrays_equal(b, unpack(ray_socket.recv_wire(driver)))


class _InterruptedOnce:
    """A socket whose n-th recv_into or sendmsg is interrupted (KeyboardInterrupt) before it moves anything."""

    def __init__(self, sock: socket.socket, n: int) -> None:
        self._sock, self._n = sock, n

    def _interrupt(self) -> None:
        self._n -= 1
        if self._n == 0:
            raise KeyboardInterrupt

    def recv_into(self, view):
        self._interrupt()
        return self._sock.recv_into(view)

    def sendmsg(self, buffers, ancdata, flags):
        self._interrupt()
        return self._sock.sendmsg(buffers[:1], ancdata, flags)  # a buffer at a time: several calls a message


def test_an_interrupt_in_the_middle_of_a_message_is_deferred_until_it_is_read(pair):
    driver, worker = pair
    entries = [(_call(1), ((0, np.arange(10, dtype=np.float32)),))]
    ray_socket.send_wire(worker, pack(entries, apart=True))
    deferred: list[BaseException] = []
    got = ray_socket.recv_wire(_InterruptedOnce(driver, 2), deferred)  # after the header, before the head
    _arrays_equal(entries, unpack(got))
    assert len(deferred) == 1 and isinstance(deferred[0], KeyboardInterrupt)
    # Without a place to defer it, the interrupt is raised (the caller owns a broken stream then).
    ray_socket.send_wire(worker, pack(entries))
    with pytest.raises(KeyboardInterrupt):
        ray_socket.recv_wire(_InterruptedOnce(driver, 2))


def test_an_interrupt_while_sending_is_deferred_until_the_message_is_sent(pair):
    driver, worker = pair
    entries = [(_call(1), ((0, np.arange(10, dtype=np.float32)),))]
    deferred: list[BaseException] = []
    ray_socket.send_wire(_InterruptedOnce(driver, 3), pack(entries, apart=True), deferred)
    assert len(deferred) == 1 and isinstance(deferred[0], KeyboardInterrupt)
    _arrays_equal(entries, unpack(ray_socket.recv_wire(worker)))  # whole, and nothing after it
    worker.setblocking(False)
    with pytest.raises(BlockingIOError):
        worker.recv(1)


def test_ctrl_c_while_waiting_for_a_message_is_raised_and_leaves_the_stream_whole(pair):
    """A real SIGINT to the main thread, asleep in wait_readable: KeyboardInterrupt, and the message that comes
    after is read whole."""
    driver, worker = pair
    main = threading.main_thread().ident
    assert threading.get_ident() == main
    threading.Timer(0.3, signal.pthread_kill, (main, signal.SIGINT)).start()
    with pytest.raises(KeyboardInterrupt):
        ray_socket.wait_readable(driver)
    ray_socket.send_wire(worker, b"after")
    assert ray_socket.wait_readable(driver) == [driver]
    assert ray_socket.recv_wire(driver) == b"after"


def test_a_peer_that_hangs_up_is_told_apart_from_one_that_breaks_off_a_message(pair):
    driver, worker = pair
    worker.close()
    with pytest.raises(EOFError):
        ray_socket.recv_wire(driver)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        wire = pack([(_call(1), ())])
        b.sendall(ray_socket._buffers(wire)[0])  # the header alone, then the peer is gone
        b.close()
        with pytest.raises(ConnectionError, match="middle of a message"):
            ray_socket.recv_wire(a)
    finally:
        a.close()


def test_the_listener_accepts_only_the_worker_process_it_expects():
    listener = ray_socket.Listener()
    try:
        assert listener.address.startswith("\0tandem-ray-")  # abstract: nothing on disk
        client = ray_socket.connect(listener.address)
        with pytest.raises(ConnectionError, match=f"process {os.getpid()} connected in place of the worker "
                                                  f"process {os.getpid() + 1}"):
            listener.accept(os.getpid() + 1, 5.0)
        client.close()
        client = ray_socket.connect(listener.address)
        conn = listener.accept(os.getpid(), 5.0)
        ray_socket.send_wire(client, b"ping")
        assert ray_socket.recv_wire(conn) == b"ping"
        conn.close()
        client.close()
        with pytest.raises(TimeoutError, match="did not connect within 0.2 s"):
            listener.accept(os.getpid(), 0.2)
    finally:
        listener.close()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("count", [0, 3, 300])  # 300: more than one message's fds
def test_the_regions_offer_gives_the_worker_the_hosts_memory(pair, count):
    """The driver offers its regions' memory files; the worker maps them and answers yes: what either writes, the
    other reads. Every fd and mapping is gone afterwards."""
    import mmap

    driver, worker = pair
    baseline = _open_fds()
    files = [os.memfd_create(f"region-{i}", os.MFD_CLOEXEC) for i in range(count)]
    for fd in files:
        os.ftruncate(fd, 4096)
    host_maps = [mmap.mmap(fd, 4096) for fd in files]
    for i, m in enumerate(host_maps):
        m[:4] = i.to_bytes(4, "little")

    def work():
        fds = ray_socket.take_regions(worker, count)
        maps = [mmap.mmap(fd, 4096) for fd in fds]
        for fd in fds:
            os.close(fd)
        for m in maps:
            m[4:8] = m[:4]  # the worker echoes what the host wrote, in the host's memory
            m.close()
        ray_socket.answer_regions(worker, True)

    t = threading.Thread(target=work, daemon=True)
    t.start()
    assert ray_socket.offer_regions(driver, files, 30.0) is True
    t.join(30.0)
    assert [int.from_bytes(m[4:8], "little") for m in host_maps] == list(range(count))
    for m in host_maps:
        m.close()
    for fd in files:
        os.close(fd)
    assert _open_fds() == baseline


def test_a_worker_that_does_not_map_the_regions_says_so_and_one_that_hangs_up_or_stays_silent_fails_the_offer(pair):
    driver, worker = pair
    fd = os.memfd_create("region", os.MFD_CLOEXEC)
    try:
        t = threading.Thread(target=lambda: (os.close(*ray_socket.take_regions(worker, 1)),
                                             ray_socket.answer_regions(worker, False)), daemon=True)
        t.start()
        assert ray_socket.offer_regions(driver, [fd], 30.0) is False
        t.join(30.0)
        with pytest.raises(TimeoutError, match="did not answer"):
            ray_socket.offer_regions(driver, [fd], 0.2)  # nobody reads on the worker's end
        os.close(ray_socket.take_regions(worker, 1)[0])  # what that offer sent
        worker.close()
        with pytest.raises((EOFError, BrokenPipeError)):  # as the worker's close finds the offer read or not
            ray_socket.offer_regions(driver, [fd], 30.0)
    finally:
        os.close(fd)


def test_a_chip_host_maps_the_hosts_regions_in_place_of_its_copies():
    """Before any run, a chip host with copies of the regions maps the host's memory files instead: its region bytes
    are the host's from then on. A file of the wrong size or count is refused and changes nothing; a second
    mapping is refused."""
    import mmap

    from engine.distributed.protocol import RegionSpec, Setup
    from engine.distributed.worker import ChipHost

    sizes = (64, 4096)
    host = ChipHost(Setup(0, 1, 1 << 20, (), tuple(RegionSpec(i, f"r{i}", n) for i, n in enumerate(sizes))),
                    local_regions=True)
    files = [os.memfd_create(f"region-{i}", os.MFD_CLOEXEC) for i in range(len(sizes))]
    try:
        for fd, n in zip(files, sizes):
            os.ftruncate(fd, n)
        assert host.local_regions and host.region_count == 2
        with pytest.raises(ValueError, match="1 region files for 2 regions"):
            host.map_regions(files[:1])
        with pytest.raises(ValueError, match="region 0's file has 4096 bytes, not 64"):
            host.map_regions(files[::-1])
        assert host.local_regions
        copy = host.region_bytes(1)
        host.map_regions(files)
        assert not host.local_regions
        views = [np.frombuffer(mmap.mmap(fd, n), np.uint8) for fd, n in zip(files, sizes)]
        views[1][:3] = (7, 8, 9)
        assert host.region_bytes(1)[:3].tolist() == [7, 8, 9] and copy[:3].tolist() == [0, 0, 0]
        host.region_bytes(0)[-1] = 5
        assert views[0][-1] == 5
        with pytest.raises(RuntimeError, match="only before the first run, once"):
            host.map_regions(files)
    finally:
        host.close()
        for fd in files:
            os.close(fd)
