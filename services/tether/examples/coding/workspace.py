"""One episode's repository: the agent's working copy, its commands, and the hidden tests.

The working copy holds the task's source files and nothing else (no tests, no .git). The hidden tests
never enter it: `run_tests` (the agent's test command) and `passed` (scoring) copy only the allow-listed
source files out of it into a fresh directory beside a small runner, run that in the sandbox too (the
code under test gets no more network or file access than the agent's commands), and compare the values
it reports with the expected ones here, outside the sandbox.
"""

from __future__ import annotations

import json
import secrets
import shutil
import tempfile
from pathlib import Path

from tether.examples.coding import reward, sandbox
from tether.examples.coding.repos import MODULE, Repo

# Imports the module under test and calls each test's function with its arguments; prints one line:
# the nonce, then {test: {"values": [...]}} or {test: {"error": "TypeName"}}. The code under test runs
# with stdout pointed at /dev/null, so its own prints cannot fake the line (nor could they pass a
# test: the expected values are not here).
RUNNER = """\
import importlib, json, os, sys
sys.path.insert(0, os.getcwd())
spec = json.load(open("_calls.json"))
real = os.dup(1)
null = os.open(os.devnull, os.O_WRONLY)
os.dup2(null, 1)
sys.stdout = open(os.devnull, "w")
report = {}
for test in spec["tests"]:
    try:
        module = importlib.import_module(test["module"])
        values = [getattr(module, test["function"])(*args) for args in test["calls"]]
        json.dumps(values)
        report[test["name"]] = {"values": values}
    except BaseException as exc:
        report[test["name"]] = {"error": type(exc).__name__}
os.write(real, (spec["nonce"] + json.dumps(report) + "\\n").encode())
"""
RUNNER_FILE = "_tether_runner.py"
TEST_TIMEOUT_S = 10.0


class Workspace:
    """Temporary directories for one episode; use as a context manager (removes them on exit)."""

    def __init__(self, repo: Repo, command_timeout_s: float, output_limit: int):
        self.repo = repo
        self.command_timeout_s = command_timeout_s
        self.output_limit = output_limit
        self.root = Path(tempfile.mkdtemp(prefix="tether-coding-"))
        self.work = self.root / "work"
        self.work.mkdir()
        for name, text in repo.files.items():
            (self.work / name).write_text(text)

    def __enter__(self) -> Workspace:
        return self

    def __exit__(self, *exc: object) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def run(self, command: str) -> sandbox.Result:
        """The agent's command, in its working copy."""
        return sandbox.run(command, self.work, self.command_timeout_s, self.output_limit)

    def passed(self) -> dict[str, bool]:
        """Every hidden test's outcome on the allow-listed files of the working copy as it is now."""
        fresh = Path(tempfile.mkdtemp(prefix="test-", dir=self.root))
        try:
            sandbox.copy_files(self.work, fresh, list(self.repo.files))
            nonce = secrets.token_hex(8)
            module = Path(MODULE).stem
            tests = [
                {"name": t.name, "module": module, "function": t.function, "calls": t.calls}
                for t in self.repo.tests
            ]
            (fresh / "_calls.json").write_text(json.dumps({"nonce": nonce, "tests": tests}))
            (fresh / RUNNER_FILE).write_text(RUNNER)
            # -I: no PYTHON* variables, no user site; -S: no site (no .pth files); -B: no bytecode.
            result = sandbox.run(f"python3 -I -S -B {RUNNER_FILE}", fresh, TEST_TIMEOUT_S, 65536)
        finally:
            shutil.rmtree(fresh, ignore_errors=True)
        expected = {t.name: list(t.expected) for t in self.repo.tests}
        return reward.outcomes(expected, reward.parse_report(result.output, nonce))
