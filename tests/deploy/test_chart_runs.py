"""Several runs on one deployment (runs.enabled; docs/runs.md) as rendered: inference serves the runs'
LoRA adapters and the trainer trains them at one rank; the run host (`python -m tether.runhost`) is one
pod that never overlaps another, wired exactly as the scheduler and the merger are, every address it
dials a real port of the right pods; its NetworkPolicy lets through exactly what its runs' services
dial and nothing reaches it but Prometheus. Off by default, it leaves no trace. (Refusals:
tests/deploy/values/bad/runs-*.yaml; its PodMonitor: test_chart_monitoring.py.)"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import pytest

from deploy import chart, policy

GOOD = chart.good_sets()
RUNS = [s.name for s in GOOD if chart.effective_values(s.name)["runs"]["enabled"]]
OFF = [s.name for s in GOOD if s.name not in RUNS]
COMPONENT = "app.kubernetes.io/component"
RUNHOST = f"{chart.FULLNAME}-runhost"
NS_LABELS = {"kubernetes.io/metadata.name": chart.NAMESPACE}
DNS, PROMETHEUS, NCCL_PORT = policy.DNS, policy.PROMETHEUS, policy.NCCL_PORT
# What the run host dials -> (the container that serves it, the variable that container listens on).
DIALLED = {
    "TETHER_TRAINER_ADDRESS": ("trainer", "TETHER_TRAINER_GRPC_PORT"),
    "TETHER_INFERENCE_ADDRESS": ("inference", "TETHER_INFERENCE_GRPC_PORT"),
    "TETHER_GATEWAY_CONTROL_ADDRESS": ("gateway", "TETHER_GATEWAY_GRPC_PORT"),
    "TETHER_GATEWAY_URL": ("gateway", "TETHER_GATEWAY_PORT"),
    "TETHER_REDIS_URL": ("redis", None),
}
# Given to the run host exactly as the scheduler gets them (its runs' schedulers dial the same).
AS_THE_SCHEDULER = (
    "TETHER_SERVICE_TOKEN",
    "TETHER_LOG_LEVEL",
    "TETHER_REDIS_PASSWORD",
    "TETHER_REDIS_URL",
    "TETHER_NAMESPACE",
    "TETHER_TRAINER_ADDRESS",
    "TETHER_INFERENCE_ADDRESS",
    "TETHER_GATEWAY_CONTROL_ADDRESS",
)


def test_there_are_value_sets_with_runs():
    """One on CPUs with its own pods, one with inference and trainer in one GPU pod (the policies
    differ), and the default sets without."""
    assert len(RUNS) >= 2 and OFF
    assert {chart.effective_values(n)["gpuSharing"]["mode"] for n in RUNS} >= {"none", "pod"}


def env_of(c: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in c.get("env") or []}


def value(c: dict[str, Any], name: str) -> str | None:
    e = env_of(c).get(name)
    return None if e is None else e.get("value")


def containers(render: chart.Render, name: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(pod template, container) of every container with that name."""
    return [(t, c) for _w, t in render.pod_templates() for c in t["spec"]["containers"] if c["name"] == name]


def runhost(render: chart.Render) -> tuple[dict[str, Any], dict[str, Any]]:
    ((t, c),) = containers(render, "runhost")
    return t, c


@pytest.mark.parametrize("name", RUNS)
def test_one_run_host_that_never_overlaps_another(name):
    """Two run hosts would start every run twice: one replica, Recreate (the old pod is gone before the
    new one starts), and no value changes either (runs.replicas is refused: bad/runs-replicas.yaml).
    Nothing dials it, so it has no Service (as the agent worker, which also serves health and metrics
    only); it runs the tether image's `python -m tether.runhost`, as the merger runs its module."""
    render = chart.render(name)
    dep = render.get("Deployment", RUNHOST)
    assert dep["spec"]["replicas"] == 1
    assert dep["spec"]["strategy"] == {"type": "Recreate"}
    templates = [w for w, t in render.pod_templates() if t["metadata"]["labels"].get(COMPONENT) == "runhost"]
    assert templates == [f"Deployment/{RUNHOST} spec.template"]
    assert not [
        o for o in render.of_kind("Service", "PodDisruptionBudget") if o["metadata"]["name"] == RUNHOST
    ]
    _t, c = runhost(render)
    ((_mt, merger),) = containers(render, "merger")
    assert c["command"] == ["python", "-m", "tether.runhost"]
    assert c["image"] == merger["image"]


