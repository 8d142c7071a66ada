"""docker-compose.yml brought up for real: a Docker engine from Debian's packages
(scripts/docker_engine.sh), the images built from this repository on a locally built base, then
`docker compose --profile cpu --profile monitoring up` on the host network (docker/compose.host.yml:
no bridge network may be created here; Grafana left out, no image of it can be had offline).

It trains the calculator demo, kills Redis with SIGKILL mid-run (Docker restarts it by its restart
policy; AOF with appendfsync always) and checks that no stream entry was lost and that the run goes
on; then checks the steps, rewards and weight versions (`tether metrics`, `tether samples`) and that
Prometheus scraped every target, and every metric the dashboards and alerts use (when
scripts/dashboards.py is there). It leaves nothing running: `down -v`, then the engine is stopped
(unless it was running before the test; its data folder stays, a cache of the built layers).

Each phase prints its duration; the last line is one JSON object with the figures.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import secrets
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import grpc
import pytest
import redis
from compose_helpers import HOST_ENV, ROOT, compose_args, compose_env, config

# Cold (no cached layers: a new machine) the builds alone take about ten minutes on 2 cores.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

ENGINE = ROOT / "scripts" / "docker_engine.sh"
PROJECT = "tether-compose-test"
NAMESPACE = "tether-compose-test"
RUN_ID = "compose-test"
# Small and quick on 2 cores: 4 tasks x 4 rollouts a step (a few seconds); Redis is killed after the
# 2nd step, and the run must train 3 more after it came back.
STEPS = 10
KILL_AFTER_STEP = 2
STEPS_AFTER_KILL = 3
MIN_STEPS = 5
RUN_SETTINGS = {
    "TETHER_RUN_ID": RUN_ID,
    "TETHER_NAMESPACE": NAMESPACE,
    "TETHER_STEPS": str(STEPS),
    "TETHER_TASKS_PER_STEP": "4",
    "TETHER_GROUP_SIZE": "4",
    "TETHER_EVAL_REPEATS": "1",
    "TETHER_AGENT_CONCURRENCY": "16",
    # A step whose rollouts were lost would wait this long: the test then fails on the steps' rewards.
    "TETHER_STEP_TIMEOUT_S": "120",
}
# The images to build (target: the variable naming its tag in docker/compose.host.env); their build
# arguments are those docker-compose.yml gives its services, so the test builds what compose would.
IMAGES = {"inference-cpu": "INFERENCE_CPU_IMAGE", "trainer": "TRAINER_IMAGE", "tether": "TETHER_IMAGE"}
BASE = "local/python:3.11-bookworm"
PROMETHEUS_JOBS = {"gateway", "vllm", "inference", "trainer", "merger", "scheduler", "agent"}
# The run host's job: its profile (runs) is not started here, so its target is down.
NOT_STARTED_JOBS = {"runhost"}

FIGURES: dict[str, object] = {}


@contextlib.contextmanager
def phase(name: str):
    t0 = time.monotonic()
    print(f"[compose] {name} ...", flush=True)
    try:
        yield
    finally:
        dt = round(time.monotonic() - t0, 1)
        FIGURES[f"{name}_s"] = dt
        print(f"[compose] {name}: {dt:.1f}s", flush=True)


def host_env() -> dict[str, str]:
    """docker/compose.host.env as a dict (the Redis port the test connects to, the image names)."""
    out = {}
    for line in HOST_ENV.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            k, _, v = line.partition("=")
            out[k.strip()] = v.strip()
    return out


def engine_env() -> dict[str, str]:
    """This process's environment pointed at the engine (what `docker_engine.sh env` prints)."""
    out = subprocess.run(["bash", str(ENGINE), "env"], capture_output=True, text=True, check=True).stdout
    env = dict(os.environ)
    for line in out.splitlines():
        key, _, value = line.removeprefix("export ").partition("=")
        env[key] = value.strip('"').replace("$PATH", os.environ.get("PATH", ""))
    return env


def sh(args: list[str], env: dict[str, str], timeout: float = 600, check: bool = True, **kw) -> str:
    res = subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout, **kw)
    if check and res.returncode != 0:
        raise AssertionError(
            f"{' '.join(args)} exited {res.returncode}:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
        )
    return res.stdout


@pytest.fixture(scope="module")
def engine():
    """A running engine (started here unless one answers already) with the local base, Redis and
    Prometheus images; stopped at the end when this test started it."""
    env = engine_env()
    was_running = subprocess.run(["bash", str(ENGINE), "status"], env=env).returncode == 0
    with phase("engine_start"):
        sh(["bash", str(ENGINE), "start"], env, timeout=300)
    try:
        with phase("base_images"):
            sh(["bash", str(ENGINE), "images"], env, timeout=900)
        yield env
    finally:
        if not was_running:
            with phase("engine_stop"):
                sh(["bash", str(ENGINE), "stop"], env, timeout=120)
            left = subprocess.run(["bash", str(ENGINE), "status"], env=env)
            assert left.returncode != 0, "the engine still answers after stop"


