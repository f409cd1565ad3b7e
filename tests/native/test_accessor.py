"""engine._native.HostAccessor: the per-run table mapping device regions to host views."""

import gc
import threading

import numpy as np
import pytest

from engine import _native

Device = _native.Device
HostAccessor = _native.HostAccessor


@pytest.fixture
def dev():
    return Device()


def device_bytes(dev, buf, offset=0, nbytes=None):
    out = np.empty(buf.size - offset if nbytes is None else nbytes, np.uint8)
    dev.copy_d2h(out, buf, offset)
    return out


def fill(dev, buf, value):
    dev.copy_h2d(buf, 0, np.full(buf.size, value, np.uint8))


def refused(dev, acc, match, call):
    """call() raises ValueError matching `match` and changes neither the
    device's counters nor the accessor's table."""
    before = (dev.stats(), acc.mapping_count(), acc.mapped_bytes())
    with pytest.raises(ValueError, match=match):
        call()
    assert (dev.stats(), acc.mapping_count(), acc.mapped_bytes()) == before


# ---------------------------------------------------------------- roundtrips


def test_stage_in_and_copy_back_roundtrip(dev):
    rng = np.random.default_rng(1)
    host = rng.standard_normal((16, 8)).astype(np.float32)
    buf = dev.alloc(host.nbytes)
    acc = HostAccessor(dev)
    acc.add(buf.addr, host.nbytes, host)
    acc.stage_in(buf.addr)
    assert device_bytes(dev, buf).tobytes() == host.tobytes()

    result = rng.standard_normal((16, 8)).astype(np.float32)
    dev.copy_h2d(buf, 0, result)  # "the kernel" writes the output
    acc.copy_back(buf.addr)
    assert host.tobytes() == result.tobytes()
    acc.close()


@pytest.mark.parametrize("nbytes", [64, 1 << 20])  # below and above the size at which map() lets go of the GIL
def test_map_adds_the_region_and_copies_in_only_when_asked(dev, nbytes):
    rng = np.random.default_rng(2)
    staged = rng.integers(0, 255, nbytes, dtype=np.uint8)
    written = rng.integers(0, 255, nbytes, dtype=np.uint8)
    a, b = dev.alloc(nbytes), dev.alloc(nbytes)
    fill(dev, b, 7)
    acc = HostAccessor(dev)
    acc.map(a.addr, nbytes, staged, True)  # an input: mapped and copied in
    acc.map(b.addr, nbytes, written, False)  # an output: mapped only
    assert device_bytes(dev, a).tobytes() == staged.tobytes()
    assert (device_bytes(dev, b) == 7).all()
    assert acc.mapping_count() == 2 and acc.mapped_bytes() == 2 * nbytes
    acc.copy_back(b.addr)
    assert (written == 7).all()
    acc.close()


def test_map_refuses_what_add_refuses(dev):
    buf = dev.alloc(64)
    acc = HostAccessor(dev)
    ro = np.zeros(64, np.uint8)
    ro.flags.writeable = False
    refused(dev, acc, "fewer than", lambda: acc.map(buf.addr, 64, np.zeros(63, np.uint8), True))
    refused(dev, acc, "host_view", lambda: acc.map(buf.addr, 64, ro, True))
    refused(dev, acc, "empty", lambda: acc.map(buf.addr, 0, np.zeros(64, np.uint8), True))
    acc.map(buf.addr, 64, np.zeros(64, np.uint8), True)
    refused(dev, acc, "overlap", lambda: acc.map(buf.addr, 64, np.zeros(64, np.uint8), True))
    with pytest.raises(TypeError, match="buffer protocol"):
        acc.map(buf.addr, 8, [0] * 8, True)
    acc.close()


def test_read_and_write_inside_a_region(dev):
    buf = dev.alloc(256)
    fill(dev, buf, 0)
    host = np.zeros(128, np.uint8)
    acc = HostAccessor(dev)
    acc.add(buf.addr + 64, 128, host)  # a region in the middle of the allocation
    acc.write(buf.addr + 70, np.arange(1, 11, dtype=np.uint8), 10)
    whole = device_bytes(dev, buf)
    assert list(whole[68:82]) == [0, 0] + list(range(1, 11)) + [0, 0]
    out = np.zeros(4, np.uint8)
    acc.read(buf.addr + 72, out, 4)
    assert list(out) == [3, 4, 5, 6]
    # nbytes may be smaller than the host buffer; only nbytes move.
    big = np.full(16, 0xEE, np.uint8)
    acc.read(buf.addr + 70, big, 2)
    assert list(big[:3]) == [1, 2, 0xEE]
    # The whole region, to its last byte.
    last = np.zeros(128, np.uint8)
    acc.read(buf.addr + 64, last, 128)
    assert (last == whole[64:192]).all()
    acc.close()


