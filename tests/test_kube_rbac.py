"""The scheduler's Role is exactly what its Kubernetes code calls, both ways, for every combination of
the features: each feature is started through `tether.scheduler.kube.start` against the recording
fake and driven through every path that calls the API (discovery's list+watch; the agent Jobs' create,
watch, the Secret, the delete after a failed Secret; the gang restart's pod delete); what it called,
as (API group, resource, verb), is compared with the rules the chart renders (helm-python-sdk) for the
values that turn those features on. A static scan holds the driven paths to the code: every client
method the kube package names was called here."""

from __future__ import annotations

import asyncio
import itertools
import re
import uuid
from pathlib import Path

import helm_python as helm
import pytest
import redis.asyncio as aioredis
import yaml
from gateway_helpers import ADMIN
from kube_fake import METHODS, Cluster, FakeKube

from tether.common import broker
from tether.common.records import DispatchJob
from tether.scheduler import kube
from tether.scheduler.kube import jobs

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "tether"
KUBE = ROOT / "services" / "tether" / "scheduler" / "kube"
INSTANCE = "demo"

Calls = frozenset[tuple[str, str, str]]


async def until(predicate, timeout: float = 20.0) -> None:
    for _ in range(int(timeout / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached")


def settings(**kw) -> kube.KubeSettings:
    base = dict(kube_enabled=True, kube_namespace="ns", kube_instance=INSTANCE)
    return kube.KubeSettings(**{**base, **kw})


async def run_feature(s: kube.KubeSettings, fake: FakeKube, r, keys, drive, on_replicas=None) -> Calls:
    (coro,) = kube.start(s, r, keys, "run-1", on_replicas=on_replicas, api=fake.api())
    task = asyncio.create_task(coro)
    try:
        await drive()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return frozenset(fake.calls)


async def discovery_calls(r, keys) -> Calls:
    fake = FakeKube()
    got: list = []

    async def on_replicas(replicas):
        got.append(replicas)

    s = settings(kube_inference_service=f"{INSTANCE}-tether-inference")

    async def drive():
        await until(lambda: ("discovery.k8s.io", "endpointslices", "watch") in fake.calls and got)

    return await run_feature(s, fake, r, keys, drive, on_replicas)


async def jobs_calls(gw, r) -> Calls:
    fake = FakeKube()
    cluster = Cluster(gw.url, lambda job, attempt: "run", fake)
    fake.fail_next("secrets", "create", 500)  # the path that deletes the Job again
    s = settings(
        agent_jobs=True,
        agent_job_image="tether/tether:0.1.0",
        agent_job_command=["tether", "agent-job"],
        agent_job_gateway_url=gw.url,
        admin_token=ADMIN,
    )
    keys = broker.Keys(gw.keys.ns)
    group = f"g-{uuid.uuid4().hex[:8]}"
    await broker.ensure_group(r, keys.dispatch, "agents")
    await broker.publish(r, keys.dispatch, DispatchJob(group, "t", 1, {"reward": 1.0}, {}, 3).to_dict())
    kubelet = asyncio.create_task(cluster.kubelet())

    async def drive():
        for _ in range(1000):
            if (await r.xpending(keys.dispatch, "agents"))["pending"] == 0 and len(cluster.started) == 1:
                if all(jobs.job_outcome(j) for j in fake.store["jobs"].values()):
                    return
            await asyncio.sleep(0.02)
        raise AssertionError("the slot did not finish")

    try:
        return await run_feature(s, fake, r, keys, drive)
    finally:
        kubelet.cancel()
        await asyncio.gather(kubelet, return_exceptions=True)


def trainer_pod(name: str, uid: str, restarts: int = 0) -> dict:
    return {
        "metadata": {"name": name, "uid": uid, "labels": {"app.kubernetes.io/component": "trainer"}},
        "status": {
            "phase": "Running",
            "conditions": [{"type": "Ready", "status": "True"}],
            "containerStatuses": [{"name": "trainer", "restartCount": restarts, "ready": True}],
        },
    }


async def gang_calls(r, keys) -> Calls:
    fake = FakeKube()
    fake.put("pods", trainer_pod("t0", "a"))
    fake.put("pods", trainer_pod("t1", "b"))
    s = settings(kube_trainer_selector="app.kubernetes.io/component=trainer")

    async def drive():
        await until(lambda: ("", "pods", "watch") in fake.calls)
        await asyncio.sleep(0.1)
        fake.put("pods", trainer_pod("t1", "b", restarts=1))
        await until(lambda: ("", "pods", "delete") in fake.calls)

    return await run_feature(s, fake, r, keys, drive)


@pytest.fixture(scope="module")
def calls(gw, redis_port) -> dict[str, Calls]:
    """What each feature calls, driven through all its paths (one event loop for the module)."""

    async def collect():
        r = aioredis.from_url(f"redis://127.0.0.1:{redis_port}", decode_responses=True)
        keys = broker.Keys(f"rbac-{uuid.uuid4().hex[:6]}")
        try:
            return {
                "discovery": await discovery_calls(r, keys),
                "jobs": await jobs_calls(gw, r),
                "gangRestart": await gang_calls(r, keys),
            }
        finally:
            await r.aclose()

    return asyncio.run(collect())


def rendered(values: dict) -> dict[str, str]:
    chart = helm.Chart.load(str(CHART))
    chart.validate_schema(values)
    return chart.render(values, name=INSTANCE, namespace="ns")


def role(values: dict, component: str = "scheduler") -> Calls | None:
    """The (group, resource, verb) the rendered Role of `component` (scheduler, runhost) grants; None
    when no Role renders."""
    out = rendered(values)
    docs = [d for d in yaml.safe_load_all(out[f"tether/templates/{component}-rbac.yaml"]) if d]
    kinds = [d["kind"] for d in docs]
    roles = [d for d in docs if d["kind"] == "Role"]
    if not roles:
        assert kinds == ["ServiceAccount"]
        return None
    assert sorted(kinds) == ["Role", "RoleBinding", "ServiceAccount"]
    (rb,) = [d for d in docs if d["kind"] == "RoleBinding"]
    (sa,) = [d for d in docs if d["kind"] == "ServiceAccount"]
    assert rb["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": roles[0]["metadata"]["name"],
    }
    assert rb["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": "ns"}]
    assert sa["metadata"]["name"] == f"{INSTANCE}-tether-{component}" == roles[0]["metadata"]["name"]
    assert sa["automountServiceAccountToken"] is False  # the pod mounts it, only when it calls the API
    granted = set()
    for rule in roles[0]["rules"]:
        assert set(rule) <= {"apiGroups", "resources", "verbs"}, (
            rule
        )  # no resourceNames/nonResourceURLs surprise
        assert "*" not in str(rule), rule
        granted |= set(itertools.product(rule["apiGroups"], rule["resources"], rule["verbs"]))
    return frozenset(granted)


def values_for(
    discovery: bool, gang: bool, agent_jobs: bool, enabled: bool = True, runs: bool = False
) -> dict:
    return {
        "secrets": {"existingSecret": "tether-secrets"},
        "runs": {"enabled": runs},
        "scheduler": {"kubernetes": {"enabled": enabled, "discovery": discovery, "gangRestart": gang}},
        "agents": {
            "worker": {"enabled": not agent_jobs},
            "jobs": {"enabled": agent_jobs, "command": ["tether", "agent-job"]},
        },
    }


@pytest.mark.parametrize("discovery,gang,agent_jobs", list(itertools.product([True, False], repeat=3)))
def test_the_role_grants_exactly_what_the_features_call(calls, discovery, gang, agent_jobs):
    on = {"discovery": discovery, "gangRestart": gang, "jobs": agent_jobs}
    wanted = frozenset().union(*(calls[f] for f, flag in on.items() if flag))
    granted = role(values_for(discovery, gang, agent_jobs))
    if not wanted:
        assert granted is None
        return
    assert granted is not None
    assert wanted - granted == set(), "called but not granted"
    assert granted - wanted == set(), "granted but never called"


def test_no_role_without_kubernetes():
    assert role(values_for(True, True, False, enabled=False)) is None


def test_the_driven_paths_cover_every_client_method_the_code_names(calls):
    named = set()
    for path in KUBE.rglob("*.py"):
        named |= set(re.findall(r"\.(?:discovery|batch|core)\.(\w+)", path.read_text()))
    assert named and named == METHODS & named
    assert named == METHODS, METHODS - named


def runhost_pod(values: dict) -> dict:
    out = rendered(values)
    (dep,) = [d for d in yaml.safe_load_all(out["tether/templates/runhost.yaml"]) if d]
    return dep["spec"]["template"]["spec"]


@pytest.mark.parametrize("discovery,gang", list(itertools.product([True, False], repeat=2)))
def test_the_run_hosts_role_grants_exactly_what_its_runs_discovery_calls(calls, discovery, gang):
    """The run host (runs.enabled) has its own identity; where the gateway routes by discovered
    replicas its runs' schedulers discover them too (docs/runs.md, "Serving, beyond one replica"): its
    Role grants exactly what discovery calls, its pod mounts the token and its environment turns
    discovery on, as tether.scheduler's kube settings read it (and nothing else: no agent Jobs, no
    gang restart, which are the base scheduler's). Without discovery: no Role, no token, no kube env."""
    values = values_for(discovery, gang, agent_jobs=False, runs=True)
    pod = runhost_pod(values)
    assert pod["serviceAccountName"] == f"{INSTANCE}-tether-runhost"
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    kube_env = sorted(n for n in env if n.startswith(("TETHER_KUBE_", "TETHER_AGENT_JOB")))
    granted = role(values, "runhost")
    if not discovery:
        assert granted is None and pod["automountServiceAccountToken"] is False and kube_env == []
        return
    assert granted == calls["discovery"]
    assert pod["automountServiceAccountToken"] is True
    assert kube_env == [
        "TETHER_KUBE_ENABLED",
        "TETHER_KUBE_INFERENCE_SERVICE",
        "TETHER_KUBE_INSTANCE",
        "TETHER_KUBE_NAMESPACE",
    ]
    assert env["TETHER_KUBE_NAMESPACE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    read = kube.KubeSettings(
        **{
            n.removeprefix("TETHER_").lower(): env[n]["value"]
            for n in kube_env
            if n != "TETHER_KUBE_NAMESPACE"
        },
        kube_namespace="ns",
    )
    assert read.kube_enabled and read.kube_inference_service == f"{INSTANCE}-tether-inference"
    assert not read.agent_jobs and not read.kube_trainer_selector
    started = kube.start(read, None, None, "run-1", api=FakeKube().api())
    for coro in started:
        coro.close()
    assert len(started) == 1  # discovery alone
    # The gateway routes by discovered sets exactly then (it would refuse a run's calls otherwise).
    gw = [d for d in yaml.safe_load_all(rendered(values)["tether/templates/gateway.yaml"]) if d]
    (deployment,) = [d for d in gw if d["kind"] == "Deployment"]
    gw_env = {
        e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert gw_env["TETHER_REPLICA_DISCOVERY"] == "true"