@pytest.fixture(scope="module")
def images(engine):
    """tether, trainer and inference-cpu built from this checkout on the local base (cached layers)."""
    env = engine
    # docker/local: this machine's CA bundle and local wheels for pip inside the builds (its README).
    local = ROOT / "scripts" / "docker_local.sh"
    if local.exists():
        sh(["bash", str(local)], env, timeout=300)
    builds = {
        s["build"]["target"]: s["build"]
        for s in config(("cpu", "monitoring"))["services"].values()
        if s.get("build")
    }
    tags = host_env()
    with phase("build"):
        # inference-cpu first: the classic builder builds every stage before the target, so the
        # tether and trainer builds after it find theirs in the cache.
        for target, tag_var in IMAGES.items():
            build = builds[target]
            cmd = ["docker", "build", "--network", "host", "-f", build["dockerfile"], "--target", target]
            cmd += ["--build-arg", f"BASE={BASE}", "-t", tags[tag_var]]
            for k, v in sorted((build.get("args") or {}).items()):
                cmd += ["--build-arg", f"{k}={v}"]
            t0 = time.monotonic()
            before = image_id(env, tags[tag_var])
            sh([*cmd, "."], env, timeout=3000)
            # The image this build replaced, with its own layers (those it shares with the new one stay):
            # the data folder is a cache kept between runs and must not grow with each. Not `docker
            # image prune`: the classic builder's stage outputs are untagged too, and they are the cache.
            if before and before != image_id(env, tags[tag_var]):
                sh(["docker", "rmi", before], env, check=False)
            FIGURES[f"build_{target}_s"] = round(time.monotonic() - t0, 1)
            print(f"[compose] built {tags[tag_var]} in {FIGURES[f'build_{target}_s']}s", flush=True)
    return env


def image_id(env: dict[str, str], tag: str) -> str:
    res = subprocess.run(
        ["docker", "image", "inspect", "-f", "{{.Id}}", tag], env=env, capture_output=True, text=True
    )
    return res.stdout.strip() if res.returncode == 0 else ""


def compose(env: dict[str, str], *args: str, timeout: float = 600, check: bool = True) -> str:
    return sh([*compose_args(("cpu", "monitoring"), host=True, project=PROJECT), *args], env, timeout, check)


def container_id(env: dict[str, str], service: str) -> str:
    out = compose(env, "ps", "-q", service).strip()
    assert out, f"no container for {service}"
    return out.splitlines()[0]


def inspect(env: dict[str, str], cid: str, fmt: str) -> str:
    return sh(["docker", "inspect", "-f", fmt, cid], env).strip()


def wait_for(what: str, fn, timeout_s: float, every_s: float = 2.0, on_timeout=None):
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            last = fn()
        except (redis.RedisError, OSError, ValueError) as exc:  # not up yet
            last = exc
        else:
            if last:
                return last
        time.sleep(every_s)
    extra = on_timeout() if on_timeout else ""
    raise AssertionError(f"{what}: not within {timeout_s:.0f}s (last: {last!r})\n{extra}")


def streams(r: redis.Redis) -> dict[str, list[str]]:
    """Every stream of the run's namespace and its entry ids."""
    out = {}
    for key in r.scan_iter(match=f"{NAMESPACE}:*", _type="stream", count=1000):
        out[key] = [eid for eid, _ in r.xrange(key)]
    return out


def run_state(r: redis.Redis) -> dict:
    raw = r.hgetall(f"{NAMESPACE}:run")
    return {k: json.loads(v) for k, v in raw.items()}


def prometheus(path: str, **params: str):
    url = f"http://127.0.0.1:{host_env()['PROMETHEUS_PORT']}{path}"
    if params:
        url += "?" + urllib.parse.urlencode(params)
    with urllib.request.urlopen(url, timeout=10) as resp:
        body = json.loads(resp.read())
    assert body["status"] == "success", body
    return body["data"]


def dashboard_metrics() -> tuple[set[str], set[str]] | None:
    """HOOK: every metric a Grafana panel or a Prometheus alert uses, and those of them only a stack
    with runs side by side exports (its gateway's per-run series), from scripts/dashboards.py's
    used_metrics() and RUNS_ONLY_METRICS (the dashboards' generator); None when that script is not in
    this checkout."""
    script = ROOT / "scripts" / "dashboards.py"
    if not script.exists():
        return None
    spec = importlib.util.spec_from_file_location("tether_dashboards_script", script)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return set(module.used_metrics()), set(module.RUNS_ONLY_METRICS)


