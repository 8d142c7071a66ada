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
  tether.scheduler.plan's pure functions; the loops here carry them out.

Weights reach inference by path 1 (inference reloads the checkpoint the trainer wrote) or, with
`weight_push="nccl"`, by path 2 (the trainer streams them into vLLM's workers while generation is
paused), falling back to path 1 when a path-2 push fails (docs/weight-push.md;
tether.scheduler.publish).

Run state (tether.common.records.RunState) lives in Redis, so a scheduler killed at any point and started again continues from the
last completed step with the same version chain (docs/trainer.md, "Restarts"):
- before a step trains, its groups are written down (`pending`); a restarted scheduler finishes that
  step with exactly those groups and step number, and the trainer answers with its record if it had
  trained it already, so no step trains twice and none is skipped;
- a step's results are read from the stream position saved with the step, so results that arrived
  before the restart are not missed; async modes keep their in-flight groups in a Redis hash;
- on start, inference is brought to the trainer's newest version and generation is resumed (a push
  cut short can leave it paused, or asleep);
- a step's record is saved with the run position in one write, then appended to metrics.jsonl
  (again on restart if it was not).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import grpc
from grpc_health.v1 import health_pb2
from prometheus_client import Counter, Gauge, Histogram

from tether.common import broker
from tether.common.records import DispatchJob, GroupResult, PendingStep, RecordError, RunState, StepMetrics
from tether.common.settings import WeightPush
from tether.scheduler import metrics as run_metrics
from tether.scheduler.plan import (
    Ready,
    Wait,
    async_budget,
    async_dispatch_count,
    plan_async_step,
    serve_should_train,
    sync_group_ids,
    sync_missing,
    sync_take,
)
from tether.scheduler.publish import WeightPublisher
from tether.v1 import gateway_pb2, inference_pb2, trainer_pb2, types_pb2

log = logging.getLogger(__name__)

STEP = Gauge("tether_scheduler_step", "Step the run is on")
VERSION = Gauge(
    "tether_scheduler_weight_version", "Weight version inference serves, as the scheduler knows it"
)
PUSH_SECONDS = Histogram(
    "tether_scheduler_weight_push_seconds",
    "Time to make inference serve a step's weights",
    ["path"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300),
)
RESUMES = Counter("tether_scheduler_resumes_total", "Runs picked up again after a scheduler restart")


# The backend-scheduling modes (module docstring). SchedulerSettings.mode has this type: a bad mode is
# refused at start-up.
SchedulingMode = Literal["colocated-sync", "colocated-async", "disaggregated-async"]


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


MODES: tuple[SchedulingMode, ...] = get_args(SchedulingMode)


def _stream_id(entry: str) -> tuple[int, int]:
    ms, _, seq = entry.partition("-")
    return int(ms), int(seq or 0)


@dataclass
class Stubs:
    gateway: Any
    inference: Any
    trainer: Any
    inference_health: Any = None  # grpc.health.v1 Health of the inference service (None: not checked)


def load_tasks(path: Path) -> list[dict]:
    tasks = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not tasks:
        raise ValueError(f"no tasks in {path}")
    for t in tasks:
        if "task_id" not in t:
            raise ValueError(f"task without task_id in {path}: {t}")
    return tasks


def step_summary(results: list[GroupResult]) -> dict[str, float]:
    """Reward and accounting over one step's resolved groups (pure)."""
    rewards = [r for g in results for r in g.rewards]
    return {
        "reward_mean": sum(rewards) / len(rewards) if rewards else float("nan"),
        "rollouts": float(len(rewards)),
        "groups_trained": float(sum(g.outcome == "trained" for g in results)),
        "groups_filtered": float(sum(g.outcome == "filtered" for g in results)),
        "samples": float(sum(g.samples for g in results)),
        "tokens": float(sum(g.tokens for g in results)),
        "generated_tokens": float(sum(g.generated_tokens for g in results)),
        "forks": float(sum(g.forks for g in results)),
        "sequences_per_rollout": (sum(g.sequences for g in results) / len(rewards)) if rewards else 0.0,
    }


