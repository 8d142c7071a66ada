"""Settings shared by the services. Each service subclasses `CommonSettings`, or `RedisSettings` when it
uses the run's Redis (gateway, merger, scheduler, agent worker; the trainer and the inference adapter do
not), and declares its own fields with types that refuse a bad value at start-up (Literal names: see
tether.algorithms.names). Every setting is read from TETHER_<FIELD>; docs/settings.md lists them.

The run config (docs/recipes.md, "The run config"): TETHER_CONFIG names a YAML file with one section
per service (`trainer: {lr: 1.0e-6}`); each service reads its own section (`config_section`) as one
more settings source. Precedence, highest first: the environment (an empty variable counts as unset),
the run config, the field's default. A key of the section that is no field of the class, or a value
that does not parse, refuses the settings naming `section.key`; a key the environment overrides is
logged as a warning, so a recipe's value is never replaced silently.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, cast

from pydantic import Field, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

# Pure key names (no Redis, no metrics): the broker builds on the same module, never on this one.
from tether.common.keys import DEFAULT_TRACE_PARTITIONS, Keys, PartitionMismatch

log = logging.getLogger("tether.settings")

CONFIG_ENV = "TETHER_CONFIG"
# Top-level keys of a run config that belong to no service: what `tether up/demo --config` reads
# (the model to serve, the example harness) and a free-text description.
RUN_KEYS = frozenset({"model", "example", "description"})
# One section per settings class (its config_section); tests/test_runconfig.py holds the two together.
SECTIONS = frozenset({"gateway", "merger", "trainer", "scheduler", "kube", "inference", "agent"})
SETTINGS_REFUSED = 2  # exit status for settings refused at start-up (supervisors need not restart it)

# How new weights reach inference, set on the scheduler and the trainer alike: "checkpoint" (path 1,
# inference reloads the checkpoint) or "nccl" (path 2, the trainer streams them; docs/weight-push.md).
WeightPush = Literal["checkpoint", "nccl"]


class CommonSettings(BaseSettings):
    """Values every service reads from the environment (TETHER_*)."""

    # env_ignore_empty: compose passes `${TETHER_LR:-}`, empty unless the user set it, so that an
    # unset variable leaves the run config's value (or the default) in place.
    model_config = SettingsConfigDict(env_prefix="TETHER_", extra="ignore", env_ignore_empty=True)
    # The run config's section this class reads (None: the class reads no run config).
    config_section: ClassVar[str | None] = None

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (
            init_settings,
            env_settings,
            RunConfigSource(settings_cls),
            dotenv_settings,
            file_secret_settings,
        )

    log_level: str = "INFO"
    # Port for Prometheus /metrics (0 = do not expose; the gateway serves it on its HTTP port).
    metrics_port: int = 0


class RedisSettings(CommonSettings):
    """The run's Redis, for the services that use it."""

    # Required: the launcher starts an embedded one when the user gives none. redis+cluster://host:port
    # (rediss+cluster:// with TLS) names a Redis Cluster by any one of its nodes.
    redis_url: str
    # Prefix of every Redis key, so several runs (or tests) can share one Redis.
    namespace: str = "tether"
    # Partitions of the trace stream (each its own hash slot on a cluster); the same on every service.
    trace_partitions: int = Field(DEFAULT_TRACE_PARTITIONS, ge=1)

    def keys(self) -> Keys:
        """The run's Redis keys (namespace and trace partitions)."""
        return Keys(self.namespace, self.trace_partitions)


class RunConfigError(ValueError):
    """A run config that cannot be used: unreadable, not a mapping, an unknown section or key, a bad
    value. The message names the file and every offending `section.key`."""


def read_run_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The run config as a mapping of sections (each a mapping) and run keys; RunConfigError if the file
    is missing, not YAML, or not shaped so."""
    import yaml  # only where a run config is used

    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise RunConfigError(f"{path}: cannot read the run config: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise RunConfigError(f"{path}: not valid YAML: {exc}") from None
    if data is None:
        return {}
    bad = run_config_problems(data)
    if bad:
        raise RunConfigError(f"{path}: " + "; ".join(bad))
    return cast("dict[str, Any]", data)


def run_config_problems(data: Any) -> list[str]:
    """What is wrong with a run config's shape (a mapping of known sections, each a mapping of settings,
    and run keys), one a line; [] when none. The settings themselves are checked by
    `tether.runconfig.check`, which imports every service's settings class; a service that must not (the
    gateway, which keeps runs' configs: docs/runs.md) checks this much."""
    if not isinstance(data, dict):
        return [f"a run config is a mapping of sections, not {type(data).__name__}"]
    bad = [f"{k}: unknown section" for k in data if k not in SECTIONS | RUN_KEYS]
    bad += [
        f"{k}: a section is a mapping of settings"
        for k, v in data.items()
        if k in SECTIONS and not isinstance(v, dict | None)
    ]
    return bad


def section_problems(settings: type[BaseSettings], section: str, values: dict[str, Any]) -> list[str]:
    """`section.key: why` for every key of `values` that is no field of `settings` or whose value does
    not parse as that field's type (constraints included). Validators across fields run when the
    settings are built, and name the field then."""
    out = []
    for key, value in values.items():
        field = settings.model_fields.get(key) if isinstance(key, str) else None
        if field is None:
            out.append(f"{section}.{key}: unknown setting")
            continue
        try:
            _adapter(field).validate_python(value)
        except ValidationError as exc:
            why = "; ".join(e["msg"] for e in exc.errors())
            out.append(f"{section}.{key}: {why} (got {value!r})")
    return out


def _adapter(field: FieldInfo) -> TypeAdapter[Any]:
    """The field's type with its constraints (ge, gt, ...), as the settings class validates it."""
    annotation: Any = Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation
    return TypeAdapter(annotation)


class RunConfigSource(PydanticBaseSettingsSource):
    """The section `settings_cls.config_section` of the file TETHER_CONFIG names (nothing when either is
    unset). Checked whole before it is used: RunConfigError lists every unknown key and bad value."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # unused: __call__ reads the section at once

    def __call__(self) -> dict[str, Any]:
        section = getattr(self.settings_cls, "config_section", None)
        path = os.environ.get(CONFIG_ENV)
        if not section or not path:
            return {}
        values = read_run_config(path).get(section) or {}
        problems = section_problems(self.settings_cls, section, values)
        if problems:
            raise RunConfigError(f"{path}: " + "; ".join(problems))
        for key in values:
            env = f"TETHER_{key}".upper()
            if os.environ.get(env):
                log.warning(
                    "%s=%s from the environment overrides %s.%s=%r of the run config %s",
                    env,
                    os.environ[env],
                    section,
                    key,
                    values[key],
                    path,
                )
        return dict(values)


@contextmanager
def refused_settings_exit(service: str) -> Iterator[None]:
    """Around a service's settings: bad settings (environment or run config) print why and exit with
    SETTINGS_REFUSED, before anything serves (restarting the process cannot help). Around a service's
    run too: a trace partition count other than the run's is refused the same way."""
    try:
        yield
    except (ValidationError, RunConfigError, PartitionMismatch) as exc:
        print(f"tether.{service}: refusing to start, bad settings: {exc}", file=sys.stderr)
        sys.exit(SETTINGS_REFUSED)
