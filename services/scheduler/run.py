"""The run loop, in three backend-scheduling modes:

- colocated-sync: dispatch P tasks x G rollouts, wait for all their groups, drain gateway admission,
  put vLLM to sleep, train, wake it, push the weights, resume admission with the new version.
- colocated-async: keep up to N groups in flight; a step trains on the first P complete groups and
  the rest carry over; admission is drained around each step as in colocated-sync.
- disaggregated-async: inference and trainer run side by side; rollouts continue while the trainer
  trains; weights are pushed between steps (vLLM pause?mode=keep -> load -> resume, so requests in
  flight continue under the new weights). No sample trains whose oldest token was sampled more than
  `max_staleness` versions before the weights being updated: dispatch is throttled to
  (max_staleness + 1) x P groups in flight, and groups that still end up too old are dropped, counted.

Run state lives in Redis, so a restarted scheduler continues from the last completed step.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from tether.common import broker
from tether.v1 import gateway_pb2, inference_pb2, trainer_pb2, types_pb2

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunConfig:
    run_id: str
    steps: int
    tasks_per_step: int
    group_size: int
    seed: int
    run_dir: Path
    eval_repeats: int = 4
    rollout_timeout_s: float = 300.0
    drain_timeout_s: float = 60.0
    mode: str = "colocated-sync"
    max_staleness: int = 1
    max_inflight_groups: int = 0  # async modes; 0 = (max_staleness + 1) x tasks_per_step
    sleep_level: int = 0  # colocated modes: put vLLM to sleep (1 or 2) while the trainer trains
    max_attempts: int = 3  # a failed rollout is retried this many times in all, then excluded


MODES = ("colocated-sync", "colocated-async", "disaggregated-async")


@dataclass
class Stubs:
    gateway: Any
    inference: Any
    trainer: Any


def load_tasks(path: Path) -> list[dict]:
    tasks = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not tasks:
        raise ValueError(f"no tasks in {path}")
    for t in tasks:
        if "task_id" not in t:
            raise ValueError(f"task without task_id in {path}: {t}")
    return tasks


def step_summary(results: list[dict]) -> dict[str, float]:
    """Reward and accounting over one step's resolved groups (pure)."""
    rewards = [r for g in results for r in g["rewards"]]
    return {
        "reward_mean": sum(rewards) / len(rewards) if rewards else float("nan"),
        "rollouts": float(len(rewards)),
        "groups_trained": float(sum(g["outcome"] == "trained" for g in results)),
        "groups_filtered": float(sum(g["outcome"] == "filtered" for g in results)),
        "samples": float(sum(g["samples"] for g in results)),
        "tokens": float(sum(g["tokens"] for g in results)),
        "forks": float(sum(g.get("forks", 0) for g in results)),
        "sequences_per_rollout": (sum(g["sequences"] for g in results) / len(rewards)) if rewards else 0.0,
    }


