"""The run state (tether.common.records.RunState) in Redis: a strict decoder (a renamed, unknown, missing
or mistyped field is an error, never a default), the representation the scheduler has always written (a
hash of JSON values, so a run saved before this record existed resumes), and a scheduler started again
on a real Redis picking the run up exactly: same step, same groups, vLLM woken, nothing trained twice.
(The same end to end, with kill -9 and real services: tests/test_scheduler_resume.py, slow.)"""

from __future__ import annotations

import json
import math

import grpc
import pytest
from fake_control import FakeGateway, FakeInference, FakeTrainer, rpc_error

from tether.cli.stack import run_status
from tether.common import broker
from tether.common.records import PendingStep, RunState
from tether.scheduler.run import Run, RunConfig, Stubs
from tether.scheduler.servicer import SchedulerServicer
from tether.v1 import trainer_pb2


def _group_result(group_id: str, outcome: str, rewards: list[float], samples: int, tokens: int) -> dict:
    """A group result as the merger publishes it (tether.common.records.GroupResult: every field)."""
    counts = dict.fromkeys(["forks", "single_sequence_rollouts", "realigns", "truncated"], 0)
    counts |= dict.fromkeys(["mismatched_calls", "side_sequences_excluded"], 0)
    return {
        "group_id": group_id,
        "rollouts": 2,
        "completed": 2,
        "rewards": rewards,
        "eval": False,
        "sequences": 2,
        **counts,
        "generated_tokens": tokens,
        "dropped_calls": {},
        "mismatches": [],
        "timed_out": False,
        "finished_at": 1700000000.0,
        "estimator": "grpo",
        "outcome": outcome,
        "samples": samples,
        "tokens": tokens,
        "min_weight_version": 2 if samples else -1,
    }


RESULTS = [
    _group_result("r-s2-g0", "trained", [1.0, 0.0], 2, 40),
    _group_result("r-s2-g1", "filtered", [1.0, 1.0], 0, 0),
]

# Step 1's record, as the scheduler writes it (tether.common.records.StepMetrics).
LAST_RECORD = {
    "step": 1,
    "weight_version": 2,
    "reward_mean": 0.5,
    **dict.fromkeys(["rollouts", "groups_trained", "groups_filtered", "samples", "tokens"], 2.0),
    **dict.fromkeys(["generated_tokens", "forks", "sequences_per_rollout", "logprob_abs_diff"], 1.0),
    **dict.fromkeys(["constrained_tokens_masked", "push_seconds", "paused_seconds", "step_seconds"], 0.0),
    "time": 1700000000.0,
}

# The run hash exactly as the scheduler wrote it before RunState existed (a colocated-sync run killed
# while step 2 trained, vLLM asleep): one field per key, each value JSON.
OLD_HASH = {
    k: json.dumps(v)
    for k, v in {
        "status": "training",
        "step": 2,
        "weight_version": 2,
        "reward_mean": 0.5,
        "run_id": "r",
        "total_steps": 4,
        "run_dir": "/runs/r",
        "next_step": 2,
        "mode": "colocated-sync",
        "results_cursor": "1700000000000-0",
        "checkpoint_dir": "/ckpt/v2",
        "slept": True,
        "last_record": LAST_RECORD,
        "pending": {
            "step": 2,
            "take": ["r-s2-g0"],
            "drop": [],
            "results": RESULTS,
            "version_before": 2,
            "rollout_s": 1.5,
            "extra": {},
        },
    }.items()
}


def test_the_hash_the_scheduler_always_wrote_decodes():
    state = RunState.from_redis(OLD_HASH)
    assert (state.run_id, state.status, state.step, state.next_step, state.weight_version) == (
        "r",
        "training",
        2,
        2,
        2,
    )
    assert state.slept and state.results_cursor == "1700000000000-0"
    assert state.pending == PendingStep(2, ["r-s2-g0"], [], RESULTS, 2, 1.5, {})
    assert RunState.from_redis(state.to_redis()) == state
    # Fields never written read as the scheduler's old `.get(...)` defaults did.
    assert (state.dispatched, state.stale_dropped, state.eval_record, state.error) == (0, 0, None, "")


@pytest.mark.parametrize(
    "change, error",
    [
        # a rename must fail, not switch a field off
        ({"weight_verison": "2"}, r"RunState record: unknown field\(s\) \['weight_verison'\]"),
        ({"run_id": None}, r"RunState record: missing required field\(s\) \['run_id'\]"),
        ({"next_step": None}, r"RunState record: missing required field\(s\) \['next_step'\]"),
        ({"step": '"2"'}, "RunState record: field 'step'"),
        ({"slept": "1"}, "RunState record: field 'slept'"),
        ({"reward_mean": "true"}, "RunState record: field 'reward_mean'"),
        ({"pending": '{"step": 2, "take": []}'}, r"field 'pending': missing required field\(s\)"),
        (
            {"pending": json.dumps({**json.loads(OLD_HASH["pending"]), "tkae": []})},
            r"field 'pending': unknown field\(s\) \['tkae'\]",
        ),
        ({"pending": "[]"}, "RunState record: field 'pending'"),
    ],
)
def test_the_decoder_is_strict(change, error):
    raw = {k: v for k, v in {**OLD_HASH, **change}.items() if v is not None}
    with pytest.raises(ValueError, match=error):
        RunState.from_redis(raw)


def test_numbers_keep_their_type():
    state = RunState.from_redis({**OLD_HASH, "reward_mean": "1", "eval_reward": "NaN"})
    assert isinstance(state.reward_mean, float) and math.isnan(state.eval_reward)


