"""The chart's runConfig: each recipe (recipes/X.yaml with recipes/helm/X.yaml) renders valid and
restricted, its run config lands unchanged in a ConfigMap mounted at /config in every Tether container
with TETHER_CONFIG set, the chart's own run settings yield to the keys the run config sets, and the pods
roll when it changes. (A run config contradicting a pod-shaping value, or naming an unknown section, is
refused: tests/deploy/values/bad/run-config-*.yaml.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy import chart, policy
from deploy.validate import render_problems

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "recipes" / "helm").glob("*.yaml"))
# Kubernetes 1.34: the Search-R1 recipe shares a GPU in one pod (a pod-scoped DRA claim).
VERSION = "1.34.0"
# The containers that run a Tether service (not Redis, not the model's init container).
SERVICE_CONTAINERS = {"gateway", "merger", "scheduler", "inference", "trainer", "agent", "runhost"}
# Settings the chart sets from the values that shape the pods (_validate.tpl refuses a run config that
# differs from them).
SHAPING = {"mode", "weight_push", "fsdp", "tensor_parallel_size", "served_model"}


def recipe_values(helm_values: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The chart values of a recipe: its Helm values file plus its run config as runConfig (what
    `tether config values` prints), and the run config alone."""
    run = yaml.safe_load((ROOT / "recipes" / helm_values.name).read_text())
    values = yaml.safe_load(helm_values.read_text())
    return {**values, "runConfig": run}, run


def same(got: Any, want: Any) -> bool:
    """Equal, a float also when Helm wrote it as `1e-06`, which YAML 1.1 (PyYAML, the services' reader)
    reads as a string that the settings then parse as the same float."""
    if isinstance(want, dict):
        return (
            isinstance(got, dict) and got.keys() == want.keys() and all(same(got[k], want[k]) for k in want)
        )
    if isinstance(want, float) and isinstance(got, str):
        return float(got) == want
    return bool(got == want)


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value") for e in container.get("env") or []}


def service_containers(render: chart.Render):
    for where, t in render.pod_templates():
        for _, c in policy.containers(t["spec"]):
            if c["name"] in SERVICE_CONTAINERS:
                yield where, t, c


def test_every_recipe_has_its_helm_values():
    names = {p.stem for p in RECIPES}
    assert names == {p.stem for p in (ROOT / "recipes").glob("*.yaml")} - {"calculator-demo"}
    assert len(names) >= 3


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_a_recipe_renders_valid_and_restricted(path):
    values, run = recipe_values(path)
    chart.validate_schema(values)
    render = chart.render_values(values, VERSION)
    assert render_problems(render, VERSION) == []

    cm = render.get("ConfigMap", f"{chart.RELEASE}-tether-run-config")
    assert same(yaml.safe_load(cm["data"]["run.yaml"]), run)  # the file, unchanged
    seen = set()
    for where, t, c in service_containers(render):
        seen.add(c["name"])
        env = env_of(c)
        assert env.get("TETHER_CONFIG") == "/config/run.yaml", (where, c["name"])
        mounts = {m["name"]: m for m in c.get("volumeMounts") or []}
        assert mounts["run-config"]["mountPath"] == "/config" and mounts["run-config"]["readOnly"], where
        volumes = {v["name"]: v for v in t["spec"]["volumes"]}
        assert volumes["run-config"]["configMap"]["name"] == cm["metadata"]["name"], where
        assert "checksum/run-config" in t["metadata"]["annotations"], where
        # What the run config sets for this service, the chart does not set from its values.
        section = {"agent": "agent"}.get(c["name"], c["name"])
        for key, value in (run.get(section) or {}).items():
            name = f"TETHER_{key.upper()}"
            if key in SHAPING:  # set from the values, which the chart holds equal to the run config
                assert env.get(name) in (None, str(value).lower() if isinstance(value, bool) else str(value))
            else:
                assert name not in env, (where, key)
    assert {"gateway", "merger", "scheduler", "inference", "trainer"} <= seen


def test_without_a_run_config_nothing_changes():
    render = chart.render("cpu-demo")
    assert not [o for o in render.of_kind("ConfigMap") if o["metadata"]["name"].endswith("-run-config")]
    for where, _, c in service_containers(render):
        assert "TETHER_CONFIG" not in env_of(c), where
    trainer = next(c for _, _, c in service_containers(render) if c["name"] == "trainer")
    assert env_of(trainer)["TETHER_LR"] == str(chart.effective_values("cpu-demo")["trainer"]["lr"])


def test_a_changed_run_config_rolls_the_pods():
    values, _ = recipe_values(RECIPES[0])
    before = chart.render_values(values, VERSION)
    values["runConfig"]["trainer"]["lr"] = 2.0e-6
    after = chart.render_values(values, VERSION)

    def checksums(render):
        return {
            w: t["metadata"]["annotations"]["checksum/run-config"] for w, t, _ in service_containers(render)
        }

    a, b = checksums(before), checksums(after)
    assert a.keys() == b.keys() and all(a[k] != b[k] for k in a)
