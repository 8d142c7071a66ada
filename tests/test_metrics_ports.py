"""Every service process serves its metrics: the gateway on its HTTP /metrics (and on TETHER_METRICS_PORT),
inference, trainer, merger and scheduler on TETHER_METRICS_PORT (common/grpc_server.py). Each real
process is started as `python -m tether.<service>`; its scrape must hold every metric docs/metrics.md
gives that process, pass `promtool check metrics`, and tell the truth about the weight version:

- gateway: the version of the run state in Redis (a gateway started mid-run), not 0;
- inference (attached to a vLLM look-alike that serves version 7): 7, read from vLLM;
- scheduler: the broker gauges of the streams in Redis, the configured staleness bound, phase `starting`
  while it waits for the trainer.

- trainer: the version of the checkpoint it resumed from (a tiny model trained two steps first).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import redis
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families
from promtool import check_metrics
from stack_helpers import wait_for
from test_metrics_docs import documented

from tether.common.broker import Keys
from tether.common.net import free_port


@contextlib.contextmanager
def service(name: str, env: dict[str, str], log: Path) -> Iterator[subprocess.Popen]:
    full = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), **env}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", f"tether.{name}"], env=full, stdout=out, stderr=subprocess.STDOUT
        )
        try:
            yield proc
        finally:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def scrape(url: str, proc: subprocess.Popen, log: Path, timeout: float = 60) -> str:
    def answer() -> str | None:
        if proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            resp = httpx.get(url, timeout=5)
        except httpx.HTTPError:
            return None
        return resp.text if resp.status_code == 200 else None

    return wait_for(answer, timeout, url, every_s=0.2)


def families(text: str) -> dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(text: str, name: str, **labels: str) -> float | None:
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and s.labels == labels:
                return s.value
    return None


def assert_exports_its_documented_metrics(process: str, text: str) -> None:
    # A family shows in the exposition (its TYPE line, a counter's with `_total`) even before a labelled
    # metric has a child; prometheus_client adds a `_created` gauge per counter and histogram.
    types = {
        line.split()[2]: line.split()[3]
        for line in text.splitlines()
        if line.startswith("# TYPE tether_") and not line.split()[2].endswith("_created")
    }
    want = {row.name: row.type for row in documented() if process in row.processes}
    assert want and types == want, (sorted(set(types) ^ set(want)), process)
    lint = check_metrics(text)
    problems = [p for p in (lint.stdout + lint.stderr).splitlines() if p.strip() and p not in LINT_KEPT]
    assert not problems and lint.returncode in (0, 3), lint.stdout + lint.stderr


# promtool's lint findings kept on purpose (none).
LINT_KEPT: set[str] = set()


def test_scheduler_serves_broker_and_run_gauges(redis_port, tmp_path):
    r = redis.Redis(port=redis_port, decode_responses=True)
    ns = "mp-sched"
    keys = Keys(ns)
    traces = keys.trace_streams[0]  # one partition of the trace stream; its gauges are labelled by it
    label = keys.short(traces)
    for i in range(5):
        r.xadd(traces, {"data": json.dumps({"i": i})})
    r.xgroup_create(traces, "merger", id="0")
    r.xreadgroup("merger", "c", {traces: ">"}, count=2)
    r.xadd(f"{ns}:dead-letter", {"data": "{}"})
    port = free_port()
    nowhere = [f"127.0.0.1:{free_port()}" for _ in range(3)]  # nothing answers: the run waits
    env = {
        "TETHER_REDIS_URL": f"redis://127.0.0.1:{redis_port}/0",
        "TETHER_NAMESPACE": ns,
        "TETHER_SCHEDULER_GRPC_PORT": str(free_port()),
        "TETHER_GATEWAY_CONTROL_ADDRESS": nowhere[0],
        "TETHER_INFERENCE_ADDRESS": nowhere[1],
        "TETHER_TRAINER_ADDRESS": nowhere[2],
        "TETHER_RUN_ID": "mp",
        "TETHER_RUN_DIR": str(tmp_path / "run"),
        "TETHER_MAX_STALENESS": "3",
        "TETHER_METRICS_PORT": str(port),
        "TETHER_BROKER_METRICS_INTERVAL_S": "0.2",
    }
    log = tmp_path / "scheduler.log"
    with service("scheduler", env, log) as proc:
        url = f"http://127.0.0.1:{port}/metrics"

        def refreshed() -> str | None:
            text = scrape(url, proc, log)
            return text if value(text, "tether_broker_stream_length", stream=label) == 5 else None

        text = wait_for(refreshed, 60, "the broker gauges")
        assert value(text, "tether_broker_group_lag", stream=label, group="merger") == 3
        assert value(text, "tether_broker_group_pending", stream=label, group="merger") == 2
        assert value(text, "tether_broker_dead_letter_entries") == 1
        assert value(text, "tether_run_max_staleness") == 3
        assert value(text, "tether_run_phase", phase="starting") == 1
        assert value(text, "tether_run_phase", phase="training") == 0
        assert_exports_its_documented_metrics("scheduler", text)
        r.xadd(traces, {"data": "{}"})
        wait_for(
            lambda: (
                value(scrape(url, proc, log), "tether_broker_group_lag", stream=label, group="merger") == 4
            ),
            30,
            "the next refresh",
        )
    r.close()


def test_merger_serves_its_metrics(redis_port, tmp_path):
    port = free_port()
    env = {
        "TETHER_REDIS_URL": f"redis://127.0.0.1:{redis_port}/0",
        "TETHER_NAMESPACE": "mp-merger",
        "TETHER_MERGER_GRPC_PORT": str(free_port()),
        "TETHER_TRAINER_ADDRESS": f"127.0.0.1:{free_port()}",
        "TETHER_METRICS_PORT": str(port),
    }
    log = tmp_path / "merger.log"
    with service("merger", env, log) as proc:
        assert_exports_its_documented_metrics("merger", scrape(f"http://127.0.0.1:{port}/metrics", proc, log))


def test_inference_serves_the_version_vllm_reports(tmp_path):
    from fakes.vllm_control import FakeVLLMControl, serve

    fake = FakeVLLMControl({})
    fake.version = "7"  # an adapter (re)started next to a vLLM that already serves version 7
    port = free_port()
    with serve(fake.app) as vllm_url:
        vllm_port = vllm_url.rsplit(":", 1)[1]
        env = {
            "TETHER_INFERENCE_GRPC_PORT": str(free_port()),
            "TETHER_VLLM_LAUNCH": "false",
            "TETHER_VLLM_PORT": vllm_port,
            "TETHER_METRICS_PORT": str(port),
        }
        log = tmp_path / "inference.log"
        with service("inference", env, log) as proc:
            url = f"http://127.0.0.1:{port}/metrics"
            text = wait_for(
                lambda: (
                    (t := scrape(url, proc, log)) and value(t, "tether_inference_weight_version") == 7 and t
                ),
                30,
                "version 7",
            )
            assert_exports_its_documented_metrics("inference", text)


def test_gateway_serves_metrics_on_http_and_its_port_at_the_run_version(redis_port, tmp_path):
    ns = "mp-gw"
    r = redis.Redis(port=redis_port, decode_responses=True)
    r.hset(f"{ns}:run", mapping={"weight_version": "5", "status": '"rolling_out"'})
    http, port = free_port(), free_port()
    env = {
        "TETHER_REDIS_URL": f"redis://127.0.0.1:{redis_port}/0",
        "TETHER_NAMESPACE": ns,
        "TETHER_VLLM_URL": f"http://127.0.0.1:{free_port()}",
        "TETHER_GATEWAY_PORT": str(http),
        "TETHER_GATEWAY_GRPC_PORT": str(free_port()),
        "TETHER_METRICS_PORT": str(port),
    }
    log = tmp_path / "gateway.log"
    with service("gateway", env, log) as proc:
        for url in (f"http://127.0.0.1:{http}/metrics", f"http://127.0.0.1:{port}/metrics"):
            text = scrape(url, proc, log)
            assert value(text, "tether_gateway_weight_version") == 5, url
            assert_exports_its_documented_metrics("gateway", text)
    r.close()


def test_trainer_serves_its_metrics_at_the_version_it_resumed(tmp_path):
    """Two steps trained (in this process, by the service's own build path) into a checkpoint folder: a
    trainer process started on it exports version 2 at once, and it goes to 3 with the next step."""
    from test_trainer_resume import _core, _groups, _train, tiny_model_dir

    model_dir = tiny_model_dir(tmp_path / "model")
    core = _core(model_dir, tmp_path / "ckpt")
    for group in _groups(2):
        core.submit(*group)
    _train(core, 1)
    single = {"run": ""}  # the single policy's series (Prometheus stores it unlabelled)
    assert REGISTRY.get_sample_value("tether_trainer_weight_version", single) == 1 == core.version
    _train(core, 2)
    assert REGISTRY.get_sample_value("tether_trainer_weight_version", single) == 2
    del core
    port = free_port()
    env = {
        "TETHER_TRAINER_GRPC_PORT": str(free_port()),
        "TETHER_MODEL_DIR": str(model_dir),
        "TETHER_CHECKPOINT_DIR": str(tmp_path / "ckpt"),
        "TETHER_DEVICE": "cpu",
        "TETHER_METRICS_PORT": str(port),
    }
    log = tmp_path / "trainer.log"
    with service("trainer", env, log) as proc:
        text = scrape(f"http://127.0.0.1:{port}/metrics", proc, log, timeout=180)
        assert value(text, "tether_trainer_weight_version", run="") == 2
        assert_exports_its_documented_metrics("trainer", text)
