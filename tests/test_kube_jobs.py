"""Agent harnesses as Kubernetes Jobs: the token bucket on an injected clock, the Job outcome, and the
dispatcher end to end against the real gateway and Redis, with the recording fake as the cluster and
the real in-Job entry point (tether.agents.job) as each Job's pod: a Job that fails is a failed attempt
retried up to max_attempts, a Job that completes without reporting fails its rollout, at most
max_concurrent Jobs are alive, the dispatch entry is acknowledged when the slot is done."""

from __future__ import annotations

import asyncio
import uuid

import httpx
import pytest
import redis.asyncio as aioredis
from gateway_helpers import ADMIN
from kube_fake import Cluster, finished

from tether.common import broker
from tether.common.records import DispatchJob
from tether.scheduler.kube import jobs
from tether.scheduler.kube.metrics import JOBS_FAILED


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_the_bucket_gives_a_burst_then_qps():
    clock = Clock()
    bucket = jobs.TokenBucket(qps=2.0, burst=3, clock=clock)
    assert [bucket.take() for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.take() == pytest.approx(0.5)
    clock.t += 0.25
    assert bucket.take() == pytest.approx(0.25)  # half a token there: a quarter second to go
    clock.t += 0.25
    assert bucket.take() == 0.0
    clock.t += 100
    assert [bucket.take() for _ in range(4)] == [0.0, 0.0, 0.0, pytest.approx(0.5)]  # never above burst


def test_job_outcomes():
    def job(*conds):
        return {"status": {"conditions": [{"type": t, "status": s, "reason": r} for t, s, r in conds]}}

    assert jobs.job_outcome({}) is None
    assert jobs.job_outcome(job(("Suspended", "False", ""))) is None
    assert jobs.job_outcome(job(("Complete", "True", ""))) == ("complete", "")
    assert jobs.job_outcome(job(("SuccessCriteriaMet", "True", "CompletionsReached"))) == ("complete", "")
    assert jobs.job_outcome(job(("Failed", "True", "DeadlineExceeded"))) == ("failed", "DeadlineExceeded")
    assert jobs.job_outcome(job(("FailureTarget", "True", "BackoffLimitExceeded"))) == (
        "failed",
        "BackoffLimitExceeded",
    )
    assert jobs.job_outcome(job(("Failed", "False", "x"))) is None


# --- the dispatcher ------------------------------------------------------------------------------------


@pytest.fixture
async def aredis(redis_port):
    r = aioredis.from_url(f"redis://127.0.0.1:{redis_port}", decode_responses=True)
    yield r
    await r.aclose()


async def until(predicate, timeout: float = 20.0) -> None:
    for _ in range(int(timeout / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached")


async def dispatch(r, keys, tasks: list[dict], max_attempts: int) -> str:
    group = f"g-{uuid.uuid4().hex[:8]}"
    for i, task in enumerate(tasks):
        job = DispatchJob(group, f"task-{i}", len(tasks), task, {"step": 0}, max_attempts)
        await broker.publish(r, keys.dispatch, job.to_dict())
    return group


async def rollouts_of(gw, group: str) -> list[dict]:
    """Every rollout the gateway holds for a group (from Redis: the gateway has no list route)."""
    out = []
    async with httpx.AsyncClient(base_url=gw.url, headers={"Authorization": f"Bearer {ADMIN}"}) as http:
        r = aioredis.Redis(port=int(gw.settings.redis_url.rsplit(":", 1)[1]), decode_responses=True)
        try:
            # A rollout's hash is `ns:rollout:{pK}:<id>` (K its trace partition): match every partition.
            async for key in r.scan_iter(match=f"{gw.keys.ns}:rollout:*", _type="hash"):
                rid = key.rsplit(":", 1)[-1]
                if await r.hget(key, "group_id") == group:
                    out.append((await http.get(f"/v1/rollouts/{rid}")).json())
        finally:
            await r.aclose()
    return sorted(out, key=lambda s: (s["task_id"], s["created_at"]))


async def run_dispatcher(gw, aredis, cluster: Cluster, tasks, max_attempts=3, max_concurrent=8, *, done):
    keys = gw.keys
    template = jobs.JobTemplate("demo", "run-1", "tether/tether:0.1.0", gw.url, ["tether", "agent-job"])
    dispatcher = jobs.JobDispatcher(
        aredis,
        keys,
        cluster.fake.api(),
        "ns",
        template,
        jobs.Gateway(gw.url, ADMIN),
        jobs.TokenBucket(1000.0, 100),
        max_concurrent,
        consumer=f"jobs-{uuid.uuid4().hex[:6]}",
    )
    group = await dispatch(aredis, keys, tasks, max_attempts)
    kubelet = asyncio.create_task(cluster.kubelet())
    task = asyncio.create_task(dispatcher.run())
    try:
        await done(dispatcher, group)
        pending = await aredis.xpending(keys.dispatch, "agents")
        return group, dispatcher, pending
    finally:
        task.cancel()
        kubelet.cancel()
        await asyncio.gather(task, kubelet, return_exceptions=True)


async def all_acked(aredis, keys, consumer_count_zero=True):
    return (await aredis.xpending(keys.dispatch, "agents"))["pending"] == 0


async def wait_for_slots(gw, aredis, group, n_final):
    async def ok():
        ros = await rollouts_of(gw, group)
        return (
            sum(1 for x in ros if x["status"] != "running") >= n_final
            and (await aredis.xpending(gw.keys.dispatch, "agents"))["pending"] == 0
        )

    for _ in range(1000):
        if await ok():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("slots not done")


async def test_each_rollout_runs_in_its_own_job_and_reports(gw, aredis):
    cluster = Cluster(gw.url, lambda job, attempt: "run")

    async def done(dispatcher, group):
        await wait_for_slots(gw, aredis, group, 2)

    group, _, pending = await run_dispatcher(
        gw, aredis, cluster, [{"reward": 1.0}, {"reward": 0.5}], done=done
    )
    ros = await rollouts_of(gw, group)
    assert [(x["status"], x["reward"]) for x in ros] == [("completed", 1.0), ("completed", 0.5)]
    assert pending["pending"] == 0
    fake = cluster.fake
    assert len(fake.store["jobs"]) == 2 and set(fake.store["secrets"]) == set(fake.store["jobs"])
    for job in fake.store["jobs"].values():
        assert job["metadata"]["labels"]["tether.dev/rollout"] in {x["rollout_id"] for x in ros}
        assert job["metadata"]["labels"]["app.kubernetes.io/component"] == "agent-job"
    # The Secret goes with its Job (owner reference), as Kubernetes' garbage collector does it.
    name = next(iter(fake.store["jobs"]))
    fake.remove("jobs", name)
    assert name not in fake.store["secrets"]


async def test_a_failed_job_is_a_failed_attempt_and_the_next_attempt_runs(gw, aredis):
    before = JOBS_FAILED.labels("DeadlineExceeded")._value.get()
    crashed_before = JOBS_FAILED.labels("BackoffLimitExceeded")._value.get()
    plan = {0: "deadline", 1: "run", 2: "run"}
    cluster = Cluster(gw.url, lambda job, attempt: plan[attempt])

    async def done(dispatcher, group):
        await wait_for_slots(gw, aredis, group, 5)

    tasks = [{"reward": 1.0}, {"reward": 0.25, "raise_on_attempt": 1}]
    group, _, _ = await run_dispatcher(gw, aredis, cluster, tasks, done=done)
    ros = await rollouts_of(gw, group)
    assert [(x["task_id"], x["status"]) for x in ros] == [
        ("task-0", "failed"),
        ("task-0", "completed"),
        ("task-1", "failed"),
        ("task-1", "failed"),
        ("task-1", "completed"),
    ]
    assert "DeadlineExceeded" in ros[0]["reason"] and "the agent crashed" in ros[3]["reason"]
    assert JOBS_FAILED.labels("DeadlineExceeded")._value.get() == before + 2
    # The harness failed the rollout itself: the Job failing after it is no second failure.
    assert JOBS_FAILED.labels("BackoffLimitExceeded")._value.get() == crashed_before
    assert len(cluster.fake.store["jobs"]) == 5


async def test_a_job_that_finishes_without_reporting_fails_its_rollout_until_attempts_run_out(gw, aredis):
    cluster = Cluster(gw.url, lambda job, attempt: "silent")

    async def done(dispatcher, group):
        await wait_for_slots(gw, aredis, group, 2)

    group, _, pending = await run_dispatcher(
        gw, aredis, cluster, [{"reward": 1.0}], max_attempts=2, done=done
    )
    ros = await rollouts_of(gw, group)
    assert [(x["status"], x["reason"]) for x in ros] == [("failed", "job finished without reporting")] * 2
    assert pending["pending"] == 0  # attempts exhausted: the slot is done


async def test_at_most_max_concurrent_jobs_are_alive(gw, aredis):
    cluster = Cluster(gw.url, lambda job, attempt: "hold")

    async def done(dispatcher, group):
        await until(lambda: len(cluster.held) == 2)
        await asyncio.sleep(0.3)
        assert len(cluster.fake.store["jobs"]) == 2  # the third waits for a free slot
        for name in list(cluster.held):
            cluster.held.remove(name)
            cluster.fake.put("jobs", finished(cluster.fake.store["jobs"][name], "Failed", "DeadlineExceeded"))
        await until(lambda: len(cluster.fake.store["jobs"]) == 3)
        await until(lambda: len(cluster.held) == 1)
        cluster.fake.put(
            "jobs", finished(cluster.fake.store["jobs"][cluster.held[0]], "Failed", "DeadlineExceeded")
        )
        await wait_for_slots(gw, aredis, group, 3)

    await run_dispatcher(
        gw, aredis, cluster, [{"reward": 1.0}] * 3, max_attempts=1, max_concurrent=2, done=done
    )
    assert cluster.max_alive <= 2


async def test_a_secret_that_cannot_be_created_fails_the_attempt_and_removes_the_job(gw, aredis):
    cluster = Cluster(gw.url, lambda job, attempt: "run")
    cluster.fake.fail_next("secrets", "create", 500)

    async def done(dispatcher, group):
        await wait_for_slots(gw, aredis, group, 2)

    group, _, _ = await run_dispatcher(gw, aredis, cluster, [{"reward": 1.0}], done=done)
    ros = await rollouts_of(gw, group)
    assert [x["status"] for x in ros] == ["failed", "completed"]
    assert "could not create the agent Job" in ros[0]["reason"]
    assert len(cluster.fake.store["jobs"]) == 1  # the first attempt's Job was deleted
    assert ("batch", "jobs", "delete") in cluster.fake.calls


async def test_after_a_restart_a_pending_entry_waits_for_its_job(gw, aredis):
    """The previous scheduler created the Job of attempt 0 and died; the new one must not start a
    second attempt while that Job runs, and acknowledges once it reported."""
    cluster = Cluster(gw.url, lambda job, attempt: "hold")
    keys = gw.keys
    consumer = f"jobs-{uuid.uuid4().hex[:6]}"
    await broker.ensure_group(aredis, keys.dispatch, "agents")
    group = await dispatch(aredis, keys, [{"reward": 0.75}], 3)
    ((entry_id, record),) = await broker.read_group(
        aredis, keys.dispatch, "agents", consumer, count=1, block_ms=None
    )
    gateway = jobs.Gateway(gw.url, ADMIN)
    rollout = await gateway.create(DispatchJob.from_dict(record), 0)
    template = jobs.JobTemplate("demo", "run-1", "tether/tether:0.1.0", gw.url)
    body = jobs.job_body(template, rollout, record["task"], entry_id, 0)
    made = cluster.fake.put("jobs", body)
    cluster.fake.put("secrets", jobs.secret_body(made, rollout["api_key"]))

    dispatcher = jobs.JobDispatcher(
        aredis,
        keys,
        cluster.fake.api(),
        "ns",
        template,
        gateway,
        jobs.TokenBucket(100, 10),
        4,
        consumer=consumer,
    )
    kubelet = asyncio.create_task(cluster.kubelet())
    task = asyncio.create_task(dispatcher.run())
    try:
        await until(lambda: cluster.held == [body["metadata"]["name"]])
        await asyncio.sleep(0.3)
        assert len(cluster.fake.store["jobs"]) == 1
        cluster.held.clear()
        await cluster.run_pod(cluster.fake.store["jobs"][body["metadata"]["name"]], "run")
        await wait_for_slots(gw, aredis, group, 1)
    finally:
        task.cancel()
        kubelet.cancel()
        await asyncio.gather(task, kubelet, return_exceptions=True)
    ros = await rollouts_of(gw, group)
    assert [(x["status"], x["reward"]) for x in ros] == [("completed", 0.75)]


async def test_a_job_deleted_before_it_finished_is_a_failed_attempt(gw, aredis):
    before = JOBS_FAILED.labels("Deleted")._value.get()
    cluster = Cluster(gw.url, lambda job, attempt: "hold" if attempt == 0 else "run")

    async def done(dispatcher, group):
        await until(lambda: len(cluster.held) == 1)
        cluster.fake.remove("jobs", cluster.held[0])  # someone ran kubectl delete job
        cluster.fake.compact()  # and the watch missed it: the next list no longer shows it
        await wait_for_slots(gw, aredis, group, 2)

    group, _, _ = await run_dispatcher(gw, aredis, cluster, [{"reward": 1.0}], done=done)
    ros = await rollouts_of(gw, group)
    assert [x["status"] for x in ros] == ["failed", "completed"]
    assert "Deleted" in ros[0]["reason"]
    assert JOBS_FAILED.labels("Deleted")._value.get() == before + 1
