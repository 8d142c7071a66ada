"""The trainer as a real process (`python -m tether.trainer`): every checkpoint carries the optimizer
state and the trainer's position; a trainer killed with SIGKILL resumes from its newest checkpoint,
keeps the groups it had accepted, answers a repeated step with the recorded result instead of training
twice, and ends with exactly the weights of an uninterrupted run."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import load_file
from test_trainer import _model, _samples, _tokenizer

from tether.common.net import free_port
from tether.v1 import trainer_pb2, trainer_pb2_grpc, types_pb2

torch.set_num_threads(1)


def same_metrics(a, b) -> bool:  # type: ignore[no-untyped-def]
    """A replayed step's metrics are the recorded ones, NaN for NaN (`step_kl` is NaN when the step
    guard is off: not measured, and NaN != NaN)."""
    a, b = dict(a), dict(b)
    return a.keys() == b.keys() and all(a[k] == b[k] or (math.isnan(a[k]) and math.isnan(b[k])) for k in a)


def tiny_model_dir(path: Path) -> Path:
    """The tiny Llama (vocab 40, hidden 128, 2 layers, 2 heads, 1 KV head) with a word-level tokenizer."""
    _model().save_pretrained(path)
    _tokenizer().save_pretrained(path)
    return path


def group_requests(n_groups: int) -> list[trainer_pb2.SubmitGroupRequest]:
    """`n_groups` groups of 2 rollouts x 2 sequences; rollout logprobs are the base model's own."""
    model = _model()
    out = []
    for g in range(n_groups):
        gid = f"g{g}"
        samples = [
            types_pb2.Sample(
                rollout_id=f"{gid}-{s.rollout_id}",
                group_id=gid,
                task_id="t",
                sequence_index=s.sequence_index,
                token_ids=s.token_ids,
                loss_mask=s.loss_mask,
                rollout_logprobs=s.rollout_logprobs,
                advantages=s.advantages,
                reward=s.reward,
                weight_version=0,
                rollout_sequences=2,
            )
            for s in _samples(model, n=4, seed=100 + g)
        ]
        out.append(trainer_pb2.SubmitGroupRequest(group_id=gid, samples=samples, rollouts=2))
    return out


def step(n: int, groups: int = 1) -> trainer_pb2.TrainStepRequest:
    return trainer_pb2.TrainStepRequest(step=n, min_groups=groups, max_groups=groups)


