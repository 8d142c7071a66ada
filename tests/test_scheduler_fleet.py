"""The scheduler's inference fleet (tether.scheduler.fleet) against real gRPC servers, each serving a
FakeInference (tests/fake_control.py) as one replica's control adapter, and a real Redis for the
published ReplicaSet: calls fanned out to every replica, a failure naming the replica, a joining replica
brought to the run's weights and state before it is published, removal published at once (even during a
push), pushes and joins serialised, and with no replica discovered, exactly the one stub of today."""

from __future__ import annotations

import asyncio
import contextlib
import uuid

import grpc
import pytest
import redis.asyncio as aioredis
from fake_control import FakeInference, FakeTrainer, rpc_error
from fakes.vllm_control import FakeVLLMControl, serve
from prometheus_client import REGISTRY

from tether.common import replicas as published
from tether.common.broker import Keys
from tether.common.grpc_server import start_server
from tether.common.records import InferenceReplica
from tether.common.vllm_client import VLLMControl
from tether.inference.servicer import InferenceServicer
from tether.scheduler.fleet import InferenceFleet
from tether.scheduler.publish import AdapterPublisher, WeightPublisher
from tether.v1 import inference_pb2, inference_pb2_grpc, trainer_pb2, types_pb2

METHODS = ("GetWeightVersion", "LoadWeights", "Pause", "Resume", "Sleep", "WakeUp")


class Adapter(inference_pb2_grpc.InferenceServicer):
    """A FakeInference behind gRPC. `gates[method]`: the call waits until the event is set; `fail`:
    methods answering `fail_code`; `seen[method]`: runs (awaited) before the call is answered."""

    def __init__(self, fake: FakeInference) -> None:
        self.fake = fake
        self.gates: dict[str, asyncio.Event] = {}
        self.fail: set[str] = set()
        self.fail_code = grpc.StatusCode.FAILED_PRECONDITION  # not retried: the test stays quick
        self.seen: dict = {}
        self.started: dict[str, asyncio.Event] = {m: asyncio.Event() for m in METHODS}

    async def _answer(self, method: str, request, context):
        self.started[method].set()
        if method in self.gates:
            await self.gates[method].wait()
        if method in self.seen:
            await self.seen[method]()
        if method in self.fail:
            await context.abort(self.fail_code, f"{method} failed here")
        try:
            return await getattr(self.fake, method)(request)
        except grpc.aio.AioRpcError as exc:
            await context.abort(exc.code(), exc.details())

    async def GetWeightVersion(self, request, context):
        return await self._answer("GetWeightVersion", request, context)

    async def LoadWeights(self, request, context):
        return await self._answer("LoadWeights", request, context)

    async def Pause(self, request, context):
        return await self._answer("Pause", request, context)

    async def Resume(self, request, context):
        return await self._answer("Resume", request, context)

    async def Sleep(self, request, context):
        return await self._answer("Sleep", request, context)

    async def WakeUp(self, request, context):
        return await self._answer("WakeUp", request, context)


class Cluster:
    """Replica adapters on real gRPC ports, the Redis the set is published in, and the fleet."""

    def __init__(self, redis_port: int) -> None:
        self.r = aioredis.Redis(port=redis_port, decode_responses=True)
        self.keys = Keys(f"t{uuid.uuid4().hex[:8]}")
        self.servers: list[grpc.aio.Server] = []
        self.adapters: dict[str, Adapter] = {}
        self.replicas: dict[str, InferenceReplica] = {}
        self.trainer = FakeTrainer(FakeInference())
        self.single = FakeInference()
        self.fleet = InferenceFleet(self.single, self.r, self.keys, trainer=self.trainer, join_backoff_s=0.02)

    async def add(self, name: str, version: int = 0, checkpoint_dir: str = "", vllm_url: str = "") -> Adapter:
        adapter = Adapter(FakeInference(version, checkpoint_dir))
        server, _, port = await start_server(
            0, lambda srv: inference_pb2_grpc.add_InferenceServicer_to_server(adapter, srv) or []
        )
        self.servers.append(server)
        self.adapters[name] = adapter
        self.replicas[name] = InferenceReplica(
            name=name,
            vllm_url=vllm_url or f"http://127.0.0.1:{port + 1}",
            control_address=f"127.0.0.1:{port}",
        )
        return adapter

    async def discover(self, *names: str) -> None:
        await self.fleet.update([self.replicas[n] for n in names])

    async def routed(self) -> list[str]:
        current = await published.current(self.r, self.keys)
        return [x.name for x in current.replicas] if current else []

    async def close(self) -> None:
        await self.fleet.aclose()
        for server in self.servers:
            await server.stop(0)
        await self.r.aclose()


