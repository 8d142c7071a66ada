"""Policy over every pod template the chart renders, for every good value set (tests/deploy/policy.py
holds the checks; the scheduler's tests apply the same ones to the agent Job bodies it builds)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from deploy import chart, policy

GOOD = chart.good_sets()
NAMES = [s.name for s in GOOD]
COMPONENT = "app.kubernetes.io/component"
# The exact selector labels (BRIEF "Fixed interfaces"): immutable once installed.
SELECTOR_KEYS = {"app.kubernetes.io/name", "app.kubernetes.io/instance", COMPONENT}


def templates(name: str) -> list[tuple[str, dict[str, Any]]]:
    return list(chart.render(name).pod_templates())


def component(template: dict[str, Any]) -> str:
    return str(((template.get("metadata") or {}).get("labels") or {}).get(COMPONENT, ""))


def collect(name: str, check) -> list[str]:
    """Every violation of one check across the set's pod templates, each prefixed with its workload."""
    return [f"{where}: {v}" for where, t in templates(name) for v in check(t.get("spec") or {}, t)]


def test_every_set_renders_pods():
    for name in NAMES:
        assert templates(name), name


@pytest.mark.parametrize("name", NAMES)
def test_pod_security_standards_restricted(name):
    assert collect(name, lambda spec, _t: policy.pod_spec_violations(spec)) == []


def _writable_root_allowed(name: str) -> set[str]:
    """Containers allowed a writable root: the inference container, and only when the set turns on the
    schema-gated exception for GPU hooks."""
    values = chart.effective_values(name)
    gate = values["inference"]["securityContext"]["allowWritableRootForGpuHooks"]
    return {"inference"} if gate and values["inference"]["backend"] == "gpu" else set()


@pytest.mark.parametrize("name", NAMES)
def test_read_only_root_filesystems(name):
    allowed = _writable_root_allowed(name)
    found = collect(name, lambda spec, _t: policy.read_only_root_violations(spec))
    assert [v for v in found if not any(f"containers[{c}]" in v for c in allowed)] == []


def test_the_writable_root_exception_is_gated_and_narrow():
    """Where the exception is on, exactly the inference container has a writable root; elsewhere none."""
    gated = [n for n in NAMES if _writable_root_allowed(n)]
    assert gated, "no value set exercises inference.securityContext.allowWritableRootForGpuHooks"
    for name in gated:
        found = collect(name, lambda spec, _t: policy.read_only_root_violations(spec))
        assert found and all("containers[inference]" in v for v in found), found


@pytest.mark.parametrize("name", NAMES)
def test_requests_on_every_container(name):
    assert collect(name, lambda spec, _t: policy.request_violations(spec)) == []


@pytest.mark.parametrize("name", NAMES)
def test_service_account_tokens_only_for_the_scheduler_and_the_run_host(name):
    values = chart.effective_values(name)
    problems = []
    for where, t in templates(name):
        spec = t.get("spec") or {}
        want = policy.kube_api_user(values, component(t))
        if want is not None:
            if spec.get("automountServiceAccountToken") is not want:
                problems.append(
                    f"{where}: automountServiceAccountToken {spec.get('automountServiceAccountToken')!r}"
                )
            if spec.get("serviceAccountName") != f"{chart.FULLNAME}-{component(t)}":
                problems.append(f"{where}: serviceAccountName {spec.get('serviceAccountName')!r}")
        else:
            problems += [f"{where}: {v}" for v in policy.service_account_token_violations(spec)]
    assert problems == []


@pytest.mark.parametrize("name", NAMES)
def test_images_are_pinned(name):
    assert collect(name, lambda spec, _t: policy.image_violations(spec)) == []


