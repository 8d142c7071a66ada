"""The validators themselves catch what they claim to (validate.py)."""

from __future__ import annotations

import copy
from typing import Any

from deploy.validate import api_server_violations, crd_violations, kube_violations


def sts(name: str = "rl-tether-trainer", replicas: int = 2) -> dict[str, Any]:
    labels = {"app.kubernetes.io/name": "tether", "app.kubernetes.io/component": "trainer"}
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": name, "labels": dict(labels)},
        "spec": {
            "serviceName": name,
            "replicas": replicas,
            "selector": {"matchLabels": dict(labels)},
            "template": {
                "metadata": {"labels": dict(labels)},
                "spec": {
                    "volumes": [{"name": "tmp", "emptyDir": {}}],
                    "containers": [
                        {
                            "name": "trainer",
                            "image": "tether/trainer:0.1.0",
                            "ports": [{"name": "grpc", "containerPort": 50053}],
                            "env": [{"name": "A", "value": "1"}],
                            "resources": {
                                "requests": {"cpu": "500m", "memory": "1Gi", "nvidia.com/gpu": 1},
                                "limits": {"memory": "2Gi", "nvidia.com/gpu": 1},
                            },
                            "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
                        }
                    ],
                },
            },
        },
    }


def c0(obj: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = obj["spec"]["template"]["spec"]["containers"][0]
    return container


def test_a_valid_statefulset_passes_both():
    assert kube_violations(sts(), "1.29.0") == []
    assert api_server_violations(sts()) == []


def test_kube_violations_at_a_version():
    bad = sts()
    c0(bad)["bogus"] = True
    assert any("bogus" in v for v in kube_violations(bad, "1.34.0"))
    claim = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "g"},
        "spec": {},
    }
    assert kube_violations(claim, "1.34.0") == []
    assert kube_violations(claim, "1.30.0") == [
        "Kubernetes 1.30.0 serves no ResourceClaim in resource.k8s.io/v1"
    ]


def test_api_server_violations_catch_each_rule():
    cases = {
        "name is not valid": lambda o: o["metadata"].update(name="rl-tether-" + "t" * 43),
        "selector does not match": lambda o: o["spec"]["selector"]["matchLabels"].update(x="y"),
        "not a label value": lambda o: o["metadata"]["labels"].update(run="a run"),
        "port name": lambda o: c0(o)["ports"].append({"name": "a-very-long-port-name", "containerPort": 1}),
        "env set twice": lambda o: c0(o)["env"].append({"name": "A", "value": "2"}),
        "no such volume": lambda o: c0(o)["volumeMounts"].append({"name": "cache", "mountPath": "/cache"}),
        "requests.memory 4Gi > limits.memory": lambda o: c0(o)["resources"]["requests"].update(memory="4Gi"),
        "cannot overcommit": lambda o: c0(o)["resources"]["requests"].update({"nvidia.com/gpu": 0}),
        "handlers": lambda o: c0(o).update(livenessProbe={"periodSeconds": 5}),
        "hostname": lambda o: o["metadata"].update(name="x" * 52) or o["spec"].update(replicas=1000000000000),
    }
    for expected, mutate in cases.items():
        obj = copy.deepcopy(sts())
        mutate(obj)
        found = api_server_violations(obj)
        assert any(expected in v for v in found), (expected, found)


def test_crd_schemas_are_strict():
    rule = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "r", "labels": {"release": "x"}},
        "spec": {"groups": [{"name": "g", "rules": [{"alert": "A", "expr": "up == 0", "for": "5m"}]}]},
    }
    assert crd_violations(rule) == []
    typo = copy.deepcopy(rule)
    typo["spec"]["groups"][0]["rules"][0]["fro"] = "5m"
    assert any("fro" in v for v in crd_violations(typo))
    wrong = copy.deepcopy(rule)
    wrong["spec"]["groups"][0]["interval"] = 30
    assert any("interval" in v for v in crd_violations(wrong))
