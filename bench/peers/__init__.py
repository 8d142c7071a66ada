"""The peers bench/gateway_overhead measures beside Tether's gateway: Agent Lightning 1.0.2's gateway and
the LiteLLM proxy, each installed from PyPI into its own venv by bench/peers/setup.sh and run from
there. These modules are glue only (start the peer's own server in front of an upstream, hand the bench
the URLs and keys its callers use, stop it); none of the peers' code is copied here. Stdlib only, so the
bench imports them from Tether's venv.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

PEERS_DIR = Path(os.environ.get("TETHER_PEERS_DIR", Path.home() / ".cache" / "tether" / "peers"))


class PeerUnavailable(RuntimeError):
    """The peer cannot be run here (venv missing, wrong version); the message says why."""


class Peer:
    """A running peer proxy. `targets(n)` gives each of n callers the base URL (ending in /v1) and key
    it sends its requests to; `end_cell()` runs after each measured cell; `stop()` ends the peer."""

    name = "peer"
    version = ""
    stream_skip: str | None = None  # why streaming is not measured, or None

    def __init__(self, proc: subprocess.Popen, url: str, log_path: Path) -> None:
        self.proc = proc
        self.url = url
        self.log_path = log_path

    def targets(self, n: int) -> list[tuple[str, str | None]]:
        raise NotImplementedError

    def end_cell(self) -> None:
        pass

    def stop(self) -> None:
        stop_process(self.proc)


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 20 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def venv_python(name: str, dist: str, version: str) -> Path:
    """The peer venv's interpreter, after checking that the pinned version is what is installed there."""
    py = PEERS_DIR / name / "bin" / "python"
    if not py.exists():
        raise PeerUnavailable(f"no venv at {PEERS_DIR / name} (run bench/peers/setup.sh)")
    found = subprocess.run(
        [str(py), "-c", f"import importlib.metadata as m; print(m.version({dist!r}))"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    if found != version:
        raise PeerUnavailable(
            f"{dist} {found or 'missing'} in {PEERS_DIR / name}, want {version} (run bench/peers/setup.sh)"
        )
    return py


def http(
    method: str, url: str, body: object | None = None, key: str | None = None, timeout: float = 30
) -> bytes:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("content-type", "application/json")
    if key:
        req.add_header("authorization", f"Bearer {key}")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.read()


def wait_healthy(proc: subprocess.Popen, url: str, log_path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise PeerUnavailable(f"exited with {proc.returncode}: {log_path.read_text()[-2000:]}")
        try:
            http("GET", url, timeout=2)
            return
        except (urllib.error.URLError, OSError):
            time.sleep(0.3)
    proc.kill()
    raise PeerUnavailable(f"not healthy after {timeout:.0f} s: {log_path.read_text()[-2000:]}")


def start_peer(name: str, upstream: str, workdir: Path, port: int) -> Peer:
    """Start the named peer ('agentlightning' or 'litellm') in front of `upstream` (a base URL ending in
    /v1); raises PeerUnavailable with the reason when it cannot run."""
    if name == "agentlightning":
        from peers import agentlightning_proxy as mod
    elif name == "litellm":
        from peers import litellm_proxy as mod
    else:
        raise PeerUnavailable(f"unknown peer {name!r}")
    return mod.start(upstream, workdir, port)


NAMES = ("agentlightning", "litellm")


def run_alone(description: str, start, default_port: int, ready_line) -> None:
    """A peer module's own command line: start the peer in front of --upstream, print `ready_line(peer)`,
    and run until SIGTERM or Ctrl-C."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--upstream", required=True, help="OpenAI-compatible base URL, ending in /v1")
    p.add_argument("--port", type=int, default=default_port)
    args = p.parse_args()
    peer = start(args.upstream, Path(tempfile.mkdtemp(prefix="tether-peer-")), args.port)
    print(f"ready {ready_line(peer)}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        peer.proc.wait()
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        peer.stop()
