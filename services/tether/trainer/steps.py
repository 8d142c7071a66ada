"""The trainer's run state on rank 0 and the step every rank runs: what is buffered, what was trained,
which version is current.

- `StepRunner`: what every data-parallel rank does for one step (train, then gather what the checkpoint
  needs). Rank 0 broadcasts each command; the other ranks run `follow()`.
- `TrainerCore` (rank 0): buffers complete groups (spooled to disk until trained, so a restart loses
  none), trains each step number at most once (a repeated step for a finished one returns the recorded
  result), writes checkpoints carrying the optimizer state and the trainer's position, and picks up
  from them (see tether.trainer.weights).
- `Trainer` (rank 0, on the event loop): one step, weight push or rank command at a time; a step's
  training and checkpoint run in a worker thread.

Errors are plain exceptions (InvalidGroup, NotReady, StepFailed, TrainerBroken); tether.trainer.servicer
maps them to gRPC status codes. Who may call: the servicer and main.py (wiring); no other room.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import os
import signal
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import orjson
import torch
from prometheus_client import Counter, Gauge, Histogram

from tether.common.records import RecordError, SampleRecord
from tether.common.sharing import SharingPolicy, TurnBook
from tether.trainer import distributed
from tether.trainer.distributed import Dist
from tether.trainer.train import StepConfig, train_step
from tether.trainer.weights import (
    OPTIMIZER_DIR,
    as_peft,
    checkpoint_name,
    merged_lora_state_dict,
    optimizer_staging,
    write_checkpoint,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from tether.trainer.nccl_push import PushReport

log = logging.getLogger(__name__)


class Runs(Protocol):
    """What the step loop asks of the runs beside the single policy (tether.trainer.runs.RunSet, which
    imports this module: named here by what it does, so imports run one way)."""

    def get(self, run_id: str) -> TrainerCore: ...

    def open(self, run_id: str, adapter: str, settings: dict[str, str]) -> TrainerCore: ...

    def close(self, run_id: str) -> bool: ...

    def weight(self, run_id: str) -> float: ...


# Every series of a policy's steps carries `run`: the run id, "" for the single policy. Prometheus keeps
# no empty label, so the single policy's series are stored exactly as before runs were labelled, and
# dashboards and alert rules written for them read the same; `{run=""}` selects the single policy's.
RUN = "run"
STEPS = Counter("tether_trainer_steps_total", "Training steps done", [RUN])
BUFFERED = Gauge("tether_trainer_buffered_groups", "Complete groups waiting to be trained on", [RUN])
STEP_SECONDS = Histogram(
    "tether_trainer_step_seconds",
    "Wall time of one training step",
    [RUN],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300),
)
TOKENS = Counter("tether_trainer_tokens_total", "Tokens trained on", [RUN])
VERSION = Gauge("tether_trainer_weight_version", "Version of the newest checkpoint", [RUN])
STALENESS = Gauge("tether_trainer_staleness_max", "Max weight-version lag of the last step's samples", [RUN])
FLOPS = Counter(
    "tether_trainer_model_flops_total",
    "Model FLOPs of the steps trained: the useful work, attention included, counted from the samples' lengths",
    [RUN],
)
MFU = Gauge("tether_trainer_mfu", "Model FLOPs utilisation of the last step against the devices' peak", [RUN])
PEAK_MEMORY = Gauge(
    "tether_trainer_peak_memory_bytes",
    "Most memory the last step held on a device (CUDA allocator peak; CPU: the process's peak resident set)",
    [RUN],
)
# Learning health, from the step's own pass (train.train_step's metrics; NaN until a step trained).
ENTROPY = Gauge(
    "tether_trainer_policy_entropy", "Mean entropy of the policy over the last step's trained tokens", [RUN]
)
POLICY_KL = Gauge(
    "tether_trainer_policy_kl",
    "k3 estimate of KL(sampling policy || policy trained) over the last step's trained tokens, before its update",
    [RUN],
)
UPDATE_KL = Gauge(
    "tether_trainer_update_kl",
    "k3 estimate of KL(sampling policy || updated policy) after the last step's update (the step guard's "
    "measure; NaN with the guard off)",
    [RUN],
)
CLIPPED = Gauge(
    "tether_trainer_clip_fraction",
    "Fraction of the last step's trained tokens the objective clipped: below the range, above it, or by the "
    "dual clip",
    [RUN, "side"],
)
RATIO = Gauge(
    "tether_trainer_importance_ratio",
    "Importance ratio (policy / sampling policy) the objective clipped, over the last step's trained tokens",
    [RUN, "stat"],
)
GRAD_NORM = Gauge("tether_trainer_grad_norm", "Gradient norm of the last step, before clipping", [RUN])
GUARD_RETRIES = Counter(
    "tether_trainer_step_guard_retries_total",
    "Updates the step guard undid and made again at a lower rate",
    [RUN],
)
# Each side's label -> train_step's metric.
CLIP_SIDES = {"low": "clip_low_fraction", "high": "clip_high_fraction", "dual": "dual_clip_fraction"}
RATIO_STATS = ("mean", "min", "max")
POLICY_SERIES = (
    STEPS, BUFFERED, STEP_SECONDS, TOKENS, VERSION, STALENESS, FLOPS, MFU, PEAK_MEMORY,
    ENTROPY, POLICY_KL, UPDATE_KL, GRAD_NORM, GUARD_RETRIES,
)  # fmt: skip


def open_series(run: str) -> None:
    """A policy's series, there from its start: the learning-health gauges NaN until it trained, the
    counters at 0 (so a first step already counts in `increase`)."""
    for gauge in (ENTROPY, POLICY_KL, UPDATE_KL, GRAD_NORM):
        gauge.labels(run).set(math.nan)
    for side in CLIP_SIDES:
        CLIPPED.labels(run, side).set(math.nan)
    for stat in RATIO_STATS:
        RATIO.labels(run, stat).set(math.nan)
    for counter in (STEPS, TOKENS, FLOPS, GUARD_RETRIES):
        counter.labels(run)


def close_series(run: str) -> None:
    """A closed run's series leave the exposition (they come back at 0 if it is opened again)."""
    for metric in POLICY_SERIES:
        with contextlib.suppress(KeyError):
            metric.remove(run)
    for side in CLIP_SIDES:
        with contextlib.suppress(KeyError):
            CLIPPED.remove(run, side)
    for stat in RATIO_STATS:
        with contextlib.suppress(KeyError):
            RATIO.remove(run, stat)


