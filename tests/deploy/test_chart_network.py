"""The NetworkPolicies let through exactly the traffic Tether needs: every address a pod is configured
to dial, NCCL between trainer ranks and between trainer and inference on any port, DNS, Prometheus to
the metrics ports, the scheduler to the API server; and agent Jobs reach nothing but the gateway (plus
what the user allows). Connections are evaluated with NetworkPolicy's own semantics (policy.py)."""

from __future__ import annotations

import re
from typing import Any

import pytest

from deploy import chart, policy

GOOD = chart.good_sets()
NAMES = [s.name for s in GOOD]
COMPONENT = "app.kubernetes.io/component"
NS_LABELS = {"kubernetes.io/metadata.name": chart.NAMESPACE}
# What a Service address looks like in an env value: <fullname>-<svc>[.<more>]:<port>.
ADDRESS = re.compile(rf"\b((?:[a-z0-9-]+\.)?{re.escape(chart.FULLNAME)}-[a-z0-9-]+)(?:\.[a-z0-9.-]+)?:(\d+)")
DNS, PROMETHEUS, NCCL_PORT = policy.DNS, policy.PROMETHEUS, policy.NCCL_PORT


def pods(render: chart.Render) -> list[tuple[str, dict[str, Any], policy.Endpoint]]:
    """(where, pod template, endpoint) of every pod template in the render."""
    out = []
    for where, t in render.pod_templates():
        ports = {
            p["name"]: p["containerPort"]
            for c in t["spec"]["containers"]
            for p in c.get("ports") or []
            if "name" in p
        }
        labels = (t.get("metadata") or {}).get("labels") or {}
        out.append((where, t, policy.Endpoint(labels, chart.NAMESPACE, NS_LABELS, None, ports)))
    return out


def agent_job_pod(name: str) -> policy.Endpoint:
    labels = {
        "app.kubernetes.io/name": "tether",
        "app.kubernetes.io/instance": chart.RELEASE,
        COMPONENT: "agent-job",
        "tether.dev/run": str(chart.effective_values(name)["run"]["id"]),
        "tether.dev/rollout": "r-0",
    }
    return policy.Endpoint(labels, chart.NAMESPACE, NS_LABELS)


def _service_targets(render: chart.Render, service: str, port: int) -> list[tuple[str, policy.Endpoint, int]]:
    """The pods behind Service `service` and the container port its `port` reaches on each."""
    svc = render.get("Service", service)
    (sp,) = [p for p in svc["spec"]["ports"] if p["port"] == port] or [None]
    assert sp is not None, f"Service/{service} has no port {port}"
    target = sp.get("targetPort", port)
    out = []
    for where, _t, ep in pods(render):
        if policy.label_selector_matches({"matchLabels": svc["spec"]["selector"]}, ep.labels):
            number = ep.ports.get(target) if isinstance(target, str) else target
            out.append((where, ep, int(number or 0)))
    return out


def dialled(render: chart.Render) -> list[tuple[str, policy.Endpoint, str, int]]:
    """(where, source pod, service, port) for every Service address in a container's env."""
    services = {s["metadata"]["name"] for s in render.of_kind("Service")}
    out = []
    for where, t, ep in pods(render):
        for c in [*(t["spec"].get("initContainers") or []), *t["spec"]["containers"]]:
            for e in c.get("env") or []:
                if e["name"].startswith("TETHER_AGENT_JOB_"):
                    continue  # dialled by the agent Jobs, not by the scheduler that passes it on
                for host, port in ADDRESS.findall(str(e.get("value", ""))):
                    parts = host.split(".")
                    service = next((p for p in reversed(parts) if p in services), None)
                    assert service, f"{where} {c['name']} {e['name']}: {host} is no Service of the render"
                    out.append((f"{where} {c['name']} {e['name']}", ep, service, int(port)))
    return out


@pytest.mark.parametrize("name", NAMES)
def test_every_configured_address_is_reachable(name):
    render = chart.render(name)
    policies = render.of_kind("NetworkPolicy")
    problems = []
    flows = dialled(render)
    assert flows, "no pod dials a Service?"
    for where, src, service, port in flows:
        targets = _service_targets(render, service, port)
        if not targets:
            problems.append(f"{where}: Service/{service} selects no pod")
        for dst_where, dst, container_port in targets:
            if dst == src:
                continue  # its own Service (the gateway's public URL is for agents, not for itself)
            if not policy.connection_allowed(policies, src, dst, container_port):
                problems.append(f"{where} -> {service}:{port} ({dst_where}:{container_port}) is blocked")
    assert problems == []


