"""Every service's settings: documented both ways, and a bad name refused at start-up naming the variable.

The documentation check reads the settings tables of the docs (first column: the variables of a row,
with or without the TETHER_ prefix; a trailing "(gateway)" etc. files the row under that service) and
compares them with the settings classes' fields: a field nobody documented and a documented variable
that is no field both fail. A new settings class must be given a table here too.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from pydantic import ValidationError

from tether.agents.main import AgentSettings
from tether.common.settings import CommonSettings, RedisSettings
from tether.gateway.main import GatewaySettings
from tether.inference.main import InferenceSettings
from tether.merger.main import MergerSettings
from tether.runhost.main import RunHostSettings
from tether.scheduler.kube.settings import KubeSettings
from tether.scheduler.main import SchedulerSettings
from tether.trainer.main import TrainerSettings

ROOT = Path(__file__).resolve().parents[1]

# Settings class -> where its table is: (doc, heading the table sits under). Rows of other tables that
# name the service in parentheses count too (docs/merging.md lists the gateway's TETHER_GUIDED).
TABLES: dict[type, tuple[str, str]] = {
    CommonSettings: ("docs/settings.md", "## Every service"),
    RedisSettings: ("docs/settings.md", "## Services that use Redis"),
    GatewaySettings: ("docs/gateway.md", "## Settings"),
    MergerSettings: ("docs/merging.md", "## Settings"),
    TrainerSettings: ("docs/trainer.md", "## Settings"),
    SchedulerSettings: ("docs/settings.md", "## Scheduler"),
    InferenceSettings: ("docs/settings.md", "## Inference adapter"),
    AgentSettings: ("docs/settings.md", "## Agent worker"),
    KubeSettings: ("docs/scheduler-kubernetes.md", "## Settings"),
    RunHostSettings: ("docs/settings.md", "## Run host"),
}
SERVICE_OF = {
    "gateway": GatewaySettings,
    "merger": MergerSettings,
    "trainer": TrainerSettings,
    "scheduler": SchedulerSettings,
    "inference": InferenceSettings,
    "agent": AgentSettings,
}

# The least each service needs to start (values only have to parse).
MINIMAL_ENV: dict[type, dict[str, str]] = {
    GatewaySettings: {"TETHER_REDIS_URL": "redis://127.0.0.1:1/0", "TETHER_VLLM_URL": "http://127.0.0.1:1"},
    MergerSettings: {
        "TETHER_REDIS_URL": "redis://127.0.0.1:1/0",
        "TETHER_MERGER_GRPC_PORT": "0",
        "TETHER_TRAINER_ADDRESS": "127.0.0.1:1",
    },
    TrainerSettings: {
        "TETHER_TRAINER_GRPC_PORT": "0",
        "TETHER_MODEL_DIR": "m",
        "TETHER_CHECKPOINT_DIR": "c",
        "TETHER_VLLM_URL": "http://127.0.0.1:1",  # so that weight_push=nccl parses too
    },
    SchedulerSettings: {
        "TETHER_REDIS_URL": "redis://127.0.0.1:1/0",
        "TETHER_SCHEDULER_GRPC_PORT": "0",
        "TETHER_GATEWAY_CONTROL_ADDRESS": "127.0.0.1:1",
        "TETHER_INFERENCE_ADDRESS": "127.0.0.1:1",
        "TETHER_TRAINER_ADDRESS": "127.0.0.1:1",
        "TETHER_RUN_ID": "r",
        "TETHER_RUN_DIR": "d",
    },
    InferenceSettings: {"TETHER_INFERENCE_GRPC_PORT": "0"},
    AgentSettings: {
        "TETHER_REDIS_URL": "redis://127.0.0.1:1/0",
        "TETHER_AGENT_FN": "m:f",
        "TETHER_GATEWAY_URL": "http://127.0.0.1:1",
    },
}
SERVICES = list(MINIMAL_ENV)


def _subclasses(cls: type) -> set[type]:
    out = set()
    for sub in cls.__subclasses__():
        if sub.__module__.startswith("tether."):  # not the settings classes tests define
            out |= {sub} | _subclasses(sub)
    return out


def _section(text: str, heading: str) -> list[str]:
    """The lines under `heading` (a line that starts with it) up to the next heading of its level or
    above."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(heading)]
    assert len(starts) == 1, f"{len(starts)} headings {heading!r}"
    level = len(heading) - len(heading.lstrip("#"))
    out = []
    for line in lines[starts[0] + 1 :]:
        m = re.match(r"(#+) ", line)
        if m and len(m.group(1)) <= level:
            break
        out.append(line)
    return out


