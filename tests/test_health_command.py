"""`tether health` (tether.common.health), the images' HEALTHCHECK, run as the command it is against real
servers: a gRPC health server from tether.common.grpc_server, the real gateway in-process (its /health
and its gRPC health while admission is paused), vLLM's look-alike answering /health with a chosen
status, the real agent worker process (its gRPC health follows Redis), and — slow — the real inference
adapter in front of real vLLM-CPU while vLLM sleeps, is paused and loads weights. Pausing, sleeping and
pushing weights are normal states: health must stay SERVING through them.

Also: every bad argument is refused with exit 1 and one line (Docker reserves exit 2), and the command
imports nothing heavy (it runs every few seconds in every container).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest
from fakes.vllm_openai import FakeVLLM
from gateway_helpers import InProcessGateway, gateway_settings

from tether.common.grpc_server import start_server
from tether.common.net import free_port
from tether.common.redis_server import start_embedded_redis
from tether.v1 import gateway_pb2

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "services")}
ENV.pop("TETHER_HEALTH", None)
# What the health command must never import (pydantic: the services' settings; the rest: heavy).
HEAVY = {"pydantic", "pydantic_settings", "fastapi", "httpx", "redis", "numpy", "torch", "transformers"}


def health(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`tether health ARGS` as a container runs it (the console script's entry point)."""
    return subprocess.run(
        [sys.executable, "-c", "from tether.cli import main; main()", "health", *args],
        env={**ENV, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
    )


def assert_healthy(*args: str, env: dict[str, str] | None = None) -> None:
    r = health(*args, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""


def assert_unhealthy(*args: str, says: str, env: dict[str, str] | None = None) -> str:
    r = health(*args, env=env)
    assert r.returncode == 1, (r.returncode, r.stderr)
    line = r.stderr.strip()
    assert "\n" not in line and says in line, line
    return line


class HealthServer:
    """A grpc.aio server with tether's health servicer (start_server), on its own event loop thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> HealthServer:
        self.thread.start()
        self.server, self.health, port = self._run(start_server(0, lambda _s: ["tether.v1.Thing"]))
        self.address = f"127.0.0.1:{port}"
        return self

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def set(self, serving: bool) -> None:
        self._run(self.health.set(serving))

    def __exit__(self, *exc) -> None:
        self._run(self.server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def grpc_health():
    with HealthServer() as server:
        yield server


# -- gRPC --------------------------------------------------------------------------------------------------


def test_grpc_serving_is_healthy_and_not_serving_is_not(grpc_health):
    grpc_health.set(True)
    assert_healthy("--grpc", grpc_health.address)
    assert_healthy("--grpc", grpc_health.address, "--service", "tether.v1.Thing")
    grpc_health.set(False)
    assert_unhealthy("--grpc", grpc_health.address, says="NOT_SERVING")
    assert_unhealthy("--grpc", grpc_health.address, "--service", "tether.v1.Thing", says="NOT_SERVING")
    grpc_health.set(True)
    assert_healthy("--grpc", grpc_health.address)


def test_grpc_unknown_service_and_closed_port_are_unhealthy(grpc_health):
    grpc_health.set(True)
    assert_unhealthy("--grpc", grpc_health.address, "--service", "no.Such", says="no health status")
    assert_unhealthy("--grpc", f"127.0.0.1:{free_port()}", "--timeout", "1", says="UNAVAILABLE")


def test_grpc_target_from_the_environment(grpc_health):
    grpc_health.set(True)
    assert_healthy(env={"TETHER_HEALTH": f"grpc://{grpc_health.address}"})
    assert_healthy(env={"TETHER_HEALTH": f"grpc://{grpc_health.address}/tether.v1.Thing"})
    grpc_health.set(False)
    assert_unhealthy(env={"TETHER_HEALTH": f"grpc://{grpc_health.address}"}, says="NOT_SERVING")
    grpc_health.set(True)


def test_a_hung_server_is_unhealthy_within_the_timeout():
    """A port that accepts and never answers (a wedged process) fails after --timeout, not never."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        t0 = time.monotonic()
        assert_unhealthy("--grpc", f"127.0.0.1:{s.getsockname()[1]}", "--timeout", "1", says="gRPC")
        assert_unhealthy(
            "--http", f"http://127.0.0.1:{s.getsockname()[1]}/health", "--timeout", "1", says="GET"
        )
        assert time.monotonic() - t0 < 20


# -- HTTP --------------------------------------------------------------------------------------------------


def test_http_200_is_healthy_and_anything_else_is_not():
    with FakeVLLM() as server:
        url = f"{server.url}/health"
        assert_healthy("--http", url)
        assert_healthy(env={"TETHER_HEALTH": url})
        server.health_status = 503
        line = assert_unhealthy("--http", url, says="503")
        assert "unhealthy" in line
        server.health_status = 200
        assert_healthy("--http", url)
    assert_unhealthy("--http", url, "--timeout", "1", says="refused")


def test_gateway_stays_healthy_while_admission_is_paused(redis_port, vllm):
    """The gateway's HTTP /health and its gRPC health, the two a HEALTHCHECK may ask: paused around a
    weight push is routine, so both stay healthy; and they answer while the pause drains."""
    with InProcessGateway(gateway_settings(redis_port, vllm.url)) as gw:
        grpc_address = f"127.0.0.1:{gw.server.grpc_port}"
        assert_healthy("--http", f"{gw.url}/health")
        assert_healthy("--grpc", grpc_address)
        status = gw.control.PauseAdmission(gateway_pb2.PauseAdmissionRequest(drain_timeout_s=5))
        assert status.paused
        assert gw.http.get("/health").json()["paused"] is True
        assert_healthy("--http", f"{gw.url}/health")
        assert_healthy("--grpc", grpc_address)
        assert_healthy("--grpc", grpc_address, "--service", "tether.v1.GatewayControl")
        gw.resume(1)
        assert_healthy("--http", f"{gw.url}/health")


# -- refusals ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, says",
    [
        ((), "give --grpc HOST:PORT or --http URL"),
        (("--grpc", "127.0.0.1:1", "--http", "http://x/"), "not allowed with"),
        (("--grpc", "127.0.0.1"), "HOST:PORT"),
        (("--grpc", ":50051"), "HOST:PORT"),
        (("--grpc", "127.0.0.1:0"), "1..65535"),
        (("--grpc", "127.0.0.1:70000"), "1..65535"),
        (("--grpc", "127.0.0.1:http"), "HOST:PORT"),
        (("--http", "ftp://127.0.0.1/health"), "http:// or https://"),
        (("--http", "127.0.0.1:8000/health"), "http:// or https://"),
        (("--http", "http://127.0.0.1:99999/health"), "out of range"),
        (("--http", "http://127.0.0.1:8000/health", "--service", "x"), "--service goes with --grpc"),
        (("--grpc", "127.0.0.1:1", "--timeout", "0"), "--timeout"),
        (("--grpc", "127.0.0.1:1", "--timeout", "-1"), "--timeout"),
        (("--grpc", "127.0.0.1:1", "--timeout", "nan"), "--timeout"),
        (("--grpc", "127.0.0.1:1", "--timeout", "soon"), "invalid float"),
        (("--bogus",), "unrecognized arguments"),
        (("--grpc",), "expected one argument"),
    ],
)
def test_bad_arguments_are_refused_with_exit_1(args, says):
    line = assert_unhealthy(*args, says=says)
    assert line.startswith("tether health: "), line


@pytest.mark.parametrize(
    "value", ["127.0.0.1:50051", "grpc://127.0.0.1", "grpc://:1", "tcp://127.0.0.1:1", "http://"]
)
def test_a_bad_target_in_the_environment_is_refused(value):
    assert_unhealthy(env={"TETHER_HEALTH": value}, says="tether health: ")


def test_help_lists_the_options():
    r = health("--help")
    assert r.returncode == 0
    assert "--grpc" in r.stdout and "--http" in r.stdout and "--service" in r.stdout
    r = subprocess.run(
        [sys.executable, "-m", "tether.cli", "--help"], env=ENV, capture_output=True, text=True, timeout=60
    )
    assert "health" in r.stdout


# -- light ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["grpc", "http"])
def test_the_command_imports_nothing_heavy(grpc_health, kind):
    grpc_health.set(True)
    target = (
        ["--grpc", grpc_health.address] if kind == "grpc" else ["--http", f"http://127.0.0.1:{free_port()}/"]
    )
    code = (
        "import json, sys\n"
        "from tether.cli import main\n"
        f"sys.argv = ['tether', 'health', *{target!r}, '--timeout', '1']\n"
        "try:\n    main()\nexcept SystemExit as e:\n    code = e.code\n"
        "print(json.dumps([code, sorted({m.split('.')[0] for m in sys.modules})]))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=60)
    exit_code, modules = json.loads(r.stdout.strip().splitlines()[-1])
    assert exit_code == (0 if kind == "grpc" else 1), r.stderr
    assert not HEAVY & set(modules), sorted(HEAVY & set(modules))


# -- the agent worker -------------------------------------------------------------------------------------


def test_agent_worker_serves_health_that_follows_redis_and_metrics(tmp_path):
    """The worker's gRPC health (TETHER_AGENT_GRPC_PORT): SERVING while Redis answers, NOT_SERVING once
    it is gone; its /metrics (TETHER_METRICS_PORT); SIGTERM stops it cleanly."""
    redis_port = free_port()
    redis_proc = start_embedded_redis(tmp_path / "redis", redis_port, tmp_path / "redis.log")
    harness = tmp_path / "harness.py"
    harness.write_text("def run(task, base_url, api_key, model):\n    return 1.0\n")
    grpc_port, metrics_port = free_port(), free_port()
    env = {
        **ENV,
        "TETHER_REDIS_URL": f"redis://127.0.0.1:{redis_port}/0",
        "TETHER_AGENT_FN": f"{harness}:run",
        "TETHER_GATEWAY_URL": f"http://127.0.0.1:{free_port()}",
        "TETHER_AGENT_GRPC_PORT": str(grpc_port),
        "TETHER_METRICS_PORT": str(metrics_port),
    }
    worker = subprocess.Popen(
        [sys.executable, "-m", "tether.agents"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    address = f"127.0.0.1:{grpc_port}"
    try:
        _wait(lambda: health("--grpc", address).returncode == 0, 60, worker)
        metrics = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
        assert "tether_agent_rollouts_in_flight 0.0" in metrics
        redis_proc.terminate()
        redis_proc.wait(10)
        _wait(lambda: health("--grpc", address).returncode == 1, 30, worker)
        assert "NOT_SERVING" in health("--grpc", address).stderr
        worker.send_signal(signal.SIGTERM)
        worker.wait(30)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(10)
        if redis_proc.poll() is None:
            redis_proc.terminate()
            redis_proc.wait(10)
    out = worker.stdout.read().decode() if worker.stdout else ""
    # Stopped by the signal while Redis is gone: the worker's read loop was cancelled, not failed.
    assert worker.returncode == 0, out[-3000:]


def test_agent_worker_default_port_is_the_fixed_one():
    from tether.agents.main import AgentSettings

    s = AgentSettings(redis_url="redis://x:1/0", agent_fn="m:f", gateway_url="http://x")
    assert (s.agent_grpc_host, s.agent_grpc_port) == ("127.0.0.1", 50056)


def _wait(ok, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        if proc is not None and proc.poll() is not None:
            out = proc.stdout.read().decode() if proc.stdout else ""
            pytest.fail(f"process exited with {proc.returncode}: {out[-3000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"not within {timeout_s} s")
        time.sleep(0.3)


# -- the inference adapter in front of real vLLM-CPU (slow) ---------------------------------------------------


@pytest.mark.slow
def test_inference_adapter_stays_healthy_while_vllm_sleeps_pauses_and_loads_weights(vllm_url, tmp_path):
    from tether.cli import prepare_calculator_model
    from tether.v1 import inference_pb2, inference_pb2_grpc, types_pb2

    port = free_port()
    vllm_port = int(vllm_url.rsplit(":", 1)[1])
    env = {
        **ENV,
        "TETHER_INFERENCE_GRPC_PORT": str(port),
        "TETHER_VLLM_LAUNCH": "false",
        "TETHER_VLLM_PORT": str(vllm_port),
    }
    adapter = subprocess.Popen(
        [sys.executable, "-m", "tether.inference"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    address = f"127.0.0.1:{port}"
    failures: list[str] = []
    stop = threading.Event()

    def poll() -> None:  # the HEALTHCHECK, every half second, through everything below
        while not stop.is_set():
            r = health("--grpc", address, "--timeout", "5")
            if r.returncode != 0:
                failures.append(r.stderr.strip())
            stop.wait(0.5)

    try:
        _wait(lambda: health("--grpc", address).returncode == 0, 60, adapter)
        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        with grpc.insecure_channel(address) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            stub.Sleep(inference_pb2.SleepRequest(level=1), timeout=120)
            assert httpx.get(f"{vllm_url}/is_sleeping", timeout=10).json()["is_sleeping"] is True
            time.sleep(3)
            assert_healthy("--grpc", address)
            stub.WakeUp(types_pb2.Empty(), timeout=120)
            stub.Pause(inference_pb2.PauseRequest(mode="keep"), timeout=60)
            time.sleep(2)
            assert_healthy("--grpc", address)
            stub.Resume(types_pb2.Empty(), timeout=60)
            model_dir = str(prepare_calculator_model(0))
            for version in (1, 2):  # path 1: pause, reload from disk, reset the prefix cache, resume
                done = stub.LoadWeights(
                    inference_pb2.LoadWeightsRequest(checkpoint_dir=model_dir, version=version), timeout=300
                )
                assert done.version == version
            time.sleep(1)
        stop.set()
        poller.join(30)
        assert not failures, failures
        assert_healthy("--grpc", address)
    finally:
        stop.set()
        adapter.send_signal(signal.SIGTERM)
        try:
            adapter.wait(30)
        except subprocess.TimeoutExpired:
            adapter.kill()
            adapter.wait(10)
