"""Each extra installs alone into a fresh venv and its service starts (scripts/check_extras.sh): one
wheel built from the tree, then per extra a new venv, a full `pip install "<wheel>[<extra>]"`, no
torch/transformers/matplotlib for the torch-free extras, and `python -m tether.<svc> --help` exits 0.
Slow: minutes, torch is installed twice (trainer, cli)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXTRAS = ("core", "gateway", "merger", "scheduler", "inference", "agents", "runhost", "trainer", "cli")


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_every_extra_installs_alone_and_its_service_starts(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TETHER_") and k != "PYTHONPATH"}
    env.update(PYTHON=sys.executable, TETHER_EXTRAS_DIR=str(tmp_path))
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "check_extras.sh"), *EXTRAS],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1400,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert sorted(re.findall(r"^check_extras: ok \[(\w+)\]", out, re.M)) == sorted(EXTRAS), out
