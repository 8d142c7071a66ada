"""The launcher's runs (tether.launcher_runs; docs/runs.md, "Starting a run's services"): the pure
decisions (what to do with a run, when a drain is over, how much LoRA room vLLM gets), `tether demo
--runs`' argument handling and run configs, the stack's check_alive failing a run alone, and real
processes: a run whose service gives up is failed and drained while the other run goes on serving, its
agent worker holding a key of its own run, and a stopped run drained and marked stopped."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import pytest
from stack_helpers import wait_for

from tether.cli import build_parser
from tether.cli.demo_runs import base_examples, parse_runs, refused_flags, run_config, run_settings, shared_lr
from tether.common import runs as rules
from tether.common.broker import Keys, key_digest
from tether.common.net import free_port
from tether.common.settings import SETTINGS_REFUSED, run_config_problems
from tether.inference.launch import lora_args, lora_capacity, vllm_env
from tether.inference.main import InferenceSettings, command
from tether.launcher import MAX_RESTARTS, Proc, RunProcs, Stack, StackError, lora_serving
from tether.launcher_runs import (
    DRAIN,
    DRAINED,
    DRAINING,
    FORGET,
    MARK_FAILED,
    MARK_RUNNING,
    MARK_STOPPED,
    START,
    UP,
    WAIT,
    Registry,
    RunSupervisor,
    close_on_trainer,
    drain_done,
    on_scheduler_end,
    phase_of,
    run_action,
    write_run_config,
)

CREATED, RUNNING, STOPPING, STOPPED, FAILED = rules.STATUSES


@pytest.mark.parametrize(
    ("status", "phase", "gave_up", "action"),
    [
        # Nothing of the run here.
        (CREATED, None, False, START),
        (RUNNING, None, False, START),  # a launcher started again resumes the run
        (STOPPING, None, False, MARK_STOPPED),  # nothing to drain here
        (STOPPED, None, False, WAIT),
        (FAILED, None, False, WAIT),
        (None, None, False, WAIT),
        # Its services up.
        (CREATED, UP, False, MARK_RUNNING),
        (RUNNING, UP, False, WAIT),
        (RUNNING, UP, True, DRAIN),  # one gave up: the run alone drains
        (CREATED, UP, True, DRAIN),
        (STOPPING, UP, False, DRAIN),  # `tether run stop`
        (FAILED, UP, False, DRAIN),
        (STOPPED, UP, False, DRAIN),
        (None, UP, False, DRAIN),  # gone from the registry
        # Draining: wait for it.
        (STOPPING, DRAINING, False, WAIT),
        (RUNNING, DRAINING, True, WAIT),
        # Drained.
        (STOPPING, DRAINED, False, MARK_STOPPED),
        (RUNNING, DRAINED, True, MARK_FAILED),
        (CREATED, DRAINED, True, MARK_FAILED),
        (STOPPING, DRAINED, True, MARK_FAILED),
        (STOPPED, DRAINED, False, FORGET),
        (FAILED, DRAINED, True, FORGET),
        (None, DRAINED, False, FORGET),
    ],
)
def test_run_action(status, phase, gave_up, action) -> None:
    assert run_action(status, phase, gave_up) == action


def test_every_status_the_supervisor_writes_is_a_transition_the_registry_allows() -> None:
    """What run_action marks, from the status it marks it in, never breaks the registry's rules."""
    writes = {MARK_RUNNING: RUNNING, MARK_STOPPED: STOPPED, MARK_FAILED: FAILED}
    for status in (*rules.STATUSES, None):
        for phase in (None, UP, DRAINING, DRAINED):
            for gave_up in (False, True):
                action = run_action(status, phase, gave_up)
                if action in writes:
                    assert status is not None
                    assert rules.next_status("r", status, writes[action]) == writes[action]


def test_phase_of() -> None:
    procs = RunProcs("a", "t.run.a")
    assert phase_of(None) is None and phase_of(procs) == UP
    procs.drain_deadline = 1.0
    assert phase_of(procs) == DRAINING
    procs.drained = True
    assert phase_of(procs) == DRAINED


def test_a_scheduler_through_with_its_run_stops_or_fails_it() -> None:
    assert on_scheduler_end("done") == on_scheduler_end("stopped") == rules.STOPPING
    assert on_scheduler_end("error") == rules.FAILED
    for working in (None, "starting", "rolling_out", "training", "pushing", "evaluating", "serving"):
        assert on_scheduler_end(working) is None


