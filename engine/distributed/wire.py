"""Messages framed over a connected socket exactly as multiprocessing.connection.Connection frames them.

Connection.send_bytes / recv_bytes pass through several Python layers per
message (a BytesIO per read, the header read on its own path); the host and
each chip worker exchange a small message each way per run, so these two do
the same framing with the least Python: a 4-byte big-endian length (or -1 and
an 8-byte length past 2 GiB), then the bytes. Either end may use either: the
bytes on the wire are the same.
"""

from __future__ import annotations

import os
import struct

__all__ = ["send_message", "recv_message"]

_LENGTH = struct.Struct("!i")
_LONG_LENGTH = struct.Struct("!Q")
_JOINED_MAX = 16 << 10  # Connection's threshold too: a small message goes in one write with its header


def send_message(fd: int, data: bytes) -> None:
    """Writes one message (blocking until all of it is in the socket). OSError when the peer is gone."""
    n = len(data)
    if n > 0x7FFFFFFF:
        _write_all(fd, _LENGTH.pack(-1) + _LONG_LENGTH.pack(n))
        _write_all(fd, data)
    elif n > _JOINED_MAX:
        _write_all(fd, _LENGTH.pack(n))
        _write_all(fd, data)
    else:
        _write_all(fd, _LENGTH.pack(n) + data)


def recv_message(fd: int) -> bytes:
    """Reads one message (blocking until all of it arrived). EOFError when the peer hung up between messages."""
    (n,) = _LENGTH.unpack(_read_exact(fd, 4, True))
    if n == -1:
        (n,) = _LONG_LENGTH.unpack(_read_exact(fd, 8, False))
    return _read_exact(fd, n, False)


def _write_all(fd: int, data: bytes) -> None:
    written = os.write(fd, data)
    if written < len(data):
        view = memoryview(data)[written:]
        while view:
            view = view[os.write(fd, view):]


def _read_exact(fd: int, n: int, at_boundary: bool) -> bytes:
    data = os.read(fd, n)
    if len(data) == n:
        return data
    if not data and at_boundary:
        raise EOFError
    parts, got = [data], len(data)
    while got < n:
        chunk = os.read(fd, n - got)
        if not chunk:
            raise OSError("the peer hung up in the middle of a message")
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)