@pytest.fixture
async def cluster(redis_port):
    c = Cluster(redis_port)
    yield c
    await c.close()


def load(version: int) -> inference_pb2.LoadWeightsRequest:
    return inference_pb2.LoadWeightsRequest(checkpoint_dir=f"/ckpt/v{version}", version=version)


async def eventually(cond, timeout_s: float = 10.0) -> None:
    async def poll() -> None:
        while not await cond():
            await asyncio.sleep(0.01)

    await asyncio.wait_for(poll(), timeout_s)


async def test_a_load_reaches_every_replica_and_versions_answer_the_lowest(cluster):
    a, b = await cluster.add("inference-0"), await cluster.add("inference-1")
    await cluster.discover("inference-0", "inference-1")
    await cluster.fleet.settled()
    assert await cluster.routed() == ["inference-0", "inference-1"]
    fleet = cluster.fleet
    served = await fleet.GetWeightVersion(types_pb2.Empty())  # the run's reconcile
    assert (served.version, served.checkpoint_dir) == (0, "")
    answer = await fleet.LoadWeights(load(1))
    assert (answer.version, answer.checkpoint_dir) == (1, "/ckpt/v1")
    for f in (a.fake, b.fake):
        assert (f.version, f.checkpoint_dir) == (1, "/ckpt/v1") and f.log[-1] == "load:/ckpt/v1:1"
    assert cluster.single.log == []  # the configured adapter is no longer called
    b.fake.version, b.fake.checkpoint_dir = 0, ""  # e.g. restarted
    served = await fleet.GetWeightVersion(types_pb2.Empty())
    assert (served.version, served.checkpoint_dir) == (0, "")  # the lowest; no checkpoint all agree on
    await fleet.Sleep(inference_pb2.SleepRequest(level=1))
    assert a.fake.asleep and b.fake.asleep
    await fleet.WakeUp(types_pb2.Empty())
    await fleet.Pause(inference_pb2.PauseRequest(mode="keep"))
    assert a.fake.paused and b.fake.paused
    await fleet.Resume(types_pb2.Empty())
    assert not (a.fake.asleep or b.fake.asleep or a.fake.paused or b.fake.paused)


async def test_a_failure_names_the_replica_and_a_failed_load_leaves_routing(cluster):
    a, b = await cluster.add("inference-0"), await cluster.add("inference-1")
    await cluster.discover("inference-0", "inference-1")
    await cluster.fleet.GetWeightVersion(types_pb2.Empty())
    await cluster.fleet.settled()
    b.fail.add("Pause")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await cluster.fleet.Pause(inference_pb2.PauseRequest(mode="keep"))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # the replica's own code
    assert "inference replica inference-1" in err.value.details() and "inference-0" not in err.value.details()
    assert b.fake.log.count("pause:keep") == 0 and a.fake.paused
    b.fail.clear()
    await cluster.fleet.Resume(types_pb2.Empty())

    b.fake.fail_load = {"/ckpt/v2"}
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await cluster.fleet.LoadWeights(load(2))
    assert "inference replica inference-1" in err.value.details() and "/ckpt/v2" in err.value.details()
    # It may still serve version 0: out of routing at once; it joins again (to version 2) once it can.
    assert await cluster.routed() == ["inference-0"]
    assert cluster.fleet.status()["serving"] == ["inference-0"]
    await cluster.fleet.settled()
    assert "/ckpt/v2" in cluster.fleet.status()["joining"]["inference-1"]  # tried, failed again
    assert REGISTRY.get_sample_value("tether_scheduler_inference_replicas", {"state": "joining"}) == 1
    b.fake.fail_load = set()
    await eventually(lambda: _is(cluster.fleet.status()["serving"] == ["inference-0", "inference-1"]))
    assert (b.fake.version, b.fake.checkpoint_dir) == (2, "/ckpt/v2")
    assert await cluster.routed() == ["inference-0", "inference-1"]


