"""Data-parallel training on CPU (gloo): a step whose batch is split over 2 ranks updates the weights
exactly as one rank training the whole batch, for token-mean and rollout-mean, also when a rank gets
no sample at all; and the torchrun-launched service (rank 0 serves, rank 1 follows) does the same."""

from __future__ import annotations

import copy
import os

import gloo_ranks
import pytest
import torch
import torch.multiprocessing as mp
from test_trainer import _flat, _model, _samples
from test_trainer_resume import TrainerProcess, _weights, group_requests, step, tiny_model_dir

from tether.common.net import free_port
from tether.common.records import SampleRecord
from tether.trainer import distributed
from tether.trainer.train import StepConfig, choose_attention, shard_rows, train_step
from tether.v1 import types_pb2

torch.set_num_threads(1)

CASES = {  # name: (loss mode, how many of the samples)
    "token-mean": ("token-mean", 7),
    "rollout-mean": ("rollout-mean", 7),
    "one-sample": ("rollout-mean", 1),
}


def _cfg(mode: str) -> StepConfig:
    # Small micro-batches, so the ranks run different numbers of them; active grad clipping.
    return StepConfig(loss_mode=mode, micro_batch_tokens=24, max_grad_norm=1.0)


def _train(engine, model, samples: list[SampleRecord], mode: str, rank: int, world: int):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    metrics = train_step(engine, opt, samples, _cfg(mode), rank=rank, world=world)
    return _flat(model), metrics


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    d = gloo_ranks.join(rank, world, port)
    try:
        base = _model()
        samples = _samples(base, n=7)
        results = {}
        for name, (mode, n) in CASES.items():
            model = copy.deepcopy(base)
            results[name] = _train(distributed.wrap(model, d), model, samples[:n], mode, d.rank, d.world)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        distributed.shutdown()


def test_shards_cover_the_batch_once():
    lengths = [9, 3, 7, 5, 12, 2, 2]
    shards = [shard_rows(lengths, r, 3) for r in range(3)]
    assert sorted(i for s in shards for i in s) == list(range(len(lengths)))
    loads = [sum(lengths[i] for i in s) for s in shards]
    assert max(loads) - min(loads) <= max(lengths)


def test_two_gloo_ranks_match_one_rank(tmp_path):
    mp.spawn(_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    base = _model()
    samples = _samples(base, n=7)
    for name, (mode, n) in CASES.items():
        model = copy.deepcopy(base)
        ref, ref_metrics = _train(model, model, samples[:n], mode, 0, 1)
        assert float((ref - _flat(base)).abs().max()) > 1e-4, name  # the step did move the weights
        for rank in ranks:
            params, metrics = rank[name]
            torch.testing.assert_close(params, ref, atol=1e-6, rtol=0, msg=name)
            assert metrics["loss"] == pytest.approx(ref_metrics["loss"], abs=1e-6)
            assert metrics["grad_norm"] == pytest.approx(ref_metrics["grad_norm"], rel=1e-5)
            for key in ("trainable_tokens", "tokens", "samples", "clip_fraction", "pad_fraction"):
                assert metrics[key] == pytest.approx(ref_metrics[key], abs=1e-9), (name, key)
            assert metrics["world_size"] == 2.0


def test_torchrun_service_with_two_ranks_matches_one_rank(tmp_path):
    from tether.trainer.weights import load_model

    model_dir = tiny_model_dir(tmp_path / "model")
    groups = group_requests(2)
    proc = TrainerProcess(
        model_dir,
        tmp_path / "ckpt",
        tmp_path / "torchrun.log",
        nproc=2,
        env={"TETHER_MICRO_BATCH_TOKENS": "24", "TETHER_DIST_HEARTBEAT_S": "0.2"},
    ).start()
    try:
        proc.wait_ready(240)
        for g in groups:
            proc.stub.SubmitGroup(g)
        resp = proc.stub.TrainStep(step(0, groups=2))
        assert resp.weight_version == 1 and resp.metrics["world_size"] == 2.0
        assert proc.stub.GetStatus(types_pb2.Empty()).steps_done == 1
        proc.stop(120)  # SIGTERM: rank 0 drains and tells rank 1 to stop; torchrun exits
    finally:
        proc.cleanup()
    log = proc.log_path.read_text(errors="replace")
    assert "[rank0]:" not in log and "[rank1]:" not in log, log  # no worker died with an error

    model, _ = load_model(model_dir, 0)
    choose_attention(model, int(model.config.vocab_size))  # the kernels the service chose at start
    opt = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.9, 0.99))
    samples = [SampleRecord.from_proto(p) for g in groups for p in g.samples]
    metrics = train_step(model, opt, samples, StepConfig(micro_batch_tokens=24, pad_token_id=1))
    got = _weights(tmp_path / "ckpt" / "v000001")
    # Adam's first step is lr * g / (|g| + eps): entries whose gradient is at fp32 summation noise
    # (~eps) are amplified, so allow 1% of a step on a handful of them (SGD above is exact to 1e-6).
    diff = torch.cat([(got[name] - value).abs().flatten() for name, value in model.state_dict().items()])
    assert float(diff.max()) < 1e-4
    assert float((diff > 1e-6).float().mean()) < 1e-3
    assert resp.metrics["loss"] == pytest.approx(metrics["loss"], abs=1e-6)


async def test_a_cancelled_rank_command_holds_the_lock_until_its_broadcast_ends():
    """Shutdown cancels the heartbeat task while its broadcast runs in a thread; the "stop" that
    follows must not start before that broadcast ends (two broadcasts at once interleave on the wire:
    a torchrun trainer's rank 1 once unpickled garbage at exit, make test-all Dec 6)."""
    import asyncio
    import threading
    import time
    from types import SimpleNamespace

    from tether.trainer.steps import Trainer

    trainer = SimpleNamespace(lock=asyncio.Lock())
    running, overlaps, release = [0], [], threading.Event()

    def broadcast(wait: bool) -> None:
        running[0] += 1
        overlaps.append(running[0])
        if wait:
            release.wait(5)
        else:
            time.sleep(0.01)
        running[0] -= 1

    heartbeat = asyncio.create_task(Trainer._rank_command(trainer, lambda: broadcast(True)))  # type: ignore[arg-type]
    await asyncio.sleep(0.05)
    heartbeat.cancel()
    stop = asyncio.create_task(Trainer._rank_command(trainer, lambda: broadcast(False)))  # type: ignore[arg-type]
    await asyncio.sleep(0.05)
    assert not stop.done() and overlaps == [1]  # "stop" waits for the heartbeat's broadcast
    release.set()
    await stop
    with pytest.raises(asyncio.CancelledError):
        await heartbeat
    assert overlaps == [1, 1]
