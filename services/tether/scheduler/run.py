"""The run loop, in three backend-scheduling modes:

- colocated-sync: dispatch P tasks x G rollouts, wait for all their groups, drain gateway admission,
  put vLLM to sleep, train, wake it, push the weights, resume admission with the new version.
- colocated-async: keep up to N groups in flight; a step trains on the first P complete groups and
  the rest carry over; admission is drained around each step as in colocated-sync.
- disaggregated-async: inference and trainer run side by side; rollouts continue while the trainer
  trains; weights are pushed between steps (vLLM pause?mode=keep -> load -> resume, so requests in
  flight continue under the new weights). No sample trains whose oldest token was sampled more than
  `max_staleness` versions before the weights being updated: dispatch is throttled to
  (max_staleness + 1) x P groups running or ready, a step waits for any running group that would be too
  old after it and trains the oldest ready groups first, so at most P groups come due in a step and none
  has to be dropped (a group that still ends up too old is dropped, counted). These decisions are
  tether.scheduler.plan's pure functions; the loops carry them out.

Weights reach inference by path 1 (inference reloads the checkpoint the trainer wrote) or, with
`weight_push="nccl"`, by path 2 (the trainer streams them into vLLM's workers while generation is
paused), falling back to path 1 when a path-2 push fails (docs/weight-push.md;
tether.scheduler.publish).

Run state (tether.common.records.RunState) lives in Redis, so a scheduler killed at any point and
started again continues from the last completed step with the same version chain (docs/trainer.md,
"Restarts"):
- before a step trains, its groups are written down (`pending`); a restarted scheduler finishes that
  step with exactly those groups and step number, and the trainer answers with its record if it had
  trained it already, so no step trains twice and none is skipped;
- a step's results are read from the stream position saved with the step, so results that arrived
  before the restart are not missed; async modes keep their in-flight groups in a Redis hash;
- on start, inference is brought to the trainer's newest version and generation is resumed (a push
  cut short can leave it paused, or asleep);
- a step's record is saved with the run position in one write, then appended to metrics.jsonl
  (again on restart if it was not).

`Run` only assembles the parts, one module each, and starts and ends the run:
- store (RunStore: the run state and the async in-flight groups in Redis),
- rollouts (Rollouts: dispatch, and the group results read back from a saved stream position),
- health (InferenceHealth: hold dispatch while inference is not serving),
- push (StepPush: train and push under the mode's rules) over publish (WeightPublisher; a run's
  scheduler, its namespace a run's: AdapterPublisher, its adapter's versions loaded by name),
- report (the step records, metrics.jsonl, gauges, the metrics stream) and steps (Steps: a step's
  lifecycle, written down before it trains),
- one loop per mode: sync_loop (colocated-sync), async_loop (the async modes), serve (`tether up`),
  and evaluate (the final evaluation).
"""

from __future__ import annotations

import logging
import shutil
from typing import Any

import grpc
from prometheus_client import Counter

from tether.common import broker
from tether.common.records import GroupResult, RunState
from tether.scheduler import metrics as run_metrics
from tether.scheduler.async_loop import AsyncLoop
from tether.scheduler.config import RunConfig, Stubs
from tether.scheduler.evaluate import Evaluation
from tether.scheduler.health import InferenceHealth
from tether.scheduler.plan import resume_from
from tether.scheduler.publish import AdapterPublisher, WeightPublisher
from tether.scheduler.push import VERSION, StepPush
from tether.scheduler.report import Reporter
from tether.scheduler.rollouts import Rollouts
from tether.scheduler.serve import ServeLoop
from tether.scheduler.steps import Steps
from tether.scheduler.store import RunStore
from tether.scheduler.sync_loop import SyncLoop
from tether.scheduler.trackers import Trackers
from tether.v1 import gateway_pb2

# RunConfig, Stubs and VERSION are imported from here by the callers that build a Run.
__all__ = ["VERSION", "Run", "RunConfig", "Stubs"]

