"""The scheduler's mode loops end to end in one process: a whole run in each mode (real Redis; the gRPC
peers are tests/fake_control.py's stand-ins, a responder plays the agent workers and the merger), and
an async run whose scheduler is cancelled mid-step and picked up by a new one. What is checked is what
the run promises: every step trains P groups no more than k versions stale, colocated steps drain the
gateway and disaggregated ones do not, every step is reported once, no group trains twice, and a
resumed run ends as one run."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest
from fake_control import FakeGateway, FakeInference, FakeTrainer
from test_scheduler_state import _group_result

from tether.common import broker
from tether.common.grpc_server import cancel_until_done
from tether.common.records import DispatchJob, RunState
from tether.scheduler.run import Run, RunConfig, Stubs

TASKS = [{"task_id": "t0"}, {"task_id": "t1"}, {"task_id": "t2"}]


class _Trainer(FakeTrainer):
    """Writes a real checkpoint folder per version (the run copies the last one to final-model)."""

    def __init__(self, inference: FakeInference, root: Path) -> None:
        super().__init__(inference)
        self.root = root

    async def TrainStep(self, req):
        resp = await super().TrainStep(req)
        ckpt = self.root / f"v{resp.weight_version}"
        ckpt.mkdir(parents=True, exist_ok=True)
        self.checkpoint_dir = resp.checkpoint_dir = str(ckpt)
        self.records[req.step] = (resp.weight_version, str(ckpt))
        return resp


async def _workers(r, keys: broker.Keys, inference: FakeInference, delay_s: float) -> None:
    """Answers each dispatched group once, `delay_s` later, as sampled by the version inference serves
    then; task t2's groups are filtered (zero variance), the others trained."""
    cursor, answered = "0-0", set()
    while True:
        resp = await r.xread({keys.dispatch: cursor}, count=100, block=50)
        for _, items in resp or []:
            for eid, fields in items:
                cursor = eid
                job = DispatchJob.from_dict(broker.decode(fields))
                if job.group_id in answered:
                    continue
                answered.add(job.group_id)
                await asyncio.sleep(delay_s)
                if job.metadata.get("eval"):
                    outcome = "eval"
                else:
                    outcome = "filtered" if job.task_id == "t2" else "trained"
                result = _group_result(job.group_id, outcome, [1.0, 0.0][: job.group_size], 4, 40)
                result["min_weight_version"] = inference.version
                await broker.publish(r, keys.group_results, result)


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _trained(trainer: FakeTrainer) -> dict[int, list[str]]:
    """Step -> the groups the trainer was asked to train (the last ask of each step)."""
    out: dict[int, list[str]] = {}
    for line in trainer.log:
        if line.startswith("train:"):
            _, step, groups = line.split(":", 2)
            out[int(step)] = groups.split(",") if groups else []
    return out


@pytest.mark.parametrize("mode", ["colocated-sync", "colocated-async", "disaggregated-async"])
async def test_a_run_in_each_mode(redis_url, tmp_path, mode):
    r = broker.connect(redis_url)
    keys = broker.Keys(f"loops-{mode}")
    inference = FakeInference()
    trainer = _Trainer(inference, tmp_path / "ckpt")
    gateway = FakeGateway()
    P, k, steps = 2, 1, 4
    cfg = RunConfig(
        run_id="r", steps=steps, tasks_per_step=P, group_size=2, seed=3, run_dir=tmp_path / "run",
        eval_repeats=1, mode=mode, max_staleness=k,
    )  # fmt: skip
    workers = asyncio.ensure_future(_workers(r, keys, inference, 0.01))
    try:
        run = Run(r, keys, cfg, Stubs(gateway, inference, trainer), TASKS)
        await asyncio.wait_for(run.run(), 60)
        state = RunState.from_redis(await r.hgetall(keys.run))
        assert state.status == "done" and state.next_step == steps and state.pending is None
        records = _records(cfg.run_dir)
        assert [m["step"] for m in records[:-1]] == list(range(steps)) and "eval_reward" in records[-1]
        trained = _trained(trainer)  # a synchronous step that drew only t2 trains nothing
        assert set(trained) <= set(range(steps))
        groups = [g for s in trained.values() for g in s]
        assert len(groups) == len(set(groups))  # no group trains twice
        version = 0
        for m in records[:-1]:
            took = trained.get(m["step"], [])
            version += bool(took)
            assert m["mode"] == mode and m["weight_version"] == version
            assert m["staleness_max"] <= k
            assert m["groups_trained"] == len(took)
        if mode == "colocated-sync":
            # P tasks a step; the filtered ones (task t2) are reported, not trained.
            assert all(m["groups_trained"] + m["groups_filtered"] == P for m in records[:-1])
        else:
            assert sorted(trained) == list(range(steps))
            assert all(len(g) == P for g in trained.values())  # an async step trains exactly P
        # Colocated: admission drained and resumed around each step; disaggregated: only told the version.
        pauses = gateway.log.count("pause")
        assert pauses == (0 if mode == "disaggregated-async" else len([s for s in trained.values() if s]))
        assert (cfg.run_dir / "final-model").is_dir()
    finally:
        await cancel_until_done(workers)
        await r.aclose()


