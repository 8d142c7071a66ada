"""helm/tether for every value set under tests/deploy/values/: lint (strict), schema, render at two
Kubernetes versions, each object valid there (kubernetes-validate --strict; custom resources against
their CRDs' vendored schemas), the kinds the set promises, and the golden render reviewers diff.

TETHER_UPDATE_GOLDEN=1 rewrites tests/deploy/golden/ from the current chart."""

from __future__ import annotations

import os
import re

import helm_python
import pytest

from deploy import chart
from deploy.validate import api_server_violations, kube_violations

GOOD = chart.good_sets()
NAMES = [s.name for s in GOOD]
AT_VERSIONS = [pytest.param(s.name, v, id=f"{s.name}@{v}") for s in GOOD for v in s.kube_versions]
UPDATE = os.environ.get("TETHER_UPDATE_GOLDEN") == "1"


def test_the_chart_is_what_the_other_code_expects():
    meta = chart.chart_metadata()
    assert (meta["name"], meta["version"], meta["appVersion"]) == ("tether", "0.1.0", "0.1.0")
    assert meta["kubeVersion"] == ">=1.29.0-0"
    assert chart.schema() is not None, "values.schema.json is missing"


def test_every_good_set_is_checked_at_two_kubernetes_versions():
    for vs in GOOD:
        assert len(set(vs.kube_versions)) >= 2, vs.name
        for v in vs.kube_versions:
            assert re.fullmatch(r"1\.\d+\.\d+", v), (vs.name, v)
    assert len(GOOD) >= 9


@pytest.mark.parametrize("name,version", AT_VERSIONS)
def test_helm_lint_strict(name, version):
    report = chart.lint(name, version)
    # Severity 1 is INFO ("icon is recommended"); strict lint fails on warnings (2) and errors (3).
    problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
    assert problems == []


@pytest.mark.parametrize("name", NAMES)
def test_values_pass_the_schema(name):
    chart.validate_schema(chart.value_set(name).values)


@pytest.mark.parametrize("name,version", AT_VERSIONS)
def test_every_object_is_valid_at_the_kubernetes_version(name, version):
    vs = chart.value_set(name)
    render = chart.render(name, version, vs.api_versions)
    assert render.objects, "the render is empty"
    problems = [
        f"{o['kind']}/{o.get('metadata', {}).get('name')}: {p}"
        for o in render.objects
        for p in kube_violations(o, version)
    ]
    assert problems == []


@pytest.mark.parametrize("name", NAMES)
def test_the_render_holds_the_kinds_the_set_promises(name):
    vs = chart.value_set(name)
    kinds = {o["kind"] for o in chart.render(name).objects}
    assert set(vs.words("expect-kinds")) <= kinds, f"missing {set(vs.words('expect-kinds')) - kinds}"
    assert not set(vs.words("expect-no-kinds")) & kinds, (
        f"unexpected {set(vs.words('expect-no-kinds')) & kinds}"
    )


# Objects that belong to one component carry its label (shared ones, e.g. the workloads' ServiceAccount,
# need not).
COMPONENT_KINDS = {
    "Deployment",
    "StatefulSet",
    "Job",
    "JobSet",
    "Service",
    "PodDisruptionBudget",
    "PodMonitor",
}


@pytest.mark.parametrize("name", NAMES)
def test_every_object_is_named_and_labelled_for_the_release(name):
    """tether.labels on every object: `kubectl get all -l app.kubernetes.io/instance=<release>` finds the
    whole release, and `tether.dev/run` finds a run's objects."""
    problems = []
    for o in chart.render(name).objects:
        meta = o.get("metadata") or {}
        labels = meta.get("labels") or {}
        where = f"{o['kind']}/{meta.get('name')}"
        if not str(meta.get("name", "")).startswith(chart.FULLNAME):
            problems.append(f"{where}: name does not start with {chart.FULLNAME}")
        want = {
            "app.kubernetes.io/name": "tether",
            "app.kubernetes.io/instance": chart.RELEASE,
            "app.kubernetes.io/part-of": "tether",
            "app.kubernetes.io/managed-by": "Helm",
            "helm.sh/chart": "tether-0.1.0",
            "tether.dev/run": str(chart.effective_values(name)["run"]["id"]),
        }
        for k, v in want.items():
            if labels.get(k) != v:
                problems.append(f"{where}: label {k}={labels.get(k)!r}, want {v!r}")
        if o["kind"] in COMPONENT_KINDS and "app.kubernetes.io/component" not in labels:
            problems.append(f"{where}: no component label")
    assert problems == []


