"""The dashboards and alert rules scripts/dashboards.py writes under helm/tether/: fresh, well-formed
Grafana JSON with the conventions its docstring states, PromQL that promtool compiles, alert rules that
fire (and stay quiet) in `promtool test rules`, and metrics that the services really define."""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from promtool import promtool

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "dashboards.py"
DASHBOARD_DIR = ROOT / "helm" / "tether" / "dashboards"
ALERTS = ROOT / "helm" / "tether" / "alerts" / "tether-alerts.yaml"
ALERT_TESTS = ROOT / "tests" / "alerts_test.yaml"

# Each dashboard's uid is part of its address (links, bookmarks, the chart's ConfigMaps): never change.
UIDS = {
    "run-overview": "tether-run",
    "gateway": "tether-gateway",
    "inference": "tether-inference",
    "broker": "tether-broker",
    "trainer": "tether-trainer",
    "learning-health": "tether-learning",
}
# What vLLM itself exports and a panel may use (the rest of vLLM's metrics are not relied on).
VLLM_GAUGES = {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"}
VLLM_GAUGES |= {"vllm:engine_sleep_state"}
VLLM_COUNTERS = {"vllm:prompt_tokens_total", "vllm:generation_tokens_total"}
VLLM_HISTOGRAMS = {
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds",
}
VLLM_SERIES = (
    VLLM_GAUGES | VLLM_COUNTERS | {h + s for h in VLLM_HISTOGRAMS for s in ("_bucket", "_sum", "_count")}
)
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def load_generator():
    spec = importlib.util.spec_from_file_location("tether_dashboards", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


gen = load_generator()


def committed() -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(DASHBOARD_DIR.glob("*.json"))}


def panels():
    for name, d in committed().items():
        for p in d["panels"]:
            yield name, p


def exprs():
    for name, p in panels():
        for t in p["targets"]:
            yield f"{name}/{p['title']}/{t['refId']}", t["expr"]


def check(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(root / "scripts" / "dashboards.py"), "--check"], capture_output=True, text=True
    )


# --- the generated files are fresh ----------------------------------------------------------------


def test_check_passes_on_the_committed_files():
    out = check(ROOT)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("change", ["edit-dashboard", "edit-alerts", "delete", "extra"])
def test_check_fails_on_a_changed_file(tmp_path, change):
    (tmp_path / "scripts").mkdir()
    shutil.copy(SCRIPT, tmp_path / "scripts" / "dashboards.py")
    shutil.copytree(ROOT / "helm" / "tether" / "dashboards", tmp_path / "helm" / "tether" / "dashboards")
    shutil.copytree(ROOT / "helm" / "tether" / "alerts", tmp_path / "helm" / "tether" / "alerts")
    assert check(tmp_path).returncode == 0  # the copy itself is fresh
    dash = tmp_path / "helm" / "tether" / "dashboards"
    if change == "edit-dashboard":
        path = dash / "gateway.json"
        path.write_text(path.read_text().replace('"Tether / Gateway"', '"Gateway (edited)"'))
    elif change == "edit-alerts":
        path = tmp_path / "helm" / "tether" / "alerts" / "tether-alerts.yaml"
        path.write_text(path.read_text().replace("for: 5m", "for: 6m"))
    elif change == "delete":
        (dash / "broker.json").unlink()
    else:
        (dash / "hand-made.json").write_text("{}\n")
    out = check(tmp_path)
    assert out.returncode == 1, out.stdout
    assert "stale" in out.stdout


def test_output_is_deterministic():
    assert gen.render() == gen.render()
    for path, text in gen.render().items():
        if path.suffix == ".json":
            assert text == json.dumps(json.loads(text), indent=2, sort_keys=True) + "\n"


# --- Grafana conventions --------------------------------------------------------------------------


def test_uids_are_unique_and_stable():
    dashboards = committed()
    assert {name: d["uid"] for name, d in dashboards.items()} == UIDS
    assert len({d["uid"] for d in dashboards.values()}) == len(dashboards)
    for name, d in dashboards.items():
        ids = [p["id"] for p in d["panels"]]
        assert ids == list(range(1, len(ids) + 1)), name
        titles = [p["title"] for p in d["panels"]]
        assert len(set(titles)) == len(titles), name
        assert "tether" in d["tags"]


