"""What each mode's loop (sync_loop.SyncLoop, async_loop.AsyncLoop) works with, written once: the run's
configuration and tasks, its state in Redis, the rollouts, inference's health, the steps, and whether
the run was asked to stop. Assembled by tether.scheduler.run."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tether.scheduler.config import RunConfig
from tether.scheduler.health import InferenceHealth
from tether.scheduler.rollouts import Rollouts
from tether.scheduler.steps import Steps
from tether.scheduler.store import RunStore


@dataclass
class ModeLoop:
    cfg: RunConfig
    tasks: list[dict[str, Any]]
    store: RunStore
    rollouts: Rollouts
    health: InferenceHealth
    steps: Steps
    stopped: Callable[[], bool]
