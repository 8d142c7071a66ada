"""Observability as rendered: PodMonitors that scrape every metrics port of every pod (the colocated
pod's too) under compose's job names with component and run kept, the PrometheusRule equal to
alerts/tether-alerts.yaml and valid for promtool, and the dashboards as grafana_dashboard ConfigMaps
equal to dashboards/*.json."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy import chart, policy

GOOD = chart.good_sets()
NAMES = [s.name for s in GOOD]
MONITORING_ON = {"monitoring": {"podMonitors": {"enabled": True}, "prometheusRule": {"enabled": True}}}
COMPOSE_PROMETHEUS = chart.ROOT / "docker" / "prometheus" / "prometheus.yml"
# Jobs whose series carry their own run label, which the pod's may not overwrite: the trainer's (the
# policy a series is of) and the run host's (the hosted run a service belongs to).
OWN_RUN_JOBS = {"trainer", "runhost"}


def with_monitoring(name: str) -> chart.Render:
    vs = chart.value_set(name)
    return chart.render_values(chart.merge(vs.values, MONITORING_ON), vs.kube_versions[0], vs.api_versions)


def _scraped(render: chart.Render) -> set[tuple[str, str]]:
    """(pod where, port name) of every pod port some PodMonitor endpoint scrapes."""
    out = set()
    for where, t in render.pod_templates():
        labels = (t.get("metadata") or {}).get("labels") or {}
        ports = {p["name"] for c in t["spec"]["containers"] for p in c.get("ports") or [] if "name" in p}
        for pm in render.of_kind("PodMonitor"):
            if policy.label_selector_matches(pm["spec"]["selector"], labels):
                out |= {
                    (where, e["port"]) for e in pm["spec"]["podMetricsEndpoints"] if e.get("port") in ports
                }
    return out


@pytest.mark.parametrize("name", NAMES)
def test_every_metrics_port_is_scraped(name):
    """Each pod's `metrics` port (vLLM's own metrics sit on `http` of inference) is an endpoint of a
    PodMonitor that selects the pod: per-pod series for replicas and ranks, no Service needed."""
    render = with_monitoring(name)
    scraped = _scraped(render)
    missing = []
    for where, t in render.pod_templates():
        for c in t["spec"]["containers"]:
            for p in c.get("ports") or []:
                wanted = p.get("name") == "metrics" or (c["name"] == "inference" and p.get("name") == "http")
                if wanted and (where, p["name"]) not in scraped:
                    missing.append(f"{where} {c['name']}:{p['name']}")
    assert missing == []


def _relabel_targets(endpoint: dict[str, Any]) -> dict[str, Any]:
    return {r.get("targetLabel"): r for r in endpoint.get("relabelings") or [] if r.get("targetLabel")}


def test_podmonitors_use_composes_job_names_and_keep_component_and_run():
    """The alerts and dashboards are shared with compose: the same job names, and every series keeps the
    pod's component label and, but for the trainer's (which carry their own: the policy they are of),
    its run label (relabelled from the pod's labels)."""
    compose = yaml.safe_load(COMPOSE_PROMETHEUS.read_text())
    compose_jobs = {j["job_name"] for j in compose["scrape_configs"]}
    jobs = set()
    # The run host's job is there with runs.enabled only.
    monitors = [*with_monitoring("gpu-disaggregated-multi-node").of_kind("PodMonitor")]
    monitors += [
        p
        for p in with_monitoring("runs-cpu").of_kind("PodMonitor")
        if p["metadata"]["name"].endswith("runhost")
    ]
    for pm in monitors:
        for e in pm["spec"]["podMetricsEndpoints"]:
            targets = _relabel_targets(e)
            jobs.add(targets["job"]["replacement"])
            assert targets["component"]["sourceLabels"] == [
                "__meta_kubernetes_pod_label_app_kubernetes_io_component"
            ]
            if targets["job"]["replacement"] in OWN_RUN_JOBS:
                assert "run" not in targets, e
            else:
                assert targets["run"]["sourceLabels"] == ["__meta_kubernetes_pod_label_tether_dev_run"]
    assert jobs == compose_jobs


def test_the_prometheus_rule_is_the_alerts_file():
    render = with_monitoring("cpu-demo")
    (rule,) = render.of_kind("PrometheusRule")
    alerts = yaml.safe_load((chart.CHART / "alerts" / "tether-alerts.yaml").read_text())
    assert rule["spec"]["groups"] == alerts["groups"]


def test_promtool_accepts_the_rendered_rules(tmp_path):
    from promtool import promtool

    (rule,) = with_monitoring("cpu-demo").of_kind("PrometheusRule")
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    proc = subprocess.run(
        [str(promtool()), "check", "rules", str(path)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_dashboards_are_the_files_labelled_for_the_grafana_sidecar():
    render = chart.render("cpu-demo")
    labels = chart.effective_values("cpu-demo")["monitoring"]["dashboards"]["labels"]
    found = {}
    for cm in render.of_kind("ConfigMap"):
        if (cm["metadata"].get("labels") or {}).get("grafana_dashboard") is None:
            continue
        assert labels.items() <= cm["metadata"]["labels"].items()
        for key, text in cm["data"].items():
            found[key] = json.loads(text)
    files = {p.name: json.loads(p.read_text()) for p in sorted((chart.CHART / "dashboards").glob("*.json"))}
    assert found == files


def test_dashboards_can_be_turned_off():
    vs = chart.value_set("cpu-demo")
    render = chart.render_values(chart.merge(vs.values, {"monitoring": {"dashboards": {"enabled": False}}}))
    assert not [
        cm
        for cm in render.of_kind("ConfigMap")
        if "grafana_dashboard" in (cm["metadata"].get("labels") or {})
    ]


def test_monitoring_false_renders_nothing_even_with_the_crds():
    vs = chart.value_set("monitoring-crds-present")
    off = {"monitoring": {"podMonitors": {"enabled": False}, "prometheusRule": {"enabled": False}}}
    render = chart.render_values(chart.merge(vs.values, off), vs.kube_versions[0], vs.api_versions)
    assert not render.of_kind("PodMonitor", "PrometheusRule")


def test_no_rendered_file_is_forgotten():
    """Every dashboard and the alerts file the chart ships are rendered (a new dashboards/*.json is
    picked up without a template change)."""
    render = with_monitoring("cpu-demo")
    rendered = {k for cm in render.of_kind("ConfigMap") for k in (cm.get("data") or {})}
    assert {p.name for p in (chart.CHART / "dashboards").glob("*.json")} <= rendered
    assert Path(chart.CHART / "alerts" / "tether-alerts.yaml").exists()


def relabel(labels: dict[str, str], rules: list[dict[str, Any]]) -> dict[str, str] | None:
    """Prometheus' relabelling (replace, keep, drop) of one target's labels; None when dropped."""
    out = dict(labels)
    for r in rules:
        action = r.get("action", "replace")
        value = r.get("separator", ";").join(out.get(s, "") for s in r.get("sourceLabels") or [])
        m = re.fullmatch(r.get("regex", "(.*)"), value)
        if action == "keep" and not m:
            return None
        if action == "drop" and m:
            return None
        if action == "replace" and m:
            out[r["targetLabel"]] = m.expand(r.get("replacement", "$1").replace("$", "\\"))
    return out


def _meta_labels(pod_labels: dict[str, str]) -> dict[str, str]:
    return {
        "__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", k): v for k, v in pod_labels.items()
    }


INDEX_LABEL = {
    "StatefulSet": "apps.kubernetes.io/pod-index",
    "Job": "batch.kubernetes.io/job-completion-index",
    "JobSet": "batch.kubernetes.io/job-completion-index",
}


@pytest.mark.parametrize("name", ["gpu-disaggregated-multi-node", "trainer-indexed-job", "trainer-jobset"])
def test_the_trainer_is_scraped_on_rank_zero_only_with_component_and_its_own_run(name):
    """Only pod 0 serves the trainer's metrics: the PodMonitor keeps it and drops the other ranks
    (which would be down targets and fire TetherTargetDown), whatever labels the workload kind gives
    its pods; the series keep component, and their own run label: the pod's run (the deployment's) is
    not laid over it, so the single policy's series (no run label) are `{run=""}` as under compose,
    which the weight-version panels and alerts select."""
    render = with_monitoring(name)
    (pm,) = [p for p in render.of_kind("PodMonitor") if p["metadata"]["name"] == f"{chart.FULLNAME}-trainer"]
    (obj,) = [
        o
        for o in render.of_kind("StatefulSet", "Job", "JobSet")
        if (o["metadata"].get("labels") or {}).get("app.kubernetes.io/component") == "trainer"
    ]
    (_w, template), *_ = policy.pod_templates(obj)
    assert template["metadata"]["labels"]["tether.dev/run"] == chart.effective_values(name)["run"]["id"]
    for index in range(2):
        pod = {**template["metadata"]["labels"], INDEX_LABEL[obj["kind"]]: str(index)}
        for endpoint in pm["spec"]["podMetricsEndpoints"]:
            got = relabel(_meta_labels(pod), endpoint.get("relabelings") or [])
            if index == 0:
                assert got is not None and got["component"] == "trainer" and "run" not in got, got
            else:
                assert got is None, f"rank {index} is scraped"


def test_relabel_follows_prometheus():
    rules = [
        {"action": "keep", "sourceLabels": ["a", "b"], "regex": "0;|;0"},
        {"sourceLabels": ["a"], "targetLabel": "x", "regex": "(.*)", "replacement": "r$1"},
    ]
    assert relabel({"a": "0"}, rules) == {"a": "0", "x": "r0"}
    assert relabel({"b": "0"}, rules) is not None
    assert relabel({"a": "1"}, rules) is None
    assert relabel({"a": "10"}, rules) is None


RUNS_SETS = [s.name for s in GOOD if chart.effective_values(s.name)["runs"]["enabled"]]


@pytest.mark.parametrize("name", RUNS_SETS)
def test_the_run_hosts_series_keep_their_own_run(name):
    """runs.enabled: the run host's PodMonitor scrapes its metrics port as job runhost with component
    kept, and lays no run label over the target: its series carry each hosted run's own `run` (and
    `service`), which a target label `run` would push aside into `exported_run` (honor_labels off, as
    every endpoint here). The run host's own series, without one, read `{run=""}` as the trainer's
    single policy does."""
    assert RUNS_SETS
    render = with_monitoring(name)
    (pm,) = [p for p in render.of_kind("PodMonitor") if p["metadata"]["name"] == f"{chart.FULLNAME}-runhost"]
    ((_w, template),) = [
        (w, t)
        for w, t in render.pod_templates()
        if t["metadata"]["labels"]["app.kubernetes.io/component"] == "runhost"
    ]
    assert policy.label_selector_matches(pm["spec"]["selector"], template["metadata"]["labels"])
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    assert not endpoint.get("honorLabels")
    got = relabel(_meta_labels(template["metadata"]["labels"]), endpoint.get("relabelings") or [])
    assert got is not None
    assert got["job"] == "runhost" and got["component"] == "runhost" and "run" not in got, got


def test_without_runs_there_is_no_run_host_monitor():
    render = with_monitoring("cpu-demo")
    assert not [p for p in render.of_kind("PodMonitor") if p["metadata"]["name"].endswith("-runhost")]
