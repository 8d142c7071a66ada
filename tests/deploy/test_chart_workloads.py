"""What the rendered workloads must agree on beyond their schemas: GPUs and vLLM's tensor-parallel size,
torchrun and the trainer's pods, the rank-0 address everyone dials, DRA claims that exist, probes sized
from maxLoadSeconds, and the drain each service is told about."""

from __future__ import annotations

import re
import shlex
import subprocess
from typing import Any

import pytest

from deploy import chart, policy

GOOD = chart.good_sets()
NAMES = [s.name for s in GOOD]
COMPONENT = "app.kubernetes.io/component"
TRAINER_KINDS = ("StatefulSet", "Job", "JobSet")


def containers_named(name: str, container: str) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(where, container, pod spec) of every container with that name in the set's render."""
    out = []
    for where, t in chart.render(name).pod_templates():
        for c in t["spec"].get("containers") or []:
            if c["name"] == container:
                out.append((where, c, t["spec"]))
    return out


def env_of(c: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in c.get("env") or []}


def claim_devices(render: chart.Render, pod_spec: dict[str, Any], container: dict[str, Any]) -> int:
    """Devices the container gets through DRA: the counts of the claims it references, resolved to the
    ResourceClaim or ResourceClaimTemplate in the render."""
    total = 0
    by_name = {c["name"]: c for c in pod_spec.get("resourceClaims") or []}
    for ref in (container.get("resources") or {}).get("claims") or []:
        pod_claim = by_name[ref["name"]]
        if "resourceClaimName" in pod_claim:
            spec = render.get("ResourceClaim", pod_claim["resourceClaimName"])["spec"]
        else:
            spec = render.get("ResourceClaimTemplate", pod_claim["resourceClaimTemplateName"])["spec"]["spec"]
        total += sum(int(r["exactly"]["count"]) for r in spec["devices"]["requests"])
    return total


def gpus_of(render: chart.Render, pod_spec: dict[str, Any], c: dict[str, Any], resource: str) -> int:
    limits = (c.get("resources") or {}).get("limits") or {}
    return int(limits.get(resource, 0)) + claim_devices(render, pod_spec, c)


@pytest.mark.parametrize("name", NAMES)
def test_dra_claims_resolve_to_objects_of_the_render(name):
    """Every pod-level resourceClaims entry names a ResourceClaim (or template) the chart renders, and
    every container claim names a pod-level entry."""
    render = chart.render(name)
    problems = []
    for where, t in render.pod_templates():
        spec = t["spec"]
        declared = {c["name"] for c in spec.get("resourceClaims") or []}
        for pc in spec.get("resourceClaims") or []:
            kind = "ResourceClaim" if "resourceClaimName" in pc else "ResourceClaimTemplate"
            target = pc.get("resourceClaimName") or pc.get("resourceClaimTemplateName")
            if not [o for o in render.of_kind(kind) if o["metadata"]["name"] == target]:
                problems.append(f"{where}: {kind}/{target} is not in the render")
        for c in spec.get("containers") or []:
            for ref in (c.get("resources") or {}).get("claims") or []:
                if ref["name"] not in declared:
                    problems.append(
                        f"{where} containers[{c['name']}]: claim {ref['name']} not in resourceClaims"
                    )
    assert problems == []


@pytest.mark.parametrize("name", NAMES)
def test_tensor_parallel_size_is_the_gpu_count(name):
    """inference.gpus is given once: the GPUs each vLLM gets (device plugin or DRA claim) and its
    tensor-parallel size come from it, so they cannot disagree."""
    values = chart.effective_values(name)
    render = chart.render(name)
    problems = []
    for where, c, spec in containers_named(name, "inference"):
        gpus = gpus_of(render, spec, c, values["gpuResourceName"])
        tp = env_of(c).get("TETHER_TENSOR_PARALLEL_SIZE")
        if values["inference"]["backend"] == "cpu":
            if gpus:
                problems.append(f"{where}: {gpus} GPUs on the CPU backend")
            continue
        if gpus != values["inference"]["gpus"] or tp != str(gpus):
            problems.append(
                f"{where}: {gpus} GPUs, tensor-parallel {tp}, inference.gpus {values['inference']['gpus']}"
            )
    assert problems == []


def _trainer_workloads(render: chart.Render) -> list[dict[str, Any]]:
    return [
        o
        for o in render.of_kind(*TRAINER_KINDS)
        if (o["metadata"].get("labels") or {}).get(COMPONENT) in ("trainer", "colocated")
    ]


