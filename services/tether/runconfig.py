"""Run configs (docs/recipes.md, "The run config"): `tether config check FILE`, and what `tether up
--config` / `tether demo --config` read from one before starting anything.

A run config is checked here against every service's settings class, without starting a service:
unknown sections and keys, values that do not parse, and each section's validators across fields
(the section's values over the class's defaults; required settings the deployment supplies, such as
ports and addresses, are given placeholders). Only the cli uses this module; no service imports it.
"""

from __future__ import annotations

import os
import sys
import typing
from typing import Any

from pydantic import ValidationError
from pydantic_settings import BaseSettings

from tether.common.settings import (
    CONFIG_ENV,
    SECTIONS,
    CommonSettings,
    RunConfigError,
    read_run_config,
    section_problems,
)


def settings_classes() -> dict[str, type[CommonSettings]]:
    """Section -> the settings class that reads it (imports every service's settings)."""
    from tether.agents.main import AgentSettings
    from tether.gateway.main import GatewaySettings
    from tether.inference.main import InferenceSettings
    from tether.merger.main import MergerSettings
    from tether.scheduler.kube.settings import KubeSettings
    from tether.scheduler.main import SchedulerSettings
    from tether.trainer.main import TrainerSettings

    classes: list[type[CommonSettings]] = [
        GatewaySettings,
        MergerSettings,
        TrainerSettings,
        SchedulerSettings,
        KubeSettings,
        InferenceSettings,
        AgentSettings,
    ]
    return {typing.cast(str, c.config_section): c for c in classes}


def check(path: str | os.PathLike[str]) -> list[str]:
    """Every problem of the run config at `path` (`section.key: why`); [] when every service would
    take it."""
    try:
        data = read_run_config(path)
    except RunConfigError as exc:
        return [str(exc)]
    classes = settings_classes()
    assert set(classes) == SECTIONS, "a settings class without its section (or the reverse)"
    problems: list[str] = []
    for section, cls in classes.items():
        values = data.get(section) or {}
        found = section_problems(cls, section, values)
        problems += found
        if values and not found:
            problems += _whole_problems(cls, section, values)
    return problems


# What a deployment supplies beyond the required fields, so that validators needing it pass (the
# launcher, compose and the chart always set vLLM's address).
DEPLOYMENT_SUPPLIES: dict[str, dict[str, Any]] = {
    "gateway": {"vllm_url": "http://inference:8001"},
    "trainer": {"vllm_url": "http://inference:8001"},
    "scheduler": {"gateway_control_address": "gateway:50051"},
}


def _whole_problems(cls: type[BaseSettings], section: str, values: dict[str, Any]) -> list[str]:
    """The class's own validators (across fields) over the section's values."""
    given = {
        **{name: _placeholder(f.annotation) for name, f in cls.model_fields.items() if f.is_required()},
        **DEPLOYMENT_SUPPLIES.get(section, {}),
        **values,
    }
    saved = os.environ.pop(CONFIG_ENV, None)  # the init values alone, not a config of the caller's
    try:
        env = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("TETHER_")}
        try:
            cls(**given)
        finally:
            os.environ.update(env)
    except ValidationError as exc:
        return [f"{section}.{'.'.join(map(str, e['loc'])) or '(section)'}: {e['msg']}" for e in exc.errors()]
    finally:
        if saved is not None:
            os.environ[CONFIG_ENV] = saved
    return []


def _placeholder(annotation: Any) -> Any:
    """A value of a required setting's type (ports, addresses, paths: what deployments set)."""
    return 0 if annotation is int else "placeholder"


def cmd_check(files: list[str]) -> int:
    """`tether config check FILE...`: each file's problems, one a line; exit 1 when any has one."""
    failed = 0
    for f in files:
        problems = check(f)
        if problems:
            failed += 1
            for p in problems:
                print(f"{f}: {p}" if not p.startswith(f"{f}:") else p)
        else:
            print(
                f"{f}: ok ({', '.join(sorted(k for k in read_run_config(f) if k in SECTIONS)) or 'no sections'})"
            )
    return 1 if failed else 0


def cmd_values(path: str) -> int:
    """`tether config values FILE`: the checked run config as Helm values (`runConfig:` holding it), for
    `helm install -f recipes/helm/X.yaml -f <(tether config values recipes/X.yaml)`."""
    import yaml

    problems = check(path)
    if problems:
        for p in problems:
            print(p, file=sys.stderr)
        return 1
    print(yaml.safe_dump({"runConfig": read_run_config(path)}, sort_keys=False), end="")
    return 0
