"""Merger service: finished rollouts in, scored training samples out.

Named steps per rollout event: load the rollout's recorded calls, merge them into sequences, park
the result in its group; once every rollout of the group reported, score the group (advantage once
per rollout, broadcast to its tokens), publish the samples and hand them to the trainer over gRPC.
Every step is idempotent, so a crash between steps is repaired by reprocessing the event.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field

import grpc
import torch
from prometheus_client import Counter, Gauge

from tether.algorithms.advantages import group_advantages
from tether.common import broker
from tether.common.records import RolloutEvent, SampleRecord, Trace
from tether.merger.merge import Call, merge_calls

log = logging.getLogger(__name__)

ROLLOUTS = Counter("tether_merger_rollouts_total", "Rollout events processed", ["status"])
GROUPS = Counter("tether_merger_groups_total", "Groups resolved", ["outcome"])
SEQUENCES = Counter("tether_merger_sequences_total", "Training sequences built")
FORKS = Counter("tether_merger_forks_total", "Calls that started a new sequence on a prefix mismatch")
DROPPED = Counter("tether_merger_calls_dropped_total", "Calls not trained on", ["reason"])
PENDING = Gauge("tether_merger_groups_pending", "Groups waiting for more rollouts")


@dataclass(frozen=True)
class MergerConfig:
    mode: str = "merge"
    estimator: str = "grpo"
    filter_zero_variance: bool = True
    max_seq_len: int | None = None


@dataclass
class MergerCounts:
    rollouts_merged: int = 0
    groups_emitted: int = 0
    groups_filtered: int = 0
    sequences: int = 0
    forks: int = 0
    calls_dropped: int = 0
    pending: set[str] = field(default_factory=set)


def trace_to_call(trace: Trace) -> tuple[Call | None, str | None]:
    """A recorded call as merge input, or the reason it cannot be trained on."""
    if trace.status != "ok":
        return None, "error"
    if not trace.prompt_token_ids or not trace.response_token_ids:
        return None, "missing_token_ids"
    if len(trace.response_logprobs) != len(trace.response_token_ids):
        return None, "missing_logprobs"
    return Call(call_id=trace.call_id, prompt_token_ids=list(trace.prompt_token_ids),
                response_token_ids=list(trace.response_token_ids),
                response_logprobs=[float(x) for x in trace.response_logprobs],
                weight_version=int(trace.weight_version), status="ok"), None


def build_samples(rollout: dict, advantage: float) -> list[SampleRecord]:
    """Broadcast the rollout's advantage to every trainable token of every one of its sequences."""
    seqs = rollout["sequences"]
    return [
        SampleRecord(
            rollout_id=rollout["rollout_id"], group_id=rollout["group_id"], task_id=rollout["task_id"],
            sequence_index=i, token_ids=s["token_ids"], loss_mask=s["loss_mask"],
            rollout_logprobs=s["logprobs"], advantages=[advantage if m else 0.0 for m in s["loss_mask"]],
            reward=float(rollout["reward"]), weight_version=int(s["weight_version"]),
            rollout_sequences=len(seqs),
        )
        for i, s in enumerate(seqs)
    ]