@pytest.mark.parametrize("name", RUNS)
def test_inference_serves_and_the_trainer_trains_the_runs_adapters(name):
    """vLLM gets LoRA serving for runs.maxRuns adapters of runs.loraRank, and the trainer LoRA of the
    same rank: a run's adapter versions load into vLLM's slots."""
    render = chart.render(name)
    runs = chart.effective_values(name)["runs"]
    inference = containers(render, "inference")
    trainers = containers(render, "trainer")
    assert inference and trainers
    for _t, c in inference:
        assert value(c, "TETHER_MAX_RUNS") == str(runs["maxRuns"])
        assert value(c, "TETHER_LORA_RANK") == str(runs["loraRank"])
    for _t, c in trainers:
        assert value(c, "TETHER_LORA_RANK") == str(runs["loraRank"])


@pytest.mark.parametrize("name", RUNS)
def test_the_trainer_and_the_gateway_share_by_one_policy(name):
    """runs.sharing goes to the trainer (whose step) and to every gateway pod (whose waiting call), and
    runs.maxConcurrentCalls to the gateway (docs/runs.md, "Sharing vLLM"); another value set says so."""
    for patch in ({}, {"runs": {"sharing": "weighted", "maxConcurrentCalls": 6}}):
        vs = chart.value_set(name)
        values = chart.merge(vs.values, patch)
        runs = chart.merge(chart.effective_values(name), patch)["runs"]
        render = chart.render_values(values, vs.kube_versions[0], vs.api_versions)
        gateways, trainers = containers(render, "gateway"), containers(render, "trainer")
        assert gateways and trainers
        for _t, c in trainers:
            assert value(c, "TETHER_RUN_SHARING") == runs["sharing"]
            assert "TETHER_RUN_MAX_CONCURRENT" not in env_of(c)
        for _t, c in gateways:
            assert value(c, "TETHER_RUN_SHARING") == runs["sharing"]
            assert value(c, "TETHER_RUN_MAX_CONCURRENT") == str(runs["maxConcurrentCalls"])


@pytest.mark.parametrize(("field", "bad"), [("sharing", "fifo"), ("maxConcurrentCalls", -1)])
def test_the_schema_refuses_a_sharing_the_services_would_refuse(field, bad):
    vs = chart.value_set("runs-cpu")
    values = chart.merge(vs.values, {"runs": {field: bad}})
    said = chart.refusal(values, vs.kube_versions[0], vs.api_versions)
    assert said is not None and field in said


@pytest.mark.parametrize("name", OFF)
def test_without_runs_nothing_of_them_is_rendered(name):
    """runs.enabled false: no run host, no policy or monitor naming it, vLLM without LoRA serving, and
    the trainer's rank is trainer.loraRank (unless the run config sets it)."""
    render = chart.render(name)
    assert "runhost" not in render.text()
    values = chart.effective_values(name)
    for _t, c in containers(render, "inference"):
        assert "TETHER_MAX_RUNS" not in env_of(c) and "TETHER_LORA_RANK" not in env_of(c)
    for _t, c in containers(render, "gateway") + containers(render, "trainer"):
        assert "TETHER_RUN_SHARING" not in env_of(c) and "TETHER_RUN_MAX_CONCURRENT" not in env_of(c)
    if "lora_rank" not in (values["runConfig"].get("trainer") or {}):
        for _t, c in containers(render, "trainer"):
            assert value(c, "TETHER_LORA_RANK") == str(values["trainer"]["loraRank"])


def test_a_trainer_rank_equal_to_the_runs_is_accepted():
    """trainer.loraRank may say the runs' rank again; the run config may too, and may set sleep 0."""
    vs = chart.value_set("runs-cpu")
    rank = chart.effective_values("runs-cpu")["runs"]["loraRank"]
    patch = {
        "trainer": {"loraRank": rank},
        "runConfig": {"trainer": {"lora_rank": rank}, "scheduler": {"sleep_level": 0}},
    }
    values = chart.merge(vs.values, patch)
    assert chart.refusal(values, vs.kube_versions[0], vs.api_versions) is None
    render = chart.render_values(values, vs.kube_versions[0], vs.api_versions)
    for _t, c in containers(render, "trainer"):
        assert value(c, "TETHER_LORA_RANK") == str(rank)


