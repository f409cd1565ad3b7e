from typing import SupportsIndex

def noop_graph(workers: SupportsIndex, shape: str, n: SupportsIndex) -> tuple[int, float, float]:
    """(tasks, submit seconds, total seconds) of one run of n noop tasks submitted from C++ on a fresh engine
    of `workers` pool threads (0: the default); shape "wide" (independent tasks) or "chain" (each depends on
    the previous one)."""