def test_copies_count_as_device_transfers(dev):
    buf = dev.alloc(64)
    host = np.ones(64, np.uint8)
    acc = HostAccessor(dev)
    acc.add(buf.addr, 64, host)
    before = dev.stats()
    acc.stage_in(buf.addr)
    acc.copy_back(buf.addr)
    acc.write(buf.addr, np.zeros(8, np.uint8), 8)
    acc.read(buf.addr, np.zeros(4, np.uint8), 4)
    after = dev.stats()
    assert after["h2d_bytes"] - before["h2d_bytes"] == 72
    assert after["d2h_bytes"] - before["d2h_bytes"] == 68
    acc.close()


# ---------------------------------------------------------------- bookkeeping


def test_mapping_count_and_mapped_bytes(dev):
    a = dev.alloc(1024)
    b = dev.alloc(300)
    acc = HostAccessor(dev)
    assert (acc.mapping_count(), acc.mapped_bytes()) == (0, 0)
    views = [np.zeros(n, np.uint8) for n in (100, 200, 300, 50)]
    acc.add(a.addr, 100, views[0])
    acc.add(a.addr + 100, 200, views[1])  # adjacent, not overlapping
    acc.add(b.addr, 300, views[2])
    acc.add(a.addr + 1000, 24, views[3])  # a view larger than the region is fine
    assert (acc.mapping_count(), acc.mapped_bytes()) == (4, 624)
    assert dev.stats()["mapped_regions"] == 4
    acc.close()
    assert (acc.mapping_count(), acc.mapped_bytes()) == (0, 0)
    assert dev.stats()["mapped_regions"] == 0


def test_close_is_idempotent_and_releases_exactly_its_own_mappings(dev):
    buf = dev.alloc(4096)
    mine, theirs = HostAccessor(dev), HostAccessor(dev)
    views = [np.zeros(64, np.uint8) for _ in range(5)]
    for i in range(3):
        mine.add(buf.addr + 64 * i, 64, views[i])
    for i in range(2):  # the same device addresses: tables are per accessor
        theirs.add(buf.addr + 64 * i, 64, views[3 + i])
    assert dev.stats()["mapped_regions"] == 5
    mine.close()
    assert dev.stats()["mapped_regions"] == 2
    mine.close()
    mine.close()
    assert dev.stats()["mapped_regions"] == 2
    assert theirs.mapping_count() == 2
    theirs.stage_in(buf.addr + 64)  # still mapped
    theirs.close()
    assert dev.stats()["mapped_regions"] == 0


def test_destructor_releases_mappings(dev):
    buf = dev.alloc(256)
    view = np.zeros(256, np.uint8)
    acc = HostAccessor(dev)
    acc.add(buf.addr, 128, view)
    acc.add(buf.addr + 128, 128, view)
    assert dev.stats()["mapped_regions"] == 2
    del acc
    gc.collect()
    assert dev.stats()["mapped_regions"] == 0


def test_reuse_after_close(dev):
    rng = np.random.default_rng(2)
    bufs = [dev.alloc(512) for _ in range(3)]
    acc = HostAccessor(dev)
    for run in range(100):
        hosts = [rng.integers(0, 256, 512, dtype=np.uint8) for _ in bufs]
        expected = [h.copy() for h in hosts]
        for b, h in zip(bufs, hosts):
            acc.add(b.addr, 512, h)
            acc.stage_in(b.addr)
        assert acc.mapping_count() == 3
        for b, h in zip(bufs, hosts):
            h[:] = 0
            acc.copy_back(b.addr)
        assert all((h == e).all() for h, e in zip(hosts, expected))
        acc.close()
        assert acc.mapping_count() == 0 and dev.stats()["mapped_regions"] == 0
    # After close the old regions are gone, not silently still mapped.
    refused(dev, acc, "no region", lambda: acc.stage_in(bufs[0].addr))
    refused(dev, acc, "not inside any registered region", lambda: acc.read(bufs[0].addr, np.zeros(1, np.uint8), 1))


def test_accessor_keeps_its_device_alive():
    dev = Device()
    buf = dev.alloc(64)
    acc = HostAccessor(dev)
    host = np.arange(64, dtype=np.uint8)
    acc.add(buf.addr, 64, host)
    del dev
    gc.collect()
    acc.stage_in(buf.addr)
    host[:] = 0
    acc.copy_back(buf.addr)
    assert (host == np.arange(64, dtype=np.uint8)).all()
    acc.close()


# ---------------------------------------------------------------- rejected regions


