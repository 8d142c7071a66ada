"""docker-compose.yml without an engine: valid for the Compose binary (`docker-compose config -q`) and
the compose-spec schema, in every profile and with the host-network override, every service hardened,
every address and healthcheck on a port the service named serves, and every metrics port scraped.
Each check is a function of tests/compose_helpers.py, shown here to fail on a broken copy. The real
bring-up is tests/test_compose.py."""

from __future__ import annotations

import copy
import json
import re
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
    address_problems,
    compose_args,
    compose_env,
    config,
    flag_value,
    hardening_problems,
    health_problems,
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
    "cpu+runs": (("cpu", "runs"), False),
    "gpu+runs": (("gpu", "runs"), False),
    "cpu+runs+monitoring": (("cpu", "runs", "monitoring"), False),
    "host cpu+monitoring": (("cpu", "monitoring"), True),
    "host cpu+runs+monitoring": (("cpu", "runs", "monitoring"), True),
}
HOST_VARIANTS = [v for v in VARIANTS if VARIANTS[v][1]]


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
    # The run host joins a stack of either profile.
    for base in ("cpu", "gpu"):
        assert set(configs[f"{base}+runs"]["services"]) - set(configs[base]["services"]) == {"runhost"}
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


@pytest.mark.parametrize("variant", HOST_VARIANTS)
def test_host_override_appendfsync_always_and_redis_moved(configs, variant):
    cfg = configs[variant]
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
    cfg = configs["cpu+runs+monitoring"]
    assert scrape_problems(cfg, prometheus) == []
    assert scrape_problems(config(("gpu", "runs", "monitoring")), prometheus) == []
    # Without the runs profile the run host's target is all that names nothing (Prometheus shows it down).
    assert scrape_problems(configs["cpu+monitoring"], prometheus) == [
        "prometheus target runhost:9107 is no service's metrics port in this configuration"
    ]
    # On the host network every port moved: the host config names the same targets on those ports.
    host = configs["host cpu+runs+monitoring"]
    assert Path(mounts(host["services"]["prometheus"])["/etc/prometheus/prometheus.yml"]["source"]) == (
        PROMETHEUS_HOST_CONFIG
    )
    host_prometheus = yaml.safe_load(PROMETHEUS_HOST_CONFIG.read_text())
    assert scrape_problems(host, host_prometheus) == []
    assert scrape_problems(configs["host cpu+monitoring"], host_prometheus) == [
        "prometheus target runhost:26107 is no service's metrics port in this configuration"
    ]
    assert scrape_problems(host, prometheus) != []  # the base file's ports are not those
    # The runs job scrapes the run host's metrics port: its own series and its runs' services'.
    for variant, prom in (("cpu+runs+monitoring", prometheus), ("host cpu+runs+monitoring", host_prometheus)):
        [job] = [j for j in prom["scrape_configs"] if j["job_name"] == "runhost"]
        port = configs[variant]["services"]["runhost"]["environment"]["TETHER_METRICS_PORT"]
        assert [t for sc in job["static_configs"] for t in sc["targets"]] == [f"runhost:{port}"], variant
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
    for name, s in sorted(configs["host cpu+runs+monitoring"]["services"].items()):
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
        "runhost",
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
    grpc_services = {"inference-cpu", "trainer", "merger", "gateway", "scheduler", "agent", "runhost"}
    off = config(("cpu", "runs"))["services"]
    on = config(
        ("cpu", "runs"),
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


def test_the_runs_profile_needs_a_stack():
    """The run host starts runs on a stack's Redis, gateway and backends: alone, Compose refuses it."""
    res = run_compose([*compose_args(("runs",)), "config", "-q"], compose_env())
    # Which missing service Compose names first varies from run to run (a Go map's order).
    assert res.returncode != 0, res.stderr
    assert re.search(
        r'"runhost" depends on undefined service "(redis|gateway|trainer|inference)"', res.stderr
    ), res.stderr


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_address_names_a_service_and_a_port_it_listens_on(configs, variant):
    assert address_problems(configs[variant]) == []


@pytest.mark.parametrize(
    "service, key, value, expected",
    [
        (
            "runhost",
            "TETHER_TRAINER_ADDRESS",
            "trainer:50054",
            "names trainer:50054, no gRPC port",
        ),
        ("runhost", "TETHER_GATEWAY_URL", "http://gateway:8001", "names gateway:8001"),
        ("runhost", "TETHER_GATEWAY_URL", "http://gateway:50051", "names gateway:50051, no port"),
        ("runhost", "TETHER_GATEWAY_CONTROL_ADDRESS", "dns:gateway:8000", "no gRPC port gateway"),
        ("runhost", "TETHER_INFERENCE_ADDRESS", "inferense:50052", "names inferense, no service"),
        ("scheduler", "TETHER_GATEWAY_CONTROL_ADDRESS", "dns:gateway:8000", "names gateway:8000"),
        ("merger", "TETHER_REDIS_URL", "redis://:x@redis:6380/0", "names redis:6380"),
        ("agent", "TETHER_GATEWAY_URL", "gateway", "names no host and port"),
    ],
)
def test_address_check_fails_on_each_breakage(configs, service, key, value, expected):
    cfg = copy.deepcopy(configs["cpu+runs"])
    cfg["services"][service]["environment"][key] = value
    problems = address_problems(cfg)
    assert any(p.startswith(f"{service}: {key}") and expected in p for p in problems), problems


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_healthcheck_dials_its_own_port(configs, variant):
    assert health_problems(configs[variant]) == []


def test_health_check_fails_on_a_port_of_another(configs):
    cfg = copy.deepcopy(configs["cpu+runs"])
    test = cfg["services"]["runhost"]["healthcheck"]["test"]
    test[-1] = "127.0.0.1:9107"  # its metrics port, which serves no gRPC health
    cfg["services"]["gateway"]["healthcheck"]["test"][-1] = "http://127.0.0.1:8001/health"
    problems = health_problems(cfg)
    assert any(p.startswith("runhost: its healthcheck dials 127.0.0.1:9107") for p in problems), problems
    assert any(p.startswith("gateway: its healthcheck dials http://127.0.0.1:8001") for p in problems)


@pytest.mark.parametrize("variant", ["cpu+runs", "gpu+runs", "host cpu+runs+monitoring"])
def test_the_run_host_gets_what_a_run_s_services_need(configs, variant):
    """The run host hands each run's scheduler, merger and agent workers what the stack's own get: the
    base namespace's Redis (the registry is there), the backends', the gateway's and its control's
    addresses, the merger's tokenizer, the service token and TLS settings. Its runs' folders are on the
    runs volume beside the base scheduler's, the checkpoints read-only (a run's final model is copied
    from them), and it serves health on its gRPC port."""
    services = configs[variant]["services"]
    runhost, scheduler = services["runhost"], services["scheduler"]
    env = runhost["environment"]
    assert runhost["command"] == ["python", "-m", "tether.runhost"]
    assert runhost["image"] == scheduler["image"] and runhost["build"]["target"] == "tether"
    for key in (
        "TETHER_REDIS_URL",
        "TETHER_NAMESPACE",
        "TETHER_GATEWAY_CONTROL_ADDRESS",
        "TETHER_INFERENCE_ADDRESS",
        "TETHER_TRAINER_ADDRESS",
        "TETHER_SERVICE_TOKEN",
        "TETHER_TLS_CERT_FILE",
        "TETHER_TLS_KEY_FILE",
        "TETHER_TLS_CA_FILE",
        "TETHER_TLS_SERVER_NAME",
        "TETHER_CONFIG",
    ):
        assert env[key] == scheduler["environment"][key], key
    assert env["TETHER_GATEWAY_URL"] == services["agent"]["environment"]["TETHER_GATEWAY_URL"]
    assert env["TETHER_MODEL_DIR"] == services["merger"]["environment"]["TETHER_MODEL_DIR"]
    assert env["TETHER_RUNHOST_AGENT_WORKERS"] == env["TETHER_RUNHOST_HEALTH_TIMEOUT_S"] == ""
    own, base = mounts(runhost), mounts(scheduler)
    for target in ("/models", "/runs", "/checkpoints", "/etc/tether/tls", "/config/run.yaml"):
        assert own[target]["source"] == base[target]["source"], target
        assert bool(own[target].get("read_only")) == bool(base[target].get("read_only")), target
    assert not own["/runs"].get("read_only") and own["/checkpoints"]["read_only"]
    runs_dir, base_dir = Path(env["TETHER_RUNS_DIR"]), Path(scheduler["environment"]["TETHER_RUN_DIR"])
    assert runs_dir.parent == Path("/runs") and runs_dir != base_dir
    assert runhost["healthcheck"]["test"][-2:] == ["--grpc", f"127.0.0.1:{env['TETHER_RUNHOST_GRPC_PORT']}"]
    deps = runhost["depends_on"]
    assert deps["redis"]["required"] and deps["gateway"]["required"]
    assert {"inference-cpu", "inference", "trainer", "trainer-gpu"} <= set(deps)


def test_runs_settings_reach_inference_and_trainer_only_when_set():
    """TETHER_MAX_RUNS turns LoRA serving on in either inference service, TETHER_LORA_RANK sizes it and
    the trainers' adapters; unset in .env both are empty (unset), so the run config's values hold."""
    pairs = {"cpu": ("inference-cpu", "trainer"), "gpu": ("inference", "trainer-gpu")}
    for profile, (inference, trainer) in pairs.items():
        off = config((profile,))["services"]
        on = config((profile,), TETHER_MAX_RUNS="2", TETHER_LORA_RANK="16")["services"]
        assert (
            off[inference]["environment"]["TETHER_MAX_RUNS"]
            == ""
            == off[trainer]["environment"]["TETHER_LORA_RANK"]
        )
        assert on[inference]["environment"]["TETHER_MAX_RUNS"] == "2"
        assert on[inference]["environment"]["TETHER_LORA_RANK"] == "16"
        assert on[trainer]["environment"]["TETHER_LORA_RANK"] == "16"
        assert "TETHER_MAX_RUNS" not in on[trainer]["environment"]