class Run:
    def __init__(self, r, keys: broker.Keys, cfg: RunConfig, stubs: Stubs, tasks: list[dict]) -> None:
        self.r = r
        self.keys = keys
        self.cfg = cfg
        self.stubs = stubs
        self.tasks = tasks
        self.stop_requested = False
        self.state: dict[str, Any] = {"status": "starting", "step": 0, "weight_version": 0, "reward_mean": 0.0}

    async def save_state(self, **changes: Any) -> None:
        self.state.update(changes)
        await self.r.hset(self.keys.run, mapping={k: json.dumps(v) for k, v in self.state.items()})

    async def load_state(self) -> dict[str, Any]:
        raw = await self.r.hgetall(self.keys.run)
        return {k: json.loads(v) for k, v in raw.items()}

    async def results_cursor(self) -> str:
        last = await self.r.xrevrange(self.keys.group_results, count=1)
        return last[0][0] if last else "0-0"

    async def dispatch(self, group_id: str, task: dict, size: int, meta: dict) -> None:
        for i in range(size):
            await broker.publish_once(self.r, self.keys, self.keys.dispatch, f"dispatch:{group_id}:{i}", {
                "group_id": group_id, "task_id": task["task_id"], "group_size": size, "task": task,
                "metadata": meta, "max_attempts": self.cfg.max_attempts})

    async def read_results(self, cursor: str, block_ms: int) -> tuple[str, list[dict]]:
        """Group results published after `cursor` (waiting up to `block_ms`), and the new cursor."""
        resp = await self.r.xread({self.keys.group_results: cursor}, count=256, block=block_ms)
        out = []
        for _, items in resp or []:
            for eid, fields in items:
                cursor = eid
                out.append(broker.decode(fields))
        return cursor, out

    async def wait_groups(self, group_ids: set[str], cursor: str) -> list[dict]:
        """Group results for `group_ids`, read from the results stream after `cursor`."""
        found: dict[str, dict] = {}
        deadline = time.monotonic() + self.cfg.rollout_timeout_s
        while len(found) < len(group_ids) and time.monotonic() < deadline:
            cursor, batch = await self.read_results(cursor, 500)
            found.update((rec["group_id"], rec) for rec in batch if rec["group_id"] in group_ids)
        if len(found) < len(group_ids):
            log.warning("%d of %d groups unresolved after %.0fs", len(group_ids) - len(found), len(group_ids),
                        self.cfg.rollout_timeout_s)
        return list(found.values())

    async def push(self, step: int, group_ids: list[str], drop_ids: list[str] | None = None,
                   colocated: bool = True) -> tuple[dict[str, float], float, float]:
        """Train on `group_ids` and push the new weights. Colocated: drain admission (and sleep
        vLLM) around the update; disaggregated: rollouts keep running, vLLM freezes in-flight
        requests only while it loads. Returns (train metrics, push seconds, paused seconds)."""
        t0 = time.perf_counter()
        slept = False
        if colocated:
            await self.stubs.gateway.PauseAdmission(
                gateway_pb2.PauseAdmissionRequest(drain_timeout_s=self.cfg.drain_timeout_s))
        try:
            if colocated and self.cfg.sleep_level:
                await self.stubs.inference.Sleep(inference_pb2.SleepRequest(level=self.cfg.sleep_level))
                slept = True
            await self.save_state(status="training")
            resp = await self.stubs.trainer.TrainStep(trainer_pb2.TrainStepRequest(
                step=step, min_groups=len(group_ids), max_groups=len(group_ids), group_ids=group_ids,
                drop_group_ids=drop_ids or []))
            if slept:
                await self.stubs.inference.WakeUp(types_pb2.Empty())
                slept = False
            await self.save_state(status="pushing")
            t1 = time.perf_counter()
            loaded = await self.stubs.inference.LoadWeights(
                inference_pb2.LoadWeightsRequest(checkpoint_dir=resp.checkpoint_dir, version=resp.weight_version))
            push_s = time.perf_counter() - t1
            if loaded.version != resp.weight_version:
                raise RuntimeError(f"inference reports version {loaded.version}, expected {resp.weight_version}")
            await self.save_state(weight_version=loaded.version, checkpoint_dir=resp.checkpoint_dir)
        finally:
            if slept:
                await self.stubs.inference.WakeUp(types_pb2.Empty())
            # Colocated: admit again; disaggregated: tell the gateway which version now serves.
            await self.stubs.gateway.ResumeAdmission(
                gateway_pb2.ResumeAdmissionRequest(weight_version=self.state["weight_version"]))
        paused_s = time.perf_counter() - t0 if colocated else push_s
        return dict(resp.metrics), push_s, paused_s

    def write_metrics(self, record: dict[str, Any]) -> None:
        with open(self.cfg.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")

    def step_record(self, step: int, results: list[dict], metrics: dict[str, float], started: float,
                    rollout_s: float, push_s: float, paused_s: float, version_before: int) -> dict[str, Any]:
        summary = step_summary(results)
        trained = [g for g in results if g["outcome"] == "trained"]
        staleness = [version_before - g["min_weight_version"] for g in trained if g.get("min_weight_version", -1) >= 0]
        step_s = time.perf_counter() - started
        return {
            "step": step, "weight_version": self.state["weight_version"], **summary,
            "logprob_abs_diff": metrics.get("logprob_abs_diff", float("nan")),
            "logprob_k3_kl": metrics.get("logprob_k3_kl", float("nan")),
            "loss": metrics.get("loss", float("nan")),
            "grad_norm": metrics.get("grad_norm", float("nan")),
            "clip_fraction": metrics.get("clip_fraction", float("nan")),
            "trainer_tokens_per_s": metrics.get("train_tokens_per_s", float("nan")),
            "staleness_max": float(max(staleness, default=0)),
            "staleness_mean": sum(staleness) / len(staleness) if staleness else 0.0,
            "rollout_seconds": rollout_s, "push_seconds": push_s, "paused_seconds": paused_s,
            "step_seconds": step_s, "tokens_per_s": summary["tokens"] / max(step_s, 1e-9),
            "mode": self.cfg.mode, "time": time.time(),
        }

    async def finish_step(self, record: dict[str, Any]) -> None:
        self.write_metrics(record)
        await broker.publish(self.r, self.keys.metrics, record)
        await self.save_state(next_step=record["step"] + 1, reward_mean=record["reward_mean"])
        log.info("step %d reward %.3f version %d (%.1fs)", record["step"], record["reward_mean"],
                 self.state["weight_version"], record["step_seconds"])

    async def start_run(self) -> int:
        previous = await self.load_state()
        start = int(previous.get("next_step", 0)) if previous.get("run_id") == self.cfg.run_id else 0
        version = (await self.stubs.inference.GetWeightVersion(types_pb2.Empty())).version
        await self.save_state(run_id=self.cfg.run_id, total_steps=self.cfg.steps, weight_version=version,
                              run_dir=str(self.cfg.run_dir), next_step=start, mode=self.cfg.mode)
        await self.stubs.gateway.ResumeAdmission(gateway_pb2.ResumeAdmissionRequest(weight_version=version))
        return start

    async def train(self) -> None:
        if self.cfg.mode not in MODES:
            raise ValueError(f"unknown mode {self.cfg.mode!r}; expected one of {MODES}")
        start = await self.start_run()
        if self.cfg.mode == "colocated-sync":
            await self.train_sync(start)
        else:
            await self.train_async(start, colocated=self.cfg.mode == "colocated-async")

    async def train_sync(self, start: int) -> None:
        rng = random.Random(self.cfg.seed)
        for step in range(self.cfg.steps):
            chosen = [rng.choice(self.tasks) for _ in range(self.cfg.tasks_per_step)]
            if step < start:
                continue  # replay the task draws of finished steps so a resumed run sees the same tasks
            if self.stop_requested:
                await self.save_state(status="stopped")
                return
            t0 = time.perf_counter()
            await self.save_state(status="rolling_out", step=step)
            cursor = await self.results_cursor()
            group_ids = [f"{self.cfg.run_id}-s{step}-g{i}" for i in range(len(chosen))]
            for gid, task in zip(group_ids, chosen, strict=True):
                await self.dispatch(gid, task, self.cfg.group_size, {"step": step, "run_id": self.cfg.run_id})
            results = await self.wait_groups(set(group_ids), cursor)
            rollout_s = time.perf_counter() - t0
            version_before = self.state["weight_version"]
            trained = [g["group_id"] for g in results if g["outcome"] == "trained"]
            metrics: dict[str, float] = {}
            push_s = paused_s = 0.0
            if trained:
                metrics, push_s, paused_s = await self.push(step, trained)
            await self.finish_step(self.step_record(step, results, metrics, t0, rollout_s, push_s, paused_s,
                                                    version_before))

    async def train_async(self, start: int, colocated: bool) -> None:
        """Groups stay in flight across steps; a step trains on the first P complete groups."""
        P, k = self.cfg.tasks_per_step, self.cfg.max_staleness
        budget = self.cfg.max_inflight_groups or (k + 1) * P
        rng = random.Random(self.cfg.seed)
        cursor = await self.results_cursor()
        outstanding: dict[str, int] = {}
        ready: list[dict] = []
        window: list[dict] = []
        dropped: list[str] = []
        dropped_total = 0
        n = 0
        step = start
        t0 = time.perf_counter()
        await self.save_state(status="rolling_out", step=step)
        while step < self.cfg.steps:
            if self.stop_requested:
                await self.save_state(status="stopped")
                return
            while len(outstanding) < budget:
                gid = f"{self.cfg.run_id}-a{step}-{n}"
                n += 1
                await self.dispatch(gid, rng.choice(self.tasks), self.cfg.group_size,
                                    {"step": step, "run_id": self.cfg.run_id})
                outstanding[gid] = self.state["weight_version"]
            cursor, batch = await self.read_results(cursor, 200)
            for rec in batch:
                if outstanding.pop(rec["group_id"], None) is None:
                    continue
                window.append(rec)
                if rec["outcome"] == "trained":
                    ready.append(rec)
            version = self.state["weight_version"]
            stale = [g for g in ready if version - g.get("min_weight_version", version) > k]
            if stale:
                ready = [g for g in ready if g not in stale]
                dropped.extend(g["group_id"] for g in stale)
                dropped_total += len(stale)
                log.warning("dropping %d groups older than %d versions", len(stale), k)
            if len(ready) < P:
                continue
            take, ready = ready[:P], ready[P:]
            rollout_s = time.perf_counter() - t0
            metrics, push_s, paused_s = await self.push(step, [g["group_id"] for g in take], dropped, colocated)
            dropped = []
            trained_ids = {g["group_id"] for g in take}
            results = [g for g in window if g["outcome"] != "trained" or g["group_id"] in trained_ids]
            window = [g for g in window if g["outcome"] == "trained" and g in ready]
            record = self.step_record(step, results, metrics, t0, rollout_s, push_s, paused_s, version)
            record.update(stale_groups_dropped=float(dropped_total), groups_in_flight=float(len(outstanding)))
            await self.finish_step(record)
            step += 1
            t0 = time.perf_counter()
            await self.save_state(status="rolling_out", step=step)

    async def evaluate(self) -> dict[str, Any]:
        """Every task `eval_repeats` times with the current weights; nothing here is trained on."""
        await self.save_state(status="evaluating")
        cursor = await self.results_cursor()
        group_ids = set()
        for i, task in enumerate(self.tasks):
            for k in range(self.cfg.eval_repeats):
                gid = f"{self.cfg.run_id}-eval-{i}-{k}"
                group_ids.add(gid)
                await self.dispatch(gid, task, 1, {"eval": True, "run_id": self.cfg.run_id})
        results = await self.wait_groups(group_ids, cursor)
        rewards = [r for g in results for r in g["rewards"]]
        record = {"eval_reward": sum(rewards) / len(rewards) if rewards else float("nan"),
                  "eval_rollouts": len(rewards), "weight_version": self.state["weight_version"],
                  "time": time.time()}
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
            if len(trained) < groups_per_step or (batch and len(trained) < 4 * groups_per_step):
                continue  # keep collecting while groups are still arriving
            t0 = time.perf_counter()
            summary = step_summary(ready)
            metrics, push_s, update_s = await self.push(step, trained)
            record = {"step": step, "weight_version": self.state["weight_version"], **summary,
                      "logprob_abs_diff": metrics.get("logprob_abs_diff", float("nan")),
                      "push_seconds": push_s, "paused_seconds": update_s,
                      "step_seconds": time.perf_counter() - t0, "time": time.time()}
            self.write_metrics(record)
            await broker.publish(self.r, self.keys.metrics, record)
            step += 1
            await self.save_state(status="serving", next_step=step, step=step, reward_mean=summary["reward_mean"])
            ready = []

    async def run(self) -> None:
        self.cfg.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            await self.train()
            if self.state.get("status") == "stopped":
                return
            record = await self.evaluate()
            ckpt = self.state.get("checkpoint_dir")
            if ckpt:
                final = self.cfg.run_dir / "final-model"
                if final.exists():
                    shutil.rmtree(final)
                shutil.copytree(ckpt, final)
            await self.save_state(status="done", eval_reward=record["eval_reward"])
        except grpc.aio.AioRpcError as exc:
            log.error("run failed: %s %s", exc.code(), exc.details())
            await self.save_state(status="failed", error=f"{exc.code()}: {exc.details()}")
            raise
        except Exception as exc:
            await self.save_state(status="failed", error=repr(exc))
            raise