@pytest.mark.parametrize("name", RUNS)
def test_the_run_host_is_wired_as_the_scheduler_and_the_merger(name):
    """Its interface: Redis, the base namespace (where the registry lives), the service token and the
    trainer's, inference's and the gateway control's addresses exactly as the scheduler gets them; the
    model as the merger mounts it (its runs' mergers read the tokenizer); the gateway's in-cluster URL
    as the agent worker gets it; its own gRPC health and metrics on the ports it declares; the run
    settings from runs.*."""
    render = chart.render(name)
    values = chart.effective_values(name)
    t, c = runhost(render)
    ((st, sched),) = containers(render, "scheduler")
    ((mt, merger),) = containers(render, "merger")
    env = env_of(c)
    for key in AS_THE_SCHEDULER:
        assert env.get(key) == env_of(sched).get(key), key
    assert env["TETHER_NAMESPACE"]["value"] == values["run"]["redisNamespace"]
    assert env["TETHER_MODEL_DIR"] == env_of(merger)["TETHER_MODEL_DIR"]
    assert value(c, "TETHER_GATEWAY_URL") == f"http://{chart.FULLNAME}-gateway:8000"
    for _at, agent in containers(render, "agent"):
        assert value(c, "TETHER_GATEWAY_URL") == value(agent, "TETHER_GATEWAY_URL")

    mounts = {m["name"]: m for m in c["volumeMounts"]}
    merger_mounts = {m["name"]: m for m in merger["volumeMounts"]}
    volumes = {v["name"]: v for v in t["spec"]["volumes"]}
    merger_volumes = {v["name"]: v for v in mt["spec"]["volumes"]}
    if "models" in merger_mounts:
        assert mounts["models"] == merger_mounts["models"] and volumes["models"] == merger_volumes["models"]
    assert t["spec"].get("initContainers") == mt["spec"].get("initContainers")

    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"grpc": 50057, "metrics": 9107}
    assert value(c, "TETHER_RUNHOST_GRPC_HOST") == "0.0.0.0"
    assert value(c, "TETHER_RUNHOST_GRPC_PORT") == str(ports["grpc"])
    assert value(c, "TETHER_METRICS_PORT") == str(ports["metrics"])
    runs = values["runs"]
    assert value(c, "TETHER_RUNHOST_AGENT_WORKERS") == str(runs["agentWorkers"])
    assert value(c, "TETHER_RUNHOST_HEALTH_TIMEOUT_S") == str(runs["healthTimeoutSeconds"])
    assert c["resources"] == runs["resources"]
    assert t["spec"]["terminationGracePeriodSeconds"] == runs["terminationGracePeriodSeconds"]
    # It talks to the API server only when its runs discover the inference replicas, under its own
    # identity (tests/test_kube_rbac.py: its Role and its TETHER_KUBE_* settings).
    discovers = policy.kube_api_user(values, "runhost")
    assert t["spec"]["automountServiceAccountToken"] is discovers
    assert (value(c, "TETHER_KUBE_ENABLED") == "true") is discovers
    assert t["spec"]["serviceAccountName"] == f"{chart.FULLNAME}-runhost" != st["spec"]["serviceAccountName"]


