"""Fuzzing the gRPC services (issue 14, "Bad input"): real servers — the trainer on the tiny model, the
inference adapter in front of a vLLM that speaks vLLM's control routes (tests/fakes), the gateway's
control service, the merger's and the scheduler's status services — get arbitrary bytes for every
method and out-of-range messages built by hypothesis. Every answer is a status the caller can act on:
OK or a client-error code, never INTERNAL / UNKNOWN (a crash), the server keeps serving, and the
trainer buffers none of the bad groups, so it never trains on them.
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Callable, Iterator

import grpc
import pytest
from fakes.vllm_control import FakeVLLMControl, checkpoint, serve
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_trainer_resume import tiny_model_dir

from tether.common.broker import Keys
from tether.common.grpc_server import start_server
from tether.common.vllm_client import VLLMControl
from tether.gateway.admission import Admission
from tether.gateway.servicer import GatewayControlServicer
from tether.inference.servicer import InferenceServicer
from tether.merger.consumer import Merger, MergerConfig
from tether.merger.servicer import MergerStatusServicer
from tether.scheduler.run import Run, RunConfig, Stubs
from tether.scheduler.servicer import SchedulerServicer
from tether.trainer.distributed import Dist
from tether.trainer.main import TrainerSettings, build
from tether.trainer.servicer import TrainerServicer
from tether.trainer.steps import Trainer, TrainerCore
from tether.v1 import (
    gateway_pb2,
    gateway_pb2_grpc,
    inference_pb2,
    inference_pb2_grpc,
    merger_pb2,
    merger_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
    types_pb2,
)

# A client's mistake, or a state the caller must wait out: never the server's fault.
CLIENT_CODES = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAVAILABLE,  # e.g. the (fake) vLLM refusing a reload of a folder that is no checkpoint
}
EXAMPLES = 150


class Servers:
    """Real grpc.aio servers on a loop of their own (the tests call them with the sync client)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.servers: list[grpc.aio.Server] = []

    def call(self, coro_fn: Callable):
        return asyncio.run_coroutine_threadsafe(coro_fn(), self.loop).result(120)

    def add(self, add_fn, make_servicer: Callable, names: list[str]) -> int:
        async def start() -> int:
            servicer = make_servicer()

            def register(server):
                add_fn(servicer, server)
                return names

            server, health, port = await start_server(0, register, token="")
            await health.set(True)
            self.servers.append(server)
            return port

        return self.call(start)

    def close(self) -> None:
        async def stop() -> None:
            for s in self.servers:
                await s.stop(0)

        self.call(stop)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[dict[str, grpc.Channel]]:
    tmp = tmp_path_factory.mktemp("fuzz")
    model_dir = tiny_model_dir(tmp / "model")
    servers = Servers()
    fake = FakeVLLMControl(checkpoint(str(model_dir)))
    with serve(fake.app) as vllm_url:

        def trainer():
            s = TrainerSettings(
                trainer_grpc_port=0, model_dir=str(model_dir), checkpoint_dir=str(tmp / "ckpt"), device="cpu"
            )
            runner, tokenizer, _ = build(s, Dist())
            return TrainerServicer(Trainer(TrainerCore(runner, tokenizer, tmp / "ckpt", keep=2)))

        ports = {
            "trainer": servers.add(
                trainer_pb2_grpc.add_TrainerServicer_to_server,
                trainer,
                [trainer_pb2.DESCRIPTOR.services_by_name["Trainer"].full_name],
            ),
            "inference": servers.add(
                inference_pb2_grpc.add_InferenceServicer_to_server,
                lambda: InferenceServicer(VLLMControl(vllm_url), str(model_dir)),
                [inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name],
            ),
            "gateway": servers.add(
                gateway_pb2_grpc.add_GatewayControlServicer_to_server,
                lambda: GatewayControlServicer(Admission()),
                [gateway_pb2.DESCRIPTOR.services_by_name["GatewayControl"].full_name],
            ),
        }
        # The merger's and scheduler's services only read their object's counters and state (Stop sets
        # a flag): built over a Merger and a Run that hold no Redis connection.
        ports["merger"] = servers.add(
            merger_pb2_grpc.add_MergerServicer_to_server,
            lambda: MergerStatusServicer(Merger(None, Keys("fuzz"), MergerConfig(), submit=None)),
            [merger_pb2.DESCRIPTOR.services_by_name["Merger"].full_name],
        )
        run_cfg = RunConfig(run_id="fuzz", steps=3, tasks_per_step=1, group_size=2, seed=0, run_dir=tmp)
        ports["scheduler"] = servers.add(
            scheduler_pb2_grpc.add_SchedulerServicer_to_server,
            lambda: SchedulerServicer(Run(None, Keys("fuzz"), run_cfg, Stubs(None, None, None), tasks=[])),
            [scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name],
        )
        channels = {name: grpc.insecure_channel(f"127.0.0.1:{port}") for name, port in ports.items()}
        try:
            yield channels
        finally:
            for ch in channels.values():
                ch.close()
            servers.close()


