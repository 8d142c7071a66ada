"""Experiment trackers (docs/trackers.md): W&B, MLflow and TensorBoard get every record the Reporter
writes to metrics.jsonl -- each step's numeric fields at its step, the learning-health figures among
them -- and the run's configuration as their config/params at start.

Chosen by `TETHER_TRACKERS` (the scheduler's `trackers` setting; `tether demo|up --tracker`). A tracker's
package is imported only when it is chosen (the `trackers` extra installs all three); `missing` says at
start-up which chosen one is not installed. By default each writes under the run directory and needs no
account or network: W&B offline (`<run dir>/wandb`, `wandb sync` uploads it later), an MLflow file store
(`<run dir>/mlruns`, unless MLFLOW_TRACKING_URI names another), TensorBoard event files
(`<run dir>/tensorboard`).

Trackers never hold training up: every call runs in one worker thread, in order, and a tracker that
raises is logged once, counted (tether_run_tracker_errors_total{tracker}) and called again next time.
Caller: tether.scheduler.report (Reporter) and main (the setting, `missing`).
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import logging
import math
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, Protocol, get_args

from prometheus_client import Counter
from pydantic import BeforeValidator
from pydantic_settings import NoDecode

log = logging.getLogger(__name__)

TrackerName = Literal["wandb", "mlflow", "tensorboard"]
TRACKERS: tuple[TrackerName, ...] = get_args(TrackerName)
# The module each tracker imports (what `missing` looks for; the `trackers` extra installs them).
PACKAGES: dict[str, str] = {"wandb": "wandb", "mlflow": "mlflow", "tensorboard": "tensorboard"}
EXTRA = "tether-rl[trackers]"

ERRORS = Counter(
    "tether_run_tracker_errors_total",
    "Calls to an experiment tracker that failed (the run goes on without that record there)",
    ["tracker"],
)

# Fields of a record that are no figure: the step is each point's step, the time its timestamp.
NOT_FIGURES = frozenset({"step", "time"})
# How long the end of a run waits for the trackers to write what they still hold and close.
CLOSE_TIMEOUT_S = 60.0


def _names(value: Any) -> Any:
    """`wandb,mlflow` (the environment, a flag) or a list (the run config) -> the names, each once."""
    if isinstance(value, str):
        value = [v for v in re.split(r"[,\s]+", value) if v]
    return tuple(dict.fromkeys(value)) if isinstance(value, list | tuple) else value


# The scheduler's `trackers` setting: NoDecode, so that pydantic-settings hands the environment's
# comma-separated string to _names rather than reading it as JSON.
TrackerNames = Annotated[tuple[TrackerName, ...], NoDecode, BeforeValidator(_names)]


def missing(names: tuple[str, ...]) -> str | None:
    """Why the chosen trackers cannot start (a package not installed), or None. Looks the packages up
    without importing them."""
    absent = [n for n in names if importlib.util.find_spec(PACKAGES[n]) is None]
    if not absent:
        return None
    packages = ", ".join(PACKAGES[n] for n in absent)
    return (
        f"tracker {', '.join(absent)} chosen but not installed (no {packages} package): pip install '{EXTRA}'"
    )


def figures(record: Mapping[str, Any]) -> dict[str, float]:
    """The numeric fields of a record that a tracker plots (pure): every int or float but the step and
    the time (NaN kept: a figure the step did not have); strings (mode, weight_push) and flags left out."""
    return {
        k: float(v)
        for k, v in record.items()
        if k not in NOT_FIGURES and isinstance(v, int | float) and not isinstance(v, bool)
    }


_SECRET = re.compile(r"(token|secret|password|api_key|_keys?)$", re.IGNORECASE)


def redact(config: Any) -> Any:
    """The configuration without its secrets (pure): values of keys that name a token, key, secret or
    password, and the credentials of URLs (a Redis URL's password), replaced by `***`."""
    if isinstance(config, Mapping):
        return {k: "***" if _SECRET.search(str(k)) and config[k] else redact(v) for k, v in config.items()}
    if isinstance(config, list | tuple):
        return [redact(v) for v in config]
    if isinstance(config, str):
        return re.sub(r"(://)[^/@\s]*@", r"\1***@", config)
    return config


def flat(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested configuration as `section.key` -> value text (pure): MLflow's params, TensorBoard's
    text."""
    out: dict[str, str] = {}
    for k, v in config.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flat(v, f"{key}."))
        else:
            out[key] = v if isinstance(v, str) else json.dumps(v, default=str)
    return out


class Tracker(Protocol):
    """One experiment tracker: opened once with the run's configuration, given each record's figures at
    its step, closed at the end. Called from the trackers' worker thread only."""

    name: TrackerName

    def open(self, config: Mapping[str, Any]) -> None: ...

    def log(self, step: int, values: dict[str, float], when: float) -> None: ...

    def close(self) -> None: ...


class WandbTracker:
    """W&B: one run per Tether run (its id from the run id; a restarted scheduler resumes it). Offline
    in `<run dir>/wandb` unless WANDB_MODE says otherwise; WANDB_PROJECT names the project (tether)."""

    name: TrackerName = "wandb"

    def __init__(self, run_dir: Path, run_id: str) -> None:
        self.run_dir = run_dir
        self.run_id = run_id
        self.run: Any = None

    def open(self, config: Mapping[str, Any]) -> None:
        import wandb

        self.run = wandb.init(
            mode=os.environ.get("WANDB_MODE", "offline"),  # type: ignore[arg-type]
            dir=str(self.run_dir),
            project=os.environ.get("WANDB_PROJECT", "tether"),
            name=self.run_id,
            id=re.sub(r"[^A-Za-z0-9_.-]", "-", self.run_id)[:64],
            resume="allow",
            config=dict(config),
            settings=wandb.Settings(silent=True, console="off", save_code=False, disable_git=True),
        )

    def log(self, step: int, values: dict[str, float], when: float) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


class MlflowTracker:
    """MLflow: one run per Tether run (tag tether.run_id; a restarted scheduler finds it again) in the
    experiment MLFLOW_EXPERIMENT_NAME (tether), in the store MLFLOW_TRACKING_URI names, else a file
    store in `<run dir>/mlruns`."""

    name: TrackerName = "mlflow"

    def __init__(self, run_dir: Path, run_id: str) -> None:
        self.run_dir = run_dir
        self.run_id = run_id
        self.client: Any = None
        self.mlflow_run = ""

    def open(self, config: Mapping[str, Any]) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI") or (self.run_dir / "mlruns").resolve().as_uri()
        if uri.startswith("file:"):
            # MLflow 3 refuses a new file store unless told; it is the one that needs no server.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "tether")
        experiment = self.client.get_experiment_by_name(name)
        eid = experiment.experiment_id if experiment else self.client.create_experiment(name)
        found = self.client.search_runs([eid], f"tags.`tether.run_id` = '{self.run_id}'", max_results=1)
        if found:
            self.mlflow_run = found[0].info.run_id
            self.client.update_run(self.mlflow_run, status="RUNNING")
            return  # its params were logged when it started (MLflow keeps the first value)
        run = self.client.create_run(eid, run_name=self.run_id, tags={"tether.run_id": self.run_id})
        self.mlflow_run = run.info.run_id
        params = [Param(k, v[:6000]) for k, v in flat(config).items()]
        for i in range(0, len(params), 100):  # log_batch takes at most 100 params a call
            self.client.log_batch(self.mlflow_run, params=params[i : i + 100])

    def log(self, step: int, values: dict[str, float], when: float) -> None:
        from mlflow.entities import Metric

        ms = int(when * 1000)
        self.client.log_batch(self.mlflow_run, metrics=[Metric(k, v, ms, step) for k, v in values.items()])

    def close(self) -> None:
        if self.client is not None and self.mlflow_run:
            self.client.set_terminated(self.mlflow_run)
            self.mlflow_run = ""


class TensorBoardTracker:
    """TensorBoard event files in `<run dir>/tensorboard` (`tensorboard --logdir` it): each figure a
    scalar, the configuration one text summary (`config`, JSON) at step 0. Written with the tensorboard
    package's own event writer (no torch, no TensorFlow)."""

    name: TrackerName = "tensorboard"

    def __init__(self, run_dir: Path, run_id: str) -> None:
        self.run_dir = run_dir
        self.writer: Any = None

    def open(self, config: Mapping[str, Any]) -> None:
        from tensorboard.compat.proto import summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.writer = EventFileWriter(str(self.run_dir / "tensorboard"))
        text = "```\n" + json.dumps(config, indent=2, default=str) + "\n```"
        tensor = tensor_pb2.TensorProto(
            dtype=types_pb2.DT_STRING,
            string_val=[text.encode()],
            tensor_shape=tensor_shape_pb2.TensorShapeProto(
                dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=1)]
            ),
        )
        plugin = summary_pb2.SummaryMetadata.PluginData(plugin_name="text")
        value = summary_pb2.Summary.Value(
            tag="config", metadata=summary_pb2.SummaryMetadata(plugin_data=plugin), tensor=tensor
        )
        self._write(0, time.time(), [value])

    def log(self, step: int, values: dict[str, float], when: float) -> None:
        from tensorboard.compat.proto import summary_pb2

        self._write(step, when, [summary_pb2.Summary.Value(tag=k, simple_value=v) for k, v in values.items()])

    def _write(self, step: int, when: float, values: list[Any]) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2

        self.writer.add_event(
            event_pb2.Event(wall_time=when, step=step, summary=summary_pb2.Summary(value=values))
        )
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


