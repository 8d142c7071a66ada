"""`tether` commands: demo, up, down, eval, agent, agent-job, gateway, traces, samples, metrics,
dead-letters, ui, prepare-demo, health, config, run.

The cli sits above every service: it starts them as processes (see tether.launcher) and reads the
stack's Redis; nothing imports it. One module per group of commands, each adding its own to the parser:

    stack       up, down; what every command that starts or finds a stack shares
    demo        demo
    demo_runs   demo --runs (several examples side by side as runs of one stack)
    evaluate    eval
    examples    prepare-demo; the examples' warm-started models and task files
    agents      agent, agent-job
    gateway     gateway
    inspection  traces, samples, metrics, dead-letters
    ui          ui (its web app in tether.cli.web)
    config      config check, config values; the --config of up and demo
    runs        run create, run list, run status, run stop (through the gateway's admin routes)

Their top-level imports are the standard library's and each other's: a command imports what it needs
when it runs, so `tether health` (every few seconds in every container) loads nothing heavy.
"""

from __future__ import annotations

import argparse
import sys

from tether.cli.agents import add_agents, cmd_agent
from tether.cli.config import add_config
from tether.cli.demo import add_demo, demo_settings, read_metrics, summarize
from tether.cli.demo_runs import add_runs_flag
from tether.cli.evaluate import add_eval, pass_at_1
from tether.cli.examples import (
    add_prepare_demo,
    load_example,
    prepare_calculator_model,
    prepare_example_model,
    train_until,
)
from tether.cli.gateway import add_gateway
from tether.cli.inspection import add_inspection
from tether.cli.runs import add_runs
from tether.cli.stack import add_down, add_up, serving_env
from tether.cli.ui import add_ui

# What scripts, benches and tests call by its old place (tether.cli was one module).
__all__ = [
    "build_parser",
    "cmd_agent",
    "demo_settings",
    "load_example",
    "main",
    "pass_at_1",
    "prepare_calculator_model",
    "prepare_example_model",
    "read_metrics",
    "serving_env",
    "summarize",
    "train_until",
]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tether", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    add_runs_flag(add_demo(sub))
    add_up(sub)
    add_eval(sub)
    add_prepare_demo(sub)
    add_down(sub)
    add_agents(sub)
    add_gateway(sub)
    add_inspection(sub)
    add_ui(sub)

    from tether.common import health

    # Listed here for --help; main() hands `tether health ...` to tether.common.health before parsing.
    health.add_arguments(sub.add_parser("health", help="check one service's health (exit 0 = healthy)"))
    add_config(sub)
    add_runs(sub)
    return p


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["health"]:
        # Runs every few seconds in every container: its own light module, and exit 1 (not argparse's
        # 2, which Docker reserves) on bad arguments.
        from tether.common import health

        sys.exit(health.main(argv[1:]))
    args = build_parser().parse_args(argv)
    try:
        sys.exit(args.fn(args))
    except BrokenPipeError:
        sys.exit(0)
