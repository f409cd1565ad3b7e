"""tandem._bench, the native helper of `tandem bench tasks`: noop graphs submitted from C++ on an engine of its own."""

from __future__ import annotations

import threading
import time

import pytest

from tandem.native_bench import noop_graph


@pytest.mark.parametrize("workers", [0, 1, 2])
@pytest.mark.parametrize("shape", ["wide", "chain"])
def test_noop_graph_counts_and_times_every_task(workers, shape):
    tasks, submit_s, total_s = noop_graph(workers, shape, 2000)
    assert tasks == 2000
    assert 0 < submit_s <= total_s


@pytest.mark.parametrize("shape, n, message", [("ring", 10, "'wide' or 'chain'"), ("wide", 0, "at least 1")])
def test_noop_graph_rejects_bad_arguments(shape, n, message):
    with pytest.raises(ValueError, match=message):
        noop_graph(1, shape, n)


def test_noop_graph_releases_the_gil():
    """Python work started after the call began finishes before the call does (a long chain, ~0.3 s)."""
    started = threading.Event()
    finished_at: list[float] = []

    def call() -> None:
        started.set()
        noop_graph(1, "chain", 200_000)
        finished_at.append(time.perf_counter())  # at once: a call that held the GIL still holds it here

    thread = threading.Thread(target=call)
    thread.start()
    started.wait()
    sum(i * i for i in range(20_000))  # about a millisecond of Python
    python_done_at = time.perf_counter()
    thread.join()
    assert python_done_at < finished_at[0]