class Run:
    def __init__(self, r, keys: broker.Keys, cfg: RunConfig, stubs: Stubs, tasks: list[dict]) -> None:
        self.r = r
        self.keys = keys
        self.cfg = cfg
        self.stubs = stubs
        self.tasks = tasks
        self.stop_requested = False
        self.held_since: float | None = None  # async modes: dispatch held since (inference not serving)
        self.state = RunState(
            run_id=cfg.run_id,
            total_steps=cfg.steps,
            run_dir=str(cfg.run_dir),
            mode=cfg.mode,
            next_step=0,
            weight_version=0,
        )
        self.inflight_key = keys.run_inflight  # async modes: group id -> {version, cursor, task}
        # Whether Redis holds every field of the run state yet: until then a save writes them all, so
        # that a run failing before its first save (inference not answering at start) still leaves a
        # hash a restarted scheduler can decode and resume from.
        self.state_written = False
        self.publisher = WeightPublisher(stubs.inference, stubs.trainer, cfg.weight_push)
        run_metrics.MAX_STALENESS.set(cfg.max_staleness)
        run_metrics.export_phase(self.state.status)

    @property
    def push_path(self) -> str:
        """How the last step's weights reached inference (WeightPublisher.path)."""
        return self.publisher.path

    def _encoded(self) -> dict[str, str]:
        return self.state.to_redis()

    async def save_state(self, **changes: Any) -> None:
        """Update the run state and write the changed fields (finish_step writes them all at once)."""
        self.state = dataclasses.replace(self.state, **changes)
        await self.r.hset(self.keys.run, mapping=self.state.to_redis(changes if self.state_written else None))
        self.state_written = True
        if "status" in changes:
            run_metrics.export_phase(self.state.status)

    async def load_state(self) -> RunState | None:
        """The run state Redis holds (strictly decoded: a bad field is an error), None if none."""
        raw = await self.r.hgetall(self.keys.run)
        return RunState.from_redis(raw) if raw else None

    async def results_cursor(self) -> str:
        last = await self.r.xrevrange(self.keys.group_results, count=1)
        return last[0][0] if last else "0-0"

    async def dispatch(self, group_id: str, task: dict, size: int, meta: dict) -> None:
        for i in range(size):
            await broker.publish_once(
                self.r,
                self.keys,
                self.keys.dispatch,
                f"dispatch:{group_id}:{i}",
                DispatchJob(
                    group_id=group_id,
                    task_id=task["task_id"],
                    group_size=size,
                    task=task,
                    metadata=meta,
                    max_attempts=self.cfg.max_attempts,
                ).to_dict(),
            )

    async def read_results(self, cursor: str, block_ms: int) -> tuple[str, list[GroupResult]]:
        """Group results published after `cursor` (waiting up to `block_ms`), and the new cursor. One
        that does not decode is dead-lettered and skipped (never trained on with a defaulted field)."""
        resp = await self.r.xread({self.keys.group_results: cursor}, count=256, block=block_ms)
        out = []
        for _, items in resp or []:
            for eid, fields in items:
                cursor = eid
                record = broker.decode(fields)
                try:
                    out.append(GroupResult.from_dict(record))
                except RecordError as exc:
                    stream = self.keys.group_results
                    await broker.dead_letter(self.r, self.keys, stream, eid, repr(exc), record, "GroupResult")
        return cursor, out

    async def wait_groups(self, group_ids: set[str], cursor: str) -> list[dict]:
        """Group results for `group_ids`, read from the results stream after `cursor`."""
        found: dict[str, dict] = {}
        deadline = time.monotonic() + self.cfg.rollout_timeout_s
        while sync_missing(group_ids, found) and time.monotonic() < deadline:
            cursor, batch = await self.read_results(cursor, 500)
            found.update((rec["group_id"], rec) for rec in batch if rec["group_id"] in group_ids)
        if len(found) < len(group_ids):
            log.warning(
                "%d of %d groups unresolved after %.0fs",
                len(group_ids) - len(found),
                len(group_ids),
                self.cfg.rollout_timeout_s,
            )
        return list(found.values())

    async def push(
        self, step: int, group_ids: list[str], drop_ids: list[str] | None = None, colocated: bool = True
    ) -> tuple[dict[str, float], float, float]:
        """Train on `group_ids` and push the new weights. Colocated: drain admission (and sleep
        vLLM) around the update; disaggregated: rollouts keep running, vLLM freezes in-flight
        requests only while it loads. Returns (train metrics, push seconds, paused seconds)."""
        t0 = time.perf_counter()
        slept = False
        if colocated:
            await self.stubs.gateway.PauseAdmission(
                gateway_pb2.PauseAdmissionRequest(drain_timeout_s=self.cfg.drain_timeout_s)
            )
        try:
            if colocated and self.cfg.sleep_level:
                await self.save_state(slept=True)  # a restarted scheduler wakes vLLM up
                await self.stubs.inference.Sleep(inference_pb2.SleepRequest(level=self.cfg.sleep_level))
                slept = True
            await self.save_state(status="training")
            resp = await self.stubs.trainer.TrainStep(
                trainer_pb2.TrainStepRequest(
                    step=step,
                    min_groups=len(group_ids),
                    max_groups=len(group_ids),
                    group_ids=group_ids,
                    drop_group_ids=drop_ids or [],
                )
            )
            if slept:
                await self.stubs.inference.WakeUp(types_pb2.Empty())
                slept = False
                await self.save_state(slept=False)
            await self.save_state(status="pushing")
            t1 = time.perf_counter()
            version = await self.load_weights(resp)
            push_s = time.perf_counter() - t1
            PUSH_SECONDS.labels(self.push_path).observe(push_s)
            VERSION.set(version)
            await self.save_state(weight_version=version, checkpoint_dir=resp.checkpoint_dir)
        finally:
            if slept:
                await self.stubs.inference.WakeUp(types_pb2.Empty())
                await self.save_state(slept=False)
            # Colocated: admit again; disaggregated: tell the gateway which version now serves.
            await self.stubs.gateway.ResumeAdmission(
                gateway_pb2.ResumeAdmissionRequest(weight_version=self.state.weight_version)
            )
        paused_s = time.perf_counter() - t0 if colocated else push_s
        return dict(resp.metrics), push_s, paused_s

    async def load_weights(self, resp) -> int:
        """Make inference serve a trained step's weights (WeightPublisher.publish); returns the version
        it serves."""
        return await self.publisher.publish(resp)

    def write_metrics(self, record: dict[str, Any]) -> None:
        with open(self.cfg.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")

    def step_record(
        self,
        step: int,
        results: list[dict],
        metrics: dict[str, float],
        started: float,
        rollout_s: float,
        push_s: float,
        paused_s: float,
        version_before: int,
    ) -> dict[str, Any]:
        summary = step_summary(results)
        trained = [g for g in results if g["outcome"] == "trained"]
        staleness = [version_before - g.min_weight_version for g in trained if g.min_weight_version >= 0]
        step_s = time.perf_counter() - started
        return {
            "step": step,
            "weight_version": self.state.weight_version,
            **summary,
            "logprob_abs_diff": metrics.get("logprob_abs_diff", float("nan")),
            "logprob_k3_kl": metrics.get("logprob_k3_kl", float("nan")),
            "loss": metrics.get("loss", float("nan")),
            "grad_norm": metrics.get("grad_norm", float("nan")),
            "clip_fraction": metrics.get("clip_fraction", float("nan")),
            "constrained_tokens_masked": metrics.get("constrained_tokens_masked", 0.0),
            "trainer_tokens_per_s": metrics.get("train_tokens_per_s", float("nan")),
            # What the trainer did with its devices (trainer/throughput.py) and the policy's entropy.
            **{
                k: metrics.get(k, float("nan"))
                for k in ("entropy", "model_tflops_per_s", "mfu", "peak_memory_gib")
            },
            "staleness_max": float(max(staleness, default=0)),
            "staleness_mean": sum(staleness) / len(staleness) if staleness else 0.0,
            # Per trainable token, from vLLM's per-token weight spans (the trainer's count).
            **{
                k: metrics.get(k, float("nan"))
                for k in ("token_staleness_max", "token_staleness_mean", "mixed_version_fraction")
            },
            "rollout_seconds": rollout_s,
            "push_seconds": push_s,
            "paused_seconds": paused_s,
            "step_seconds": step_s,
            "tokens_per_s": summary["tokens"] / max(step_s, 1e-9),
            "weight_push": self.push_path,
            "mode": self.cfg.mode,
            "time": time.time(),
        }

    async def finish_step(self, record: dict[str, Any], consumed: list[str] | None = None) -> None:
        """The step's record and the run's next position in one Redis transaction (with the in-flight
        groups the step used up), then metrics.jsonl and the metrics stream. A restart between the two
        halves rewrites the record from the run state (`recover_metrics`)."""
        self.state = dataclasses.replace(
            self.state,
            next_step=record["step"] + 1,
            reward_mean=record["reward_mean"],
            pending=None,
            last_record=record,
        )
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.hset(self.keys.run, mapping=self._encoded())
            if consumed:
                pipe.hdel(self.inflight_key, *consumed)
            await pipe.execute()
        await self.report(record)
        log.info(
            "step %d reward %.3f version %d (%.1fs)",
            record["step"],
            record["reward_mean"],
            self.state.weight_version,
            record["step_seconds"],
        )

    async def report(self, record: dict[str, Any]) -> None:
        self.write_metrics(record)
        checked = StepMetrics.from_dict(record)
        run_metrics.export_step(checked)
        step = checked.to_dict()  # what the metrics stream carries, checked
        await broker.publish_once(
            self.r, self.keys, self.keys.metrics, f"metrics:{self.cfg.run_id}:{step['step']}", step
        )

    async def recover_metrics(self) -> None:
        """The last finished step's record (and the evaluation's), if a restart came between saving and
        reporting it."""
        path = self.cfg.run_dir / "metrics.jsonl"
        lines = (
            [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            if path.exists()
            else []
        )
        record = self.state.last_record
        if record and not any(m.get("step") == record["step"] for m in lines):
            log.info("reporting step %d, finished before the restart", record["step"])
            await self.report(record)
        evaluated = self.state.eval_record
        if evaluated and not any("eval_reward" in m for m in lines):
            self.write_metrics(evaluated)

    async def reconcile_weights(self) -> int:
        """Wake vLLM if a colocated step had put it to sleep (a sleep cut short leaves it asleep), then
        bring inference to the trainer's newest version and resume generation
        (WeightPublisher.reconcile). Returns the served version."""
        if self.state.slept:
            await self.stubs.inference.WakeUp(types_pb2.Empty())
            await self.save_state(slept=False)
        return await self.publisher.reconcile()

    async def inference_serving(self) -> bool:
        """Whether inference says SERVING (vLLM answers, the newest checkpoint restored; through the
        inference Service, any of its replicas); True when it is not checked."""
        if self.stubs.inference_health is None:
            return True
        try:
            resp = await self.stubs.inference_health.Check(health_pb2.HealthCheckRequest(), timeout=5.0)
        except grpc.aio.AioRpcError:
            return False
        return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)

    async def hold_dispatch(self) -> bool:
        """Async modes, before dispatching more groups: True (hold them back) while inference is not
        serving -- a vLLM restarting would only burn their rollouts' attempts -- while the loop goes on
        reading results and training. Raises once it held for `rollout_timeout_s` (the process exits;
        its supervisor starts it again), as `wait_inference` does."""
        if await self.inference_serving():
            if self.held_since is not None:
                log.info("inference serving again; dispatching")
                self.held_since = None
            return False
        now = time.monotonic()
        if self.held_since is None:
            log.warning("inference not serving; holding dispatch")
            self.held_since = now
        elif now - self.held_since > self.cfg.rollout_timeout_s:
            raise RuntimeError(f"inference not serving after {self.cfg.rollout_timeout_s:.0f}s")
        return True

    async def wait_inference(self) -> None:
        """Wait until inference says SERVING (vLLM answers, the newest checkpoint restored): a step
        dispatched while it restarts would only burn its rollouts' attempts. Raises after
        `rollout_timeout_s` (the process exits; its supervisor starts it again)."""
        if self.stubs.inference_health is None:
            return
        deadline = time.monotonic() + self.cfg.rollout_timeout_s
        waited = False
        while True:
            if await self.inference_serving():
                if waited:
                    log.info("inference serving again")
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"inference not serving after {self.cfg.rollout_timeout_s:.0f}s")
            if not waited:
                log.warning("inference not serving; waiting before the next step")
                waited = True
            await asyncio.sleep(1.0)

    async def start_run(self) -> int:
        """Start the run, or pick it up where a previous scheduler left it (same run id). Returns the
        first step to run."""
        previous = await self.load_state()
        if previous is not None and previous.run_id == self.cfg.run_id:
            start = previous.next_step
            self.state = previous
            self.state_written = True
            RESUMES.inc()
            self.export_resumed(previous)
            log.info(
                "resuming run %s at step %d (%s when the previous scheduler stopped)",
                self.cfg.run_id,
                start,
                previous.status,
            )
        else:
            start = 0
            await self.r.delete(self.keys.run, self.inflight_key)
            self.state_written = False
        await self.wait_inference()
        version = await self.reconcile_weights()
        VERSION.set(version)
        await self.save_state(
            run_id=self.cfg.run_id,
            total_steps=self.cfg.steps,
            weight_version=version,
            run_dir=str(self.cfg.run_dir),
            next_step=start,
            mode=self.cfg.mode,
        )
        await self.recover_metrics()
        await self.stubs.gateway.ResumeAdmission(gateway_pb2.ResumeAdmissionRequest(weight_version=version))
        return start

    def export_resumed(self, state: RunState) -> None:
        """The run gauges of a resumed run: its status, its last finished step's record and its
        evaluation, so that a restarted scheduler does not show NaN until its next step."""
        run_metrics.export_phase(state.status)
        evaluated = (
            state.eval_reward
            if state.eval_reward is not None
            else (state.eval_record or {}).get("eval_reward")
        )
        if evaluated is not None:
            run_metrics.export_eval(evaluated)
        if state.last_record:
            try:
                run_metrics.export_step(StepMetrics.from_dict(state.last_record))
            except RecordError as exc:  # written by an older scheduler: the next step sets them
                log.warning("last step's record not shown in the run gauges: %s", exc)

    async def train(self) -> None:
        start = await self.start_run()
        if self.cfg.mode == "colocated-sync":
            await self.train_sync(start)
        else:
            await self.train_async(start, colocated=self.cfg.mode == "colocated-async")

    async def train_step(
        self,
        step: int,
        take: list[str],
        drop: list[str],
        results: list[dict],
        version_before: int,
        started: float,
        rollout_s: float,
        colocated: bool,
        extra: dict[str, float] | None = None,
    ) -> None:
        """Write the step's groups down, train and push, then finish the step. Every argument is saved
        first, so a restarted scheduler can run this again with the same groups (`resume_pending`)."""
        await self.save_state(
            pending=PendingStep(
                step=step,
                take=take,
                drop=drop,
                results=[g.to_dict() for g in results],
                version_before=version_before,
                rollout_s=rollout_s,
                extra=extra or {},
            )
        )
        metrics: dict[str, float] = {}
        push_s = paused_s = 0.0
        self.publisher.path = ""
        if take:
            metrics, push_s, paused_s = await self.push(step, take, drop, colocated)
        record = self.step_record(
            step, results, metrics, started, rollout_s, push_s, paused_s, version_before
        )
        record.update(extra or {})
        await self.finish_step(
            record, consumed=list(dict.fromkeys([*(g["group_id"] for g in results), *drop]))
        )

    async def resume_pending(self, step: int, colocated: bool) -> bool:
        """Finish `step` if its groups were chosen before a restart; False if there is nothing to finish."""
        pending = self.state.pending
        if not pending or pending.step != step:
            return False
        log.info(
            "finishing step %d with the groups chosen before the restart (%d to train)",
            step,
            len(pending.take),
        )
        await self.train_step(
            step,
            pending.take,
            pending.drop,
            [GroupResult.from_dict(g) for g in pending.results],
            pending.version_before,
            time.perf_counter(),
            pending.rollout_s,
            colocated,
            pending.extra,
        )
        return True

    async def step_cursor(self, step: int) -> str:
        """Where the step's group results start in the results stream, saved with the step, so that a
        restarted scheduler re-reads results that arrived before it went down."""
        if self.state.step == step and self.state.results_cursor:
            return self.state.results_cursor
        cursor = await self.results_cursor()
        await self.save_state(status="rolling_out", step=step, results_cursor=cursor)
        return cursor

    async def train_sync(self, start: int) -> None:
        rng = random.Random(self.cfg.seed)
        for step in range(self.cfg.steps):
            chosen = [rng.choice(self.tasks) for _ in range(self.cfg.tasks_per_step)]
            if step < start:
                continue  # replay the task draws of finished steps so a resumed run sees the same tasks
            if self.stop_requested:
                await self.save_state(status="stopped")
                return
            STEP.set(step)
            if await self.resume_pending(step, colocated=True):
                continue
            await self.wait_inference()
            t0 = time.perf_counter()
            cursor = await self.step_cursor(step)
            await self.save_state(status="rolling_out")
            group_ids = sync_group_ids(self.cfg.run_id, step, len(chosen))
            for gid, task in zip(group_ids, chosen, strict=True):
                await self.dispatch(gid, task, self.cfg.group_size, {"step": step, "run_id": self.cfg.run_id})
            results = await self.wait_groups(set(group_ids), cursor)
            trained = sync_take([(g["group_id"], g["outcome"]) for g in results])
            await self.train_step(
                step,
                trained,
                [],
                results,
                self.state.weight_version,
                t0,
                time.perf_counter() - t0,
                colocated=True,
            )

    async def restore_inflight(self) -> tuple[dict[str, int], str | None]:
        """Async modes after a restart: the groups dispatched and not used up by a finished step
        (dispatched again: publishing is idempotent, so only one lost between saving and dispatching
        goes out now), and the stream position their results start at."""
        saved = {gid: json.loads(v) for gid, v in (await self.r.hgetall(self.inflight_key)).items()}
        pending = self.state.pending
        taken = (
            {*pending.take, *pending.drop, *(g["group_id"] for g in pending.results)} if pending else set()
        )
        for gid, g in saved.items():
            await self.dispatch(
                gid, g["task"], self.cfg.group_size, {"step": g["step"], "run_id": self.cfg.run_id}
            )
        cursor = min((g["cursor"] for g in saved.values()), key=_stream_id, default=None)
        return {gid: g["version"] for gid, g in saved.items() if gid not in taken}, cursor

    async def train_async(self, start: int, colocated: bool) -> None:
        """Groups stay in flight across steps; a step trains on the first P complete groups."""
        P, k = self.cfg.tasks_per_step, self.cfg.max_staleness
        budget = async_budget(self.cfg.max_inflight_groups, k, P)
        rng = random.Random(self.cfg.seed)
        n = self.state.dispatched
        for _ in range(n):
            rng.choice(self.tasks)  # the same task sequence as an uninterrupted run
        outstanding, saved_cursor = await self.restore_inflight()
        step = start
        if step < self.cfg.steps and await self.resume_pending(step, colocated):
            step += 1
        cursor = saved_cursor or await self.results_cursor()
        ready: list[dict] = []
        window: list[dict] = []
        dropped: list[str] = []
        dropped_total = self.state.stale_dropped
        t0 = time.perf_counter()
        await self.save_state(status="rolling_out", step=step)
        while step < self.cfg.steps:
            if self.stop_requested:
                await self.save_state(status="stopped")
                return
            STEP.set(step)
            wanted = async_dispatch_count(len(outstanding), len(ready), budget)
            for _ in range(0 if wanted == 0 or await self.hold_dispatch() else wanted):
                gid = f"{self.cfg.run_id}-a{step}-{n}"
                task = rng.choice(self.tasks)
                n += 1
                self.state = dataclasses.replace(self.state, dispatched=n)
                async with self.r.pipeline(transaction=True) as pipe:  # saved before it goes out
                    pipe.hset(
                        self.inflight_key,
                        gid,
                        json.dumps(
                            {
                                "version": self.state.weight_version,
                                "cursor": cursor,
                                "task": task,
                                "step": step,
                            }
                        ),
                    )
                    pipe.hset(self.keys.run, mapping=self.state.to_redis(["dispatched"]))
                    await pipe.execute()
                await self.dispatch(gid, task, self.cfg.group_size, {"step": step, "run_id": self.cfg.run_id})
                outstanding[gid] = self.state.weight_version
            cursor, batch = await self.read_results(cursor, 200)
            for rec in batch:
                if outstanding.pop(rec["group_id"], None) is None:
                    continue
                window.append(rec)
                if rec["outcome"] == "trained":
                    ready.append(rec)
            version = self.state.weight_version
            by_id = {g["group_id"]: g for g in ready}
            plan = plan_async_step(
                [Ready(g["group_id"], g.min_weight_version) for g in ready],
                outstanding,
                version,
                P,
                k,
            )
            ready = [by_id[g.group_id] for g in plan.ready]
            if plan.stale:
                dropped.extend(g.group_id for g in plan.stale)
                dropped_total += len(plan.stale)
                log.warning("dropping %d groups older than %d versions", len(plan.stale), k)
            if isinstance(plan, Wait):
                continue
            take = [by_id[g.group_id] for g in plan.take]
            trained_ids = {g["group_id"] for g in take}
            kept_ids = {g["group_id"] for g in ready}
            results = [g for g in window if g["outcome"] != "trained" or g["group_id"] in trained_ids]
            window = [g for g in window if g["outcome"] == "trained" and g["group_id"] in kept_ids]
            self.state = dataclasses.replace(self.state, stale_dropped=dropped_total)
            await self.train_step(
                step,
                [g["group_id"] for g in take],
                dropped,
                results,
                version,
                t0,
                time.perf_counter() - t0,
                colocated,
                {"stale_groups_dropped": float(dropped_total), "groups_in_flight": float(len(outstanding))},
            )
            dropped = []
            step += 1
            t0 = time.perf_counter()
            await self.save_state(status="rolling_out", step=step)

    async def evaluate(self) -> dict[str, Any]:
        """Every task `eval_repeats` times with the current weights; nothing here is trained on. Done
        once per run: a restarted scheduler re-reads the results from the saved stream position."""
        if self.state.eval_record:
            return self.state.eval_record
        cursor = self.state.eval_cursor or await self.results_cursor()
        await self.save_state(status="evaluating", eval_cursor=cursor)
        await self.wait_inference()
        group_ids = set()
        for i, task in enumerate(self.tasks):
            for k in range(self.cfg.eval_repeats):
                gid = f"{self.cfg.run_id}-eval-{i}-{k}"
                group_ids.add(gid)
                await self.dispatch(gid, task, 1, {"eval": True, "run_id": self.cfg.run_id})
        results = await self.wait_groups(group_ids, cursor)
        rewards = [r for g in results for r in g["rewards"]]
        record = {
            "eval_reward": sum(rewards) / len(rewards) if rewards else float("nan"),
            "eval_rollouts": len(rewards),
            "weight_version": self.state.weight_version,
            "time": time.time(),
        }
        await self.save_state(eval_record=record)
        run_metrics.export_eval(record["eval_reward"])
        self.write_metrics(record)
        return record

    async def serve(self, groups_per_step: int = 1, linger_s: float = 1.0) -> None:
        """Serve-only mode (`tether up`): users create and complete rollouts themselves; every time
        `groups_per_step` groups were scored (waiting `linger_s` for more), train and push."""
        self.cfg.run_dir.mkdir(parents=True, exist_ok=True)
        step = await self.start_run()
        await self.save_state(status="serving")
        cursor = await self.results_cursor()
        ready: list[dict] = []
        while not self.stop_requested:
            cursor, batch = await self.read_results(cursor, int(linger_s * 1000) if ready else 1000)
            ready.extend(rec for rec in batch if rec["outcome"] in ("trained", "filtered"))
            trained = [g["group_id"] for g in ready if g["outcome"] == "trained"]
            if not serve_should_train(len(trained), bool(batch), groups_per_step):
                continue  # keep collecting while groups are still arriving
            t0 = time.perf_counter()
            summary = step_summary(ready)
            metrics, push_s, update_s = await self.push(step, trained)
            record = {
                "step": step,
                "weight_version": self.state.weight_version,
                **summary,
                "logprob_abs_diff": metrics.get("logprob_abs_diff", float("nan")),
                "constrained_tokens_masked": metrics.get("constrained_tokens_masked", 0.0),
                "push_seconds": push_s,
                "paused_seconds": update_s,
                "step_seconds": time.perf_counter() - t0,
                "time": time.time(),
            }
            self.write_metrics(record)
            checked = StepMetrics.from_dict(record)
            run_metrics.export_step(checked)
            await broker.publish(self.r, self.keys.metrics, checked.to_dict())
            step += 1
            await self.save_state(
                status="serving", next_step=step, step=step, reward_mean=summary["reward_mean"]
            )
            ready = []

    async def run(self) -> None:
        self.cfg.run_dir.mkdir(parents=True, exist_ok=True)
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
