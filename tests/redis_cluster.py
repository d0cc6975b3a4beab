"""A real Redis Cluster for the remote tier's tests: 3 masters (and optionally one
replica each) on loopback ports, made with ``redis-cli --cluster create``.

Every node runs without persistence, with a short ``cluster-node-timeout`` so
that a killed master's replica is promoted within a few seconds. When
``redis-server`` or ``redis-cli`` is missing the tests fail with how to install
them: they are never skipped (``make test`` installs them).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time

import redis

INSTALL_HINT = (
    "redis-server and redis-cli are needed for the cluster tests "
    "(apt-get install -y redis-server redis-tools, or run `make test`, which installs them)"
)
NODE_TIMEOUT_MS = 1000


def free_cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free too."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 >= 65536:
            continue
        with socket.socket() as bus:
            try:
                bus.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


class RedisCluster:
    """``masters`` masters with ``replicas`` replicas each, in ``workdir``."""

    def __init__(self, workdir: str, *, masters: int = 3, replicas: int = 0, **settings: str):
        binary, cli = shutil.which("redis-server"), shutil.which("redis-cli")
        if binary is None or cli is None:
            raise RuntimeError(INSTALL_HINT)
        self.binary, self.cli, self.workdir = binary, cli, workdir
        self.settings = {"maxmemory": "256mb", "maxmemory-policy": "allkeys-lru", **settings}
        self.ports = [free_cluster_port() for _ in range(masters * (1 + replicas))]
        self.procs: dict[int, subprocess.Popen] = {}
        try:
            for port in self.ports:
                self.start_node(port)
            self._create(replicas)
            self.wait_ok()
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports[:2])

    def start_node(self, port: int) -> None:
        node_dir = os.path.join(self.workdir, f"node-{port}")
        os.makedirs(node_dir, exist_ok=True)
        args = [self.binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        args += ["--appendonly", "no", "--dir", node_dir, "--cluster-enabled", "yes"]
        args += ["--cluster-config-file", "nodes.conf", "--cluster-node-timeout"]
        args += [str(NODE_TIMEOUT_MS), "--cluster-replica-validity-factor", "0"]
        for name, value in self.settings.items():
            args += [f"--{name}", value]
        self.procs[port] = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        client = self.node(port)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if self.procs[port].poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start: {args}") from None
                time.sleep(0.02)
        client.close()

    def node(self, port: int) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=port, socket_timeout=2)

    def masters(self) -> list[int]:
        """Ports of the masters that serve slots now (from a live node's view)."""
        for port in self.procs:
            try:
                slots = self.node(port).execute_command("CLUSTER SLOTS")
            except redis.RedisError:
                continue
            return sorted({int(item[2][1]) for item in slots})
        raise RuntimeError("no cluster node answers")

    def master_of(self, key: str) -> int:
        slot = self.node(next(iter(self.procs))).cluster("KEYSLOT", key)
        for port in self.procs:
            for item in self.node(port).execute_command("CLUSTER SLOTS"):
                if int(item[0]) <= slot <= int(item[1]):
                    return int(item[2][1])
        raise RuntimeError(f"no master serves {key!r}")

    def wait_ok(self, timeout: float = 30) -> None:
        """Until every live node says ``cluster_state:ok`` and agrees on the masters."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                views = [self.node(p).cluster("INFO") for p in self.procs]
                maps = {tuple(self._masters_seen(p)) for p in self.procs}
                if all(v["cluster_state"] == "ok" for v in views) and len(maps) == 1:
                    return
            except redis.RedisError:
                pass
            time.sleep(0.05)
        raise RuntimeError("the cluster did not reach cluster_state:ok")

    def wait_failover(self, dead: int, timeout: float = 30) -> float:
        """Until a replica serves the slots of killed master ``dead``; seconds it took."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            try:
                if dead not in self.masters():
                    self.wait_ok(timeout)
                    return time.monotonic() - start
            except RuntimeError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"no replica took over master {dead}")

    def replicate(self) -> None:
        """Wait until every master's writes reached its replicas (WAIT)."""
        for port in self.masters():
            self.node(port).execute_command("WAIT", 1, 5000)

    def kill(self, port: int) -> None:
        """SIGKILL one node: it vanishes as a crash would make it."""
        proc = self.procs.pop(port)
        proc.kill()
        proc.wait()

    def stop(self) -> None:
        for port in list(self.procs):
            proc = self.procs.pop(port)
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def flush(self) -> None:
        for port in self.masters():
            self.node(port).flushall()

    def _masters_seen(self, port: int) -> list[int]:
        return sorted({int(i[2][1]) for i in self.node(port).execute_command("CLUSTER SLOTS")})

    def _create(self, replicas: int) -> None:
        nodes = [f"127.0.0.1:{p}" for p in self.ports]
        done = subprocess.run(
            [
                self.cli,
                "--cluster",
                "create",
                *nodes,
                "--cluster-replicas",
                str(replicas),
                "--cluster-yes",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if done.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {done.stdout}{done.stderr}")
