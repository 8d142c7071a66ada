"""Helpers for the tests that drive the `tether` command and its processes from outside."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

TETHER = [sys.executable, "-m", "tether.cli"]


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split()[2] == "Z")


def wait_for(cond, timeout: float, what: str, every_s: float = 0.5):
    """`cond()` once it is truthy; AssertionError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError(f"timed out waiting for {what}")


def jsonl(text: str) -> list[dict]:
    return [json.loads(x) for x in text.splitlines() if x.strip()]


@dataclass
class UpStack:
    """A `tether up` started by `tether_up`: its gateway, its directory and run directory."""

    gateway: str
    cwd: Path
    run_dir: Path

    def cli(self, *args: str) -> list[dict]:
        """`tether ARGS` in the stack's directory (as a user runs it there), its JSON lines."""
        out = subprocess.run([*TETHER, *args], cwd=self.cwd, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
        return jsonl(out.stdout)

    def steps(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        return jsonl(path.read_text()) if path.exists() else []


@contextlib.contextmanager
def tether_up(cwd: Path, *args: str, env: dict[str, str] | None = None) -> Iterator[UpStack]:
    """`tether up ARGS` in `cwd`, as a user runs it; yields once every service is up. On the way out
    `tether down`; when the body passed, also checks the stack stopped cleanly (both commands exit 0
    and no process of it is left)."""
    run_dir = cwd / "run"
    log_path = cwd / "up.log"
    state_file = cwd / ".tether" / "stack.json"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [*TETHER, "up", "--run-dir", str(run_dir), *args],
            cwd=cwd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        try:

            def ready():
                if proc.poll() is not None:
                    raise AssertionError(log_path.read_text())
                if not state_file.exists():
                    return None
                state = json.loads(state_file.read_text())
                return state if "scheduler" in state["addresses"] else None

            wait_for(lambda: ready() and "gateway:" in log_path.read_text(), 900, "the stack")
            yield UpStack(ready()["addresses"]["gateway_url"], cwd, run_dir)
        finally:
            down = subprocess.run([*TETHER, "down"], cwd=cwd, capture_output=True, text=True, timeout=120)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                raise
    assert down.returncode == 0, down.stdout + down.stderr
    assert proc.returncode == 0, log_path.read_text()[-3000:]
    state = json.loads(state_file.read_text())
    assert not [name for name, pid in state["pids"].items() if alive(pid)]
