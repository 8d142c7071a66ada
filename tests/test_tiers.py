"""The two tiers are declared once (tiers.FULL_ONLY): every entry names a test that exists (a typo
would silently keep a slow test in `make test`), and what issue 24 asks of `make test` stays in it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from tiers import FULL_ONLY, full_only

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("entry", sorted(FULL_ONLY))
def test_each_entry_names_a_test_that_exists(entry):
    path, _, name = entry.partition("::")
    source = (ROOT / path).read_text()
    assert re.search(r"^(async )?def test_", source, re.M), f"{path} holds no test"
    if name:
        assert re.search(rf"^(async )?def {name}\(", source, re.M), f"no {name} in {path}"
    assert FULL_ONLY[entry].strip(), "every entry says why"


# What `make test` must cover (issue 24): one test id each, none of them left to `make test-all`.
IN_MAKE_TEST = [
    "tests/test_sdk_conformance.py::test_chat_streaming",
    "tests/test_sdk_gemini.py::test_generate_content",
    "tests/test_e2e.py::test_the_policy_learns",
    "tests/harnesses/test_harnesses.py::test_claude_code",
    "tests/harnesses/test_harnesses.py::test_codex",
    "tests/harnesses/test_harnesses.py::test_gemini_cli",
    "tests/deploy/test_chart.py::test_helm_lint_strict",
    "tests/deploy/test_chart_policy.py::test_pod_security_standards_restricted",
    "tests/test_e2e.py::test_a_gateway_killed_mid_run_loses_nothing",
    "tests/test_gateway_fuzz.py::test_fuzz_each_operation[POST /v1/chat/completions]",
    "tests/test_advantages.py::test_grpo_matches_the_rounded_convention",
]


@pytest.mark.parametrize("nodeid", IN_MAKE_TEST)
def test_make_test_keeps_every_layer(nodeid):
    path, _, name = nodeid.partition("::")
    assert re.search(rf"^(async )?def {name.split('[')[0]}\(", (ROOT / path).read_text(), re.M), nodeid
    assert full_only(nodeid) is None, nodeid


def test_the_long_runs_are_left_to_make_test_all():
    for nodeid in (
        "tests/test_images.py::test_anything",
        "tests/test_faults.py::test_every_fault_in_one_run",
        "tests/test_gateway_fuzz.py::test_fuzz_each_operation_1000[GET /metrics]",
        "tests/harnesses/test_harnesses.py::test_aider",
    ):
        assert full_only(nodeid), nodeid