CLASSES: dict[str, type[WandbTracker | MlflowTracker | TensorBoardTracker]] = {
    "wandb": WandbTracker,
    "mlflow": MlflowTracker,
    "tensorboard": TensorBoardTracker,
}


class Trackers:
    """The chosen trackers of a run, behind one worker thread (module docstring). `start` opens them with
    the run's configuration, `log` hands each a record (nothing before `start` or after `close`), `close`
    ends them (idempotent; `start` opens them again). With no tracker chosen every call does nothing."""

    def __init__(self, trackers: list[Tracker]) -> None:
        self.trackers = trackers
        self.warned: set[str] = set()
        self.opened: set[str] = set()
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None  # from `start` to `close`

    @classmethod
    def chosen(cls, names: tuple[str, ...], run_dir: Path, run_id: str) -> Trackers:
        """The trackers `names` chooses, not yet opened (nothing imported until `start`)."""
        return cls([CLASSES[n](run_dir, run_id) for n in names])

    def start(self, config: Mapping[str, Any]) -> None:
        """Open every tracker with the run's configuration (secrets redacted)."""
        if not self.trackers:
            return
        if self.pool is None:
            self.pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="tether-trackers"
            )
        self.pool.submit(self._open_all, redact(config))

    def log(self, record: Mapping[str, Any], step: int | None = None) -> None:
        """Hand every opened tracker the record's figures at `step` (default: the record's own), with
        the record's time as their timestamp."""
        if self.pool is None:
            return
        at = record["step"] if step is None else step
        when = record.get("time")
        when = float(when) if isinstance(when, int | float) and math.isfinite(when) else time.time()
        self.pool.submit(self._log_all, int(at), figures(record), when)

    def close(self) -> None:
        """Close every tracker after what it was handed is written; the end of a run waits for it at
        most CLOSE_TIMEOUT_S."""
        pool, self.pool = self.pool, None
        if pool is None:
            return
        try:
            pool.submit(self._close_all).result(timeout=CLOSE_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            log.warning("trackers still closing after %.0f s; the run ends without them", CLOSE_TIMEOUT_S)
        pool.shutdown(wait=False)

    # --- in the worker thread ----------------------------------------------------------------------

    def _open_all(self, config: Mapping[str, Any]) -> None:
        for t in self.trackers:
            if self._call(t, t.open, config):
                self.opened.add(t.name)

    def _log_all(self, step: int, values: dict[str, float], when: float) -> None:
        for t in self.trackers:
            if t.name in self.opened:
                self._call(t, t.log, step, values, when)

    def _close_all(self) -> None:
        for t in self.trackers:
            if t.name in self.opened:
                self._call(t, t.close)
        self.opened.clear()

    def _call(self, tracker: Tracker, fn: Any, *args: Any) -> bool:
        """One call to a tracker: a failure is counted and logged (the first of each tracker as a
        warning with its traceback), never raised."""
        try:
            fn(*args)
            return True
        except Exception:
            ERRORS.labels(tracker.name).inc()
            if tracker.name not in self.warned:
                self.warned.add(tracker.name)
                log.warning(
                    "tracker %s failed (the run goes on; tether_run_tracker_errors_total counts each "
                    "failure, only this first one is logged)",
                    tracker.name,
                    exc_info=True,
                )
            return False