class TrainerProcess:
    """`python -m tether.trainer` (or torchrun with `nproc` ranks) with TETHER_* settings, and a stub."""

    def __init__(
        self,
        model_dir: Path,
        checkpoint_dir: Path,
        log_path: Path,
        nproc: int = 1,
        env: dict[str, str] | None = None,
    ) -> None:
        self.port = free_port()
        self.log_path = log_path
        base = {k: v for k, v in os.environ.items() if not k.startswith("TETHER_")}
        self.env = {
            **base,
            "TETHER_TRAINER_GRPC_PORT": str(self.port),
            "TETHER_MODEL_DIR": str(model_dir),
            "TETHER_CHECKPOINT_DIR": str(checkpoint_dir),
            "TETHER_DEVICE": "cpu",
            "TETHER_SEED": "0",
            "TETHER_LR": "0.01",
            "TETHER_LOG_LEVEL": "INFO",
            "OMP_NUM_THREADS": "1",
            **(env or {}),
        }
        if nproc == 1:
            self.cmd = [sys.executable, "-m", "tether.trainer"]
        else:
            self.cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nproc-per-node={nproc}",
                "--master-addr=127.0.0.1",
                f"--master-port={free_port()}",
                "-m",
                "tether.trainer",
            ]
        self.proc: subprocess.Popen | None = None
        self.channel: grpc.Channel | None = None

    def start(self) -> TrainerProcess:
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            self.cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = trainer_pb2_grpc.TrainerStub(self.channel)
        return self

    def wait_ready(self, timeout: float = 180.0) -> TrainerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"trainer exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                self.stub.GetStatus(types_pb2.Empty(), timeout=2)
                return self
            except grpc.RpcError:
                time.sleep(0.3)
        raise AssertionError(f"trainer not ready after {timeout}s:\n{self.log_tail()}")

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def kill(self) -> None:
        """SIGKILL, no goodbye."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
        self.channel.close()

    def stop(self, timeout: float = 60.0) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
            raise
        finally:
            self.channel.close()

    def cleanup(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def _weights(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_killed_trainer_resumes_and_matches_an_uninterrupted_run(tmp_path):
    model_dir = tiny_model_dir(tmp_path / "model")
    groups = group_requests(3)
    straight = TrainerProcess(model_dir, tmp_path / "straight", tmp_path / "straight.log").start()
    crashing = TrainerProcess(model_dir, tmp_path / "crashing", tmp_path / "crashing.log").start()
    restarted = None
    try:
        straight.wait_ready()
        crashing.wait_ready()
        for proc in (straight, crashing):
            for g in groups:
                assert not proc.stub.SubmitGroup(g).duplicate
        expected = [straight.stub.TrainStep(step(n)) for n in (1, 2, 3)]
        assert [r.weight_version for r in expected] == [1, 2, 3]
        bad = group_requests(4)[3]
        bad.samples[1].token_ids[2] = 99
        with pytest.raises(grpc.RpcError) as err:
            straight.stub.SubmitGroup(bad)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "vocabulary" in err.value.details() and bad.samples[1].rollout_id in err.value.details()
        assert straight.stop() == 0  # SIGTERM drains and exits cleanly
        first = [crashing.stub.TrainStep(step(n)) for n in (1, 2)]
        assert [r.weight_version for r in first] == [1, 2]
        crashing.kill()

        restarted = TrainerProcess(model_dir, tmp_path / "crashing", tmp_path / "restarted.log").start()
        restarted.wait_ready()
        status = restarted.stub.GetStatus(types_pb2.Empty())
        # Resumed at version 2, with the one accepted-but-untrained group still buffered.
        assert (status.weight_version, status.steps_done, status.buffered_groups) == (2, 2, 1)
        assert status.HasField("last_step") and status.last_step == 2
        assert restarted.stub.SubmitGroup(groups[0]).duplicate  # trained before the crash
        # The scheduler repeats step 2 (it crashed before recording the push): nothing is trained.
        again = restarted.stub.TrainStep(step(2))
        assert again.replayed and again.weight_version == 2
        assert again.checkpoint_dir == first[1].checkpoint_dir
        assert same_metrics(again.metrics, first[1].metrics)
        third = restarted.stub.TrainStep(step(3))
        assert not third.replayed and third.weight_version == 3
        assert restarted.stub.GetStatus(types_pb2.Empty()).steps_done == 3
        with pytest.raises(grpc.RpcError) as err:
            restarted.stub.TrainStep(step(4))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # nothing left to train on
    finally:
        for proc in (straight, crashing, restarted):
            if proc is not None:
                proc.cleanup()

    a, b = _weights(tmp_path / "straight" / "v000003"), _weights(tmp_path / "crashing" / "v000003")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=1e-6, rtol=0, msg=name)
    assert third.metrics["loss"] == pytest.approx(expected[2].metrics["loss"], abs=1e-7)
    state = torch.load(tmp_path / "crashing" / "v000003" / "trainer_state.pt", weights_only=True)
    assert state["version"] == 3 and state["steps_done"] == 3
    assert state["trained_groups"] == ["g0", "g1", "g2"] and sorted(state["records"]) == [1, 2, 3]
    assert not list((tmp_path / "crashing" / "buffer").glob("*.group"))


def trainer_settings(model_dir: Path, folder: Path, **overrides):  # type: ignore[no-untyped-def]
    """The settings of an in-process trainer on the CPU: `model_dir`, checkpoints in `folder`."""
    from tether.trainer.main import TrainerSettings

    return TrainerSettings(
        trainer_grpc_port=0,
        model_dir=str(model_dir),
        checkpoint_dir=str(folder),
        device="cpu",
        **{"lr": 0.01, **overrides},
    )


def _core(model_dir: Path, folder: Path, **overrides):
    """A rank-0 trainer core built by the service's own build/resume path, in this process."""
    from tether.trainer.distributed import Dist
    from tether.trainer.main import build
    from tether.trainer.steps import TrainerCore

    s = trainer_settings(model_dir, folder, **overrides)
    runner, tokenizer, resume = build(s, Dist())
    return TrainerCore(
        runner,
        tokenizer,
        folder,
        resumed=resume.state if resume else None,
        settings={"lora_rank": s.lora_rank},
    )


def _train(core, n: int, *args, **kwargs):
    plan = core.plan(n, *(args or (1, 1)), **kwargs)
    record = core.execute(plan)
    core.finish(plan, record)
    return record


def _groups(n: int):
    from tether.common.records import SampleRecord

    return [
        (g.group_id, [SampleRecord.from_proto(p) for p in g.samples], g.rollouts) for g in group_requests(n)
    ]