def _rows(lines: list[str]) -> list[str]:
    """First cells of a section's table rows (not the header, not the |---| line)."""
    rows = [line for line in lines if line.startswith("|")]
    return [r.split("|")[1].strip() for r in rows[2:] if not set(r) <= set("|-: ")]


def _names(cell: str) -> set[str]:
    return {n.removeprefix("TETHER_").lower() for n in re.findall(r"`([A-Z][A-Z0-9_]*)`", cell)}


def documented() -> dict[type, set[str]]:
    """Settings class -> the field names its tables (and the rows that name it) document."""
    out: dict[type, set[str]] = {cls: set() for cls in TABLES}
    for cls, (doc, heading) in TABLES.items():
        for cell in _rows(_section((ROOT / doc).read_text(), heading)):
            m = re.search(r"\((\w+)\)\s*$", cell)
            owner = SERVICE_OF[m.group(1)] if m else cls
            names = _names(cell)
            assert names, f"{doc} {heading}: a row names no variable: {cell!r}"
            out[owner] |= names
    return out


def own_fields(cls: type) -> set[str]:
    """The fields a class adds to its parent's (the parent's are in the parent's table)."""
    return set(cls.model_fields) - set(cls.__bases__[0].model_fields)


def test_every_settings_class_has_a_table():
    assert _subclasses(CommonSettings) | {CommonSettings} == set(TABLES)


@pytest.mark.parametrize("cls", list(TABLES), ids=lambda c: c.__name__)
def test_docs_list_every_field_and_no_other(cls):
    docs = documented()[cls]
    missing = own_fields(cls) - docs
    stale = docs - set(cls.model_fields)
    doc, heading = TABLES[cls]
    assert not missing, f"{cls.__name__} fields not documented in {doc} ({heading}): {sorted(missing)}"
    assert not stale, f"{doc} documents {sorted(stale)}, which {cls.__name__} does not have"


def test_redis_url_is_required_only_where_redis_is_used():
    uses_redis = {GatewaySettings, MergerSettings, SchedulerSettings, AgentSettings}
    for cls in SERVICES:
        field = cls.model_fields.get("redis_url")
        if cls in uses_redis:
            assert field is not None and field.is_required(), cls.__name__
        else:
            assert field is None, f"{cls.__name__} does not use Redis but has redis_url"


def literal_values(annotation) -> tuple | None:
    """The allowed values of a Literal (or optional Literal) field, else None."""
    if typing.get_origin(annotation) is typing.Literal:
        return typing.get_args(annotation)
    for arg in typing.get_args(annotation):
        if typing.get_origin(arg) is typing.Literal:
            return typing.get_args(arg)
    return None


LITERAL_FIELDS = [
    (cls, name, values)
    for cls in SERVICES
    for name, field in cls.model_fields.items()
    if (values := literal_values(field.annotation)) is not None
]


def test_the_names_are_literal_types():
    """The settings that choose a named behaviour take the names' own types (so a bad one is refused)."""
    have = {(cls.__name__, name) for cls, name, _ in LITERAL_FIELDS}
    want = {
        ("GatewaySettings", "guided"),
        ("MergerSettings", "merge_mode"),
        ("MergerSettings", "overlong"),
        ("MergerSettings", "advantage_estimator"),
        ("MergerSettings", "advantage_level"),
        ("MergerSettings", "side_calls"),
        ("MergerSettings", "truncated_responses"),
        ("TrainerSettings", "loss_mode"),
        ("TrainerSettings", "kl_estimator"),
        ("TrainerSettings", "off_policy"),
        ("TrainerSettings", "device"),
        ("TrainerSettings", "weight_push"),
        ("TrainerSettings", "weight_push_backend"),
        ("TrainerSettings", "weight_push_dtype"),
        ("SchedulerSettings", "mode"),
        ("SchedulerSettings", "weight_push"),
        ("SchedulerSettings", "trackers"),
    }
    assert want <= have, sorted(want - have)


