"""The scheduler's run-overview gauges (tether.scheduler.metrics): set from each step's StepMetrics record
(NaN for a figure the step did not measure, never an earlier step's), the phase following the run state
through a real run (real Redis; the gRPC peers are tests/fake_control.py's stand-ins, a responder plays
the merger), the weight version the scheduler exports, and a restarted scheduler showing the last step
at once."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import numpy as np
import pytest
from fake_control import FakeGateway, FakeInference, FakeTrainer
from prometheus_client import REGISTRY
from test_scheduler_state import LAST_RECORD, _group_result

from tether.common import broker
from tether.common.grpc_server import cancel_until_done
from tether.common.records import DispatchJob, StepMetrics
from tether.scheduler import metrics as m
from tether.scheduler.run import VERSION, Run, RunConfig, Stubs


def _gauge(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


def _phase() -> list[str]:
    """The phases whose gauge is 1 (exactly one while the gauges tell the truth)."""
    return [p for p in m.PHASES if _gauge("tether_run_phase", phase=p) == 1.0]


def test_a_step_record_sets_every_run_gauge_and_unmeasured_ones_are_nan():
    record = StepMetrics.from_dict(
        {
            **LAST_RECORD,
            "reward_mean": 0.75,
            "step_seconds": 12.5,
            "push_seconds": 0.4,
            "paused_seconds": 1.5,
            "staleness_max": 1.0,
            "staleness_mean": 0.5,
            "token_staleness_max": 2.0,
            "token_staleness_mean": 0.25,
            "logprob_abs_diff": 0.003,
            "logprob_k3_kl": 0.0001,
            "sequences_per_rollout": 1.25,
            "forks": 3.0,
            "groups_in_flight": 6.0,
            "tokens_per_s": 800.0,
        }
    )
    m.export_step(record)
    for name in m.STEP_FIELDS:
        value = getattr(record, name)
        got = _gauge(f"tether_run_{m.GAUGE_NAMES.get(name, name)}")
        assert got is not None, name
        if value is None or math.isnan(value):
            assert math.isnan(got), name
        else:
            assert got == value, name
    assert _gauge("tether_run_reward_mean") == 0.75 and _gauge("tether_run_groups_in_flight") == 6.0
    assert _gauge("tether_run_tokens_per_second") == 800.0

    # The next step measured no staleness and no mismatch (serve mode): NaN, not the step before's.
    later = StepMetrics.from_dict({**LAST_RECORD, "step": 2, "logprob_abs_diff": float("nan")})
    m.export_step(later)
    for name in ("staleness_max", "token_staleness_mean", "logprob_abs_diff", "groups_in_flight"):
        assert math.isnan(_gauge(f"tether_run_{name}")), name
    assert _gauge("tether_run_reward_mean") == 0.5 and _gauge("tether_run_forks") == 1.0


def test_a_step_record_carries_learning_health_and_counts_steps_that_trained_nothing():
    from tether.common.records import GroupResult
    from tether.scheduler.report import LEARNING_HEALTH, step_record

    def record(results: list[dict], metrics: dict, previous: dict | None) -> dict:
        timing = {"rollout_seconds": 1.0, "push_seconds": 0.1, "paused_seconds": 0.0, "step_seconds": 2.0}
        groups = [GroupResult.from_dict(g) for g in results]
        return step_record(3, 2, groups, metrics, timing, 1, "checkpoint", "colocated-sync", 1.0, previous)

    health = {k: 0.1 * (i + 1) for i, k in enumerate(LEARNING_HEALTH)}
    trained = record(
        [
            _group_result("a", "trained", [1.0, 0.0], 2, 10),
            _group_result("b", "filtered", [1.0, 1.0], 0, 0),
            _group_result("c", "filtered", [0.0, 0.0], 0, 0),
            _group_result("d", "trained", [0.5, 0.0], 2, 10),
        ],
        {**health, "step_guard_retries": 1.0},
        {"untrained_steps_in_a_row": 4.0},
    )
    assert trained["zero_variance_fraction"] == 0.5 and trained["groups_filtered_fraction"] == 0.5
    assert trained["group_ids"] == ["a", "b", "c", "d"]
    assert {k: trained[k] for k in LEARNING_HEALTH} == health and trained["step_guard_retries"] == 1.0
    assert trained["untrained_steps_in_a_row"] == 0.0  # it trained: the count starts again
    nothing = [_group_result("e", "filtered", [1.0, 1.0], 0, 0)]
    first = record(nothing, {}, trained)
    assert first["untrained_steps_in_a_row"] == 1.0 and math.isnan(first["policy_kl"])
    assert record(nothing, {}, first)["untrained_steps_in_a_row"] == 2.0
    assert record(nothing, {}, None)["untrained_steps_in_a_row"] == 1.0
    # The record is a StepMetrics, and its new gauges follow it.
    m.export_step(
        StepMetrics.from_dict(
            {**LAST_RECORD, **{k: trained[k] for k in ("zero_variance_fraction", "untrained_steps_in_a_row")}}
        )
    )
    assert (
        _gauge("tether_run_zero_variance_fraction") == 0.5
        and _gauge("tether_run_untrained_steps_in_a_row") == 0.0
    )


def test_a_step_record_carries_its_responses_length_cuts_and_repetition():
    from tether.common.records import GroupResult
    from tether.scheduler.report import RESPONSE_FIGURES, serve_record, step_summary

    def group(
        gid: str, lengths: list[int], cut: int, repetitive: int, outcome: str = "trained"
    ) -> GroupResult:
        return GroupResult.from_dict(
            {
                **_group_result(gid, outcome, [1.0, 0.0], 2, 10),
                "response_lengths": lengths,
                "cut_responses": cut,
                "repetitive_responses": repetitive,
            }
        )

    # Ten responses over two groups, one of them filtered (trained or not, every response counts).
    results = [group("a", [10, 20, 30, 40], 1, 0), group("b", [50, 60, 70, 80, 90, 1000], 2, 1, "filtered")]
    summary = step_summary(results)
    assert summary["response_length_mean"] == 145.0  # 1450 / 10
    assert summary["response_length_p95"] == pytest.approx(590.5)  # rank 8.55 of 0..9: 90 + 0.55 * 910
    assert summary["truncated_fraction"] == 0.3 and summary["repetition_rate"] == 0.1
    # Results from a merger that did not count responses (an older one): not measured, NaN.
    old = GroupResult.from_dict(_group_result("c", "trained", [1.0, 0.0], 2, 10))
    assert all(math.isnan(step_summary([old])[k]) for k in RESPONSE_FIGURES)
    assert step_summary([old, *results])["response_length_mean"] == 145.0
    # Serve mode reports them too, and every one is a field of the checked record and its gauge.
    timing = {"push_seconds": 0.0, "paused_seconds": 0.0, "step_seconds": 1.0}
    served = StepMetrics.from_dict(serve_record(4, 2, results, {}, timing, 1.0))
    m.export_step(served)
    for name in RESPONSE_FIGURES:
        assert getattr(served, name) == summary[name] == _gauge(f"tether_run_{name}"), name


def test_percentile_is_numpys_linear_percentile():
    from tether.scheduler.report import percentile

    rng = np.random.default_rng(0)
    for n in (1, 2, 3, 7, 20, 101):
        values = rng.integers(0, 5000, n).tolist()
        for q in (0, 50, 90, 95, 100):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12), (n, q)
    assert math.isnan(percentile([], 95))


def test_the_phase_gauge_has_one_series_per_status_and_one_at_1():
    for status in m.PHASES:
        m.export_phase(status)
        assert _phase() == [status]
    m.export_phase("something-new")  # a status added later still shows, on its own series
    assert _phase() == [] and _gauge("tether_run_phase", phase="something-new") == 1.0
    m.export_phase("starting")
    assert _gauge("tether_run_phase", phase="something-new") == 0.0


class _Trainer(FakeTrainer):
    """Reports the step's figures as the real trainer does, and which phase the gauge showed while it
    trained."""

    def __init__(self, inference: FakeInference, root: Path) -> None:
        super().__init__(inference)
        self.root = root
        self.phases: list[list[str]] = []

    async def TrainStep(self, req):
        self.phases.append(_phase())
        resp = await super().TrainStep(req)
        ckpt = self.root / f"v{resp.weight_version}"  # a real folder: the run copies the last one
        ckpt.mkdir(parents=True, exist_ok=True)
        self.checkpoint_dir = resp.checkpoint_dir = str(ckpt)
        self.records[req.step] = (resp.weight_version, str(ckpt))
        resp.metrics.update(
            {"logprob_abs_diff": 0.002, "logprob_k3_kl": 0.0004, "loss": -0.1, "token_staleness_max": 0.0}
        )
        return resp


class _Inference(FakeInference):
    def __init__(self) -> None:
        super().__init__()
        self.phases: list[list[str]] = []

    async def LoadWeights(self, req):
        self.phases.append(_phase())
        return await super().LoadWeights(req)


async def _merger(r, keys: broker.Keys, rewards: dict[str, list[float]]) -> None:
    """Answers each dispatched group once with a scored result (trained; eval groups: eval)."""
    cursor, answered = "0-0", set()
    while True:
        resp = await r.xread({keys.dispatch: cursor}, count=100, block=100)
        for _, items in resp or []:
            for eid, fields in items:
                cursor = eid
                job = DispatchJob.from_dict(broker.decode(fields))
                if job.group_id in answered:
                    continue
                answered.add(job.group_id)
                evaluated = bool(job.metadata.get("eval"))
                got = rewards.get(job.task_id, [1.0, 0.0])[: job.group_size]
                result = _group_result(job.group_id, "eval" if evaluated else "trained", got, 4, 40)
                result["min_weight_version"] = 0
                await broker.publish(r, keys.group_results, result)


async def test_a_run_drives_phase_step_and_version_gauges(redis_url, tmp_path):
    r = broker.connect(redis_url)
    keys = broker.Keys("rm")
    inference = _Inference()
    trainer = _Trainer(inference, tmp_path / "ckpt")
    cfg = RunConfig(
        run_id="rm", steps=2, tasks_per_step=1, group_size=2, seed=0, run_dir=tmp_path, eval_repeats=1,
        max_staleness=3,
    )  # fmt: skip
    merger = asyncio.ensure_future(_merger(r, keys, {"t": [1.0, 0.5]}))
    try:
        run = Run(r, keys, cfg, Stubs(FakeGateway(), inference, trainer), [{"task_id": "t"}])
        assert _phase() == ["starting"] and _gauge("tether_run_max_staleness") == 3.0
        await asyncio.wait_for(run.run(), 60)

        assert trainer.phases == [["training"], ["training"]]
        assert inference.phases == [["pushing"], ["pushing"]]
        assert _phase() == ["done"]
        steps = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
        last = steps[1]
        assert last["step"] == 1 and steps[-1]["eval_reward"] == 1.0  # eval groups: one rollout
        assert _gauge("tether_run_reward_mean") == last["reward_mean"] == 0.75
        assert _gauge("tether_run_step_seconds") == last["step_seconds"]
        assert _gauge("tether_run_push_seconds") == last["push_seconds"]
        assert _gauge("tether_run_logprob_abs_diff") == 0.002
        assert _gauge("tether_run_logprob_k3_kl") == 0.0004
        assert _gauge("tether_run_token_staleness_max") == 0.0
        assert _gauge("tether_run_staleness_max") == last["staleness_max"] == 1.0  # version 1, sampled by 0
        assert math.isnan(_gauge("tether_run_groups_in_flight"))  # colocated-sync does not measure it
        assert _gauge("tether_run_eval_reward") == 1.0
        assert _gauge("tether_scheduler_weight_version") == inference.version == 2

        # A new scheduler process (gauges back at their start values) resumes the finished run and
        # shows its last step, evaluation and status before doing anything else.
        for gauge in m.RUN_STEP.values():
            gauge.set(math.nan)
        m.export_eval(None)
        m.export_phase("starting")
        again = Run(r, keys, cfg, Stubs(FakeGateway(), inference, trainer), [{"task_id": "t"}])
        await again.start_run()
        assert _gauge("tether_run_reward_mean") == 0.75 and _gauge("tether_run_eval_reward") == 1.0
        assert _gauge("tether_run_logprob_abs_diff") == 0.002 and _phase() == ["done"]
        assert _gauge("tether_scheduler_weight_version") == 2
    finally:
        await cancel_until_done(merger)
        await r.aclose()


async def test_the_scheduler_version_is_the_reconciled_one_at_start(redis_url, tmp_path):
    """A scheduler starting against inference at version 0 and a trainer at version 4 exports 4 once it
    has brought inference there, not a default."""
    r = broker.connect(redis_url)
    try:
        inference = FakeInference(0, "")
        trainer = FakeTrainer(inference, 4, "/ckpt/v4")
        cfg = RunConfig(run_id="v", steps=1, tasks_per_step=1, group_size=2, seed=0, run_dir=tmp_path)
        run = Run(r, broker.Keys("v"), cfg, Stubs(FakeGateway(), inference, trainer), [{"task_id": "t"}])
        VERSION.set(-1)
        await run.start_run()
        assert inference.version == 4 and _gauge("tether_scheduler_weight_version") == 4
    finally:
        await r.aclose()
