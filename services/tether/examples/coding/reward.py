"""The coding agent's reward, as pure functions: hidden-test outcomes from the runner's report, and the
episode's score from those outcomes.

The agent's code only ever produces values (the runner's report of what each call returned); whether
a value is right is decided here, against expected values the agent's code never sees, so nothing it
prints, patches or exits with can mark a test passed.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping


def parse_report(output: str, nonce: str) -> dict[str, dict]:
    """The runner's report: the last line that starts with this run's nonce, as {test: {values|error}}.
    No such line (the code under test exited, hung or printed garbage) is an empty report."""
    for line in reversed(output.splitlines()):
        if line.startswith(nonce):
            try:
                report = json.loads(line[len(nonce) :])
            except json.JSONDecodeError:
                return {}
            return report if isinstance(report, dict) else {}
    return {}


def _canonical(value: object) -> str:
    # JSON text, so True and 1 (or 5 and 5.0) differ as they would in `assert value == expected is ...`
    return json.dumps(value, sort_keys=True)


def outcomes(expected: Mapping[str, list], report: Mapping[str, object]) -> dict[str, bool]:
    """Pass/fail per test: passed iff the report holds exactly the expected values (as JSON) for it."""
    result = {}
    for name, values in expected.items():
        entry = report.get(name)
        got = entry.get("values") if isinstance(entry, dict) else None
        result[name] = isinstance(got, list) and _canonical(got) == _canonical(list(values))
    return result


def score(
    submitted: bool, passed: Mapping[str, bool], fail_to_pass: Iterable[str], pass_to_pass: Iterable[str]
) -> float:
    """1.0 when the agent submitted and every FAIL_TO_PASS and PASS_TO_PASS test passes, else 0.0.
    A test missing from `passed` counts as failed."""
    if not submitted:
        return 0.0
    required = [*fail_to_pass, *pass_to_pass]
    return 1.0 if required and all(passed.get(name, False) for name in required) else 0.0
