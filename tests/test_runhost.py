"""The run host (services/tether/runhost): the registry's runs' services as its children, for compose and
the chart. Its /metrics merges every hosted service's page, labelled by run and service (pure, and
checked by promtool); the real process starts a run's services, fails the one whose service gives up,
drains a stopped one and one whose scheduler is done, leaves the registry as it is when stopped itself, and a new run host resumes;
a second run host waits while the first holds the registry's lease."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from promtool import check_metrics
from stack_helpers import wait_for

from tether.common.broker import Keys, connect_sync
from tether.common.net import free_port
from tether.common.records import RunState
from tether.common.runs import FAILED, RUNNING, STOPPED, run_namespace
from tether.launcher_runs import Registry, serving
from tether.runhost.main import Lease
from tether.runhost.series import HostedSeries, labelled, merged, registry_of


def _page(step: float, seconds: list[float]) -> str:
    """One service's /metrics, as prometheus_client writes it."""
    reg = CollectorRegistry()
    Gauge("tether_scheduler_step", "Step the run is on", registry=reg).set(step)
    Counter("tether_merger_groups_total", "Groups resolved", ["outcome"], registry=reg).labels("trained").inc(
        3
    )
    h = Histogram("tether_scheduler_weight_push_seconds", "push", ["path"], registry=reg, buckets=(1, 10))
    for s in seconds:
        h.labels("adapter").observe(s)
    return generate_latest(reg).decode()


def test_pages_are_labelled_and_merged_into_one_family_each() -> None:
    a = list(labelled(_page(4, [0.5]), {"run": "calc", "service": "scheduler"}))
    b = list(labelled(_page(7, [2.0, 20.0]), {"run": "instr", "service": "scheduler"}))
    families = merged([*a, *b])
    assert [f.name for f in families] == [f.name for f in a]  # each once, in first-seen order
    step = next(f for f in families if f.name == "tether_scheduler_step")
    assert {(s.labels["run"], s.value) for s in step.samples} == {("calc", 4.0), ("instr", 7.0)}

    own = CollectorRegistry()
    Gauge("tether_runhost_runs", "Runs", registry=own).set(2)
    pages = {"calc": _page(4, [0.5]), "instr": _page(7, [2.0, 20.0])}

    class Page(HostedSeries):
        def _page(self, url: str) -> str | None:
            return pages.get(url)

    series = Page(lambda: [(r, "scheduler", r) for r in ("calc", "instr", "gone")], own=own)
    text = generate_latest(registry_of(series)).decode()
    assert check_metrics(text).returncode == 0, check_metrics(text).stdout  # one HELP/TYPE per family
    parsed = {f.name: f for f in text_string_to_metric_families(text)}
    assert [s.value for s in parsed["tether_runhost_runs"].samples] == [2.0]
    buckets = {
        (s.labels["run"], s.labels["le"]): s.value
        for s in parsed["tether_scheduler_weight_push_seconds"].samples
        if s.name.endswith("_bucket")
    }
    assert buckets[("instr", "10.0")] == 1.0 and buckets[("instr", "+Inf")] == 2.0
    assert buckets[("calc", "1.0")] == 1.0
    groups = parsed["tether_merger_groups"].samples
    assert {
        (s.labels["run"], s.labels["service"], s.labels["outcome"])
        for s in groups
        if s.name.endswith("_total")
    } == {
        ("calc", "scheduler", "trained"),
        ("instr", "scheduler", "trained"),
    }


def _runhost(tmp_path: Path, redis_url: str, grpc_port: int, metrics_port: int) -> subprocess.Popen:
    dead = "127.0.0.1:9"  # nothing answers there: a run's scheduler waits for inference, serving meanwhile
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("TETHER_")},
        "TETHER_REDIS_URL": redis_url,
        "TETHER_NAMESPACE": "host",
        "TETHER_TRAINER_ADDRESS": dead,
        "TETHER_INFERENCE_ADDRESS": dead,
        "TETHER_GATEWAY_URL": "http://127.0.0.1:9",
        "TETHER_GATEWAY_CONTROL_ADDRESS": dead,
        "TETHER_MODEL_DIR": "",
        "TETHER_RUNS_DIR": str(tmp_path / "runs"),
        "TETHER_RUNHOST_GRPC_PORT": str(grpc_port),
        "TETHER_METRICS_PORT": str(metrics_port),
        "TETHER_RUNHOST_HEALTH_TIMEOUT_S": "150",
        "TETHER_RUNHOST_DRAIN_GRACE_S": "20",
        "PYTHONPATH": os.pathsep.join(sys.path),
    }
    log = open(tmp_path / f"runhost-{grpc_port}.log", "w")  # noqa: SIM115 -- the child's, closed with it
    return subprocess.Popen(
        [sys.executable, "-m", "tether.runhost"], env=env, stdout=log, stderr=subprocess.STDOUT
    )


def _series(metrics_port: int) -> dict:
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    return {f.name: f for f in text_string_to_metric_families(text)}, text


def _value(metrics_port: int, name: str) -> float:
    """The run host's own unlabelled series `name`."""
    (sample,) = [s for s in _series(metrics_port)[0][name].samples if "run" not in s.labels]
    return sample.value