open_series("")  # the single policy's, whether it trains or not (as before runs)
PATHS = Gauge(
    "tether_trainer_path",
    "1 for the kernel path each part of the step runs (attention of packed rows, LM head), chosen at start",
    ["part", "path"],
)


def export_learning_health(metrics: dict[str, float], run: str = "") -> None:
    """The learning-health gauges of policy `run` from a trained step's metrics (a figure it lacks: NaN)."""
    nan = math.nan
    ENTROPY.labels(run).set(metrics.get("entropy", nan))
    POLICY_KL.labels(run).set(metrics.get("policy_kl", nan))
    UPDATE_KL.labels(run).set(metrics.get("step_kl", nan))
    GRAD_NORM.labels(run).set(metrics.get("grad_norm", nan))
    for side, key in CLIP_SIDES.items():
        CLIPPED.labels(run, side).set(metrics.get(key, nan))
    for stat in RATIO_STATS:
        RATIO.labels(run, stat).set(metrics.get(f"ratio_{stat}", nan))
    GUARD_RETRIES.labels(run).inc(metrics.get("step_guard_retries", 0.0))


STEP_RATE_WINDOW_S = 600.0  # GetStatus's steps_per_minute: over the last 10 minutes
STEP_RATE_KEPT = 4096  # finish times kept for it (a step every 0.15 s fills the window)


def steps_per_minute(
    finished: list[float], now: float, since: float, window_s: float = STEP_RATE_WINDOW_S
) -> float:
    """Steps per minute over the last `window_s` seconds, or since `since` (this process started) when
    that is sooner; `finished`: the steps' finish times. A policy that stopped training falls to 0 as
    its steps leave the window."""
    span = min(window_s, now - since)
    if span <= 0:
        return 0.0
    return 60.0 * sum(1 for f in finished if now - f <= window_s) / span


def validate(sample: SampleRecord, vocab_size: int) -> str | None:
    """What is wrong with a sample, or None."""
    n = len(sample.token_ids)
    if n < 2:
        return "a sample needs at least 2 tokens"
    if not (len(sample.loss_mask) == len(sample.rollout_logprobs) == len(sample.advantages) == n):
        return "token_ids, loss_mask, rollout_logprobs and advantages must have equal lengths"
    if any(t < 0 or t >= vocab_size for t in sample.token_ids):
        return f"token id outside the vocabulary (size {vocab_size})"
    if any(m not in (0, 1) for m in sample.loss_mask):
        return "loss_mask values must be 0 or 1"
    if not all(math.isfinite(x) for x in sample.rollout_logprobs) or not all(
        math.isfinite(x) for x in sample.advantages
    ):
        return "rollout_logprobs and advantages must be finite"
    return None


# --- errors (the servicer maps them to status codes) ----------------------------------------------------


