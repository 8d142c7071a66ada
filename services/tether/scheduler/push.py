"""A step's training and weight push, under the mode's rules (tether.scheduler.plan.push_plan):
colocated modes drain gateway admission (and put vLLM to sleep) around the update; disaggregated-async
lets rollouts run on while the trainer trains, and vLLM holds requests in flight only while it loads.
The weights reach inference through tether.scheduler.publish (path 1, path 2, fallback). Also the
reconciliation at start: a push cut short can leave vLLM asleep, paused or on older weights.
Caller: tether.scheduler.steps and serve, and the run's start.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import Gauge, Histogram

from tether.scheduler.plan import push_plan
from tether.scheduler.publish import AdapterPublisher, WeightPublisher
from tether.scheduler.store import RunStore
from tether.v1 import gateway_pb2, inference_pb2, trainer_pb2, types_pb2

VERSION = Gauge(
    "tether_scheduler_weight_version", "Weight version inference serves, as the scheduler knows it"
)
PUSH_SECONDS = Histogram(
    "tether_scheduler_weight_push_seconds",
    "Time to make inference serve a step's weights",
    ["path"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300),
)


class StepPush:
    """Trains a step and makes inference serve its weights. `publisher.path` says how the last step's
    weights got there."""

    def __init__(
        self,
        gateway: Any,
        inference: Any,
        trainer: Any,
        store: RunStore,
        publisher: WeightPublisher | AdapterPublisher,
        drain_timeout_s: float,
        sleep_level: int,
        run_id: str = "",
        intended_groups: int = 0,
    ) -> None:
        self.gateway = gateway
        self.inference = inference
        self.trainer = trainer
        self.store = store
        self.publisher = publisher
        self.drain_timeout_s = drain_timeout_s
        self.sleep_level = sleep_level
        self.run_id = run_id  # the trainer's run this scheduler trains ("": its single policy)
        # What a step is meant to train (tasks_per_step), told to the trainer with each step: its
        # loss_denominator = intended weighs a step of fewer groups that much less. 0: not said.
        self.intended_groups = intended_groups

    async def push(
        self,
        step: int,
        group_ids: list[str],
        drop_ids: list[str] | None = None,
        colocated: bool = True,
        full_step: bool = True,
    ) -> tuple[dict[str, float], float, float]:
        """Train on `group_ids` and push the new weights. Returns (train metrics, push seconds, paused
        seconds: the whole update when colocated, the load alone when disaggregated). `full_step`: the
        step was meant to train `intended_groups` (not the serve mode's, which trains what arrived)."""
        plan = push_plan(colocated, self.sleep_level, run=bool(self.run_id))
        t0 = time.perf_counter()
        slept = False
        if plan.drain:
            await self.gateway.PauseAdmission(
                gateway_pb2.PauseAdmissionRequest(drain_timeout_s=self.drain_timeout_s)
            )
        try:
            if plan.sleep_level:
                await self.store.save(slept=True)  # a restarted scheduler wakes vLLM up
                await self.inference.Sleep(inference_pb2.SleepRequest(level=plan.sleep_level))
                slept = True
            await self.store.save(status="training")
            resp = await self.trainer.TrainStep(
                trainer_pb2.TrainStepRequest(
                    step=step,
                    min_groups=len(group_ids),
                    max_groups=len(group_ids),
                    group_ids=group_ids,
                    drop_group_ids=drop_ids or [],
                    run_id=self.run_id,
                    intended_groups=self.intended_groups if full_step else 0,
                )
            )
            if slept:
                await self.inference.WakeUp(types_pb2.Empty())
                slept = False
                await self.store.save(slept=False)
            push_s = await self.publish(resp, pause=plan.gate_load)
        finally:
            if slept:
                await self.inference.WakeUp(types_pb2.Empty())
                await self.store.save(slept=False)
            # Colocated: admit again; disaggregated: tell the gateway which version now serves.
            await self.gateway.ResumeAdmission(
                gateway_pb2.ResumeAdmissionRequest(weight_version=self.store.state.weight_version)
            )
        paused_s = time.perf_counter() - t0 if plan.drain else push_s
        return dict(resp.metrics), push_s, paused_s

    async def publish(self, resp: Any, pause: bool = False) -> float:
        """Make inference serve the step's weights (`resp`: the TrainStep answer) and save the version it
        serves; returns the seconds it took. `pause`: admission paused first (the caller resumes it)."""
        await self.store.save(status="pushing")
        t1 = time.perf_counter()
        if pause:
            await self.gateway.PauseAdmission(gateway_pb2.PauseAdmissionRequest(drain_timeout_s=0))
        version = await self.load_weights(resp)
        push_s = time.perf_counter() - t1
        PUSH_SECONDS.labels(self.publisher.path).observe(push_s)
        VERSION.set(version)
        await self.store.save(weight_version=version, checkpoint_dir=resp.checkpoint_dir)
        return push_s

    async def load_weights(self, resp: Any) -> int:
        """Make inference serve a trained step's weights (WeightPublisher.publish); returns the version
        it serves."""
        return await self.publisher.publish(resp)

    async def reconcile(self) -> int:
        """Wake vLLM if a colocated step had put it to sleep (a sleep cut short leaves it asleep), then
        bring inference to the trainer's newest version and resume generation
        (WeightPublisher.reconcile). Returns the served version."""
        if self.store.state.slept:
            await self.inference.WakeUp(types_pb2.Empty())
            await self.store.save(slept=False)
        return await self.publisher.reconcile()