@pytest.mark.parametrize("name", NAMES)
def test_tether_images_follow_the_app_version(name):
    """With no tag or digest set, every Tether image carries the chart's appVersion (Redis has its own
    pin)."""
    values = chart.effective_values(name)
    app = chart.chart_metadata()["appVersion"]
    problems = []
    for key, image in values["images"].items():
        if key == "redis" or image.get("tag") or image.get("digest"):
            continue
        for where, t in templates(name):
            for cw, c in policy.containers(t.get("spec") or {}):
                repo, _, tag = c["image"].rpartition(":")
                if repo.endswith(image["repository"]) and not tag.startswith(app):
                    problems.append(f"{where} {cw}: {c['image']}, want tag {app}{image.get('tagSuffix', '')}")
    assert problems == []


@pytest.mark.parametrize("name", NAMES)
def test_probes_use_ports_the_container_declares(name):
    assert collect(name, lambda spec, _t: policy.probe_violations(spec)) == []


@pytest.mark.parametrize("name", NAMES)
def test_every_long_running_container_is_probed(name):
    """Each Deployment/StatefulSet container has readiness and liveness (or a gRPC/HTTP startup probe
    guarding a long load): a pod that never reports is never routed to, or never restarted."""
    problems = []
    for obj in chart.render(name).of_kind("Deployment", "StatefulSet"):
        for c in obj["spec"]["template"]["spec"]["containers"]:
            for probe in ("readinessProbe", "livenessProbe"):
                if probe not in c:
                    problems.append(
                        f"{obj['kind']}/{obj['metadata']['name']} containers[{c['name']}]: no {probe}"
                    )
    assert problems == []


@pytest.mark.parametrize("name", NAMES)
def test_no_secret_in_a_literal_env_value(name):
    assert collect(name, lambda spec, _t: policy.env_violations(spec)) == []


@pytest.mark.parametrize("name", NAMES)
def test_gpu_pods_have_a_memory_dev_shm(name):
    assert collect(name, lambda spec, _t: policy.shm_violations(spec)) == []


def test_some_set_renders_gpu_pods():
    """The /dev/shm and surge rules are not vacuous: GPU pods exist in the sets."""
    gpu = [n for n in NAMES if any(policy.uses_gpu(t.get("spec") or {}) for _, t in templates(n))]
    assert len(gpu) >= 4, gpu


@pytest.mark.parametrize("name", NAMES)
def test_gpu_workloads_never_surge(name):
    assert [v for o in chart.render(name).objects for v in policy.surge_violations(o)] == []


@pytest.mark.parametrize("name", NAMES)
def test_grace_period_covers_prestop_and_drain(name):
    """terminationGracePeriodSeconds >= preStop sleep + drain + margin (values' shutdown), on every
    container with a preStop hook; and every Tether service has one (endpoints go before SIGTERM)."""
    shutdown = chart.effective_values(name)["shutdown"]
    drain = shutdown["drainSeconds"] + shutdown["marginSeconds"] - 1
    problems = []
    for where, t in templates(name):
        spec = t.get("spec") or {}
        for c in spec.get("containers") or []:
            if policy.prestop_seconds(c) == 0:
                continue
            problems += [
                f"{where}: {v}"
                for v in policy.grace_violations({**spec, "containers": [c]}, drain_seconds=drain)
            ]
    assert problems == []


def _selected(render: chart.Render, selector: dict[str, str]) -> list[tuple[str, dict[str, Any]]]:
    return [
        (w, t)
        for w, t in render.pod_templates()
        if policy.label_selector_matches(
            {"matchLabels": selector}, (t.get("metadata") or {}).get("labels") or {}
        )
    ]


@pytest.mark.parametrize("name", NAMES)
def test_service_target_ports_resolve(name):
    """Each Service selects pods of the release, and each of its target ports (a name or a number) is a
    container port of every pod it selects."""
    render = chart.render(name)
    problems = []
    for svc in render.of_kind("Service"):
        where = f"Service/{svc['metadata']['name']}"
        selector = svc["spec"].get("selector")
        if not selector:
            continue
        pods = _selected(render, selector)
        if not pods:
            problems.append(f"{where}: selects no pod of the render ({selector})")
        for port in svc["spec"].get("ports") or []:
            target = port.get("targetPort", port["port"])
            for pw, t in pods:
                declared = [p for c in t["spec"]["containers"] for p in c.get("ports") or []]
                key = "name" if isinstance(target, str) else "containerPort"
                if not any(p.get(key) == target for p in declared):
                    problems.append(
                        f"{where} port {port.get('name')}: targetPort {target!r} is no port of {pw}"
                    )
    assert problems == []


