"""Experiment trackers (tether.scheduler.trackers, docs/trackers.md): the same step records the Reporter
writes to metrics.jsonl reach W&B (offline), MLflow (a file store) and TensorBoard (event files), each
read back with the tracker's own reader; the choice of trackers (environment, run config, flags); a
tracker that is not installed refuses the start; a tracker that fails is counted and the run goes on.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import logging
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import REGISTRY
from test_scheduler_state import _group_result

from tether.common import broker
from tether.common.grpc_server import cancel_until_done
from tether.common.records import GroupResult
from tether.scheduler import trackers as tr
from tether.scheduler.config import RunConfig
from tether.scheduler.report import LEARNING_HEALTH, Reporter, step_record

# Three real-shaped step records (the trainer's figures, some missing: NaN) and the evaluation's.
TIMING = {"rollout_seconds": 1.5, "push_seconds": 0.25, "paused_seconds": 0.125, "step_seconds": 2.0}
CONFIG = {
    "run": {"run_id": "trk", "steps": 3, "mode": "colocated-sync"},
    "trainer": {"lr": 5e-4},
    "gateway": {"admin_token": "s3cret"},
}


def _records() -> list[dict]:
    records: list[dict] = []
    for step in range(3):
        groups = [
            GroupResult.from_dict(_group_result(f"g{step}a", "trained", [1.0, 0.25 * step], 2, 10 + step)),
            GroupResult.from_dict(_group_result(f"g{step}b", "filtered", [1.0, 1.0], 0, 0)),
        ]
        metrics = {"loss": 0.5 - 0.1 * step, "grad_norm": 1.25 + step, "logprob_abs_diff": 0.001}
        metrics |= {k: 0.01 * (i + 1) * (step + 1) for i, k in enumerate(LEARNING_HEALTH)}
        if step == 1:
            metrics.pop("policy_kl")  # a figure the trainer did not report this step: NaN
        records.append(
            step_record(
                step, step + 1, groups, metrics, TIMING, step, "checkpoint", "colocated-sync",
                1_800_000_000.0 + step, records[-1] if records else None,
            )
        )  # fmt: skip
    return records


EVAL = {"eval_reward": 0.75, "eval_rollouts": 8, "weight_version": 3, "time": 1_800_000_010.0}


async def _feed(redis_url: str, run_dir: Path, trackers: tr.Trackers) -> list[tuple[int, dict[str, float]]]:
    """The records through a Reporter (metrics.jsonl, gauges, stream, trackers) as a run reports them;
    returns what metrics.jsonl holds, as (step, figures) pairs: what every tracker must have got."""
    r = broker.connect(redis_url)
    try:
        reporter = Reporter(r, broker.Keys("trk"), "trk", run_dir, trackers)
        reporter.trackers.start(CONFIG)
        for record in _records():
            await reporter.report(record)
        reporter.write(EVAL, step=3)  # the evaluation: after the last step
        reporter.close()
    finally:
        await r.aclose()
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 4
    return [(m.get("step", 3), tr.figures(m)) for m in lines]


def _same(got: dict[int, dict[str, float]], want: list[tuple[int, dict[str, float]]], rel: float) -> None:
    """Each step's figures, exactly the same names, values equal (NaN as NaN) within `rel`."""
    assert sorted(got) == sorted(s for s, _ in want)
    for step, figures in want:
        assert set(got[step]) == set(figures), (step, set(got[step]) ^ set(figures))
        for k, v in figures.items():
            g = got[step][k]
            assert (math.isnan(g) and math.isnan(v)) or g == pytest.approx(v, rel=rel, abs=1e-12), (step, k)
    # The records are real: learning health, timing and NaN (a figure a step did not have) all went.
    assert {"policy_kl", "step_guard_retries", "rollout_seconds", "reward_mean"} <= set(got[0])
    assert math.isnan(got[1]["policy_kl"]) and not math.isnan(got[0]["policy_kl"])


# --- each tracker, read back with its own reader ------------------------------------------------------