def test_null_device_admits_nothing(dev):
    buf = dev.alloc(64)
    acc = HostAccessor(None)
    view = np.zeros(64, np.uint8)
    with pytest.raises(ValueError, match="no device"):
        acc.add(buf.addr, 64, view)
    assert (acc.mapping_count(), acc.mapped_bytes()) == (0, 0)
    with pytest.raises(ValueError):
        acc.read(buf.addr, view, 1)
    with pytest.raises(ValueError):
        acc.stage_in(buf.addr)
    acc.close()
    acc.close()
    assert dev.stats()["mapped_regions"] == 0


def test_empty_size_null_view_and_short_view_rejected(dev):
    buf = dev.alloc(64)
    acc = HostAccessor(dev)
    view = np.zeros(64, np.uint8)
    refused(dev, acc, "empty", lambda: acc.add(buf.addr, 0, view))
    refused(dev, acc, "null host view", lambda: acc.add(buf.addr, 64, None))
    refused(dev, acc, "fewer than", lambda: acc.add(buf.addr, 64, np.zeros(63, np.uint8)))
    refused(dev, acc, "non-negative", lambda: acc.add(buf.addr, -1, view))
    ro = np.zeros(64, np.uint8)
    ro.flags.writeable = False
    refused(dev, acc, "host_view", lambda: acc.add(buf.addr, 64, ro))
    refused(dev, acc, "contiguous", lambda: acc.add(buf.addr, 8, np.zeros((8, 8), np.uint8)[:, 0]))
    with pytest.raises(TypeError, match="buffer protocol"):
        acc.add(buf.addr, 8, [0] * 8)
    assert acc.mapping_count() == 0


def test_region_must_lie_inside_one_live_allocation(dev):
    a = dev.alloc(128)
    b = dev.alloc(128)
    acc = HostAccessor(dev)
    view = np.zeros(4096, np.uint8)
    refused(dev, acc, "overruns", lambda: acc.add(a.addr, 129, view))
    refused(dev, acc, "overruns", lambda: acc.add(a.addr + 100, 29, view))
    refused(dev, acc, "outside any allocation", lambda: acc.add(view.ctypes.data, 64, view))
    other = Device()
    theirs = other.alloc(128)
    refused(dev, acc, "outside any allocation", lambda: acc.add(theirs.addr, 64, view))
    dev.free(b)
    refused(dev, acc, "outside any allocation", lambda: acc.add(b.addr, 64, view))
    assert other.stats()["mapped_regions"] == 0


@pytest.mark.parametrize(
    "offset, size",
    [(100, 100), (50, 100), (150, 100), (120, 10), (0, 400), (199, 1), (100, 1)],
    ids=["same", "front", "back", "contained", "containing", "last-byte", "first-byte"],
)
def test_overlap_rejected(dev, offset, size):
    buf = dev.alloc(400)
    acc = HostAccessor(dev)
    acc.add(buf.addr + 100, 100, np.zeros(100, np.uint8))
    refused(dev, acc, "overlaps", lambda: acc.add(buf.addr + offset, size, np.zeros(size, np.uint8)))
    acc.add(buf.addr + 99, 1, np.zeros(1, np.uint8))  # touching is not overlapping
    acc.add(buf.addr + 200, 1, np.zeros(1, np.uint8))
    assert acc.mapping_count() == 3
    acc.close()


# ---------------------------------------------------------------- spans fail closed


def test_spans_not_inside_one_region_fail_closed(dev):
    buf = dev.alloc(512)
    fill(dev, buf, 0x33)
    base = buf.addr + 128  # region [128, 256) and [256, 320) of the allocation
    acc = HostAccessor(dev)
    acc.add(base, 128, np.zeros(128, np.uint8))
    acc.add(base + 128, 64, np.zeros(64, np.uint8))

    cases = [
        (base + 120, 16, "overruns"),  # runs off the end of the first region into the second
        (base + 128 + 60, 8, "overruns"),  # runs off the end of the last region
        (base - 8, 16, "starts before"),  # starts before the region's base
        (buf.addr, 512, "starts before"),  # the whole allocation
        (buf.addr, 64, "not inside any registered region"),  # mapped memory, unmapped span
        (base + 192, 1, "not inside any registered region"),  # just past the last region
    ]
    for addr, nbytes, match in cases:
        dst = np.full(nbytes, 0x77, np.uint8)
        refused(dev, acc, match, lambda: acc.read(addr, dst, nbytes))
        assert (dst == 0x77).all(), (addr - buf.addr, nbytes)
        src = np.full(nbytes, 0x99, np.uint8)
        refused(dev, acc, match, lambda: acc.write(addr, src, nbytes))
        assert (device_bytes(dev, buf) == 0x33).all(), (addr - buf.addr, nbytes)
    acc.close()