def methods(descriptor, service: str) -> list[tuple[str, type]]:
    """(full method path, request class) of every method of `service`."""
    from google.protobuf import message_factory

    svc = descriptor.services_by_name[service]
    return [
        (f"/{svc.full_name}/{m.name}", message_factory.GetMessageClass(m.input_type)) for m in svc.methods
    ]


SERVICES = {
    "trainer": methods(trainer_pb2.DESCRIPTOR, "Trainer"),
    "inference": methods(inference_pb2.DESCRIPTOR, "Inference"),
    "gateway": methods(gateway_pb2.DESCRIPTOR, "GatewayControl"),
    "merger": methods(merger_pb2.DESCRIPTOR, "Merger"),
    "scheduler": methods(scheduler_pb2.DESCRIPTOR, "Scheduler"),
}
ALL_METHODS = [(name, path, cls) for name, ms in SERVICES.items() for path, cls in ms]


def raw_call(ch: grpc.Channel, path: str, payload: bytes) -> grpc.StatusCode:
    try:
        ch.unary_unary(path)(payload, timeout=60)
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        return exc.code()


def still_serving(ch: grpc.Channel) -> bool:
    reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def parses(cls, payload: bytes) -> bool:
    try:
        cls.FromString(payload)
        return True
    except (DecodeError, RuntimeError, ValueError):
        return False


@pytest.mark.parametrize(("service", "path", "cls"), ALL_METHODS, ids=[p for _, p, _ in ALL_METHODS])
def test_arbitrary_bytes_get_a_client_error_never_a_crash(stack, service, path, cls):
    ch = stack[service]
    seen: set[grpc.StatusCode] = set()

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(st.binary(max_size=256))
    def one(payload: bytes) -> None:
        code = raw_call(ch, path, payload)
        seen.add(code)
        assert code in CLIENT_CODES, (path, payload, code)
        if not parses(cls, payload):  # bytes that are no message of the method: the caller's mistake
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (path, payload, code)

    one()
    assert still_serving(ch)
    assert grpc.StatusCode.INVALID_ARGUMENT in seen  # the generator did reach the refusal


def test_garbage_is_invalid_argument_not_internal(stack):
    # The one fixed case, readable in a failure: 0xff is no valid protobuf tag.
    assert raw_call(stack["trainer"], "/tether.v1.Trainer/SubmitGroup", b"\xff\xff\xff") == (
        grpc.StatusCode.INVALID_ARGUMENT
    )


VOCAB = 40  # the tiny model's


def good_sample(group_id: str, n: int = 4) -> types_pb2.Sample:
    return types_pb2.Sample(
        rollout_id="r0",
        group_id=group_id,
        task_id="t",
        token_ids=list(range(1, n + 1)),
        loss_mask=[0] + [1] * (n - 1),
        rollout_logprobs=[0.0] + [-1.0] * (n - 1),
        advantages=[0.0] + [0.5] * (n - 1),
        reward=1.0,
        weight_version=0,
        rollout_sequences=1,
        weight_spans=[types_pb2.WeightSpan(version=0, start=0, end=n)],
    )