class InvalidGroup(ValueError):
    """INVALID_ARGUMENT: the group cannot be trained on as sent."""


class NotReady(RuntimeError):
    """FAILED_PRECONDITION: not enough groups buffered, or a step the trainer can no longer account for."""


class StepFailed(RuntimeError):
    """The step did not update the weights; the same request can be retried (RESOURCE_EXHAUSTED for
    out-of-memory, INTERNAL otherwise)."""

    def __init__(self, message: str, out_of_memory: bool = False) -> None:
        super().__init__(message)
        self.out_of_memory = out_of_memory


class TrainerBroken(RuntimeError):
    """UNAVAILABLE: the weights in memory no longer match the newest checkpoint; restart the trainer
    (it resumes from that checkpoint)."""


class UnknownRun(LookupError):
    """NOT_FOUND: a run id this trainer has not opened (OpenRun)."""


class RunRefused(ValueError):
    """INVALID_ARGUMENT: a run that cannot be opened as asked (its id, its adapter)."""


class RunsUnavailable(RuntimeError):
    """FAILED_PRECONDITION: this trainer cannot hold runs (no LoRA, several ranks)."""


# --- every rank -----------------------------------------------------------------------------------------


@dataclass
class StepOutput:
    metrics: dict[str, float]
    model_state: dict[str, torch.Tensor] | None  # None: save the model's own tensors
    optimizer_dir: Path  # where the ranks wrote the optimizer shards
    adapter_state: dict[str, torch.Tensor] | None  # LoRA weights, rank 0 only


