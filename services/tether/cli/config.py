"""Run configs (docs/recipes.md): `tether config check|values`, and the --config of `tether up` and
`tether demo` (checked first, handed to every process; a flag given wins over it).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from tether.cli.args import Subparsers

CONFIG_HELP = (
    "a run config (YAML, one section per service; docs/recipes.md): checked first, then read by every "
    "service (TETHER_CONFIG); a flag given wins over it, and so does a TETHER_* variable of your environment"
)


# Flags of `tether up` / `tether demo` -> the setting each passes on (a flag given wins over the config).
FLAG_SETTINGS = {
    "lr": "TETHER_LR",
    "seed": "TETHER_SEED",
    "group_size": "TETHER_GROUP_SIZE",
    "groups_per_step": "TETHER_GROUPS_PER_STEP",
    "steps": "TETHER_STEPS",
    "tasks_per_step": "TETHER_TASKS_PER_STEP",
    "eval_repeats": "TETHER_EVAL_REPEATS",
    "concurrency": "TETHER_AGENT_CONCURRENCY",
    "mode": "TETHER_MODE",
    "max_staleness": "TETHER_MAX_STALENESS",
    "sleep_level": "TETHER_SLEEP_LEVEL",
    "example": "TETHER_AGENT_FN",
    "tracker": "TETHER_TRACKERS",
}


def use_run_config(args: argparse.Namespace) -> tuple[dict, frozenset[str]]:
    """With --config: the file checked against every service's settings (RunConfigError naming every
    problem), handed to every process as TETHER_CONFIG; returns its sections and run keys, and the
    settings of the flags the user gave (which win over it). Without: ({}, those flags)."""
    explicit = frozenset(env for flag, env in FLAG_SETTINGS.items() if getattr(args, flag, None) is not None)
    if not getattr(args, "config", None):
        return {}, explicit
    from tether.common.settings import CONFIG_ENV, RunConfigError, read_run_config
    from tether.runconfig import check

    problems = check(args.config)
    if problems:
        raise RunConfigError("\n".join(problems))
    path = str(Path(args.config).resolve())
    os.environ[CONFIG_ENV] = path  # the launcher hands the user's environment to every process
    return read_run_config(path), explicit


def config_model(config: dict, model: str | None) -> str | None:
    """--model, else the run config's `model`, which must then be a local model directory (a recipe
    names the hub id: download it first)."""
    if model or not config.get("model"):
        return model
    path = Path(config["model"])
    if not (path / "config.json").is_file():
        raise ValueError(
            f"the run config's model {config['model']!r} is not a local model directory (no config.json): "
            "download it (e.g. `hf download NAME --local-dir DIR`) and pass --model DIR"
        )
    return str(path)


def cmd_config_check(args: argparse.Namespace) -> int:
    from tether.runconfig import cmd_check

    return cmd_check(args.files)


def cmd_config_values(args: argparse.Namespace) -> int:
    from tether.runconfig import cmd_values

    return cmd_values(args.file)


def add_config(sub: Subparsers) -> None:
    config = sub.add_parser("config", help="run configs: one YAML file for every service (docs/recipes.md)")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    check = config_sub.add_parser(
        "check",
        help="validate run configs against every service's settings, starting nothing (exit 1: a problem)",
    )
    check.add_argument("files", nargs="+", metavar="FILE")
    check.set_defaults(fn=cmd_config_check)
    values = config_sub.add_parser(
        "values", help="print a checked run config as the Helm chart's values (runConfig: ...)"
    )
    values.add_argument("file", metavar="FILE")
    values.set_defaults(fn=cmd_config_values)
