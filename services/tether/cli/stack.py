"""The local stack's commands, `tether up` and `tether down`, and what every command that starts or
finds a stack shares: a stack stopped whatever happens (`on_stack`), the run's state in Redis,
`.tether/stack.json` (written by tether.launcher).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, cast

from tether.cli.args import Subparsers
from tether.cli.config import CONFIG_HELP, config_model, use_run_config
from tether.cli.examples import prepare_calculator_model

if TYPE_CHECKING:  # the launcher (and what it imports) only where a command runs a stack
    from tether.common.records import RunState
    from tether.launcher import Stack


def stop_on_signals(stack: Stack) -> None:
    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def on_stack(stack: Stack, body: Callable[[], int], interrupted: int = 130, say: str | None = None) -> int:
    """`body()`'s exit code, with the stack stopped after it whatever happens: `interrupted` on Ctrl-C
    or SIGTERM (printing `say`), 1 on a StackError (printing why)."""
    from tether.launcher import StackError

    stop_on_signals(stack)
    try:
        return body()
    except KeyboardInterrupt:
        if say:
            print(say, flush=True)
        return interrupted
    except StackError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        stack.stop()


def run_status(redis_url: str, namespace: str) -> RunState | None:
    """The run's state (tether.common.records.RunState), None until the scheduler has written it."""
    from tether.common.broker import Keys, connect_sync
    from tether.common.records import RunState

    r = connect_sync(redis_url)
    try:
        raw = cast("dict[str, str]", r.hgetall(Keys(namespace).run))  # a client that decodes responses
        return RunState.from_redis(raw) if raw else None
    finally:
        r.close()


def redis_down() -> tuple[type[Exception], ...]:
    import redis

    return (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError)


def stack_state() -> dict:
    from tether.launcher import STATE_FILE

    if not STATE_FILE.exists():
        raise SystemExit(
            f"no stack here ({STATE_FILE} not found): run from where `tether up`/`tether demo` ran"
        )
    return json.loads(STATE_FILE.read_text())


def use_stack_token(state: dict) -> None:
    """A process this command runs beside the stack (`tether agent`'s worker) serves gRPC as the
    stack's own processes do: requiring the stack's service token (`.tether/service-token`, which
    `state` names), unless the user gave a token of their own."""
    from tether.common.grpc_server import TOKEN_FILE_ENV, token_given

    if state.get("service_token_file") and not token_given():
        os.environ[TOKEN_FILE_ENV] = state["service_token_file"]


def running(pid: int) -> bool:
    """Alive and not a zombie (a launcher whose parent has not reaped it yet has stopped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


# `tether up`'s own choices where neither a flag nor the run config sets them.
UP_DEFAULTS: dict[str, int | float] = {"lr": 5e-4, "seed": 0, "group_size": 4, "groups_per_step": 1}


def prepared_run_dir(args: argparse.Namespace, defaults: dict, prefix: str) -> Path:
    """The command's run directory (--run-dir, else runs/<prefix>-<time>), made; `defaults` set on
    `args` for each flag not given."""
    for k, d in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, d)
    run_dir = Path(args.run_dir or f"runs/{prefix}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def cmd_up(args: argparse.Namespace) -> int:
    from tether.launcher import Stack, start_stack

    try:
        config, explicit = use_run_config(args)
        trackers = tracker_env(args, config)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    run_dir = prepared_run_dir(args, UP_DEFAULTS, "up")
    try:
        model = config_model(config, args.model)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    model_dir = Path(model).resolve() if model else prepare_calculator_model(args.seed)
    stack = Stack(run_dir=run_dir, namespace=f"tether-{run_dir.name}", config=config, explicit=explicit)

    def run() -> int:
        from tether.launcher import lora_serving
        from tether.launcher_runs import Registry, RunSupervisor
        from tether.runhost.main import Lease

        serving, trainer = serving_env(args), {}
        if args.max_runs:  # runs side by side: LoRA on in vLLM and the trainer (docs/runs.md)
            lora = lora_serving(args.max_runs)
            serving, trainer = {**serving, **lora["inference"]}, lora["trainer"]
        start_stack(
            stack,
            model_dir,
            lr=args.lr,
            seed=args.seed,
            group_size=args.group_size,
            scheduler_env={
                "TETHER_RUN_ID": run_dir.name,
                "TETHER_GROUPS_PER_STEP": str(args.groups_per_step),
                **trackers,
            },
            serving_env=serving,
            trainer_env=trainer,
            gateway_replicas=args.gateway_replicas,
        )
        print(f"gateway: {stack.addresses['gateway_url']}/v1", flush=True)
        print(
            f"create rollouts with POST {stack.addresses['gateway_url']}/v1/rollouts; stop with `tether down` "
            "or Ctrl-C",
            flush=True,
        )
        # The registry's runs (`tether run create`): their services started, drained and failed here.
        registry = Registry(stack.redis_url, stack.namespace)
        # The registry's runs are hosted once: a run host (tether.runhost) on this Redis holds the same
        # lease, and while it does this launcher starts no run.
        lease = Lease(stack.redis_url, stack.namespace)
        lease.keep()
        try:
            supervisor = RunSupervisor(stack, registry, end_finished=True)
            holding = None
            while True:
                stack.check_alive()
                held = lease.held
                if held != holding and not held:
                    print(f"another run host holds {lease.key}: this stack starts no run", file=sys.stderr)
                holding = held
                if held:
                    supervisor.tick()
                time.sleep(1.0)
        finally:
            registry.close()
            lease.release()

    return on_stack(stack, run, interrupted=0, say="stopping the stack")


def serving_env(args: argparse.Namespace) -> dict[str, str]:
    """The inference service's settings for the serving flags given (InferenceSettings); a flag not
    given leaves the setting to the environment (a user's TETHER_MAX_MODEL_LEN) or its default."""
    env = {}
    for flag, name in (
        ("max_model_len", "TETHER_MAX_MODEL_LEN"),
        ("dtype", "TETHER_DTYPE"),
        ("tensor_parallel_size", "TETHER_TENSOR_PARALLEL_SIZE"),
        ("gpu_memory_utilization", "TETHER_GPU_MEMORY_UTILIZATION"),
    ):
        value = getattr(args, flag)
        if value is not None:
            env[name] = str(value)
    if args.vllm_arg:
        # Each value is split as a shell would; the words travel as one quoted string.
        env["TETHER_VLLM_EXTRA_ARGS"] = shlex.join(word for arg in args.vllm_arg for word in shlex.split(arg))
    return env


def shell_words(value: str) -> str:
    try:
        shlex.split(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{value!r}: {exc}") from None
    return value


def cmd_down(args: argparse.Namespace) -> int:
    state = stack_state()
    pid = state.get("launcher_pid")
    if state.get("stopped") or not pid:
        print("stack already stopped")
        return 0
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        print("launcher not running")
        return 0
    for _ in range(600):
        if not running(pid):
            print("stack stopped")
            return 0
        time.sleep(0.1)
    print("stack did not stop within 60 s", file=sys.stderr)
    return 1


def replicas_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--gateway-replicas",
        type=int,
        default=1,
        metavar="N",
        help="gateway processes sharing the gateway port (SO_REUSEPORT; each supervised, with its own "
        "control and metrics port)",
    )


def tracker_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tracker",
        action="append",
        metavar="NAME",
        help="log every step record to an experiment tracker: wandb, mlflow or tensorboard (repeat the "
        "flag or comma-separate; written under the run directory by default: docs/trackers.md); "
        "default: the run config's scheduler.trackers",
    )