def test_datasource_is_a_template_variable():
    for path in DASHBOARD_DIR.glob("*.json"):
        text = path.read_text()
        assert "__inputs" not in text and "${DS_" not in text, path.name
        d = json.loads(text)
        (var,) = [v for v in d["templating"]["list"] if v["name"] == "datasource"]
        assert var["type"] == "datasource" and var["query"] == "prometheus"
    for name, p in panels():
        assert p["datasource"] == DATASOURCE, (name, p["title"])
        assert all(t["datasource"] == DATASOURCE for t in p["targets"]), (name, p["title"])


_WINDOWED = re.compile(r"\b(rate|irate|increase|delta|idelta|deriv|[a-z]+_over_time)\s*\(")


def windows(expr: str) -> list[tuple[str, str]]:
    """(function, its range window) for each range-vector function of an expression."""
    out = []
    for m in _WINDOWED.finditer(expr):
        depth, i = 1, m.end()
        while depth:
            depth += {"(": 1, ")": -1}.get(expr[i], 0)
            i += 1
        arg = expr[m.end() : i - 1]
        window = re.findall(r"\[([^\]]*)\]\s*$", arg)
        out.append((m.group(1), window[0] if window else ""))
    return out


def test_windows_helper_finds_each_window():
    assert windows('sum(rate(a{x="1"}[5m])) / clamp_min(increase(b[$__rate_interval]), 1)') == [
        ("rate", "5m"),
        ("increase", "$__rate_interval"),
    ]


def test_every_rate_and_increase_uses_the_rate_interval():
    seen = 0
    for where, expr in exprs():
        for fn, window in windows(expr):
            assert window == "$__rate_interval", f"{where}: {fn}(...[{window}]) in {expr}"
            seen += 1
    assert seen > 20  # the rule above checked something


def divisors(expr: str) -> list[str]:
    """What follows each division operator."""
    return [expr[m.end() :].lstrip() for m in re.finditer(r"/", expr)]


def test_every_ratio_is_guarded_against_an_idle_window():
    ratios = 0
    for where, expr in exprs():
        for rest in divisors(expr):
            ratios += 1
            assert rest.startswith("clamp_min(") or re.match(r"\d", rest), f"{where}: unguarded / in {expr}"
    assert ratios > 5


def test_every_panel_describes_itself_and_names_its_metrics():
    for name, p in panels():
        metrics = set().union(*(gen.metric_names(t["expr"]) for t in p["targets"]))
        assert metrics, (name, p["title"])
        about, _, listed = p["description"].partition(" Metrics: ")
        assert len(about) > 10, (name, p["title"])
        assert set(listed.rstrip(".").split(", ")) == metrics, (name, p["title"])


def test_metric_names_of_an_expression():
    expr = (
        'histogram_quantile(0.9, sum by (le, route) (rate(a_bucket{route=~"x|y"}[$__rate_interval])))'
        ' / clamp_min(sum(rate(b_total[5m] offset 1h)), 1e-9) or on () vllm:c{s="awake"} > bool 0'
        ' and ignoring (job) label_replace(d, "component", "gateway", "", "")'
    )
    assert gen.metric_names(expr) == {"a_bucket", "b_total", "vllm:c", "d"}


def test_the_run_overview_shows_what_the_issue_asks_for():
    run = committed()["run-overview"]
    used = {m for p in run["panels"] for t in p["targets"] for m in gen.metric_names(t["expr"])}
    for metric in (
        "tether_run_reward_mean",
        "tether_run_step_seconds",
        "tether_run_phase",
        "tether_run_push_seconds",
        "tether_run_paused_seconds",
        "tether_run_staleness_max",
        "tether_run_token_staleness_max",
        "tether_run_max_staleness",
        "tether_run_logprob_abs_diff",
        "tether_run_logprob_k3_kl",
        "tether_run_forks",
        *(m for selector in gen.WEIGHT_VERSIONS.values() for m in gen.metric_names(selector)),
    ):
        assert metric in used, metric


# --- PromQL compiles; alerts fire ----------------------------------------------------------------


def compile_rules(tmp_path: Path, named: dict[str, str]) -> subprocess.CompletedProcess:
    rules = [{"record": name, "expr": expr} for name, expr in named.items()]
    path = tmp_path / "panels.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "panels", "rules": rules}]}))
    return subprocess.run(
        [str(promtool()), "check", "rules", str(path)], capture_output=True, text=True, timeout=120
    )


def grafana_free(expr: str) -> str:
    """The expression with Grafana's variables replaced by what Prometheus would see."""
    out = expr.replace("$__rate_interval", "1m").replace("$__interval", "15s").replace("$__range", "1h")
    return out.replace('"$run"', '".*"')  # the run variable's "All"


