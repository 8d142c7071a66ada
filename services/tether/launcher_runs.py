"""The launcher's runs (docs/runs.md, "Starting a run's services"): for every run of the stack's registry,
its own scheduler, merger and agent workers, started as processes of the stack, each given the run's
namespace (TETHER_NAMESPACE: all a run's service needs to find its run) and the run's config
(TETHER_CONFIG: a file in the run's folder); the run marked `running` once they serve, drained when it
is `stopping` (`tether run stop`; then `stopped`), and failed alone when one of them gives up (its
restarts spent, or settings refused): its processes stop, it is marked `failed`, and the stack and the
other runs go on.

A run's agent workers create their rollouts with a key of the run (TETHER_RUN_KEY; the gateway then
makes each rollout the run's, served by its adapter): the key `create` answered when the launcher made
the run itself (`tether demo --runs`), else one the registry issues for them. Keys are never logged
nor written to disk (the environment of the workers only).

What to do with a run is decided by `run_action`, pure, from the registry's status and what runs of it
here; `RunSupervisor.tick` reads, asks and acts. The cli uses it, and the run host (tether.runhost: the
same supervisor in a container of its own, for compose and the chart); no other service imports it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tether.common import runs as rules
from tether.common.grpc_server import service_token
from tether.common.net import free_port
from tether.common.settings import CONFIG_ENV
from tether.common.tls import sync_channel, tls_from_env
from tether.launcher import RunProcs, Stack, _signal_group, metrics_port

if TYPE_CHECKING:
    from tether.common.records import RunRecord, RunState
    from tether.gateway.runs import Runs

# What the supervisor does with a run, each tick.
START = "start"  # start its services (a created run; a running one a launcher before this one served)
MARK_RUNNING = "mark_running"  # its services serve: created -> running
DRAIN = "drain"  # SIGTERM its services (it is stopping, final or gone; or one of them gave up)
MARK_STOPPED = "mark_stopped"  # drained (or nothing of it ran here): stopping -> stopped
MARK_FAILED = "mark_failed"  # drained after one of its services gave up: -> failed
FORGET = "forget"  # drained and final: nothing left of it here
WAIT = "wait"  # nothing to do now

# Where a run's services are here: None (nothing of it runs here), "up", "draining", "drained".
UP, DRAINING, DRAINED = "up", "draining", "drained"
LIVE = (rules.CREATED, rules.RUNNING)


def phase_of(procs: RunProcs | None) -> str | None:
    if procs is None:
        return None
    if procs.drained:
        return DRAINED
    return DRAINING if procs.drain_deadline is not None else UP


def run_action(status: str | None, phase: str | None, gave_up: bool) -> str:
    """What to do with a run whose registry status is `status` (None: the registry has no such run)
    and whose services here are in `phase` (None: none here); `gave_up`: one of them gave up.

    A live run without services here gets them (a `running` one too: a launcher started again resumes
    it from Redis); services whose run is no longer live (or that gave up) drain; a drained run is
    marked `failed` when a service gave up and it was still live, else `stopped` once it was asked to
    stop; a `stopping` run with nothing here has nothing to drain."""
    if phase is None:
        if status in LIVE:
            return START
        return MARK_STOPPED if status == rules.STOPPING else WAIT
    if phase == DRAINING:
        return WAIT
    if phase == DRAINED:
        if status in LIVE or (status == rules.STOPPING and gave_up):
            return MARK_FAILED if gave_up else WAIT
        return MARK_STOPPED if status == rules.STOPPING else FORGET
    if gave_up or status not in LIVE:
        return DRAIN
    return MARK_RUNNING if status == rules.CREATED else WAIT


def on_scheduler_end(scheduler_status: str | None) -> str | None:
    """What a running run's scheduler status (its RunState's) asks of the registry once the run's steps
    are over: `done` (its steps and evaluation) or `stopped` -> stop the run (its services drain, then
    `stopped`); `error` (the scheduler gave up on the run: RunState.error says why) -> fail it; anything
    else (still working, serving, or no state yet) -> nothing."""
    if scheduler_status in ("done", "stopped"):
        return rules.STOPPING
    if scheduler_status == "error":
        return rules.FAILED
    return None


def drain_done(alive: int, now: float, deadline: float) -> bool | None:
    """Whether a drain is over: True when no process is left, False past the deadline (kill what is
    left), None while they still have time."""
    if alive == 0:
        return True
    return False if now >= deadline else None


class Registry:
    """The stack's run registry (gateway.runs.Runs, the base namespace's) for the launcher's synchronous
    loop: one event loop and one Redis client of its own, for as long as it is open."""

    def __init__(self, redis_url: str, namespace: str) -> None:
        from tether.common import broker
        from tether.gateway.runs import Runs

        self._loop = asyncio.Runner()
        self._r = broker.connect(redis_url)
        self.runs: Runs = Runs(self._r, broker.Keys(namespace))

    def call(self, coro: Any) -> Any:
        return self._loop.run(coro)

    def list(self) -> list[RunRecord]:
        return self.call(self.runs.list())

    def create(self, run_id: str, config: dict, adapter: str | None = None) -> tuple[RunRecord, str]:
        return self.call(self.runs.create(run_id, config, adapter))

    def get(self, run_id: str) -> RunRecord:
        return self.call(self.runs.get(run_id))

    def set_status(self, run_id: str, status: str) -> RunRecord:
        return self.call(self.runs.set_status(run_id, status))

    def stop(self, run_id: str) -> RunRecord:
        return self.call(self.runs.stop(run_id))

    def issue_key(self, run_id: str) -> str:
        return self.call(self.runs.issue_key(run_id))

    def scheduler_state(self, namespace: str) -> RunState | None:
        """The run's scheduler state (`RunState` in the run's namespace), None until it wrote one."""
        from tether.common.keys import Keys
        from tether.common.records import RunState

        raw = self.call(self._r.hgetall(Keys(namespace).run))
        return RunState.from_redis(raw) if raw else None

    def close(self) -> None:
        try:
            self._loop.run(self._r.aclose())
        finally:
            self._loop.close()


def run_dir_of(stack: Stack, run_id: str) -> Path:
    """A run's folder: its config, metrics.jsonl, step records (the scheduler's TETHER_RUN_DIR)."""
    return stack.run_dir / run_id


def write_run_config(folder: Path, config: dict) -> Path:
    """The run's config as a file its services read (TETHER_CONFIG; JSON is YAML)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.yaml"
    path.write_text(json.dumps(config, indent=2, default=str) + "\n")
    return path


