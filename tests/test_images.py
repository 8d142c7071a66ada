"""The images (docker/Dockerfile) built for real and checked one by one on a real engine: the engine and
the builds are tests/test_compose.py's fixtures (scripts/docker_engine.sh; the build arguments
docker-compose.yml gives), so the layers are shared with the compose bring-up.

- each image's configuration: user 2000:0, tini as PID 1, STOPSIGNAL SIGTERM, the `tether health`
  HEALTHCHECK and its target, the exposed ports;
- each runs as that user with a read-only root (only /tmp and /cache written), no capabilities and no
  privilege escalation; every service of the image answers `python -m tether.<svc> --help`; the
  `tether` image has no torch, the trainer torch 2.13.0, inference-cpu vLLM 0.32.0 with Tether's plugin;
- the services come up under those restrictions until Docker itself reports them healthy through the
  image's HEALTHCHECK (gateway with a real Redis, agent worker, trainer and vLLM-CPU on the tiny model),
  vLLM-CPU answers a chat completion with token ids, and `docker stop` (SIGTERM) ends each cleanly.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import uuid

import httpx
import pytest
import test_compose as compose_test
from test_dockerfile import PORTS

from tether.common.net import free_port
from tether.common.redis_server import start_embedded_redis

# The image builds (tests/test_compose.py's fixtures) take as long here as there when this file runs alone.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

# tests/test_compose.py's engine (scripts/docker_engine.sh) and builds, shared; `images` is its env.
engine = compose_test.engine
images = compose_test.images
host_env, sh = compose_test.host_env, compose_test.sh

TAG_VARS = {"tether": "TETHER_IMAGE", "trainer": "TRAINER_IMAGE", "inference-cpu": "INFERENCE_CPU_IMAGE"}
SERVICES = {
    "tether": ["gateway", "merger", "scheduler", "agents", "inference"],
    "trainer": ["trainer"],
    "inference-cpu": ["inference"],
}
HEALTH_TARGET = {
    "tether": "http://127.0.0.1:8000/health",
    "trainer": "grpc://127.0.0.1:50053",
    "inference-cpu": "grpc://127.0.0.1:50052",
}
# The restrictions compose runs every service with (docker-compose.yml x-hardening / x-tether).
LOCKED = [
    "--read-only",
    "--cap-drop",
    "ALL",
    "--security-opt",
    "no-new-privileges:true",
    "--tmpfs",
    "/tmp",
    "--tmpfs",
    "/cache:uid=2000,gid=0,mode=0775,exec",
]

ADMIN_TOKEN = "images-test-admin-token"


def tag(target: str) -> str:
    return host_env()[TAG_VARS[target]]


@pytest.mark.parametrize("target", list(TAG_VARS))
def test_image_configuration(images, target):
    cfg = json.loads(sh(["docker", "image", "inspect", tag(target)], images))[0]["Config"]
    assert cfg["User"] == "2000:0"
    assert cfg["Entrypoint"] == ["/usr/bin/tini", "--"]
    assert cfg["StopSignal"] == "SIGTERM"
    assert cfg["Healthcheck"]["Test"] == ["CMD", "tether", "health"]
    assert {int(p.split("/")[0]) for p in cfg["ExposedPorts"]} == PORTS[target]
    env = dict(e.split("=", 1) for e in cfg["Env"])
    assert env["TETHER_HEALTH"] == HEALTH_TARGET[target]
    for var in (
        "HOME",
        "HF_HOME",
        "VLLM_CACHE_ROOT",
        "TRITON_CACHE_DIR",
        "TORCHINDUCTOR_CACHE_DIR",
        "XDG_CACHE_HOME",
    ):
        assert env[var].startswith("/cache"), var
    assert not any(k.startswith("PIP_") for k in env), "pip's build-time settings left in the image"


PROBE = r"""
import importlib.util, json, os, subprocess, sys
def rc(*cmd):
    return subprocess.run(list(cmd), capture_output=True).returncode
def writable(path):
    try:
        open(path, "w").close()
        os.remove(path)
        return True
    except OSError:
        return False