class Merger:
    def __init__(self, r, keys: broker.Keys, cfg: MergerConfig, submit) -> None:
        """`submit(group_id, samples, rollouts)` hands a scored group to the trainer (async)."""
        self.r = r
        self.keys = keys
        self.cfg = cfg
        self.submit = submit
        self.counts = MergerCounts()

    async def load_traces(self, rollout_id: str) -> list[Trace]:
        ids = await self.r.lrange(self.keys.rollout_calls(rollout_id), 0, -1)
        pipe = self.r.pipeline(transaction=False)
        for eid in ids:
            pipe.xrange(self.keys.traces, min=eid, max=eid)
        traces = []
        for items in await pipe.execute():
            for _, fields in items:
                traces.append(Trace.from_dict(broker.decode(fields)))
        return traces

    async def merge_rollout(self, event: RolloutEvent, meta: dict) -> dict:
        calls: list[Call] = []
        for trace in await self.load_traces(event.rollout_id):
            call, reason = trace_to_call(trace)
            if call is None:
                DROPPED.labels(reason).inc()
                self.counts.calls_dropped += 1
                if reason != "error":
                    log.warning("rollout %s call %s not trainable: %s", event.rollout_id, trace.call_id, reason)
                continue
            calls.append(call)
        seqs, stats = merge_calls(calls, mode=self.cfg.mode, max_seq_len=self.cfg.max_seq_len)
        FORKS.inc(stats.forks)
        self.counts.forks += stats.forks
        return {
            "rollout_id": event.rollout_id, "group_id": event.group_id, "task_id": event.task_id,
            "status": event.status if seqs or event.status != "completed" else "empty",
            "reward": event.reward, "eval": bool(meta.get("eval")),
            "sequences": [
                {"token_ids": s.token_ids, "loss_mask": s.loss_mask, "logprobs": s.logprobs,
                 "weight_version": s.min_weight_version}
                for s in seqs
            ],
            "forks": stats.forks, "calls": stats.calls_in,
        }

    async def handle_event(self, event: RolloutEvent) -> None:
        raw_meta = await self.r.hget(self.keys.rollout(event.rollout_id), "metadata")
        meta = json.loads(raw_meta) if raw_meta else {}
        if event.status == "completed":
            merged = await self.merge_rollout(event, meta)
        else:
            merged = {"rollout_id": event.rollout_id, "group_id": event.group_id, "task_id": event.task_id,
                      "status": event.status, "reward": None, "eval": bool(meta.get("eval")), "sequences": []}
        ROLLOUTS.labels(merged["status"]).inc()
        self.counts.rollouts_merged += 1
        gkey = self.keys.group(event.group_id)
        await self.r.hset(gkey, event.rollout_id, json.dumps(merged, separators=(",", ":")))
        if await self.r.hlen(gkey) >= event.group_size:
            await self.resolve_group(event.group_id)
            self.counts.pending.discard(event.group_id)
        else:
            self.counts.pending.add(event.group_id)
        PENDING.set(len(self.counts.pending))

    async def resolve_group(self, group_id: str) -> None:
        if await self.r.exists(self.keys.group_done(group_id)):
            return
        rollouts = [json.loads(v) for v in (await self.r.hgetall(self.keys.group(group_id))).values()]
        rollouts.sort(key=lambda x: x["rollout_id"])
        ok = [x for x in rollouts if x["status"] == "completed" and x["reward"] is not None]
        rewards = torch.tensor([float(x["reward"]) for x in ok], dtype=torch.float32)
        result = {"group_id": group_id, "rollouts": len(rollouts), "completed": len(ok),
                  "rewards": rewards.tolist(), "eval": any(x["eval"] for x in rollouts),
                  "sequences": sum(len(x["sequences"]) for x in ok),
                  "forks": sum(x.get("forks", 0) for x in ok), "finished_at": time.time()}
        if result["eval"]:
            outcome = "eval"
        elif len(ok) < 2:
            outcome = "too_few"
        elif self.cfg.filter_zero_variance and float(rewards.max() - rewards.min()) == 0.0:
            outcome = "filtered"
        else:
            outcome = "trained"
        samples: list[SampleRecord] = []
        if outcome == "trained":
            advantages = group_advantages(rewards, self.cfg.estimator)
            for rollout, adv in zip(ok, advantages.tolist(), strict=True):
                samples.extend(build_samples(rollout, float(adv)))
            for i, s in enumerate(samples):
                await broker.publish_once(self.r, self.keys, self.keys.samples, f"sample:{group_id}:{i}",
                                          s.to_dict())
            await self.submit(group_id, samples, len(ok))
            self.counts.groups_emitted += 1
            self.counts.sequences += len(samples)
            SEQUENCES.inc(len(samples))
        elif outcome == "filtered":
            self.counts.groups_filtered += 1
        result.update(outcome=outcome, samples=len(samples),
                      tokens=sum(len(s.token_ids) for s in samples),
                      min_weight_version=min((s.weight_version for s in samples), default=-1))
        await broker.publish_once(self.r, self.keys, self.keys.group_results, f"group:{group_id}", result)
        await self.r.set(self.keys.group_done(group_id), outcome)
        GROUPS.labels(outcome).inc()
        log.info("group %s: %s (%d rollouts, rewards %s, %d samples)", group_id, outcome, len(rollouts),
                 [round(x, 3) for x in result["rewards"]], len(samples))

    async def run(self, consumer: str = "merger-0") -> None:
        stream = self.keys.rollout_events
        await broker.ensure_group(self.r, stream, "merger")
        while True:
            for entry_id, record in await broker.read_group(self.r, stream, "merger", consumer):
                try:
                    event = RolloutEvent.from_dict(record)
                    if event.status not in ("completed", "failed") or event.group_size < 1:
                        raise ValueError(f"unexpected rollout event {record}")
                except (ValueError, KeyError, TypeError) as exc:
                    await broker.dead_letter(self.r, self.keys, stream, entry_id, repr(exc), record)
                    await self.r.xack(stream, "merger", entry_id)
                    continue
                await self.handle_with_retry(event)
                await self.r.xack(stream, "merger", entry_id)

    async def handle_with_retry(self, event: RolloutEvent) -> None:
        # The trainer may be restarting: keep the event unacknowledged and retry; every step of
        # handle_event is idempotent.
        delay = 0.5
        while True:
            try:
                await self.handle_event(event)
                return
            except grpc.aio.AioRpcError as exc:
                log.warning("trainer unavailable (%s); retrying rollout %s in %.1fs", exc.code(),
                            event.rollout_id, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)