def _rank_zero_host(obj: dict[str, Any]) -> tuple[str, str, int]:
    """(rank 0's hostname, its subdomain, the number of trainer pods) of a trainer workload, the way
    Kubernetes names them."""
    name, spec = obj["metadata"]["name"], obj["spec"]
    if obj["kind"] == "StatefulSet":
        return f"{name}-0", spec["serviceName"], int(spec.get("replicas", 1))
    if obj["kind"] == "Job":
        assert spec.get("completionMode") == "Indexed", f"Job/{name}: not Indexed (no stable hostnames)"
        pods = int(spec["parallelism"])
        assert int(spec["completions"]) == pods, f"Job/{name}: completions != parallelism"
        return f"{name}-0", spec["template"]["spec"]["subdomain"], pods
    (rjob,) = spec["replicatedJobs"]
    job = rjob["template"]["spec"]
    assert spec["network"]["enableDNSHostnames"] is True
    return (
        f"{name}-{rjob['name']}-0-0",
        spec["network"]["subdomain"],
        int(rjob.get("replicas", 1)) * int(job["parallelism"]),
    )


def _torchrun(c: dict[str, Any]) -> dict[str, str] | None:
    """torchrun's --flag=value options from the trainer container's command, or None without torchrun."""
    text = " ".join(c.get("command") or []) + " " + " ".join(c.get("args") or [])
    if "torchrun" not in text:
        return None
    words = shlex.split(text.split("torchrun", 1)[1].split(";")[0])
    return dict(w[2:].split("=", 1) for w in words if w.startswith("--") and "=" in w)


@pytest.mark.parametrize("name", NAMES)
def test_torchrun_matches_the_trainer_pods(name):
    """--nnodes is the number of trainer pods, --nproc-per-node the GPUs each has, the rendezvous is
    rank 0 under a headless Service that publishes not-ready addresses, with is_host and --local-addr
    set (c10d's hostname heuristics fail on Kubernetes)."""
    values = chart.effective_values(name)
    render = chart.render(name)
    problems = []
    for obj in _trainer_workloads(render):
        host, subdomain, pods = _rank_zero_host(obj)
        where = f"{obj['kind']}/{obj['metadata']['name']}"
        for _w, t in policy.pod_templates(obj):
            for c in t["spec"]["containers"]:
                if c["name"] != "trainer":
                    continue
                args = _torchrun(c)
                if pods == 1 and args is None:
                    continue
                if args is None:
                    problems.append(f"{where}: {pods} trainer pods without torchrun")
                    continue
                gpus = gpus_of(render, t["spec"], c, values["gpuResourceName"])
                want = {
                    "nnodes": str(pods),
                    "nproc-per-node": str(gpus if values["trainer"]["backend"] == "gpu" else 1),
                    "rdzv-backend": "c10d",
                    "rdzv-endpoint": f"{host}.{subdomain}:{values['trainer']['rdzv']['port']}",
                }
                for k, v in want.items():
                    if args.get(k) != v:
                        problems.append(f"{where}: --{k}={args.get(k)}, want {v}")
                if "is_host=" not in args.get("rdzv-conf", ""):
                    problems.append(f"{where}: no is_host in --rdzv-conf")
                if not args.get("local-addr"):
                    problems.append(f"{where}: no --local-addr")
        svc = render.get("Service", subdomain)["spec"]
        if svc.get("clusterIP") != "None" or svc.get("publishNotReadyAddresses") is not True:
            problems.append(f"Service/{subdomain}: not headless with publishNotReadyAddresses")
    assert problems == []


def test_the_multi_node_sets_run_torchrun():
    for name in ("gpu-disaggregated-multi-node", "trainer-indexed-job", "trainer-jobset"):
        (obj,) = _trainer_workloads(chart.render(name))
        assert _rank_zero_host(obj)[2] > 1, name


TRAINER_ADDRESS = re.compile(r"([a-z0-9.-]*-trainer[a-z0-9.-]*):50053")