def agent_fn(config: dict) -> str:
    """The harness a run's config names for its agent workers (`agent.agent_fn`), "" for none: the
    run's agents are then the user's own, made with the run's key."""
    return str((config.get("agent") or {}).get("agent_fn") or "")


def serving(address: str) -> bool:
    """One gRPC health check of `address`: SERVING or not (not answering is not)."""
    try:
        with sync_channel(address, tls_from_env()) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=1.0
            )
        return resp.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def close_on_trainer(address: str, run_id: str, token: str = "", timeout_s: float = 10.0) -> str:
    """Ask the trainer at `address` to free a finished run's adapter and optimizer (`CloseRun`; its
    checkpoints stay). What happened, in words: the launcher logs it and goes on whatever the answer
    (a trainer that is down or restarting frees nothing of the run: a new trainer reopens only the runs
    its checkpoints name as open, and this one will be closed by the next launcher's close)."""
    from tether.v1 import trainer_pb2, trainer_pb2_grpc

    try:
        with sync_channel(address, tls_from_env()) as ch:
            resp = trainer_pb2_grpc.TrainerStub(ch).CloseRun(
                trainer_pb2.CloseRunRequest(run_id=run_id),
                timeout=timeout_s,
                metadata=[("authorization", f"Bearer {token}")] if token else None,
            )
    except grpc.RpcError as exc:
        return f"not closed on the trainer ({exc.code().name}: {exc.details()})"
    return "closed on the trainer" if resp.closed else "not open on the trainer"


