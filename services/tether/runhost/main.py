"""The run host: the registry's runs' services in one process tree, for compose and Kubernetes (what the
launcher does for `tether up --max-runs`; docs/runs.md, "Starting a run's services").

It reads the run registry of the base namespace (TETHER_NAMESPACE) every second and, per run, starts its
scheduler, merger and agent workers as child processes (each given the run's namespace and config,
wired to the deployment's shared trainer, inference and gateway), marks the run `running` once they
serve, drains it when it is stopped (`tether run stop`) and fails it alone when one of its services gives
up: `launcher_runs.RunSupervisor` on a stack of no processes of its own. A run's folder (metrics.jsonl,
config.yaml, step records) and its services' logs are under TETHER_RUNS_DIR.

Serves gRPC health on TETHER_RUNHOST_GRPC_PORT (SERVING while the registry's Redis answers and the
supervisor runs) and on TETHER_METRICS_PORT one /metrics page: its own series and every hosted service's,
labelled `run` and `service` (runhost/series.py). Stopped (SIGTERM), it stops its runs' services (they
finish what they hold) without touching the registry: the next run host resumes each `running` run.

Exactly one run host per registry: two would start every run twice. Run: python -m tether.runhost
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from prometheus_client import Gauge, start_http_server
from pydantic import Field

from tether.common import broker
from tether.common.grpc_server import follow_health, run_until_signal, start_server
from tether.common.logs import setup_logging
from tether.common.settings import RedisSettings, refused_settings_exit
from tether.common.usage import exit_if_help
from tether.runhost.series import HostedSeries, registry_of

if TYPE_CHECKING:
    from tether.launcher import Stack

log = logging.getLogger("tether.runhost")

# The run host's ports in the containers' fixed interface (docker/, helm/).
DEFAULT_GRPC_PORT = 50057

RUNS = Gauge("tether_runhost_runs", "Runs with live services on this run host (draining ones included)")
PROCESSES = Gauge("tether_runhost_processes", "Live processes of the hosted runs' services")


class RunHostSettings(RedisSettings):
    config_section: ClassVar[str | None] = None  # its runs' configs are the registry's, not a file

    trainer_address: str
    inference_address: str
    gateway_url: str
    # What a run's scheduler is given for TETHER_GATEWAY_CONTROL_ADDRESS (required by it; a run's
    # scheduler pauses its run through its namespace's admission key, never through this).
    gateway_control_address: str
    # The base model's folder: the tokenizer the runs' mergers read (as the merger's own TETHER_MODEL_DIR;
    # "": none).
    model_dir: str = ""
    runs_dir: str = "runs"
    runhost_grpc_host: str = "127.0.0.1"
    runhost_grpc_port: int = DEFAULT_GRPC_PORT
    # Agent workers per run whose config names a harness (agent.agent_fn).
    runhost_agent_workers: int = Field(1, ge=1)
    # How long a run's services have to serve before the run is failed.
    runhost_health_timeout_s: float = Field(180.0, gt=0)
    # How long a stopped run's services have to finish before SIGKILL.
    runhost_drain_grace_s: float = Field(30.0, ge=0)


# The runs' services listen on loopback only (the run host checks their health and reads their /metrics
# there), whatever interface the image binds its services on by default (docker/Dockerfile).
CHILD_HOSTS = {
    "TETHER_MERGER_GRPC_HOST": "127.0.0.1",
    "TETHER_SCHEDULER_GRPC_HOST": "127.0.0.1",
    "TETHER_AGENT_GRPC_HOST": "127.0.0.1",
}


def host_stack(s: RunHostSettings) -> Stack:
    """A stack of no processes of its own: the deployment's shared services' addresses, for its runs
    (whose processes take the run host's environment, their listening hosts set to loopback)."""
    from tether.launcher import Stack

    os.environ.update(CHILD_HOSTS)
    return Stack(
        run_dir=Path(s.runs_dir),
        namespace=s.namespace,
        redis_url=s.redis_url,
        model_dir=s.model_dir,
        addresses={
            "trainer": s.trainer_address,
            "inference": s.inference_address,
            "gateway_url": s.gateway_url.rstrip("/"),
            "gateway_grpc": s.gateway_control_address,
        },
        state_file=None,
        own_token=False,
    )


def live_targets(stack: Stack) -> list[tuple[str, str, str]]:
    """(run id, service, /metrics URL) of every live process of a hosted run."""
    out = []
    for p in list(stack.procs):
        url = stack.metrics.get(p.name)
        if p.run and url and p.popen.poll() is None:
            out.append((p.run, p.name.split("/", 1)[1], url))
    return out


# A run host's lease lasts LEASE_S unrenewed and is renewed every LEASE_RENEW_S by a thread of its own
# (a supervisor's tick may wait minutes for starting runs' services): a killed run host's successor
# waits at most LEASE_S.
LEASE_S = 15.0
LEASE_RENEW_S = 3.0


class Lease:
    """Exactly one run host per registry: a Redis key (`Keys.runhost_lease`) naming its holder, taken
    with SET NX and renewed by its holder; a second run host waits (NOT_SERVING, starting nothing) until
    the first one's lease ends (stopped: it gives it back; killed: it expires)."""

    def __init__(
        self, redis_url: str, namespace: str, ttl_s: float = LEASE_S, renew_s: float = LEASE_RENEW_S
    ) -> None:
        self._r = broker.connect_sync(redis_url, timeout_s=10.0)
        self.key = broker.Keys(namespace).runhost_lease
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.ttl_ms = int(ttl_s * 1000)
        self.renew_s = renew_s
        self.held = False  # as the renewing thread last found it (`keep`)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def hold(self) -> bool:
        """Take or renew the lease; whether this run host holds it now."""
        if self._r.set(self.key, self.owner, nx=True, px=self.ttl_ms):
            return True
        # Renew only our own: compare and extend in one step.
        return bool(self._r.eval(_RENEW, 1, self.key, self.owner, self.ttl_ms))

    def keep(self) -> None:
        """Take or renew the lease every `renew_s` from a thread of its own, `held` saying the outcome;
        while Redis does not answer, `held` stays as it was (nobody can take the lease meanwhile)."""
        import redis

        def renew() -> None:
            while not self._stop.is_set():
                try:
                    self.held = self.hold()
                except redis.RedisError:
                    pass
                self._stop.wait(self.renew_s)

        try:  # the first answer before anyone reads `held`
            self.held = self.hold()
        except redis.RedisError:
            pass
        self._thread = threading.Thread(target=renew, name="lease", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Stop renewing and give the lease back (if still ours), so the next holder need not wait for
        it to expire; with Redis away it expires by itself."""
        import redis

        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.renew_s)
        self.held = False
        try:
            self._r.eval(_RELEASE, 1, self.key, self.owner)
        except redis.RedisError as exc:
            log.warning("the run registry's lease was not given back (%r): it expires by itself", exc)
        finally:
            self._r.close()


_RENEW = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0"
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"


class Supervising:
    """The supervisor's loop in a thread of its own (it waits and sleeps synchronously): a look at the
    registry every `interval_s`, until `stop()`; `alive` says whether it still runs."""

    def __init__(self, s: RunHostSettings, interval_s: float = 1.0) -> None:
        from tether.launcher_runs import Registry, RunSupervisor

        self.stack = host_stack(s)
        self.registry = Registry(s.redis_url, s.namespace)
        self.supervisor = RunSupervisor(
            self.stack,
            self.registry,
            health_timeout_s=s.runhost_health_timeout_s,
            drain_grace_s=s.runhost_drain_grace_s,
            agent_workers=s.runhost_agent_workers,
            end_finished=True,
        )
        self.interval_s = interval_s
        self.lease = Lease(s.redis_url, s.namespace)
        self.holding = False  # whether this run host holds the registry's lease (else it waits)
        self.failure: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="runs", daemon=True)

    def start(self) -> None:
        self.lease.keep()
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                held = self.lease.held
                if held != self.holding:
                    log.warning(
                        "%s",
                        "holding the run registry's lease: hosting its runs"
                        if held
                        else f"another run host holds {self.lease.key}: waiting, hosting nothing",
                    )
                    self.holding = held
                if not held:
                    if self.stack.runs:  # lost it (Redis lost the key): never run a run twice
                        self.stack.stop(self.supervisor.drain_grace_s)
                        self.stack.procs, self.stack.runs, self.stack.stopped = [], {}, False
                    self._stop.wait(self.interval_s)
                    continue
                self.stack.check_alive()
                self.supervisor.tick()
                alive = [len(r.alive()) for r in self.stack.runs.values()]
                RUNS.set(sum(1 for n in alive if n))
                PROCESSES.set(sum(alive))
                self._stop.wait(self.interval_s)
        except BaseException as exc:  # noqa: BLE001 -- ends the process (health NOT_SERVING, exit 1)
            self.failure = exc
            log.exception("the runs' supervisor failed")

    def stop(self, grace_s: float) -> None:
        """The loop ends, then every hosted process gets SIGTERM (SIGKILL after `grace_s`); the registry
        is left as it is, so the next run host resumes the runs."""
        self._stop.set()
        self._thread.join(timeout=grace_s)
        self.stack.stop(grace_s)
        if not self._thread.is_alive():  # else it may still be using the registry's loop
            self.registry.close()
        self.lease.release()  # the next run host need not wait for it to expire


async def watch(sup: Supervising) -> None:
    """Ends (failing the process) when the supervisor's thread does."""
    while sup.alive:
        await asyncio.sleep(1.0)
    raise RuntimeError(f"the runs' supervisor stopped: {sup.failure!r}")


async def amain(s: RunHostSettings) -> None:
    r = broker.connect(s.redis_url)
    sup = Supervising(s)
    server, health, port = await start_server(s.runhost_grpc_port, lambda _server: [], s.runhost_grpc_host)
    if s.metrics_port:
        series = HostedSeries(lambda: live_targets(sup.stack))
        start_http_server(s.metrics_port, addr=s.runhost_grpc_host, registry=registry_of(series))
    log.info(
        "run host on %s:%d: runs of %s, their folders in %s",
        s.runhost_grpc_host,
        port,
        s.namespace,
        s.runs_dir,
    )
    sup.start()

    async def answers() -> bool:
        return sup.alive and sup.holding and bool(await asyncio.wait_for(r.ping(), 2.0))

    async def stop_runs() -> None:
        start = time.monotonic()
        await asyncio.to_thread(sup.stop, s.runhost_drain_grace_s)
        log.info("the runs' services stopped in %.1f s", time.monotonic() - start)

    try:
        await run_until_signal(
            server, health, [watch(sup), follow_health(health, answers, what="run host")], on_stop=stop_runs
        )
    finally:
        await r.aclose()


def main() -> None:
    exit_if_help(RunHostSettings, __doc__)
    with refused_settings_exit("runhost"):
        s = RunHostSettings()
    setup_logging("runhost", s.log_level)
    asyncio.run(amain(s))


if __name__ == "__main__":
    main()
