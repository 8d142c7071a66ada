"""Path 2 of the weight push (vLLM's weight-transfer API + a broadcast per bucket), checked on CPU.

1. Bucketing properties (hypothesis): order, each tensor once, sizes, alignment, metadata, and that
   vLLM's packed consumer would receive each bucket as exactly one broadcast; pack/unpack round trip.
2. The HTTP choreography against the look-alike vLLM (tests/fakes/vllm_control.py) that checks the protocol
   and joins the transfer group as rank 1 over gloo, receiving each bucket the way vLLM's packed NCCL
   consumer does; the served weights must end equal to the trainer's state dict.
3. A failure injected on the 2nd bucket: the push raises, nothing is finished, a retry succeeds.
   The scheduler's wiring (TETHER_WEIGHT_PUSH=nccl) through the real trainer and inference services:
   pause -> the trainer's PushWeights -> resume; path 1 (checkpoint reload) when path 2 fails; a failed
   reload restores the previous checkpoint or leaves generation paused, never half-loaded weights.
4. Conformance with vLLM's own code (needs the vLLM-CPU virtualenv, else skipped): the real RL router
   and the real NCCL init/update dataclasses parse what the client sends, and vLLM's real packed
   consumer cuts our packed buffers back into the trainer's tensors.

What needs a GPU (NCCL group, vLLM's workers loading the weights) is listed in docs/weight-push.md.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from typing import Any

import grpc
import httpx
import pytest
import torch
from fakes.vllm_control import GROUP_TIMEOUT_S, FakeVLLMControl, checkpoint, serve, vllm_chunks, vllm_unpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm_cpu import VLLM_PYTHON

from tether.common.net import free_port
from tether.trainer.nccl_push import (
    PushError,
    WeightPusher,
    create_transfer_group,
    dtype_name,
    pack_bucket,
    plan_buckets,
    push_weights,
    unpack_bucket,
)
from tether.trainer.weight_transfer import TransferState, WeightTransferClient, WeightTransferError
from tether.v1 import inference_pb2

DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
]


def make_tensor(dtype: torch.dtype, shape: list[int], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(0, 100, shape, generator=g).to(dtype)


def tiny_state() -> dict[str, torch.Tensor]:
    """A real HF state dict (the tiny 2-layer Llama the CPU stack trains), norms in bf16 for a mix."""
    from tether.demo.tiny import build_model, build_tokenizer

    model = build_model(build_tokenizer(["three", "plus", "four", "is", "seven"]), seed=0)
    return {k: (v.to(torch.bfloat16) if "norm" in k else v.clone()) for k, v in model.state_dict().items()}


# -- 1. bucketing --------------------------------------------------------------------------------------

specs_strategy = st.lists(
    st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(0, 6), max_size=3)), max_size=14
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=specs_strategy, bucket_bytes=st.integers(1, 300), seed=st.integers(0, 2**16))
def test_bucketing_properties(specs, bucket_bytes, seed):
    state = {f"layer.{i}.w": make_tensor(dtype, shape, seed + i) for i, (dtype, shape) in enumerate(specs)}
    buckets = plan_buckets(state, bucket_bytes)

    # Stable order, every tensor in exactly one bucket, no empty bucket.
    assert [n for b in buckets for n in b.names] == list(state)
    assert [b.index for b in buckets] == list(range(len(buckets)))
    assert all(b.specs for b in buckets)
    for b, nxt in zip(buckets, buckets[1:], strict=False):
        # Greedy: a bucket closes only when the next tensor would overflow it or sit misaligned.
        first = nxt.specs[0]
        assert b.nbytes + first.nbytes > bucket_bytes or b.nbytes % first.dtype.itemsize
    for b in buckets:
        # Size bound (a tensor bigger than the bound travels alone).
        assert b.nbytes <= bucket_bytes or len(b.specs) == 1
        # Metadata as vLLM's NCCLWeightTransferUpdateInfo wants it, and JSON-ready.
        info = b.update_info()
        assert json.loads(json.dumps(info)) == info
        assert len(info["names"]) == len(info["dtype_names"]) == len(info["shapes"])
        for name, dname, shape in zip(info["names"], info["dtype_names"], info["shapes"], strict=True):
            assert getattr(torch, dname) == state[name].dtype
            assert shape == list(state[name].shape)
        # vLLM's consumer, told packed_buffer_size_bytes = bucket_bytes, receives it as ONE broadcast of
        # exactly the bytes the trainer packs.
        flat = pack_bucket(b, state)
        assert flat.dtype == torch.uint8 and flat.dim() == 1
        assert vllm_chunks(info, bucket_bytes) == [(b.names, flat.numel())]
        # unpack(pack(bucket)) == tensors, by our unpack and by vLLM's in-place views.
        for unpacked in (unpack_bucket(flat, info), dict(vllm_unpack(flat, info))):
            assert list(unpacked) == b.names
            for name, t in unpacked.items():
                assert t.dtype == state[name].dtype and t.shape == state[name].shape
                assert torch.equal(t, state[name])


def test_bucketing_edge_cases():
    with pytest.raises(ValueError):
        plan_buckets({"a": torch.zeros(1)}, 0)
    assert plan_buckets({}, 10) == []
    # A bf16 tensor of odd length would leave the next fp32 tensor at offset 2: new bucket.
    state = {"a": torch.zeros(3, dtype=torch.bfloat16), "b": torch.zeros(1, dtype=torch.float32)}
    assert [b.names for b in plan_buckets(state, 1 << 20)] == [["a"], ["b"]]
    # Views and non-contiguous tensors are packed by value.
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    state = {"t": base.t(), "row": base[1]}
    (bucket,) = plan_buckets(state, 1 << 20)
    out = unpack_bucket(pack_bucket(bucket, state), bucket.update_info())
    assert torch.equal(out["t"], base.t()) and torch.equal(out["row"], base[1])
    assert dtype_name(torch.bfloat16) == "bfloat16"
    # fp32 master weights sent in the serving dtype; integer tensors untouched.
    state = {"w": torch.randn(4, 3), "step": torch.arange(3)}
    (bucket,) = plan_buckets(state, 1 << 20, cast_floats_to=torch.bfloat16)
    assert bucket.update_info()["dtype_names"] == ["bfloat16", "int64"]
    out = unpack_bucket(pack_bucket(bucket, state), bucket.update_info())
    assert torch.equal(out["w"], state["w"].to(torch.bfloat16)) and torch.equal(out["step"], state["step"])

    # A sharded DTensor cannot be gathered by rank 0 alone.
    class Sharded(torch.Tensor):
        def full_tensor(self):
            raise AssertionError("must not gather")

    sharded = {"w": torch.zeros(2).as_subclass(Sharded)}
    with pytest.raises(TypeError, match="gather"):
        pack_bucket(plan_buckets(sharded, 64)[0], sharded)


def test_nccl_group_refuses_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(RuntimeError, match="CUDA"):
        create_transfer_group("127.0.0.1", free_port(), 2, backend="nccl")


BUCKET = 48 << 10  # the tiny model's 128x256 MLP matrices (128 KiB) travel alone, the rest is packed


def pusher_for(client: WeightTransferClient, **kw: Any) -> WeightPusher:
    return WeightPusher(
        client,
        master_address="127.0.0.1",
        backend="gloo",
        bucket_bytes=BUCKET,
        timeout_s=GROUP_TIMEOUT_S,
        **kw,
    )


async def test_push_over_gloo_choreography():
    state = tiny_state()
    plan = plan_buckets(state, BUCKET)
    assert len(plan) >= 4 and any(b.nbytes > BUCKET for b in plan) and any(len(b.specs) > 1 for b in plan)
    fake = FakeVLLMControl({k: torch.zeros_like(v) for k, v in state.items()})
    with serve(fake.app) as url:
        async with WeightTransferClient(url) as client:
            pusher = pusher_for(client)
            report = await pusher.push(state, 1)
            assert (report.version, report.buckets, report.tensors) == ("1", len(plan), len(state))
            assert report.bytes == sum(v.numel() * v.element_size() for v in state.values())
            fake.assert_serves(state)
            assert fake.version == "1" and await client.weight_version() == "1"
            assert client.state is TransferState.READY

            # No update after finish: refused by the client, never sent.
            with pytest.raises(WeightTransferError) as refused:
                await client.update_weights(plan[0].update_info())
            assert not refused.value.sent

            # A second push on the same group carries the next version.
            state2 = {k: (v + 1 if v.is_floating_point() else v) for k, v in state.items()}
            await pusher.push(state2, 2)
            fake.assert_serves(state2)
            assert fake.version == "2"
            await pusher.close()

    assert fake.violations == []
    one_push = ["start", *["update"] * len(plan)]
    assert fake.log == ["init", *one_push, "finish:1", *one_push, "finish:2", "shutdown"]
    # Every update carried the metadata of exactly the bytes broadcast with it (one chunk per update,
    # the tensors rebuilt from metadata + bytes equal the trainer's), in the plan's order.
    assert fake.updates == [b.names for b in plan] * 2
    assert fake.chunks_per_update == [1] * (2 * len(plan))


async def test_client_refuses_out_of_order_calls():
    fake = FakeVLLMControl({})
    with serve(fake.app) as url:
        async with WeightTransferClient(url) as client:
            for call in (
                client.start_weight_update(),
                client.update_weights({"names": [], "dtype_names": [], "shapes": []}),
                client.finish_weight_update(1),
            ):
                with pytest.raises(WeightTransferError) as err:
                    await call
                assert not err.value.sent and err.value.status is None
            assert client.state is TransferState.IDLE
        # The fake checks the order too (so its empty violation lists above mean something).
        resp = httpx.post(f"{url}/start_weight_update")
        assert resp.status_code == 500
        resp = httpx.post(
            f"{url}/update_weights", json={"update_info": {"names": [], "dtype_names": [], "shapes": []}}
        )
        assert resp.status_code == 500
    assert fake.log == [] and len(fake.violations) == 2


@pytest.mark.parametrize("mode", ["after", "before"])
async def test_failure_on_second_bucket_then_retry(mode):
    """The fake answers 500 to the 2nd bucket, having received its broadcast ("after": a load error) or
    not ("before": the trainer's broadcast is left without a peer). The push raises, nothing is
    finished, the version stays; a retry from start (on a new group, as PushError says) succeeds."""
    state = tiny_state()
    plan = plan_buckets(state, BUCKET)
    old = {k: torch.zeros_like(v) for k, v in state.items()}
    fake = FakeVLLMControl(old, fail=(1, mode))
    with serve(fake.app) as url:
        async with WeightTransferClient(url) as client:
            pusher = pusher_for(client)
            await pusher.connect()
            t0 = time.monotonic()
            with pytest.raises(PushError) as err:
                await push_weights(state, client, pusher.group, BUCKET, version=1)
            # It fails at once: it does not wait for a broadcast the worker will never join.
            assert time.monotonic() - t0 < GROUP_TIMEOUT_S / 2
            assert (err.value.step, err.value.bucket, err.value.retry_from) == ("update", 1, "init")
            cause = err.value.__cause__
            assert isinstance(cause, WeightTransferError) and cause.status == 500
            assert "injected failure" in cause.detail

            # Nothing finished: vLLM keeps the old version, the client will not finish this session.
            assert not any(entry.startswith("finish") for entry in fake.log)
            assert fake.version == "0" and await client.weight_version() == "0"
            assert client.state is TransferState.READY
            with pytest.raises(WeightTransferError) as refused:
                await client.finish_weight_update(1)
            assert not refused.value.sent
            # As in vLLM, bucket 0 was already applied: the served weights are mixed until the retry.
            assert torch.equal(fake.weights[plan[0].names[0]], state[plan[0].names[0]])
            assert not torch.equal(fake.weights[plan[-1].names[-1]], state[plan[-1].names[-1]])

            await pusher.reset()
            t0 = time.monotonic()
            report = await pusher.push(state, 1)
            assert time.monotonic() - t0 < GROUP_TIMEOUT_S / 2
            assert report.buckets == len(plan)
            fake.assert_serves(state)
            assert fake.version == "1"
            await pusher.close()
    assert fake.violations == []
    assert fake.log == [
        "init",
        "start",
        "update",
        "shutdown",
        "init",
        "start",
        *["update"] * len(plan),
        "finish:1",
        "shutdown",
    ]


async def test_pusher_retries_by_itself():
    state = tiny_state()
    fake = FakeVLLMControl({k: torch.zeros_like(v) for k, v in state.items()}, fail=(2, "before"))
    with serve(fake.app) as url:
        async with WeightTransferClient(url) as client:
            pusher = pusher_for(client, attempts=2)
            await pusher.push(state, 5)
            await pusher.close()
    fake.assert_serves(state)
    assert fake.version == "5" and fake.violations == []
    assert fake.log[:5] == ["init", "start", "update", "update", "shutdown"]
    assert fake.log.count("init") == 2 and fake.log.count("finish:5") == 1


async def test_rejected_init_fails_fast():
    fake = FakeVLLMControl({}, reject_init=True)
    with serve(fake.app) as url:
        async with WeightTransferClient(url) as client:
            pusher = pusher_for(client, attempts=1)
            t0 = time.monotonic()
            with pytest.raises(PushError) as err:
                await pusher.push({"w": torch.ones(4)}, 1)
            # The trainer's half of the rendezvous is still waiting on its thread: not awaited.
            assert time.monotonic() - t0 < GROUP_TIMEOUT_S / 2
            assert err.value.step == "init"
            assert isinstance(err.value.__cause__, WeightTransferError) and err.value.__cause__.status == 400
            assert client.state is TransferState.IDLE


# -- 3b. the scheduler's path-2 wiring through the real trainer and inference services ----------------


async def test_scheduler_weight_push_wiring(tmp_path):
    """Scheduler (Run.load_weights) -> trainer (PushWeights, real TrainerCore, gloo group) and inference
    adapter (real InferenceServicer) -> the look-alike vLLM, all over real gRPC."""
    from test_trainer_resume import group_requests, tiny_model_dir

    from tether.common.broker import Keys
    from tether.common.grpc_server import channel, start_server
    from tether.common.vllm_client import VLLMControl
    from tether.inference.servicer import InferenceServicer
    from tether.scheduler.run import Run, RunConfig, Stubs
    from tether.trainer.distributed import Dist
    from tether.trainer.main import TrainerSettings, build, weight_pusher
    from tether.trainer.servicer import TrainerServicer
    from tether.trainer.steps import Trainer, TrainerCore
    from tether.v1 import inference_pb2_grpc, trainer_pb2, trainer_pb2_grpc, types_pb2

    model_dir = tiny_model_dir(tmp_path / "model")
    fake = FakeVLLMControl(checkpoint(str(model_dir)))
    servers = []
    with serve(fake.app) as url:
        settings = TrainerSettings(
            trainer_grpc_port=0,
            model_dir=str(model_dir),
            checkpoint_dir=str(tmp_path / "ckpt"),
            device="cpu",
            lr=0.01,
            weight_push="nccl",
            vllm_url=url,
            weight_push_backend="gloo",
            weight_push_bucket_mb=BUCKET / 2**20,
            weight_push_attempts=1,
            weight_push_timeout_s=GROUP_TIMEOUT_S,
        )
        runner, tokenizer, _ = build(settings, Dist())
        core = TrainerCore(runner, tokenizer, tmp_path / "ckpt", keep=0, keep_push_state=True)
        steps = Trainer(core, pusher=weight_pusher(settings, Dist()))
        trainer = TrainerServicer(steps)
        inference = InferenceServicer(VLLMControl(url), str(model_dir))
        for add, servicer in (
            (trainer_pb2_grpc.add_TrainerServicer_to_server, trainer),
            (inference_pb2_grpc.add_InferenceServicer_to_server, inference),
        ):
            server, _, port = await start_server(0, lambda srv, a=add, s=servicer: a(s, srv) or [])
            servers.append((server, channel(f"127.0.0.1:{port}")))
        stubs = Stubs(
            gateway=None,
            trainer=trainer_pb2_grpc.TrainerStub(servers[0][1]),
            inference=inference_pb2_grpc.InferenceStub(servers[1][1]),
        )
        run = Run(
            None,
            Keys("t"),
            RunConfig(
                run_id="r",
                steps=5,
                tasks_per_step=1,
                group_size=2,
                seed=0,
                run_dir=tmp_path,
                weight_push="nccl",
            ),
            stubs,
            [],
        )
        try:
            for g in group_requests(5):
                await stubs.trainer.SubmitGroup(g)

            async def step(n: int):
                return await stubs.trainer.TrainStep(
                    trainer_pb2.TrainStepRequest(step=n, min_groups=1, max_groups=1)
                )

            def served_is(resp) -> None:
                assert fake.version == str(resp.weight_version) and not fake.paused
                ckpt = checkpoint(resp.checkpoint_dir)
                assert ckpt.keys() == fake.weights.keys()
                assert all(torch.equal(fake.weights[k], v) for k, v in ckpt.items()), (
                    "not the checkpoint's weights"
                )

            # Path 2: generation paused, the trainer streams every bucket, vLLM finishes the version and
            # drops its prefix cache, generation resumes. No checkpoint is read.
            first = await step(0)
            assert await run.load_weights(first) == 1 and run.push_path == "nccl"
            served_is(first)
            n_buckets = len(plan_buckets(core.push_state(1), BUCKET))
            assert fake.log == [
                "pause:keep",
                "init",
                "start",
                *["update"] * n_buckets,
                "finish:1",
                "reset",
                "resume",
            ]
            assert (await stubs.trainer.GetStatus(types_pb2.Empty())).checkpoint_dir == first.checkpoint_dir
            # The adapter did not load it, so it does not vouch for a checkpoint folder.
            assert (await stubs.inference.GetWeightVersion(types_pb2.Empty())).checkpoint_dir == ""

            # Path 2 fails on its 2nd bucket (the 1st is already in): path 1 reloads the whole checkpoint.
            fake.log.clear()
            fake.fail = (1, "before")
            second = await step(1)
            assert await run.load_weights(second) == 2 and run.push_path == "checkpoint-fallback"
            served_is(second)
            assert fake.log[:4] == ["pause:keep", "start", "update", "shutdown"]
            assert "finish:2" not in fake.log and fake.log[-4:] == [
                "pause:keep",
                "reload:v000002",
                "reset",
                "resume",
            ]
            assert (
                await stubs.inference.GetWeightVersion(types_pb2.Empty())
            ).checkpoint_dir == second.checkpoint_dir

            # Both paths fail (the reload part-way): inference reloads the checkpoint it served before and
            # resumes on that version; the scheduler sees the failure and can retry.
            fake.log.clear()
            fake.fail = (0, "after")
            third = await step(2)
            fake.fail_reload = {third.checkpoint_dir}
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await run.load_weights(third)
            assert (
                err.value.code() == grpc.StatusCode.UNAVAILABLE
                and "still serving version 2" in err.value.details()
            )
            served_is(second)
            assert fake.log[-4:] == ["reload-failed:v000003", "reload:v000002", "reset", "resume"]
            fake.fail_reload = set()
            assert await run.load_weights(third) == 3 and run.push_path == "nccl"  # the retry
            served_is(third)

            # Both fail after a path-2 push, so the adapter knows no checkpoint of what vLLM serves: it
            # keeps generation paused (health NOT_SERVING) until a load succeeds.
            fourth = await step(3)
            fake.fail, fake.fail_reload = (0, "after"), {fourth.checkpoint_dir}
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await run.load_weights(fourth)
            assert "stays paused" in err.value.details()
            assert fake.paused and fake.version == "3" and inference.loader.unsafe
            # The scheduler's retry: this time path 2 completes, vLLM reports the new version, and the
            # adapter no longer holds generation (it did until a path-1 load succeeded).
            fake.fail, fake.fail_reload = None, set()
            assert await run.load_weights(fourth) == 4 and run.push_path == "nccl"
            served_is(fourth)
            assert not inference.loader.unsafe

            # The same failure, recovered by a path-1 load.
            fifth = await step(4)
            fake.fail, fake.fail_reload = (0, "after"), {fifth.checkpoint_dir}
            with pytest.raises(grpc.aio.AioRpcError):
                await run.load_weights(fifth)
            assert fake.paused and inference.loader.unsafe
            fake.fail_reload = set()
            fake.log.clear()
            await stubs.inference.LoadWeights(
                inference_pb2.LoadWeightsRequest(checkpoint_dir=fifth.checkpoint_dir, version=5)
            )
            served_is(fifth)
            assert not inference.loader.unsafe and fake.log == [
                "pause:keep",
                "reload:v000005",
                "reset",
                "resume",
            ]
        finally:
            await steps.close_pusher()
            for server, ch in servers:
                await ch.close()
                await server.stop(0)
            await inference.vllm.close()
    assert fake.violations == []


# -- 4. conformance with vLLM's own code ------------------------------------------------------------------

CONFORMANCE_SERVER = r'''
"""Runs in the vLLM-CPU virtualenv: vLLM's RL router over a stub engine that parses with vLLM's NCCL
dataclasses and receives with vLLM's packed consumer (CUDA streams stubbed: this is CPU)."""
import contextlib, sys
import torch, uvicorn
from fastapi import FastAPI
import vllm.distributed.weight_transfer.packed_tensor as packed
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferInitInfo, NCCLWeightTransferUpdateInfo
from vllm.entrypoints.rl.online.api_router import router

class _Stream:
    def synchronize(self):
        pass

packed._get_streams = lambda device, n: tuple(_Stream() for _ in range(n))
torch.cuda.stream = lambda stream: contextlib.nullcontext()
torch.accelerator.current_device_index = lambda: 0

payload = torch.load(sys.argv[1], weights_only=True)

class Wire:
    """Stands for the NCCL group: each broadcast takes the trainer's next packed buffer."""
    def __init__(self, flats):
        self.flats, self.sizes = list(flats), []
    def broadcast(self, tensor, src):
        assert src == 0
        flat = self.flats.pop(0)
        self.sizes.append((tensor.numel(), flat.numel()))
        assert tensor.dtype == torch.uint8 and tensor.numel() == flat.numel(), (tensor.shape, flat.shape)
        tensor.copy_(flat)

class Engine:
    def __init__(self):
        self.calls, self.received, self.broadcasts, self.init = [], {}, [], None
        self.wire = Wire(payload["flats"])
    async def init_weight_transfer_engine(self, request):
        self.init = NCCLWeightTransferInitInfo(**request.init_info)
        self.calls.append("init")
    async def start_weight_update(self):
        self.calls.append("start")
    async def update_weights(self, request):
        info = NCCLWeightTransferUpdateInfo(**request.update_info)
        before = len(self.wire.sizes)
        packed.packed_nccl_broadcast_consumer(
            iterator=((n, (s, getattr(torch, d))) for n, d, s in zip(info.names, info.dtype_names, info.shapes)),
            group=self.wire, src=0, post_unpack_func=lambda pairs: self.received.update(
                (n, t.clone()) for n, t in pairs),
            buffer_size_bytes=self.init.packed_buffer_size_bytes, num_buffers=self.init.packed_num_buffers,
            device="cpu")
        self.broadcasts.append(len(self.wire.sizes) - before)
        self.calls.append("update")
    async def finish_weight_update(self, weight_version=None):
        self.calls.append(f"finish:{weight_version}")
    async def shutdown_weight_transfer_engine(self):
        self.calls.append("shutdown")

app = FastAPI()
app.include_router(router)
engine = app.state.engine_client = Engine()

@app.get("/_result")
def result():
    expected = payload["expected"]
    bad = [k for k in expected if k not in engine.received or engine.received[k].dtype != expected[k].dtype
           or not torch.equal(engine.received[k], expected[k])]
    return {"calls": engine.calls, "broadcasts": engine.broadcasts, "left": len(engine.wire.flats),
            "bad": bad, "extra": sorted(set(engine.received) - set(expected)),
            "init": engine.init and {"packed": engine.init.packed, "buffer": engine.init.packed_buffer_size_bytes,
                                     "world_size": engine.init.world_size, "rank_offset": engine.init.rank_offset}}

uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[2]), log_level="warning")
'''


@pytest.mark.slow  # starts Python in the vLLM-CPU virtualenv (vLLM's import alone takes ~10-30 s)
async def test_conformance_with_vllm_code(tmp_path):
    if not VLLM_PYTHON.exists():
        pytest.skip(f"no vLLM-CPU virtualenv at {VLLM_PYTHON}")
    state = tiny_state()
    state["extra.int_buffer"] = torch.arange(7, dtype=torch.int64)
    state["extra.odd_bf16"] = torch.randn(5).to(torch.bfloat16)  # forces an alignment break before...
    state["extra.fp32"] = torch.randn(3)  # ...this one
    plan = plan_buckets(state, BUCKET)
    torch.save(
        {"flats": [pack_bucket(b, state).clone() for b in plan], "expected": state}, tmp_path / "payload.pt"
    )
    (tmp_path / "server.py").write_text(CONFORMANCE_SERVER)
    port = free_port()
    log = (tmp_path / "server.log").open("wb")
    proc = subprocess.Popen(
        [str(VLLM_PYTHON), str(tmp_path / "server.py"), str(tmp_path / "payload.pt"), str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        async with httpx.AsyncClient() as http:
            while True:
                if proc.poll() is not None:
                    pytest.fail(f"server exited:\n{(tmp_path / 'server.log').read_text()[-3000:]}")
                try:
                    if (await http.get(f"{url}/_result", timeout=2)).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    pytest.fail("conformance server did not come up")
                await asyncio.sleep(0.3)
        async with WeightTransferClient(url) as client:
            await client.init_engine(
                master_address="127.0.0.1", master_port=29555, world_size=2, packed_buffer_size_bytes=BUCKET
            )
            await client.start_weight_update()
            for bucket in plan:
                await client.update_weights(bucket.update_info())
            await client.finish_weight_update(7)
            await client.shutdown_engine()
            result = (await client.http.get("/_result")).json()
    finally:
        proc.terminate()
        proc.wait(20)
        log.close()
    assert result["init"] == {"packed": True, "buffer": BUCKET, "world_size": 2, "rank_offset": 1}
    assert result["calls"] == ["init", "start", *["update"] * len(plan), "finish:7", "shutdown"]
    assert result["broadcasts"] == [1] * len(plan)  # vLLM's consumer: one broadcast per bucket
    assert result["left"] == 0 and result["bad"] == [] and result["extra"] == []
