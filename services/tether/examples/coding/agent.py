"""The coding agent: a bash-tool harness in mini-SWE-agent's shape, fixing a seeded bug in a small repo.

Each turn the model replies with one fenced ```bash block; the harness runs that command in the
episode's sandboxed working copy (sandbox.py: source files only, no tests, no .git, no network, a
read-only system, a per-command timeout) and sends back its exit status and (truncated) output. The
command ``run_tests`` is the harness's own: it runs the hidden tests on a fresh copy of the source
files and shows PASSED or FAILED per test name. The episode ends when a command prints
COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT (the submission), or at the turn, context or time limit
(no submission: reward 0). The reward is 1 when, after submission, every FAIL_TO_PASS and
PASS_TO_PASS test passes on the allow-listed files copied into a pristine repository (reward.py).

On the tiny demo model the demonstrations mix a reliable path (run the tests, apply the fix the
failing test calls for, submit) with a blind one (a random sed fix, submit), so the warm-started
policy is right mostly when it looks first: RL raises the reward by shifting mass onto ``run_tests``.
"""

from __future__ import annotations

import os
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from openai.types.chat import ChatCompletionMessageParam

from tether.examples import harness
from tether.examples.coding import repos, reward
from tether.examples.coding.workspace import Workspace

SUBMIT = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
TEST_COMMAND = "run_tests"
SYSTEM = (
    "you fix a bug in a python repository . reply with exactly one bash command in a ```bash block . "
    f"the tests are hidden : the command {TEST_COMMAND} runs them . "
    f"to submit , run echo {SUBMIT}"
)
FORMAT_ERROR = "format error : reply with exactly one ```bash block"

# Limits of one episode (the guards against endless turns, hangs and floods of output).
MAX_TURNS = 8
COMMAND_TIMEOUT_S = 5.0
OUTPUT_CHARS = 600  # per observation
CONTEXT_CHARS = 8000  # the whole conversation; beyond it the episode ends unsubmitted
EPISODE_TIMEOUT_S = 120.0
# Tokens per reply: enough for one command; a stronger model that thinks aloud wants more.
MAX_TOKENS_ENV = "CODING_MAX_TOKENS"
MAX_TOKENS = 24

_BLOCK = re.compile(r"```bash\s+(.*?)\s*```", re.DOTALL)


def task_message(task: dict) -> str:
    return f"the tests of {repos.MODULE} fail . fix the bug ."


def parse_command(reply: str) -> str | None:
    """The command of a reply with exactly one ```bash block, else None."""
    blocks = _BLOCK.findall(reply)
    return blocks[0] if len(blocks) == 1 and blocks[0].strip() else None


def observation(returncode: int, output: str, timed_out: bool = False, truncated: bool = False) -> str:
    lines = [f"exit {returncode}"]
    if output.strip():
        lines.append(output.strip())
    if timed_out:
        lines.append("timeout")
    if truncated:
        lines.append("output truncated")
    return "\n".join(lines)


def fix_command(fix: str) -> str:
    return f"sed -i '{fix}' {repos.MODULE}"


def _reply(command: str) -> str:
    return f"```bash\n{command}\n```"


def report_text(repo: repos.Repo, passed: dict[str, bool]) -> str:
    """PASSED or FAILED per hidden test, the failing ones first (where a reader looks)."""
    order = sorted(repo.tests, key=lambda t: passed[t.name])
    return "\n".join(f"{'PASSED' if passed[t.name] else 'FAILED'} {t.name}" for t in order)


@dataclass
class Episode:
    reward: float
    submitted: bool
    turns: int
    end: str  # submitted, turns, context, time
    messages: list[dict] = field(default_factory=list)
    passed: dict[str, bool] = field(default_factory=dict)


Policy = Callable[[list[ChatCompletionMessageParam]], str]


def run_episode(
    task: dict,
    policy: Policy,
    max_turns: int = MAX_TURNS,
    command_timeout_s: float = COMMAND_TIMEOUT_S,
    output_chars: int = OUTPUT_CHARS,
    context_chars: int = CONTEXT_CHARS,
    episode_timeout_s: float = EPISODE_TIMEOUT_S,
) -> Episode:
    """One episode of `policy` (messages -> reply text) on `task`'s repository, scored."""
    repo = repos.build(task)
    messages: list[ChatCompletionMessageParam] = opening(task)
    deadline = time.monotonic() + episode_timeout_s
    end = "turns"
    submitted = False
    turns = 0
    with Workspace(repo, command_timeout_s, output_chars) as ws:
        while turns < max_turns:
            if time.monotonic() > deadline:
                end = "time"
                break
            reply = policy(messages)
            turns += 1
            messages.append({"role": "assistant", "content": reply})
            command = parse_command(reply)
            if command is None:
                obs = FORMAT_ERROR
            elif command.strip() == TEST_COMMAND:
                passed = ws.passed()
                obs = observation(0 if all(passed.values()) else 1, report_text(repo, passed))
            elif command.strip() == f"echo {SUBMIT}":  # the plain submission needs no sandbox
                submitted, end = True, "submitted"
                break
            else:
                result = ws.run(command)
                if result.output.lstrip().startswith(SUBMIT):
                    submitted, end = True, "submitted"
                    break
                obs = observation(result.returncode, result.output, result.timed_out, result.truncated)
            messages.append({"role": "user", "content": obs})
            if sum(len(str(m["content"])) for m in messages) > context_chars:
                end = "context"
                break
        passed = ws.passed() if submitted else {}
    score = reward.score(submitted, passed, repo.fail_to_pass, repo.pass_to_pass)
    return Episode(score, submitted, turns, end, [dict(m) for m in messages], passed)


