"""The agent Job the scheduler builds (tether.scheduler.kube.jobs), from the settings the chart gives
the scheduler, held to the same policies as every pod the chart renders, and fenced by the chart's
agent-job NetworkPolicy: the gateway and DNS, nothing else of the release."""

from __future__ import annotations

import pytest

from deploy import chart, policy
from deploy.test_chart_network import DNS, NS_LABELS, pods
from tether.scheduler import kube
from tether.scheduler.kube import jobs

SET = "agents-as-jobs"


def scheduler_env(render: chart.Render) -> dict[str, str]:
    """The scheduler container's literal environment in the render."""
    deploy = render.get("Deployment", f"{chart.FULLNAME}-scheduler")
    (container,) = [c for c in deploy["spec"]["template"]["spec"]["containers"] if c["name"] == "scheduler"]
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


def scheduler_settings(env: dict[str, str]) -> kube.KubeSettings:
    """The scheduler's own settings class over what the chart set (and the two values the pod gets
    from the downward API and the Secret)."""
    mp = pytest.MonkeyPatch()
    try:
        for name, value in env.items():
            mp.setenv(name, value)
        mp.setenv("TETHER_KUBE_NAMESPACE", chart.NAMESPACE)
        mp.setenv("TETHER_ADMIN_TOKEN", "from-the-secret")
        return kube.KubeSettings()
    finally:
        mp.undo()


@pytest.fixture(scope="module")
def job() -> dict:
    env = scheduler_env(chart.render(SET))
    settings = scheduler_settings(env)
    assert settings.agent_jobs and settings.kube_instance == chart.RELEASE
    rollout = {
        "rollout_id": "0123456789abcdef0123456789abcdef",
        "api_key": "tr-never-in-the-body",
        "base_url": f"http://{chart.FULLNAME}-gateway:8000/v1",
        "model": "tether-policy",
    }
    body = jobs.job_body(kube.job_template(settings, env["TETHER_RUN_ID"]), rollout, {"q": "2+2"}, "1-0", 0)
    assert "tr-never-in-the-body" not in str(body)
    return body


CHECKS = {
    "restricted": policy.pod_spec_violations,
    "read-only root": policy.read_only_root_violations,
    "requests": policy.request_violations,
    "no API token": policy.service_account_token_violations,
    "pinned images": policy.image_violations,
    "no secret literals": policy.env_violations,
    "writable paths mounted": policy.writable_path_violations,
}


@pytest.mark.parametrize("check", sorted(CHECKS))
def test_the_job_pod_passes_the_charts_pod_policies(job, check):
    assert CHECKS[check](job["spec"]["template"]["spec"]) == []


def test_the_job_pod_is_fenced_by_the_charts_network_policy(job):
    render = chart.render(SET)
    policies = render.of_kind("NetworkPolicy")
    labels = job["spec"]["template"]["metadata"]["labels"]
    assert policy.network_policy_violations(labels, policies) == []
    me = policy.Endpoint(labels, chart.NAMESPACE, NS_LABELS)
    reached = {
        where
        for where, _t, ep in pods(render)
        for port in ep.ports.values()
        if policy.connection_allowed(policies, me, ep, port)
    }
    assert reached and all("gateway" in where for where in reached), reached
    assert policy.connection_allowed(policies, me, DNS, 53, "UDP")
    # Nothing of the release reaches it.
    assert not any(policy.connection_allowed(policies, ep, me, 8080) for _w, _t, ep in pods(render))


def test_the_jobs_pull_with_the_charts_pull_secrets():
    # A private registry: the agent Jobs' pods get the same imagePullSecrets as the chart's own pods.
    values = {**chart.value_set(SET).values, "imagePullSecrets": [{"name": "regcred"}, {"name": "other"}]}
    render = chart.render_values(values, chart.value_set(SET).kube_versions[0])
    env = scheduler_env(render)
    settings = scheduler_settings(env)
    rollout = {"rollout_id": "ab" * 16, "api_key": "k", "base_url": "", "model": "m"}
    body = jobs.job_body(kube.job_template(settings, env["TETHER_RUN_ID"]), rollout, {}, "1-0", 0)
    pulls = body["spec"]["template"]["spec"]["imagePullSecrets"]
    assert pulls == [{"name": "regcred"}, {"name": "other"}]
    chart_pod = render.get("Deployment", f"{chart.FULLNAME}-scheduler")["spec"]["template"]["spec"]
    assert chart_pod["imagePullSecrets"] == pulls