async def _is(value: bool) -> bool:
    return value


async def test_a_joining_replica_serves_the_run_weights_and_state_before_it_is_published(cluster):
    await cluster.add("inference-0")
    await cluster.discover("inference-0")
    await cluster.fleet.LoadWeights(load(3))
    await cluster.fleet.settled()
    await cluster.fleet.Sleep(inference_pb2.SleepRequest(level=1))  # a colocated step trains
    c = await cluster.add("inference-2")
    routed_at_load: list[list[str]] = []

    async def record() -> None:
        routed_at_load.append(await cluster.routed())

    c.seen["LoadWeights"] = record
    await cluster.discover("inference-0", "inference-2")
    await cluster.fleet.settled()
    assert routed_at_load == [["inference-0"]]  # not published while it loaded
    assert c.fake.log == ["version", "load:/ckpt/v3:3", "sleep:1"]
    assert await cluster.routed() == ["inference-0", "inference-2"]
    await cluster.fleet.WakeUp(types_pb2.Empty())
    assert not c.fake.asleep

    # Weights pushed by path 2 carry no checkpoint: a replica joining then loads the trainer's.
    for adapter in cluster.adapters.values():
        adapter.fake.version, adapter.fake.checkpoint_dir = 4, ""
    cluster.trainer.version, cluster.trainer.checkpoint_dir = 4, "/ckpt/v4"
    assert (await cluster.fleet.GetWeightVersion(types_pb2.Empty())).version == 4
    await cluster.fleet.Pause(inference_pb2.PauseRequest(mode="keep"))
    d = await cluster.add("inference-3", version=3, checkpoint_dir="/ckpt/v3")
    await cluster.discover("inference-0", "inference-2", "inference-3")
    await cluster.fleet.settled()
    assert d.fake.log == ["version", "load:/ckpt/v4:4", "pause:keep"] and d.fake.paused
    # One that already serves them is not reloaded.
    e = await cluster.add("inference-4", version=4)
    await cluster.discover("inference-0", "inference-2", "inference-3", "inference-4")
    await cluster.fleet.settled()
    assert e.fake.log == ["version", "pause:keep"]
    assert await cluster.routed() == ["inference-0", "inference-2", "inference-3", "inference-4"]


async def test_a_replica_joining_during_a_push_waits_for_it_and_gets_the_new_weights(cluster):
    a = await cluster.add("inference-0")
    await cluster.discover("inference-0")
    await cluster.fleet.LoadWeights(load(4))
    await cluster.fleet.settled()
    a.gates["LoadWeights"] = gate = asyncio.Event()
    a.started["LoadWeights"].clear()
    push = asyncio.create_task(cluster.fleet.LoadWeights(load(5)))
    await a.started["LoadWeights"].wait()
    c = await cluster.add("inference-2")
    await cluster.discover("inference-0", "inference-2")
    await asyncio.sleep(0.2)
    assert c.fake.log == [] and await cluster.routed() == ["inference-0"]  # it waits for the push
    gate.set()
    assert (await push).version == 5
    await cluster.fleet.settled()
    assert c.fake.log == ["version", "load:/ckpt/v5:5"] and await cluster.routed() == [
        "inference-0",
        "inference-2",
    ]


