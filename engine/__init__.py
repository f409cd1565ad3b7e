"""Tandem: an asynchronous pipelined execution engine with a native worker pool.

    @engine.program
    def mlp(run, x: In(("B", 384)), w: In((384, 384)), y: Out(("B", 384))): ...
    rt = mlp.prepare(depth=2, bounds={"B": 64})
    y = rt(x, w)
"""

from engine import _blas  # noqa: F401  (must precede _native: loads OpenBLAS)
from engine import _native
from engine import kernels
from engine.dtypes import DType, bfloat16, float16, float32, int32, int64, uint8
from engine.errors import CaptureError, ClosedError, DeviceMemoryError, KernelError, RunCancelledError
from engine.memory import DeviceMemoryHandle
from engine.program import Program, program
from engine.run import HostKernel, Run, host_kernel
from engine.handles import RunHandle
from engine.runtime import Runtime
from engine.specs import In, InOut, Out, Scalar
from engine.tensor import DeviceBuffer, DeviceTensor

__version__ = "0.1.0"

__all__ = [
    "CaptureError", "ClosedError", "DType", "DeviceBuffer", "DeviceMemoryError", "DeviceMemoryHandle", "DeviceTensor",
    "HostKernel", "In", "InOut", "KernelError", "Out", "Program", "Run", "RunCancelledError", "RunHandle",
    "Runtime", "Scalar", "bfloat16", "float16", "float32", "host_kernel", "int32", "int64", "kernels",
    "program", "uint8",
]