out = {
    "uid": os.getuid(), "gid": os.getgid(),
    "root_writable": writable("/probe"), "cache_writable": writable("/cache/probe"),
    "tmp_writable": writable("/tmp/probe"),
    "help": {s: rc(sys.executable, "-m", "tether." + s, "--help") for s in sys.argv[1].split(",")},
    "health_refused": rc("tether", "health", "--grpc", "127.0.0.1:1", "--timeout", "1"),
    "torch": importlib.util.find_spec("torch") is not None,
    "local_inputs": os.path.exists("/opt/local"),
}
vllm = os.environ.get("TETHER_VLLM_PYTHON")
if vllm:
    out["vllm"] = subprocess.run([vllm, "-c",
        "import vllm, tether_vllm; from importlib.metadata import entry_points; "
        "print(vllm.__version__, [e.name for e in entry_points(group='vllm.endpoint_plugins')])"],
        capture_output=True, text=True).stdout.strip()
print(json.dumps(out))
"""


@pytest.mark.parametrize("target", list(TAG_VARS))
def test_image_runs_locked_down(images, target):
    out = sh(
        ["docker", "run", "--rm", "--network", "none", *LOCKED, tag(target), "python", "-c", PROBE]
        + [",".join(SERVICES[target])],
        images,
        timeout=300,
    )
    got = json.loads(out.strip().splitlines()[-1])
    assert (got["uid"], got["gid"]) == (2000, 0)
    assert not got["root_writable"] and got["cache_writable"] and got["tmp_writable"]
    assert got["help"] == {s: 0 for s in SERVICES[target]}
    assert got["health_refused"] == 1
    assert not got["local_inputs"], "docker/local reached a final image"
    assert got["torch"] is (target == "trainer")
    if target == "trainer":
        version = sh(
            [
                "docker",
                "run",
                "--rm",
                "--network",
                "none",
                *LOCKED,
                tag(target),
                "python",
                "-c",
                "import torch; print(torch.__version__)",
            ],
            images,
        ).strip()
        assert version.startswith("2.13.0")
    if target == "inference-cpu":
        assert got["vllm"].startswith("0.32.0") and "'tether'" in got["vllm"], got["vllm"]


class Containers:
    """Containers this test starts, each removed at the end whatever happened."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env, self.names = env, []

    def run(
        self, image: str, *args: str, env: dict[str, str], name: str, command: tuple[str, ...] = ()
    ) -> str:
        name = f"tether-img-{name}-{uuid.uuid4().hex[:6]}"
        flags = [f"--env={k}={v}" for k, v in env.items()]
        cmd = ["docker", "run", "-d", "--name", name, "--network", "host", "--health-interval", "2s"]
        sh([*cmd, *LOCKED, *flags, *args, image, *command], self.env)
        self.names.append(name)
        return name

    def state(self, name: str) -> dict:
        return json.loads(sh(["docker", "inspect", "--format", "{{json .State}}", name], self.env))

    def wait_healthy(self, name: str, timeout_s: float) -> float:
        t0 = time.monotonic()
        while True:
            st = self.state(name)
            if st.get("Health", {}).get("Status") == "healthy":
                return time.monotonic() - t0
            if st["Status"] != "running" or time.monotonic() - t0 > timeout_s:
                logs = subprocess.run(
                    ["docker", "logs", "--tail", "60", name], env=self.env, capture_output=True, text=True
                )
                tail = (logs.stdout + logs.stderr)[-4000:]
                pytest.fail(f"{name} not healthy ({st['Status']}, {st.get('Health')}):\n{tail}")
            time.sleep(1)

    def stop(self, name: str) -> tuple[int, float]:
        t0 = time.monotonic()
        sh(["docker", "stop", "-t", "60", name], self.env, timeout=120)
        return self.state(name)["ExitCode"], time.monotonic() - t0

    def remove_all(self) -> None:
        for name in self.names:
            subprocess.run(["docker", "rm", "-f", name], env=self.env, capture_output=True, timeout=120)


