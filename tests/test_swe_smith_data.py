"""recipes/data/swe_smith.py on a fixture of records in SWE-smith's own format (tests/fixtures/
swe_smith_records.jsonl: FAIL_TO_PASS/PASS_TO_PASS as lists and as JSON strings, as exports differ):
each filter drops what it should and says why, the probe step keeps only mixed outcomes, the split is
seeded and order-independent, and the script writes the tasks the scheduler reads."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "swe_smith_records.jsonl"
_spec = importlib.util.spec_from_file_location("swe_smith", ROOT / "recipes" / "data" / "swe_smith.py")
assert _spec and _spec.loader
swe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(swe)


def fixture_branch_exists(record) -> bool:
    return not record["repo"].startswith("swesmith/gone__")


def test_the_static_filters_drop_what_the_recipe_says():
    records = swe.load_records(FIXTURE)
    assert {
        "instance_id",
        "repo",
        "patch",
        "FAIL_TO_PASS",
        "PASS_TO_PASS",
        "image_name",
        "problem_statement",
    } <= set(records[0])
    kept, dropped = swe.filter_records(records, fixture_branch_exists)
    assert dropped == {"empty problem statement": 2, "missing branch": 1, "more than 200 tests": 1}
    assert len(kept) == 10
    assert all(r["problem_statement"].strip() for r in kept)
    # 200 tests exactly is kept, 201 is not (string-encoded lists are counted too).
    r = dict(
        records[0], FAIL_TO_PASS=json.dumps(["a"]), PASS_TO_PASS=json.dumps([f"t{i}" for i in range(199)])
    )
    assert swe.drop_reason(r, fixture_branch_exists) is None
    r["PASS_TO_PASS"] = json.dumps([f"t{i}" for i in range(200)])
    assert swe.drop_reason(r, fixture_branch_exists) == "more than 200 tests"


def test_the_probe_keeps_only_mixed_outcomes():
    records = swe.load_records(FIXTURE)
    calls = []

    def fake_probe(record, runs):  # a stand-in for gateway_probe: solved runs by the record's index
        calls.append((record["instance_id"], runs))
        k = int(record["instance_id"].rsplit("_", 1)[1], 16) % 3
        return [1.0] * k + [0.0] * (runs - k) if k < 2 else [1.0] * runs

    kept, dropped = swe.filter_records(records, fixture_branch_exists, fake_probe, runs=4)
    assert len(calls) == 10 and all(
        runs == 4 for _, runs in calls
    )  # only records that passed the static filters
    assert dropped["probe: no run solved it"] == 4 and dropped["probe: every run solved it"] == 3
    assert len(kept) == 3 and all(int(r["instance_id"].rsplit("_", 1)[1], 16) % 3 == 1 for r in kept)
    assert (
        swe.mixed([1.0, 0.0])
        and not swe.mixed([0.0, 0.0])
        and not swe.mixed([1.0, 1.0])
        and not swe.mixed([])
    )


def test_the_split_is_seeded_and_order_independent():
    records = [{"instance_id": f"i{n:05d}"} for n in range(6400)]
    train, held = swe.split(records, held_out=400, seed=0)
    assert len(train) == 6000 and len(held) == 400
    assert not {r["instance_id"] for r in train} & {r["instance_id"] for r in held}
    shuffled = records[:]
    random.Random(7).shuffle(shuffled)
    assert swe.split(shuffled, 400, 0) == (train, held)
    assert swe.split(records, 400, 1)[1] != held


def test_the_script_writes_the_tasks(tmp_path):
    assert (
        swe.main(["--records", str(FIXTURE), "--out", str(tmp_path), "--held-out", "3", "--no-branch-check"])
        == 0
    )
    report = json.loads((tmp_path / "report.json").read_text())
    # Offline (no branch check) the missing-branch record stays in.
    assert report == {
        "records": 14,
        "dropped": {"empty problem statement": 2, "more than 200 tests": 1},
        "kept": 11,
        "train": 8,
        "held_out": 3,
        "seed": 0,
        "probe_runs": 0,
    }
    train = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    held = [json.loads(line) for line in (tmp_path / "heldout.jsonl").read_text().splitlines()]
    assert len(train) == 8 and len(held) == 3
    assert all(t["task_id"] == t["instance_id"] for t in train + held)  # what TETHER_TASKS_FILE needs