class StepRunner:
    """One training step on this rank, and the commands that keep all ranks in step.

    `model` is the HF model (or its peft wrapper), `engine` what runs forward/backward (the model, DDP
    or FSDP2), `hf_model` the plain HF model whose `save_pretrained` writes checkpoints.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        engine: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        cfg: StepConfig,
        d: Dist,
        checkpoint_root: Path,
        ref_model: torch.nn.Module | None = None,
    ) -> None:
        self.model = model
        self.checkpoint_root = checkpoint_root  # every rank writes its optimizer shards under it
        self.ref_model = ref_model
        self.engine = engine
        self.optimizer = optimizer
        self.cfg = cfg
        self.d = d
        self.lora = hasattr(model, "get_base_model")
        # The peft adapter this runner trains ("default": the single policy's, as apply_lora names it).
        self.adapter_name = "default"
        self.run_id = ""  # the run this runner trains; "" = the single policy
        self.hf_model = distributed.hf_model(model)
        self.vocab_size = int(self.hf_model.config.vocab_size)

    def activate(self) -> None:
        """Make this runner's adapter the one that runs and trains (peft's set_adapter also leaves only
        its parameters trainable); nothing to do while it already is, as without runs."""
        if self.lora and as_peft(self.model).active_adapter != self.adapter_name:
            as_peft(self.model).set_adapter(self.adapter_name)

    def run(self, samples: list[SampleRecord], version: int, intended_groups: int = 0) -> StepOutput:
        self.activate()
        metrics = train_step(
            self.engine,
            self.optimizer,
            samples,
            self.cfg,
            version=version,
            rank=self.d.rank,
            world=self.d.world,
            ref_model=self.ref_model,
            device=self.d.device,
            intended_groups=intended_groups,
        )
        model_state, adapter = self.trained_state()
        optim = optimizer_staging(self.checkpoint_root, version + 1)
        distributed.save_optimizer(self.model, self.optimizer, optim)
        return StepOutput(metrics, model_state, optim, adapter)

    def trained_state(self) -> tuple[dict[str, torch.Tensor] | None, dict[str, torch.Tensor] | None]:
        """(the weights the checkpoint saves, the LoRA adapter's tensors) after a step: merged weights
        and the adapter with LoRA (rank 0), the gathered weights under FSDP, else the model's own."""
        if not self.lora:
            return distributed.model_state(self.model, self.d), None
        if self.d.rank != 0:
            return None, None
        return merged_lora_state_dict(self.model), self.adapter_state()

    def adapter_state(self) -> dict[str, torch.Tensor]:
        from peft import get_peft_model_state_dict

        state = get_peft_model_state_dict(self.model, adapter_name=self.adapter_name)
        return {k: v.detach().cpu().clone() for k, v in state.items()}

    def save_weights(self, folder: Path, out: StepOutput, tokenizer: PreTrainedTokenizerBase) -> None:
        """A checkpoint's weights: the HF model (full or merged weights) and the tokenizer, for vLLM."""
        self.hf_model.save_pretrained(folder, safe_serialization=True, state_dict=out.model_state)
        tokenizer.save_pretrained(folder)

    def publish(self, checkpoint: Path, version: int) -> None:
        """After the checkpoint of `version`: where else its weights go (a run's adapter directory)."""

    def adapter_dir(self, version: int) -> str:
        """Where `publish` puts `version`; "" when nothing is published beside the checkpoint."""
        return ""

    def describe(self, version: int) -> dict[str, Any]:
        """What GetStatus adds for this runner's policy at `version` (a run's id and adapter)."""
        return {}

    # Rank 0 side: each command is broadcast, then run here too.
    def step(self, samples: list[SampleRecord], version: int, intended_groups: int = 0) -> StepOutput:
        distributed.broadcast(("step", samples, version, intended_groups))
        return self.run(samples, version, intended_groups)

    def heartbeat(self) -> None:
        distributed.broadcast(("noop",))

    def stop(self) -> None:
        distributed.broadcast(("stop",))

    def follow(self) -> None:
        """Ranks > 0: run rank 0's commands until it says stop. SIGTERM/SIGINT are ignored here: torchrun
        signals every rank at once, and rank 0 finishes its step, then sends "stop" (if rank 0 dies
        instead, the next collective fails and this rank exits)."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        while True:
            cmd = distributed.broadcast(None)
            if cmd[0] == "stop":
                return
            if cmd[0] == "step":
                self.run(cmd[1], cmd[2], cmd[3])


# --- rank 0: buffer, steps, checkpoints -----------------------------------------------------------------


class GroupSpool:
    """Groups accepted but not trained yet, one file each, so a restarted trainer still has them (the
    merger hands a group over once). Files are named by arrival order, so the order survives too."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        for tmp in folder.glob(".tmp-*"):
            tmp.unlink(missing_ok=True)
        self.files: dict[str, Path] = {}
        self.next_seq = 0

    def load(self) -> list[tuple[str, list[SampleRecord], int]]:
        out = []
        for path in sorted(self.folder.glob("*.group")):
            try:
                data = orjson.loads(path.read_bytes())
                samples = [SampleRecord.from_dict(s) for s in data["samples"]]
            except (orjson.JSONDecodeError, RecordError) as exc:
                log.warning("unreadable spooled group %s (%s); dropped", path, exc)
                path.unlink(missing_ok=True)
                continue
            self.files[data["group_id"]] = path
            self.next_seq = max(self.next_seq, int(path.name.split("-", 1)[0]) + 1)
            out.append((data["group_id"], samples, int(data["rollouts"])))
        return out

    def add(self, group_id: str, samples: list[SampleRecord], rollouts: int) -> None:
        digest = hashlib.sha1(group_id.encode()).hexdigest()[:16]
        path = self.folder / f"{self.next_seq:012d}-{digest}.group"
        self.next_seq += 1
        tmp = self.folder / f".tmp-{path.name}"
        payload = orjson.dumps(
            {"group_id": group_id, "rollouts": rollouts, "samples": [s.to_dict() for s in samples]}
        )
        with open(tmp, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        self.files[group_id] = path

    def remove(self, group_id: str) -> None:
        path = self.files.pop(group_id, None)
        if path is not None:
            path.unlink(missing_ok=True)


@dataclass
class StepRecord:
    step: int
    weight_version: int
    checkpoint_dir: str
    metrics: dict[str, float]
    groups: list[str]
    replayed: bool = False
    adapter_dir: str = ""  # a run's step: its adapter's directory of weight_version

    def to_state(self) -> dict[str, Any]:
        state = {
            "step": self.step,
            "weight_version": self.weight_version,
            "checkpoint_dir": self.checkpoint_dir,
            "metrics": dict(self.metrics),
            "groups": list(self.groups),
        }
        return {**state, "adapter_dir": self.adapter_dir} if self.adapter_dir else state


@dataclass
class StepPlan:
    step: int
    group_ids: list[str]
    samples: list[SampleRecord]
    drop_ids: list[str] = field(default_factory=list)  # buffered groups discarded with this step
    intended_groups: int = 0  # the groups the scheduler meant the step to train (0: not said)
    position: dict[str, Any] = field(default_factory=dict)
    model_state: dict[str, torch.Tensor] | None = None  # gathered / merged weights of the new version


class TrainerCore:
    """Rank 0's view of the run: what is buffered, what was trained, which version is current."""

    def __init__(
        self,
        runner: StepRunner,
        tokenizer: PreTrainedTokenizerBase,
        checkpoint_root: Path,
        *,
        keep: int = 3,
        resumed: dict[str, Any] | None = None,
        records_kept: int = 256,
        settings: dict[str, Any] | None = None,
        keep_push_state: bool = False,
    ) -> None:
        self.runner = runner
        self.run = runner.run_id  # its series' `run` label: "" for the single policy
        self.tokenizer = tokenizer
        self.root = checkpoint_root
        self.keep = keep
        self.records_kept = records_kept
        self.settings = settings or {}
        state = resumed or {}
        self.version = int(state.get("version", 0))
        self.steps_done = int(state.get("steps_done", 0))
        self.trained: list[str] = list(state.get("trained_groups", []))
        self.dropped: list[str] = list(state.get("dropped_groups", []))
        self.consumed = set(self.trained) | set(self.dropped)  # a group is trained or dropped once
        self.records: dict[int, dict[str, Any]] = {int(k): v for k, v in state.get("records", {}).items()}
        # Steps at or below this one may have been trained, but their records were dropped.
        self.records_floor = int(state.get("records_floor", -1))
        self.last_step: int | None = state.get("last_step")
        self.last_step_time = float(state.get("last_step_time", 0.0))
        self.started = time.time()
        self.step_times: deque[float] = deque(maxlen=STEP_RATE_KEPT)  # this process's, newest last
        self.broken: str | None = None
        # Path 2 pushes what was saved: the gathered (FSDP) or merged (LoRA) state of the newest step.
        self.keep_push_state = keep_push_state
        self.last_state: dict[str, torch.Tensor] | None = None
        self.spool = GroupSpool(checkpoint_root / "buffer")
        self.groups: OrderedDict[str, tuple[list[SampleRecord], int]] = OrderedDict()
        for group_id, samples, rollouts in self.spool.load():
            if group_id in self.consumed:
                self.spool.remove(group_id)
            else:
                self.groups[group_id] = (samples, rollouts)
        self._set_gauges()

    def _set_gauges(self, record: StepRecord | None = None) -> None:
        """The buffer and version gauges of this policy, and with `record` the step's figures."""
        run = self.run
        BUFFERED.labels(run).set(len(self.groups))
        VERSION.labels(run).set(self.version)
        if record is None:
            return
        STALENESS.labels(run).set(record.metrics.get("staleness_max", 0.0))
        MFU.labels(run).set(record.metrics.get("mfu", 0.0))
        PEAK_MEMORY.labels(run).set(record.metrics.get("peak_memory_gib", 0.0) * 2**30)
        export_learning_health(record.metrics, run)

    # SubmitGroup
    def submit(self, group_id: str, samples: list[SampleRecord], rollouts: int) -> tuple[int, bool]:
        """Buffer a complete group; returns (buffered groups, duplicate)."""
        if not group_id:
            raise InvalidGroup("group_id is required")
        if group_id in self.consumed or group_id in self.groups:
            return len(self.groups), True
        if not samples:
            raise InvalidGroup(f"group {group_id} has no samples")
        for s in samples:
            problem = validate(s, self.runner.vocab_size)
            if problem:
                raise InvalidGroup(f"rollout {s.rollout_id}: {problem}")
        self.spool.add(group_id, samples, rollouts)
        self.groups[group_id] = (samples, rollouts)
        self._set_gauges()
        return len(self.groups), False

    # TrainStep, in three parts: plan (event loop), execute (worker thread), finish (event loop).
    def plan(
        self,
        step: int,
        min_groups: int,
        max_groups: int,
        group_ids: list[str] | None = None,
        drop_ids: list[str] | None = None,
    ) -> StepPlan | StepRecord:
        """What step `step` trains on: exactly `group_ids` (in that order) when given, else the oldest
        buffered groups (at least `min_groups`, at most `max_groups`, 0 = all). `drop_ids` are buffered
        groups to discard without training (stale ones); they go with this step's checkpoint."""
        if self.broken:
            raise TrainerBroken(self.broken)
        drop = [g for g in dict.fromkeys(drop_ids or ()) if g in self.groups and g not in (group_ids or ())]
        if step in self.records:
            self._discard(drop)  # the step is done; its drops can still be honoured
            return StepRecord(**self.records[step], replayed=True)
        if step <= self.records_floor:
            raise NotReady(
                f"step {step} is older than the step records kept (newest {self.records_floor} "
                "dropped); cannot tell whether it was trained"
            )
        if group_ids:
            ids = list(dict.fromkeys(group_ids))
            missing = [g for g in ids if g not in self.groups]
            if missing:
                gone = [g for g in missing if g in self.consumed]
                raise NotReady(
                    f"{len(missing)} requested groups are not buffered (e.g. {missing[:3]}"
                    + (f"; already trained or dropped: {gone[:3]}" if gone else "")
                    + ")"
                )
        else:
            candidates = [g for g in self.groups if g not in drop]
            need = max(1, min_groups)
            if len(candidates) < need:
                raise NotReady(f"{len(candidates)} groups buffered, step needs {need}")
            ids = candidates if max_groups <= 0 else candidates[:max_groups]
        return StepPlan(step, ids, [s for gid in ids for s in self.groups[gid][0]], drop_ids=drop)

    def _discard(self, group_ids: list[str]) -> None:
        for gid in group_ids:
            if self.groups.pop(gid, None) is not None:
                self.dropped.append(gid)
                self.consumed.add(gid)
                self.spool.remove(gid)
        self._set_gauges()

    def execute(self, plan: StepPlan) -> StepRecord:
        """Train and write the checkpoint. Blocking; called with no other step in flight."""
        try:
            out = self.runner.step(plan.samples, self.version, plan.intended_groups)
        except Exception as exc:
            self.runner.optimizer.zero_grad(set_to_none=True)
            if self.runner.d.active:  # the ranks may now disagree about where they are
                self.broken = f"step {plan.step} failed on a multi-rank trainer: {exc!r}"
            oom = isinstance(exc, (torch.OutOfMemoryError, MemoryError))
            raise StepFailed(
                f"step {plan.step} failed before the update: {exc!r}", out_of_memory=oom
            ) from exc
        version = self.version + 1
        path = self.root / checkpoint_name(version)
        metrics = {
            **out.metrics,
            "groups": float(len(plan.group_ids)),
            "groups_dropped": float(len(plan.drop_ids)),
        }
        record = StepRecord(
            plan.step,
            version,
            str(path),
            metrics,
            plan.group_ids,
            adapter_dir=self.runner.adapter_dir(version),
        )
        records = dict(self.records)
        records[plan.step] = record.to_state()
        floor = self.records_floor
        while len(records) > self.records_kept:
            oldest = min(records)
            floor = max(floor, oldest)
            del records[oldest]
        plan.position = {
            "version": version,
            "steps_done": self.steps_done + 1,
            "trained_groups": self.trained + plan.group_ids,
            "dropped_groups": self.dropped + plan.drop_ids,
            "records": records,
            "records_floor": floor,
            "last_step": plan.step,
            "last_step_time": time.time(),
        }
        state = {
            **plan.position,
            "optimizer_dir": OPTIMIZER_DIR,
            "adapter": out.adapter_state,
            "rng": torch.get_rng_state(),
            "settings": self.settings,
        }
        try:
            write_checkpoint(
                lambda folder: self.runner.save_weights(folder, out, self.tokenizer),
                self.root,
                version,
                keep=self.keep,
                trainer_state=state,
                optimizer_dir=out.optimizer_dir,
            )
            self.runner.publish(path, version)
        except Exception as exc:
            self.broken = f"checkpoint v{version} could not be written after the update: {exc!r}"
            raise TrainerBroken(self.broken) from exc
        if self.keep_push_state:
            plan.model_state = out.model_state
        return record

    def finish(self, plan: StepPlan, record: StepRecord) -> None:
        p = plan.position
        self.version, self.steps_done, self.last_step = p["version"], p["steps_done"], p["last_step"]
        self.last_step_time = p["last_step_time"]
        self.step_times.append(time.time())
        self.trained, self.dropped = p["trained_groups"], p["dropped_groups"]
        self.consumed.update(plan.group_ids)
        self.consumed.update(plan.drop_ids)
        self.records, self.records_floor = p["records"], p["records_floor"]
        self.last_state = plan.model_state
        for gid in plan.group_ids + plan.drop_ids:
            self.groups.pop(gid, None)
            self.spool.remove(gid)
        STEPS.labels(self.run).inc()
        TOKENS.labels(self.run).inc(record.metrics.get("tokens", 0.0))
        FLOPS.labels(self.run).inc(record.metrics.get("model_flops", 0.0))
        self._set_gauges(record)

    def checkpoint_dir(self) -> str:
        return str(self.root / checkpoint_name(self.version)) if self.version else ""

    def _check_current(self, version: int) -> None:
        if self.broken:
            raise TrainerBroken(self.broken)
        if version != self.version:
            raise NotReady(f"the trainer holds version {self.version}, not {version}")

    def adapter_dir_at(self, version: int) -> str:
        """A run's push: the directory of its adapter at `version`, the current one."""
        self._check_current(version)
        return self.runner.adapter_dir(version)

    def push_state(self, version: int) -> dict[str, torch.Tensor]:
        """The full weights of `version` under the HF names vLLM loads (rank 0), for path 2."""
        self._check_current(version)
        if self.last_state is not None:
            return self.last_state
        if self.runner.lora:
            self.runner.activate()  # runs may have trained their adapters since
            return merged_lora_state_dict(self.runner.model)
        if self.runner.d.fsdp:
            raise NotReady(
                f"the full weights of version {version} are not gathered (restarted FSDP trainer); "
                "load its checkpoint instead"
            )
        return self.runner.hf_model.state_dict()

    def status(self) -> dict[str, Any]:
        return {
            "buffered_groups": len(self.groups),
            "buffered_samples": sum(len(g) for g, _ in self.groups.values()),
            "weight_version": self.version,
            "steps_done": self.steps_done,
            "last_step": self.last_step,
            "checkpoint_dir": self.checkpoint_dir(),
            "last_step_time": self.last_step_time,
            "steps_per_minute": steps_per_minute(list(self.step_times), time.time(), self.started),
            **self.runner.describe(self.version),
        }


# --- rank 0: one thing at a time -----------------------------------------------------------------------


class Turns:
    """The policies' steps, one at a time, in the order the sharing policy says (tether.common.sharing):
    a step waits for its turn, holds it while it plans, trains and checkpoints, and gives it back; the
    next turn goes to the step `TurnBook.pick` chooses among those waiting (within one policy, in
    arrival order). When the pick is the policy whose step just ended, not back yet, the turn is held
    for it up to `hold_s` seconds, then goes to the waiting ones."""

    def __init__(self, book: TurnBook, weight: Callable[[str], float], hold_s: float = 0.0) -> None:
        self.book = book
        self.weight = weight  # a policy's weight ("": the single policy)
        self.hold_s = hold_s
        self.waiting: list[tuple[str, asyncio.Future[None]]] = []  # arrival order
        self.busy = False
        self.returning: str | None = None  # the policy whose step just ended, while it may come back
        self.hold: asyncio.TimerHandle | None = None
        self.order: list[str] = []  # the policies served, in order (tests, logs)

    @contextlib.asynccontextmanager
    async def turn(self, run: str) -> AsyncIterator[None]:
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiting.append((run, granted))
        self._dispatch()
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():
                self._release(run)  # granted as it was cancelled: hand the turn on
            else:
                self.waiting = [(r, f) for r, f in self.waiting if f is not granted]
                self._dispatch()
            raise
        try:
            yield
        finally:
            self._release(run)

    def _release(self, run: str) -> None:
        self.busy = False
        self.returning = run if self.hold_s > 0 else None
        self._dispatch()
        if self.returning is not None and self.hold is None:
            self.hold = asyncio.get_running_loop().call_later(self.hold_s, self._stop_holding)

    def _stop_holding(self) -> None:
        self.hold, self.returning = None, None
        self._dispatch()

    def _dispatch(self) -> None:
        if self.busy or not self.waiting:
            return
        runs = list(dict.fromkeys(r for r, _ in self.waiting))
        choice = self.book.pick(runs, self.returning)
        if choice not in runs:
            return  # held for the policy whose step just ended
        if self.hold is not None:
            self.hold.cancel()
        self.hold, self.returning = None, None
        i = next(i for i, (r, _) in enumerate(self.waiting) if r == choice)
        _, granted = self.waiting.pop(i)
        self.busy = True
        self.book.served(choice, self.weight(choice))
        self.order.append(choice)
        granted.set_result(None)

    def forget(self, run: str) -> None:
        self.book.forget(run)


class Trainer:
    """Rank 0's entry point from the event loop: one step, weight push or rank command at a time; the
    steps of several policies in the order of the sharing policy (`turns`; round-robin by default).

    `pusher`: a tether.trainer.nccl_push.WeightPusher when path 2 is on (TETHER_WEIGHT_PUSH=nccl), else
    None. The caller shields `train` and `push` (a step, once planned, runs to its end even if the
    caller goes away: a restarted scheduler then gets the recorded result, never a second update).
    """

    def __init__(
        self,
        core: TrainerCore,
        pusher: Any = None,
        step_delay_s: float = 0.0,
        runs: Runs | None = None,
        sharing: SharingPolicy = "round_robin",
        hold_s: float = 0.0,
        weight: float = 1.0,
    ) -> None:
        self.core = core
        self.runs = runs  # the runs beside the single policy (tether.trainer.runs); None: none
        self.pusher = pusher
        self.step_delay_s = step_delay_s  # tests: a slow step (TETHER_TEST_STEP_DELAY_S)
        self.lock = asyncio.Lock()  # one step, push (or rank command) at a time
        self.single_weight = weight  # the single policy's share (TETHER_RUN_WEIGHT)
        # The sharing policy (TETHER_RUN_SHARING) and how long a turn waits for the policy it picks.
        self.turns = Turns(TurnBook(sharing), self.weight, hold_s)

    def weight(self, run_id: str) -> float:
        """A policy's share under the weighted sharing policy: a run's own (its settings' run_weight), the
        single policy's the trainer's."""
        if run_id and self.runs is not None:
            return self.runs.weight(run_id)
        return self.single_weight

    async def train(
        self,
        step: int,
        min_groups: int,
        max_groups: int,
        group_ids: list[str],
        drop_ids: list[str],
        run_id: str = "",
        intended_groups: int = 0,
    ) -> StepRecord:
        """Plan, train (worker thread) and finish step `step` of the single policy or run `run_id`; the
        recorded result if it was trained. `intended_groups`: the groups the scheduler meant the step to
        train (the loss's `intended` denominator). The policies' steps take turns (`turns`), each under the lock."""
        self.core_of(run_id)  # a run not open is refused at once, not after waiting for a turn
        async with self.turns.turn(run_id), self.lock:
            core = self.core_of(run_id)
            plan = core.plan(step, min_groups, max_groups, group_ids, drop_ids)
            if isinstance(plan, StepRecord):
                log.info(
                    "step %d was already trained (version %d); returning its record",
                    step,
                    plan.weight_version,
                )
                return plan
            plan.intended_groups = intended_groups
            log.info(
                "training step %d on %d groups (version %d)",
                plan.step,
                len(plan.group_ids),
                core.version,
            )
            with STEP_SECONDS.labels(core.run).time():
                record = await asyncio.to_thread(self._execute, core, plan)
            core.finish(plan, record)
            log.info(
                "%sstep %d -> version %d: %s",
                f"run {run_id}: " if run_id else "",
                step,
                record.weight_version,
                {k: round(v, 4) for k, v in record.metrics.items()},
            )
            return record

    def _execute(self, core: TrainerCore, plan: Any) -> StepRecord:
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        return core.execute(plan)

    def core_of(self, run_id: str) -> TrainerCore:
        """The single policy's core ("") or run `run_id`'s; UnknownRun for a run not opened."""
        if not run_id:
            return self.core
        if self.runs is None:
            raise UnknownRun(f"run {run_id!r} is not open on this trainer (it holds no runs)")
        return self.runs.get(run_id)

    async def open_run(
        self, run_id: str, adapter: str, settings: dict[str, str] | None = None
    ) -> TrainerCore:
        """Open run `run_id` with its own `settings` (its adapter added to the model: no step may run
        meanwhile)."""
        if self.runs is None:
            raise RunsUnavailable("this trainer holds no runs")
        runs = self.runs
        async with self.lock:
            return await asyncio.to_thread(runs.open, run_id, adapter, dict(settings or {}))

    async def close_run(self, run_id: str) -> bool:
        """Close run `run_id`: its adapter and optimizer leave memory once its step in hand (if any)
        ended; False when it was not open. Its steps still waiting for a turn then find it gone."""
        if self.runs is None:
            return False
        runs = self.runs
        async with self.lock:
            closed = await asyncio.to_thread(runs.close, run_id)
        if closed:
            self.turns.forget(run_id)
        return closed

    async def push(self, version: int) -> PushReport:
        """Path 2: stream the weights of `version` into vLLM's workers, then drop vLLM's prefix cache.
        Returns the pusher's report (buckets, tensors, bytes, seconds)."""
        async with self.lock:  # the weights must not change under the broadcast
            state = self.core.push_state(version)
            report = await self.pusher.push(state, version)
            await self.pusher.client.reset_prefix_cache()
            return report

    async def close_pusher(self) -> None:
        if self.pusher is not None:
            async with self.lock:
                await self.pusher.close()

    async def keep_ranks_alive(self, every_s: float) -> None:
        """Multi-rank: an idle collective now and then, so the other ranks' wait never times out."""
        while True:
            await asyncio.sleep(every_s)
            await self._rank_command(self.core.runner.heartbeat)

    async def stop_ranks(self) -> None:
        try:
            await self._rank_command(self.core.runner.stop)
        except Exception as exc:  # a rank already gone: nothing left to stop
            log.warning("could not tell the other ranks to stop: %r", exc)

    async def _rank_command(self, command: Callable[[], None]) -> None:
        """A command to the other ranks (a broadcast, in a thread) under the lock, run to its end even
        when the caller is cancelled: the thread cannot be stopped, and had the lock been let go, the
        next command's broadcast (shutdown's "stop" after the heartbeat task was cancelled) would
        interleave with it on the wire, and the other ranks unpickle garbage."""
        async with self.lock:
            sent = asyncio.ensure_future(asyncio.to_thread(command))
            try:
                await asyncio.shield(sent)
            except asyncio.CancelledError:
                await sent
                raise