@pytest.mark.parametrize("name", NAMES)
def test_every_pod_resolves_names(name):
    render = chart.render(name)
    policies = render.of_kind("NetworkPolicy")
    problems = [
        f"{where}: DNS {proto} blocked"
        for where, _t, ep in pods(render)
        for proto in ("UDP", "TCP")
        if not policy.connection_allowed(policies, ep, DNS, 53, proto)
    ]
    assert problems == []


@pytest.mark.parametrize("name", NAMES)
def test_nccl_between_ranks_and_to_inference_on_any_port(name):
    """NCCL opens ephemeral ports: trainer<->trainer and trainer<->inference pass on any port, both ways
    (a weight push over NCCL connects in both directions)."""
    render = chart.render(name)
    policies = render.of_kind("NetworkPolicy")
    by_component: dict[str, list[policy.Endpoint]] = {}
    for _w, _t, ep in pods(render):
        by_component.setdefault(ep.labels.get(COMPONENT, ""), []).append(ep)
    problems = []
    for a, b in (("trainer", "trainer"), ("trainer", "inference"), ("inference", "trainer")):
        for src in by_component.get(a, []):
            for dst in by_component.get(b, []):
                if not policy.connection_allowed(policies, src, dst, NCCL_PORT):
                    problems.append(f"{a} -> {b}:{NCCL_PORT} blocked")
    assert problems == []


@pytest.mark.parametrize("name", NAMES)
def test_prometheus_scrapes_every_metrics_port(name):
    render = chart.render(name)
    policies = render.of_kind("NetworkPolicy")
    problems = []
    for where, _t, ep in pods(render):
        for port_name in ("metrics",):
            if port_name in ep.ports and not policy.connection_allowed(
                policies, PROMETHEUS, ep, ep.ports[port_name]
            ):
                problems.append(f"{where}: Prometheus -> {port_name} ({ep.ports[port_name]}) blocked")
    assert problems == []


@pytest.mark.parametrize("name", NAMES)
def test_the_api_server_is_reached_only_by_the_pods_that_use_it(name):
    """The scheduler when scheduler.kubernetes.enabled; the run host when its runs discover the
    inference replicas (policy.kube_api_user); no other pod."""
    render = chart.render(name)
    policies = render.of_kind("NetworkPolicy")
    values = chart.effective_values(name)
    api = policy.Endpoint(ip="10.96.0.1")
    for where, _t, ep in pods(render):
        reaches = policy.connection_allowed(policies, ep, api, 443) or policy.connection_allowed(
            policies, ep, api, 6443
        )
        uses = policy.kube_api_user(values, ep.labels.get(COMPONENT, ""))
        if uses is not None:
            assert reaches == uses, where
        else:
            assert not reaches, f"{where} reaches the API server"


def test_kube_api_cidrs_narrow_the_schedulers_egress():
    """With networkPolicy.kubeApi.cidrs set, the scheduler reaches the API server's addresses on its
    ports and no other address."""
    vs = chart.value_set("agents-as-jobs")
    cidrs = ["10.96.0.1/32", "172.18.0.2/32"]
    values = chart.merge(vs.values, {"networkPolicy": {"kubeApi": {"cidrs": cidrs}}})
    render = chart.render_values(values, vs.kube_versions[0])
    policies = render.of_kind("NetworkPolicy")
    (sched,) = [ep for _w, _t, ep in pods(render) if ep.labels.get(COMPONENT) == "scheduler"]
    assert policy.connection_allowed(policies, sched, policy.Endpoint(ip="10.96.0.1"), 443)
    assert policy.connection_allowed(policies, sched, policy.Endpoint(ip="172.18.0.2"), 6443)
    assert not policy.connection_allowed(policies, sched, policy.Endpoint(ip="10.96.0.2"), 443)
    assert not policy.connection_allowed(policies, sched, policy.Endpoint(ip="172.18.0.2"), 80)