@pytest.mark.parametrize("cls", SERVICES, ids=lambda c: c.__name__)
def test_minimal_environment_starts(cls, clean_env):
    for k, v in MINIMAL_ENV[cls].items():
        clean_env.setenv(k, v)
    cls()


# Settings whose values other settings must allow (FSDP_OFFLOAD is refused without FSDP).
NEEDS = {
    (TrainerSettings, "fsdp_offload"): {"TETHER_FSDP": "true"},
    (MergerSettings, "truncated_responses"): {"TETHER_OVERLONG_BUFFER_TOKENS": "512"},
}


@pytest.mark.parametrize(
    ("cls", "name", "values"), LITERAL_FIELDS, ids=[f"{c.__name__}.{n}" for c, n, _ in LITERAL_FIELDS]
)
def test_a_bad_name_is_refused_naming_the_variable(cls, name, values, clean_env):
    for k, v in {**MINIMAL_ENV[cls], **NEEDS.get((cls, name), {})}.items():
        clean_env.setenv(k, v)
    # A setting of several names (TETHER_TRACKERS: a tuple of them, comma-separated in the environment).
    many = typing.get_origin(cls.model_fields[name].annotation) is tuple
    for good in values:  # every documented value is taken as it is written in the environment
        clean_env.setenv(f"TETHER_{name.upper()}", str(good))
        assert getattr(cls(), name) == ((good,) if many else good)
    clean_env.setenv(f"TETHER_{name.upper()}", "bogus")
    with pytest.raises(ValidationError) as exc:
        cls()
    assert [e["loc"] for e in exc.value.errors()] == [(name, 0) if many else (name,)]
    assert name in str(exc.value) and "'bogus'" in str(exc.value)


def test_the_overlong_penalty_needs_a_buffer_and_takes_only_sound_values(clean_env):
    for k, v in MINIMAL_ENV[MergerSettings].items():
        clean_env.setenv(k, v)
    clean_env.setenv("TETHER_TRUNCATED_RESPONSES", "penalty")
    with pytest.raises(ValidationError, match="needs overlong_buffer_tokens"):
        MergerSettings()
    for name, bad in [
        ("OVERLONG_BUFFER_TOKENS", "0"),
        ("OVERLONG_PENALTY", "0"),
        ("OVERLONG_PENALTY", "nan"),
    ]:
        clean_env.setenv("TETHER_OVERLONG_BUFFER_TOKENS", "512")
        clean_env.setenv(f"TETHER_{name}", bad)
        with pytest.raises(ValidationError) as exc:
            MergerSettings()
        assert [e["loc"] for e in exc.value.errors()] == [(name.lower(),)]
        clean_env.delenv(f"TETHER_{name}")
    clean_env.setenv("TETHER_OVERLONG_BUFFER_TOKENS", "512")
    s = MergerSettings()
    assert (s.truncated_responses, s.overlong_buffer_tokens, s.overlong_penalty) == ("penalty", 512, 1.0)


# One Literal setting per service that has one, given to the real process.
STARTS = [
    ("scheduler", SchedulerSettings, "mode"),
    ("merger", MergerSettings, "advantage_estimator"),
    ("trainer", TrainerSettings, "loss_mode"),
    ("gateway", GatewaySettings, "guided"),
]


@pytest.mark.parametrize(("service", "cls", "name"), STARTS, ids=[s for s, _, _ in STARTS])
def test_the_process_refuses_a_bad_name_at_start(service, cls, name, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TETHER_")}
    env.update(MINIMAL_ENV[cls], **{f"TETHER_{name.upper()}": "bogus"})
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "services"), env.get("PYTHONPATH", "")])
    p = subprocess.run(
        [sys.executable, "-m", f"tether.{service}"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode != 0
    assert re.search(rf"^{name}$", p.stderr, re.M), p.stderr[-2000:]
    assert "input_value='bogus'" in p.stderr, p.stderr[-2000:]
