"""Scheduler service process. Run: python -m tether.scheduler

Started again with the same TETHER_RUN_ID (and Redis), it picks the run up where the previous process
left it, however that one ended (see tether.scheduler.run); the local launcher restarts it when it dies.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Literal

from tether.common import broker
from tether.common.grpc_server import channel, run_until_signal, start_server
from tether.common.logs import setup_logging
from tether.common.settings import CommonSettings
from tether.common.usage import exit_if_help
from tether.scheduler.run import Run, RunConfig, Stubs, load_tasks
from tether.scheduler.servicer import SchedulerServicer
from tether.v1 import (
    gateway_pb2_grpc,
    inference_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    trainer_pb2_grpc,
)

log = logging.getLogger("tether.scheduler")


class SchedulerSettings(CommonSettings):
    scheduler_grpc_host: str = "127.0.0.1"
    scheduler_grpc_port: int
    gateway_control_address: str
    inference_address: str
    trainer_address: str
    run_id: str
    run_dir: str
    tasks_file: str = ""  # empty: serve-only (`tether up`): groups train as users complete them
    steps: int = 60
    tasks_per_step: int = 8
    group_size: int = 8
    eval_repeats: int = 4
    seed: int = 0
    rollout_timeout_s: float = 300.0
    groups_per_step: int = 1  # serve-only mode: train once this many groups are scored
    mode: str = "colocated-sync"  # colocated-sync | colocated-async | disaggregated-async
    max_staleness: int = 1
    max_inflight_groups: int = 0
    sleep_level: int = 0
    max_attempts: int = 3
    # "checkpoint": inference reloads each step's checkpoint (path 1). "nccl": the trainer streams the
    # weights into vLLM (path 2; the trainer needs TETHER_WEIGHT_PUSH=nccl too), path 1 on failure.
    weight_push: Literal["checkpoint", "nccl"] = "checkpoint"


async def amain(s: SchedulerSettings) -> None:
    r = broker.connect(s.redis_url)
    stubs = Stubs(
        gateway=gateway_pb2_grpc.GatewayControlStub(channel(s.gateway_control_address)),
        inference=inference_pb2_grpc.InferenceStub(channel(s.inference_address)),
        trainer=trainer_pb2_grpc.TrainerStub(channel(s.trainer_address)),
    )
    cfg = RunConfig(
        run_id=s.run_id,
        steps=s.steps,
        tasks_per_step=s.tasks_per_step,
        group_size=s.group_size,
        seed=s.seed,
        run_dir=Path(s.run_dir),
        eval_repeats=s.eval_repeats,
        rollout_timeout_s=s.rollout_timeout_s,
        mode=s.mode,
        max_staleness=s.max_staleness,
        max_inflight_groups=s.max_inflight_groups,
        sleep_level=s.sleep_level,
        max_attempts=s.max_attempts,
        weight_push=s.weight_push,
    )
    tasks = load_tasks(Path(s.tasks_file)) if s.tasks_file else []
    run = Run(r, broker.Keys(s.namespace), cfg, stubs, tasks)

    def register(server):
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(SchedulerServicer(run), server)
        return [scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name]

    server, health, port = await start_server(
        s.scheduler_grpc_port, register, s.scheduler_grpc_host, s.metrics_port
    )
    await health.set(True)
    log.info("scheduler on %s:%d", s.scheduler_grpc_host, port)

    async def work() -> None:
        try:
            await (run.run() if tasks else run.serve(s.groups_per_step))
        except Exception:
            log.exception("run failed")
        await asyncio.Event().wait()  # keep answering GetRun until stopped

    try:
        await run_until_signal(server, health, [work()])
    finally:
        await r.aclose()


def main() -> None:
    exit_if_help(SchedulerSettings, __doc__)
    s = SchedulerSettings()
    setup_logging("scheduler", s.log_level)
    asyncio.run(amain(s))


if __name__ == "__main__":
    main()