def test_drain_done() -> None:
    assert drain_done(0, 5.0, 10.0) is True
    assert drain_done(2, 5.0, 10.0) is None
    assert drain_done(2, 10.0, 10.0) is False  # past the grace: kill what is left


def test_lora_capacity_leaves_room_for_a_swap_and_old_versions() -> None:
    assert lora_capacity(1) == (2, 2)
    assert lora_capacity(2) == (3, 4)
    with pytest.raises(ValueError):
        lora_capacity(0)
    assert lora_args(0) == []


def test_lora_serving_sets_the_runs_and_the_rank_on_both_services(monkeypatch) -> None:
    monkeypatch.delenv("TETHER_LORA_RANK", raising=False)
    env = lora_serving(2)
    assert env == {
        "inference": {"TETHER_MAX_RUNS": "2", "TETHER_LORA_RANK": "8"},
        "trainer": {"TETHER_LORA_RANK": "8"},
    }
    monkeypatch.setenv("TETHER_LORA_RANK", "16")
    assert lora_serving(1)["trainer"] == {"TETHER_LORA_RANK": "16"}
    with pytest.raises(StackError):
        lora_serving(0)


def test_the_inference_service_serves_runs_after_the_users_vllm_flags(tmp_path, monkeypatch) -> None:
    """TETHER_MAX_RUNS is all a deployment sets (compose, the chart, the launcher): the vLLM command gets
    LoRA on with room for the runs, after the user's flags, and vLLM runtime loading."""
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    base = {"inference_grpc_port": 1, "model_dir": str(tmp_path), "vllm_python": "python"}
    s = InferenceSettings(**base, max_runs=2, lora_rank=16, vllm_extra_args="--max-num-seqs 8")
    argv = command(s)
    assert argv[-9:] == [
        "--max-num-seqs", "8", "--enable-lora", "--max-loras", "3", "--max-cpu-loras", "4", "--max-lora-rank", "16",
    ]  # fmt: skip
    assert command(InferenceSettings(**base, max_runs=1))[-2:] == ["--max-lora-rank", "8"]  # the default
    assert "--enable-lora" not in command(InferenceSettings(**base, lora_rank=16))  # one policy: no LoRA
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    assert vllm_env(lora=True)["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in vllm_env()


def _demo_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["demo", *argv])


def test_parse_runs() -> None:
    assert parse_runs("calculator,instruction") == ["calculator", "instruction"]
    assert parse_runs(" calculator , calculator,") == ["calculator"]
    with pytest.raises(ValueError, match="at least one"):
        parse_runs(" , ")
    with pytest.raises(ValueError, match="unknown example 'nope'"):
        parse_runs("calculator,nope")


def test_the_base_model_is_the_runs_own_unless_named_and_must_know_every_run(capsys) -> None:
    assert base_examples(None, ["instruction", "calculator"]) == ["instruction", "calculator"]
    assert base_examples("calculator,instruction", ["calculator"]) == ["calculator", "instruction"]
    with pytest.raises(ValueError, match="instruction is not among them"):
        base_examples("calculator", ["calculator", "instruction"])
    with pytest.raises(ValueError, match="unknown example 'nope'"):
        base_examples("calculator,nope", ["calculator"])
    # Refused before anything starts: exit 2, with the reason.
    args = _demo_args("--runs", "calculator,instruction", "--base-model", "calculator")
    assert args.fn(args) == 2
    assert "instruction is not among them" in capsys.readouterr().err
    args = _demo_args("--example", "calculator", "--base-model", "calculator,instruction")
    assert args.fn(args) == 2
    assert "give --runs too" in capsys.readouterr().err


def test_flags_without_meaning_for_runs_are_refused(capsys) -> None:
    args = _demo_args("--runs", "calculator", "--example", "instruction", "--sleep-level", "0")
    assert [why.split()[0] for why in refused_flags(args)] == ["--example", "--sleep-level"]
    assert args.fn(args) == 2
    err = capsys.readouterr().err
    assert "with --runs, these flags have no meaning: --example" in err and "--sleep-level" in err
    assert refused_flags(_demo_args("--runs", "calculator", "--steps", "3")) == []


