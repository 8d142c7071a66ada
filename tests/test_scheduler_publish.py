"""WeightPublisher (tether.scheduler.publish) against stand-ins of the Inference and Trainer stubs: path 1,
path 2, path 2 failing over to path 1, and a restarted scheduler bringing inference to the trainer's
newest weights after a push was cut short. (The same code against the real trainer and inference
servicers, over gRPC: tests/test_weight_transfer.py::test_scheduler_weight_push_wiring.)"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from fake_control import FakeInference, FakeTrainer, rpc_error
from prometheus_client import REGISTRY

from tether.scheduler.publish import WeightPublisher
from tether.v1 import trainer_pb2


def trained(version: int) -> trainer_pb2.TrainStepResponse:
    return trainer_pb2.TrainStepResponse(
        step=version - 1, weight_version=version, checkpoint_dir=f"/ckpt/v{version}"
    )


def stack(weight_push: str, version: int = 1) -> tuple[FakeInference, FakeTrainer, WeightPublisher]:
    inference = FakeInference(version - 1, f"/ckpt/v{version - 1}" if version > 1 else "")
    trainer = FakeTrainer(inference, version, f"/ckpt/v{version}")
    return inference, trainer, WeightPublisher(inference, trainer, weight_push)


def fallbacks() -> float:
    return REGISTRY.get_sample_value("tether_scheduler_weight_push_fallbacks_total") or 0.0


async def test_path_1_loads_the_checkpoint():
    inference, trainer, pub = stack("checkpoint", 2)
    assert await pub.publish(trained(2)) == 2 and pub.path == "checkpoint"
    assert inference.log == ["load:/ckpt/v2:2"] and trainer.log == []
    assert (inference.version, inference.checkpoint_dir, inference.paused) == (2, "/ckpt/v2", False)


async def test_path_1_refuses_a_load_that_reports_another_version():
    inference, _, pub = stack("checkpoint", 2)
    inference.report_version = 1
    with pytest.raises(RuntimeError, match="reports version 1, expected 2"):
        await pub.publish(trained(2))
    assert pub.path == ""


async def test_path_1_failure_reaches_the_caller():
    inference, _, pub = stack("checkpoint", 2)
    inference.fail_load = {"/ckpt/v2"}
    with pytest.raises(grpc.aio.AioRpcError):
        await pub.publish(trained(2))
    assert pub.path == "" and inference.version == 1


async def test_path_2_streams_the_weights_while_generation_is_paused():
    inference, trainer, pub = stack("nccl", 3)
    before = fallbacks()
    assert await pub.publish(trained(3)) == 3 and pub.path == "nccl"
    assert inference.log == ["pause:keep", "version", "resume"] and trainer.log == ["push:3"]
    assert (inference.version, inference.paused) == (3, False)
    assert fallbacks() == before  # no checkpoint was read


@pytest.mark.parametrize("how", ["push fails", "vLLM does not take it"])
async def test_path_2_failure_falls_back_to_path_1(how):
    inference, trainer, pub = stack("nccl", 3)
    if how == "push fails":
        trainer.fail_push = rpc_error(grpc.StatusCode.UNAVAILABLE, "bucket 2 of 5 failed")
        expect = ["pause:keep", "load:/ckpt/v3:3"]
    else:
        trainer.lose_push = True
        expect = ["pause:keep", "version", "load:/ckpt/v3:3"]
    before = fallbacks()
    assert await pub.publish(trained(3)) == 3 and pub.path == "checkpoint-fallback"
    # Still paused after the failed push, vLLM reloads the whole checkpoint (which resumes it).
    assert inference.log == expect and trainer.log == ["push:3"]
    assert (inference.version, inference.checkpoint_dir, inference.paused, inference.partial) == (
        3,
        "/ckpt/v3",
        False,
        False,
    )
    assert fallbacks() == before + 1


async def test_path_2_then_path_1_failing_reaches_the_caller():
    inference, trainer, pub = stack("nccl", 3)
    trainer.fail_push = rpc_error(grpc.StatusCode.UNAVAILABLE, "push failed")
    inference.fail_load = {"/ckpt/v3"}
    with pytest.raises(grpc.aio.AioRpcError):
        await pub.publish(trained(3))
    assert pub.path == ""


class HangingTrainer(FakeTrainer):
    """A push that never answers: the scheduler waiting on it is killed there."""

    async def PushWeights(self, req):
        await super().PushWeights(req)
        await asyncio.Event().wait()


@pytest.mark.parametrize("weight_push", ["checkpoint", "nccl"])
async def test_restart_mid_push_brings_inference_to_the_trainers_weights(weight_push):
    inference = FakeInference(1, "/ckpt/v1")
    trainer = HangingTrainer(inference, 2, "/ckpt/v2")
    if weight_push == "nccl":
        # Killed mid path 2: generation paused, vLLM serves the pushed version 2, which the adapter
        # cannot vouch for (it loaded nothing itself).
        task = asyncio.create_task(WeightPublisher(inference, trainer, "nccl").publish(trained(2)))
        while trainer.log != ["push:2"]:
            await asyncio.sleep(0)
        task.cancel()
        assert (inference.version, inference.checkpoint_dir, inference.paused) == (2, "", True)
    else:
        # Killed after the step trained, before its checkpoint was loaded; a colocated push had
        # paused generation.
        inference.paused = True
    inference.log.clear()
    restarted = WeightPublisher(inference, FakeTrainer(inference, 2, "/ckpt/v2"), weight_push)
    assert await restarted.reconcile() == 2
    assert inference.log == ["version", "load:/ckpt/v2:2"]
    assert (inference.version, inference.checkpoint_dir, inference.paused) == (2, "/ckpt/v2", False)


@pytest.mark.parametrize(
    "served, trainer_at, load",
    [
        ((2, "/ckpt/v2"), (2, "/ckpt/v2"), None),  # the push had finished: only resume generation
        ((0, ""), (0, ""), None),  # nothing trained yet: the base model stays
        ((0, ""), (3, "/ckpt/v3"), "load:/ckpt/v3:3"),  # inference restarted on its base model
        ((2, "/ckpt/v2"), (3, "/ckpt/v3"), "load:/ckpt/v3:3"),  # trained, never pushed
    ],
)
async def test_reconcile_after_a_restart(served, trainer_at, load):
    inference = FakeInference(*served)
    inference.paused = True
    pub = WeightPublisher(inference, FakeTrainer(inference, *trainer_at), "nccl")
    assert await pub.reconcile() == trainer_at[0]
    assert inference.log == ["version", load if load else "resume"]
    assert (inference.version, inference.checkpoint_dir, inference.paused) == (*trainer_at, False)
