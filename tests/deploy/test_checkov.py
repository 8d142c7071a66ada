"""checkov's Kubernetes policies over the renders of every good value set, with one skip list
(tests/deploy/checkov.yaml) whose every entry says why. checkov runs from its own virtualenv
(scripts/setup.sh --test), never from .venv."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from deploy import chart

CONFIG = chart.HERE / "checkov.yaml"
CHECKOV = (
    Path(os.environ.get("TETHER_CHECKOV_VENV", Path.home() / ".cache/tether/checkov-venv"))
    / "bin"
    / "checkov"
)


def test_every_skipped_check_says_why():
    config = yaml.safe_load(CONFIG.read_text())
    entries = [line for line in CONFIG.read_text().splitlines() if re.match(r"\s*-\s*CKV", line)]
    assert len(entries) == len(config.get("skip-check") or [])
    for line in entries:
        check, _, why = line.partition("#")
        assert re.fullmatch(r"\s*-\s*CKV2?_K8S_\d+\s*", check), line
        assert len(why.strip()) >= 20, f"no reason given: {line}"


def _documented_exception(check: dict) -> bool:
    """CKV_K8S_22 (writable root) on the inference Deployment of a set that turns on the schema-gated
    exception for GPU hooks."""
    name = Path(check["file_path"]).stem
    if check["check_id"] != "CKV_K8S_22" or not check["resource"].endswith(f"{chart.FULLNAME}-inference"):
        return False
    gate = chart.effective_values(name)["inference"]["securityContext"]["allowWritableRootForGpuHooks"]
    return bool(gate)


@pytest.mark.slow
def test_checkov_finds_nothing_in_the_renders(tmp_path):
    assert CHECKOV.exists(), f"{CHECKOV} missing: run scripts/setup.sh --test"
    for vs in chart.good_sets():
        (tmp_path / f"{vs.name}.yaml").write_text(chart.render(vs.name).text())
    proc = subprocess.run(
        [
            str(CHECKOV),
            "-d",
            str(tmp_path),
            "--config-file",
            str(CONFIG),
            "--skip-download",
            "-o",
            "json",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "BC_SKIP_MAPPING": "TRUE", "CHECKOV_RUN_SCA_PACKAGE_SCAN_V2": "false"},
    )
    assert proc.stdout.strip(), proc.stderr[-3000:]
    reports = json.loads(proc.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    failed = [
        f"{c['check_id']} {c['check_name']}: {Path(c['file_path']).stem} {c['resource']}"
        for r in reports
        for c in r.get("results", {}).get("failed_checks", [])
        if not _documented_exception(c)
    ]
    assert sum(r.get("summary", {}).get("passed", 0) for r in reports) > 0, "checkov checked nothing"
    assert sorted(set(failed)) == []