@pytest.mark.parametrize("name", NAMES)
def test_everyone_dials_rank_zero(name):
    """Scheduler, merger and inference reach the trainer's gRPC at rank 0's stable DNS name, whatever
    workload runs the trainer (StatefulSet, Indexed Job and JobSet name their pods differently)."""
    render = chart.render(name)
    trainers = _trainer_workloads(render)
    if not trainers:
        return
    host, subdomain, _ = _rank_zero_host(trainers[0])
    allowed = {f"{host}.{subdomain}", "127.0.0.1", "localhost"}
    problems = []
    for where, t in render.pod_templates():
        for c in t["spec"].get("containers") or []:
            for e in c.get("env") or []:
                for dialled in TRAINER_ADDRESS.findall(str(e.get("value", ""))):
                    if dialled not in allowed:
                        problems.append(
                            f"{where} {c['name']} {e['name']}: {dialled}, want {host}.{subdomain}"
                        )
    assert problems == []


def _startup_budget(c: dict[str, Any]) -> int:
    probe = c.get("startupProbe") or {}
    return int(probe.get("periodSeconds", 10)) * int(probe.get("failureThreshold", 3)) + int(
        probe.get("initialDelaySeconds", 0)
    )


@pytest.mark.parametrize("max_load", [900, 2400])
def test_the_startup_probe_waits_for_max_load_seconds(max_load):
    """One value, maxLoadSeconds, sizes the startup probes of vLLM and the trainer (a model load or
    compile longer than the probe's budget restarts the pod forever)."""
    vs = chart.value_set("gpu-disaggregated-multi-node")
    values = chart.merge(vs.values, {"maxLoadSeconds": max_load})
    render = chart.render_values(values, vs.kube_versions[0])
    found = [
        (c["name"], _startup_budget(c))
        for _w, t in render.pod_templates()
        for c in t["spec"]["containers"]
        if c["name"] in ("inference", "trainer")
    ]
    assert {n for n, _b in found} == {"inference", "trainer"}
    assert all(max_load <= budget <= max_load + 60 for _n, budget in found), found


@pytest.mark.parametrize("name", NAMES)
def test_every_service_is_told_its_drain(name):
    """The drain the grace period was sized for (shutdown.drainSeconds) reaches the processes that
    drain: the gateway's TETHER_SHUTDOWN_GRACE_S and vLLM's --shutdown-timeout (its default, 0, aborts
    every in-flight request on SIGTERM); the trainer's TETHER_DRAIN_S (the step in hand) is the rest of
    its own grace."""
    drain = str(chart.effective_values(name)["shutdown"]["drainSeconds"])
    problems = []
    for where, c, _spec in containers_named(name, "gateway"):
        if env_of(c).get("TETHER_SHUTDOWN_GRACE_S") != drain:
            problems.append(f"{where}: TETHER_SHUTDOWN_GRACE_S {env_of(c).get('TETHER_SHUTDOWN_GRACE_S')!r}")
    for where, c, _spec in containers_named(name, "inference"):
        extra = shlex.split(env_of(c).get("TETHER_VLLM_EXTRA_ARGS", ""))
        given = [extra[i + 1] for i, w in enumerate(extra[:-1]) if w == "--shutdown-timeout"]
        given += [w.split("=", 1)[1] for w in extra if w.startswith("--shutdown-timeout=")]
        if given != [drain]:
            problems.append(f"{where}: vLLM --shutdown-timeout {given}, want [{drain}]")
    # The trainer's step in hand may use all of its own grace but preStop and the margin.
    v = chart.effective_values(name)
    trainer_drain = v["trainer"]["terminationGracePeriodSeconds"] - sum(
        v["shutdown"][k] for k in ("preStopSeconds", "marginSeconds")
    )
    trainers = containers_named(name, "trainer")
    assert trainers
    for where, c, _spec in trainers:
        if env_of(c).get("TETHER_DRAIN_S") != str(trainer_drain) or trainer_drain < int(drain):
            problems.append(
                f"{where}: TETHER_DRAIN_S {env_of(c).get('TETHER_DRAIN_S')!r}, want {trainer_drain}"
            )
    assert problems == []


@pytest.mark.parametrize("name", NAMES)
def test_runtime_class_only_when_asked(name):
    """runtimeClassName stays unset unless a value names one (a wrong class leaves pods Pending)."""
    values = chart.effective_values(name)
    asked = {values["inference"]["runtimeClassName"], values["trainer"]["runtimeClassName"]} - {""}
    used = {t["spec"].get("runtimeClassName") for _w, t in chart.render(name).pod_templates()} - {None}
    assert used <= asked


GRPC_SERVICES = {"merger": 50054, "scheduler": 50055, "agent": 50056, "runhost": 50057}