log = logging.getLogger(__name__)

RESUMES = Counter("tether_scheduler_resumes_total", "Runs picked up again after a scheduler restart")


class Run:
    """One run, assembled from its parts (module docstring). `stop_requested` (set by the servicer's
    Stop) ends the loop at the next step."""

    def __init__(
        self, r: Any, keys: broker.Keys, cfg: RunConfig, stubs: Stubs, tasks: list[dict[str, Any]]
    ) -> None:
        self.cfg = cfg
        self.stubs = stubs
        self.tasks = tasks
        self.stop_requested = False
        state = RunState(
            run_id=cfg.run_id,
            total_steps=cfg.steps,
            run_dir=str(cfg.run_dir),
            mode=cfg.mode,
            next_step=0,
            weight_version=0,
        )
        self.store = RunStore(r, keys, state)
        self.rollouts = Rollouts(r, keys, cfg.max_attempts, cfg.rollout_timeout_s)
        self.health = InferenceHealth(stubs.inference_health, cfg.rollout_timeout_s)
        self.publisher: WeightPublisher | AdapterPublisher = (
            AdapterPublisher(
                stubs.inference, stubs.trainer, cfg.trainer_run_id, cfg.adapter, cfg.trainer_settings
            )
            if cfg.trainer_run_id
            else WeightPublisher(stubs.inference, stubs.trainer, cfg.weight_push)
        )
        self.pusher = StepPush(
            stubs.gateway,
            stubs.inference,
            stubs.trainer,
            self.store,
            self.publisher,
            cfg.drain_timeout_s,
            cfg.sleep_level,
            cfg.trainer_run_id,
            cfg.tasks_per_step,
        )
        self.reporter = Reporter(
            r, keys, cfg.run_id, cfg.run_dir, Trackers.chosen(cfg.trackers, cfg.run_dir, cfg.run_id)
        )
        self.steps = Steps(self.store, self.rollouts, self.pusher, self.reporter, cfg.mode)
        parts = (self.store, self.rollouts, self.health, self.steps)
        self.sync_loop = SyncLoop(cfg, tasks, *parts, self.stopped)
        self.async_loop = AsyncLoop(cfg, tasks, *parts, self.stopped)
        self.serve_loop = ServeLoop(self.store, self.rollouts, self.pusher, self.reporter, self.stopped)
        self.evaluation = Evaluation(
            cfg.run_id, tasks, cfg.eval_repeats, self.store, self.rollouts, self.health, self.reporter
        )
        run_metrics.MAX_STALENESS.set(cfg.max_staleness)

    def stopped(self) -> bool:
        return self.stop_requested

    # --- what the servicer and tests read: the run state, where the parts keep it ---------------------

    @property
    def state(self) -> RunState:
        return self.store.state

    @state.setter
    def state(self, state: RunState) -> None:
        self.store.state = state

    @property
    def push_path(self) -> str:
        """How the last step's weights reached inference (WeightPublisher.path)."""
        return self.publisher.path

    @property
    def held_since(self) -> float | None:
        """Async modes: dispatch held since (inference not serving)."""
        return self.health.held_since

    # --- the parts' entry points, by the names the run has always had ---------------------------------

    async def save_state(self, **changes: Any) -> None:
        await self.store.save(**changes)

    async def results_cursor(self) -> str:
        return await self.rollouts.cursor()

    async def read_results(self, cursor: str, block_ms: int) -> tuple[str, list[GroupResult]]:
        return await self.rollouts.read(cursor, block_ms)

    async def wait_groups(self, group_ids: set[str], cursor: str) -> list[GroupResult]:
        return await self.rollouts.wait(group_ids, cursor)

    async def push(
        self, step: int, group_ids: list[str], drop_ids: list[str] | None = None, colocated: bool = True
    ) -> tuple[dict[str, float], float, float]:
        return await self.pusher.push(step, group_ids, drop_ids, colocated)

    async def load_weights(self, resp: Any) -> int:
        return await self.pusher.load_weights(resp)

    def step_record(
        self,
        step: int,
        results: list[GroupResult],
        metrics: dict[str, float],
        started: float,
        rollout_s: float,
        push_s: float,
        paused_s: float,
        version_before: int,
    ) -> dict[str, Any]:
        timing = {"rollout_seconds": rollout_s, "push_seconds": push_s, "paused_seconds": paused_s}
        return self.steps.record(step, results, metrics, started, timing, version_before)

    async def resume_pending(self, step: int, colocated: bool) -> bool:
        return await self.steps.resume_pending(step, colocated)

    async def train_sync(self, start: int) -> None:
        await self.sync_loop.run(start)

    async def train_async(self, start: int, colocated: bool) -> None:
        await self.async_loop.run(start, colocated)

    async def evaluate(self) -> dict[str, Any]:
        return await self.evaluation.run()

    # --- the run's start and end --------------------------------------------------------------------

    async def start_run(self) -> int:
        """Start the run, or pick it up where a previous scheduler left it (same run id). Returns the
        first step to run."""
        previous = await self.store.load()
        start = resume_from(previous, self.cfg.run_id)
        if previous is not None and start is not None:
            self.store.adopt(previous)
            RESUMES.inc()
            self.reporter.export_resumed(previous)
            log.info(
                "resuming run %s at step %d (%s when the previous scheduler stopped)",
                self.cfg.run_id,
                start,
                previous.status,
            )
        else:
            start = 0
            await self.store.clear()
        await self.health.wait()
        version = await self.pusher.reconcile()
        VERSION.set(version)
        await self.store.save(
            run_id=self.cfg.run_id,
            total_steps=self.cfg.steps,
            weight_version=version,
            run_dir=str(self.cfg.run_dir),
            next_step=start,
            mode=self.cfg.mode,
        )
        await self.reporter.recover(self.store.state)
        await self.stubs.gateway.ResumeAdmission(gateway_pb2.ResumeAdmissionRequest(weight_version=version))
        return start

    async def train(self) -> None:
        start = await self.start_run()
        if self.cfg.mode == "colocated-sync":
            await self.train_sync(start)
        else:
            await self.train_async(start, colocated=self.cfg.mode == "colocated-async")

    async def serve(self, groups_per_step: int = 1, linger_s: float = 1.0) -> None:
        """Serve-only mode (`tether up`): train and push every time `groups_per_step` groups were
        scored (tether.scheduler.serve)."""
        self.cfg.run_dir.mkdir(parents=True, exist_ok=True)
        self.reporter.trackers.start(self.cfg.tracker_config())
        try:
            step = await self.start_run()
            await self.serve_loop.run(step, groups_per_step, linger_s)
        finally:
            self.reporter.close()

    async def run(self) -> None:
        """Train, evaluate, keep the final model; a failure is saved in the run state and raised."""
        self.cfg.run_dir.mkdir(parents=True, exist_ok=True)
        self.reporter.trackers.start(self.cfg.tracker_config())
        try:
            await self.train()
            if self.state.status == "stopped":
                return
            record = await self.evaluate()
            ckpt = self.state.checkpoint_dir
            if ckpt:
                final = self.cfg.run_dir / "final-model"
                if final.exists():
                    shutil.rmtree(final)
                shutil.copytree(ckpt, final)
            await self.save_state(status="done", eval_reward=record["eval_reward"])
        except grpc.aio.AioRpcError as exc:
            # Not retryable, or it outlasted its retries: fail loudly. "error" is not a final
            # status: the process exits non-zero, its supervisor starts it again, and it resumes.
            log.error("run failed: %s %s", exc.code().name, exc.details())
            await self.save_state(status="error", error=f"{exc.code().name}: {exc.details()}")
            raise
        except Exception as exc:
            await self.save_state(status="error", error=repr(exc))
            raise
        finally:
            self.reporter.close()