def tracker_env(args: argparse.Namespace, config: dict) -> dict[str, str]:
    """TETHER_TRACKERS for the scheduler when --tracker was given ({} otherwise: the run config's
    choice stands). ValueError, before anything starts, for an unknown tracker or one whose package is
    not installed (flags or run config)."""
    from pydantic import TypeAdapter, ValidationError

    from tether.scheduler.trackers import TrackerNames, missing

    given = ",".join(args.tracker or [])
    try:
        names = TypeAdapter(TrackerNames).validate_python(
            given or (config.get("scheduler") or {}).get("trackers", ())
        )
    except ValidationError as exc:
        raise ValueError(f"--tracker: {'; '.join(e['msg'] for e in exc.errors())}") from None
    problem = missing(names)
    if problem:
        raise ValueError(problem)
    return {"TETHER_TRACKERS": ",".join(names)} if given else {}


def add_up(sub: Subparsers) -> None:
    up = sub.add_parser("up", help="start the stack for agents you run yourself")
    up.add_argument(
        "--model",
        help="HF model directory (default: the run config's `model`, else the warm-started calculator model)",
    )
    up.add_argument("--config", metavar="FILE", help=CONFIG_HELP)
    up.add_argument("--lr", type=float, help="default 5e-4")
    up.add_argument("--seed", type=int, help="default 0")
    up.add_argument("--group-size", type=int, help="default group size of new rollouts (4)")
    up.add_argument("--groups-per-step", type=int, help="default 1")
    up.add_argument("--run-dir")
    up.add_argument(
        "--max-runs",
        type=int,
        metavar="N",
        help="serve and train up to N runs side by side (`tether run create`): vLLM with LoRA on and room "
        "for N adapters, the trainer with LoRA (TETHER_LORA_RANK, default 8); docs/runs.md",
    )
    serving = up.add_argument_group("serving (vLLM)")
    serving.add_argument(
        "--max-model-len",
        type=int,
        help="context length to serve (default: the model's max_position_embeddings)",
    )
    serving.add_argument(
        "--dtype",
        help="weights and activations dtype (default: float32, so that the trainer's logprobs match vLLM's)",
    )
    serving.add_argument("--tensor-parallel-size", type=int)
    serving.add_argument("--gpu-memory-utilization", type=float)
    serving.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        type=shell_words,
        metavar="ARGS",
        help="more vLLM flags, split like a shell would (repeatable), e.g. "
        "--vllm-arg '--max-num-seqs 64 --enable-prefix-caching'; one flag alone: "
        "--vllm-arg=--enable-prefix-caching",
    )
    replicas_flag(up)
    tracker_flag(up)
    up.set_defaults(fn=cmd_up)


def add_down(sub: Subparsers) -> None:
    down = sub.add_parser("down", help="stop the stack started here")
    down.set_defaults(fn=cmd_down)
