"""bench/trainer_gpu is what a lent GPU machine runs (its figures are in docs/trainer.md). Its logic runs
here too, on a tiny model, so that it still works when a GPU is next lent: every part passes or says
why it is CUDA-only."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
CUDA_ONLY = {"bf16", "packing_bf16"}


def test_trainer_gpu_bench_runs_on_cpu():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "trainer_gpu"), "--device", "cpu", "--small"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["ok"] is True and report["complete"] is True
    parts = report["parts"]
    assert {name for name, r in parts.items() if r["ok"] is None} == CUDA_ONLY
    assert all(r["ok"] is True for name, r in parts.items() if name not in CUDA_ONLY)
    # The checks really ran: the FSDP2 part compared weights and resumed from the optimizer shards.
    fsdp = parts["fsdp2"]
    assert fsdp["checks"]["resumed_vs_continuous_weights"] and fsdp["child_resume"]["optimizer_shard_files"]
