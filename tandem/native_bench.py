"""The native benchmark helpers (the `tandem._bench` extension), safe to import on their own.

The extension links the core library, which links OpenBLAS by its soname: the
engine package loads that library first (engine/_blas.py), so it is imported
before the extension, as `engine._native` is after it.
"""

import engine  # noqa: F401  (loads OpenBLAS before the extension that links it)
from tandem._bench import noop_graph

__all__ = ["noop_graph"]