def test_each_run_takes_its_examples_demo_settings_and_flags_win() -> None:
    settings = run_settings(
        _demo_args("--runs", "calculator,instruction", "--steps", "3"), ["calculator", "instruction"]
    )
    assert settings["calculator"]["steps"] == settings["instruction"]["steps"] == 3
    assert settings["instruction"]["eval_repeats"] == 1  # instruction's DEMO
    assert settings["calculator"]["eval_repeats"] == 4  # the demo default


def test_the_runs_share_one_learning_rate() -> None:
    same = {"a": {"lr": 5e-4}, "b": {"lr": 5e-4}}
    assert shared_lr(same, None) == 5e-4
    differ = {"a": {"lr": 5e-4}, "b": {"lr": 1e-3}}
    with pytest.raises(ValueError, match="give --lr"):
        shared_lr(differ, None)
    assert shared_lr(differ, 2e-4) == 2e-4


def test_a_runs_config_passes_every_services_check(tmp_path) -> None:
    """The config `tether demo --runs` creates each run with: a run config's shape for the registry,
    and every service's settings accept it (what `tether run create` checks)."""
    from tether.runconfig import check

    args = _demo_args("--runs", "instruction", "--steps", "3")
    args.mode, args.max_staleness, args.seed = "colocated-sync", 1, 0
    cfg = run_settings(args, ["instruction"])["instruction"]
    config = run_config("instruction", cfg, args, tmp_path / "tasks.jsonl", ["tensorboard"])
    assert run_config_problems(config) == []
    assert config["agent"]["agent_fn"] == "tether.examples.instruction.agent:rollout"
    assert config["scheduler"]["steps"] == 3 and config["scheduler"]["tasks_file"] == str(
        tmp_path / "tasks.jsonl"
    )
    assert check(str(write_run_config(tmp_path / "run", config))) == []


def _proc(run: str, code: int, tmp_path: Path, name: str) -> Proc:
    cmd = [sys.executable, "-c", f"raise SystemExit({code})"]
    proc = Proc(name, lambda: subprocess.Popen(cmd), tmp_path / f"{name}.log", run=run)
    proc.popen.wait(30)
    return proc


def test_a_runs_process_that_gives_up_fails_its_run_not_the_stack(tmp_path) -> None:
    stack = Stack(run_dir=tmp_path, state_file=None)
    stack.runs["a"] = RunProcs("a", "t.run.a")
    refused = _proc("a", SETTINGS_REFUSED, tmp_path, "a/scheduler")
    spent = _proc("a", 1, tmp_path, "a/merger")
    spent.restarts = MAX_RESTARTS
    stack.procs += [refused, spent]
    stack.runs["a"].procs += [refused, spent]
    stack.check_alive()  # no StackError
    assert "a/scheduler exited with code 2" in stack.runs["a"].gave_up
    # The stack's own process that gives up is still the whole stack's failure.
    stack.procs.append(_proc("", SETTINGS_REFUSED, tmp_path, "trainer"))
    with pytest.raises(StackError, match="trainer exited with code 2"):
        stack.check_alive()