def test_service_names_and_ports_are_the_fixed_interface():
    """The names and ports every other piece of Tether dials (BRIEF "Fixed interfaces")."""
    want = {
        "gateway": {"http": 8000, "grpc": 50051},
        "inference": {"http": 8001, "grpc": 50052, "metrics": 9102},
        "trainer": {"grpc": 50053, "metrics": 9103, "rdzv": 29400},
        "merger": {"grpc": 50054, "metrics": 9104},
        "scheduler": {"grpc": 50055, "metrics": 9105},
        "redis": {"redis": 6379},
    }
    render = chart.render("gpu-disaggregated-multi-node")
    for svc, ports in want.items():
        obj = render.get("Service", f"{chart.FULLNAME}-{svc}")
        assert {p["name"]: p["port"] for p in obj["spec"]["ports"]} == ports, svc
    trainer = render.get("Service", f"{chart.FULLNAME}-trainer")["spec"]
    assert trainer.get("clusterIP") == "None" and trainer.get("publishNotReadyAddresses") is True


def test_selector_labels_are_identical_across_all_value_sets():
    """A workload's selector (and a StatefulSet's serviceName) is immutable after install: every value set
    gives each workload the same one, exactly the three selector labels, so an upgrade from one set to
    another never fails on it. A Service's selector may change (the inference Service follows the
    colocated pod); it still uses exactly the selector labels."""
    seen: dict[str, tuple[str, Any]] = {}
    problems = []
    for name in NAMES:
        for obj in chart.render(name).objects:
            kind, objname = obj["kind"], obj["metadata"]["name"]
            spec = obj.get("spec") or {}
            key = f"{kind}/{objname}"
            if kind in ("Deployment", "StatefulSet", "DaemonSet"):
                selector = spec["selector"].get("matchLabels") or {}
                if spec["selector"].get("matchExpressions"):
                    problems.append(f"{name} {key}: matchExpressions in a workload selector")
                immutable = (selector, spec.get("serviceName"))
                if key in seen and seen[key][1] != immutable:
                    problems.append(f"{key}: {seen[key][0]} has {seen[key][1]}, {name} has {immutable}")
                seen.setdefault(key, (name, immutable))
            elif kind == "Service" and spec.get("selector"):
                selector = spec["selector"]
            else:
                continue
            if set(selector) != SELECTOR_KEYS:
                problems.append(f"{name} {key}: selector keys {sorted(selector)}")
    assert problems == []


def test_a_components_selector_is_the_same_for_every_object_of_it():
    """Per component, one selector across sets and kinds (Deployment and Service of the gateway agree)."""
    by_component: dict[str, set[tuple[tuple[str, str], ...]]] = {}
    for name in NAMES:
        for obj in chart.render(name).of_kind("Deployment", "StatefulSet", "Service"):
            spec = obj.get("spec") or {}
            selector = spec.get("selector") or {}
            selector = selector.get("matchLabels", selector) if obj["kind"] != "Service" else selector
            if selector:
                by_component.setdefault(selector.get(COMPONENT, "?"), set()).add(
                    tuple(sorted(selector.items()))
                )
    assert {c: s for c, s in by_component.items() if len(s) > 1} == {}


def _agent_job_labels(name: str) -> dict[str, str]:
    """The labels the scheduler gives agent Job pods (BRIEF "Fixed interfaces")."""
    return {
        "app.kubernetes.io/name": "tether",
        "app.kubernetes.io/instance": chart.RELEASE,
        COMPONENT: "agent-job",
        "tether.dev/run": str(chart.effective_values(name)["run"]["id"]),
        "tether.dev/rollout": "r-0",
    }


