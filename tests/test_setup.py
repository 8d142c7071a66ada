"""`make demo`'s first half: scripts/setup.sh without --test must succeed on a machine the tests set up.

(It once exited 1 before doing anything: a `[ ... ] && cat` that was false failed its pipeline under
`set -e`, so `make demo`, the quick start's first command, stopped at setup.)"""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_setup_for_the_demo_succeeds_and_keeps_the_test_environment():
    stamp = ROOT / ".venv" / ".tether-installed"
    before = stamp.read_text()
    proc = subprocess.run(["bash", "scripts/setup.sh"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "setup: ready" in proc.stdout
    # Nothing was reinstalled: an environment set up with --test serves the demo as it is.
    assert "installing" not in proc.stdout and stamp.read_text() == before
