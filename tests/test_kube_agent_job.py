"""`tether agent-job`, the entry point inside an agent Job (tether.agents.job), against the real
gateway: the harness named by TETHER_AGENT_FN runs once with the Job's environment, its reward is
reported with the rollout's own key (exit 0), a failing harness fails the rollout (exit 1); and the
scheduler's Kubernetes settings, refused at start-up when they cannot work."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from pydantic import ValidationError

from tether.agents import job as agent_job
from tether.cli import main as cli_main
from tether.scheduler.kube import KubeSettings

HARNESS = """
def rollout(task, base_url, api_key, model):
    assert base_url.endswith("/v1") and api_key.startswith("tr-") and model
    if task.get("crash"):
        raise RuntimeError("harness crashed")
    return task["reward"]
"""


@pytest.fixture
def harness(tmp_path):
    path = tmp_path / "harness.py"
    path.write_text(HARNESS)
    return f"{path}:rollout"


def job_env(gw, rollout: dict, task: str, fn: str) -> dict[str, str]:
    return {
        "TETHER_TASK": task,
        "TETHER_BASE_URL": rollout["base_url"],
        "TETHER_API_KEY": rollout["api_key"],
        "TETHER_MODEL": rollout["model"],
        "TETHER_AGENT_FN": fn,
        "TETHER_ROLLOUT_ID": rollout["rollout_id"],
        "TETHER_GATEWAY_URL": gw.url,
    }


def state(gw, rollout: dict) -> dict:
    from gateway_helpers import ADMIN

    return gw.http.get(
        f"/v1/rollouts/{rollout['rollout_id']}", headers={"authorization": f"Bearer {ADMIN}"}
    ).json()


def test_the_reward_is_reported_with_the_rollout_key(gw, harness):
    ro = gw.new_rollout()
    assert agent_job.run(job_env(gw, ro, '{"reward": 0.5}', harness)) == 0
    got = state(gw, ro)
    assert (got["status"], got["reward"]) == ("completed", 0.5)


@pytest.mark.parametrize(
    "task,why", [('{"crash": true}', "harness crashed"), ('{"reward": NaN}', "non-finite")]
)
def test_a_failing_harness_fails_the_rollout(gw, harness, task, why):
    ro = gw.new_rollout()
    assert agent_job.run(job_env(gw, ro, task, harness)) == 1
    got = state(gw, ro)
    assert got["status"] == "failed" and why in got["reason"]


def test_missing_settings_exit_1_without_touching_the_gateway(gw, harness):
    ro = gw.new_rollout()
    env = job_env(gw, ro, '{"reward": 1}', harness)
    del env["TETHER_API_KEY"]
    assert agent_job.run(env) == 1
    assert state(gw, ro)["status"] == "running"


def test_the_cli_command_runs_it(gw, harness, monkeypatch):
    ro = gw.new_rollout()
    for k, v in job_env(gw, ro, '{"reward": 1.0}', harness).items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit) as exit_:
        cli_main(["agent-job"])
    assert exit_.value.code == 0
    assert state(gw, ro)["status"] == "completed"


# --- settings ------------------------------------------------------------------------------------


def test_settings_parse_the_chart_environment(monkeypatch):
    env = {
        "TETHER_KUBE_ENABLED": "true",
        "TETHER_KUBE_NAMESPACE": "ns",
        "TETHER_KUBE_INSTANCE": "demo",
        "TETHER_KUBE_INFERENCE_SERVICE": "demo-tether-inference",
        "TETHER_KUBE_TRAINER_SELECTOR": "app.kubernetes.io/instance=demo,app.kubernetes.io/component=trainer",
        "TETHER_AGENT_JOBS": "true",
        "TETHER_AGENT_JOB_IMAGE": "tether/tether:0.1.0",
        "TETHER_AGENT_JOB_COMMAND": '["tether", "agent-job"]',
        "TETHER_AGENT_JOB_ARGS": "[]",
        "TETHER_AGENT_JOB_QPS": "2.5",
        "TETHER_AGENT_JOB_BURST": "4",
        "TETHER_AGENT_JOB_MAX_CONCURRENT": "8",
        "TETHER_AGENT_JOB_TTL_S": "60",
        "TETHER_AGENT_JOB_DEADLINE_S": "900",
        "TETHER_AGENT_JOB_RESOURCES": '{"requests": {"cpu": "250m"}, "limits": {"memory": "1Gi"}}',
        "TETHER_AGENT_JOB_GATEWAY_URL": "http://demo-tether-gateway:8000",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    s = KubeSettings()
    assert s.agent_job_command == ["tether", "agent-job"] and s.agent_job_qps == 2.5
    assert s.agent_job_resources == {"requests": {"cpu": "250m"}, "limits": {"memory": "1Gi"}}
    assert (s.agent_job_burst, s.agent_job_max_concurrent, s.agent_job_ttl_s, s.agent_job_deadline_s) == (
        4,
        8,
        60,
        900,
    )


@pytest.mark.parametrize(
    "kw,message",
    [
        (dict(kube_enabled=True), "TETHER_KUBE_NAMESPACE"),
        (dict(agent_jobs=True), "needs TETHER_KUBE_ENABLED"),
        (
            dict(kube_enabled=True, kube_namespace="n", kube_instance="i", agent_jobs=True),
            "TETHER_AGENT_JOB_IMAGE",
        ),
        (dict(agent_job_resources={"request": {}}), "unknown keys"),
        (dict(agent_job_qps=0), "greater than 0"),
    ],
)
def test_settings_refuse_what_cannot_work(kw, message):
    with pytest.raises(ValidationError, match=message):
        KubeSettings(**kw)


def test_the_scheduler_refuses_bad_kube_settings_before_serving(tmp_path):
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(sys.path),
        "TETHER_REDIS_URL": "redis://127.0.0.1:1",
        "TETHER_SCHEDULER_GRPC_PORT": "0",
        "TETHER_GATEWAY_CONTROL_ADDRESS": "127.0.0.1:1",
        "TETHER_INFERENCE_ADDRESS": "127.0.0.1:1",
        "TETHER_TRAINER_ADDRESS": "127.0.0.1:1",
        "TETHER_RUN_ID": "r",
        "TETHER_RUN_DIR": str(tmp_path),
        "TETHER_KUBE_ENABLED": "true",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "tether.scheduler"], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2, proc.stderr
    assert "TETHER_KUBE_NAMESPACE" in proc.stderr