# Each defect breaks one rule a trainable sample must keep.
DEFECTS: dict[str, Callable[[types_pb2.Sample, int], None]] = {
    "token id below 0": lambda s, v: s.token_ids.__setitem__(1, -abs(v) - 1),
    "token id past the vocabulary": lambda s, v: s.token_ids.__setitem__(1, VOCAB + abs(v)),
    "mask not 0/1": lambda s, v: s.loss_mask.__setitem__(1, 2 + abs(v)),
    "short mask": lambda s, v: s.loss_mask.pop(),
    "long logprobs": lambda s, v: s.rollout_logprobs.append(-1.0),
    "short advantages": lambda s, v: s.advantages.pop(),
    "nan logprob": lambda s, v: s.rollout_logprobs.__setitem__(1, math.nan),
    "inf advantage": lambda s, v: s.advantages.__setitem__(1, math.inf * (1 if v >= 0 else -1)),
    "one token": lambda s, v: (
        s.ClearField("token_ids"),
        s.token_ids.append(1),
        s.ClearField("loss_mask"),
        s.loss_mask.append(1),
        s.ClearField("rollout_logprobs"),
        s.rollout_logprobs.append(-1.0),
        s.ClearField("advantages"),
        s.advantages.append(1.0),
    ),
}


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(
    defect=st.sampled_from(sorted(DEFECTS)),
    value=st.integers(-(2**31) + 64, 2**31 - 64),
    n=st.integers(2, 12),
    rollouts=st.integers(-(2**31), 2**31 - 1),
)
def test_bad_groups_are_refused_and_never_buffered(stack, defect, value, n, rollouts):
    stub = trainer_pb2_grpc.TrainerStub(stack["trainer"])
    bad = good_sample("bad", n)
    DEFECTS[defect](bad, value)
    request = trainer_pb2.SubmitGroupRequest(
        group_id=f"bad-{defect}-{value}-{n}", samples=[good_sample("bad", n), bad], rollouts=rollouts
    )
    with pytest.raises(grpc.RpcError) as err:
        stub.SubmitGroup(request, timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (defect, err.value.details())
    assert stub.GetStatus(types_pb2.Empty(), timeout=10).buffered_groups == 0


def test_no_group_id_and_no_samples_are_refused(stack):
    stub = trainer_pb2_grpc.TrainerStub(stack["trainer"])
    for request in (
        trainer_pb2.SubmitGroupRequest(group_id="", samples=[good_sample("x")], rollouts=1),
        trainer_pb2.SubmitGroupRequest(group_id="empty", samples=[], rollouts=1),
    ):
        with pytest.raises(grpc.RpcError) as err:
            stub.SubmitGroup(request, timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert stub.GetStatus(types_pb2.Empty(), timeout=10).buffered_groups == 0


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(
    step=st.integers(-(2**63), 2**63 - 1),
    min_groups=st.integers(-(2**31), 2**31 - 1),
    max_groups=st.integers(-(2**31), 2**31 - 1),
    ids=st.lists(st.text(max_size=20), max_size=3),
)
def test_train_step_out_of_range_never_trains(stack, step, min_groups, max_groups, ids):
    # Nothing is buffered: whatever the numbers, no step may train (and none may crash the trainer).
    stub = trainer_pb2_grpc.TrainerStub(stack["trainer"])
    before = stub.GetStatus(types_pb2.Empty(), timeout=10)
    request = trainer_pb2.TrainStepRequest(
        step=step, min_groups=min_groups, max_groups=max_groups, group_ids=ids, drop_group_ids=ids
    )
    try:
        stub.TrainStep(request, timeout=60)
        code = grpc.StatusCode.OK
    except grpc.RpcError as exc:
        code = exc.code()
    assert code in CLIENT_CODES - {grpc.StatusCode.OK}, (request, code)
    after = stub.GetStatus(types_pb2.Empty(), timeout=10)
    assert (after.weight_version, after.steps_done) == (before.weight_version, before.steps_done)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(
    timeout=st.floats(allow_nan=True, allow_infinity=True, width=64),
    version=st.integers(-(2**63), 2**63 - 1),
)
def test_gateway_control_out_of_range(stack, timeout, version):
    stub = gateway_pb2_grpc.GatewayControlStub(stack["gateway"])
    for call, request in (
        (
            stub.PauseAdmission,
            gateway_pb2.PauseAdmissionRequest(
                drain_timeout_s=min(timeout, 1.0) if timeout == timeout else timeout
            ),
        ),
        (stub.ResumeAdmission, gateway_pb2.ResumeAdmissionRequest(weight_version=version)),
    ):
        try:
            call(request, timeout=30)
            code = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            code = exc.code()
        assert code in CLIENT_CODES, (request, code)
    stub.ResumeAdmission(gateway_pb2.ResumeAdmissionRequest(weight_version=0), timeout=30)
    assert not stub.GetAdmission(types_pb2.Empty(), timeout=10).paused