def rollout(task: dict, base_url: str, api_key: str, model: str) -> float:
    """Run one episode against an OpenAI-compatible endpoint and return its reward (1.0 or 0.0)."""
    client = harness.client(base_url, api_key)
    max_tokens = int(os.environ.get(MAX_TOKENS_ENV) or MAX_TOKENS)

    def policy(messages: list[ChatCompletionMessageParam]) -> str:
        completion = client.chat.completions.create(
            model=model, messages=messages, temperature=1.0, max_tokens=max_tokens
        )
        return completion.choices[0].message.content or ""

    return run_episode(task, policy).reward


def tasks(n: int | None = None, seed: int = 0) -> list[dict]:
    """Every generated repository (repos.all_tasks), or n of them sampled without replacement."""
    return harness.pick(repos.all_tasks(), n, seed)


FIXES: tuple[str, ...] = tuple(sorted({f.fix for f in repos.FUNCTIONS}))


def demonstrations(n: int = 2000, seed: int = 0, test_fraction: float = 0.3) -> list[list[dict]]:
    """n conversations shaped like the agent's, round(n * test_fraction) of them running the tests first.

    Those read the failing test and apply its function's fix; the others apply a random fix blind, so
    the warm-started policy learns that only looking first is reliable.
    """
    rng = random.Random(seed)
    pool = tasks()
    kinds = harness.mix(n, test_fraction, rng, "test_fraction")
    conversations: list[list[dict]] = []
    for runs_tests in kinds:
        task = rng.choice(pool)
        repo = repos.build(task)
        messages = opening(task)
        if runs_tests:
            failing = {t.name: t.name not in repo.fail_to_pass for t in repo.tests}
            messages += [
                {"role": "assistant", "content": _reply(TEST_COMMAND)},
                {"role": "user", "content": observation(1, report_text(repo, failing))},
            ]
            fix = repo.fix
        else:
            fix = rng.choice(FIXES)
        messages += [
            {"role": "assistant", "content": _reply(fix_command(fix))},
            {"role": "user", "content": observation(0, "")},
            {"role": "assistant", "content": _reply(f"echo {SUBMIT}")},
        ]
        conversations.append(messages)
    return conversations


def _words() -> list[str]:
    texts = [SYSTEM, FORMAT_ERROR, task_message({}), "exit 0 1 2 124 126 127 timeout output truncated"]
    texts += ["PASSED FAILED", " ".join(f"test_{f.name}" for f in repos.FUNCTIONS)]
    texts += [_reply(fix_command(fix)) for fix in FIXES]
    texts += [_reply(c) for c in (TEST_COMMAND, f"echo {SUBMIT}", f"cat {repos.MODULE}", "ls")]
    texts += [f.source(buggy) for f in repos.FUNCTIONS for buggy in (False, True)]
    seen: dict[str, None] = {}
    for text in texts:
        seen.update(dict.fromkeys(text.split()))
    return list(seen)


def opening(task: dict) -> list[Any]:
    """The system and task messages every episode starts with."""
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task_message(task)}]


def reads_the_report(model: Any, tokenizer: Any, picked: list[dict]) -> float:
    """How well a policy reads the test report: its mean teacher-forced probability, over the `picked`
    tasks, of applying the failing function's fix right after running the tests. RL's lever here (run
    the tests first) pays only as far as this does."""
    from tether.demo.warmstart import reply_probability  # torch: only where a model is scored

    scores = []
    for task in picked:
        repo = repos.build(task)
        report = report_text(repo, {t.name: t.name not in repo.fail_to_pass for t in repo.tests})
        conversation = [
            *opening(task),
            {"role": "assistant", "content": _reply(TEST_COMMAND)},
            {"role": "user", "content": observation(1, report)},
            {"role": "assistant", "content": _reply(fix_command(repo.fix))},
        ]
        scores.append(reply_probability(model, tokenizer, conversation))
    return sum(scores) / len(scores)


def warm_start_check(model: Any, tokenizer: Any, seed: int) -> float:
    """What the warm start trains until (WARM_START["until"]): reading the report, over every task (a
    sample of 24 read 0.95 where all 148 read 0.90: seed 3)."""
    return reads_the_report(model, tokenizer, tasks())


VOCAB: list[str] = _words()
DEMONSTRATIONS = 2000
# 600 steps, then 200 more at a time (at most 4 times) until warm_start_check reaches 0.95. A step count
# alone gave a model that reads the report at 0.95-0.99 (seeds 0-4) where it was written, 0.89 (seed 0) on
# another machine, and 0.79 here with scalar kernels (ATEN_CPU_CAPABILITY=default): trained to the
# property, every machine's model has it.
WARM_START: dict[str, float] = {"steps": 600, "lr": 3e-3, "until": 0.95, "more_steps": 200, "max_rounds": 4}
# Dynamic sampling on (issue 27, docs/trainer.md "Defaults, measured"): without it every seed collapsed
# once near saturation (steps trained on 1-3 unsolved groups at the full learning rate).
DEMO: dict[str, int | float] = {
    "steps": 60,
    "tasks_per_step": 8,
    "group_size": 8,
    "eval_repeats": 1,
    "dynamic_sampling": True,
}
