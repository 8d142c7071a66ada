"""Policy checks over Kubernetes objects as plain dicts (what the chart renders, and the Job bodies the
scheduler builds): each returns the list of violations, empty when the object passes.

Pod-level functions take a PodSpec (`template.spec` of a workload, `spec` of a Pod) and never look at
anything else, so the same rule holds the chart's pods and the scheduler's agent Jobs alike. The PSS
list follows the Kubernetes Pod Security Standards "restricted" profile (baseline included) as the
admission controller enforces it; the rest are Tether's own rules (docs in ISSUE13 / DEPLOY.md).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
from collections.abc import Iterable, Iterator
from typing import Any

# PSS restricted: the only volume types a pod may use.
ALLOWED_VOLUME_TYPES = frozenset(
    {
        "configMap",
        "csi",
        "downwardAPI",
        "emptyDir",
        "ephemeral",
        "persistentVolumeClaim",
        "projected",
        "secret",
    }
)
ALLOWED_ADD_CAPABILITIES = frozenset({"NET_BIND_SERVICE"})
ALLOWED_SECCOMP = frozenset({"RuntimeDefault", "Localhost"})
# PSS baseline: the sysctls a pod may set.
SAFE_SYSCTLS = frozenset(
    {
        "kernel.shm_rmid_forced",
        "net.ipv4.ip_local_port_range",
        "net.ipv4.ip_unprivileged_port_start",
        "net.ipv4.tcp_syncookies",
        "net.ipv4.ping_group_range",
        "net.ipv4.ip_local_reserved_ports",
        "net.ipv4.tcp_keepalive_time",
        "net.ipv4.tcp_fin_timeout",
        "net.ipv4.tcp_keepalive_intvl",
        "net.ipv4.tcp_keepalive_probes",
    }
)
ALLOWED_SELINUX_TYPES = frozenset(
    {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
)
# Words that make an environment variable's value a secret: it must come from a Secret (valueFrom) or
# a mounted file, never a literal in the pod spec.
SECRET_WORDS = frozenset({"TOKEN", "PASSWORD", "PASSWD", "KEY", "SECRET", "APIKEY", "CREDENTIALS"})
# ...unless the variable names where the secret lives rather than holding it.
REFERENCE_SUFFIXES = frozenset({"FILE", "PATH", "DIR", "NAME", "REF"})
URL_PASSWORD = re.compile(r"://[^/\s:@]*:([^/\s@]+)@")
VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
SLEEP_EXEC = re.compile(r"(?:^|[\s;&|])sleep\s+(\d+)")


def containers(pod_spec: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every container of the pod with where it sits (`containers[gateway]`, `initContainers[model]`)."""
    for field in ("initContainers", "containers", "ephemeralContainers"):
        for c in pod_spec.get(field) or []:
            yield f"{field}[{c.get('name', '?')}]", c


