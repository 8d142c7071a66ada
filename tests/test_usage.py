"""`python -m tether.<svc> --help` (common/usage.py): the settings table, read from the class alone."""

from __future__ import annotations

import enum
from typing import Literal

import pytest
from pydantic import Field

from tether.common.settings import RedisSettings
from tether.common.usage import exit_if_help


class Mode(enum.StrEnum):
    FAST = "fast"
    SAFE = "safe"


class DemoSettings(RedisSettings):
    needed: str
    mode: Mode = Mode.SAFE
    side: Literal["left", "right"] = "left"
    workers: int = Field(4, ge=1)
    ids: list[int] = []
    token: str | None = None


def test_no_argument_returns_without_reading_the_environment(monkeypatch) -> None:
    monkeypatch.delenv("TETHER_NEEDED", raising=False)
    assert exit_if_help(DemoSettings, "Demo.", []) is None


def test_help_prints_every_setting_with_type_and_default(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        exit_if_help(DemoSettings, "Demo service.", ["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m test_usage") and "Demo service." in out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.startswith("  TETHER_")}
    assert rows == {
        "TETHER_REDIS_URL": ["str", "(required)"],
        "TETHER_NAMESPACE": ["str", "tether"],
        "TETHER_TRACE_PARTITIONS": ["int", "(ge=1)", "4"],
        "TETHER_LOG_LEVEL": ["str", "INFO"],
        "TETHER_METRICS_PORT": ["int", "0"],
        "TETHER_NEEDED": ["str", "(required)"],
        "TETHER_MODE": ["fast|safe", "safe"],
        "TETHER_SIDE": ["left|right", "left"],
        "TETHER_WORKERS": ["int", "(ge=1)", "4"],
        "TETHER_IDS": ["list[int]", "[]"],
        "TETHER_TOKEN": ["str", "|", "None", "(unset)"],
    }


def test_any_other_argument_is_refused(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        exit_if_help(DemoSettings, None, ["--port", "1"])
    assert exit_.value.code == 2
    assert "unrecognized arguments" in capsys.readouterr().err