@pytest.mark.parametrize("name", NAMES)
def test_every_pod_is_covered_by_a_network_policy(name):
    """Ingress and egress of every pod (the agent Jobs' too) are governed by a NetworkPolicy: a pod
    no policy selects is open to the whole cluster."""
    render = chart.render(name)
    policies = render.of_kind("NetworkPolicy")
    pods = [(w, (t.get("metadata") or {}).get("labels") or {}) for w, t in render.pod_templates()]
    if chart.effective_values(name)["agents"]["jobs"]["enabled"]:
        pods.append(("agent Job pods", _agent_job_labels(name)))
    problems = [f"{w}: {v}" for w, labels in pods for v in policy.network_policy_violations(labels, policies)]
    assert problems == []


def test_agent_jobs_reach_only_the_gateway_dns_and_what_the_user_allows():
    render = chart.render("agents-as-jobs")
    labels = _agent_job_labels("agents-as-jobs")
    own = [
        p
        for p in render.of_kind("NetworkPolicy")
        if (p["spec"]["podSelector"].get("matchLabels") or {}).get(COMPONENT) == "agent-job"
    ]
    assert len(own) == 1, "one NetworkPolicy selects the agent-job pods"
    spec = own[0]["spec"]
    assert policy.label_selector_matches(spec["podSelector"], labels)
    assert set(spec["policyTypes"]) == {"Ingress", "Egress"} and not spec.get("ingress")
    extra = chart.effective_values("agents-as-jobs")["agents"]["jobs"]["extraEgress"]
    assert all(rule in spec["egress"] for rule in extra)
    peers = [peer for rule in spec["egress"] if rule not in extra for peer in rule.get("to") or []]
    pod_peers = [
        p["podSelector"].get("matchLabels", {})
        for p in peers
        if "podSelector" in p and "namespaceSelector" not in p
    ]
    assert all(p.get(COMPONENT) == "gateway" for p in pod_peers), pod_peers


SECRET_KEY = re.compile(
    r"(^|[_.\-])(password|passwd|token|secret|api[_\-]?key|credentials?)($|[_.\-])", re.IGNORECASE
)
SECRET_TEXT = re.compile(r"requirepass\s+\S+|://[^/\s:@]*:[^/\s@]+@", re.IGNORECASE)


@pytest.mark.parametrize("name", NAMES)
def test_no_secret_data_in_config_maps(name):
    problems = []
    for cm in chart.render(name).of_kind("ConfigMap"):
        for key, value in (cm.get("data") or {}).items():
            if SECRET_KEY.search(key):
                problems.append(f"ConfigMap/{cm['metadata']['name']}: key {key}")
            if SECRET_TEXT.search(str(value)):
                problems.append(f"ConfigMap/{cm['metadata']['name']}: {key} holds a password")
    assert problems == []


@pytest.mark.parametrize("name", NAMES)
def test_no_secret_is_rendered_with_data(name):
    """The chart never writes a secret value into a manifest (it reads an existing Secret); only
    `secrets.generate` creates one, on the cluster."""
    assert [
        s["metadata"]["name"]
        for s in chart.render(name).of_kind("Secret")
        if s.get("data") or s.get("stringData")
    ] == []


@pytest.mark.parametrize("name", NAMES)
def test_pod_disruption_budgets_never_block_a_drain(name):
    """A PDB allows at least one voluntary eviction of the pods it covers: minAvailable equal to the
    replicas (or maxUnavailable 0) would hold a node drain forever."""
    render = chart.render(name)
    replicas = {
        tuple(sorted(((o["spec"]["template"]["metadata"].get("labels")) or {}).items())): o["spec"].get(
            "replicas", 1
        )
        for o in render.of_kind("Deployment", "StatefulSet")
    }
    problems = []
    for pdb in render.of_kind("PodDisruptionBudget"):
        spec, pname = pdb["spec"], pdb["metadata"]["name"]
        if "maxUnavailable" in spec:
            if str(spec["maxUnavailable"]) in ("0", "0%"):
                problems.append(f"PodDisruptionBudget/{pname}: maxUnavailable 0")
            continue
        covered = [
            n
            for labels, n in replicas.items()
            if policy.label_selector_matches(spec.get("selector"), dict(labels))
        ]
        want = spec.get("minAvailable")
        if isinstance(want, str) and want.endswith("%"):
            if want != "0%":
                problems.append(f"PodDisruptionBudget/{pname}: minAvailable {want} (use maxUnavailable)")
        elif want is not None and any(int(want) >= n for n in covered):
            problems.append(f"PodDisruptionBudget/{pname}: minAvailable {want} of {covered} replicas")
    assert problems == []