def _main_containers(pod_spec: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for c in pod_spec.get("containers") or []:
        yield f"containers[{c.get('name', '?')}]", c


def pod_spec_violations(pod_spec: dict[str, Any]) -> list[str]:
    """Pod Security Standards "restricted" (and so "baseline"): what the admission controller would
    refuse in a namespace labelled `pod-security.kubernetes.io/enforce: restricted`."""
    out: list[str] = []
    psc = pod_spec.get("securityContext") or {}
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod_spec.get(field):
            out.append(f"{field}: true")
    for v in pod_spec.get("volumes") or []:
        kinds = [k for k in v if k != "name"]
        for k in kinds:
            if k not in ALLOWED_VOLUME_TYPES:
                out.append(f"volumes[{v.get('name')}]: type {k} is not allowed")
    for s in psc.get("sysctls") or []:
        if s.get("name") not in SAFE_SYSCTLS:
            out.append(f"securityContext.sysctls: {s.get('name')} is not a safe sysctl")
    out += _selinux_violations("securityContext", psc)
    out += _apparmor_violations("securityContext", psc)
    if (psc.get("windowsOptions") or {}).get("hostProcess"):
        out.append("securityContext.windowsOptions.hostProcess: true")

    pod_seccomp = (psc.get("seccompProfile") or {}).get("type")
    if pod_seccomp is not None and pod_seccomp not in ALLOWED_SECCOMP:
        out.append(f"securityContext.seccompProfile.type: {pod_seccomp}")
    if psc.get("runAsUser") == 0:
        out.append("securityContext.runAsUser: 0")

    for where, c in containers(pod_spec):
        sc = c.get("securityContext") or {}
        if sc.get("privileged"):
            out.append(f"{where}.securityContext.privileged: true")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{where}.securityContext.allowPrivilegeEscalation must be false")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"{where}.securityContext.capabilities.drop must contain ALL")
        for cap in caps.get("add") or []:
            if cap not in ALLOWED_ADD_CAPABILITIES:
                out.append(f"{where}.securityContext.capabilities.add: {cap} is not allowed")
        if sc.get("runAsNonRoot", psc.get("runAsNonRoot")) is not True:
            out.append(f"{where}: runAsNonRoot must be true (pod or container)")
        if sc.get("runAsUser") == 0:
            out.append(f"{where}.securityContext.runAsUser: 0")
        seccomp = (sc.get("seccompProfile") or {}).get("type", pod_seccomp)
        if seccomp not in ALLOWED_SECCOMP:
            out.append(
                f"{where}: seccompProfile must be RuntimeDefault or Localhost (pod or container), got {seccomp}"
            )
        if sc.get("procMount") not in (None, "Default"):
            out.append(f"{where}.securityContext.procMount: {sc.get('procMount')}")
        out += _selinux_violations(f"{where}.securityContext", sc)
        out += _apparmor_violations(f"{where}.securityContext", sc)
        if (sc.get("windowsOptions") or {}).get("hostProcess"):
            out.append(f"{where}.securityContext.windowsOptions.hostProcess: true")
        for p in c.get("ports") or []:
            if p.get("hostPort"):
                out.append(
                    f"{where}.ports[{p.get('name', p.get('containerPort'))}]: hostPort {p['hostPort']}"
                )
    return out


def _selinux_violations(where: str, sc: dict[str, Any]) -> list[str]:
    se = sc.get("seLinuxOptions") or {}
    out = []
    if se.get("type", "") not in ALLOWED_SELINUX_TYPES:
        out.append(f"{where}.seLinuxOptions.type: {se['type']}")
    for field in ("user", "role"):
        if se.get(field):
            out.append(f"{where}.seLinuxOptions.{field} must be unset")
    return out


def _apparmor_violations(where: str, sc: dict[str, Any]) -> list[str]:
    kind = (sc.get("appArmorProfile") or {}).get("type")
    if kind is not None and kind not in ("RuntimeDefault", "Localhost"):
        return [f"{where}.appArmorProfile.type: {kind}"]
    return []


def read_only_root_violations(pod_spec: dict[str, Any]) -> list[str]:
    """Every container (init ones too) runs on a read-only root filesystem."""
    return [
        f"{where}.securityContext.readOnlyRootFilesystem must be true"
        for where, c in containers(pod_spec)
        if (c.get("securityContext") or {}).get("readOnlyRootFilesystem") is not True
    ]


def request_violations(pod_spec: dict[str, Any]) -> list[str]:
    """Every container asks the scheduler for cpu and memory (a pod without requests is BestEffort: the
    first one evicted, and invisible to capacity planning)."""
    out = []
    for where, c in containers(pod_spec):
        if where.startswith("ephemeralContainers"):
            continue
        requests = (c.get("resources") or {}).get("requests") or {}
        for resource in ("cpu", "memory"):
            if resource not in requests:
                out.append(f"{where}.resources.requests.{resource} is missing")
    return out


def kube_api_user(values: dict[str, Any], name: str) -> bool | None:
    """Whether the component's pod talks to the Kubernetes API (None: it never does): the scheduler
    when scheduler.kubernetes.enabled; the run host when its runs discover the inference replicas
    (runs.enabled with scheduler.kubernetes.discovery; docs/runs.md, "Serving, beyond one replica")."""
    k = values["scheduler"]["kubernetes"]
    if name == "scheduler":
        return bool(k["enabled"])
    if name == "runhost":
        return bool(values["runs"]["enabled"] and k["enabled"] and k["discovery"])
    return None


def service_account_token_violations(pod_spec: dict[str, Any], *, may_mount: bool = False) -> list[str]:
    """The API token is mounted only where the pod talks to the API (the scheduler, when told to)."""
    mounted = pod_spec.get("automountServiceAccountToken")
    if may_mount:
        return []
    if mounted is not False:
        return [f"automountServiceAccountToken must be false, got {mounted!r}"]
    return []


def image_violations(pod_spec: dict[str, Any]) -> list[str]:
    """Images are pinned (a tag other than `latest`, or a digest) and pulled IfNotPresent."""
    out = []
    for where, c in containers(pod_spec):
        image = c.get("image") or ""
        name, _, digest = image.partition("@")
        last = name.rsplit("/", 1)[-1]
        tag = last.partition(":")[2]
        if not image:
            out.append(f"{where}: no image")
        elif digest:
            if not re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
                out.append(f"{where}: malformed digest in {image}")
        elif not tag:
            out.append(f"{where}: image {image} has neither tag nor digest")
        if tag == "latest":
            out.append(f"{where}: image {image} uses latest")
        if c.get("imagePullPolicy") != "IfNotPresent":
            out.append(f"{where}: imagePullPolicy {c.get('imagePullPolicy')!r}, want IfNotPresent")
    return out


def _probes(c: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        if c.get(kind):
            yield kind, c[kind]


def probe_violations(pod_spec: dict[str, Any]) -> list[str]:
    """HTTP and TCP probes name a port the container declares; gRPC probes (the API takes only a number
    there) use the number of a port the container declares. A probe on a port nobody listens on fails
    only on the cluster, after the rollout."""
    out = []
    for where, c in _main_containers(pod_spec):
        names = {p.get("name") for p in c.get("ports") or [] if p.get("name")}
        numbers = {p.get("containerPort") for p in c.get("ports") or []}
        for kind, probe in _probes(c):
            for handler in ("httpGet", "tcpSocket"):
                if handler in probe:
                    port = probe[handler].get("port")
                    if not isinstance(port, str):
                        out.append(f"{where}.{kind}.{handler}.port {port!r} is a number, want a port name")
                    elif port not in names:
                        out.append(f"{where}.{kind}.{handler}.port {port!r} is not a port of the container")
            if "grpc" in probe and probe["grpc"].get("port") not in numbers:
                out.append(
                    f"{where}.{kind}.grpc.port {probe['grpc'].get('port')!r} is not a port of the container"
                )
    return out


def _is_secret_name(name: str) -> bool:
    words = [w for w in re.split(r"[_\-.]", name.upper()) if w]
    if not words or words[-1] in REFERENCE_SUFFIXES:
        return False
    return any(w in SECRET_WORDS for w in words)


def env_violations(pod_spec: dict[str, Any]) -> list[str]:
    """No secret as a literal value: a secret-like name (TOKEN, PASSWORD, KEY, ... as a word) takes its
    value from a Secret, and a URL's password is a `$(VAR)` of a variable that does (defined earlier in
    the list: the kubelet expands only those, and leaves a later one as the literal text)."""
    out = []
    for where, c in containers(pod_spec):
        from_secret: set[str] = set()
        for e in c.get("env") or []:
            name, value = e.get("name", ""), e.get("value")
            if "secretKeyRef" in (e.get("valueFrom") or {}):
                from_secret.add(name)
            if value in (None, ""):
                continue
            if _is_secret_name(name):
                out.append(f"{where}.env[{name}] is a literal value (use valueFrom.secretKeyRef)")
            for password in URL_PASSWORD.findall(str(value)):
                ref = VAR_REF.fullmatch(password)
                if not ref:
                    out.append(f"{where}.env[{name}] has a password in a literal URL")
                elif ref.group(1) not in from_secret:
                    out.append(
                        f"{where}.env[{name}]: $({ref.group(1)}) is not a Secret variable defined before it"
                    )
    return out


def gpu_resources(container: dict[str, Any]) -> dict[str, Any]:
    """The GPU-like extended resources a container asks for (limits or requests)."""
    res = container.get("resources") or {}
    found = {}
    for field in ("limits", "requests"):
        for name, qty in (res.get(field) or {}).items():
            if ("gpu" in name.lower() or name.startswith("nvidia.com/")) and str(qty) not in ("0", ""):
                found[name] = qty
    return found


def uses_gpu(pod_spec: dict[str, Any]) -> bool:
    """The pod holds a GPU: an extended GPU resource on a container, or a DRA claim on a container."""
    if pod_spec.get("resourceClaims"):
        return True
    return any(
        gpu_resources(c) or (c.get("resources") or {}).get("claims") for _, c in _main_containers(pod_spec)
    )


def shm_violations(pod_spec: dict[str, Any]) -> list[str]:
    """Every GPU container mounts a memory-backed emptyDir at /dev/shm (NCCL and torch's data loaders
    need more than the runtime's 64 MiB default)."""
    if not uses_gpu(pod_spec):
        return []
    memory_dirs = {
        v["name"]
        for v in pod_spec.get("volumes") or []
        if (v.get("emptyDir") or {}).get("medium") == "Memory"
    }
    out = []
    for where, c in _main_containers(pod_spec):
        if not (gpu_resources(c) or (c.get("resources") or {}).get("claims")):
            continue
        mounts = [m for m in c.get("volumeMounts") or [] if m.get("mountPath") == "/dev/shm"]
        if not any(m.get("name") in memory_dirs for m in mounts):
            out.append(f"{where}: GPU container without a memory emptyDir at /dev/shm")
    return out


def prestop_seconds(container: dict[str, Any]) -> int:
    """The seconds a container's preStop hook sleeps (a `sleep` action, or `sleep N` in an exec)."""
    pre = (container.get("lifecycle") or {}).get("preStop") or {}
    if "sleep" in pre:
        return int(pre["sleep"].get("seconds", 0))
    command = " ".join(str(a) for a in (pre.get("exec") or {}).get("command") or [])
    return sum(int(n) for n in SLEEP_EXEC.findall(command))


def grace_violations(pod_spec: dict[str, Any], *, drain_seconds: int = 0) -> list[str]:
    """The kubelet's grace period outlasts each container's preStop sleep plus its drain: otherwise the
    kubelet kills the process mid-drain and the in-flight requests are lost."""
    grace = pod_spec.get("terminationGracePeriodSeconds", 30)
    out = []
    for where, c in _main_containers(pod_spec):
        need = prestop_seconds(c) + drain_seconds
        if need and grace <= need:
            out.append(
                f"{where}: terminationGracePeriodSeconds {grace} <= preStop {prestop_seconds(c)} + drain {drain_seconds}"
            )
    return out


# Paths a process writes at run time: on a read-only root each must lie on a writable mount (users of
# vLLM on Kubernetes hit `/.cache` permission errors constantly).
WRITABLE_ENV = (
    "HOME",
    "XDG_CACHE_HOME",
    "HF_HOME",
    "VLLM_CACHE_ROOT",
    "TRITON_CACHE_DIR",
    "TORCHINDUCTOR_CACHE_DIR",
    "PROMETHEUS_MULTIPROC_DIR",
    "TMPDIR",
)


def _on_writable_mount(path: str, mounts: list[dict[str, Any]]) -> bool:
    best = max(
        (m for m in mounts if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")),
        key=lambda m: len(m["mountPath"]),
        default=None,
    )
    return best is not None and not best.get("readOnly", False)


def writable_path_violations(pod_spec: dict[str, Any]) -> list[str]:
    """A container on a read-only root has /tmp and every cache its environment names on a writable
    mount."""
    out = []
    for where, c in containers(pod_spec):
        if (c.get("securityContext") or {}).get("readOnlyRootFilesystem") is not True:
            continue
        mounts = c.get("volumeMounts") or []
        env = {e["name"]: e.get("value") for e in c.get("env") or []}
        wanted = {"/tmp": "/tmp"} | {k: env[k] for k in WRITABLE_ENV if env.get(k)}
        for name, path in wanted.items():
            if not str(path).startswith("/"):
                out.append(f"{where}: {name}={path} is not an absolute path")
            elif not _on_writable_mount(str(path), mounts):
                out.append(f"{where}: {name}={path} is on the read-only root")
    return out


def env_reference_violations(pod_spec: dict[str, Any]) -> list[str]:
    """Every `$(VAR)` the kubelet is to expand names a variable it can: for an env value one defined
    earlier in the list, for command and args one defined at all. Otherwise the text stays as it is
    (`$(TETHER_NODE_INDEX)` reaches the program literally) and nothing fails until it runs. `$$(X)` is an
    escape. A container with envFrom is checked for env order only."""
    out = []
    for where, c in containers(pod_spec):
        seen: set[str] = set()
        env = c.get("env") or []
        all_names = {e["name"] for e in env}
        for e in env:
            for ref in VAR_REF.findall(_unescaped(str(e.get("value", "")))):
                if ref not in seen:
                    out.append(f"{where}.env[{e['name']}]: $({ref}) is not defined before it")
            seen.add(e["name"])
        if c.get("envFrom"):
            continue
        for field in ("command", "args"):
            for arg in c.get(field) or []:
                for ref in VAR_REF.findall(_unescaped(str(arg))):
                    # Lower case: a shell's command substitution the kubelet leaves alone ($(hostname)).
                    if ref not in all_names and ref.isupper():
                        out.append(f"{where}.{field}: $({ref}) is no variable of the container")
    return out


def _unescaped(text: str) -> str:
    return text.replace("$$", "")


# --- object-level checks -------------------------------------------------------------------------------

POD_TEMPLATE_KINDS = frozenset({"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"})


def pod_templates(obj: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Each pod template an object carries, as (where, template): workloads, CronJobs, JobSets' jobs."""
    kind = obj.get("kind")
    spec = obj.get("spec") or {}
    if kind in POD_TEMPLATE_KINDS:
        yield "spec.template", spec.get("template") or {}
    elif kind == "CronJob":
        yield (
            "spec.jobTemplate.spec.template",
            ((spec.get("jobTemplate") or {}).get("spec") or {}).get("template") or {},
        )
    elif kind == "Pod":
        yield "", {"metadata": obj.get("metadata") or {}, "spec": spec}
    elif kind == "JobSet":
        for rj in spec.get("replicatedJobs") or []:
            yield (
                f"spec.replicatedJobs[{rj.get('name')}].template.spec.template",
                ((rj.get("template") or {}).get("spec") or {}).get("template") or {},
            )


def label_selector_matches(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    """A metav1.LabelSelector applied to a label set (an empty selector selects everything; a missing
    one selects nothing, as for a NetworkPolicy's peers)."""
    if selector is None:
        return False
    for k, v in (selector.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def network_policy_violations(pod_labels: dict[str, str], policies: Iterable[dict[str, Any]]) -> list[str]:
    """The pod is selected by a NetworkPolicy that governs both its ingress and its egress."""
    types: set[str] = set()
    for p in policies:
        spec = p.get("spec") or {}
        if label_selector_matches(spec.get("podSelector"), pod_labels):
            declared = spec.get("policyTypes") or (
                ["Ingress", "Egress"] if spec.get("egress") else ["Ingress"]
            )
            types.update(declared)
    return [
        f"no NetworkPolicy governs {t} of pods labelled {pod_labels}"
        for t in ("Ingress", "Egress")
        if t not in types
    ]


def surge_violations(obj: dict[str, Any]) -> list[str]:
    """A GPU workload never surges: a surge pod stays Pending on a full GPU pool and the rollout stalls."""
    kind = obj.get("kind")
    out = []
    for _where, template in pod_templates(obj):
        if not uses_gpu(template.get("spec") or {}):
            continue
        if kind == "Deployment":
            strategy = (obj.get("spec") or {}).get("strategy") or {}
            if strategy.get("type") == "Recreate":
                continue
            surge = (strategy.get("rollingUpdate") or {}).get("maxSurge", "25%")
            if str(surge) not in ("0", "0%"):
                out.append(f"{kind}/{obj['metadata']['name']}: GPU Deployment surges (maxSurge {surge!r})")
        elif kind == "DaemonSet":
            surge = ((obj["spec"].get("updateStrategy") or {}).get("rollingUpdate") or {}).get("maxSurge", 0)
            if str(surge) not in ("0", "0%"):
                out.append(f"{kind}/{obj['metadata']['name']}: GPU DaemonSet surges (maxSurge {surge!r})")
    return out


# --- NetworkPolicy semantics: is one connection allowed? ------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Endpoint:
    """One end of a connection: a pod (labels, namespace, its named container ports) or an address
    outside the cluster (ip, no labels)."""

    labels: dict[str, str] = dataclasses.field(default_factory=dict)
    namespace: str = ""
    namespace_labels: dict[str, str] = dataclasses.field(default_factory=dict)
    ip: str | None = None
    ports: dict[str, int] = dataclasses.field(default_factory=dict)


# The cluster's DNS and a Prometheus of the monitoring namespace, as the NetworkPolicy tests meet them,
# and an ephemeral port, as NCCL picks them.
DNS = Endpoint(
    labels={"k8s-app": "kube-dns"},
    namespace="kube-system",
    namespace_labels={"kubernetes.io/metadata.name": "kube-system"},
)
PROMETHEUS = Endpoint(
    labels={"app.kubernetes.io/name": "prometheus"},
    namespace="monitoring",
    namespace_labels={"kubernetes.io/metadata.name": "monitoring"},
)
NCCL_PORT = 43117


def _peer_matches(peer: dict[str, Any], policy_namespace: str, other: Endpoint) -> bool:
    if "ipBlock" in peer:
        if other.ip is None:
            return False
        block = peer["ipBlock"]
        ip = ipaddress.ip_address(other.ip)
        return ip in ipaddress.ip_network(block["cidr"]) and not any(
            ip in ipaddress.ip_network(e) for e in block.get("except") or []
        )
    if other.ip is not None and not other.labels:
        return False  # an address outside the cluster matches ipBlocks only
    ns_selector = peer.get("namespaceSelector")
    in_namespace = (
        other.namespace == policy_namespace
        if ns_selector is None
        else label_selector_matches(ns_selector, other.namespace_labels)
    )
    pod_selector = peer.get("podSelector")
    return in_namespace and (pod_selector is None or label_selector_matches(pod_selector, other.labels))


def _port_matches(
    rule_ports: list[dict[str, Any]] | None, port: int, protocol: str, target: Endpoint
) -> bool:
    if not rule_ports:
        return True
    for p in rule_ports:
        if p.get("protocol", "TCP") != protocol:
            continue
        want = p.get("port")
        if want is None:
            return True
        if isinstance(want, str):
            if target.ports.get(want) == port:
                return True
            continue
        if int(want) <= port <= int(p.get("endPort", want)):
            return True
    return False


def _direction_allows(
    policies: Iterable[dict[str, Any]],
    pod: Endpoint,
    other: Endpoint,
    port: int,
    protocol: str,
    direction: str,
) -> bool:
    """`direction` (Egress from pod to other, or Ingress to pod from other) is allowed: no policy of the
    pod's namespace selects the pod for it, or one of those has a rule matching peer and port."""
    rules_key, peers_key = ("egress", "to") if direction == "Egress" else ("ingress", "from")
    target = other if direction == "Egress" else pod
    selecting = []
    for p in policies:
        spec = p.get("spec") or {}
        if (p.get("metadata") or {}).get("namespace", pod.namespace) != pod.namespace:
            continue
        if not label_selector_matches(spec.get("podSelector"), pod.labels):
            continue
        types = spec.get("policyTypes") or (["Ingress", "Egress"] if "egress" in spec else ["Ingress"])
        if direction in types:
            selecting.append(p)
    if not selecting:
        return True
    for p in selecting:
        ns = (p.get("metadata") or {}).get("namespace", pod.namespace)
        for rule in p["spec"].get(rules_key) or []:
            peers = rule.get(peers_key)
            if peers and not any(_peer_matches(peer, ns, other) for peer in peers):
                continue
            if _port_matches(rule.get("ports"), port, protocol, target):
                return True
    return False


def connection_allowed(
    policies: list[dict[str, Any]], src: Endpoint, dst: Endpoint, port: int, protocol: str = "TCP"
) -> bool:
    """A connection from src to dst's port gets through: src's egress allows it and, when dst is a pod,
    so does dst's ingress (the policies of both namespaces apply, each to its own pods)."""
    if not _direction_allows(policies, src, dst, port, protocol, "Egress"):
        return False
    if dst.ip is not None and not dst.labels:
        return True
    return _direction_allows(policies, dst, src, port, protocol, "Ingress")


# The checks every rendered pod template must pass with no finding (each takes a pod spec).
POD_CHECKS = (
    pod_spec_violations,
    request_violations,
    image_violations,
    probe_violations,
    env_violations,
    shm_violations,
    writable_path_violations,
    env_reference_violations,
)