def test_services_become_healthy_locked_down_and_stop_on_sigterm(images, tmp_path):
    from tether.cli import prepare_calculator_model

    # The tiny model, readable by the images' user (UID 2000, group 0) whatever its files' modes are.
    model = tmp_path / "model"
    shutil.copytree(prepare_calculator_model(0), model)
    for p in [model, *model.iterdir()]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    harness = tmp_path / "harness"
    harness.mkdir()
    (harness / "h.py").write_text("def run(task, base_url, api_key, model):\n    return 1.0\n")
    for p in (tmp_path, harness, harness / "h.py"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    redis_port = free_port()
    redis_proc = start_embedded_redis(tmp_path / "redis", redis_port, tmp_path / "redis.log")
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    ports = {
        k: free_port() for k in ("http", "gw_grpc", "agent", "agent_metrics", "trainer", "inference", "vllm")
    }
    c = Containers(images)
    took: dict[str, float] = {}
    try:
        started = {
            "gateway": c.run(
                tag("tether"),
                name="gateway",
                env={
                    "TETHER_REDIS_URL": redis_url,
                    "TETHER_VLLM_URL": f"http://127.0.0.1:{ports['vllm']}",
                    "TETHER_GATEWAY_PORT": str(ports["http"]),
                    "TETHER_GATEWAY_GRPC_PORT": str(ports["gw_grpc"]),
                    "TETHER_HEALTH": f"http://127.0.0.1:{ports['http']}/health",
                    # The image listens on 0.0.0.0: the gateway refuses to start there without one.
                    "TETHER_ADMIN_TOKEN": ADMIN_TOKEN,
                },
            ),
            "agent": c.run(
                tag("tether"),
                "-v",
                f"{harness}:/harness:ro",
                name="agent",
                command=("python", "-m", "tether.agents"),
                env={
                    "TETHER_REDIS_URL": redis_url,
                    "TETHER_AGENT_FN": "/harness/h.py:run",
                    "TETHER_ADMIN_TOKEN": ADMIN_TOKEN,
                    "TETHER_GATEWAY_URL": f"http://127.0.0.1:{ports['http']}",
                    "TETHER_AGENT_GRPC_PORT": str(ports["agent"]),
                    "TETHER_METRICS_PORT": str(ports["agent_metrics"]),
                    "TETHER_HEALTH": f"grpc://127.0.0.1:{ports['agent']}",
                },
            ),
            "trainer": c.run(
                tag("trainer"),
                "-v",
                f"{model}:/models/calculator:ro",
                "--tmpfs",
                "/checkpoints:uid=2000,gid=0,mode=0775",
                name="trainer",
                env={
                    "TETHER_MODEL_DIR": "/models/calculator",
                    "TETHER_TRAINER_GRPC_PORT": str(ports["trainer"]),
                    "TETHER_HEALTH": f"grpc://127.0.0.1:{ports['trainer']}",
                },
            ),
            "inference-cpu": c.run(
                tag("inference-cpu"),
                "-v",
                f"{model}:/models/calculator:ro",
                "--shm-size",
                "1g",
                name="inference",
                env={
                    "TETHER_MODEL_DIR": "/models/calculator",
                    "TETHER_INFERENCE_GRPC_PORT": str(ports["inference"]),
                    "TETHER_VLLM_HOST": "127.0.0.1",
                    "TETHER_VLLM_PORT": str(ports["vllm"]),
                    "TETHER_HEALTH": f"grpc://127.0.0.1:{ports['inference']}",
                },
            ),
        }
        # Docker's own verdict, through each image's HEALTHCHECK (`tether health` on TETHER_HEALTH).
        for what, timeout_s in (("gateway", 60), ("agent", 60), ("trainer", 180), ("inference-cpu", 420)):
            took[what] = round(c.wait_healthy(started[what], timeout_s), 1)
        reply = httpx.post(
            f"http://127.0.0.1:{ports['vllm']}/v1/chat/completions",
            json={
                "model": "tether-policy",
                "messages": [{"role": "user", "content": "what is 3 + 4 ?"}],
                "max_tokens": 8,
                "return_token_ids": True,
                "logprobs": True,
            },
            timeout=60,
        ).json()
        assert reply["choices"][0]["token_ids"] and reply["prompt_token_ids"]
        metrics = httpx.get(f"http://127.0.0.1:{ports['agent_metrics']}/metrics", timeout=10).text
        assert "tether_agent_rollouts_in_flight" in metrics
        health = httpx.get(f"http://127.0.0.1:{ports['http']}/health", timeout=10).json()
        assert health["status"] == "ok"
        for what, name in started.items():
            code, seconds = c.stop(name)
            assert code == 0, f"{what} exited {code} on SIGTERM"
            assert seconds < 45, f"{what} took {seconds:.0f}s to stop"
        print(json.dumps({"healthy_after_s": took}))
    finally:
        c.remove_all()
        redis_proc.terminate()
        redis_proc.wait(10)
