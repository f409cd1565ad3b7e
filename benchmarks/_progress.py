"""Progress reporting for the benchmarks: a tqdm bar, a plain fallback, or messages to a parent.

Three ways a benchmark's `Progress` shows itself:
- run by `tandem bench` (which sets TANDEM_PROGRESS=pipe): one line per step on
  stderr, `##tandem-progress## <done> <total> <label>`, which the driver turns
  into its own bar; the benchmark's stdout (its tables) stays clean;
- in a terminal with tqdm installed: a tqdm bar on stderr;
- otherwise (no tqdm, or stderr is a file): a plain line per step on stderr.
"""

from __future__ import annotations

import os
import sys
import time
from types import TracebackType
from typing import Any

PIPE_ENV = "TANDEM_PROGRESS"
PIPE_PREFIX = "##tandem-progress##"


def parse_pipe_line(line: str) -> tuple[int, int, str] | None:
    """(done, total, label) from one line a child wrote in pipe mode, or None if it is not one."""
    if not line.startswith(PIPE_PREFIX):
        return None
    parts = line[len(PIPE_PREFIX):].strip().split(" ", 2)
    try:
        done, total = int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None
    return done, total, parts[2] if len(parts) > 2 else ""


def make_bar(total: int | None, desc: str) -> Any | None:
    """A tqdm bar on stderr when stderr is a terminal and tqdm is installed; else None."""
    if not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, file=sys.stderr, leave=False, dynamic_ncols=True)


class Progress:
    """Counts the steps of one benchmark: `with Progress(total, "overlap") as p: ...; p.step("depth 2")`."""

    def __init__(self, total: int, desc: str) -> None:
        self.total = total
        self.desc = desc
        self.done = 0
        self._pipe = os.environ.get(PIPE_ENV) == "pipe"
        self._bar = None if self._pipe else make_bar(total, desc)
        self._last_plain = 0.0

    def step(self, label: str = "") -> None:
        """One step finished; `label` names the next (or the finished) piece of work."""
        self.done += 1
        if self._pipe:
            print(f"{PIPE_PREFIX} {self.done} {self.total} {label}", file=sys.stderr, flush=True)
        elif self._bar is not None:
            self._bar.set_postfix_str(label, refresh=False)
            self._bar.update(1)
        else:
            # Plain lines are for logs: at most one a second, plus the last.
            now = time.monotonic()
            if now - self._last_plain >= 1.0 or self.done == self.total:
                self._last_plain = now
                print(f"  [{self.done}/{self.total}] {self.desc}: {label}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