@pytest.mark.parametrize("name", NAMES)
def test_golden_render(name):
    text = chart.render(name).golden(full_dashboards=name == chart.FULL_DASHBOARDS)
    path = chart.GOLDEN / f"{name}.yaml"
    if UPDATE:
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"no golden render: TETHER_UPDATE_GOLDEN=1 writes {path.relative_to(chart.ROOT)}"
    # Compared exactly: a change to the chart shows up as a diff of these files in review.
    assert text == path.read_text(), (
        f"{path.name} differs: rerun with TETHER_UPDATE_GOLDEN=1 and review the diff"
    )


def test_no_golden_render_without_its_value_set():
    stale = {p.stem for p in chart.GOLDEN.glob("*.yaml")} - set(NAMES)
    assert not stale, f"golden renders of removed value sets: {sorted(stale)}"


def test_renders_are_reproducible():
    """Two renders of one set are identical (no random password, no timestamp): the goldens and GitOps
    diffs depend on it."""
    vs = GOOD[0]
    first = chart.render_values(vs.values, vs.kube_versions[0], vs.api_versions).text()
    assert first == chart.render(vs.name).text()


def test_monitoring_auto_follows_the_cluster_and_true_renders_without_it():
    """auto renders the PodMonitors and PrometheusRule exactly when monitoring.coreos.com/v1 is served;
    true renders them with no Capabilities (helm template, GitOps)."""
    present = chart.value_set("monitoring-crds-present")
    kinds = {o["kind"] for o in chart.render(present.name, None, ()).objects}
    assert not {"PodMonitor", "PrometheusRule"} & kinds, "auto rendered without the CRDs"
    kinds = {o["kind"] for o in chart.render("gitops-no-capabilities", None, ()).objects}
    assert {"PodMonitor", "PrometheusRule"} <= kinds


@pytest.mark.parametrize("name", NAMES)
def test_the_api_server_would_accept_every_object(name):
    """What the API server validates beyond the OpenAPI schemas (validate.api_server_violations)."""
    problems = [p for o in chart.render(name).objects for p in api_server_violations(o)]
    assert problems == []


# Helm's longest release name (53 characters) and a long but ordinary one, with "tether" in them so the
# fullname is the release name.
LONGEST_RELEASE = "tether-" + "x" * 46
LONG_RELEASE = "tether-" + "x" * 30


@pytest.mark.parametrize(
    "name", ["gpu-disaggregated-multi-node", "trainer-jobset", "trainer-indexed-job", "agents-as-jobs"]
)
def test_long_release_names_make_valid_names_or_a_clear_refusal(name):
    """Names derived from the release stay within what Kubernetes and its controllers accept (a
    StatefulSet over 52 characters cannot label its revisions, a pod hostname is a DNS label). A
    37-character release renders; Helm's longest (53) renders too, or is refused by a message that
    says the release name is too long (not by a pod that never starts)."""
    vs = chart.value_set(name)
    render = chart.render_values(vs.values, vs.kube_versions[0], vs.api_versions, release=LONG_RELEASE)
    assert [p for o in render.objects for p in api_server_violations(o)] == []
    try:
        render = chart.render_values(vs.values, vs.kube_versions[0], vs.api_versions, release=LONGEST_RELEASE)
    except helm_python.HelmError as e:
        assert re.search(r"release|fullname", str(e), re.IGNORECASE), str(e)
        return
    assert [p for o in render.objects for p in api_server_violations(o)] == []


@pytest.mark.parametrize("name", ["cpu-demo", "gpu-disaggregated-multi-node", "agents-as-jobs"])
def test_notes_say_how_to_point_an_agent_at_the_gateway(name):
    """NOTES.txt (what `helm install` prints) names the gateway's URL, the model to ask for, and where
    the key comes from."""
    render = chart.render(name)
    notes = next(v for k, v in render.manifests.items() if k.endswith("NOTES.txt"))
    values = chart.effective_values(name)
    assert f"http://{chart.FULLNAME}-gateway.{chart.NAMESPACE}:8000" in notes
    assert values["run"]["servedModel"] in notes
    assert "key" in notes.lower()
