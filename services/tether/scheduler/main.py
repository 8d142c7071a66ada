"""Scheduler service process. Run: python -m tether.scheduler

Started again with the same TETHER_RUN_ID (and Redis), it picks the run up where the previous process
left it, however that one ended (see tether.scheduler.run). A fatal error (a gRPC code that is not
retryable, or one that outlasted its retries; Redis failing) ends the process with status 1,
so its supervisor -- the local launcher, Compose, Kubernetes -- starts it again and it resumes. Settings
it refuses (an unknown mode) end it with status 2 before it serves anything.

With TETHER_NAMESPACE a run's (`<base>.run.<id>`) it is that run's scheduler (docs/runs.md, "A run's
services"): it trains the trainer's run `<id>`, loads each version of the run's adapter into vLLM, and
pauses only the run's own admission.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from pathlib import Path
from typing import Any, ClassVar

import grpc
from grpc_health.v1 import health_pb2_grpc
from pydantic import Field, field_validator

from tether.common import broker
from tether.common.grpc_server import channel, run_until_signal, start_server
from tether.common.logs import setup_logging
from tether.common.records import RunRecord
from tether.common.retry import Retrying
from tether.common.runs import run_of_namespace
from tether.common.settings import (
    CONFIG_ENV,
    SETTINGS_REFUSED,
    RedisSettings,
    WeightPush,
    read_run_config,
    refused_settings_exit,
)
from tether.common.usage import exit_if_help
from tether.scheduler import kube
from tether.scheduler.config import (
    RunConfig,
    SchedulingMode,
    Stubs,
    load_tasks,
    run_problem,
    run_trainer_settings,
)
from tether.scheduler.fleet import InferenceFleet
from tether.scheduler.gateways import ControlChannels, GatewayReplicas, RunGate, check_spec
from tether.scheduler.metrics import follow_broker
from tether.scheduler.run import Run
from tether.scheduler.servicer import SchedulerServicer
from tether.scheduler.trackers import TrackerNames, missing
from tether.v1 import (
    gateway_pb2_grpc,
    inference_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    trainer_pb2_grpc,
)

log = logging.getLogger("tether.scheduler")


class SchedulerSettings(RedisSettings):
    config_section: ClassVar[str | None] = "scheduler"

    scheduler_grpc_host: str = "127.0.0.1"
    scheduler_grpc_port: int
    # host:port of the gateway's GatewayControl; with several gateway replicas, each one's, comma-separated
    # (every replica is paused and resumed: scheduler/gateways.py).
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
    mode: SchedulingMode = "colocated-sync"
    max_staleness: int = 1
    max_inflight_groups: int = 0
    sleep_level: int = Field(0, ge=0, le=2)  # colocated modes: vLLM sleeps (level 1 or 2) while training
    max_attempts: int = 3
    # colocated-sync: keep dispatching groups (at most dynamic_sampling_max_groups a step; 0 = 4 x
    # tasks_per_step) until tasks_per_step of them carry signal (rewards that differ within the group);
    # each step counts the groups dispatched, filtered and trained. The async modes always train
    # tasks_per_step such groups a step.
    dynamic_sampling: bool = False
    dynamic_sampling_max_groups: int = Field(0, ge=0)
    # "checkpoint": inference reloads each step's checkpoint (path 1). "nccl": the trainer streams the
    # weights into vLLM (path 2; the trainer needs TETHER_WEIGHT_PUSH=nccl too), path 1 on failure.
    weight_push: WeightPush = "checkpoint"
    # With a metrics port: how often the tether_broker_* gauges (stream lengths, consumer-group lag and
    # pending entries) are read from Redis.
    broker_metrics_interval_s: float = Field(5.0, gt=0)
    # Experiment trackers that get every step record (docs/trackers.md): wandb, mlflow, tensorboard,
    # comma-separated (a list in the run config); each needs its package (the `trackers` extra).
    trackers: TrackerNames = ()
    # A run's scheduler (TETHER_NAMESPACE a run's, `<base>.run.<id>`) pauses its gateways through the
    # run's `admission` key, which they read this often: the gateway's setting of the same name.
    admission_check_s: float = Field(2.0, gt=0)

    @field_validator("gateway_control_address")
    @classmethod
    def _control_addresses(cls, v: str) -> str:
        check_spec(v)
        return v


async def run_adapter(r: Any, namespace: str) -> tuple[str, str, dict[str, str]]:
    """(trainer run id, adapter, the run's own trainer settings) of the run whose namespace this is
    (common.runs.run_of_namespace; its record in the base namespace's registry names the adapter and
    holds its run config); ("", "", {}) for any other namespace: the trainer's single policy, as before
    runs. RuntimeError when the registry has no such run."""
    found = run_of_namespace(namespace)
    if found is None:
        return "", "", {}
    base, run_id = found
    raw = await r.hget(broker.Keys(base).runs, run_id)
    if raw is None:
        raise RuntimeError(f"namespace {namespace} names run {run_id}, which the registry of {base} lacks")
    record = RunRecord.from_json(raw)
    return run_id, record.adapter, run_trainer_settings(record.config)


def gateway_stub(s: SchedulerSettings, r: Any, run_id: str, channels: ControlChannels) -> Any:
    """A run's admission (RunGate: its namespace's key), or the gateway replicas' GatewayControl."""
    if run_id:
        return RunGate(r, s.keys(), hold_s=2 * s.admission_check_s)
    return GatewayReplicas(
        s.gateway_control_address,
        lambda address, name: Retrying(gateway_pb2_grpc.GatewayControlStub(channels.open(address, name))),
        close=channels.close,
        r=r,
        keys=s.keys(),
    )


