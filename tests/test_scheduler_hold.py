"""The scheduler holds dispatch while inference is not serving, in every mode: a vLLM restarting
would only burn the attempts of every rollout dispatched meanwhile (the agent worker waits for a
healthy replica before another attempt, but the first one fails). colocated-sync waits before each step
(`InferenceHealth.wait`); the async modes, whose loop keeps reading results and training, hold back new
groups (`InferenceHealth.hold_dispatch`) and dispatch them once inference serves again; the final evaluation waits
too. Inference's health is a real grpc.health.v1 server (tether.common.grpc_server); the other services
are tests/fake_control.py's stand-ins, on a real Redis."""

from __future__ import annotations

import asyncio

import pytest
from fake_control import FakeGateway, FakeInference, FakeTrainer
from grpc_health.v1 import health_pb2_grpc

from tether.common import broker
from tether.common.grpc_server import channel, start_server
from tether.scheduler.run import Run, RunConfig, Stubs


class CountingHealth:
    """The inference health stub the scheduler gets, counting the checks it makes."""

    def __init__(self, stub: health_pb2_grpc.HealthStub) -> None:
        self.stub, self.checks = stub, 0

    async def Check(self, request, timeout=None):
        self.checks += 1
        return await self.stub.Check(request, timeout=timeout)


async def _until(cond, what: str, limit: int = 600) -> None:
    """Yield to the run (0.05 s at a time, at most `limit` times) until `cond()` (or its awaited
    value) holds."""
    for _ in range(limit):
        value = cond()
        if await value if asyncio.iscoroutine(value) else value:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.parametrize("mode", ["colocated-sync", "colocated-async", "disaggregated-async"])
async def test_no_dispatch_while_inference_is_not_serving(redis_url, tmp_path, mode):
    r = broker.connect(redis_url)
    keys = broker.Keys(f"hold-{mode}")
    server, health, port = await start_server(0, lambda _s: [], token="", tls=None, health_port=0)
    ch = channel(f"127.0.0.1:{port}", wait_for_ready=False, token="", tls=None)
    try:
        await health.set(True)
        probe = CountingHealth(health_pb2_grpc.HealthStub(ch))
        inference = FakeInference()
        cfg = RunConfig(
            run_id="r", steps=2, tasks_per_step=2, group_size=2, seed=0, run_dir=tmp_path, mode=mode
        )
        stubs = Stubs(FakeGateway(), inference, FakeTrainer(inference), inference_health=probe)
        run = Run(r, keys, cfg, stubs, [{"task_id": "t"}])
        start = await run.start_run()

        await health.set(False)  # vLLM restarting
        checks = probe.checks
        if mode == "colocated-sync":
            loop = asyncio.create_task(run.train_sync(start))
        else:
            loop = asyncio.create_task(run.train_async(start, colocated=mode == "colocated-async"))
        # The run asks again and again and dispatches nothing meanwhile.
        await _until(lambda: probe.checks >= checks + 3 or loop.done(), "three health checks")
        assert not loop.done()
        assert await r.xlen(keys.dispatch) == 0

        await health.set(True)  # serving again: the groups go out
        # sync: the step's 2 groups; async: the in-flight budget, (max_staleness 1 + 1) x 2 groups;
        # of 2 rollouts each.
        want = 2 * (2 if mode == "colocated-sync" else 4)

        async def dispatched() -> bool:
            return await r.xlen(keys.dispatch) >= want

        await _until(dispatched, "the dispatch")
        assert await r.xlen(keys.dispatch) == want and run.held_since is None
        run.stop_requested = True
        loop.cancel()  # it waits for results no agent sends
        await asyncio.gather(loop, return_exceptions=True)
    finally:
        await ch.close()
        await server.stop(0)
        await r.aclose()


async def test_the_evaluation_waits_for_inference(redis_url, tmp_path):
    r = broker.connect(redis_url)
    keys = broker.Keys("hold-eval")
    server, health, port = await start_server(0, lambda _s: [], token="", tls=None, health_port=0)
    ch = channel(f"127.0.0.1:{port}", wait_for_ready=False, token="", tls=None)
    try:
        probe = CountingHealth(health_pb2_grpc.HealthStub(ch))
        inference = FakeInference()
        cfg = RunConfig(run_id="r", steps=0, tasks_per_step=1, group_size=1, seed=0, run_dir=tmp_path)
        stubs = Stubs(FakeGateway(), inference, FakeTrainer(inference), inference_health=probe)
        run = Run(r, keys, cfg, stubs, [{"task_id": "t"}])
        await health.set(False)
        task = asyncio.create_task(run.evaluate())
        await _until(lambda: probe.checks >= 3 or task.done(), "three health checks", limit=200)
        assert not task.done() and await r.xlen(keys.dispatch) == 0
        await health.set(True)
        await _until(lambda: r.xlen(keys.dispatch), "the evaluation's dispatch")
        assert await r.xlen(keys.dispatch) == cfg.eval_repeats
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    finally:
        await ch.close()
        await server.stop(0)
        await r.aclose()