async def test_a_join_that_hangs_ends_when_its_replica_goes_away(cluster):
    await cluster.add("inference-0")
    await cluster.discover("inference-0")
    await cluster.fleet.LoadWeights(load(1))
    await cluster.fleet.settled()
    c = await cluster.add("inference-2")
    c.gates["GetWeightVersion"] = asyncio.Event()  # its adapter never answers
    await cluster.discover("inference-0", "inference-2")
    await c.started["GetWeightVersion"].wait()
    push = asyncio.create_task(cluster.fleet.LoadWeights(load(2)))
    await asyncio.sleep(0.2)
    assert not push.done()  # a push waits for the join under way
    await cluster.discover("inference-0")  # it went away: its join is cancelled
    assert (await asyncio.wait_for(push, 10)).version == 2
    await cluster.fleet.settled()
    assert cluster.fleet.status()["joining"] == {} and await cluster.routed() == ["inference-0"]
    assert c.fake.log == []


async def test_a_replica_that_goes_away_is_published_out_at_once_even_mid_push(cluster):
    a, b = await cluster.add("inference-0"), await cluster.add("inference-1")
    await cluster.discover("inference-0", "inference-1")
    await cluster.fleet.LoadWeights(load(1))
    await cluster.fleet.settled()
    b.gates["LoadWeights"] = asyncio.Event()  # never answers: its pod is going away
    b.started["LoadWeights"].clear()
    push = asyncio.create_task(cluster.fleet.LoadWeights(load(2)))
    await b.started["LoadWeights"].wait()
    await cluster.discover("inference-0")  # returns while the push holds the lock
    assert await cluster.routed() == ["inference-0"]
    # Its channel is closed, which ends the call; a replica gone does not fail the push.
    answer = await asyncio.wait_for(push, 10)
    assert answer.version == 2 and a.fake.version == 2 and b.fake.version == 1
    assert cluster.fleet.status()["serving"] == ["inference-0"]
    await cluster.discover()
    current = await published.current(cluster.r, cluster.keys)
    assert current is not None and current.replicas == []
    assert (await cluster.fleet.LoadWeights(load(3))).version == 3  # no replica: nothing to load
    assert (await cluster.fleet.GetWeightVersion(types_pb2.Empty())).version == 3
    b.gates.clear()
    await cluster.discover("inference-1")  # back: brought to version 3 first
    await cluster.fleet.settled()
    assert (b.fake.version, await cluster.routed()) == (3, ["inference-1"])


async def test_a_scheduler_started_with_replicas_serving_adopts_them_for_its_reconcile(cluster):
    a = await cluster.add("inference-0", version=6, checkpoint_dir="/ckpt/v6")
    b = await cluster.add("inference-1", version=6, checkpoint_dir="/ckpt/v6")
    await cluster.discover("inference-0", "inference-1")
    trainer = FakeTrainer(FakeInference(), 7, "/ckpt/v7")
    assert await WeightPublisher(cluster.fleet, trainer).reconcile() == 7
    for f in (a.fake, b.fake):
        assert f.log == ["version", "version", "load:/ckpt/v7:7"]  # adopted as they were, then loaded
    assert await cluster.routed() == ["inference-0", "inference-1"]


async def test_without_discovery_the_fleet_is_the_one_adapter():
    """No ReplicaSet (local, Compose): every call reaches the configured stub as it is, and its
    answers and failures come back untouched."""
    direct, behind = FakeInference(1, "/ckpt/v1"), FakeInference(1, "/ckpt/v1")
    fleet = InferenceFleet(behind, None, Keys("unused"))
    for stub, f in ((direct, direct), (fleet, behind)):
        trainer = FakeTrainer(f, 3, "/ckpt/v3")
        trainer.fail_push = rpc_error(grpc.StatusCode.UNAVAILABLE, "bucket 2 of 5 failed")
        pub = WeightPublisher(stub, trainer, "nccl")
        assert (
            await pub.publish(trainer_pb2.TrainStepResponse(weight_version=3, checkpoint_dir="/ckpt/v3")) == 3
        )
        await stub.Sleep(inference_pb2.SleepRequest(level=2))
        await stub.WakeUp(types_pb2.Empty())
        assert await pub.reconcile() == 3
    assert behind.log == direct.log and (behind.version, behind.checkpoint_dir) == (3, "/ckpt/v3")
    behind.fail_load = {"/ckpt/v9"}
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await fleet.LoadWeights(load(9))
    assert err.value.details() == "weight load failed: /ckpt/v9"  # the adapter's own error


