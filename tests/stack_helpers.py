"""Helpers for the tests that drive the `tether` command and its processes from outside."""

from __future__ import annotations

import os
import sys
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