@pytest.mark.parametrize("name", RUNS)
def test_the_runs_folders_are_writable_and_the_adapters_readable(name):
    """TETHER_RUNS_DIR (each run's metrics.jsonl, config.yaml and logs) is the runs volume, writable:
    runs.storage.existingClaim, else an emptyDir of runs.storage.sizeLimit. The checkpoint volume is
    mounted read-only where the trainer writes it: a run's scheduler copies its last adapter version
    (a folder the trainer names under /checkpoints) into the run's final-model."""
    render = chart.render(name)
    storage = chart.effective_values(name)["runs"]["storage"]
    t, c = runhost(render)
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in t["spec"]["volumes"]}
    runs = mounts[value(c, "TETHER_RUNS_DIR")]
    assert not runs.get("readOnly")
    if storage["existingClaim"]:
        assert volumes[runs["name"]]["persistentVolumeClaim"] == {"claimName": storage["existingClaim"]}
    else:
        assert volumes[runs["name"]]["emptyDir"] == {"sizeLimit": storage["sizeLimit"]}
    checkpoints = mounts["/checkpoints"]
    assert checkpoints["readOnly"] is True
    ((tt, trainer), *_) = containers(render, "trainer")
    (written,) = [m for m in trainer["volumeMounts"] if m["mountPath"] == "/checkpoints"]
    trainer_volumes = {v["name"]: v for v in tt["spec"]["volumes"]}
    claim = trainer_volumes[written["name"]]["persistentVolumeClaim"]["claimName"]
    assert volumes[checkpoints["name"]]["persistentVolumeClaim"]["claimName"] == claim
    assert value(trainer, "TETHER_CHECKPOINT_DIR") == "/checkpoints"


def _address(text: str) -> tuple[str, int]:
    """(host, port) of an address as the services take them: a URL, `dns:host:port` or `host:port`."""
    if "://" in text:
        parts = urlsplit(text)
        assert parts.hostname and parts.port, text
        return parts.hostname, parts.port
    host, port = text.removeprefix("dns:").rsplit(":", 1)
    return host, int(port)


@pytest.mark.parametrize("name", RUNS)
def test_every_address_the_run_host_dials_is_a_port_the_right_container_listens_on(name):
    """Each address resolves to a Service of the render and one of its ports, whose target port is
    declared by the container that serves it in every pod the Service selects, and is the port that
    container is told to listen on."""
    render = chart.render(name)
    _t, c = runhost(render)
    services = {s["metadata"]["name"]: s for s in render.of_kind("Service")}
    problems = []
    for key, (serving, listen) in DIALLED.items():
        host, port = _address(value(c, key) or "")
        svc_name = next((p for p in reversed(host.split(".")) if p in services), None)
        if svc_name is None:
            problems.append(f"{key}: {host} is no Service of the render")
            continue
        svc = services[svc_name]["spec"]
        (sp,) = [p for p in svc["ports"] if p["port"] == port] or [None]
        if sp is None:
            problems.append(f"{key}: Service/{svc_name} has no port {port}")
            continue
        target = sp.get("targetPort", port)
        pods = [
            (w, t)
            for w, t in render.pod_templates()
            if policy.label_selector_matches({"matchLabels": svc["selector"]}, t["metadata"]["labels"])
        ]
        if not pods:
            problems.append(f"{key}: Service/{svc_name} selects no pod")
        for w, t in pods:
            served = [x for x in t["spec"]["containers"] if x["name"] == serving]
            declared = [
                p["containerPort"]
                for x in served
                for p in x.get("ports") or []
                if p.get("name") == target or p["containerPort"] == target
            ]
            if len(declared) != 1:
                problems.append(f"{key}: {w} container {serving} declares no port {target!r}")
                continue
            if listen and value(served[0], listen) != str(declared[0]):
                problems.append(
                    f"{key}: {w} {serving} listens on {value(served[0], listen)}, not {declared[0]}"
                )
    assert problems == []


def _endpoints(render: chart.Render) -> list[policy.Endpoint]:
    out = []
    for _w, t in render.pod_templates():
        ports = {p["name"]: p["containerPort"] for c in t["spec"]["containers"] for p in c.get("ports") or []}
        out.append(policy.Endpoint(t["metadata"]["labels"], chart.NAMESPACE, NS_LABELS, None, ports))
    return out