def test_host_buffer_shorter_than_nbytes_rejected(dev):
    buf = dev.alloc(64)
    fill(dev, buf, 1)
    acc = HostAccessor(dev)
    acc.add(buf.addr, 64, np.zeros(64, np.uint8))
    dst = np.full(8, 5, np.uint8)
    refused(dev, acc, "fewer than", lambda: acc.read(buf.addr, dst, 9))
    refused(dev, acc, "fewer than", lambda: acc.write(buf.addr, np.zeros(8, np.uint8), 9))
    refused(dev, acc, "non-negative", lambda: acc.read(buf.addr, dst, -1))
    assert (dst == 5).all() and (device_bytes(dev, buf) == 1).all()
    acc.close()


def test_whole_region_transfers_need_a_registered_base(dev):
    buf = dev.alloc(128)
    host = np.full(64, 4, np.uint8)
    acc = HostAccessor(dev)
    acc.add(buf.addr, 64, host)
    fill(dev, buf, 2)
    refused(dev, acc, "no region is registered at base", lambda: acc.stage_in(buf.addr + 1))
    refused(dev, acc, "no region is registered at base", lambda: acc.copy_back(buf.addr + 64))
    assert (host == 4).all() and (device_bytes(dev, buf) == 2).all()
    acc.close()


def test_region_whose_allocation_was_freed_fails_closed(dev):
    keep = dev.alloc(64)  # allocated first, so it cannot reuse the freed address
    buf = dev.alloc(4096)
    host = np.full(4096, 6, np.uint8)
    acc = HostAccessor(dev)
    acc.add(buf.addr, 4096, host)
    dev.free(buf)
    refused(dev, acc, "freed", lambda: acc.stage_in(buf.addr))
    refused(dev, acc, "freed", lambda: acc.copy_back(buf.addr))
    refused(dev, acc, "freed", lambda: acc.read(buf.addr, np.zeros(4, np.uint8), 4))
    assert (host == 6).all()
    acc.close()
    assert dev.stats()["mapped_regions"] == 0
    dev.free(keep)


# ---------------------------------------------------------------- threads


def test_two_accessors_in_two_threads_stay_independent(dev):
    """Each thread owns an accessor whose region overlaps the other's device
    addresses. They add, stage, write, read, copy back and close concurrently;
    each sees only its own table and its own data."""
    chunk = 1024
    buf = dev.alloc(3 * chunk)
    fill(dev, buf, 0)
    # Thread 0 maps [0, 2C), thread 1 maps [C, 3C); they share [C, 2C), where
    # both only ever stage zeros. Each owns one exclusive third. The whole-region
    # copies (stage in, copy back) touch the shared third: they take turns, as
    # two runs sharing bytes are ordered by the engine (unordered, the same bytes
    # written by one thread and read by the other are a data race, which TSan
    # reports even when the value is the same); everything else is concurrent.
    layout = [(0, 0), (chunk, chunk)]  # (region offset, exclusive offset within the region)
    rounds = 300
    errors = []
    barrier = threading.Barrier(2)
    shared_bytes = threading.Lock()

    def work(k):
        try:
            region_off, own_off = layout[k]
            base = buf.addr + region_off
            host = np.zeros(2 * chunk, np.uint8)
            own = slice(own_off, own_off + chunk)
            shared = slice(chunk - own_off, 2 * chunk - own_off)
            acc = HostAccessor(dev)
            barrier.wait()
            for i in range(rounds):
                tag = (2 * i + k) % 251 + 1
                acc.add(base, 2 * chunk, host)
                if acc.mapping_count() != 1 or acc.mapped_bytes() != 2 * chunk:
                    errors.append(f"thread {k}: table sees {acc.mapping_count()} mappings")
                    return
                host[own] = tag
                host[shared] = 0
                with shared_bytes:
                    acc.stage_in(base)
                seen = np.empty(chunk, np.uint8)
                acc.read(base + own_off, seen, chunk)
                if not (seen == tag).all():
                    errors.append(f"thread {k}: staged data not read back in round {i}")
                    return
                acc.write(base + own_off, np.full(chunk, tag ^ 0xFF, np.uint8), chunk)
                host[:] = 0xCC
                with shared_bytes:
                    acc.copy_back(base)
                if not ((host[own] == tag ^ 0xFF).all() and (host[shared] == 0).all()):
                    errors.append(f"thread {k}: copied back foreign data in round {i}")
                    return
                acc.close()
                if acc.mapping_count() != 0:
                    errors.append(f"thread {k}: close left mappings")
                    return
        except Exception as e:  # pragma: no cover - reported below
            errors.append(f"thread {k}: {e!r}")

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert dev.stats()["mapped_regions"] == 0
