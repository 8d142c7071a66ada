"""CPU offload under FSDP2 (TETHER_FSDP_OFFLOAD, trainer/offload.py), on CPU with gloo.

- CPUOffloadOptimizer updates a model as torch.optim.Adam does, also across a checkpoint written and
  read the way the trainer does (torch.distributed.checkpoint), and reads a plain Adam's checkpoint;
- FSDP2 on one rank (in this process) and on two (spawned), with the optimizer's state offloaded or with
  FSDP2's CPUOffloadPolicy, trains the weights a plain one-rank Adam trains; a run resumed from the
  step-1 checkpoint with the optimizer offloaded ends where the continuous run does;
- the settings refuse an unknown offload and an offload without FSDP.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import gloo_ranks
import pytest
import torch
import torch.multiprocessing as mp
from pydantic import ValidationError
from test_trainer import SETTINGS, _model, _samples
from test_trainer_resume import _weights

from tether.common.net import free_port
from tether.common.records import SampleRecord
from tether.trainer import distributed
from tether.trainer.distributed import Dist
from tether.trainer.main import TrainerSettings
from tether.trainer.offload import CPUOffloadOptimizer
from tether.trainer.train import StepConfig, token_logprobs, train_step

torch.set_num_threads(1)

ADAM = {"lr": 0.01, "betas": (0.9, 0.99), "eps": 1e-6, "weight_decay": 0.01}
CFG = StepConfig(micro_batch_tokens=24, max_grad_norm=1.0)


def _full(model: torch.nn.Module, d: Dist) -> dict[str, torch.Tensor]:
    """The model's full weights (gathered on rank 0 under FSDP2)."""
    state = distributed.model_state(model, d)
    return state if state is not None else {k: v.detach().clone() for k, v in model.state_dict().items()}


def _loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return -token_logprobs(model, ids).mean()


def _diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_offloaded_adam_equals_adam_over_three_steps_and_a_checkpoint(tmp_path):
    base = _model()
    ids = torch.randint(0, 40, (3, 12), generator=torch.Generator().manual_seed(0))
    ref = copy.deepcopy(base)
    ref_opt = torch.optim.Adam(ref.parameters(), **ADAM)
    model = copy.deepcopy(base)
    opt = CPUOffloadOptimizer(model.parameters(), **ADAM)
    for step in range(3):
        if step == 2:  # the trainer's checkpoint: written, then read into a fresh optimizer and model
            distributed.save_optimizer(model, opt, tmp_path / "offloaded")
            model = copy.deepcopy(model)
            opt = CPUOffloadOptimizer(model.parameters(), **ADAM)
            distributed.load_optimizer(model, opt, tmp_path / "offloaded")
            assert int(opt.state[next(model.parameters())]["step"]) == 2
        for m, o in ((ref, ref_opt), (model, opt)):
            o.zero_grad(set_to_none=True)
            _loss(m, ids).backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            o.step()
    moved = _diff(_full(ref, Dist()), _full(base, Dist()))
    assert moved > 1e-3  # the three steps did move the weights
    assert _diff(_full(model, Dist()), _full(ref, Dist())) < 1e-6
    # The moments are Adam's, in CPU memory.
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(
            opt.state[p]["exp_avg_sq"], ref_opt.state[q]["exp_avg_sq"], atol=1e-9, rtol=0
        )

    # A plain Adam's checkpoint resumes into the offloaded optimizer (and the next step agrees).
    distributed.save_optimizer(ref, ref_opt, tmp_path / "plain")
    model = copy.deepcopy(ref)
    opt = CPUOffloadOptimizer(model.parameters(), **ADAM)
    distributed.load_optimizer(model, opt, tmp_path / "plain")
    for m, o in ((ref, ref_opt), (model, opt)):
        o.zero_grad(set_to_none=True)
        _loss(m, ids).backward()
        o.step()
    assert _diff(_full(model, Dist()), _full(ref, Dist())) < 1e-6


def test_fsdp_offload_needs_fsdp_and_a_known_mode():
    with pytest.raises(ValidationError, match="needs fsdp=true"):
        TrainerSettings(**SETTINGS, fsdp_offload="optimizer")
    with pytest.raises(ValidationError, match="fsdp_offload"):
        TrainerSettings(**SETTINGS, fsdp=True, fsdp_offload="gpu")
    assert TrainerSettings(**SETTINGS, fsdp=True, fsdp_offload="params").fsdp_offload == "params"
    assert TrainerSettings(**SETTINGS).fsdp_offload == "none"


# --- FSDP2 ------------------------------------------------------------------------------------------------