def test_every_panel_expression_compiles(tmp_path):
    named = {}
    for i, (_, expr) in enumerate(exprs()):
        assert "$" not in grafana_free(expr), expr
        named[f"tether_panel_{i}"] = grafana_free(expr)
    out = compile_rules(tmp_path, named)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(named)} rules found" in out.stdout


def test_a_broken_expression_does_not_compile(tmp_path):
    out = compile_rules(tmp_path, {"ok": "sum(rate(x[1m]))", "broken": "sum(rate(x[1m])"})
    assert out.returncode != 0


def test_alert_rules_pass_promtool():
    out = subprocess.run(
        [str(promtool()), "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_alert_unit_tests_pass():
    out = subprocess.run(
        [str(promtool()), "test", "rules", str(ALERT_TESTS)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_every_alert_is_complete_and_tested_both_ways():
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    rules = [r for g in groups for r in g["rules"]]
    names = {r["alert"] for r in rules}
    assert names == {
        "TetherStalenessAboveBound",
        "TetherWeightVersionsDisagree",
        "TetherTargetDown",
        "TetherReplicaUnhealthy",
        "TetherDeadLettersGrowing",
        "TetherTrainerStalled",
        "TetherEntropyCollapse",
        "TetherPolicyKLSpike",
        "TetherRewardCollapse",
        "TetherResponsesTruncated",
        "TetherNothingTrained",
        "TetherStepGuardActing",
        "TetherWrongAdapter",
    }
    for r in rules:
        assert re.fullmatch(r"\d+[smh]", r["for"]), r["alert"]
        assert r["labels"]["severity"] in {"warning", "critical"}, r["alert"]
        assert r["annotations"]["summary"] and r["annotations"]["description"], r["alert"]
    cases = [c for t in yaml.safe_load(ALERT_TESTS.read_text())["tests"] for c in t["alert_rule_test"]]
    fires = {c["alertname"] for c in cases if c["exp_alerts"]}
    quiet = {c["alertname"] for c in cases if not c["exp_alerts"]}
    assert fires == names and quiet == names


# --- the metrics exist ----------------------------------------------------------------------------


def defined_metrics() -> set[str]:
    """Every series name the services' metrics would show in a scrape: each module under tether that
    imports prometheus_client is imported, then the default registry is read."""
    from prometheus_client import REGISTRY

    services = ROOT / "services"
    for path in sorted((services / "tether").rglob("*.py")):
        if "prometheus_client" in path.read_text():
            importlib.import_module(".".join(path.relative_to(services).with_suffix("").parts))
    suffixes = {
        "counter": ("_total",),
        "gauge": ("",),
        "histogram": ("_bucket", "_sum", "_count"),
        "summary": ("", "_sum", "_count"),
    }
    return {m.name + s for m in REGISTRY.collect() for s in suffixes.get(m.type, ("",))}


def test_every_used_metric_is_defined_by_the_services_or_vllm():
    used = gen.used_metrics()
    assert len(used) > 50
    assert not used & gen.PROMETHEUS_SERIES
    missing = used - defined_metrics() - VLLM_SERIES
    assert not missing, sorted(missing)


# --- ... and a real run exports them (tests/test_e2e.py scrapes its demo with tests/scrape_helpers.py) --


def test_the_queried_metrics_of_one_dashboard_and_of_the_alerts():
    learning = gen.dashboard_metrics("learning-health")
    assert {"tether_trainer_policy_entropy", "tether_trainer_step_guard_retries_total"} <= learning
    assert learning < gen.dashboard_metrics() and gen.alert_metrics() <= gen.used_metrics()
    assert "up" not in gen.alert_metrics()  # Prometheus's own: TetherTargetDown
    with pytest.raises(KeyError, match="no-such-board"):
        gen.dashboard_metrics("learning-health", "no-such-board")


def test_a_queried_metric_no_scrape_holds_a_series_of_is_named():
    """A made-up panel expression against real expositions (prometheus_client's): a metric no process
    defines is named, and so is a labelled gauge that no label set was used of yet (HELP and TYPE
    lines only); once one is, only the undefined one is left."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
    from scrape_helpers import series_names, unexported

    expr = (
        "max by (side) (tether_trainer_clip_fraction) + sum(increase(tether_made_up_total[$__rate_interval]))"
        " + max(tether_trainer_grad_norm) + sum(rate(tether_trainer_steps_total[$__rate_interval]))"
    )
    used = gen.metric_names(expr)
    assert used == {
        "tether_trainer_clip_fraction",
        "tether_made_up_total",
        "tether_trainer_grad_norm",
        "tether_trainer_steps_total",
    }
    registry = CollectorRegistry()
    clip = Gauge("tether_trainer_clip_fraction", "clipped", ["side"], registry=registry)
    Gauge("tether_trainer_grad_norm", "norm", registry=registry)
    trainer = CollectorRegistry()
    Counter("tether_trainer_steps", "steps", registry=trainer)
    scraped = {"trainer": series_names(generate_latest(registry).decode())}
    scraped["other"] = series_names(generate_latest(trainer).decode())
    assert unexported(used, scraped) == {"tether_trainer_clip_fraction", "tether_made_up_total"}
    clip.labels(side="low").set(0.1)
    scraped["trainer"] = series_names(generate_latest(registry).decode())
    assert unexported(used, scraped) == {"tether_made_up_total"}


def test_scraping_reads_each_process_the_stack_file_lists(tmp_path):
    """scrape_helpers.scraping on a stack file naming a real /metrics server and a port nobody serves."""
    from prometheus_client import CollectorRegistry, Gauge, start_http_server
    from scrape_helpers import scraping
    from stack_helpers import wait_for

    registry = CollectorRegistry()
    Gauge("tether_run_phase", "phase", ["phase"], registry=registry).labels(phase="training").set(1)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    url = f"http://127.0.0.1:{server.server_port}/metrics"
    (tmp_path / ".tether").mkdir()
    metrics = {"scheduler": url, "gone": "http://127.0.0.1:9/metrics"}
    (tmp_path / ".tether" / "stack.json").write_text(json.dumps({"metrics": metrics}))
    try:
        with scraping(tmp_path, every_s=0.05) as seen:
            wait_for(lambda: "scheduler" in seen, 10, "a scrape", every_s=0.05)
    finally:
        server.shutdown()
        thread.join(10)
    assert "tether_run_phase" in seen["scheduler"] and "gone" not in seen


def test_a_run_labelled_selector_is_narrowed_to_the_run_variable() -> None:
    assert gen.for_run("max(tether_run_reward_mean)") == 'max(tether_run_reward_mean{run=~"$run"})'
    assert (
        gen.for_run('sum(rate(tether_merger_calls_dropped_total{reason="x"}[$__rate_interval]))')
        == 'sum(rate(tether_merger_calls_dropped_total{reason="x", run=~"$run"}[$__rate_interval]))'
    )
    # The single policy's own selector, a shared service's series and an unlabelled trainer series stay.
    for expr in (
        'max(tether_trainer_weight_version{run=""})',
        "sum(tether_gateway_requests_total)",
        "tether_trainer_path",
    ):
        assert gen.for_run(expr) == expr


# A selector of a series the run host or the trainer labels with `run` (docs/metrics.md), with its braces.
_RUN_SELECTOR = re.compile(gen.RUN_SERIES.pattern)


def test_every_dashboard_with_run_series_filters_by_run() -> None:
    """A dashboard querying series that carry `run` has the `run` variable ("All" = `.*`, so the base
    namespace's unlabelled series stay), and each such selector picks `$run` or names its run."""
    filtered = set()
    for name, d in committed().items():
        selectors = [
            m.group(0) for p in d["panels"] for t in p["targets"] for m in _RUN_SELECTOR.finditer(t["expr"])
        ]
        variables = {v["name"]: v for v in d["templating"]["list"]}
        if not selectors:
            assert "run" not in variables, name
            continue
        filtered.add(name)
        run = variables["run"]
        assert run["includeAll"] and run["allValue"] == ".*" and run["current"]["value"] == "$__all", name
        assert (
            run["query"]["query"] == "label_values(tether_run_phase, run)" and run["datasource"] == DATASOURCE
        )
        for sel in selectors:
            assert 'run=~"$run"' in sel or re.search(r'\brun="', sel), (name, sel)
    assert {"run-overview", "learning-health", "trainer", "broker", "gateway"} <= filtered


def test_the_metrics_only_a_stack_with_runs_exports_are_queried_per_run():
    """What tests/test_compose.py may miss in a stack without runs: the gateway's per-run series, each
    queried by a panel and filtered by `run`; nothing else."""
    assert gen.RUNS_ONLY_METRICS <= gen.dashboard_metrics()
    assert all(gen.RUN_SERIES.fullmatch(m) for m in gen.RUNS_ONLY_METRICS)
    assert all(m.startswith("tether_gateway_run_") for m in gen.RUNS_ONLY_METRICS)
