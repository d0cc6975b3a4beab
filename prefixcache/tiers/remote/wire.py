"""Pipelined GETs whose replies are read off the socket straight into place.

redis-py (with hiredis) reads a reply into its own buffer, copies it into the
parser's, and copies that into a new ``bytes``: three copies of every byte
before the caller sees it, and the 4 MiB values are fresh memory each time.
A restore wants each byte in one place, the restore buffer, so the fetch
takes a connection from redis-py's pool (connected, authenticated, with its
timeouts: redis-py does all of that) and reads the replies of its own
pipelined GETs itself: each reply's header line, then its bytes with
``recv_into`` straight into their destinations (one copy, by the kernel).

A reply is RESP: ``$<length>\\r\\n<bytes>\\r\\n``, or ``$-1\\r\\n`` (RESP3 ``_\\r\\n``)
for a missing key. Anything else, or a read that stops half way, leaves the
connection's state unknown: it is disconnected, never returned to the pool
dirty (redis-py reconnects it on its next use).
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import TypeVar

import redis

from ...errors import PayloadError

T = TypeVar("T")
_MAX_LINE = 64  # a bulk reply's header line: '$' + up to 20 digits + CRLF


class Replies:
    """The replies, in order, of GETs sent on one connection's socket."""

    def __init__(self, sock: socket.socket):
        self._sock = sock
        self.num_read = 0  # replies read to their end

    def length(self) -> int | None:
        """The next reply's length in bytes; None for a missing key.

        Raises:
            PayloadError: the reply is not a string (e.g. an error reply).
        """
        line = bytearray()
        while not line.endswith(b"\r\n"):
            if len(line) > _MAX_LINE:
                raise PayloadError(f"remote reply header too long: {bytes(line[:16])!r}")
            line += self._recv(1)
        if line in (b"$-1\r\n", b"_\r\n"):
            self.num_read += 1
            return None
        if line[:1] != b"$" or not line[1:-2].isdigit():
            raise PayloadError(f"remote reply is not a string: {bytes(line[:_MAX_LINE])!r}")
        return int(line[1:-2])

    def read(self, size: int) -> bytes:
        """The next ``size`` bytes (a small header)."""
        out = bytearray(size)
        self.read_into(memoryview(out))
        return bytes(out)

    def read_into(self, view: memoryview) -> None:
        """Fill ``view`` with the next bytes."""
        got, size = 0, view.nbytes
        while got < size:
            n = self._sock.recv_into(view[got:])
            if n == 0:
                raise ConnectionError("remote server closed the connection mid-reply")
            got += n

    def end(self) -> None:
        """Consume the CRLF that ends a string reply."""
        if self.read(2) != b"\r\n":
            raise PayloadError("remote reply does not end where its length says")
        self.num_read += 1

    def _recv(self, size: int) -> bytes:
        data = self._sock.recv(size)
        if not data:
            raise ConnectionError("remote server closed the connection mid-reply")
        return data


def pipelined_gets(client: redis.Redis, names: list[str], body: Callable[[Replies], T]) -> T:
    """Send GET of every name in ``names`` on one pooled connection (one write)
    and return ``body(replies)``, which reads the replies. Unless it read every
    one to its end, the connection is disconnected before it goes back to the pool.
    """
    pool = client.connection_pool
    conn = pool.get_connection()
    replies = None
    try:
        conn.send_packed_command(conn.pack_commands([("GET", name) for name in names]))
        # redis-py keeps a connected Connection's socket in ``_sock``; the pool
        # hands a connection over connected, with no reply left unread
        replies = Replies(conn._sock)
        return body(replies)
    finally:
        if replies is None or replies.num_read != len(names):
            conn.disconnect()
        pool.release(conn)
