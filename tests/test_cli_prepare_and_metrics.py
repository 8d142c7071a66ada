"""`tether prepare-demo` (compose's model-init) and `tether metrics` (the run's step records), as
their commands run: a real warm start into a folder, a real Redis holding the steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parent.parent
TETHER = [sys.executable, "-m", "tether.cli"]
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "services")}


def test_prepare_demo_writes_the_model_link_and_tasks_and_reuses_its_cache(tmp_path):
    out = tmp_path / "calculator"
    for _ in range(2):  # the second run finds the model in out/cache and rewrites the link and tasks
        subprocess.run([*TETHER, "prepare-demo", "--out", str(out)], env=ENV, check=True, timeout=600)
    link = out / "model"
    assert link.is_symlink() and not os.readlink(link).startswith("/")  # relative: the volume may move
    assert (link / "config.json").is_file() and (link / "tokenizer.json").is_file()
    assert len(list((out / "cache").iterdir())) == 1
    tasks = [json.loads(line) for line in (out / "tasks.jsonl").read_text().splitlines()]
    assert tasks and all("task_id" in t for t in tasks)


def test_metrics_prints_the_runs_step_records(redis_url):
    r = redis.Redis.from_url(redis_url)
    records = [{"step": i, "weight_version": i + 1, "reward_mean": 0.25 * i} for i in range(3)]
    for rec in records:
        r.xadd("ns:step-metrics", {"data": json.dumps(rec)})
    out = subprocess.run(
        [*TETHER, "metrics", "--redis-url", redis_url, "--namespace", "ns"],
        env=ENV,
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    assert [json.loads(line) for line in out.splitlines()] == records
    r.close()