async def amain(s: SchedulerSettings, k: kube.KubeSettings | None = None) -> None:
    r = broker.connect(s.redis_url)
    await broker.agree_trace_partitions(r, s.keys())
    trainer_run, adapter, trainer_settings = await run_adapter(r, s.namespace)
    if trainer_run:
        log.info("namespace %s: run %s, served as adapter %s", s.namespace, trainer_run, adapter)
    # Calls retry the retryable codes with backoff, a few times; then, or on any other code, the run
    # fails and the process exits (see main). Not retried: a weight load or a path-2 push, whose
    # failures the run handles itself (fallback to path 1; reconcile after a restart).
    trainer = Retrying(trainer_pb2_grpc.TrainerStub(channel(s.trainer_address)), exempt={"PushWeights"})
    inference = channel(s.inference_address)
    gateway_channels = ControlChannels()
    # The one adapter at inference_address, until Kubernetes discovery hands the fleet the replicas
    # (fleet.update); from then on every replica's adapter (tether.scheduler.fleet).
    fleet = InferenceFleet(
        Retrying(inference_pb2_grpc.InferenceStub(inference), exempt={"LoadWeights"}),
        r,
        s.keys(),
        trainer=trainer,
    )
    stubs = Stubs(
        gateway=gateway_stub(s, r, trainer_run, gateway_channels),
        inference=fleet,
        trainer=trainer,
        inference_health=health_pb2_grpc.HealthStub(inference),
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
        dynamic_sampling=s.dynamic_sampling,
        dynamic_sampling_max_groups=s.dynamic_sampling_max_groups,
        trackers=s.trackers,
        config_file=read_run_config(os.environ[CONFIG_ENV]) if os.environ.get(CONFIG_ENV) else {},
        trainer_run_id=trainer_run,
        adapter=adapter,
        trainer_settings=trainer_settings,
    )
    tasks = load_tasks(Path(s.tasks_file)) if s.tasks_file else []
    keys = s.keys()
    run = Run(r, keys, cfg, stubs, tasks)

    def register(server: grpc.aio.Server) -> list[str]:
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(SchedulerServicer(run), server)
        return [scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name]

    server, health, port = await start_server(
        s.scheduler_grpc_port, register, s.scheduler_grpc_host, s.metrics_port
    )
    await health.set(True)
    log.info("scheduler on %s:%d", s.scheduler_grpc_host, port)

    async def work() -> None:
        # A failure ends the process (run_until_signal raises it again): the supervisor starts the
        # scheduler again and it resumes the run from Redis. A finished run keeps answering GetRun.
        await (run.run() if tasks else run.serve(s.groups_per_step))
        await asyncio.Event().wait()

    # The broker gauges only where someone can scrape them; the task never ends or raises.
    background = [work()]
    if s.metrics_port:
        background.append(follow_broker(r, keys, s.broker_metrics_interval_s))
    # On Kubernetes: replica discovery, agent Jobs, trainer gang restart (each when configured).
    background += kube.start(k or kube.KubeSettings(), r, keys, s.run_id, on_replicas=fleet.update)
    try:
        await run_until_signal(server, health, background)
    finally:
        await fleet.aclose()
        await r.aclose()


def main() -> None:
    exit_if_help(SchedulerSettings, __doc__)
    with refused_settings_exit("scheduler"):
        s = SchedulerSettings()
        k = kube.KubeSettings()
    problem = missing(s.trackers)
    if run_of_namespace(s.namespace):
        problem = problem or run_problem(s.sleep_level, s.weight_push)
    if problem:  # a package the image or venv lacks, a run's bad settings: starting again cannot help
        print(f"tether.scheduler: refusing to start: {problem}", file=sys.stderr)
        sys.exit(SETTINGS_REFUSED)
    setup_logging("scheduler", s.log_level)
    try:
        with refused_settings_exit("scheduler"):
            asyncio.run(amain(s, k))
    except Exception as exc:
        log.critical("fatal: %r; exiting non-zero so that the supervisor starts the scheduler again", exc)
        sys.exit(1)


if __name__ == "__main__":
    main()
