"""The value files the chart ships for users to start from (helm/tether/ci/*.yaml, the README's
install commands) render and pass the same core checks as tests/deploy's own sets: a broken example
is the first thing a new user meets."""

from __future__ import annotations

import pytest

from deploy import chart, policy
from deploy.validate import render_problems

EXAMPLES = sorted((chart.CHART / "ci").glob("*.yaml"))


def test_the_chart_ships_examples():
    assert len(EXAMPLES) >= 2


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
@pytest.mark.parametrize("version", chart.DEFAULT_KUBE_VERSIONS)
def test_an_example_renders_valid_and_restricted(path, version):
    values = chart.load_set(path).values
    chart.validate_schema(values)
    render = chart.render_values(values, version)
    problems = render_problems(render, version)
    problems += [v for o in render.objects for v in policy.surge_violations(o)]
    assert problems == []
