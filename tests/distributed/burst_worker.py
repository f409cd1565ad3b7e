"""A stand-in chip worker for transport tests: it answers Setup, sends a burst of replies and exits at once."""

from __future__ import annotations

import os
from multiprocessing import connection

from engine.distributed.protocol import Done, Ready, decode, encode

REPLIES = 500


def burst_then_exit(conn: connection.Connection, spin_us: int = 0,
                    cpus: tuple[int, ...] = ()) -> None:  # as engine.distributed.worker.main
    decode(conn.recv_bytes())  # the Setup
    conn.send_bytes(encode(Ready(os.getpid(), 1, 0)))
    for seq in range(1, REPLIES + 1):
        conn.send_bytes(encode(Done(seq, None, -1, -1)))
    os._exit(0)  # gone right behind its replies: no goodbye, no flush beyond the socket's
