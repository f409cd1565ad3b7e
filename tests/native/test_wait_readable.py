"""engine._native.wait_readable: the fd wait that engine.distributed's readers poll, then sleep, in."""

from __future__ import annotations

import os
import threading
import time

import pytest

from engine import _native


@pytest.fixture
def pipes():
    made = [os.pipe() for _ in range(3)]
    yield made
    for r, w in made:
        for fd in (r, w):
            try:
                os.close(fd)
            except OSError:
                pass


def test_the_readable_ones_in_order(pipes):
    os.write(pipes[2][1], b"x")
    os.write(pipes[0][1], b"x")
    assert _native.wait_readable([r for r, _ in pipes], 0, 0) == [0, 2]
    assert _native.wait_readable([r for r, _ in pipes], 1000, 0) == [0, 2]  # found while spinning


def test_nothing_ready_is_empty_after_the_spin_and_the_timeout(pipes):
    assert _native.wait_readable([r for r, _ in pipes], 0, 0) == []
    assert _native.wait_readable([r for r, _ in pipes], 2000, 20) == []


def test_a_hung_up_writer_counts_as_ready(pipes):
    os.close(pipes[1][1])
    assert _native.wait_readable([r for r, _ in pipes], 0, 1000) == [1]


@pytest.mark.parametrize("spin_us", [0, 2_000_000])  # woken from sleep, or seen while polling
def test_a_write_from_another_thread_ends_the_wait_which_released_the_gil(pipes, spin_us):
    r, w = pipes[0]

    def write_later() -> None:
        time.sleep(0.05)  # Python code: it runs only because the wait released the GIL
        os.write(w, b"x")

    writer = threading.Thread(target=write_later)
    writer.start()
    try:
        assert _native.wait_readable([r], spin_us, 10_000) == [0]
    finally:
        writer.join()


def test_a_negative_spin_is_refused(pipes):
    with pytest.raises(ValueError, match="spin_us"):
        _native.wait_readable([pipes[0][0]], -1, 0)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux: the CPUs a thread may run on")
def test_current_cpu_is_one_this_thread_may_run_on():
    allowed = os.sched_getaffinity(0)
    assert _native.current_cpu() in allowed
    if len(allowed) > 1:  # bound to one CPU, it runs there
        cpu = max(allowed)
        try:
            os.sched_setaffinity(0, {cpu})
            assert _native.current_cpu() == cpu
        finally:
            os.sched_setaffinity(0, allowed)
