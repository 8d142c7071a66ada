"""docker-compose.yml without an engine: valid for the Compose binary (`docker-compose config -q`) and
the compose-spec schema, in every profile and with the host-network override, and every service
hardened. Each check is a function of tests/compose_helpers.py, shown here to fail on a broken copy.
The real bring-up is tests/test_compose.py."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from compose_helpers import (
    COMPOSE_FILE,
    HOST_OVERRIDE,
    PROMETHEUS_CONFIG,
    PROMETHEUS_HOST_CONFIG,
    ROOT,
    SECRETS,
    compose_args,
    compose_env,
    config,
    flag_value,
    hardening_problems,
    mounts,
    redis_problems,
    run_compose,
    scrape_problems,
    service_ports,
)

VARIANTS = {
    "cpu": (("cpu",), False),
    "gpu": (("gpu",), False),
    "monitoring": (("monitoring",), False),
    "cpu+monitoring": (("cpu", "monitoring"), False),
    "host cpu+monitoring": (("cpu", "monitoring"), True),
}


def check_jsonschema(path: Path) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).parent / "check-jsonschema"
    return subprocess.run(
        [str(exe), "--builtin-schema", "vendor.compose-spec", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def configs() -> dict[str, dict]:
    return {name: config(profiles, host) for name, (profiles, host) in VARIANTS.items()}


@pytest.mark.parametrize("variant", VARIANTS)
def test_compose_config_quiet(variant):
    profiles, host = VARIANTS[variant]
    res = run_compose([*compose_args(profiles, host), "config", "-q"], compose_env())
    assert res.returncode == 0, res.stderr


def test_compose_config_refuses_a_broken_file(tmp_path):
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(COMPOSE_FILE.read_text().replace("condition: service_healthy", "condition: healthy", 1))
    res = run_compose(
        [
            compose_args()[0],
            "-f",
            str(broken),
            "--project-directory",
            str(ROOT),
            "--profile",
            "cpu",
            "config",
            "-q",
        ],
        compose_env(),
    )
    assert res.returncode != 0 and "healthy" in res.stderr


def test_schema_valid_base_file_and_every_merged_variant(tmp_path, configs):
    res = check_jsonschema(COMPOSE_FILE)
    assert res.returncode == 0, res.stdout + res.stderr
    # The override uses Compose's !reset/!override tags, which a plain YAML loader refuses: its merged
    # result is what gets validated (as is every profile's).
    for name, cfg in configs.items():
        out = tmp_path / f"{name.replace(' ', '_').replace('+', '_')}.json"
        out.write_text(json.dumps(cfg))
        res = check_jsonschema(out)
        assert res.returncode == 0, f"{name}: {res.stdout}{res.stderr}"


def test_schema_refuses_an_unknown_key(tmp_path, configs):
    cfg = copy.deepcopy(configs["cpu"])
    cfg["services"]["gateway"]["restart_policy"] = "on-failure"  # a typo of a real key
    out = tmp_path / "bad.json"
    out.write_text(json.dumps(cfg))
    res = check_jsonschema(out)
    assert res.returncode != 0 and "restart_policy" in res.stdout


def test_profiles_hold_the_services_they_promise(configs):
    assert set(configs["cpu"]["services"]) == {
        "redis",
        "model-init",
        "inference-cpu",
        "trainer",
        "merger",
        "gateway",
        "scheduler",
        "agent",
        "ui",
    }
    assert {"inference", "trainer-gpu", "ui"} <= set(configs["gpu"]["services"])
    assert not {"inference-cpu", "trainer"} & set(configs["gpu"]["services"])
    assert set(configs["monitoring"]["services"]) == {"prometheus", "grafana"}
    # No Grafana image can be had offline: the host override (the compose test) leaves it out.
    assert "grafana" not in configs["host cpu+monitoring"]["services"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_service_is_hardened(configs, variant):
    assert hardening_problems(configs[variant]) == []


@pytest.mark.parametrize(
    "breakage, expected",
    [
        (lambda s: s.pop("healthcheck"), "gateway: no healthcheck"),
        (lambda s: s.update(restart="always"), "gateway: restart is 'always'"),
        (lambda s: s.update(read_only=False), "gateway: root filesystem not read-only"),
        (lambda s: s.update(cap_drop=["NET_RAW"]), "gateway: cap_drop"),
        (lambda s: s.update(security_opt=[]), "gateway: no no-new-privileges"),
        (lambda s: s.update(user="0:0"), "gateway: user '0:0' is root"),
        (lambda s: s.update(user="tether"), "not numeric"),
        (lambda s: s.pop("user"), "gateway: no user"),
        (lambda s: s["deploy"]["resources"]["limits"].pop("memory"), "gateway: no memory limit"),
        (
            lambda s: s["depends_on"]["redis"].update(condition="service_started"),
            "condition 'service_started'",
        ),
    ],
)
def test_hardening_check_fails_on_each_breakage(configs, breakage, expected):
    cfg = copy.deepcopy(configs["cpu"])
    breakage(cfg["services"]["gateway"])
    problems = hardening_problems(cfg)
    assert any(expected in p for p in problems), problems


def test_one_shot_model_init_is_waited_for_and_needs_no_health(configs):
    cfg = configs["cpu"]
    waits = {
        name
        for name, s in cfg["services"].items()
        if (s.get("depends_on") or {}).get("model-init", {}).get("condition")
        == "service_completed_successfully"
    }
    assert {"inference-cpu", "trainer"} <= waits
    assert cfg["services"]["model-init"]["command"][:2] == ["tether", "prepare-demo"]


@pytest.mark.parametrize("appendfsync", ["everysec", "always"])
def test_redis_keeps_every_entry(appendfsync):
    cfg = config(("cpu",), REDIS_APPENDFSYNC=appendfsync)
    assert redis_problems(cfg, appendfsync) == []


def test_redis_check_fails_on_eviction_or_no_aof(configs):
    for flag, value, expected in (
        ("--maxmemory-policy", "allkeys-lru", "noeviction"),
        ("--appendonly", "no", "AOF is off"),
    ):
        cfg = copy.deepcopy(configs["cpu"])
        cmd = cfg["services"]["redis"]["command"]
        cmd[cmd.index(flag) + 1] = value
        assert any(expected in p for p in redis_problems(cfg, "everysec"))


def test_host_override_appendfsync_always_and_redis_moved(configs):
    cfg = configs["host cpu+monitoring"]
    assert redis_problems(cfg, "always") == []
    port = cfg["services"]["redis"]["command"][cfg["services"]["redis"]["command"].index("--port") + 1]
    assert port != "6379"  # the machine's own Redis holds it
    assert all(
        f":{port}/" in s["environment"]["TETHER_REDIS_URL"]
        for s in cfg["services"].values()
        if "TETHER_REDIS_URL" in s.get("environment", {})
    )
    for name, s in cfg["services"].items():
        assert s.get("network_mode") == "host", name
        assert not s.get("ports"), name
        assert not s.get("networks"), name
        for key, value in (s.get("environment") or {}).items():
            if key.endswith("_HOST") and key.startswith("TETHER_"):
                assert value == "127.0.0.1", (
                    f"{name}: {key}={value} binds beyond loopback on the host network"
                )


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_trainer_and_inference_share_the_checkpoints(configs, profile):
    services = configs[profile]["services"]
    trainer = services["trainer" if profile == "cpu" else "trainer-gpu"]
    inference = services["inference-cpu" if profile == "cpu" else "inference"]
    ckpt = trainer["environment"]["TETHER_CHECKPOINT_DIR"]
    t, i = mounts(trainer)[ckpt], mounts(inference)[ckpt]
    assert t["type"] == i["type"] == "volume" and t["source"] == i["source"]
    assert not t.get("read_only") and i.get("read_only")
    # One model for both (and the merger's chat template).
    model = trainer["environment"]["TETHER_MODEL_DIR"]
    assert inference["environment"]["TETHER_MODEL_DIR"] == model
    assert mounts(trainer)["/models"]["source"] == mounts(inference)["/models"]["source"]


def test_gpu_profile_reserves_nvidia_gpus_and_shared_memory(configs):
    for name in ("inference", "trainer-gpu"):
        s = configs["gpu"]["services"][name]
        devices = s["deploy"]["resources"]["reservations"]["devices"]
        assert devices and all(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices), name
        assert s.get("shm_size"), name


def test_prometheus_scrapes_every_metrics_port(configs):
    prometheus = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    cfg = configs["cpu+monitoring"]
    assert scrape_problems(cfg, prometheus) == []
    assert scrape_problems(config(("gpu", "monitoring")), prometheus) == []
    # On the host network every port moved: the host config names the same targets on those ports.
    host = configs["host cpu+monitoring"]
    assert Path(mounts(host["services"]["prometheus"])["/etc/prometheus/prometheus.yml"]["source"]) == (
        PROMETHEUS_HOST_CONFIG
    )
    assert scrape_problems(host, yaml.safe_load(PROMETHEUS_HOST_CONFIG.read_text())) == []
    assert scrape_problems(host, prometheus) != []  # the base file's ports are not those
    # Fails when a target is missing, or names nothing.
    broken = copy.deepcopy(prometheus)
    broken["scrape_configs"] = [j for j in broken["scrape_configs"] if j["job_name"] != "trainer"]
    broken["scrape_configs"].append({"job_name": "x", "static_configs": [{"targets": ["nowhere:1"]}]})
    problems = scrape_problems(cfg, broken)
    assert any("trainer: metrics port 9103" in p for p in problems)
    assert any("nowhere:1" in p for p in problems)


def test_host_network_ports_are_distinct_and_out_of_the_ephemeral_range(configs):
    """On one host every service's ports must differ, and none may be one the kernel hands out as the
    local port of a client socket (32768-60999 by default), which another process can hold by chance."""
    seen: dict[int, str] = {}
    for name, s in sorted(configs["host cpu+monitoring"]["services"].items()):
        for port in service_ports(s):
            assert port not in seen, f"{name} and {seen.get(port)} both use port {port}"
            seen[port] = name
            assert 1024 <= port < 32768, f"{name}: port {port}"
    assert 6379 not in seen  # the machine's own Redis
    assert {
        "redis",
        "gateway",
        "inference-cpu",
        "trainer",
        "merger",
        "scheduler",
        "agent",
        "ui",
        "prometheus",
    } <= set(seen.values())


def test_prometheus_loads_the_alert_rules_and_grafana_the_dashboards(configs):
    monitoring = configs["monitoring"]["services"]
    prom = mounts(monitoring["prometheus"])
    rules_dir = prom["/etc/prometheus/rules"]["source"]
    prometheus = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    assert prometheus["rule_files"] == ["/etc/prometheus/rules/*.yaml"]
    assert Path(rules_dir) == ROOT / "helm" / "tether" / "alerts"
    assert Path(prom["/etc/prometheus/prometheus.yml"]["source"]) == PROMETHEUS_CONFIG
    graf = mounts(monitoring["grafana"])
    provisioning = Path(graf["/etc/grafana/provisioning"]["source"])
    datasource = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())
    [ds] = datasource["datasources"]
    assert ds["type"] == "prometheus" and ds["uid"] and ds["url"] == "http://prometheus:9090"
    provider = yaml.safe_load((provisioning / "dashboards" / "tether.yaml").read_text())
    [p] = provider["providers"]
    dashboards = p["options"]["path"]
    assert Path(graf[dashboards]["source"]) == ROOT / "helm" / "tether" / "dashboards"
    home = monitoring["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home.startswith(dashboards + "/")
    name = home.removeprefix(dashboards + "/")
    if (ROOT / "helm" / "tether" / "dashboards").is_dir():
        assert (ROOT / "helm" / "tether" / "dashboards" / name).is_file(), f"home dashboard {name} missing"


@pytest.mark.parametrize("variant", ["cpu", "host cpu+monitoring"])
def test_the_ui_is_behind_the_admin_token_on_loopback(configs, variant):
    """`tether ui` gets the gateway's admin token (the same .env secret, required), reads the run's
    Redis as the services do (TETHER_REDIS_URL, never on its command line, where `ps` would show the
    password), is published on 127.0.0.1 only, and its healthcheck is the one route open without
    the token."""
    services = configs[variant]["services"]
    ui, gateway, merger = services["ui"], services["gateway"], services["merger"]
    env = ui["environment"]
    assert (
        env["TETHER_ADMIN_TOKEN"] == gateway["environment"]["TETHER_ADMIN_TOKEN"] == "test-tether_admin_token"
    )
    assert env["TETHER_REDIS_URL"] == merger["environment"]["TETHER_REDIS_URL"]
    command = [str(w) for w in ui["command"]]
    assert command[:2] == ["tether", "ui"] and "--redis-url" not in command
    assert not any("test-redis_password" in w for w in command)
    assert flag_value(command, "--namespace") == env["TETHER_NAMESPACE"]
    assert ui["image"] == gateway["image"]  # the tether image holds the `tether` command
    assert env["TETHER_MODEL_DIR"] == merger["environment"]["TETHER_MODEL_DIR"]  # --model: the tokenizer
    port = int(flag_value(command, "--port"))
    assert ui["healthcheck"]["test"][-1] == f"http://127.0.0.1:{port}/healthz"
    for published in ui.get("ports") or []:
        assert published["host_ip"] == "127.0.0.1" and int(published["target"]) == port, published
    if variant == "cpu":
        assert ui["ports"] and flag_value(command, "--host") == "0.0.0.0"
    else:
        assert ui["network_mode"] == "host" and flag_value(command, "--host") == "127.0.0.1"


def test_no_secret_is_committed():
    # Without the secrets Compose refuses to start at all: no default value stands in for one.
    res = run_compose([*compose_args(("cpu", "monitoring")), "config", "-q"], compose_env(secrets={}))
    assert res.returncode != 0
    assert any(s in res.stderr for s in SECRETS), res.stderr
    # .env.example names each secret with an empty value; .env itself is ignored by git.
    example = dict(
        line.split("=", 1)
        for line in (ROOT / ".env.example").read_text().splitlines()
        if "=" in line and not line.startswith("#")
    )
    for s in SECRETS:
        assert example.get(s) == "", f".env.example sets {s}"
    ignored = subprocess.run(["git", "check-ignore", "-q", ".env"], cwd=ROOT)
    assert ignored.returncode == 0, ".env is not gitignored"
    tracked = subprocess.run(["git", "ls-files", ".env"], cwd=ROOT, capture_output=True, text=True).stdout
    assert tracked.strip() == ""


def test_host_override_covers_every_service():
    # A service the override forgets would join compose's bridge network, which these machines must not use.
    base = {name for name in yaml.safe_load(COMPOSE_FILE.read_text())["services"]}
    text = HOST_OVERRIDE.read_text()
    missing = [name for name in sorted(base) if f"\n  {name}:" not in text]
    assert missing == []


def test_mtls_is_off_by_default_and_reaches_every_grpc_service_when_set(tmp_path):
    """TETHER_TLS_* from .env reach every Tether container with a gRPC server or client, with the
    directory TETHER_TLS_DIR mounted read-only at /etc/tether/tls; unset, the variables are empty (TLS
    off) and an empty named volume is mounted."""
    grpc_services = {"inference-cpu", "trainer", "merger", "gateway", "scheduler", "agent"}
    off = config(("cpu",))["services"]
    on = config(
        ("cpu",),
        TETHER_TLS_DIR=str(tmp_path),
        TETHER_TLS_CERT_FILE="/etc/tether/tls/tls.crt",
        TETHER_TLS_KEY_FILE="/etc/tether/tls/tls.key",
        TETHER_TLS_CA_FILE="/etc/tether/tls/ca.crt",
        TETHER_TLS_SERVER_NAME="tether",
    )["services"]
    for name in grpc_services:
        assert off[name]["environment"]["TETHER_TLS_CERT_FILE"] == "", name
        assert mounts(off[name])["/etc/tether/tls"]["type"] == "volume", name
        env = on[name]["environment"]
        assert (
            env["TETHER_TLS_CA_FILE"] == "/etc/tether/tls/ca.crt"
            and env["TETHER_TLS_SERVER_NAME"] == "tether"
        )
        mount = mounts(on[name])["/etc/tether/tls"]
        assert (mount["type"], mount["source"], mount.get("read_only")) == ("bind", str(tmp_path), True), name
