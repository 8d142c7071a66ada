"""Find Prometheus' `promtool` for the tests that lint metrics, rules and PromQL.

Order: `promtool` on PATH (e.g. `apt-get install -y prometheus`), then TETHER_PROMTOOL, then the Debian
package unpacked under ~/.cache/tether/prometheus; when none is there, `apt-get download prometheus`
and `dpkg -x` it into that cache (no install: the package's maintainer scripts want systemd and a
`prometheus` user, and a test must not change the system). Debian bookworm's package is 2.42.

Use: `path = promtool()` (pytest.skip when it cannot be had, saying why), `check_metrics(text)`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

CACHE = Path(os.environ.get("TETHER_CACHE", Path.home() / ".cache" / "tether")) / "prometheus"
UNPACKED = CACHE / "usr" / "bin" / "promtool"


def _runs(path: Path) -> bool:
    try:
        return subprocess.run([str(path), "--version"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _unpack() -> str:
    """Download and unpack the Debian package into CACHE; '' when done, else why not."""
    if not (shutil.which("apt-get") and shutil.which("dpkg")):
        return "no apt-get/dpkg to fetch Debian's prometheus package"
    with tempfile.TemporaryDirectory() as tmp:
        got = subprocess.run(
            ["apt-get", "download", "prometheus"], cwd=tmp, capture_output=True, text=True, timeout=600
        )
        debs = list(Path(tmp).glob("prometheus_*.deb"))
        if got.returncode != 0 or not debs:
            return f"apt-get download prometheus failed: {got.stderr.strip()[-300:]}"
        # Unpack next to the cache and move into place, so a concurrent test never sees half a tree.
        CACHE.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".prometheus-", dir=CACHE.parent))
        try:
            subprocess.run(["dpkg", "-x", str(debs[0]), str(staging)], check=True, timeout=300)
            if not UNPACKED.exists():
                try:
                    os.replace(staging, CACHE)
                except OSError:  # another process put one there first
                    pass
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return ""


def find_promtool(fetch: bool = True) -> tuple[Path | None, str]:
    """(path to a working promtool, '') or (None, why there is none)."""
    candidates = [shutil.which("promtool"), os.environ.get("TETHER_PROMTOOL"), str(UNPACKED)]
    for candidate in candidates:
        if candidate and _runs(Path(candidate)):
            return Path(candidate), ""
    if not fetch:
        return None, "promtool not found"
    why = _unpack()
    if not why and _runs(UNPACKED):
        return UNPACKED, ""
    return None, why or f"unpacked {UNPACKED} does not run"


def promtool() -> Path:
    """A working promtool, or skip the calling test with the reason."""
    path, why = find_promtool()
    if path is None:
        pytest.skip(f"promtool unavailable: {why}")
    return path


def check_metrics(text: str) -> subprocess.CompletedProcess:
    """`promtool check metrics` on an exposition (stdin); its problems are on stderr/stdout."""
    return subprocess.run(
        [str(promtool()), "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
