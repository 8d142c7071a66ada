#!/usr/bin/env python3
"""SWE-smith tasks for recipes/swe-bench-verified-qwen3.5-9b.yaml: the filtering Agent Lightning v1.0
describes (issue 15), then a seeded split, so that a user reproduces its ~6K train / 400 held-out sets.

Records are SWE-smith's own (the Hugging Face dataset exported as JSON lines, e.g. with
`datasets.load_dataset("SWE-bench/SWE-smith", split="train").to_json("swe_smith.jsonl")`):
`instance_id`, `repo`, `patch`, `FAIL_TO_PASS`, `PASS_TO_PASS` (lists, or JSON strings of lists in some
exports), `image_name`, `problem_statement`. Steps, each counted in the report:

1. drop records with an empty problem statement;
2. drop records whose task branch is missing (SWE-smith keeps each task as the branch `instance_id` of
   its repository mirror; the check is a function, by default `git ls-remote`);
3. drop records with more than 200 tests (FAIL_TO_PASS + PASS_TO_PASS);
4. probe runs (optional, a function): run the harness N times per task through a gateway and keep the
   tasks with mixed outcomes (some runs solve it, some do not): a task every run solves or every run
   fails gives a GRPO group no signal;
5. a seeded split: `--held-out` tasks (400) held out, the rest the training set.

Writes OUT/train.jsonl and OUT/heldout.jsonl (one task a line: the record plus `task_id` =
`instance_id`, what the scheduler's TETHER_TASKS_FILE takes) and OUT/report.json (the counts).

    python recipes/data/swe_smith.py --records swe_smith.jsonl --out /srv/models/swe-smith \\
        [--probe-gateway http://127.0.0.1:8080 --agent tether.examples.coding.agent:rollout --runs 4]

Probe against a gateway that records without training (`tether gateway --upstream URL` in front of a
vLLM serving the base model), never against a training stack: probe groups would be trained on.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

MAX_TESTS = 200  # Agent Lightning v1.0 (issue 15): more than 200 tests -> dropped
HELD_OUT = 400  # Agent Lightning v1.0 (issue 15): ~6K train / 400 held out

Record = dict[str, Any]
BranchExists = Callable[[Record], bool]
# (record, runs) -> the reward of each run (1.0 = solved).
Probe = Callable[[Record, int], list[float]]


def load_records(path: Path) -> list[Record]:
    """SWE-smith records from JSON lines (or one JSON list)."""
    text = path.read_text()
    if text.lstrip().startswith("["):
        return list(json.loads(text))
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def tests_of(record: Record, field: str) -> list[str]:
    """FAIL_TO_PASS / PASS_TO_PASS as a list, whether the export kept a list or a JSON string."""
    value = record.get(field) or []
    if isinstance(value, str):
        value = json.loads(value) if value.strip() else []
    return list(value)


def drop_reason(record: Record, branch_exists: BranchExists, max_tests: int = MAX_TESTS) -> str | None:
    """Why the record is dropped before any probe run, or None to keep it."""
    if not str(record.get("problem_statement") or "").strip():
        return "empty problem statement"
    if not branch_exists(record):
        return "missing branch"
    if len(tests_of(record, "FAIL_TO_PASS")) + len(tests_of(record, "PASS_TO_PASS")) > max_tests:
        return f"more than {max_tests} tests"
    return None


def mixed(rewards: list[float]) -> bool:
    """Some runs solved the task and some did not."""
    solved = sum(1 for r in rewards if r >= 1.0)
    return 0 < solved < len(rewards)


def filter_records(
    records: Iterable[Record],
    branch_exists: BranchExists,
    probe: Probe | None = None,
    runs: int = 4,
    max_tests: int = MAX_TESTS,
) -> tuple[list[Record], Counter[str]]:
    """The records that pass every step, and how many each step dropped."""
    kept, dropped = [], Counter[str]()
    for record in records:
        reason = drop_reason(record, branch_exists, max_tests)
        if reason is None and probe is not None:
            rewards = probe(record, runs)
            if not mixed(rewards):
                reason = (
                    "probe: every run solved it"
                    if all(r >= 1.0 for r in rewards)
                    else "probe: no run solved it"
                )
        if reason:
            dropped[reason] += 1
        else:
            kept.append(record)
    return kept, dropped


def split(
    records: list[Record], held_out: int = HELD_OUT, seed: int = 0
) -> tuple[list[Record], list[Record]]:
    """(train, held out): a seeded shuffle of the records in instance_id order, the first `held_out`
    held out. The same records and seed give the same split, whatever order they came in."""
    ordered = sorted(records, key=lambda r: r["instance_id"])
    random.Random(seed).shuffle(ordered)
    return ordered[held_out:], ordered[:held_out]


def as_task(record: Record) -> Record:
    return {"task_id": record["instance_id"], **record}


def git_branch_exists(record: Record) -> bool:
    """The task's branch (`instance_id`) on the repository's GitHub mirror (SWE-smith's `repo`)."""
    url = f"https://github.com/{record['repo']}.git"
    p = subprocess.run(
        ["git", "ls-remote", "--exit-code", "--heads", url, record["instance_id"]],
        capture_output=True,
        timeout=60,
    )
    return p.returncode == 0


def gateway_probe(gateway_url: str, agent_spec: str, admin_token: str | None = None) -> Probe:
    """Runs the harness `agent_spec` (`module:function`, as `tether agent` takes it) `runs` times per
    task through the gateway's rollout API, each run its own rollout of one group; a run that raises
    counts as unsolved."""
    import httpx

    from tether.agents.worker import load_function

    fn = load_function(agent_spec)
    headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}

    def probe(record: Record, runs: int) -> list[float]:
        rewards = []
        with httpx.Client(base_url=gateway_url, timeout=60) as http:
            for i in range(runs):
                ro = (
                    http.post(
                        "/v1/rollouts",
                        json={
                            "task_id": record["instance_id"],
                            "group_id": f"probe-{record['instance_id']}",
                            "group_size": runs,
                        },
                        headers=headers,
                    )
                    .raise_for_status()
                    .json()
                )
                try:
                    reward = float(fn(as_task(record), ro["base_url"], ro["api_key"], ro["model"]))
                except Exception as exc:  # a failed run is an unsolved one here
                    print(f"probe {record['instance_id']} run {i}: {exc!r}", file=sys.stderr)
                    reward = 0.0
                http.post(
                    f"/v1/rollouts/{ro['rollout_id']}/complete",
                    json={"reward": reward},
                    headers={"Authorization": f"Bearer {ro['api_key']}"},
                )
                rewards.append(reward)
        return rewards

    return probe


