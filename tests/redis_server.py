"""A real redis-server for the remote tier's tests: started, killed and restarted here.

The server runs with no persistence on a loopback port (or a unix socket),
with the settings docs/remote.md recommends (``maxmemory`` + ``allkeys-lru``).
When ``redis-server`` is not installed the tests fail with how to install it:
they are never skipped (``make test`` installs it on a fresh machine).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time

import redis

INSTALL_HINT = (
    "redis-server is not installed: the remote tier's tests need a real server "
    "(apt-get install -y redis-server, or run `make test`, which installs it)"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One redis-server process on ``127.0.0.1:port`` or a unix socket in ``workdir``."""

    def __init__(
        self,
        workdir: str,
        *,
        unix: bool = False,
        maxmemory: str = "256mb",
        args: tuple[str, ...] = (),
        tls: dict[str, str] | None = None,
        admin: dict[str, str] | None = None,
    ):
        """``args``: more server options (e.g. ``--requirepass``); ``tls``: the
        server's ``cert``, ``key`` and ``ca`` files (it then listens on a TLS
        port only); ``admin``: what the readiness check logs in with."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError(INSTALL_HINT)
        self.binary, self.workdir, self.maxmemory = binary, workdir, maxmemory
        self.args, self.tls, self.admin = list(args), tls, admin or {}
        self.port = 0 if unix else free_port()
        self.socket = os.path.join(workdir, "redis.sock") if unix else None
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        if self.socket:
            return f"unix://{self.socket}"
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Start (or restart, on the same port or socket) and wait until it answers."""
        port = "0" if self.tls else str(self.port)
        args = [self.binary, "--port", port, "--bind", "127.0.0.1", "--save", ""]
        args += ["--appendonly", "no", "--dir", self.workdir, "--maxmemory", self.maxmemory]
        args += ["--maxmemory-policy", "allkeys-lru", *self.args]
        if self.socket:
            args += ["--unixsocket", self.socket, "--unixsocketperm", "700"]
        if self.tls:
            args += ["--tls-port", str(self.port), "--tls-cert-file", self.tls["cert"]]
            args += ["--tls-key-file", self.tls["key"], "--tls-ca-cert-file", self.tls["ca"]]
            args += ["--tls-auth-clients", "optional"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = self.client(socket_timeout=1, socket_connect_timeout=1)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start: {args}") from None
                time.sleep(0.02)
        client.close()

    def client(self, **options) -> redis.Redis:
        """An administrator's client (logged in with ``admin``, trusting the test CA)."""
        if self.tls:
            options |= {"ssl_ca_certs": self.tls["ca"]}
        return redis.Redis.from_url(self.url, **self.admin, **options)

    def kill(self) -> None:
        """SIGKILL: the server vanishes mid-run, as a crash would make it."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