@pytest.mark.parametrize("name", RUNS)
def test_the_run_host_reaches_exactly_what_its_runs_dial(name):
    """Its runs' schedulers reach the gateway's control gRPC, inference's gRPC (adapter loads) and the
    trainer's; its agent workers the gateway's HTTP; all of them Redis and DNS; the API server only
    when its runs discover the inference replicas (as the scheduler's, on the API's ports). Nothing
    else: no NCCL port, no metrics port, no vLLM HTTP, no other pod, no outside address on another
    port. The trainer's, inference's, the gateway's and Redis's own ingress admit it (connection_allowed
    checks both ends)."""
    render = chart.render(name)
    policies = render.of_kind("NetworkPolicy")
    eps = _endpoints(render)
    (host,) = [e for e in eps if e.labels[COMPONENT] == "runhost"]
    one_pod = chart.effective_values(name)["gpuSharing"]["mode"] == "pod"
    inf, tr = ("colocated", "colocated") if one_pod else ("inference", "trainer")
    reached = {
        (ep.labels[COMPONENT], port)
        for ep in eps
        if ep is not host
        for port in {*ep.ports.values(), NCCL_PORT}
        if policy.connection_allowed(policies, host, ep, port)
    }
    assert reached == {("gateway", 8000), ("gateway", 50051), (inf, 50052), (tr, 50053), ("redis", 6379)}
    assert policy.connection_allowed(policies, host, DNS, 53, "UDP")
    assert policy.connection_allowed(policies, host, DNS, 53, "TCP")
    discovers = policy.kube_api_user(chart.effective_values(name), "runhost")
    for ip, port in (("10.96.0.1", 443), ("10.96.0.1", 6443)):
        assert policy.connection_allowed(policies, host, policy.Endpoint(ip=ip), port) is discovers
    for ip, port in (("203.0.113.9", 80), ("203.0.113.9", 8000)):
        assert not policy.connection_allowed(policies, host, policy.Endpoint(ip=ip), port), (ip, port)


@pytest.mark.parametrize("name", RUNS)
def test_only_prometheus_reaches_the_run_host(name):
    """Nothing of the release dials the run host (its runs' services talk inside the pod); Prometheus
    scrapes its metrics port and nothing else (kubelet's probes need no rule)."""
    render = chart.render(name)
    policies = render.of_kind("NetworkPolicy")
    eps = _endpoints(render)
    (host,) = [e for e in eps if e.labels[COMPONENT] == "runhost"]
    for ep in eps:
        for port in {*host.ports.values(), NCCL_PORT}:
            assert ep is host or not policy.connection_allowed(policies, ep, host, port), (ep.labels, port)
    assert policy.connection_allowed(policies, PROMETHEUS, host, host.ports["metrics"])
    assert not policy.connection_allowed(policies, PROMETHEUS, host, host.ports["grpc"])


def test_with_mtls_the_run_host_probes_its_health_only_port():
    """tls.existingSecret: the run host gets the certificate files and TETHER_TLS_* (it hands them on to
    its children), and kubelet's gRPC probes read its plaintext health-only port, 50057 + 100."""
    vs = chart.value_set("runs-cpu")
    values = chart.merge(vs.values, {"tls": {"existingSecret": "tether-mtls"}})
    render = chart.render_values(values, vs.kube_versions[0], vs.api_versions)
    t, c = runhost(render)
    assert value(c, "TETHER_GRPC_HEALTH_PORT") == "50157"
    assert {p["name"]: p["containerPort"] for p in c["ports"]}["health"] == 50157
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"] == {"port": 50157}, probe
    assert value(c, "TETHER_TLS_CA_FILE") == "/etc/tether/tls/ca.crt"
    assert {"mountPath": "/etc/tether/tls", "name": "tls", "readOnly": True} in c["volumeMounts"]
    assert [v for v in t["spec"]["volumes"] if v["name"] == "tls"][0]["secret"]["secretName"] == "tether-mtls"


@pytest.mark.parametrize("name", RUNS)
def test_notes_say_how_to_create_a_run(name):
    """What `helm install` prints with runs on: the run host, and `tether run create` through a
    port-forwarded gateway with the admin token."""
    notes = next(v for k, v in chart.render(name).manifests.items() if k.endswith("NOTES.txt"))
    assert RUNHOST in notes
    assert f"port-forward svc/{chart.FULLNAME}-gateway 8000:8000" in notes
    assert "tether run create --config" in notes and "--gateway-url http://127.0.0.1:8000" in notes
    if "PodMonitors scrape every component" in notes:
        assert "runhost" in notes.split("PodMonitors scrape every component", 1)[1].split("\n", 1)[0]