class RunSupervisor:
    """Starts, drains and fails the registry's runs on `stack` (a stack started by start_stack: its
    trainer, inference and gateway addresses), one `tick` at a time from the launcher's loop, after
    `stack.check_alive()` (which records a run's service that gave up instead of failing the stack)."""

    def __init__(
        self,
        stack: Stack,
        registry: Registry,
        *,
        health_timeout_s: float = 180.0,
        drain_grace_s: float = 30.0,
        agent_workers: int = 1,
        end_finished: bool = False,
    ) -> None:
        self.stack = stack
        # A run whose scheduler ended (its steps done, or failed) is stopped (or failed) in the registry,
        # so its services drain and its adapter leaves the trainer (`tether up`, the run host; `tether
        # demo --runs` follows its runs itself).
        self.end_finished = end_finished
        self.registry = registry
        self.health_timeout_s = health_timeout_s
        self.drain_grace_s = drain_grace_s
        self.agent_workers = agent_workers
        self.keys: dict[str, str] = {}  # run id -> a key of the run, for its agent workers
        self.closed: set[str] = set()  # runs closed on the trainer (a run id is never used twice)

    def create(self, run_id: str, config: dict, adapter: str | None = None) -> RunRecord:
        """A new run in the registry, its key kept for its agent workers (next `tick` starts them)."""
        record, key = self.registry.create(run_id, config, adapter)
        self.keys[run_id] = key
        return record

    def tick(self) -> None:
        """One look at the registry and the runs here, and what each run needs done. Nothing while the
        stack's Redis is down (check_alive starts it again; the registry is there)."""
        import redis

        try:
            records = {r.run_id: r for r in self.registry.list()}
        except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
            return
        starting: list[tuple[RunProcs, list[str]]] = []
        for run_id in sorted(set(records) | set(self.stack.runs)):
            record = records.get(run_id)
            here = self.stack.runs.get(run_id)
            if here is not None and here.drain_deadline is not None and not here.drained:
                self.drain_progress(here)
            action = run_action(
                record.status if record else None, phase_of(here), bool(here and here.gave_up)
            )
            if self.end_finished and action == WAIT and record is not None and record.status == rules.RUNNING:
                self.end_if_finished(record)
            started = self.act(action, run_id, record, here)
            if started is not None:
                starting.append(started)
        # Every run this tick started comes up at once: their services start side by side, then the
        # launcher waits for all of them (a merger may take a minute to serve on a busy box).
        self.wait_serving(starting)

    def act(
        self, action: str, run_id: str, record: RunRecord | None, here: RunProcs | None
    ) -> tuple[RunProcs, list[str]] | None:
        """Does what `action` says for the run; a run it started: (its processes, the addresses that
        must serve), for the caller to wait on."""
        from tether.gateway.bodies import ApiError

        try:
            if action == START and record is not None:
                return self.start(record)
            elif action == DRAIN and here is not None:
                if here.gave_up:
                    print(
                        f"run {run_id}: a service gave up; stopping the run\n{here.gave_up}", file=sys.stderr
                    )
                self.drain(here)
            elif action == MARK_RUNNING:
                self.registry.set_status(run_id, rules.RUNNING)
            elif action == MARK_STOPPED:
                self.registry.set_status(run_id, rules.STOPPED)
                print(f"run {run_id}: stopped; {self.close(run_id, record)}", flush=True)
            elif action == MARK_FAILED:
                self.registry.set_status(run_id, rules.FAILED)
                print(f"run {run_id}: failed; {self.close(run_id, record)}", file=sys.stderr, flush=True)
            elif action == FORGET:
                # Final without passing through MARK_*: e.g. stopped while still `created` (a run whose
                # services took long to serve), or failed by another writer.
                if run_id not in self.closed:
                    print(
                        f"run {run_id}: {record.status if record else 'gone'}; {self.close(run_id, record)}"
                    )
                self.stack.runs.pop(run_id, None)
                self.keys.pop(run_id, None)
        except ApiError as exc:  # another writer moved the run in between: the next tick sees it
            print(f"run {run_id}: {action}: {exc.message}", file=sys.stderr, flush=True)
        return None

    def end_if_finished(self, record: RunRecord) -> None:
        """Stops (or fails) a running run in the registry once its scheduler says it ended
        (`on_scheduler_end`); the next tick drains it."""
        import redis

        from tether.gateway.bodies import ApiError

        try:
            state = self.registry.scheduler_state(record.namespace)
        except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
            return
        target = on_scheduler_end(state.status if state else None)
        if target is None or state is None:
            return
        said = f"run {record.run_id}: its scheduler says {state.status}" + (
            f" ({state.error})" if state.error else ""
        )
        try:
            if target == rules.FAILED:
                print(f"{said}; failing the run", file=sys.stderr, flush=True)
                self.registry.set_status(record.run_id, rules.FAILED)
            else:
                print(f"{said}; stopping the run", flush=True)
                self.registry.stop(record.run_id)
        except ApiError as exc:  # another writer moved it in between: the next tick sees it
            print(f"run {record.run_id}: {exc.message}", file=sys.stderr, flush=True)

    def close(self, run_id: str, record: RunRecord | None) -> str:
        """A finished run's adapter and optimizer leave the trainer's memory (close_on_trainer), once."""
        self.closed.add(run_id)
        if record is None:
            return "not in the registry"
        token = service_token({**os.environ, **self.stack.token_env()})  # the stack's, or the user's
        return close_on_trainer(
            self.stack.addresses["trainer"], rules.trainer_run_id(record.namespace), token
        )

    def start(self, record: RunRecord) -> tuple[RunProcs, list[str]]:
        """Starts the run's merger, scheduler and (when its config names a harness) agent workers, on
        the stack's shared trainer, inference and gateway; returns its processes and the merger's and
        scheduler's addresses (`wait_serving` waits for them)."""
        stack, run_id = self.stack, record.run_id
        folder = run_dir_of(stack, run_id)
        config_file = write_run_config(folder, record.config)
        here = stack.runs[run_id] = RunProcs(run_id, record.namespace)
        a = stack.addresses
        common = {"TETHER_NAMESPACE": record.namespace, CONFIG_ENV: str(config_file)}
        ports = {"merger": free_port(), "scheduler": free_port()}
        for service, env in (
            (
                "merger",
                {
                    "TETHER_MERGER_GRPC_PORT": str(ports["merger"]),
                    "TETHER_TRAINER_ADDRESS": a["trainer"],
                    "TETHER_MODEL_DIR": stack.model_dir,
                },
            ),
            (
                "scheduler",
                {
                    "TETHER_SCHEDULER_GRPC_PORT": str(ports["scheduler"]),
                    # Required, unused: a run's scheduler pauses its run through its namespace's key.
                    "TETHER_GATEWAY_CONTROL_ADDRESS": a.get("gateway_controls") or a["gateway_grpc"],
                    "TETHER_INFERENCE_ADDRESS": a["inference"],
                    "TETHER_TRAINER_ADDRESS": a["trainer"],
                    "TETHER_RUN_ID": run_id,
                    "TETHER_RUN_DIR": str(folder),
                },
            ),
        ):
            name = f"{run_id}/{service}"
            stack.start(name, f"tether.{service}", {**common, **env, **metrics_port(stack, name)}, run=run_id)
        fn = agent_fn(record.config)
        if fn:
            key = self.keys.get(run_id) or self.registry.issue_key(run_id)
            self.keys[run_id] = key
            for i in range(self.agent_workers):
                name = f"{run_id}/agent-{i}"
                env = {
                    **common,
                    **metrics_port(stack, name),
                    "TETHER_GATEWAY_URL": a["gateway_url"],
                    "TETHER_AGENT_NAME": f"agent-{i}",
                    "TETHER_AGENT_GRPC_PORT": str(free_port()),
                    "TETHER_RUN_KEY": key,
                }
                stack.start(name, "tether.agents", env, run=run_id)
        stack.write_state()
        return here, [f"127.0.0.1:{ports['merger']}", f"127.0.0.1:{ports['scheduler']}"]

    def wait_serving(self, starting: list[tuple[RunProcs, list[str]]]) -> None:
        """Until every starting run's addresses are SERVING; a run whose service gives up meanwhile, or
        whose wait passes health_timeout_s, fails (only it: the next tick drains it); the others are
        still waited for."""
        deadline = time.monotonic() + self.health_timeout_s
        waiting = {here.run_id: (here, list(addresses)) for here, addresses in starting}
        while waiting:
            self.stack.check_alive()  # the stack's own processes too: their failure is the stack's
            for run_id, (here, addresses) in list(waiting.items()):
                if not here.gave_up and time.monotonic() > deadline:
                    here.gave_up = f"not serving after {self.health_timeout_s:.0f}s: {', '.join(addresses)}"
                if not here.gave_up:
                    addresses[:] = [w for w in addresses if not serving(w)]
                if here.gave_up or not addresses:
                    del waiting[run_id]
            if waiting:
                time.sleep(0.3)

    def drain(self, here: RunProcs) -> None:
        """SIGTERM the run's processes (as Stack.stop does); drain_progress ends it."""
        here.drain_deadline = time.monotonic() + self.drain_grace_s
        for p in here.alive():
            _signal_group(p.popen.pid, signal.SIGTERM)
        self.drain_progress(here)

    def drain_progress(self, here: RunProcs) -> None:
        assert here.drain_deadline is not None
        done = drain_done(len(here.alive()), time.monotonic(), here.drain_deadline)
        if done is None:
            return
        for p in here.procs:  # what is left (past the grace), and what a clean exit left in its group
            _signal_group(p.popen.pid, signal.SIGKILL)
            try:
                p.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self.stack.procs = [p for p in self.stack.procs if p.run != here.run_id]
        here.drained = True
        self.stack.write_state()
