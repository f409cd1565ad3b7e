"""pytest plugin for scripts/sanitize address: a LeakSanitizer check once pytest is done.

CPython frees little at exit, so LeakSanitizer's exit-time check reports the
interpreter rather than us (scripts/sanitize turns it off). Instead, with every
object allocated by malloc (PYTHONMALLOC=malloc, so LeakSanitizer can follow
pointers through Python objects), this plugin runs LeakSanitizer's recoverable
check from an atexit handler: after every test, fixture and runtime is gone and
pytest's own frames have returned (CPython keeps its frames in memory that
LeakSanitizer does not scan, so a check from inside pytest would blame objects that
live frames still hold), but before the interpreter tears its modules down.
Memory that nothing points to any more is a leak, whoever allocated it; reports go
where ASAN_OPTIONS' log_path says, and scripts/sanitize fails on them.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import os
import sys
from typing import Any

# The frame objects of threads still running when the check runs (daemon threads, such as
# trio's idle thread cache): CPython points at them only from its frame stacks, which
# LeakSanitizer does not scan, so they would be reported though they are live. Held
# here, they are reachable from memory it does scan.
_live_frames: list[Any] = []


def _hold_live_frames() -> None:
    for frame in sys._current_frames().values():
        while frame is not None:
            _live_frames.append((frame, frame.f_locals))  # the frame's locals live outside it
            frame = frame.f_back


def _check() -> None:
    for _ in range(3):
        gc.collect()
    _hold_live_frames()
    try:
        check = ctypes.CDLL(None).__lsan_do_recoverable_leak_check
    except AttributeError:  # not running under ASan/LSan
        return
    if check() != 0:
        sys.stderr.write("LeakSanitizer: memory leaked (see the sanitizer logs)\n")
        sys.stderr.flush()
        os._exit(1)


def pytest_unconfigure(config: Any) -> None:
    atexit.register(_check)
