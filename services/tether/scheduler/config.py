"""What a run is given: its configuration (RunConfig, built from SchedulerSettings in main.py, which
refuse a bad value at start-up), the gRPC stubs it calls (Stubs) and its tasks (load_tasks)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from tether.common.settings import WeightPush

# The backend-scheduling modes (tether.scheduler.run). SchedulerSettings.mode has this type: a bad mode
# is refused at start-up.
SchedulingMode = Literal["colocated-sync", "colocated-async", "disaggregated-async"]

MODES: tuple[SchedulingMode, ...] = get_args(SchedulingMode)


@dataclass(frozen=True)
class RunConfig:
    """The run, built from SchedulerSettings (main.py), which refuse a bad value at start-up."""

    run_id: str
    steps: int
    tasks_per_step: int
    group_size: int
    seed: int
    run_dir: Path
    eval_repeats: int = 4
    rollout_timeout_s: float = 300.0
    drain_timeout_s: float = 60.0
    mode: SchedulingMode = "colocated-sync"
    max_staleness: int = 1
    max_inflight_groups: int = 0  # async modes; 0 = (max_staleness + 1) x tasks_per_step
    sleep_level: int = 0  # colocated modes: put vLLM to sleep (1 or 2) while the trainer trains
    max_attempts: int = 3  # a failed rollout is retried this many times in all, then excluded
    weight_push: WeightPush = "checkpoint"  # "checkpoint" (path 1) or "nccl" (path 2, path 1 as its fallback)
    # colocated-sync: dispatch more groups until tasks_per_step carry signal (plan.top_up), at most
    # dynamic_sampling_max_groups a step (0 = 4 x tasks_per_step). The async modes always train P such.
    dynamic_sampling: bool = False
    dynamic_sampling_max_groups: int = 0
    # Experiment trackers (tether.scheduler.trackers) and the run config file's contents (TETHER_CONFIG),
    # which they are given as the run's configuration beside these fields.
    trackers: tuple[str, ...] = ()
    config_file: dict[str, Any] = field(default_factory=dict)
    # A run's scheduler (its namespace a run's: common.runs.run_of_namespace): the trainer's run it
    # trains and the adapter vLLM serves it as (the run record's); "" both: the single policy.
    trainer_run_id: str = ""
    adapter: str = ""
    # A run's own trainer settings (its record's run config, `trainer:` section; run_trainer_settings),
    # sent with OpenRun; the trainer refuses what a run may not set.
    trainer_settings: dict[str, str] = field(default_factory=dict)

    def tracker_config(self) -> dict[str, Any]:
        """What the trackers record as the run's config/params: these fields under `run`, and the run
        config file's sections and keys."""
        run = {k: str(v) if isinstance(v, Path) else v for k, v in vars(self).items()}
        for k in ("trackers", "config_file"):
            run.pop(k)
        return {"run": run, **self.config_file}


def run_trainer_settings(config: dict[str, Any]) -> dict[str, str]:
    """The `trainer:` section of a run's config (its RunRecord.config) as OpenRun takes it: each value as
    its TETHER_ environment variable would give it (true/false, numbers as written by Python, lists
    comma-separated); an unset (null) key is left out."""

    def text(value: Any) -> str:
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, list | tuple):
            return ",".join(text(v) for v in value)
        return str(value)

    section = config.get("trainer") or {}
    return {str(k): text(v) for k, v in section.items() if v is not None}


def run_problem(sleep_level: int, weight_push: WeightPush) -> str | None:
    """Why a run's scheduler cannot take these settings (None: it can). Its vLLM serves other runs too,
    and its weights are an adapter: it may neither put vLLM to sleep nor stream full weights into it."""
    if sleep_level:
        return "a run's scheduler cannot put the shared vLLM to sleep (TETHER_SLEEP_LEVEL must be 0)"
    if weight_push != "checkpoint":
        return "a run's weights are adapter versions, loaded by name: TETHER_WEIGHT_PUSH must be checkpoint"
    return None


@dataclass
class Stubs:
    gateway: Any
    inference: Any
    trainer: Any
    inference_health: Any = None  # grpc.health.v1 Health of the inference service (None: not checked)


def load_tasks(path: Path) -> list[dict[str, Any]]:
    tasks = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not tasks:
        raise ValueError(f"no tasks in {path}")
    for t in tasks:
        if "task_id" not in t:
            raise ValueError(f"task without task_id in {path}: {t}")
    return tasks
