"""`tether demo`'s settings: a flag given on the command line, else the run config's value, else the
example's DEMO, else DEMO_DEFAULTS (cli.demo.demo_settings); dynamic sampling among them (issue 27)."""

from __future__ import annotations

import pytest

from tether.cli import build_parser, demo_settings
from tether.cli.demo import DEMO_DEFAULTS
from tether.cli.examples import load_example


def settings(*argv: str, config: dict | None = None) -> dict:
    return demo_settings(build_parser().parse_args(["demo", *argv]), config)


@pytest.mark.parametrize("example", ["calculator", "instruction", "search", "coding"])
def test_an_example_takes_its_demo_dict_then_the_defaults(example):
    got = settings("--example", example)
    preset = load_example(example).get("DEMO", {})
    assert got == {k: preset.get(k, d) for k, d in DEMO_DEFAULTS.items()}


def test_dynamic_sampling_flag_beats_the_run_config_which_beats_the_example():
    example = load_example("coding").get("DEMO", {}).get("dynamic_sampling", False)
    assert settings("--example", "coding")["dynamic_sampling"] is example
    on = {"scheduler": {"dynamic_sampling": True}}
    off = {"scheduler": {"dynamic_sampling": False}}
    assert settings("--example", "coding", config=on)["dynamic_sampling"] is True
    assert settings("--example", "coding", config=off)["dynamic_sampling"] is False
    assert settings("--example", "coding", "--no-dynamic-sampling", config=on)["dynamic_sampling"] is False
    assert settings("--example", "calculator", "--dynamic-sampling", config=off)["dynamic_sampling"] is True
    assert settings("--example", "calculator")["dynamic_sampling"] is False
