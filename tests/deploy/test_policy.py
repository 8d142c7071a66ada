"""The policy checks themselves: a compliant pod passes each, and each rule catches the pod that breaks
it (a check that cannot fail proves nothing about the chart)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from deploy import policy


def good_pod() -> dict[str, Any]:
    return {
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": 60,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 2000,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "volumes": [
            {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}},
            {"name": "model", "persistentVolumeClaim": {"claimName": "m", "readOnly": True}},
            {"name": "tmp", "emptyDir": {}},
            {"name": "cache", "emptyDir": {}},
        ],
        "containers": [
            {
                "name": "inference",
                "image": "ghcr.io/x/tether-inference:0.1.0",
                "imagePullPolicy": "IfNotPresent",
                "ports": [{"name": "http", "containerPort": 8001}, {"name": "grpc", "containerPort": 50052}],
                "env": [
                    {"name": "TOKENIZERS_PARALLELISM", "value": "false"},
                    {"name": "PORT", "value": "8001"},
                    {"name": "HOME", "value": "/cache"},
                    {"name": "HF_HOME", "value": "/cache/huggingface"},
                    {"name": "TETHER_ADMIN_TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
                    {"name": "TETHER_REDIS_PASSWORD_FILE", "value": "/run/secrets/redis/password"},
                    {"name": "TETHER_REDIS_URL", "value": "redis://:$(TETHER_ADMIN_TOKEN)@redis:6379/0"},
                ],
                "resources": {"requests": {"cpu": "4", "memory": "32Gi"}, "limits": {"nvidia.com/gpu": 2}},
                "securityContext": {
                    "allowPrivilegeEscalation": False,
                    "readOnlyRootFilesystem": True,
                    "capabilities": {"drop": ["ALL"]},
                },
                "startupProbe": {"httpGet": {"path": "/health", "port": "http"}},
                "readinessProbe": {"httpGet": {"path": "/v1/models", "port": "http"}},
                "livenessProbe": {"grpc": {"port": 50052}},
                "lifecycle": {"preStop": {"sleep": {"seconds": 10}}},
                "volumeMounts": [
                    {"name": "shm", "mountPath": "/dev/shm"},
                    {"name": "tmp", "mountPath": "/tmp"},
                    {"name": "cache", "mountPath": "/cache"},
                    {"name": "model", "mountPath": "/models", "readOnly": True},
                ],
                "command": ["/bin/sh", "-c", "exec vllm --port $(PORT) --host $(hostname -i)"],
            }
        ],
    }


def c0(pod: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = pod["containers"][0]
    return container


CHECKS: list[Callable[[dict[str, Any]], list[str]]] = [
    policy.pod_spec_violations,
    policy.read_only_root_violations,
    policy.request_violations,
    policy.service_account_token_violations,
    policy.image_violations,
    policy.probe_violations,
    policy.env_violations,
    policy.shm_violations,
    policy.grace_violations,
    policy.writable_path_violations,
    policy.env_reference_violations,
]


@pytest.mark.parametrize("check", CHECKS, ids=lambda f: f.__name__)
def test_a_compliant_pod_passes(check):
    assert check(good_pod()) == []


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """A mutation: set a dotted path (`c0.` = the first container) to value; None deletes it."""

    def mutate(pod: dict[str, Any]) -> None:
        node = pod
        parts = path.split(".")
        if parts[0] == "c0":
            node, parts = c0(pod), parts[1:]
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        if value is None:
            node.pop(parts[-1], None)
        else:
            node[parts[-1]] = value

    return mutate


BREAKS = {
    "hostNetwork": (policy.pod_spec_violations, _set("hostNetwork", True), "hostNetwork"),
    "hostPID": (policy.pod_spec_violations, _set("hostPID", True), "hostPID"),
    "hostPath volume": (
        policy.pod_spec_violations,
        lambda p: p["volumes"].append({"name": "h", "hostPath": {"path": "/"}}),
        "hostPath",
    ),
    "privileged": (policy.pod_spec_violations, _set("c0.securityContext.privileged", True), "privileged"),
    "privilege escalation unset": (
        policy.pod_spec_violations,
        _set("c0.securityContext.allowPrivilegeEscalation", None),
        "allowPrivilegeEscalation",
    ),
    "capabilities not dropped": (
        policy.pod_spec_violations,
        _set("c0.securityContext.capabilities", {"drop": ["NET_RAW"]}),
        "drop must contain ALL",
    ),
    "capability added": (
        policy.pod_spec_violations,
        _set("c0.securityContext.capabilities", {"drop": ["ALL"], "add": ["SYS_ADMIN"]}),
        "SYS_ADMIN",
    ),
    "runAsNonRoot missing": (
        policy.pod_spec_violations,
        _set("securityContext.runAsNonRoot", None),
        "runAsNonRoot",
    ),
    "runAsNonRoot overridden": (
        policy.pod_spec_violations,
        _set("c0.securityContext.runAsNonRoot", False),
        "runAsNonRoot",
    ),
    "root user": (policy.pod_spec_violations, _set("c0.securityContext.runAsUser", 0), "runAsUser: 0"),
    "seccomp missing": (
        policy.pod_spec_violations,
        _set("securityContext.seccompProfile", None),
        "seccompProfile",
    ),
    "seccomp unconfined": (
        policy.pod_spec_violations,
        _set("c0.securityContext.seccompProfile", {"type": "Unconfined"}),
        "seccompProfile",
    ),
    "hostPort": (policy.pod_spec_violations, lambda p: c0(p)["ports"][0].update(hostPort=80), "hostPort"),
    "unsafe sysctl": (
        policy.pod_spec_violations,
        _set("securityContext.sysctls", [{"name": "kernel.msgmax", "value": "1"}]),
        "kernel.msgmax",
    ),
    "init container escalates": (
        policy.pod_spec_violations,
        lambda p: p.setdefault("initContainers", []).append({"name": "init", "image": "i:1"}),
        "initContainers[init]",
    ),
    "writable root": (
        policy.read_only_root_violations,
        _set("c0.securityContext.readOnlyRootFilesystem", False),
        "readOnlyRootFilesystem",
    ),
    "no memory request": (policy.request_violations, _set("c0.resources.requests", {"cpu": "1"}), "memory"),
    "token mounted by default": (
        policy.service_account_token_violations,
        _set("automountServiceAccountToken", None),
        "automountServiceAccountToken",
    ),
    "latest": (policy.image_violations, _set("c0.image", "ghcr.io/x/tether:latest"), "latest"),
    "no tag": (policy.image_violations, _set("c0.image", "ghcr.io/x/tether"), "neither tag nor digest"),
    "registry port is not a tag": (
        policy.image_violations,
        _set("c0.image", "registry:5000/tether"),
        "neither tag nor digest",
    ),
    "pull Always": (policy.image_violations, _set("c0.imagePullPolicy", "Always"), "IfNotPresent"),
    "probe on a missing port": (
        policy.probe_violations,
        _set("c0.readinessProbe", {"httpGet": {"path": "/", "port": "metrics"}}),
        "'metrics' is not a port",
    ),
    "probe on a number": (
        policy.probe_violations,
        _set("c0.startupProbe", {"httpGet": {"path": "/", "port": 8001}}),
        "want a port name",
    ),
    "grpc probe on a port nobody declares": (
        policy.probe_violations,
        _set("c0.livenessProbe", {"grpc": {"port": 50099}}),
        "50099",
    ),
    "literal token": (
        policy.env_violations,
        lambda p: c0(p)["env"].append({"name": "TETHER_ADMIN_TOKEN", "value": "s3cret"}),
        "TETHER_ADMIN_TOKEN",
    ),
    "literal password in a URL": (
        policy.env_violations,
        lambda p: c0(p)["env"].append({"name": "TETHER_REDIS_URL", "value": "redis://:pw@redis:6379/0"}),
        "TETHER_REDIS_URL",
    ),
    "URL password from a variable defined after it": (
        policy.env_violations,
        lambda p: c0(p)["env"].insert(0, {"name": "U", "value": "redis://:$(TETHER_ADMIN_TOKEN)@r:6379"}),
        "$(TETHER_ADMIN_TOKEN) is not a Secret variable defined before it",
    ),
    "URL password from a literal variable": (
        policy.env_violations,
        lambda p: c0(p)["env"].append({"name": "U", "value": "redis://:$(TOKENIZERS_PARALLELISM)@r:6379"}),
        "$(TOKENIZERS_PARALLELISM)",
    ),
    "cache on the read-only root": (
        policy.writable_path_violations,
        lambda p: c0(p)["env"].append({"name": "VLLM_CACHE_ROOT", "value": "/root/.cache/vllm"}),
        "VLLM_CACHE_ROOT=/root/.cache/vllm",
    ),
    "cache on a read-only mount": (
        policy.writable_path_violations,
        lambda p: c0(p)["env"].append({"name": "TRITON_CACHE_DIR", "value": "/models/triton"}),
        "TRITON_CACHE_DIR=/models/triton",
    ),
    "no /tmp": (
        policy.writable_path_violations,
        lambda p: c0(p)["volumeMounts"].pop(1),
        "/tmp=/tmp",
    ),
    "env reference before its definition": (
        policy.env_reference_violations,
        lambda p: c0(p)["env"].insert(0, {"name": "URL", "value": "http://x:$(PORT)"}),
        "$(PORT) is not defined before it",
    ),
    "command reference to nothing": (
        policy.env_reference_violations,
        lambda p: c0(p)["command"].append("--rank=$(NODE_INDEX)"),
        "$(NODE_INDEX)",
    ),
    "GPU without /dev/shm": (
        policy.shm_violations,
        lambda p: c0(p)["volumeMounts"].pop(0),
        "/dev/shm",
    ),
    "/dev/shm on disk": (
        policy.shm_violations,
        lambda p: p["volumes"].__setitem__(0, {"name": "shm", "emptyDir": {}}),
        "/dev/shm",
    ),
    "grace shorter than preStop": (
        policy.grace_violations,
        _set("terminationGracePeriodSeconds", 10),
        "terminationGracePeriodSeconds 10",
    ),
}


@pytest.mark.parametrize("name", list(BREAKS))
def test_each_rule_catches_the_pod_that_breaks_it(name):
    check, mutate, expected = BREAKS[name]
    pod = copy.deepcopy(good_pod())
    mutate(pod)
    found = check(pod)
    assert any(expected in v for v in found), found


def test_a_dra_claim_makes_a_gpu_pod():
    pod = good_pod()
    c0(pod)["resources"] = {"requests": {"cpu": "1", "memory": "1Gi"}, "claims": [{"name": "gpu"}]}
    pod["resourceClaims"] = [{"name": "gpu", "resourceClaimName": "shared-gpu"}]
    assert policy.uses_gpu(pod)
    c0(pod)["volumeMounts"] = []
    assert policy.shm_violations(pod)


def test_the_scheduler_may_mount_its_token():
    pod = good_pod()
    pod["automountServiceAccountToken"] = True
    assert policy.service_account_token_violations(pod, may_mount=True) == []
    assert policy.service_account_token_violations(pod) != []


def test_grace_counts_the_drain():
    assert policy.grace_violations(good_pod(), drain_seconds=50)
    assert policy.grace_violations(good_pod(), drain_seconds=40) == []


def test_exec_prestop_sleep_counts():
    c = {"lifecycle": {"preStop": {"exec": {"command": ["/bin/sh", "-c", "sleep 15; kill -TERM 1"]}}}}
    assert policy.prestop_seconds(c) == 15


def _deployment(strategy: dict[str, Any] | None, pod: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = {"template": {"metadata": {"labels": {}}, "spec": pod}}
    if strategy is not None:
        spec["strategy"] = strategy
    return {"kind": "Deployment", "metadata": {"name": "inference"}, "spec": spec}


def test_gpu_deployments_never_surge():
    assert policy.surge_violations(_deployment(None, good_pod()))  # the default surges 25%
    assert policy.surge_violations(
        _deployment({"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1}}, good_pod())
    )
    assert policy.surge_violations(_deployment({"type": "Recreate"}, good_pod())) == []
    ok = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
    assert policy.surge_violations(_deployment(ok, good_pod())) == []
    cpu = good_pod()
    c0(cpu)["resources"] = {"requests": {"cpu": "1", "memory": "1Gi"}}
    assert policy.surge_violations(_deployment(None, cpu)) == []


def test_network_policy_coverage():
    labels = {"app.kubernetes.io/name": "tether", "app.kubernetes.io/component": "gateway"}
    deny = {"spec": {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}}
    ingress_only = {"spec": {"podSelector": {"matchLabels": {"app.kubernetes.io/component": "gateway"}}}}
    other = {
        "spec": {
            "podSelector": {
                "matchExpressions": [
                    {"key": "app.kubernetes.io/component", "operator": "In", "values": ["redis"]}
                ]
            },
            "policyTypes": ["Ingress", "Egress"],
        }
    }
    assert policy.network_policy_violations(labels, [deny]) == []
    assert policy.network_policy_violations(labels, [ingress_only]) == [
        f"no NetworkPolicy governs Egress of pods labelled {labels}"
    ]
    assert len(policy.network_policy_violations(labels, [other])) == 2


NS = "tether-ci"


def _pod(component: str, **ports: int) -> policy.Endpoint:
    return policy.Endpoint(
        labels={"app.kubernetes.io/instance": "rl", "app.kubernetes.io/component": component},
        namespace=NS,
        namespace_labels={"kubernetes.io/metadata.name": NS},
        ports=ports,
    )


def _np(selector: dict[str, str], types: list[str], **rules: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": "p", "namespace": NS},
        "spec": {"podSelector": {"matchLabels": selector}, "policyTypes": types, **rules},
    }


DENY = _np({"app.kubernetes.io/instance": "rl"}, ["Ingress", "Egress"])
GATEWAY_TO_REDIS = _np(
    {"app.kubernetes.io/component": "gateway"},
    ["Egress"],
    egress=[
        {
            "to": [{"podSelector": {"matchLabels": {"app.kubernetes.io/component": "redis"}}}],
            "ports": [{"port": 6379}],
        }
    ],
)
REDIS_FROM_GATEWAY = _np(
    {"app.kubernetes.io/component": "redis"},
    ["Ingress"],
    ingress=[
        {
            "from": [{"podSelector": {"matchLabels": {"app.kubernetes.io/component": "gateway"}}}],
            "ports": [{"port": "redis"}],
        }
    ],
)


def test_connections_need_egress_and_ingress():
    gateway, redis = _pod("gateway"), _pod("redis", redis=6379)
    assert policy.connection_allowed([], gateway, redis, 6379)
    assert not policy.connection_allowed([DENY], gateway, redis, 6379)
    assert not policy.connection_allowed([DENY, GATEWAY_TO_REDIS], gateway, redis, 6379)
    assert policy.connection_allowed([DENY, GATEWAY_TO_REDIS, REDIS_FROM_GATEWAY], gateway, redis, 6379)
    assert not policy.connection_allowed([DENY, GATEWAY_TO_REDIS, REDIS_FROM_GATEWAY], gateway, redis, 6380)
    assert not policy.connection_allowed([DENY, GATEWAY_TO_REDIS, REDIS_FROM_GATEWAY], redis, gateway, 6379)
    # A named port resolves against the destination's container ports.
    other = _pod("redis", redis=6380)
    assert not policy.connection_allowed([DENY, GATEWAY_TO_REDIS, REDIS_FROM_GATEWAY], gateway, other, 6379)


def test_peers_outside_the_namespace_and_outside_the_cluster():
    prom = policy.Endpoint(
        labels={"app.kubernetes.io/name": "prometheus"},
        namespace="monitoring",
        namespace_labels={"kubernetes.io/metadata.name": "monitoring"},
    )
    trainer = _pod("trainer", metrics=9103)
    same_ns_only = _np(
        {"app.kubernetes.io/component": "trainer"},
        ["Ingress"],
        ingress=[{"from": [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}]}],
    )
    any_ns = _np(
        {"app.kubernetes.io/component": "trainer"},
        ["Ingress"],
        ingress=[
            {
                "from": [
                    {
                        "namespaceSelector": {},
                        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
                    }
                ],
                "ports": [{"port": 9100, "endPort": 9110}],
            }
        ],
    )
    assert not policy.connection_allowed([same_ns_only], prom, trainer, 9103)
    assert policy.connection_allowed([any_ns], prom, trainer, 9103)
    assert not policy.connection_allowed([any_ns], prom, trainer, 9200)
    outside = policy.Endpoint(ip="203.0.113.7")
    https = _np(
        {"app.kubernetes.io/component": "trainer"},
        ["Egress"],
        egress=[
            {
                "to": [{"ipBlock": {"cidr": "203.0.113.0/24", "except": ["203.0.113.8/32"]}}],
                "ports": [{"port": 443}],
            }
        ],
    )
    assert policy.connection_allowed([https], trainer, outside, 443)
    assert not policy.connection_allowed([https], trainer, policy.Endpoint(ip="203.0.113.8"), 443)
    assert not policy.connection_allowed([https], trainer, _pod("redis"), 443)
    assert policy.connection_allowed(
        [_np({}, ["Egress"], egress=[{"ports": [{"port": 443}]}])], trainer, outside, 443
    )