def _run(r, tmp_path, inference, trainer, gateway, **cfg) -> Run:
    config = RunConfig(
        run_id="r", steps=4, tasks_per_step=2, group_size=2, seed=0, run_dir=tmp_path, sleep_level=1, **cfg
    )
    return Run(r, broker.Keys("t"), config, Stubs(gateway, inference, trainer), [{"task_id": "t"}])


async def test_a_restarted_scheduler_finishes_the_pending_step_exactly(redis_url, tmp_path):
    r = broker.connect(redis_url)
    keys = broker.Keys("t")
    try:
        # Before the restart: step 2's groups were written down, vLLM put to sleep, the trainer trained
        # it (version 3), and the scheduler died before the push. Inference still serves version 2.
        await r.hset(keys.run, mapping={**OLD_HASH, "run_dir": json.dumps(str(tmp_path))})
        inference = FakeInference(2, "/ckpt/v2")
        inference.asleep = True
        trainer = FakeTrainer(inference, 2, "/ckpt/v2")
        await trainer.TrainStep(trainer_pb2.TrainStepRequest(step=2, group_ids=["r-s2-g0"]))
        gateway = FakeGateway()
        run = _run(r, tmp_path, inference, trainer, gateway)

        assert await run.start_run() == 2
        # Woken, then brought to the trainer's newest weights; admission resumed with that version.
        assert inference.log[:3] == ["wake", "version", "load:/ckpt/v3:3"] and not inference.asleep
        assert gateway.log == ["resume:3"] and run.state.weight_version == 3 and not run.state.slept
        assert run.state.pending == PendingStep(2, ["r-s2-g0"], [], RESULTS, 2, 1.5, {})

        assert await run.resume_pending(2, colocated=True)
        # The same step number and groups: the trainer answers from its record, nothing trains twice.
        assert trainer.log.count("train:2:r-s2-g0") == 2 and trainer.version == 3
        # Step 1's record, saved but not yet in metrics.jsonl when the scheduler died, came first.
        reported = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in reported] == [1, 2]
        record = reported[-1]
        assert (record["step"], record["weight_version"], record["groups_trained"]) == (2, 3, 1)
        assert record["groups_filtered"] == 1 and record["weight_push"] == "checkpoint"

        saved = RunState.from_redis(await r.hgetall(keys.run))
        assert saved.to_redis() == run.state.to_redis()  # (as JSON: a record holds NaNs)
        assert (saved.next_step, saved.pending, saved.last_record["step"]) == (3, None, 2)
        assert not await run.resume_pending(3, colocated=True)  # nothing left to finish
    finally:
        await r.aclose()


async def test_a_new_run_id_starts_afresh_and_every_reader_sees_the_state(redis_url, tmp_path):
    r = broker.connect(redis_url)
    keys = broker.Keys("t")
    try:
        await r.hset(keys.run, mapping={**OLD_HASH, "run_id": json.dumps("an-earlier-run")})
        await r.hset(keys.run_inflight, "g", "{}")
        inference = FakeInference()
        run = _run(r, tmp_path, inference, FakeTrainer(inference), FakeGateway())
        assert await run.start_run() == 0
        assert inference.log == ["version", "resume"]  # nothing to wake, nothing trained to load
        assert not await r.exists(keys.run_inflight)
        raw = await r.hgetall(keys.run)
        # The first write of a run holds every field, so the state always decodes.
        assert set(raw) == set(run.state.to_redis())
        assert {"run_id", "total_steps", "weight_version", "run_dir", "next_step", "mode"} <= set(raw)
        assert RunState.from_redis(raw).run_id == "r"

        await run.save_state(status="rolling_out", step=1, reward_mean=float("nan"))
        with pytest.raises(TypeError):
            await run.save_state(stauts="done")  # a misspelt field is refused, not written
        state = run_status(redis_url, "t")
        assert (state.status, state.step, state.total_steps) == ("rolling_out", 1, 4)
        assert run_status(redis_url, "elsewhere") is None
        answer = SchedulerServicer(run)._state()
        assert (answer.status, answer.step, answer.total_steps, answer.reward_mean) == (
            "rolling_out",
            1,
            4,
            0.0,
        )
        plain = broker.connect_sync(redis_url)
        assert not plain.hexists(keys.run, "stauts")
        plain.close()
    finally:
        await r.aclose()


class InferenceDownAtStart(FakeInference):
    """An adapter whose vLLM does not answer yet: GetWeightVersion fails as the real one does
    (UNKNOWN, from the HTTP error under it) until `up` is set."""

    up = False

    async def GetWeightVersion(self, req):
        if not self.up:
            raise rpc_error(grpc.StatusCode.UNKNOWN, "Unexpected <class 'httpx.ConnectError'>")
        return await super().GetWeightVersion(req)


async def test_a_run_failing_before_its_first_save_leaves_a_state_a_restart_resumes(redis_url, tmp_path):
    """docker compose started the scheduler while vLLM was still down: its first call failed before the
    run's first save, and the error save wrote `status`/`error` alone, a hash no restart could decode
    (each restarted scheduler died on it again). The first save of a run writes every field."""
    r = broker.connect(redis_url)
    keys = broker.Keys("t")
    try:
        inference = InferenceDownAtStart()
        run = _run(r, tmp_path, inference, FakeTrainer(inference), FakeGateway())
        with pytest.raises(grpc.aio.AioRpcError):
            await run.run()
        saved = RunState.from_redis(await r.hgetall(keys.run))
        assert (saved.run_id, saved.status, saved.next_step) == ("r", "error", 0)
        assert "ConnectError" in saved.error
        # The supervisor starts it again once vLLM answers: it picks the run up.
        inference.up = True
        again = _run(r, tmp_path, inference, FakeTrainer(inference), FakeGateway())
        assert await again.start_run() == 0
        assert RunState.from_redis(await r.hgetall(keys.run)).run_id == "r"
    finally:
        await r.aclose()
