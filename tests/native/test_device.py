"""engine._native.Device and Buffer: the cpu device's memory, provenance checks and counters."""

import threading

import numpy as np
import pytest

from engine import _native

Device = _native.Device
Buffer = _native.Buffer
DeviceMemoryError = _native.DeviceMemoryError


@pytest.fixture
def dev():
    return Device()


def read(dev, buf, nbytes=None, offset=0):
    out = np.empty(buf.size - offset if nbytes is None else nbytes, dtype=np.uint8)
    dev.copy_d2h(out, buf, offset)
    return out


def fill(dev, buf, value):
    dev.copy_h2d(buf, 0, np.full(buf.size, value, dtype=np.uint8))


def reused_address(dev):
    """Allocates and frees until the allocator hands back a freed address.

    Returns (old handle, new live handle at the same address). The sizes vary
    because how soon glibc reuses an aligned block depends on its bin."""
    for size in (4096, 1024, 1 << 20, 128):
        old = dev.alloc(size)
        dev.free(old)
        held = []  # misses stay allocated, so each attempt takes a different free block
        try:
            for _ in range(2_000):
                new = dev.alloc(size)
                if new.addr == old.addr:
                    return old, new
                held.append(new)
        finally:
            for b in held:
                dev.free(b)
    pytest.fail("the allocator never reused a freed address")


# ---------------------------------------------------------------- identity


def test_uid_is_random_nonzero_and_per_device():
    devices = [Device() for _ in range(8)]
    uids = {d.uid for d in devices}
    assert len(uids) == 8
    assert 0 not in uids
    assert all(0 < u < 2**64 for u in uids)
    d = devices[0]
    uid = d.uid  # fixed for the device's life and stamped on every handle it issues
    b = d.alloc(16)
    d.free(b)
    assert d.uid == uid == b.device_uid
    assert hex(d.uid) in repr(d)


def test_buffer_value_type():
    b = Buffer(2**64 - 1, 7, 0x1000, 256)
    assert (b.device_uid, b.id, b.addr, b.size) == (2**64 - 1, 7, 0x1000, 256)
    assert b == Buffer(2**64 - 1, 7, 0x1000, 256)
    assert b != Buffer(2**64 - 1, 8, 0x1000, 256)
    assert b != Buffer(2**64 - 1, 7, 0x1000, 255)
    assert b != (2**64 - 1, 7, 0x1000, 256)
    assert hash(b) == hash(Buffer(2**64 - 1, 7, 0x1000, 256))
    assert len({b, Buffer(2**64 - 1, 7, 0x1000, 256)}) == 1
    r = repr(b)
    assert r.startswith("Buffer(") and "id=7" in r and "0x1000" in r and "size=256" in r
    with pytest.raises(AttributeError):
        b.addr = 0


# ---------------------------------------------------------------- alloc / free


@pytest.mark.parametrize("align", [1, 2, 8, 16, 64, 256, 4096])
def test_alloc_alignment(dev, align):
    bufs = [dev.alloc(n, align=align) for n in (1, 3, 100, 5000)]
    for b in bufs:
        assert b.addr % align == 0
        assert b.device_uid == dev.uid
    assert [b.size for b in bufs] == [1, 3, 100, 5000]
    assert len({b.id for b in bufs}) == 4
    for b in bufs:
        dev.free(b)


def test_default_alignment_is_64(dev):
    for _ in range(16):
        assert dev.alloc(24).addr % 64 == 0


def test_ids_are_unique_and_increasing(dev):
    ids = []
    for _ in range(20):
        b = dev.alloc(32)
        ids.append(b.id)
        dev.free(b)
    assert ids == sorted(ids) and len(set(ids)) == 20


@pytest.mark.parametrize(
    "nbytes, align, match",
    [(0, 64, "nbytes"), (16, 3, "power of two"), (16, 0, "power of two"), (16, 96, "power of two"),
     (-1, 64, "non-negative"), (16, -64, "non-negative")],
)
def test_alloc_rejects_bad_arguments_and_changes_nothing(dev, nbytes, align, match):
    keep = dev.alloc(128)
    before = dev.stats()
    with pytest.raises(ValueError, match=match):
        dev.alloc(nbytes, align=align)
    assert dev.stats() == before
    dev.free(keep)