def tether_cli(*args: str) -> list[dict]:
    exe = Path(sys.executable).parent / "tether"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "services")}
    out = subprocess.run(
        [str(exe), *args], env=env, capture_output=True, text=True, timeout=120, check=True
    ).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def scheduler_without_token(port: int) -> tuple[object, bool]:
    """GetRun on the scheduler with no service token (its status code), and whether its gRPC
    health still answers SERVING to the same bare caller."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from tether.v1 import scheduler_pb2_grpc, types_pb2

    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        try:
            scheduler_pb2_grpc.SchedulerStub(ch).GetRun(types_pb2.Empty(), timeout=10)
            code: object = "answered"
        except grpc.RpcError as exc:
            code = exc.code()
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
    return code, reply.status == health_pb2.HealthCheckResponse.SERVING


def test_compose_cpu_stack_trains_survives_redis_kill_and_is_scraped(images):
    env = images
    started = time.monotonic()
    secrets_ = {
        "TETHER_ADMIN_TOKEN": secrets.token_urlsafe(24),
        "TETHER_SERVICE_TOKEN": secrets.token_urlsafe(24),
        "REDIS_PASSWORD": secrets.token_urlsafe(24),
        "GRAFANA_ADMIN_PASSWORD": secrets.token_urlsafe(24),
    }
    cenv = {
        **compose_env(secrets_, **RUN_SETTINGS),
        **{k: env[k] for k in ("PATH", "DOCKER_HOST", "DOCKER_CONFIG")},
    }
    redis_port = int(host_env()["REDIS_PORT"])
    redis_url = f"redis://:{secrets_['REDIS_PASSWORD']}@127.0.0.1:{redis_port}/0"

    def logs() -> str:
        return compose(cenv, "logs", "--no-color", "--tail", "40", check=False)[-12000:]

    compose(cenv, "down", "-v", "--remove-orphans", "-t", "5", check=False)  # a previous run's leftovers
    try:
        r = redis.Redis.from_url(redis_url, decode_responses=True)

        def steps_done() -> int:
            return int(run_state(r).get("next_step", 0))

        with phase("up"):
            # depends_on makes `up` wait for each service's dependencies (healthy, or model-init done);
            # the scheduler starts last and the run starts with it.
            compose(cenv, "up", "-d", "--no-build", timeout=1200)
        with phase("train_before_kill"):
            # Polled often: a step takes seconds, and Redis must die while the run still has steps to go.
            wait_for(
                f"{KILL_AFTER_STEP} steps",
                lambda: steps_done() >= KILL_AFTER_STEP,
                900,
                0.25,
                on_timeout=logs,
            )

        with phase("redis_kill_restart"):
            cid = container_id(cenv, "redis")
            restarts = int(inspect(cenv, cid, "{{.RestartCount}}"))
            before = streams(r)
            killed_at = run_state(r)
            pid = int(inspect(cenv, cid, "{{.State.Pid}}"))
            assert pid > 1
            os.kill(pid, 9)  # kill -9 of the container's process: a crash, which restart: on-failure restarts
            r.close()
            wait_for(
                "Redis restarted by its restart policy",
                lambda: (
                    int(inspect(cenv, cid, "{{.RestartCount}}")) > restarts
                    and inspect(cenv, cid, "{{.State.Health.Status}}") == "healthy"
                ),
                120,
                1.0,
                on_timeout=logs,
            )
            r = redis.Redis.from_url(redis_url, decode_responses=True)
            after = streams(r)
        assert before, "no streams before the kill"
        lost = {}
        for key, ids in before.items():
            kept = [eid for eid, _ in r.xrange(key, max=ids[-1])] if ids else []
            if kept != ids:
                lost[key] = sorted(set(ids) - set(kept))
        assert lost == {}, f"stream entries lost by the kill: {lost}"
        FIGURES["streams_checked"] = {k.removeprefix(NAMESPACE + ":"): len(v) for k, v in before.items()}
        assert set(after) >= set(before)

        # The run was mid-way when Redis died, and trains on after it came back.
        assert killed_at["status"] not in ("done", "evaluating") and killed_at["next_step"] < STEPS, killed_at
        FIGURES["killed_at_step"] = killed_at["next_step"]
        with phase("train_after_kill"):
            wait_for(
                f"{STEPS_AFTER_KILL} more steps (the run goes on after Redis came back)",
                lambda: steps_done() >= max(MIN_STEPS, killed_at["next_step"] + STEPS_AFTER_KILL),
                900,
                on_timeout=logs,
            )
            wait_for("every service healthy", lambda: all_healthy(cenv), 300, on_timeout=logs)
        state = run_state(r)
        FIGURES["steps"] = state["next_step"]
        # The services speak gRPC only with the service token: a bare call is refused, health is not.
        refused, health_ok = scheduler_without_token(int(host_env()["SCHEDULER_PORT"]))
        assert refused == grpc.StatusCode.UNAUTHENTICATED and health_ok, (refused, health_ok)
        FIGURES["weight_version"] = state["weight_version"]

        # The run's records through the CLI, against the compose Redis.
        metrics = tether_cli("metrics", "--redis-url", redis_url, "--namespace", NAMESPACE)
        steps = [m for m in metrics if "step" in m]
        assert len(steps) >= MIN_STEPS, metrics
        rewards = [m["reward_mean"] for m in steps]
        FIGURES["reward_mean_by_step"] = [None if x is None else round(x, 3) for x in rewards]
        FIGURES["rollouts_by_step"] = [m.get("rollouts") for m in steps]
        # Every step rolled out and was rewarded, the steps after the kill too: none lost its rollouts
        # (a NaN/None reward_mean is a step with no rollout back before its timeout).
        assert all(x is not None and 0.0 <= x <= 1.0 for x in rewards), rewards
        # colocated-sync: each step's new weights are pushed before the next step rolls out.
        versions = [m["weight_version"] for m in steps]
        assert versions == sorted(versions) and versions[-1] >= MIN_STEPS, versions
        samples = tether_cli("samples", "--redis-url", redis_url, "--namespace", NAMESPACE)
        assert samples, "no samples"
        assert all(0.0 <= s["reward"] <= 1.0 for s in samples)
        sample_versions = {s["weight_version"] for s in samples}
        # Samples were drawn by the pushed weights, not only by the initial ones.
        assert max(sample_versions) >= MIN_STEPS - 1, sample_versions
        FIGURES["samples"] = len(samples)

        with phase("scrape"):

            def targets_up():
                active = prometheus("/api/v1/targets")["activeTargets"]
                jobs = {t["labels"]["job"]: t["health"] for t in active}
                jobs = {j: h for j, h in jobs.items() if j not in NOT_STARTED_JOBS}
                return jobs if set(jobs) == PROMETHEUS_JOBS and set(jobs.values()) == {"up"} else None

            wait_for(
                "every Prometheus target up",
                targets_up,
                120,
                on_timeout=lambda: json.dumps(prometheus("/api/v1/targets")["activeTargets"], indent=1)[
                    -4000:
                ],
            )
            up = prometheus("/api/v1/query", query="up")["result"]
            FIGURES["targets_up"] = sorted(s["metric"]["job"] for s in up if s["value"][1] == "1")
            up = [s for s in up if s["metric"]["job"] not in NOT_STARTED_JOBS]
            assert {s["metric"]["job"]: s["value"][1] for s in up} == {j: "1" for j in PROMETHEUS_JOBS}
            names = set(prometheus("/api/v1/label/__name__/values"))
            FIGURES["series_names"] = len(names)
            assert any(n.startswith("vllm:") for n in names), "vLLM's own metrics were not scraped"
            queried = dashboard_metrics()
            if queried is None:
                FIGURES["dashboard_metrics"] = "scripts/dashboards.py not in this checkout"
            else:
                # This stack runs no run side by side (the `runs` profile is not up): the gateway's
                # per-run series are not born, and only they may be missing.
                used, runs_only = queried
                assert runs_only <= used, sorted(runs_only - used)
                missing = sorted(used - names - runs_only)
                FIGURES["dashboard_metrics"] = (
                    f"{len(used & names)}/{len(used)} found, {len(runs_only - names)} of the runs' own absent"
                )
                assert missing == [], f"metrics the dashboards or alerts use, not in the scrape: {missing}"
    finally:
        with phase("down"):
            compose(cenv, "down", "-v", "--remove-orphans", "-t", "20", timeout=300, check=False)
        left = sh(["docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={PROJECT}"], cenv)
        FIGURES["total_s"] = round(time.monotonic() - started, 1)
        print("[compose] figures: " + json.dumps(FIGURES), flush=True)
    assert left.strip() == "", f"containers left: {left}"


def all_healthy(env: dict[str, str]) -> bool:
    """Every long-running service's container healthy, model-init exited 0; raises on one that died."""
    rows = [
        json.loads(line) for line in compose(env, "ps", "-a", "--format", "json").splitlines() if line.strip()
    ]
    by_service = {row["Service"]: row for row in rows}
    if "model-init" in by_service and by_service["model-init"]["State"] == "exited":
        assert by_service["model-init"]["ExitCode"] == 0, f"model-init failed: {by_service['model-init']}"
    services = {"redis", "inference-cpu", "trainer", "merger", "gateway", "scheduler", "agent", "prometheus"}
    missing = services - set(by_service)
    if missing:
        return False
    return all(by_service[s].get("Health") == "healthy" for s in services)