def test_a_draining_runs_processes_are_not_restarted(tmp_path) -> None:
    stack = Stack(run_dir=tmp_path, state_file=None)
    stack.runs["a"] = RunProcs("a", "t.run.a", drain_deadline=time.monotonic() + 10)
    proc = _proc("a", 1, tmp_path, "a/merger")
    stack.procs.append(proc)
    stack.runs["a"].procs.append(proc)
    first = proc.popen
    stack.check_alive()
    assert proc.popen is first and proc.restarts == 0


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def test_a_run_whose_service_gives_up_fails_alone_and_a_stopped_run_drains(
    tmp_path, redis_port, rdb, monkeypatch
) -> None:
    """Real processes: two runs' mergers, schedulers and (for one) an agent worker on a stack with
    nothing behind its trainer and inference addresses (the schedulers wait for inference, serving
    meanwhile). Both runs' services start before the launcher waits for any of them to serve. Run
    `bad`'s config has a setting a run's scheduler refuses: it is drained and `failed`, and run `good`
    stays `running`, its processes untouched; its agent worker holds a key of its own run (in its
    environment only); then `good` is stopped, drained and `stopped`."""
    import tether.launcher_runs as launcher_runs

    started_when_first_asked: list[set[str]] = []  # the runs with processes when `serving` was first asked
    real_serving = launcher_runs.serving

    def serving(address: str) -> bool:
        if not started_when_first_asked:
            started_when_first_asked.append({p.run for p in stack.procs})
        return real_serving(address)

    monkeypatch.setattr(launcher_runs, "serving", serving)
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    stack = Stack(run_dir=tmp_path, namespace="sup", state_file=None, redis_url=redis_url)
    dead = "127.0.0.1:9"  # nothing answers there
    stack.addresses = {
        "trainer": dead,
        "inference": dead,
        "gateway_grpc": dead,
        "gateway_url": "http://127.0.0.1:9",
    }
    stack.model_dir = ""  # the merger strips no generation-prompt tail (no tokenizer to read)
    registry = Registry(redis_url, "sup")
    supervisor = RunSupervisor(stack, registry, health_timeout_s=120, drain_grace_s=20)
    try:
        supervisor.create("good", {"agent": {"agent_fn": "tether.examples.calculator.agent:rollout"}})
        supervisor.create("bad", {"scheduler": {"sleep_level": 1}})  # refused for a run: status 2

        def statuses() -> dict[str, str]:
            stack.check_alive()
            supervisor.tick()
            return {r.run_id: r.status for r in registry.list()}

        wait_for(lambda: statuses() == {"good": RUNNING, "bad": FAILED}, 180, "good running, bad failed")
        assert started_when_first_asked == [{"good", "bad"}]  # started side by side, then waited for
        assert "bad" not in stack.runs or stack.runs["bad"].drained
        assert all(p.run != "bad" for p in stack.procs)
        good = stack.runs["good"]
        assert not good.gave_up and len(good.alive()) == 3
        assert sorted(p.name for p in good.procs) == ["good/agent-0", "good/merger", "good/scheduler"]
        assert (tmp_path / "logs" / "good" / "scheduler.log").exists()
        assert "refusing to start" in (tmp_path / "logs" / "bad" / "scheduler.log").read_text()

        agent = next(p for p in good.procs if p.name == "good/agent-0")
        env = _environ(agent.popen.pid)
        assert env["TETHER_NAMESPACE"] == "sup.run.good"
        key = env["TETHER_RUN_KEY"]
        assert key.startswith("trk-") and rdb.get(Keys("sup").run_key(key_digest(key))) == "good"
        for log in (tmp_path / "logs").rglob("*.log"):
            assert key not in log.read_text()

        registry.stop("good")
        wait_for(lambda: statuses()["good"] == STOPPED, 60, "good stopped")
        assert all(p.popen.poll() is not None for p in good.procs)
        assert stack.procs == []
        statuses()
        assert stack.runs == {}  # both final and drained: forgotten
    finally:
        stack.stop(grace_s=10)
        registry.close()


def test_closing_a_run_on_a_trainer_that_is_not_there_says_so_and_goes_on() -> None:
    said = close_on_trainer(f"127.0.0.1:{free_port()}", "calc", timeout_s=2.0)
    assert said.startswith("not closed on the trainer (UNAVAILABLE")


def test_the_joint_warm_start_trains_each_example_as_much_as_its_own() -> None:
    """`tether demo --runs`' base model: each example's demonstrations as many times as its own warm
    start draws (steps x batch), so one epoch of the list in the steps' sum gives each its own share;
    the calculator's and instruction's real settings: 300 and 1,500 steps of 32."""
    from collections import Counter

    from tether.cli.examples import joint_demonstrations, load_example

    calc, instr = load_example("calculator"), load_example("instruction")
    assert (calc["WARM_START"]["steps"], instr["WARM_START"]["steps"]) == (300, 1500)
    a, b = [("a", i) for i in range(2000)], [("b", i) for i in range(3000)]
    got = joint_demonstrations([(a, 300), (b, 1500)], 32)
    per = Counter(x[0] for x in got)
    assert per == {"a": 300 * 32, "b": 1500 * 32}  # 1:5, as their own warm starts (not 2:3, as their lists)
    assert len(got) == (300 + 1500) * 32  # one epoch in the joint run's 1,800 steps
    # Every demonstration is used, each as evenly as the count allows.
    counts = Counter(got)
    assert {counts[x] for x in a} == {4, 5} and {counts[x] for x in b} == {16}
    with pytest.raises(ValueError, match="without demonstrations"):
        joint_demonstrations([([], 10)], 32)
