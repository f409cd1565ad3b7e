"""Loads OpenBLAS from the scipy-openblas32 wheel before the native module.

engine._native links against libscipy_openblas by its soname; importing
scipy_openblas32 loads that library into the process (RTLD_GLOBAL), which is
how the dynamic linker then finds it for the extension.
"""

import scipy_openblas32 as _openblas  # noqa: F401  (imported for its side effect)

OPENBLAS_VERSION: str = _openblas.__version__