def test_the_scheduler_pod_gets_the_kubernetes_environment():
    """The settings the scheduler's Kubernetes code reads (BRIEF "Scheduler environment")."""
    render = chart.render("agents-as-jobs")
    (sched,) = [t for _, t in render.pod_templates() if component(t) == "scheduler"]
    env = {e["name"]: e for c in sched["spec"]["containers"] for e in c.get("env") or []}
    assert env["TETHER_KUBE_ENABLED"]["value"] == "true"
    assert env["TETHER_KUBE_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert env["TETHER_KUBE_INSTANCE"]["value"] == chart.RELEASE
    assert env["TETHER_KUBE_INFERENCE_SERVICE"]["value"] == f"{chart.FULLNAME}-inference"
    assert env["TETHER_KUBE_TRAINER_SELECTOR"]["value"] == (
        f"app.kubernetes.io/instance={chart.RELEASE},app.kubernetes.io/component=trainer"
    )
    assert env["TETHER_AGENT_JOBS"]["value"] == "true"
    assert env["TETHER_AGENT_JOB_GATEWAY_URL"]["value"] == f"http://{chart.FULLNAME}-gateway:8000"
    for key in (
        "QPS",
        "BURST",
        "MAX_CONCURRENT",
        "TTL_S",
        "DEADLINE_S",
        "IMAGE",
        "COMMAND",
        "ARGS",
        "RESOURCES",
    ):
        assert f"TETHER_AGENT_JOB_{key}" in env, key


@pytest.mark.parametrize("name", NAMES)
def test_caches_and_tmp_are_on_writable_mounts(name):
    assert collect(name, lambda spec, _t: policy.writable_path_violations(spec)) == []


@pytest.mark.parametrize("name", NAMES)
def test_every_variable_reference_resolves(name):
    assert collect(name, lambda spec, _t: policy.env_reference_violations(spec)) == []


def test_every_service_account_a_pod_uses_is_rendered():
    """A pod naming a ServiceAccount that does not exist is never created (the ReplicaSet reports it
    only in its events). The scheduler's, `<fullname>-scheduler`, comes with scheduler-rbac.yaml."""
    problems = []
    for name in NAMES:
        render = chart.render(name)
        accounts = {o["metadata"]["name"] for o in render.of_kind("ServiceAccount")}
        for where, t in render.pod_templates():
            sa = t["spec"].get("serviceAccountName", "default")
            if sa not in accounts:
                problems.append(f"{name} {where}: ServiceAccount {sa} is not rendered")
    assert problems == []


def test_a_digest_wins_over_the_tag():
    digest = "sha256:" + "ab" * 32
    vs = chart.value_set("cpu-demo")
    render = chart.render_values(
        chart.merge(vs.values, {"images": {"tether": {"tag": "9.9.9", "digest": digest}}})
    )
    images = {c["image"] for _w, t in render.pod_templates() for _cw, c in policy.containers(t["spec"])}
    tether = {i for i in images if i.split("@")[0].split(":")[0].endswith("tether/tether")}
    assert tether == {f"tether/tether@{digest}"}


def test_redis_is_durable_and_keeps_its_data():
    """The in-chart Redis: the pinned official image, AOF on, noeviction (the AOF is the trace store:
    evicting a key loses a trace), the password from a file, and its volume kept when the release goes."""
    render = chart.render("cpu-demo")
    sts = render.get("StatefulSet", f"{chart.FULLNAME}-redis")
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    assert c["image"] == "redis:7.4.5"
    conf = "\n".join(
        v for cm in render.of_kind("ConfigMap") for v in (cm.get("data") or {}).values() if "appendonly" in v
    ) + " ".join(c.get("command", []) + c.get("args", []))
    assert "appendonly yes" in conf and "maxmemory-policy noeviction" in conf, conf
    retention = sts["spec"].get("persistentVolumeClaimRetentionPolicy", {})
    assert retention.get("whenDeleted", "Retain") == "Retain"
    assert [t["metadata"]["name"] for t in sts["spec"]["volumeClaimTemplates"]]
    env = {e["name"] for e in c.get("env") or []}
    assert not {"REDIS_PASSWORD", "REDISCLI_AUTH"} & env


def test_a_scheduler_without_kubernetes_gets_no_kubernetes_settings():
    render = chart.render("scheduler-without-kubernetes")
    (sched,) = [t for _, t in render.pod_templates() if component(t) == "scheduler"]
    assert sched["spec"]["automountServiceAccountToken"] is False
    env = {e["name"]: e.get("value") for c in sched["spec"]["containers"] for e in c.get("env") or []}
    assert env["TETHER_KUBE_ENABLED"] == "false"
    assert env.get("TETHER_AGENT_JOBS", "false") == "false"
    assert not render.of_kind("Role", "RoleBinding")


def _scheduler_env(render: chart.Render) -> dict[str, str]:
    (sched,) = [t for _, t in render.pod_templates() if component(t) == "scheduler"]
    return {e["name"]: e.get("value", "") for c in sched["spec"]["containers"] for e in c.get("env") or []}


def test_discovery_and_gang_restart_switch_their_settings_off():
    """Empty TETHER_KUBE_INFERENCE_SERVICE / TETHER_KUBE_TRAINER_SELECTOR turn the features off (BRIEF)."""
    vs = chart.value_set("cpu-demo")
    off = {"scheduler": {"kubernetes": {"enabled": True, "discovery": False, "gangRestart": False}}}
    env = _scheduler_env(chart.render_values(chart.merge(vs.values, off)))
    assert env["TETHER_KUBE_ENABLED"] == "true"
    assert env["TETHER_KUBE_INFERENCE_SERVICE"] == "" and env["TETHER_KUBE_TRAINER_SELECTOR"] == ""


def test_the_agent_job_settings_are_the_values():
    """The JSON settings parse and carry agents.jobs; the default image is the pinned tether image."""
    name = "agents-as-jobs"
    jobs = chart.effective_values(name)["agents"]["jobs"]
    env = _scheduler_env(chart.render(name))
    assert json.loads(env["TETHER_AGENT_JOB_COMMAND"]) == jobs["command"]
    assert json.loads(env["TETHER_AGENT_JOB_ARGS"]) == jobs["args"]
    assert json.loads(env["TETHER_AGENT_JOB_RESOURCES"]) == jobs["resources"]
    for key, value in (
        ("QPS", jobs["qps"]),
        ("BURST", jobs["burst"]),
        ("MAX_CONCURRENT", jobs["maxConcurrent"]),
        ("TTL_S", jobs["ttlSecondsAfterFinished"]),
        ("DEADLINE_S", jobs["activeDeadlineSeconds"]),
    ):
        assert float(env[f"TETHER_AGENT_JOB_{key}"]) == float(value), key
    image = env["TETHER_AGENT_JOB_IMAGE"]
    pod = {"containers": [{"name": "agent", "image": image, "imagePullPolicy": "IfNotPresent"}]}
    assert policy.image_violations(pod) == [] and image == "tether/tether:0.1.0"


def test_image_pull_secrets_reach_every_pod():
    """A private registry's pull secret is set once and reaches every pod the chart renders (a pod
    without it stays in ImagePullBackOff)."""
    vs = chart.value_set("gpu-disaggregated-multi-node")
    render = chart.render_values(chart.merge(vs.values, {"imagePullSecrets": [{"name": "regcred"}]}))
    missing = [
        w
        for w, t in render.pod_templates()
        if {"name": "regcred"} not in (t["spec"].get("imagePullSecrets") or [])
    ]
    assert missing == []