def _up(metrics_port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def test_one_run_host_holds_the_lease(redis_url) -> None:
    a, b = Lease(redis_url, "host", ttl_s=0.5), Lease(redis_url, "host", ttl_s=0.5)
    assert a.hold() and a.hold()  # taken, then renewed
    assert not b.hold()
    a.release()
    assert b.hold() and not a.hold()
    time.sleep(0.8)  # b not renewed: it expired
    assert a.hold() and not b.hold()
    a.release()
    b.release()  # not its own: nothing happens
    assert Lease(redis_url, "other", ttl_s=5).hold()  # a namespace of its own


def test_a_kept_lease_outlives_its_ttl_until_released(redis_url) -> None:
    """Renewed by its own thread, the lease holds however long the holder's loop is busy."""
    a, b = Lease(redis_url, "kept", ttl_s=0.6, renew_s=0.1), Lease(redis_url, "kept", ttl_s=0.6)
    a.keep()
    assert a.held
    time.sleep(1.5)  # 2.5 TTLs
    assert a.held and not b.hold()
    a.release()
    assert not a.held and b.hold()


def test_the_run_host_runs_labels_fails_drains_and_resumes_runs(tmp_path, redis_url) -> None:
    registry = Registry(redis_url, "host")
    grpc_port, metrics_port = free_port(), free_port()
    host = _runhost(tmp_path, redis_url, grpc_port, metrics_port)
    try:
        wait_for(lambda: serving(f"127.0.0.1:{grpc_port}"), 60, "the run host serving")
        registry.create("good", {"agent": {"agent_fn": "tether.examples.calculator.agent:rollout"}})
        registry.create("bad", {"scheduler": {"sleep_level": 1}})  # refused for a run: status 2

        def statuses() -> dict[str, str]:
            return {r.run_id: r.status for r in registry.list()}

        wait_for(lambda: statuses() == {"good": RUNNING, "bad": FAILED}, 200, "good running, bad failed", 1.0)
        assert "refusing to start" in (tmp_path / "runs" / "logs" / "bad" / "scheduler.log").read_text()
        assert (tmp_path / "runs" / "good" / "config.yaml").exists()

        # One page: the run host's own series and each of good's services', labelled.
        # (A run is running once its merger and scheduler serve; its agent worker's page may come later.)
        def labelled_sources() -> set:
            rss = _series(metrics_port)[0]["process_resident_memory_bytes"].samples
            return {(s.labels.get("run"), s.labels.get("service")) for s in rss}

        everyone = {
            (None, None),  # the run host's own
            ("good", "scheduler"),
            ("good", "merger"),
            ("good", "agent-0"),
        }
        wait_for(lambda: labelled_sources() == everyone, 60, "every hosted service's series, labelled")
        families, text = _series(metrics_port)
        assert check_metrics(text).returncode == 0
        assert [s.value for s in families["tether_runhost_runs"].samples] == [1.0]  # bad is drained
        assert [s.value for s in families["tether_runhost_processes"].samples] == [3.0]
        assert {s.labels["run"] for s in families["tether_run_phase"].samples} == {"good"}

        # A second run host waits while the first holds the registry's lease: it serves nothing and
        # starts nothing (two would run every run twice).
        grpc_2, metrics_2 = free_port(), free_port()
        second = _runhost(tmp_path, redis_url, grpc_2, metrics_2)
        wait_for(lambda: _up(metrics_2), 60, "the second run host's metrics")
        time.sleep(3)
        assert not serving(f"127.0.0.1:{grpc_2}")
        assert _value(metrics_2, "tether_runhost_processes") == 0.0
        assert _value(metrics_port, "tether_runhost_processes") == 3.0

        # Stopped itself, the first stops the runs' services and leaves the registry (good is still
        # running) and gives the lease back: the second takes it and resumes good.
        host.send_signal(signal.SIGTERM)
        assert host.wait(90) == 0
        assert statuses()["good"] == RUNNING
        host, grpc_port, metrics_port = second, grpc_2, metrics_2
        wait_for(lambda: serving(f"127.0.0.1:{grpc_port}"), 60, "the second run host serving")
        wait_for(lambda: _value(metrics_port, "tether_runhost_processes") == 3.0, 120, "good resumed", 1.0)
        # Its scheduler's state saying the run is done (its steps and evaluation through), the run host
        # stops the run: its services drain and the registry says stopped.
        done = RunState("good", 2, "", "sync", 2, 2, status="done")
        r = connect_sync(redis_url)
        r.hset(Keys(run_namespace("host", "good")).run, mapping=done.to_redis())
        r.close()
        wait_for(lambda: statuses()["good"] == STOPPED, 90, "good stopped", 1.0)
        wait_for(lambda: _value(metrics_port, "tether_runhost_runs") == 0.0, 30, "good forgotten")
    finally:
        if host.poll() is None:
            host.send_signal(signal.SIGTERM)
            try:
                host.wait(60)
            except subprocess.TimeoutExpired:
                host.kill()
        registry.close()
    assert host.returncode == 0, (tmp_path / f"runhost-{grpc_port}.log").read_text()[-3000:]


@pytest.mark.parametrize("missing", ["TETHER_TRAINER_ADDRESS", "TETHER_REDIS_URL"])
def test_the_run_host_refuses_to_start_without_its_wiring(tmp_path, missing) -> None:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("TETHER_")},
        "TETHER_REDIS_URL": "redis://127.0.0.1:9/0",
        "TETHER_TRAINER_ADDRESS": "t:1",
        "TETHER_INFERENCE_ADDRESS": "i:1",
        "TETHER_GATEWAY_URL": "http://g:1",
        "TETHER_GATEWAY_CONTROL_ADDRESS": "g:2",
        "TETHER_MODEL_DIR": "/m",
        "PYTHONPATH": os.pathsep.join(sys.path),
    }
    del env[missing]
    got = subprocess.run(
        [sys.executable, "-m", "tether.runhost"], env=env, capture_output=True, text=True, timeout=60
    )
    assert got.returncode == 2, got.stderr
    assert missing.removeprefix("TETHER_").lower() in got.stderr.lower()