@pytest.mark.parametrize("name", NAMES)
def test_probes_understand_rl_states(name):
    """vLLM: startup and readiness wait for /v1/models, liveness asks /health (200 while vLLM sleeps
    or takes a weight push); no probe on the adapter's gRPC health, which says NOT_SERVING during a
    weight load. The gateway probes /health (200 while admission is paused). The gRPC services use
    gRPC-native probes on their own port (with mTLS, on its health-only port: port + 100,
    tests/deploy/test_chart_tls.py)."""
    problems = []
    shift = 100 if chart.effective_values(name)["tls"]["existingSecret"] else 0
    for where, t in chart.render(name).pod_templates():
        for c in t["spec"]["containers"]:
            probes = {k: c.get(k) or {} for k in ("startupProbe", "readinessProbe", "livenessProbe")}
            got = {
                k: (p.get("httpGet") or {}).get("path") or ("grpc" if "grpc" in p else None)
                for k, p in probes.items()
            }
            if c["name"] == "inference":
                want = {
                    "startupProbe": "/v1/models",
                    "readinessProbe": "/v1/models",
                    "livenessProbe": "/health",
                }
            elif c["name"] == "gateway":
                want = {k: "/health" for k in probes}
            elif c["name"] == "ui":
                want = {k: "/healthz" for k in probes}  # the one route open without the admin token
            elif c["name"] in GRPC_SERVICES:
                want = {k: "grpc" for k in probes}
                ports = {p["grpc"]["port"] for p in probes.values() if "grpc" in p}
                if ports != {GRPC_SERVICES[c["name"]] + shift}:
                    problems.append(f"{where} {c['name']}: gRPC probes on {ports}")
            else:
                continue
            if got != want:
                problems.append(f"{where} {c['name']}: probes {got}, want {want}")
    assert problems == []


def _claim_of(t: dict[str, Any], claim: str) -> bool:
    return any(
        (v.get("persistentVolumeClaim") or {}).get("claimName") == claim
        for v in t["spec"].get("volumes") or []
    )


@pytest.mark.parametrize("name", [n for n in NAMES if chart.effective_values(n)["checkpoints"]["sameNode"]])
def test_a_read_write_once_checkpoint_volume_pins_its_readers_to_the_trainer(name):
    """checkpoints.sameNode: every pod besides the trainer that mounts the RWO checkpoint claim must
    be scheduled onto the trainer's node (required podAffinity on kubernetes.io/hostname), or it stays
    in ContainerCreating with a Multi-Attach error."""
    render = chart.render(name)
    claim = f"{chart.FULLNAME}-checkpoints"
    writers = ("trainer", "colocated")
    trainer_labels = [
        (t.get("metadata") or {}).get("labels") or {}
        for _w, t in render.pod_templates()
        if ((t.get("metadata") or {}).get("labels") or {}).get("app.kubernetes.io/component") in writers
    ]
    assert trainer_labels
    problems = []
    for where, t in render.pod_templates():
        labels = (t.get("metadata") or {}).get("labels") or {}
        if labels.get("app.kubernetes.io/component") in writers or not _claim_of(t, claim):
            continue
        terms = (
            ((t["spec"].get("affinity") or {}).get("podAffinity") or {}).get(
                "requiredDuringSchedulingIgnoredDuringExecution"
            )
        ) or []
        pinned = any(
            term.get("topologyKey") == "kubernetes.io/hostname"
            and all(policy.label_selector_matches(term.get("labelSelector"), tl) for tl in trainer_labels)
            for term in terms
        )
        if not pinned:
            problems.append(f"{where}: mounts {claim} (RWO) without required podAffinity to the trainer")
    assert problems == []


def _hostname(obj: dict[str, Any], index: int) -> str:
    """Pod `index`'s hostname as Kubernetes sets it for the workload kind."""
    name = obj["metadata"]["name"]
    if obj["kind"] == "JobSet":
        return f"{name}-{obj['spec']['replicatedJobs'][0]['name']}-0-{index}"
    return f"{name}-{index}"