def test_lora_trainer_resumes_in_process(tmp_path):
    """LoRA + activation checkpointing through the same build/resume path, without subprocesses:
    checkpoints hold merged weights, the adapter and its optimizer state resume from trainer_state."""
    pytest.importorskip("peft")
    from tether.trainer.distributed import Dist
    from tether.trainer.main import TrainerSettings, build

    model_dir = tiny_model_dir(tmp_path / "model")
    groups = _groups(3)
    lora = {"lora_rank": 4, "lora_alpha": 8.0, "gradient_checkpointing": True}
    straight = _core(model_dir, tmp_path / "a", **lora)
    for g in groups:
        straight.submit(*g)
    assert [_train(straight, n).weight_version for n in (1, 2, 3)] == [1, 2, 3]
    first = _core(model_dir, tmp_path / "b", **lora)
    for g in groups:
        first.submit(*g)
    _train(first, 1)
    _train(first, 2)
    del first
    second = _core(model_dir, tmp_path / "b", **lora)
    assert second.version == 2 and list(second.groups) == ["g2"]
    assert _train(second, 3).weight_version == 3
    a, b = _weights(tmp_path / "a" / "v000003"), _weights(tmp_path / "b" / "v000003")
    assert a.keys() == set(_weights(model_dir))  # merged: plain HF names, no adapter tensors
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=1e-6, rtol=0, msg=name)
    with pytest.raises(SystemExit, match="lora_rank"):  # a LoRA run does not resume as full fine-tuning
        build(
            TrainerSettings(
                trainer_grpc_port=0,
                model_dir=str(model_dir),
                checkpoint_dir=str(tmp_path / "b"),
                device="cpu",
            ),
            Dist(),
        )


def test_scheduler_chosen_groups_and_drops(tmp_path):
    from tether.trainer.steps import NotReady

    model_dir = tiny_model_dir(tmp_path / "model")
    groups = _groups(4)
    core = _core(model_dir, tmp_path / "ckpt")
    for g in groups:
        core.submit(*g)
    record = _train(core, 0, 0, 0, group_ids=["g2", "g0"], drop_ids=["g1", "g0"])
    assert record.groups == ["g2", "g0"] and record.metrics["groups_dropped"] == 1.0
    assert record.metrics["samples"] == 8.0 and list(core.groups) == ["g3"]
    assert core.submit(*groups[1])[1]  # dropped: a resubmission is a duplicate
    with pytest.raises(NotReady, match="already trained or dropped"):
        core.plan(1, 0, 0, group_ids=["g0"])
    with pytest.raises(NotReady, match="not buffered"):
        core.plan(1, 0, 0, group_ids=["g9"])
    assert _train(core, 1).groups == ["g3"]
    again = _core(model_dir, tmp_path / "ckpt")  # restarted: trained and dropped groups stay consumed
    assert again.version == 2 and not again.groups
    assert all(again.submit(*g)[1] for g in groups)
    assert again.plan(0, 0, 0).replayed


def test_settings_fail_fast():
    from pydantic import ValidationError

    from tether.trainer.main import TrainerSettings

    base = {"trainer_grpc_port": 0, "model_dir": "m", "checkpoint_dir": "c"}
    for bad in (
        {"off_policy": "is"},
        {"loss_mode": "mean"},
        {"mask_low": 1.5},
        {"lora_rank": 4, "fsdp": True},
    ):
        with pytest.raises(ValidationError):
            TrainerSettings(**base, **bad)


@pytest.mark.slow  # two trainer processes and an 8 s step (~30 s on an idle 2-core box)
def test_sigterm_in_the_middle_of_a_slow_step_finishes_checkpoints_and_reports_it(tmp_path):
    """SIGTERM while a step runs (made to last 8 s, past the gRPC server's 5 s stop grace): the step
    still trains, its checkpoint is written and the scheduler's TrainStep gets its answer before the
    process exits (0); started again, the trainer answers the same step with its record (`replayed`)
    instead of training it twice, and is ready for the next."""
    import concurrent.futures

    from stack_helpers import wait_for

    model_dir = tiny_model_dir(tmp_path / "model")
    groups = group_requests(2)
    ckpt = tmp_path / "ckpt"
    slow = TrainerProcess(model_dir, ckpt, tmp_path / "slow.log", env={"TETHER_TEST_STEP_DELAY_S": "8"})
    slow.start()
    restarted = None
    try:
        slow.wait_ready()
        for g in groups:
            slow.stub.SubmitGroup(g)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(slow.stub.TrainStep, step(1), timeout=120)
            wait_for(lambda: "training step 1" in slow.log_tail(), 60, "step 1 to start", every_s=0.1)
            assert not (ckpt / "v000001").exists()  # in the middle of the step
            slow.proc.send_signal(signal.SIGTERM)
            reply = answer.result(timeout=120)
        assert (reply.step, reply.weight_version, reply.replayed) == (1, 1, False)
        assert slow.proc.wait(60) == 0
        assert (ckpt / "v000001" / "trainer_state.pt").exists()
        assert "finishing 1 operation(s) in hand" in slow.log_tail()

        restarted = TrainerProcess(model_dir, ckpt, tmp_path / "restarted.log").start().wait_ready()
        assert restarted.stub.GetStatus(types_pb2.Empty()).steps_done == 1
        again = restarted.stub.TrainStep(step(1))  # a scheduler that did not record the answer
        assert again.replayed and again.weight_version == 1 and same_metrics(again.metrics, reply.metrics)
        assert restarted.stub.TrainStep(step(2)).weight_version == 2
    finally:
        slow.cleanup()
        if restarted is not None:
            restarted.cleanup()
