"""Value combinations no hand-written set covers (hypothesis draws them): the chart either refuses them
with a message that starts at a values path (schema pointer or a `_validate.tpl` rule), never with a
template crash; or it renders objects that pass the core checks. A nil pointer in a template branch
nobody rendered, or a rule that lets a broken combination through, shows up here."""

from __future__ import annotations

import os
import re
from typing import Any

import helm_python
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from deploy import chart, policy
from deploy.validate import render_problems

# What a template crash looks like (as opposed to a `fail` the chart chose).
CRASH = re.compile(
    r"nil pointer|error calling|wrong type|can't evaluate|unable to parse|map has no entry", re.I
)
VALIDATE_FAIL = re.compile(r"execution error at \(tether/templates/[^)]*\): ([A-Za-z][\w.]*)")
SCHEMA_FAIL = re.compile(r"at '(/[^']*)'|at '':")


def _resolves(path: str, values: dict[str, Any]) -> bool:
    node: Any = values
    for key in path.split("."):
        if not isinstance(node, dict) or key not in node:
            return False
        node = node[key]
    return True


@st.composite
def combos(draw: st.DrawFn) -> tuple[dict[str, Any], str]:
    gpu = draw(st.booleans())
    backend = "gpu" if gpu else "cpu"
    jobs = draw(st.booleans())
    values: dict[str, Any] = {
        "secrets": {"existingSecret": "tether-secrets"},
        "run": {
            "mode": draw(st.sampled_from(["colocated-sync", "colocated-async", "disaggregated-async"])),
            "weightPush": draw(st.sampled_from(["checkpoint", "nccl"])),
        },
        "inference": {
            "backend": backend,
            "gpus": draw(st.integers(0, 4)) if gpu else 0,
            "replicas": draw(st.integers(1, 3)),
        },
        "trainer": {
            "backend": draw(st.sampled_from([backend, "cpu"])),
            "nodes": draw(st.integers(1, 3)),
            "gpusPerNode": draw(st.integers(0, 4)),
            "workload": draw(st.sampled_from(["statefulset", "indexedJob", "jobset"])),
        },
        "gpuSharing": {
            "mode": draw(st.sampled_from(["none", "dra", "pod"])),
            "dra": {"count": draw(st.integers(1, 2))},
        },
        "checkpoints": {
            "accessModes": [draw(st.sampled_from(["ReadWriteOnce", "ReadWriteMany"]))],
            "sameNode": draw(st.booleans()),
        },
        "model": draw(
            st.sampled_from(
                [
                    {"source": "download"},
                    {"source": "pvc", "dir": "/models/m", "pvc": {"claimName": "models"}},
                    {"source": "image", "dir": "/opt/model"},
                ]
            )
        ),
        "redis": draw(
            st.sampled_from([{"mode": "internal"}, {"mode": "external", "external": {"existingSecret": "r"}}])
        ),
        "scheduler": {
            "kubernetes": {
                "enabled": draw(st.booleans()) or jobs,
                "discovery": draw(st.booleans()),
                "gangRestart": draw(st.booleans()),
            }
        },
        "agents": {
            "worker": {"enabled": draw(st.booleans())},
            "jobs": {"enabled": jobs, "command": ["tether", "agent-job"] if jobs else []},
        },
        "monitoring": {
            "podMonitors": {"enabled": draw(st.sampled_from(["auto", True, False]))},
            "prometheusRule": {"enabled": draw(st.sampled_from(["auto", True, False]))},
        },
    }
    return values, draw(st.sampled_from(["1.29.0", "1.34.0"]))


def _problems(render: chart.Render, version: str, values: dict[str, Any]) -> list[str]:
    out = render_problems(render, version)
    out += [v for o in render.objects for v in policy.surge_violations(o)]
    policies = render.of_kind("NetworkPolicy")
    for where, t in render.pod_templates():
        labels = (t.get("metadata") or {}).get("labels") or {}
        out += [f"{where}: {v}" for v in policy.network_policy_violations(labels, policies)]
    return out


@settings(
    max_examples=int(os.environ.get("TETHER_COMBINATIONS", "80")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(combos())
def test_any_combination_renders_clean_or_is_refused_at_a_path(combo):
    values, version = combo
    try:
        render = chart.render_values(values, version)
    except helm_python.HelmError as e:
        message = str(e)
        event("refused")
        assert not CRASH.search(message), f"a template crash, not a refusal: {message}"
        rule = VALIDATE_FAIL.search(message)
        if rule:
            assert _resolves(rule.group(1), chart.default_values()), (
                f"refusal names no values path: {message}"
            )
        else:
            assert SCHEMA_FAIL.search(message), f"refusal names no values path: {message}"
        return
    event("rendered")
    assert _problems(render, version, values) == []