def test_agent_jobs_reach_the_gateway_and_nothing_else():
    name = "agents-as-jobs"
    render = chart.render(name)
    policies = render.of_kind("NetworkPolicy")
    job = agent_job_pod(name)
    reachable = []
    for _where, _t, ep in pods(render):
        for port in set(ep.ports.values()) | {NCCL_PORT}:
            if policy.connection_allowed(policies, job, ep, port):
                reachable.append((ep.labels.get(COMPONENT), port))
    assert reachable == [("gateway", 8000)]
    assert policy.connection_allowed(policies, job, DNS, 53, "UDP")
    # The user's extraEgress (203.0.113.0/24:443) and nothing more outside.
    assert policy.connection_allowed(policies, job, policy.Endpoint(ip="203.0.113.9"), 443)
    assert not policy.connection_allowed(policies, job, policy.Endpoint(ip="198.51.100.1"), 443)
    # Nobody reaches into an agent Job.
    for where, _t, ep in pods(render):
        assert not policy.connection_allowed(policies, ep, job, 8080), where


@pytest.mark.parametrize("name", NAMES)
def test_redis_is_reached_only_by_the_services_that_use_it(name):
    """Only pods configured with the Redis URL reach Redis (the trainer and inference never do)."""
    render = chart.render(name)
    policies = render.of_kind("NetworkPolicy")
    users = {
        src.labels.get(COMPONENT) for _w, src, service, _p in dialled(render) if service.endswith("-redis")
    }
    problems = []
    for _where, _t, ep in pods(render):
        if ep.labels.get(COMPONENT) == "redis":
            for _w2, _t2, src in pods(render):
                if src.labels.get(COMPONENT) not in users and policy.connection_allowed(
                    policies, src, ep, 6379
                ):
                    problems.append(f"{src.labels.get(COMPONENT)} reaches Redis without using it")
    assert problems == []


HUB = policy.Endpoint(ip="192.0.2.10")  # the egress proxy of model-download-from-hub
EXTERNAL_REDIS = policy.Endpoint(ip="10.20.30.40")


def _uses_redis(t: dict[str, Any]) -> bool:
    return any(e["name"] == "TETHER_REDIS_URL" for c in t["spec"]["containers"] for e in c.get("env") or [])


def test_an_external_redis_is_reached_by_its_users_only():
    render = chart.render("redis-external")
    policies = render.of_kind("NetworkPolicy")
    assert not render.of_kind("StatefulSet") or all(
        (o["metadata"].get("labels") or {}).get(COMPONENT) != "redis" for o in render.of_kind("StatefulSet")
    ), "an in-chart Redis next to the external one"
    problems = []
    for where, t, ep in pods(render):
        reaches = policy.connection_allowed(policies, ep, EXTERNAL_REDIS, 6379)
        if reaches != _uses_redis(t):
            problems.append(f"{where}: uses Redis {_uses_redis(t)}, reaches it {reaches}")
    assert problems == []


@pytest.mark.parametrize("name", ["model-download-from-hub", "cpu-demo"])
def test_only_the_pods_that_download_the_model_reach_the_hub(name):
    """modelDownloadEgress opens the hub to the pods whose init container downloads the model; the
    demo's model is prepared offline and opens nothing."""
    render = chart.render(name)
    policies = render.of_kind("NetworkPolicy")
    values = chart.effective_values(name)
    configured = bool(values["networkPolicy"]["modelDownloadEgress"])
    problems = []
    downloaders = 0
    for where, t, ep in pods(render):
        downloads = any(c["name"] == "model-download" for c in t["spec"].get("initContainers") or [])
        downloaders += downloads
        if ep.labels.get(COMPONENT) == "scheduler" and not values["networkPolicy"]["kubeApi"]["cidrs"]:
            continue  # reaches any address on 443: the API server's, unless kubeApi.cidrs narrows it
        reaches = policy.connection_allowed(policies, ep, HUB, 443)
        if reaches != (downloads and configured):
            problems.append(f"{where}: downloads {downloads}, reaches the hub {reaches}")
    assert downloaders, "no pod downloads the model"
    assert problems == []


def test_the_hub_token_is_a_mounted_file():
    """The Hugging Face token reaches the download as a file from its Secret, never as an env value."""
    render = chart.render("model-download-from-hub")
    for where, t, _ep in pods(render):
        for c in t["spec"].get("initContainers") or []:
            if c["name"] != "model-download":
                continue
            env = {e["name"]: e for e in c.get("env") or []}
            assert "HF_TOKEN" not in env, where
            path = env["HF_TOKEN_PATH"]["value"]
            mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts") or []}
            mount = next((n for p, n in mounts.items() if path.startswith(p.rstrip("/") + "/")), None)
            assert mount, f"{where}: {path} is on no mount"
            (vol,) = [v for v in t["spec"]["volumes"] if v["name"] == mount]
            assert vol["secret"]["secretName"] == "hf-token", where