def write_jsonl(path: Path, records: list[Record]) -> None:
    path.write_text("".join(json.dumps(as_task(r)) + "\n" for r in records))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--records", required=True, type=Path, help="SWE-smith records (JSON lines)")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--held-out", type=int, default=HELD_OUT)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tests", type=int, default=MAX_TESTS)
    p.add_argument("--no-branch-check", action="store_true", help="skip `git ls-remote` (offline)")
    p.add_argument("--probe-gateway", help="gateway URL for the probe runs (none: no probe)")
    p.add_argument("--agent", help="the harness of the probe runs, module:function")
    p.add_argument("--admin-token")
    p.add_argument("--runs", type=int, default=4, help="probe runs per task")
    args = p.parse_args(argv)
    if args.probe_gateway and not args.agent:
        p.error("--probe-gateway needs --agent")

    records = load_records(args.records)
    branch_exists: BranchExists = (lambda r: True) if args.no_branch_check else git_branch_exists
    probe = gateway_probe(args.probe_gateway, args.agent, args.admin_token) if args.probe_gateway else None
    kept, dropped = filter_records(records, branch_exists, probe, args.runs, args.max_tests)
    train, held = split(kept, args.held_out, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    write_jsonl(args.out / "train.jsonl", train)
    write_jsonl(args.out / "heldout.jsonl", held)
    report = {
        "records": len(records),
        "dropped": dict(sorted(dropped.items())),
        "kept": len(kept),
        "train": len(train),
        "held_out": len(held),
        "seed": args.seed,
        "probe_runs": args.runs if probe else 0,
    }
    (args.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