def test_free_releases_and_counts(dev):
    a = dev.alloc(100)
    b = dev.alloc(300)
    dev.free(a)
    s = dev.stats()
    assert s["bytes_in_use"] == 300 and s["live_allocations"] == 1
    assert s["peak_bytes"] == 400 and s["total_allocations"] == 2
    dev.check(b)
    dev.free(b)
    assert dev.stats()["bytes_in_use"] == 0


def test_destructor_frees_everything():
    """A device dropped with live allocations returns their memory: the
    process's virtual size does not grow with every dropped device."""

    def vm_pages():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0])

    chunk = 64 << 20
    for _ in range(2):  # warm up the allocator
        d = Device()
        d.alloc(chunk)
        del d
    start = vm_pages()
    for _ in range(32):  # 2 GiB if leaked
        d = Device()
        d.alloc(chunk)
        d.alloc(chunk // 2)
        del d
    grown = (vm_pages() - start) * 4096
    assert grown < 4 * chunk


# ---------------------------------------------------------------- copies


@pytest.mark.parametrize("dtype", [np.uint8, np.int32, np.float32, np.float64, np.complex128])
def test_copy_roundtrip_exact(dev, dtype):
    rng = np.random.default_rng(0)
    src = (rng.standard_normal((7, 13)) * 1000).astype(dtype)
    buf = dev.alloc(src.nbytes)
    dev.copy_h2d(buf, 0, src)
    out = np.empty_like(src)
    dev.copy_d2h(out, buf, 0)
    assert out.tobytes() == src.tobytes()


def test_copy_at_offsets(dev):
    buf = dev.alloc(64)
    dev.copy_h2d(buf, 0, np.zeros(64, np.uint8))
    dev.copy_h2d(buf, 10, np.arange(1, 6, dtype=np.uint8))
    assert list(read(dev, buf)[8:17]) == [0, 0, 1, 2, 3, 4, 5, 0, 0]
    tail = np.empty(4, np.uint8)
    dev.copy_d2h(tail, buf, 12)
    assert list(tail) == [3, 4, 5, 0]
    # Accepts any buffer-protocol object.
    dev.copy_h2d(buf, 60, b"wxyz")
    ba = bytearray(4)
    dev.copy_d2h(ba, buf, 60)
    assert ba == b"wxyz"
    dev.copy_d2h(memoryview(ba), buf, 10)
    assert ba == bytes([1, 2, 3, 4])


def test_zero_length_copies_are_no_ops(dev):
    buf = dev.alloc(16)
    fill(dev, buf, 9)
    before = dev.stats()
    dev.copy_h2d(buf, 16, np.empty(0, np.uint8))
    dev.copy_d2h(np.empty(0, np.uint8), buf, 16)
    dev.copy_d2d(buf, 0, buf, 8, 0)
    assert dev.stats() == before
    assert (read(dev, buf) == 9).all()


def test_copy_d2d(dev):
    a = dev.alloc(32)
    b = dev.alloc(32)
    dev.copy_h2d(a, 0, np.arange(32, dtype=np.uint8))
    fill(dev, b, 0)
    dev.copy_d2d(b, 4, a, 8, 16)
    assert list(read(dev, b)) == [0] * 4 + list(range(8, 24)) + [0] * 12
    # Overlapping spans of one allocation behave like memmove.
    dev.copy_d2d(a, 2, a, 0, 30)
    assert list(read(dev, a)) == [0, 1] + list(range(30))
    assert dev.stats()["d2d_bytes"] == 46


def test_counters_exact(dev):
    a = dev.alloc(1000)
    b = dev.alloc(24, align=4096)
    dev.copy_h2d(a, 0, np.ones(250, np.float32))
    dev.copy_h2d(b, 8, np.ones(2, np.float64))
    dev.copy_d2h(np.empty(10, np.uint8), a, 990)
    dev.copy_d2d(b, 0, a, 0, 8)
    dev.free(a)
    c = dev.alloc(500)
    assert dev.stats() == {
        "capacity": 0,
        "bytes_in_use": 524,
        "peak_bytes": 1024,
        "live_allocations": 2,
        "total_allocations": 3,
        "h2d_bytes": 1016,
        "d2h_bytes": 10,
        "d2d_bytes": 8,
        "mapped_regions": 0,
    }
    dev.free(b)
    dev.free(c)
    s = dev.stats()
    assert (s["bytes_in_use"], s["live_allocations"], s["peak_bytes"]) == (0, 0, 1024)


# ---------------------------------------------------------------- provenance


def every_use(dev, handle, good):
    """Each way a handle reaches the device; each must refuse a bad handle."""
    return [
        lambda: dev.free(handle),
        lambda: dev.check(handle),
        lambda: dev.copy_h2d(handle, 0, np.ones(4, np.uint8)),
        lambda: dev.copy_d2h(np.empty(4, np.uint8), handle, 0),
        lambda: dev.copy_d2d(handle, 0, good, 0, 4),
        lambda: dev.copy_d2d(good, 0, handle, 0, 4),
    ]


def assert_refused_everywhere(dev, handle, match, witnesses, good=None):
    """Every use raises ValueError matching `match`, and changes nothing:
    counters identical and the bytes of every live allocation identical.
    `good` is a valid partner for device-to-device copies."""
    good = good if good is not None else dev.alloc(16)
    fill(dev, good, 0x5A)
    snapshot = [read(dev, w).copy() for w in witnesses + [good]]
    before = dev.stats()
    for use in every_use(dev, handle, good):
        with pytest.raises(ValueError, match=match):
            use()
    assert dev.stats() == before
    assert all((read(dev, w) == s).all() for w, s in zip(witnesses + [good], snapshot))


def test_interior_handle_refused(dev):
    b = dev.alloc(256)
    fill(dev, b, 1)
    interior = Buffer(b.device_uid, b.id, b.addr + 64, b.size - 64)
    assert_refused_everywhere(dev, interior, "interior", [b])
    # An interior address with another live id is interior too.
    other = dev.alloc(16)
    assert_refused_everywhere(dev, Buffer(dev.uid, other.id, b.addr + 1, 16), "interior", [b, other])
    dev.check(b)


def test_foreign_handle_from_another_device_refused(dev):
    other = Device()
    theirs = other.alloc(64)
    mine = dev.alloc(64)
    fill(dev, mine, 3)
    assert_refused_everywhere(dev, theirs, "foreign", [mine])
    # Same address and id as a live allocation here, but the other device's uid.
    assert_refused_everywhere(dev, Buffer(other.uid, mine.id, mine.addr, mine.size), "foreign", [mine])
    other.check(theirs)
    assert other.stats()["live_allocations"] == 1


def test_foreign_handle_never_allocated_here_refused(dev):
    mine = dev.alloc(64)
    fill(dev, mine, 4)
    # An id this device never issued.
    assert_refused_everywhere(dev, Buffer(dev.uid, mine.id + 1000, mine.addr, 64), "foreign", [mine])
    assert_refused_everywhere(dev, Buffer(dev.uid, 0, mine.addr, 64), "foreign", [mine])
    # A live id at an address this device never allocated.
    host = np.zeros(64, np.uint8)
    assert_refused_everywhere(dev, Buffer(dev.uid, mine.id, host.ctypes.data, 64), "foreign", [mine])
    # The right base and id with the wrong size is forged.
    assert_refused_everywhere(dev, Buffer(dev.uid, mine.id, mine.addr, 32), "foreign", [mine])
    assert (host == 0).all()


def test_already_freed_handle_refused(dev):
    keep = dev.alloc(64)
    fill(dev, keep, 5)
    good = dev.alloc(16)  # before the free, so it cannot reuse the freed address
    b = dev.alloc(4096)
    dev.free(b)
    assert_refused_everywhere(dev, b, "already freed", [keep], good=good)


def test_stale_handle_after_address_reuse_refused(dev):
    old, new = reused_address(dev)
    assert old.addr == new.addr and new.id > old.id
    fill(dev, new, 7)
    assert_refused_everywhere(dev, old, "stale", [new])
    # The newer allocation is untouched and still usable.
    dev.check(new)
    assert (read(dev, new) == 7).all()
    live = dev.stats()["live_allocations"]
    dev.free(new)
    assert dev.stats()["live_allocations"] == live - 1


def test_stale_handle_inside_a_newer_larger_allocation_refused(dev):
    # Whether the allocator ever places a larger block over a freed one is up to it
    # (glibc mmaps large blocks and the kernel may or may not reuse the hole), so the
    # old handle is forged as it would then look: a freed id whose address lies inside
    # a live allocation issued after it. Stale, not merely interior.
    old = dev.alloc(4096)
    dev.free(old)
    big = dev.alloc(1 << 16)
    assert big.id > old.id
    fill(dev, big, 9)
    stale = Buffer(dev.uid, old.id, big.addr + 4096, old.size)
    assert_refused_everywhere(dev, stale, "stale", [big])
    # A freed id issued after the live block cannot have been overlaid by it: interior.
    newer = dev.alloc(64)
    dev.free(newer)
    assert_refused_everywhere(dev, Buffer(dev.uid, newer.id, big.addr + 64, 64), "interior", [big])
    dev.check(big)
    assert (read(dev, big) == 9).all()
    dev.free(big)


def test_double_free_refused(dev):
    b = dev.alloc(64)
    dev.free(b)
    before = dev.stats()
    with pytest.raises(ValueError, match="already freed"):
        dev.free(b)
    assert dev.stats() == before


# ---------------------------------------------------------------- spans


def refused(dev, match, call):
    """call() raises ValueError matching `match` and leaves the counters alone."""
    before = dev.stats()
    with pytest.raises(ValueError, match=match):
        call()
    assert dev.stats() == before


def test_overrun_copies_refused_and_nothing_copied(dev):
    buf = dev.alloc(64)
    fill(dev, buf, 0xAB)
    refused(dev, "overruns", lambda: dev.copy_h2d(buf, 60, np.zeros(8, np.uint8)))
    refused(dev, "overruns", lambda: dev.copy_h2d(buf, 0, np.zeros(65, np.uint8)))
    refused(dev, "overruns", lambda: dev.copy_h2d(buf, 65, np.zeros(0, np.uint8)))
    refused(dev, "overruns", lambda: dev.copy_h2d(buf, 2**62, np.zeros(1, np.uint8)))
    assert (read(dev, buf) == 0xAB).all()

    dst = np.full(8, 0x11, np.uint8)
    refused(dev, "overruns", lambda: dev.copy_d2h(dst, buf, 57))
    big = np.full(65, 0x11, np.uint8)
    refused(dev, "overruns", lambda: dev.copy_d2h(big, buf, 0))
    assert (dst == 0x11).all() and (big == 0x11).all()

    other = dev.alloc(16)
    fill(dev, other, 0x22)
    refused(dev, "overruns", lambda: dev.copy_d2d(other, 0, buf, 0, 17))
    refused(dev, "overruns", lambda: dev.copy_d2d(buf, 60, other, 0, 8))
    refused(dev, "overruns", lambda: dev.copy_d2d(buf, 0, other, 9, 8))
    refused(dev, "overruns", lambda: dev.copy_d2d(buf, 0, other, 0, 2**62))
    assert (read(dev, other) == 0x22).all() and (read(dev, buf) == 0xAB).all()


def test_negative_offsets_are_value_errors(dev):
    buf = dev.alloc(16)
    with pytest.raises(ValueError, match="non-negative"):
        dev.copy_h2d(buf, -1, np.zeros(4, np.uint8))
    with pytest.raises(ValueError, match="non-negative"):
        dev.copy_d2h(np.zeros(4, np.uint8), buf, -1)
    with pytest.raises(ValueError, match="non-negative"):
        dev.copy_d2d(buf, 0, buf, 0, -4)
    with pytest.raises(ValueError, match="non-negative"):
        Device(capacity=-1)


def test_host_buffer_requirements(dev):
    buf = dev.alloc(64)
    fill(dev, buf, 1)
    with pytest.raises(ValueError, match="contiguous"):
        dev.copy_h2d(buf, 0, np.zeros((4, 4), np.uint8)[:, ::2])
    ro = np.zeros(8, np.uint8)
    ro.flags.writeable = False
    with pytest.raises(ValueError):
        dev.copy_d2h(ro, buf, 0)
    with pytest.raises(ValueError):
        dev.copy_d2h(b"12345678", buf, 0)
    with pytest.raises(TypeError, match="buffer protocol"):
        dev.copy_h2d(buf, 0, [1, 2, 3])
    with pytest.raises(TypeError, match="buffer protocol"):
        dev.copy_d2h(42, buf, 0)
    # A read-only source is fine for host -> device.
    dev.copy_h2d(buf, 0, ro)
    assert (read(dev, buf)[:8] == 0).all() and (ro == 0).all()


# ---------------------------------------------------------------- resolve


def test_resolve(dev):
    a = dev.alloc(100)
    b = dev.alloc(50)
    assert dev.resolve(a.addr, 100) == a
    assert dev.resolve(a.addr + 10, 90) == a
    assert dev.resolve(b.addr + 49, 1) == b
    with pytest.raises(ValueError, match="overruns"):
        dev.resolve(a.addr + 10, 91)
    with pytest.raises(ValueError, match="overruns"):
        dev.resolve(a.addr, 2**62)
    host = np.zeros(8)
    with pytest.raises(ValueError, match="outside any allocation"):
        dev.resolve(host.ctypes.data, 8)
    with pytest.raises(ValueError, match="outside any allocation"):
        dev.resolve(0, 1)
    dev.free(b)
    with pytest.raises(ValueError, match="outside any allocation"):
        dev.resolve(b.addr, 1)


# ---------------------------------------------------------------- capacity


def test_capacity_exceeded_then_device_still_usable():
    dev = Device(capacity=4096)
    assert dev.stats()["capacity"] == 4096
    a = dev.alloc(3000)
    fill(dev, a, 8)
    before = dev.stats()
    with pytest.raises(DeviceMemoryError, match="exhausted") as info:
        dev.alloc(1097)
    assert isinstance(info.value, MemoryError)
    assert _native.DeviceMemoryError is DeviceMemoryError
    assert dev.stats() == before
    b = dev.alloc(1096)  # exactly up to the limit
    assert dev.stats()["bytes_in_use"] == 4096
    with pytest.raises(DeviceMemoryError):
        dev.alloc(1)
    dev.free(a)
    c = dev.alloc(3000)
    dev.copy_h2d(c, 0, np.full(3000, 9, np.uint8))
    assert (read(dev, c) == 9).all()
    dev.free(b)
    dev.free(c)
    s = dev.stats()
    assert (s["bytes_in_use"], s["peak_bytes"], s["total_allocations"]) == (0, 4096, 3)


def test_unlimited_device_reports_system_exhaustion_as_device_memory_error(dev):
    before = dev.stats()
    with pytest.raises(DeviceMemoryError):
        dev.alloc(2**62)
    assert dev.stats() == before
    dev.free(dev.alloc(8))


# ---------------------------------------------------------------- independence, threads


def test_two_devices_are_independent():
    a, b = Device(capacity=1024), Device()
    x = a.alloc(512)
    a.copy_h2d(x, 0, np.ones(512, np.uint8))
    b_before = b.stats()
    y = b.alloc(2048)  # a's capacity does not apply to b
    b.copy_d2h(np.empty(16, np.uint8), y, 0)
    assert a.stats()["bytes_in_use"] == 512 and a.stats()["h2d_bytes"] == 512
    assert a.stats()["d2h_bytes"] == 0
    assert b.stats()["bytes_in_use"] == 2048 and b_before["total_allocations"] == 0
    with pytest.raises(ValueError, match="foreign"):
        b.free(x)
    with pytest.raises(ValueError, match="foreign"):
        a.copy_d2d(x, 0, y, 0, 8)
    a.free(x)
    b.check(y)
    assert b.stats()["live_allocations"] == 1 and a.stats()["live_allocations"] == 0


def test_concurrent_use_of_one_device_keeps_exact_counters():
    dev = Device()
    n_threads, rounds, size = 8, 200, 4096
    errors = []

    def work(seed):
        try:
            payload = np.full(size, seed, np.uint8)
            out = np.empty(size, np.uint8)
            for _ in range(rounds):
                b = dev.alloc(size)
                dev.copy_h2d(b, 0, payload)
                c = dev.alloc(size)
                dev.copy_d2d(c, 0, b, 0, size)
                dev.free(b)
                dev.copy_d2h(out, c, 0)
                dev.free(c)
                if not (out == seed).all():
                    errors.append(f"thread {seed} read foreign data")
                    return
        except Exception as e:  # pragma: no cover - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=work, args=(i + 1,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    total = n_threads * rounds * size
    s = dev.stats()
    assert s["live_allocations"] == 0 and s["bytes_in_use"] == 0
    assert s["total_allocations"] == 2 * n_threads * rounds
    assert (s["h2d_bytes"], s["d2h_bytes"], s["d2d_bytes"]) == (total, total, total)
    assert size * 2 <= s["peak_bytes"] <= 2 * size * n_threads
