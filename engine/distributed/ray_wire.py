"""How a batch of messages, and its replies, cross Ray between the driver and a chip worker actor.

An entry is a message and the region data it carries: (argument index, array)
pairs, the bytes a Call reads on its way out, the bytes it wrote on the way
back. A small batch travels as one `bytes` object: Ray serializes bytes
without its pickler (under a microsecond), while a list of NamedTuples and
numpy arrays costs it 25-45 us each way (cloudpickle's reducer for every
object, an out-of-band buffer per array; measured on Ray 2.60). A batch
carrying more than INLINE_BYTES keeps its arrays apart, where Ray's
out-of-band buffers avoid copying them into a pickle.
"""

from __future__ import annotations

import pickle
from typing import Any, Union

import numpy as np

from engine.distributed.protocol import from_plain, plain

__all__ = ["Entry", "Wire", "INLINE_BYTES", "pack", "unpack"]

Entry = tuple[Any, tuple[tuple[int, np.ndarray], ...]]
Wire = Union[bytes, tuple[bytes, list[np.ndarray]]]

# Serializing inline cost 13 us at 256 KB against Ray's 23 us, about even at 512 KB, and 460 us from 768 KB
# (each pickle a fresh mmap'd allocation): half the crossover keeps clear of that cliff.
INLINE_BYTES = 256 * 1024


def pack(entries: list[Entry], apart: bool = False) -> Wire:
    """apart: arrays always apart from the head, however small (a socket sends them raw: pickling a numpy
    array costs more than its bytes)."""
    heads = []
    arrays: list[np.ndarray] = []
    inline = 0
    for msg, data in entries:
        heads.append((*plain(msg), tuple(i for i, _ in data)))
        for _, a in data:
            arrays.append(a)
            inline += a.nbytes
    if inline <= INLINE_BYTES and not (apart and arrays):
        return pickle.dumps((heads, arrays), protocol=pickle.HIGHEST_PROTOCOL)
    return pickle.dumps(heads, protocol=pickle.HIGHEST_PROTOCOL), arrays


def unpack(wire: Wire) -> list[Entry]:
    """The entries pack() sent (arrays may be read-only views of what Ray received)."""
    if isinstance(wire, bytes):
        heads, arrays = pickle.loads(wire)
    else:
        head, arrays = wire
        heads = pickle.loads(head)
    it = iter(arrays)
    return [(from_plain(kind, fields), tuple((i, next(it)) for i in indices)) for kind, fields, indices in heads]