def _fsdp_runs(base, samples: list[SampleRecord], d: Dist, folder: Path) -> dict[str, object]:
    """Two steps under FSDP2 for each offload (the full weights after them, rank 0), and two steps with
    the optimizer offloaded where the second runs in a fresh model and optimizer resumed from the
    step-1 checkpoint (weights and optimizer shards, as the trainer writes them)."""

    def engine(offload: str, start=base):
        model = copy.deepcopy(start)
        dd = Dist(d.rank, d.world, d.local_rank, d.device, fsdp=True, offload=offload)
        distributed.wrap(model, dd)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = (
            CPUOffloadOptimizer(params, **ADAM)
            if offload == "optimizer"
            else torch.optim.Adam(params, **ADAM)
        )
        return model, opt, dd

    out: dict[str, object] = {}
    for offload in ("none", "optimizer", "params"):
        model, opt, dd = engine(offload)
        metrics = [train_step(model, opt, samples, CFG, rank=d.rank, world=d.world) for _ in range(2)]
        out[offload] = (_full(model, dd), [m["loss"] for m in metrics])

    model, opt, dd = engine("optimizer")
    train_step(model, opt, samples, CFG, rank=d.rank, world=d.world)
    step1 = distributed.broadcast(_full(model, dd))  # what the checkpoint's safetensors hold
    distributed.save_optimizer(model, opt, folder)
    restarted = copy.deepcopy(base)
    restarted.load_state_dict(step1)
    model, opt, dd = engine("optimizer", restarted)
    distributed.load_optimizer(model, opt, folder)
    train_step(model, opt, samples, CFG, rank=d.rank, world=d.world)
    out["resumed"] = (_full(model, dd), [])
    return out


def _check_fsdp_runs(out: dict, base, samples: list[SampleRecord]) -> None:
    ref = copy.deepcopy(base)
    opt = torch.optim.Adam(ref.parameters(), **ADAM)
    losses = [train_step(ref, opt, samples, CFG)["loss"] for _ in range(2)]
    want = _full(ref, Dist())
    assert _diff(want, _full(base, Dist())) > 1e-3  # the steps moved the weights
    sharded, sharded_losses = out["none"]
    for name in ("optimizer", "params", "resumed"):
        got, got_losses = out[name]
        # Against FSDP2 with Adam on the device: the same reduction, so the offload alone differs.
        assert _diff(got, sharded) < 1e-6, name
        # Against one rank without FSDP: gradients summed in another order; Adam's early steps
        # (lr x g / (|g| + eps)) magnify that noise on entries whose gradient is ~0 (as in
        # test_trainer_distributed.py): a bound on the worst entry, and nearly all entries exact.
        diff = torch.cat([(got[k] - want[k]).abs().flatten() for k in want])
        assert float(diff.max()) < 1e-4, name
        assert float((diff > 1e-6).float().mean()) < 1e-3, name
        assert got_losses == pytest.approx(losses[: len(got_losses)], abs=1e-5), name
    assert sharded_losses == pytest.approx(losses, abs=1e-5)


def test_fsdp_on_one_rank_trains_as_adam_with_each_offload(tmp_path, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    d = distributed.init("cpu", fsdp=True)  # a private gloo group of one
    try:
        base = _model()
        samples = _samples(base, n=5)
        out = _fsdp_runs(base, samples, d, tmp_path / "optimizer")
    finally:
        distributed.shutdown()
    _check_fsdp_runs(out, base, samples)


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    d = gloo_ranks.join(rank, world, port, fsdp=True)
    try:
        base = _model()
        out = _fsdp_runs(base, _samples(base, n=7), d, Path(out_dir) / "optimizer")
        if rank == 0:
            torch.save(out, os.path.join(out_dir, "out.pt"))
    finally:
        distributed.shutdown()


def test_fsdp_on_two_gloo_ranks_trains_as_one_rank_with_each_offload(tmp_path):
    mp.spawn(_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    base = _model()
    _check_fsdp_runs(torch.load(tmp_path / "out.pt", weights_only=False), base, _samples(base, n=7))


def test_the_service_trains_and_resumes_with_the_optimizer_offloaded(tmp_path, monkeypatch, caplog):
    """main.build's own path (settings, FSDP2 on a private gloo group of one, CPUOffloadOptimizer, the
    checkpoint and its optimizer shards): three steps straight equal two steps, a restart, and a third."""
    from test_trainer_resume import _groups, _train, tiny_model_dir

    from tether.trainer.main import build
    from tether.trainer.steps import TrainerCore

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    model_dir = tiny_model_dir(tmp_path / "model")
    groups = _groups(3)

    def core(folder: Path) -> TrainerCore:
        s = TrainerSettings(
            trainer_grpc_port=0,
            model_dir=str(model_dir),
            checkpoint_dir=str(folder),
            device="cpu",
            lr=0.01,
            peak_tflops=1.0,
            fsdp=True,
            fsdp_offload="optimizer",
        )
        runner, tokenizer, resume = build(s, d)
        assert isinstance(runner.optimizer, CPUOffloadOptimizer)
        return TrainerCore(runner, tokenizer, folder, resumed=resume.state if resume else None)

    d = distributed.init("cpu", fsdp=True, offload="optimizer")
    try:
        with caplog.at_level("INFO", logger="tether.trainer"):
            straight = core(tmp_path / "a")
        assert "GiB on each device" in caplog.text and "offload optimizer" in caplog.text
        assert "memory plan:" in caplog.text and "FSDP2 over 1 ranks" in caplog.text  # planned, sharded
        for g in groups:
            straight.submit(*g)
        for n in (1, 2, 3):
            _train(straight, n)
        first = core(tmp_path / "b")
        for g in groups:
            first.submit(*g)
        _train(first, 1)
        _train(first, 2)
        del first
        second = core(tmp_path / "b")
        assert second.version == 2
        _train(second, 3)
    finally:
        distributed.shutdown()
    a, b = _weights(tmp_path / "a" / "v000003"), _weights(tmp_path / "b" / "v000003")
    assert _diff(a, _weights(model_dir)) > 1e-3
    assert _diff(a, b) < 1e-6