async def test_wandb_offline_run_holds_every_record_of_metrics_jsonl(redis_url, tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)  # the default: offline, nothing leaves the machine
    monkeypatch.setenv("WANDB_SILENT", "true")
    want = await _feed(redis_url, tmp_path, tr.Trackers.chosen(("wandb",), tmp_path, "trk"))

    [log_file] = (tmp_path / "wandb").glob("offline-run-*-trk/run-trk.wandb")
    # wandb's own reader of its transaction log (the Python DataStore reader is gone from wandb 0.2x).
    out = subprocess.run(
        [str(Path(sys.executable).parent / "wandb"), "leet", "inspect", "--json", str(log_file)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    entries = [json.loads(line) for line in out.splitlines() if line.strip()]
    got: dict[int, dict[str, float]] = {}
    for e in entries:
        if e["type"] == "history":
            item = e["history"]["item"]
            got[int(e["history"]["step"]["num"])] = {
                k: float(v) for k, v in item.items() if not k.startswith("_")
            }
    _same(got, want, rel=1e-12)
    [run] = [e["run"] for e in entries if e["type"] == "run"]
    config = run["config"]["update"]
    assert config["run"]["steps"] == 3 and config["trainer"]["lr"] == 5e-4 and run["run_id"] == "trk"
    assert config["gateway"]["admin_token"] == "***"  # secrets never reach a tracker


async def test_mlflow_file_store_holds_every_record_of_metrics_jsonl(redis_url, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    # Absent before, as in a fresh process: the tracker itself allows MLflow's file store.
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    want = await _feed(redis_url, tmp_path, tr.Trackers.chosen(("mlflow",), tmp_path, "trk"))

    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    experiment = client.get_experiment_by_name("tether")
    [run] = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "trk" and run.info.status == "FINISHED"
    got: dict[int, dict[str, float]] = {}
    for key in run.data.metrics:
        for point in client.get_metric_history(run.info.run_id, key):
            got.setdefault(point.step, {})[key] = point.value
            if point.step == 0:  # the record's time is the point's timestamp
                assert point.timestamp == 1_800_000_000_000
    _same(got, want, rel=1e-12)
    params = run.data.params
    assert params["run.steps"] == "3" and params["trainer.lr"] == "0.0005"
    assert params["gateway.admin_token"] == "***"


async def test_tensorboard_event_files_hold_every_record_of_metrics_jsonl(redis_url, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    want = await _feed(redis_url, tmp_path, tr.Trackers.chosen(("tensorboard",), tmp_path, "trk"))

    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    got: dict[int, dict[str, float]] = {}
    for tag in events.Tags()["scalars"]:
        for e in events.Scalars(tag):
            got.setdefault(e.step, {})[tag] = e.value
    # TensorBoard keeps scalars as float32.
    want32 = [(s, {k: float(np.float32(v)) for k, v in f.items()}) for s, f in want]
    _same(got, want32, rel=1e-6)
    [config] = events.Tensors("config")
    text = tensor_util.make_ndarray(config.tensor_proto)[0].decode()
    written = json.loads(text.strip("`\n"))
    assert written["run"]["steps"] == 3 and written["gateway"]["admin_token"] == "***"


# --- failures: a tracker that raises, a tracker not installed ----------------------------------------


class _Recording:
    def __init__(self, name: str, fail_at: str = "") -> None:
        self.name = name
        self.fail_at = fail_at
        self.got: list[tuple[int, dict[str, float]]] = []
        self.closed = False

    def open(self, config) -> None:
        if self.fail_at == "open":
            raise ConnectionError("tracking server down")

    def log(self, step: int, values: dict[str, float], when: float) -> None:
        if self.fail_at == "log":
            raise ConnectionError("tracking server down")
        self.got.append((step, values))

    def close(self) -> None:
        self.closed = True


def _errors(name: str) -> float:
    return REGISTRY.get_sample_value("tether_run_tracker_errors_total", {"tracker": name}) or 0.0


async def test_a_failing_tracker_is_counted_once_logged_and_the_run_goes_on(redis_url, tmp_path, caplog):
    failing, unreachable, healthy = _Recording("boom", "log"), _Recording("down", "open"), _Recording("ok")
    before = _errors("boom"), _errors("down")
    with caplog.at_level(logging.WARNING, logger="tether.scheduler.trackers"):
        want = await _feed(redis_url, tmp_path, tr.Trackers([failing, unreachable, healthy]))
    # Every record still reached metrics.jsonl (checked by _feed) and the healthy tracker.
    _same(dict(healthy.got), want, rel=0)
    assert healthy.closed
    # Each failure counted; the one that never opened is left out after its one failure.
    assert _errors("boom") - before[0] == 4 and _errors("down") - before[1] == 1
    assert failing.closed and not unreachable.closed
    warned = [r.getMessage() for r in caplog.records]
    assert sum("tracker boom failed" in m for m in warned) == 1, warned  # once, not once per record
    assert sum("tracker down failed" in m for m in warned) == 1, warned


def test_a_tracker_not_installed_refuses_the_scheduler_at_start(monkeypatch, capsys, tmp_path):
    from tether.scheduler import main as scheduler_main

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    assert tr.missing(("tensorboard",)) is None
    problem = tr.missing(("wandb", "tensorboard"))
    assert (
        problem and "wandb" in problem and "tensorboard" not in problem and "tether-rl[trackers]" in problem
    )
    env = {
        "TETHER_SCHEDULER_GRPC_PORT": "0",
        "TETHER_GATEWAY_CONTROL_ADDRESS": "127.0.0.1:1",
        "TETHER_INFERENCE_ADDRESS": "127.0.0.1:1",
        "TETHER_TRAINER_ADDRESS": "127.0.0.1:1",
        "TETHER_RUN_ID": "trk",
        "TETHER_RUN_DIR": str(tmp_path),
        "TETHER_REDIS_URL": "redis://127.0.0.1:1/0",
        "TETHER_TRACKERS": "tensorboard,wandb",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(sys, "argv", ["tether.scheduler"])
    monkeypatch.setattr(scheduler_main, "amain", lambda *a: pytest.fail("the scheduler started"))
    with pytest.raises(SystemExit) as exit_:
        scheduler_main.main()
    assert exit_.value.code == 2
    assert "refusing to start" in capsys.readouterr().err and "pip install 'tether-rl[trackers]'" in problem
    # `tether demo|up --tracker wandb` says so before starting anything.
    with pytest.raises(ValueError, match=r"tether-rl\[trackers\]"):
        _tracker_env(["wandb"])


# --- choosing trackers --------------------------------------------------------------------------------


def _tracker_env(flags: list[str] | None, config: dict | None = None) -> dict[str, str]:
    from tether.cli.stack import tracker_env

    return tracker_env(argparse.Namespace(tracker=flags), config or {})


def test_trackers_are_chosen_by_the_environment_the_run_config_and_the_flags(monkeypatch, tmp_path):
    from pydantic import ValidationError

    from tether.common.settings import section_problems
    from tether.scheduler.main import SchedulerSettings

    required = dict(
        scheduler_grpc_port=0, gateway_control_address="g:1", inference_address="i:1", trainer_address="t:1",
        run_id="trk", run_dir=str(tmp_path), redis_url="redis://r:1/0",
    )  # fmt: skip
    monkeypatch.delenv("TETHER_CONFIG", raising=False)
    assert SchedulerSettings(**required).trackers == ()
    monkeypatch.setenv("TETHER_TRACKERS", "wandb, tensorboard,wandb")
    assert SchedulerSettings(**required).trackers == ("wandb", "tensorboard")
    monkeypatch.setenv("TETHER_TRACKERS", "comet")
    with pytest.raises(ValidationError, match="'wandb', 'mlflow' or 'tensorboard'"):
        SchedulerSettings(**required)
    monkeypatch.delenv("TETHER_TRACKERS")
    config = tmp_path / "run.yaml"
    config.write_text("scheduler:\n  trackers: [mlflow, tensorboard]\n")
    monkeypatch.setenv("TETHER_CONFIG", str(config))
    assert SchedulerSettings(**required).trackers == ("mlflow", "tensorboard")
    # `tether config check` takes a list or a comma-separated string, and refuses an unknown name.
    assert section_problems(SchedulerSettings, "scheduler", {"trackers": "wandb,mlflow"}) == []
    assert section_problems(SchedulerSettings, "scheduler", {"trackers": ["comet"]})
    # The flags: repeatable or comma-separated, passed to the scheduler only when given.
    assert _tracker_env(["wandb,mlflow", "tensorboard"]) == {"TETHER_TRACKERS": "wandb,mlflow,tensorboard"}
    assert _tracker_env(None, {"scheduler": {"trackers": ["mlflow"]}}) == {}
    with pytest.raises(ValueError, match="--tracker"):
        _tracker_env(["comet"])


def test_the_run_configuration_trackers_get_has_no_secrets_and_flattens_to_params(tmp_path):
    cfg = RunConfig(
        run_id="trk", steps=3, tasks_per_step=2, group_size=4, seed=0, run_dir=tmp_path,
        trackers=("mlflow",), config_file={"trainer": {"lr": 1e-6}, "gateway": {"vllm_api_key": "k"}},
    )  # fmt: skip
    config = tr.redact(cfg.tracker_config())
    assert config["run"]["run_dir"] == str(tmp_path) and config["run"]["group_size"] == 4
    assert "trackers" not in config["run"] and "config_file" not in config["run"]
    assert config["gateway"]["vllm_api_key"] == "***" and config["trainer"]["lr"] == 1e-6
    assert tr.redact({"redis_url": "redis://:pw@host:6379/0", "max_tokens": 5, "admin_token": ""}) == {
        "redis_url": "redis://***@host:6379/0",
        "max_tokens": 5,  # a count, not a secret
        "admin_token": "",
    }
    flat = tr.flat({"run": {"steps": 3, "mode": "colocated-sync", "dynamic_sampling": False}, "model": "m"})
    assert flat == {
        "run.steps": "3",
        "run.mode": "colocated-sync",
        "run.dynamic_sampling": "false",
        "model": "m",
    }
    record = {"step": 2, "time": 1.0, "loss": 0.5, "rollouts": 4, "mode": "colocated-sync", "nan": math.nan}
    figures = tr.figures({**record, "flag": True})
    assert set(figures) == {"loss", "rollouts", "nan"} and figures["rollouts"] == 4.0


# --- through a run -----------------------------------------------------------------------------------


async def test_a_run_logs_each_step_and_its_evaluation_to_its_trackers(redis_url, tmp_path, monkeypatch):
    from fake_control import FakeGateway
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from test_run_metrics import _Inference, _merger, _Trainer

    from tether.scheduler.run import Run, Stubs

    r = broker.connect(redis_url)
    keys = broker.Keys("trkrun")
    inference = _Inference()
    cfg = RunConfig(
        run_id="trkrun", steps=2, tasks_per_step=1, group_size=2, seed=0, run_dir=tmp_path / "run",
        eval_repeats=1, trackers=("tensorboard",),
    )  # fmt: skip
    merger = asyncio.ensure_future(_merger(r, keys, {"t": [1.0, 0.5]}))
    try:
        run = Run(
            r,
            keys,
            cfg,
            Stubs(FakeGateway(), inference, _Trainer(inference, tmp_path / "ckpt")),
            [{"task_id": "t"}],
        )
        await asyncio.wait_for(run.run(), 60)
    finally:
        await cancel_until_done(merger)
        await r.aclose()
    lines = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(cfg.run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()  # readable: the run closed its trackers at its end
    assert [e.step for e in events.Scalars("reward_mean")] == [0, 1]
    assert [e.value for e in events.Scalars("reward_mean")] == [m["reward_mean"] for m in lines[:2]]
    # The evaluation at the step after the last.
    assert [(e.step, e.value) for e in events.Scalars("eval_reward")] == [(2, lines[2]["eval_reward"])]
    assert run.reporter.trackers.pool is None


class _Built(Exception):
    pass


async def test_the_scheduler_hands_its_run_the_trackers_and_the_run_config(redis_url, tmp_path, monkeypatch):
    from tether.scheduler import main as scheduler_main

    config = tmp_path / "run.yaml"
    config.write_text("scheduler:\n  trackers: tensorboard\ntrainer:\n  lr: 1.0e-6\n")
    monkeypatch.setenv("TETHER_CONFIG", str(config))
    built: list[RunConfig] = []

    def capture(r, keys, cfg, stubs, tasks):
        built.append(cfg)
        raise _Built

    monkeypatch.setattr(scheduler_main, "Run", capture)
    s = scheduler_main.SchedulerSettings(
        scheduler_grpc_port=0, gateway_control_address="127.0.0.1:1", inference_address="127.0.0.1:1",
        trainer_address="127.0.0.1:1", run_id="trk", run_dir=str(tmp_path), redis_url=redis_url,
    )  # fmt: skip
    with pytest.raises(_Built):
        await scheduler_main.amain(s)
    [cfg] = built
    assert cfg.trackers == ("tensorboard",) and cfg.config_file["trainer"] == {"lr": 1e-6}
    assert cfg.tracker_config()["run"]["run_id"] == "trk"
