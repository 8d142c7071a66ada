"""The coding tasks: a generated family of one-module Python repositories, each with one seeded bug.

A repository is ``ops.py`` holding a few one-line functions drawn from `FUNCTIONS`, one of them with
its bug (a swapped operator, an off-by-one index, a wrong constant). Its tests are hidden from the
agent: each is a name, a function and the calls it makes; the expected values come from the correct
implementation and never leave the harness. FAIL_TO_PASS are the buggy function's tests (each fails
on the seeded bug, checked), PASS_TO_PASS the others'.

A task (what tasks.jsonl carries) names the functions and the buggy one; `build` makes the rest.
Every bug's wrong text occurs once in its file, so a one-line ``sed -i 's/OLD/NEW/' ops.py`` fixes it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

MODULE = "ops.py"


@dataclass(frozen=True)
class Function:
    name: str
    params: str
    body: str  # the correct expression
    bug: str  # the seeded bug's expression
    kind: str  # swapped operator, off-by-one, wrong constant
    fix: str  # the sed script that turns the bug back into the body
    calls: tuple[tuple, ...]  # the hidden test's arguments

    def source(self, buggy: bool) -> str:
        return f"def {self.name}({self.params}):\n    return {self.bug if buggy else self.body}\n"


FUNCTIONS: tuple[Function, ...] = (
    Function("add", "a, b", "a + b", "a - b", "swapped operator", "s/-/+/", ((2, 3), (0, 4))),
    Function("sub", "a, b", "a - b", "a + b", "swapped operator", "s/+/-/", ((5, 3), (2, 2))),
    Function("mul", "a, b", "a * b", "a + b", "swapped operator", "s/+/*/", ((2, 3), (0, 5))),
    Function("smaller", "a, b", "a if a < b else b", "a if a > b else b", "swapped operator", "s/>/</",
             ((2, 5), (7, 1))),
    Function("larger", "a, b", "a if a > b else b", "a if a < b else b", "swapped operator", "s/</>/",
             ((2, 5), (7, 1))),
    Function("double", "a", "2 * a", "3 * a", "wrong constant", "s/3/2/", ((4,), (1,))),
    Function("inc", "a", "a + 1", "a + 2", "wrong constant", "s/2/1/", ((1,), (5,))),
    Function("first", "xs", "xs[0]", "xs[1]", "off-by-one", "s/1/0/", (([4, 5, 6],), ([7, 8],))),
    Function("last", "xs", "xs[-1]", "xs[-2]", "off-by-one", "s/2/1/", (([4, 5, 6],), ([7, 8],))),
    Function("is_even", "n", "n % 2 == 0", "n % 2 == 1", "wrong constant", "s/1/0/", ((4,), (7,))),
)  # fmt: skip
BY_NAME = {f.name: f for f in FUNCTIONS}


@dataclass(frozen=True)
class Test:
    name: str
    function: str
    calls: tuple[tuple, ...]
    expected: tuple  # one value per call


@dataclass(frozen=True)
class Repo:
    files: dict[str, str]  # the agent's working copy: only these files, allow-listed for scoring
    tests: tuple[Test, ...]  # hidden
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]
    fix: str  # the sed script of the reference fix (demonstrations, the honest scripted agent)


def _evaluate(source: str, function: str, calls: tuple[tuple, ...]) -> tuple:
    namespace: dict = {}
    exec(compile(source, MODULE, "exec"), namespace)  # our own generated code, never the agent's
    return tuple(namespace[function](*args) for args in calls)


def build(task: dict) -> Repo:
    """The task's repository: files with the bug seeded, hidden tests with expected values."""
    names: list[str] = task["functions"]
    buggy: str = task["bug"]
    functions = [BY_NAME[n] for n in names]
    source = "\n\n".join(f.source(buggy=f.name == buggy) for f in functions)
    correct = "\n\n".join(f.source(buggy=False) for f in functions)
    tests = tuple(
        Test(f"test_{f.name}", f.name, f.calls, _evaluate(correct, f.name, f.calls)) for f in functions
    )
    bug = BY_NAME[buggy]
    if _evaluate(source, buggy, bug.calls) == _evaluate(correct, buggy, bug.calls):
        raise ValueError(f"{buggy}: the seeded bug passes its test")
    return Repo(
        files={MODULE: source},
        tests=tests,
        fail_to_pass=(f"test_{buggy}",),
        pass_to_pass=tuple(t.name for t in tests if t.function != buggy),
        fix=bug.fix,
    )


def _valid(names: tuple[str, ...], buggy: str) -> bool:
    """The bug's wrong text occurs once in the file (so its sed fix touches nothing else)."""
    bug = BY_NAME[buggy]
    old = bug.fix.split("/")[1]
    source = "\n\n".join(BY_NAME[n].source(buggy=n == buggy) for n in names)
    return source.count(old) == 1


def all_tasks() -> list[dict]:
    """Every valid two-function repository with one buggy function, in a fixed order."""
    tasks = []
    for a, b in itertools.permutations([f.name for f in FUNCTIONS], 2):
        for buggy in (a, b):
            if _valid((a, b), buggy):
                tasks.append({"task_id": f"{a}+{b}:{buggy}", "functions": [a, b], "bug": buggy})
    return tasks