def _expand(text: str, env: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion (unknown names stay as written)."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), text)


def _pod_env(c: dict[str, Any], obj: dict[str, Any], index: int) -> dict[str, str]:
    """The container's env in pod `index`: literal values expanded in order, the downward API fields
    the trainer uses resolved as the kubelet would."""
    pod_name = (
        _hostname(obj, index) if obj["kind"] == "StatefulSet" else f"{obj['metadata']['name']}-{index}-x7k2p"
    )
    fields = {
        "metadata.name": pod_name,
        "metadata.labels['apps.kubernetes.io/pod-index']": str(index) if obj["kind"] == "StatefulSet" else "",
        "metadata.labels['batch.kubernetes.io/job-completion-index']": str(index)
        if obj["kind"] != "StatefulSet"
        else "",
        "status.podIP": f"10.0.0.{index + 10}",
    }
    env: dict[str, str] = {}
    for e in c.get("env") or []:
        if "value" in e:
            env[e["name"]] = _expand(str(e["value"]), env)
        elif "fieldRef" in (e.get("valueFrom") or {}):
            env[e["name"]] = fields.get(e["valueFrom"]["fieldRef"]["fieldPath"], "?")
    return env


@pytest.mark.parametrize("name", ["gpu-disaggregated-multi-node", "trainer-indexed-job", "trainer-jobset"])
def test_each_rank_advertises_its_own_dns_name_and_only_rank_zero_hosts(name):
    """In pod i, after the kubelet's expansion, --local-addr is pod i's own stable DNS name and the
    rendezvous is hosted (is_host=1) by pod 0 alone."""
    render = chart.render(name)
    (obj,) = _trainer_workloads(render)
    _host0, subdomain, pods = _rank_zero_host(obj)
    (_w, template), *_ = policy.pod_templates(obj)
    (c,) = [c for c in template["spec"]["containers"] if c["name"] == "trainer"]
    command = [*(c.get("command") or []), *(c.get("args") or [])]
    assert command[:2] == ["/bin/sh", "-c"], command
    for index in range(pods):
        env = _pod_env(c, obj, index)
        script = _expand(command[2], env)
        # Run the container's own shell script with torchrun swapped for echo: what it would start.
        shown = subprocess.run(
            ["/bin/sh", "-c", script.replace("exec torchrun", "exec echo torchrun"), *command[3:]],
            env={"PATH": "/usr/bin:/bin", **env},
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert shown.returncode == 0, shown.stderr
        args = _torchrun({"command": [shown.stdout]}) or {}
        assert args.get("local-addr") == f"{_hostname(obj, index)}.{subdomain}", (
            index,
            args.get("local-addr"),
        )
        conf = dict(kv.split("=", 1) for kv in args.get("rdzv-conf", "").split(","))
        assert conf.get("is_host") == ("1" if index == 0 else "0"), (index, conf)


@pytest.mark.parametrize("name", NAMES)
def test_the_ui_is_behind_the_admin_token(name):
    """`tether ui` (ui.enabled) gets the admin token from the Secret key the gateway's admin routes use,
    never a literal; reads the run's Redis as the services do (TETHER_REDIS_URL from tether.redisEnv, not
    on its command line); carries no service token (it talks no gRPC); and is a ClusterIP Service on
    8900 for `kubectl port-forward`."""
    render = chart.render(name)
    uis = containers_named(name, "ui")
    if not chart.effective_values(name)["ui"]["enabled"]:
        assert uis == [] and not [o for o in render.objects if o["metadata"]["name"].endswith("-ui")]
        return
    [(where, ui, _)] = uis
    gateway = containers_named(name, "gateway")[0][1]

    def token(c: dict[str, Any]) -> dict[str, Any]:
        [env] = [e for e in c["env"] if e["name"] == "TETHER_ADMIN_TOKEN"]
        return env

    assert token(ui) == token(gateway) and "value" not in token(ui), where
    assert (
        token(ui)["valueFrom"]["secretKeyRef"]["key"]
        == chart.effective_values(name)["secrets"]["adminTokenKey"]
    )
    names = [e["name"] for e in ui["env"]]
    assert "TETHER_SERVICE_TOKEN" not in names and {"TETHER_REDIS_URL", "TETHER_NAMESPACE"} <= set(names)
    assert ui["command"][:2] == ["tether", "ui"] and "--redis-url" not in ui["command"]
    assert ui["command"][ui["command"].index("--host") + 1] == "0.0.0.0"  # refused without the token
    service = render.get("Service", f"{chart.FULLNAME}-ui")["spec"]
    assert service["type"] == "ClusterIP" and [p["port"] for p in service["ports"]] == [8900]


def test_the_ui_can_be_turned_off():
    """ui.enabled false: no Deployment, Service or NetworkPolicy of the ui."""
    values = chart.merge(chart.value_set("cpu-demo").values, {"ui": {"enabled": False}})
    render = chart.render_values(values)
    assert not [o for o in render.objects if o["metadata"]["name"].endswith("-ui")]