@pytest.mark.parametrize(
    ("tasks", "bound"), [(TASKS, 0), ([{"task_id": "t2"}], 5)], ids=["some-filtered", "all-filtered"]
)
async def test_dynamic_sampling_tops_a_synchronous_step_up_to_p_groups_with_signal(
    redis_url, tmp_path, tasks, bound
):
    """colocated-sync with dynamic sampling: a step whose first P groups drew task t2 (filtered) keeps
    dispatching until P groups carry signal, trains exactly those, and reports what it dispatched; with
    nothing but t2 it stops at its bound and trains nothing."""
    r = broker.connect(redis_url)
    keys = broker.Keys(f"loops-dynamic-{bound}")
    inference = FakeInference()
    trainer = _Trainer(inference, tmp_path / "ckpt")
    P, steps = 2, 4
    cfg = RunConfig(
        run_id="r", steps=steps, tasks_per_step=P, group_size=2, seed=3, run_dir=tmp_path / "run",
        eval_repeats=0, dynamic_sampling=True, dynamic_sampling_max_groups=bound,
    )  # fmt: skip
    workers = asyncio.ensure_future(_workers(r, keys, inference, 0.01))
    try:
        await asyncio.wait_for(Run(r, keys, cfg, Stubs(FakeGateway(), inference, trainer), tasks).run(), 60)
        records = [m for m in _records(cfg.run_dir) if "step" in m]
        trained = _trained(trainer)
        assert [m["step"] for m in records] == list(range(steps))
        for m in records:
            surplus = m.get("groups_surplus", 0.0)
            assert m["groups_dispatched"] == m["groups_trained"] + m["groups_filtered"] + surplus
            if bound == 0:
                assert m["groups_trained"] == P and len(trained[m["step"]]) == P
                assert P <= m["groups_dispatched"] <= 4 * P
            else:
                assert m["groups_trained"] == 0 and m["groups_dispatched"] == bound == m["groups_filtered"]
                assert m["untrained_steps_in_a_row"] == m["step"] + 1
        if bound == 0:
            assert set(trainer.intended) == {P}  # each step tells the trainer what it meant to train
            assert any(m["groups_dispatched"] > P for m in records), (
                "no step needed a top-up: change the seed"
            )
    finally:
        await cancel_until_done(workers)
        await r.aclose()


async def test_an_async_run_cancelled_mid_step_is_finished_by_a_new_scheduler(redis_url, tmp_path):
    r = broker.connect(redis_url)
    keys = broker.Keys("loops-resume")
    inference = FakeInference()
    trainer = _Trainer(inference, tmp_path / "ckpt")
    P, steps = 2, 5
    cfg = RunConfig(
        run_id="r", steps=steps, tasks_per_step=P, group_size=2, seed=1, run_dir=tmp_path / "run",
        eval_repeats=1, mode="disaggregated-async", max_staleness=1,
    )  # fmt: skip
    workers = asyncio.ensure_future(_workers(r, keys, inference, 0.02))
    try:
        first = Run(r, keys, cfg, Stubs(FakeGateway(), inference, trainer), TASKS)
        task = asyncio.ensure_future(first.run())
        for _ in range(400):
            if first.state.next_step >= 2:
                break
            await asyncio.sleep(0.01)
        task.cancel()  # as a kill would, wherever the run is
        await asyncio.gather(task, return_exceptions=True)

        again = Run(r, keys, cfg, Stubs(FakeGateway(), inference, trainer), TASKS)
        await asyncio.wait_for(again.run(), 60)
        records = _records(cfg.run_dir)
        assert [m["step"] for m in records[:-1]] == list(range(steps))  # each step reported once
        trained = _trained(trainer)
        assert sorted(trained) == list(range(steps)) and all(len(g) == P for g in trained.values())
        groups = [g for s in trained.values() for g in s]
        assert len(groups) == len(set(groups))
        assert trainer.version == steps and again.state.weight_version == steps
        # The resumed run drew its tasks where the first left off: group n's task is the run's n-th
        # draw, each group went out once.
        rng = random.Random(cfg.seed)
        draws = [rng.choice(TASKS)["task_id"] for _ in range(again.state.dispatched)]
        jobs = [DispatchJob.from_dict(job) for _, job in await broker.read_all(r, keys.dispatch)]
        sent = {j.group_id: j.task_id for j in jobs if not j.metadata.get("eval")}
        assert sorted(int(g.rsplit("-", 1)[1]) for g in sent) == list(range(again.state.dispatched))
        assert all(task == draws[int(g.rsplit("-", 1)[1])] for g, task in sent.items())
    finally:
        await cancel_until_done(workers)
        await r.aclose()
