"""Sequence parallelism (trainer/sequence_parallel.py) on CPU with gloo: the all-to-all layout on one
process, then ranks that share each packed row give the one-rank run's per-token logprobs, loss and
weights after two steps (fp32), with 2 ranks (one group) and with 4 (2 groups x 2 replicas)."""

from __future__ import annotations

import copy
import dataclasses
import os

import gloo_ranks
import pytest
import torch
import torch.multiprocessing as mp
from pydantic import ValidationError
from transformers import LlamaConfig, LlamaForCausalLM

from tether.common.net import free_port
from tether.common.records import SampleRecord
from tether.trainer import attention, distributed, sequence_parallel
from tether.trainer.main import TrainerSettings
from tether.trainer.train import (
    StepConfig,
    collate,
    enable_activation_checkpointing,
    packed_micro_batch,
    plan_micro_batches,
    sequence_shard,
    target_logprobs,
    token_logprobs,
    train_step,
)

torch.set_num_threads(1)

# Uneven samples; packed into rows of 2 x 24 tokens they make rows of odd length (padded) whose
# samples straddle the shards' border.
LENGTHS = [13, 6, 9, 11, 7, 5, 7, 17]
STEPS = 2


def _model(kv_heads: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(cfg).float()
    attention.use(model, "segments")
    return model


def _samples(model: torch.nn.Module) -> list[SampleRecord]:
    """Samples whose rollout logprobs are the model's own, advantages of both signs."""
    g = torch.Generator().manual_seed(3)
    out = []
    for i, n in enumerate(LENGTHS):
        ids = torch.randint(0, 64, (n,), generator=g).tolist()
        prompt = 2 + i % 3
        mask = [0] * prompt + [1] * (n - prompt)
        with torch.no_grad():
            lp = token_logprobs(model, torch.tensor([ids]))[0].tolist()
        adv = 1.0 if i % 2 == 0 else -0.5
        out.append(
            SampleRecord(
                rollout_id=f"r{i // 2}",
                group_id="g",
                task_id="t",
                sequence_index=i % 2,
                token_ids=ids,
                loss_mask=mask,
                rollout_logprobs=[0.0] + [lp[t - 1] if mask[t] else 0.0 for t in range(1, n)],
                advantages=[adv * m for m in mask],
                reward=float(adv > 0),
                weight_version=0,
            )
        )
    return out


def _prompt_heavy(samples: list[SampleRecord]) -> list[SampleRecord]:
    """The longest two samples without trainable tokens: packed first (17 + 13 tokens), they fill the
    first shard of their row, which then computes no target but still exchanges and backpropagates."""
    return [
        dataclasses.replace(s, loss_mask=[0] * len(s.token_ids), advantages=[0.0] * len(s.token_ids))
        if len(s.token_ids) >= 13
        else s
        for s in samples
    ]


def _cfg(size: int, recompute: bool = False) -> StepConfig:
    return StepConfig(
        micro_batch_tokens=24,
        max_grad_norm=1.0,
        sequence_parallel=size,
        checkpointing="on" if recompute else "off",
        kl_coef=0.5 if recompute else 0.0,
    )


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _steps(engine, model, samples, cfg: StepConfig, rank: int = 0, world: int = 1, ref=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    metrics = [
        train_step(engine, opt, samples, cfg, rank=rank, world=world, ref_model=ref) for _ in range(STEPS)
    ]
    return _flat(model), metrics


def _recomputing(base: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A copy whose blocks recompute in backward (the exchanges run again there), and a frozen
    reference for the KL term (its attention exchanges too)."""
    model = copy.deepcopy(base)
    enable_activation_checkpointing(model)
    return model, copy.deepcopy(base).requires_grad_(False).eval()


def _row_logprobs(model, samples, shard: tuple[int, int] | None = None, group=None):
    """Per-token logprobs of all samples packed into one row (rank's shard of it when `shard`)."""
    lengths = [len(s.token_ids) for s in samples]
    mb = packed_micro_batch(collate(samples, 0), lengths, list(range(len(samples))))
    if shard is None:
        with torch.no_grad():
            lp, _ = target_logprobs(model, mb)
        return mb.rows, mb.cols, lp
    rank, size = shard
    mine = sequence_shard(mb, rank, size, 0)
    assert mine.sp_cuts is not None
    with torch.no_grad(), sequence_parallel.row(group, size, mine.sp_cuts):
        lp, _ = target_logprobs(model, mine)
    return mine.rows, mine.cols, lp


def _worker(rank: int, world: int, size: int, port: int, out_dir: str) -> None:
    d = gloo_ranks.join(rank, world, port)
    try:
        group = sequence_parallel.group(size)
        base = _model()
        samples = _samples(base)
        result = {"logprobs": _row_logprobs(base, samples, (rank % size, size), group)}
        # One KV head for 4 query heads: the keys and values are repeated before the exchange.
        mqa = _model(kv_heads=1)
        result["logprobs_mqa"] = _row_logprobs(mqa, samples, (rank % size, size), group)
        model = copy.deepcopy(base)
        result["steps"] = _steps(distributed.wrap(model, d), model, samples, _cfg(size), rank, world)
        model, ref = _recomputing(base)
        result["steps_recomputed"] = _steps(
            distributed.wrap(model, d), model, samples, _cfg(size, True), rank, world, ref
        )
        model = copy.deepcopy(base)
        result["steps_shard_without_targets"] = _steps(
            distributed.wrap(model, d), model, _prompt_heavy(samples), _cfg(size), rank, world
        )
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        distributed.shutdown()


def _simulated_all_to_all(sends: list[torch.Tensor]) -> list[torch.Tensor]:
    """What all_to_all_single delivers: rank j receives block j of every rank i's input, as block i."""
    return [torch.stack([sent[j] for sent in sends]) for j in range(len(sends))]


def test_the_exchange_layout_gives_each_rank_its_heads_over_the_whole_row_and_back():
    size, heads, per, dim = 3, 6, 4, 5
    full = torch.randn(1, heads, size * per, dim)
    shards = [full[:, :, r * per : (r + 1) * per] for r in range(size)]
    got = _simulated_all_to_all([sequence_parallel.scatter_heads(x, size) for x in shards])
    h = heads // size
    rows = [sequence_parallel.gather_sequence(y) for y in got]
    for j, whole in enumerate(rows):
        torch.testing.assert_close(whole, full[:, j * h : (j + 1) * h], rtol=0, atol=0)
    back = _simulated_all_to_all([sequence_parallel.scatter_sequence(z, size) for z in rows])
    for r, y in enumerate(back):
        torch.testing.assert_close(sequence_parallel.gather_heads(y), shards[r], rtol=0, atol=0)


def test_shards_cover_the_padded_row_and_padding_is_its_own_segment():
    assert [sequence_parallel.shard_bounds(11, 4, r) for r in range(4)] == [
        (0, 3, 12),
        (3, 6, 12),
        (6, 9, 12),
        (9, 12, 12),
    ]
    model = _model()
    samples = _samples(model)[:3]  # 13 + 6 + 9 = 28 tokens: 2 of padding over 3 ranks
    lengths = [len(s.token_ids) for s in samples]
    mb = packed_micro_batch(collate(samples, 0), lengths, [0, 1, 2])
    parts = [sequence_shard(mb, r, 3, 0) for r in range(3)]
    assert [p.input_ids.shape[1] for p in parts] == [10, 10, 10]
    assert parts[0].sp_cuts == [0, 13, 19, 28, 30]  # the two pad tokens: a segment after the samples
    assert sum(p.tokens for p in parts) == 28 and sum(p.cells for p in parts) == 30
    # Every target once, with the token that follows its position in the row (maybe in the next shard).
    assert sorted(int(x) for p in parts for x in p.rows * 100 + p.cols) == sorted(
        int(x) for x in mb.rows * 100 + mb.cols
    )
    row = mb.input_ids[0]
    for r, p in enumerate(parts):
        assert p.targets is not None
        torch.testing.assert_close(p.targets, row[p.src_pos + 10 * r + 1])


def test_heads_that_do_not_split_are_refused():
    with pytest.raises(ValueError, match="sequence_parallel=3 .* 4 heads"):
        sequence_parallel.check_heads(_model(), 3)
    sequence_parallel.check_heads(_model(), 2)


def test_settings_refuse_what_sequence_parallelism_cannot_do(monkeypatch):
    least = {"trainer_grpc_port": 0, "model_dir": "m", "checkpoint_dir": "c"}
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValidationError, match="torchrun"):
        TrainerSettings(**least, sequence_parallel=2)
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValidationError, match="does not divide the 4 ranks"):
        TrainerSettings(**least, sequence_parallel=3)
    with pytest.raises(ValidationError, match="packed rows"):
        TrainerSettings(**least, sequence_parallel=2, pack_samples=False)
    with pytest.raises(ValidationError, match="FSDP"):
        TrainerSettings(**least, sequence_parallel=2, fsdp=True)
    assert TrainerSettings(**least, sequence_parallel=2).sequence_parallel == 2
    with pytest.raises(ValidationError):
        TrainerSettings(**least, sequence_parallel=0)


def _compare(tmp_path, world: int, size: int) -> None:
    mp.spawn(_worker, args=(world, size, free_port(), str(tmp_path)), nprocs=world, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    base = _model()
    samples = _samples(base)
    for key, model in (("logprobs", base), ("logprobs_mqa", _model(kv_heads=1))):
        rows, cols, ref = _row_logprobs(model, samples)
        want = {(int(r), int(c)): float(v) for r, c, v in zip(rows, cols, ref, strict=True)}
        for k in range(0, world, size):  # each group computes every target once
            got = {
                (int(r), int(c)): float(v)
                for rank in ranks[k : k + size]
                for r, c, v in zip(*rank[key], strict=True)
            }
            assert got.keys() == want.keys(), key
            assert max(abs(got[t] - want[t]) for t in want) < 1e-5, key
    model = copy.deepcopy(base)
    expected = {"steps": _steps(model, model, samples, _cfg(1))}
    model, ref = _recomputing(base)
    expected["steps_recomputed"] = _steps(model, model, samples, _cfg(1, True), ref=ref)
    model = copy.deepcopy(base)
    expected["steps_shard_without_targets"] = _steps(model, model, _prompt_heavy(samples), _cfg(1))
    lengths = [len(s.token_ids) for s in samples]
    rows = plan_micro_batches(
        collate(_prompt_heavy(samples), 0),
        lengths,
        list(range(len(lengths))),
        StepConfig(micro_batch_tokens=48),
    )
    assert any(sequence_shard(mb, 0, 2, 0).rows.numel() == 0 for mb in rows)  # the case is what it says
    for case, (ref_params, ref_metrics) in expected.items():
        assert float((ref_params - _flat(base)).abs().max()) > 1e-3  # the steps did move the weights
        for rank in ranks:
            params, metrics = rank[case]
            torch.testing.assert_close(params, ref_params, atol=1e-5, rtol=0, msg=case)
            for got, want in zip(metrics, ref_metrics, strict=True):
                assert got["loss"] == pytest.approx(want["loss"], abs=1e-5), case
                assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5), case
                for key in ("trainable_tokens", "tokens", "samples", "entropy", "logprob_abs_diff", "ref_kl"):
                    assert got[key] == pytest.approx(want[key], abs=1e-5), (case, key)
                assert got["pad_fraction"] > 0.0  # the rows' padding to a multiple of the group's size
                assert got["world_size"] == float(world) and got["sequence_parallel"] == float(size)
    assert expected["steps_recomputed"][1][1]["ref_kl"] > 0  # the KL term was there to check


def test_two_ranks_sharing_each_row_match_one_rank(tmp_path):
    _compare(tmp_path, world=2, size=2)


def test_two_groups_of_two_ranks_match_one_rank(tmp_path):
    _compare(tmp_path, world=4, size=2)


def test_torchrun_service_with_rows_shared_by_two_ranks_matches_one_rank(tmp_path):
    """The service's own start-up (heads checked, groups made, logged) and step, against one process."""
    from test_trainer_resume import TrainerProcess, _weights, group_requests, step, tiny_model_dir

    from tether.trainer.weights import load_model

    model_dir = tiny_model_dir(tmp_path / "model")  # 2 heads, 1 KV head: the KV head is repeated
    groups = group_requests(2)
    env = {
        "TETHER_MICRO_BATCH_TOKENS": "24",
        "TETHER_SEQUENCE_PARALLEL": "2",
        "TETHER_DIST_HEARTBEAT_S": "0.2",
    }
    proc = TrainerProcess(model_dir, tmp_path / "ckpt", tmp_path / "torchrun.log", nproc=2, env=env).start()
    try:
        proc.wait_ready(240)
        for g in groups:
            proc.stub.SubmitGroup(g)
        resp = proc.stub.TrainStep(step(0, groups=2))
        assert resp.metrics["sequence_parallel"] == 2.0 and resp.metrics["world_size"] == 2.0
        proc.stop(120)
    finally:
        proc.cleanup()
    log = proc.log_path.read_text(errors="replace")
    assert "[rank0]:" not in log and "[rank1]:" not in log, log
    assert "sequence parallelism: Ulysses, each packed row split over 2 ranks" in log
    assert "memory plan:" in log and "each row shared by 2 ranks" in log

    model, _ = load_model(model_dir, 0)
    attention.use(model, "segments")
    opt = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.9, 0.99))
    samples = [SampleRecord.from_proto(p) for g in groups for p in g.samples]
    metrics = train_step(model, opt, samples, StepConfig(micro_batch_tokens=24, pad_token_id=1))
    got = _weights(tmp_path / "ckpt" / "v000001")
    # Adam's first step amplifies gradients at fp32 noise (as in test_trainer_distributed.py).
    diff = torch.cat([(got[name] - value).abs().flatten() for name, value in model.state_dict().items()])
    assert float(diff.max()) < 1e-4
    assert float((diff > 1e-6).float().mean()) < 1e-3
    assert resp.metrics["loss"] == pytest.approx(metrics["loss"], abs=1e-6)
