"""The async face of the engine, on anyio: works under asyncio and trio alike.

    from scheduler import AsyncRuntime
    async with AsyncRuntime(rt) as art:
        y = await art.call(x)
"""

from scheduler._futures import InvalidStateError, RunFuture
from scheduler._metrics import Histogram, Percentiles, RunRecord, Stats
from scheduler._stream import RunStream, StreamItemError
from scheduler.runtime import AsyncRuntime

__all__ = ["AsyncRuntime", "Histogram", "InvalidStateError", "Percentiles", "RunFuture", "RunRecord", "RunStream", "Stats",
           "StreamItemError"]