async def test_a_removal_published_while_redis_is_away_is_published_once_it_answers(tmp_path):
    from tether.common.net import free_port
    from tether.common.redis_server import start_embedded_redis

    port = free_port()
    proc = start_embedded_redis(tmp_path / "redis", port)
    c = Cluster(port)
    try:
        await c.add("inference-0")
        await c.add("inference-1")
        await c.discover("inference-0", "inference-1")
        await c.fleet.settled()
        assert await c.routed() == ["inference-0", "inference-1"]
        proc.terminate()
        proc.wait(10)
        await c.discover("inference-0")  # does not raise: the set is published once Redis is back
        assert c.fleet.status()["serving"] == ["inference-0"]
        proc = start_embedded_redis(tmp_path / "redis", port)

        async def republished() -> bool:
            try:
                return await c.routed() == ["inference-0"]
            except Exception:
                return False

        await eventually(republished, 60)
    finally:
        await c.close()
        proc.terminate()
        proc.wait(10)


async def test_the_gateway_routes_to_what_the_fleet_publishes_and_never_to_stale_weights(redis_port, cluster):
    """Both consumers of the one interface together: the fleet publishes, a discovering gateway
    follows; a replica is routed only after it loaded the run's weights, and drained once it left."""
    from fakes.vllm_openai import FakeVLLM
    from gateway_helpers import InProcessGateway, gateway_settings

    def routed_by_gateway(gw: InProcessGateway) -> set[str]:
        return {r["url"] for r in gw.http.get("/health").json()["replicas"] if r["state"] == "routed"}

    async def gateway_routes(gw: InProcessGateway, urls: set[str]) -> None:
        async def check() -> bool:
            return await asyncio.to_thread(routed_by_gateway, gw) == urls

        await eventually(check)

    with (
        FakeVLLM() as service,
        FakeVLLM() as va,
        FakeVLLM() as vb,
        InProcessGateway(
            gateway_settings(
                redis_port,
                service.url,
                namespace=cluster.keys.ns,
                replica_discovery=True,
                health_check_s=0.05,
            )
        ) as gw,
    ):
        await cluster.add("inference-0", vllm_url=va.url)
        b = await cluster.add("inference-1", vllm_url=vb.url)
        await cluster.discover("inference-0")
        await cluster.fleet.LoadWeights(load(1))
        await gateway_routes(gw, {va.url})
        routed_while_loading: list[set[str]] = []

        async def look() -> None:
            await asyncio.sleep(0.2)  # several of the gateway's reads
            routed_while_loading.append(await asyncio.to_thread(routed_by_gateway, gw))

        b.seen["LoadWeights"] = look
        await cluster.discover("inference-0", "inference-1")
        await cluster.fleet.settled()
        assert routed_while_loading == [{va.url}] and b.fake.version == 1
        await gateway_routes(gw, {va.url, vb.url})
        await cluster.discover("inference-1")
        await gateway_routes(gw, {vb.url})
        await eventually(
            lambda: _is(va.url not in {r["url"] for r in gw.http.get("/health").json()["replicas"]})
        )


async def test_a_colocated_step_of_the_run_reaches_every_replica_and_one_joining_mid_step(cluster, tmp_path):
    """The run's own code (Run.start_run, Run.push with sleep) against the fleet: every replica sleeps,
    wakes and loads; one that joins while the trainer trains is put to sleep like the others first."""
    from fake_control import FakeGateway

    from tether.scheduler.run import Run, RunConfig, Stubs

    a, b = await cluster.add("inference-0"), await cluster.add("inference-1")
    c = await cluster.add("inference-2")
    await cluster.discover("inference-0", "inference-1")
    trainer = FakeTrainer(FakeInference())
    train_step = trainer.TrainStep

    async def train_while_one_joins(req):
        await cluster.discover("inference-0", "inference-1", "inference-2")
        await cluster.fleet.settled()
        assert await cluster.routed() == ["inference-0", "inference-1", "inference-2"]
        return await train_step(req)

    trainer.TrainStep = train_while_one_joins
    config = RunConfig(
        run_id="r", steps=2, tasks_per_step=1, group_size=1, seed=0, run_dir=tmp_path, sleep_level=1
    )
    run = Run(
        cluster.r, cluster.keys, config, Stubs(FakeGateway(), cluster.fleet, trainer), [{"task_id": "t"}]
    )
    assert await run.start_run() == 0
    await run.push(0, ["g0"], colocated=True)
    assert run.state.weight_version == 1
    for f in (a.fake, b.fake):
        assert f.log == ["version", "version", "resume", "sleep:1", "wake", "load:/ckpt/v1:1"]
    assert c.fake.log == ["version", "resume", "sleep:1", "wake", "load:/ckpt/v1:1"]
    assert all((f.fake.version, f.fake.asleep) == (1, False) for f in (a, b, c))


