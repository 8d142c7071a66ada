"""Mutual TLS in the chart (tls.existingSecret; docs/security.md): off by default; set, every Tether
container gets the certificate files (the Secret mounted read-only) and the TETHER_TLS_* variables, and
every gRPC-native probe reads the plaintext health-only port the container serves
(TETHER_GRPC_HEALTH_PORT): kubelet's gRPC probe cannot present a client certificate."""

from __future__ import annotations

from typing import Any

import pytest

from deploy import chart

TLS_ENV = {
    "TETHER_TLS_CERT_FILE": "/etc/tether/tls/tls.crt",
    "TETHER_TLS_KEY_FILE": "/etc/tether/tls/tls.key",
    "TETHER_TLS_CA_FILE": "/etc/tether/tls/ca.crt",
}


def _tether_containers(render: chart.Render) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(where, container, pod spec) of every container that talks gRPC to the others (it carries the
    service token)."""
    out = []
    for where, t in render.pod_templates():
        for c in t["spec"].get("containers") or []:
            if any(e["name"] == "TETHER_SERVICE_TOKEN" for e in c.get("env") or []):
                out.append((f"{where} {c['name']}", c, t["spec"]))
    return out


def _env(c: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in c.get("env") or []}


def _grpc_probe_ports(c: dict[str, Any]) -> set[int]:
    return {
        int(c[p]["grpc"]["port"])
        for p in ("startupProbe", "readinessProbe", "livenessProbe")
        if "grpc" in (c.get(p) or {})
    }


def _check(render: chart.Render, server_name: str | None) -> list[str]:
    problems = []
    containers = _tether_containers(render)
    assert containers
    for where, c, spec in containers:
        env = _env(c)
        probes = _grpc_probe_ports(c)
        grpc_ports = {p["containerPort"] for p in c.get("ports") or [] if p["name"].endswith("grpc")}
        if server_name is None:
            if set(env) & {*TLS_ENV, "TETHER_TLS_SERVER_NAME", "TETHER_GRPC_HEALTH_PORT"}:
                problems.append(f"{where}: TLS variables with TLS off")
            if not probes <= grpc_ports:
                problems.append(f"{where}: gRPC probes on {probes}, not its gRPC port {grpc_ports}")
            continue
        if {k: env.get(k) for k in TLS_ENV} != TLS_ENV or env.get("TETHER_TLS_SERVER_NAME") != server_name:
            problems.append(f"{where}: TLS variables {env}")
        mount = [m for m in c.get("volumeMounts") or [] if m["mountPath"] == "/etc/tether/tls"]
        volumes = {v["name"]: v for v in spec.get("volumes") or []}
        if len(mount) != 1 or not mount[0].get("readOnly"):
            problems.append(f"{where}: /etc/tether/tls not mounted read-only")
        elif volumes[mount[0]["name"]].get("secret", {}).get("secretName") != "tether-mtls":
            problems.append(f"{where}: /etc/tether/tls is not the Secret tether-mtls")
        if probes:
            health_port = int(env.get("TETHER_GRPC_HEALTH_PORT", "0"))
            if probes != {health_port} or health_port in grpc_ports:
                problems.append(f"{where}: gRPC probes on {probes}, health-only port {health_port}")
    return problems


@pytest.mark.parametrize("name", [s.name for s in chart.good_sets()])
def test_every_value_set(name):
    tls = chart.effective_values(name)["tls"]
    assert _check(chart.render(name), tls["serverName"] if tls["existingSecret"] else None) == []


def test_single_node_trainer_and_the_agent_worker_probe_the_health_port():
    """cpu-demo with TLS: the one-node trainer's, merger's, scheduler's and agent worker's native gRPC
    probes move to their health-only ports (the multi-node set's trainer probes by exec, with TLS)."""
    values = chart.merge(chart.value_set("cpu-demo").values, {"tls": {"existingSecret": "tether-mtls"}})
    render = chart.render_values(values)
    assert _check(render, "tether") == []
    probed = {where.split()[-1]: _grpc_probe_ports(c) for where, c, _ in _tether_containers(render)}
    assert probed["trainer"] == {50153} and probed["merger"] == {50154} and probed["scheduler"] == {50155}
    assert probed["agent"] == {50156}


def test_the_check_fails_on_a_probe_left_on_the_mtls_port():
    values = chart.merge(chart.value_set("cpu-demo").values, {"tls": {"existingSecret": "tether-mtls"}})
    render = chart.render_values(values)
    for _, c, _ in _tether_containers(render):
        if "TETHER_GRPC_HEALTH_PORT" in _env(c):
            c["env"] = [e for e in c["env"] if e["name"] != "TETHER_GRPC_HEALTH_PORT"]
            break
    assert any("health-only port 0" in p for p in _check(render, "tether"))