async def test_a_replica_on_other_weights_than_the_base_model_joins_after_the_next_load(cluster):
    await cluster.add("inference-0")
    await cluster.discover("inference-0")
    assert (await cluster.fleet.GetWeightVersion(types_pb2.Empty())).version == 0  # the run: base model
    stray = await cluster.add("inference-1", version=5, checkpoint_dir="/ckpt/v5")  # another run's
    await cluster.discover("inference-0", "inference-1")
    await cluster.fleet.settled()
    assert "serves version 5" in cluster.fleet.status()["joining"]["inference-1"]
    assert await cluster.routed() == ["inference-0"]  # never routed on those weights
    await cluster.fleet.LoadWeights(load(1))
    await eventually(lambda: _is(cluster.fleet.status()["serving"] == ["inference-0", "inference-1"]))
    assert (stray.fake.version, await cluster.routed()) == (1, ["inference-0", "inference-1"])


async def test_a_replica_that_joins_later_serves_the_runs_adapter_version(cluster):
    """A run's scheduler loads only its adapter's versions (LoadAdapter, no LoadWeights). Replicas here
    are the real inference adapter (InferenceServicer) over a vLLM look-alike each: one discovered
    after versions 1 and 2 were loaded serves version 2 (and only it) once it is published; one that
    serves it already loads nothing; the next version reaches every member."""
    vllms: dict[str, FakeVLLMControl] = {}
    controls: list[VLLMControl] = []
    with contextlib.ExitStack() as stack:

        async def add(name: str) -> FakeVLLMControl:
            fake = vllms[name] = FakeVLLMControl({})
            url = stack.enter_context(serve(fake.app))
            control = VLLMControl(url)
            controls.append(control)
            servicer = InferenceServicer(control, "")
            server, _, port = await start_server(
                0, lambda srv: inference_pb2_grpc.add_InferenceServicer_to_server(servicer, srv) or []
            )
            cluster.servers.append(server)
            cluster.replicas[name] = InferenceReplica(
                name=name, vllm_url=url, control_address=f"127.0.0.1:{port}"
            )
            return fake

        try:
            first = await add("inference-0")
            await cluster.discover("inference-0")
            await cluster.fleet.settled()
            run = AdapterPublisher(cluster.fleet, cluster.trainer, "calc", "calc-lora")
            for version in (1, 2):
                await run.load(f"/adapters/calc-lora/{version}", version)
            assert first.adapters == {"calc-lora": "/adapters/calc-lora/2"}

            late = await add("inference-1")
            served = await add("inference-2")
            served.adapters["calc-lora"] = "/adapters/calc-lora/2"  # as after a scheduler restart
            await cluster.discover("inference-0", "inference-1", "inference-2")
            await cluster.fleet.settled()
            assert await cluster.routed() == ["inference-0", "inference-1", "inference-2"]
            assert late.adapters == {"calc-lora": "/adapters/calc-lora/2"}
            assert [e for e in late.log if e.startswith("lora:")] == ["lora:calc-lora:/adapters/calc-lora/2"]
            assert not [e for e in served.log if e.startswith("lora:")]  # served it already

            await run.load("/adapters/calc-lora/3", 3)
            assert {n: f.adapters["calc-lora"] for n, f in vllms.items()} == dict.fromkeys(
                vllms, "/adapters/calc-lora/3"
            )
        finally:
            for control in controls:
                await control.close()
