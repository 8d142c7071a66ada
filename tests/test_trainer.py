"""Trainer step on a real (tiny) HF Llama: logprob agreement, direction of the update, packing that
matches unpacked logits, micro-batching and packing that leave the gradient unchanged, off-policy
correction modes, LoRA checkpoints that reload as plain HF weights, sample validation."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
from pydantic import ValidationError
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from tether.common.records import SampleRecord
from tether.trainer import attention, distributed, weights
from tether.trainer.main import TrainerSettings
from tether.trainer.train import (
    StepConfig,
    choose_attention,
    chunked_head_matches,
    collate,
    enable_activation_checkpointing,
    micro_batches,
    off_policy_correction,
    pack,
    packed_micro_batch,
    packing_keeps_samples_apart,
    target_logprobs,
    token_logprobs,
    token_staleness_stats,
    train_step,
)
from tether.trainer.weights import save_checkpoint

torch.set_num_threads(1)


# The least TrainerSettings needs (for the refusals below).
SETTINGS = {"trainer_grpc_port": 0, "model_dir": "m", "checkpoint_dir": "c"}


def _model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=40,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
    )
    return LlamaForCausalLM(cfg).float()


def _samples(model, n: int = 6, seed: int = 1) -> list[SampleRecord]:
    """Sequences whose 'rollout' logprobs are the model's own (as if vLLM had sampled them)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(6, 14, (1,), generator=g))
        ids = torch.randint(0, 40, (length,), generator=g).tolist()
        prompt = int(torch.randint(2, 4, (1,), generator=g))
        mask = [0] * prompt + [1] * (length - prompt)
        with torch.no_grad():
            lp = token_logprobs(model, torch.tensor([ids]), torch.ones(1, length, dtype=torch.long))[
                0
            ].tolist()
        logprobs = [0.0] + [lp[t - 1] if mask[t] else 0.0 for t in range(1, length)]
        adv = 1.0 if i % 2 == 0 else -1.0
        out.append(
            SampleRecord(
                rollout_id=f"r{i // 2}",
                group_id="g",
                task_id="t",
                sequence_index=i % 2,
                token_ids=ids,
                loss_mask=mask,
                rollout_logprobs=logprobs,
                advantages=[adv * m for m in mask],
                reward=float(adv > 0),
                weight_version=0,
            )
        )
    return out


def _shifted(samples: list[SampleRecord], delta: float) -> list[SampleRecord]:
    """The same samples with the engine's logprobs moved by `delta` (train/rollout ratio exp(-delta))."""
    return [
        dataclasses.replace(
            s,
            rollout_logprobs=[lp + delta * m for lp, m in zip(s.rollout_logprobs, s.loss_mask, strict=True)],
        )
        for s in samples
    ]


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _step(base, samples, cfg: StepConfig, lr: float = 0.1, version: int = 0) -> tuple[torch.Tensor, dict]:
    """Parameter change of one SGD step (linear in the gradient, so weights can be compared exactly)."""
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    metrics = train_step(model, opt, samples, cfg, version=version)
    return _flat(model) - _flat(base), metrics


def test_on_policy_logprobs_match_and_update_follows_advantage():
    model = _model()
    samples = _samples(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    metrics = train_step(model, opt, samples, StepConfig())
    assert metrics["logprob_abs_diff"] < 1e-5
    assert metrics["pad_fraction"] == 0.0 and metrics["masked_fraction"] == 0.0
    batch = collate(samples, 0)
    with torch.no_grad():
        after = token_logprobs(model, batch.input_ids, batch.attention)
    delta = ((after - batch.rollout_logprobs) * batch.mask).sum(dim=1)
    pos = torch.tensor([s.advantages[-1] > 0 for s in samples])
    assert (delta[pos] > 0).all() and (delta[~pos] < 0).all(), delta


def test_packed_rows_give_the_unpacked_logits():
    model = _model()
    samples = _samples(model, n=4)
    lengths = [len(s.token_ids) for s in samples]
    batch = collate(samples, 0)
    # Raw logits: one packed row with restarting position ids vs each sample alone.
    packed_ids = torch.tensor([[t for s in samples for t in s.token_ids]])
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        packed = model(input_ids=packed_ids, position_ids=positions, use_cache=False).logits[0]
        alone = torch.cat([model(input_ids=torch.tensor([s.token_ids])).logits[0] for s in samples])
        torch.testing.assert_close(packed, alone, atol=1e-5, rtol=0)
        # The trainer's path: targets of a packed micro-batch (logits of the needed positions only).
        mb = packed_micro_batch(batch, lengths, list(range(len(samples))))
        lp, _ = target_logprobs(model, mb)
        ref = token_logprobs(model, batch.input_ids, batch.attention)[mb.rows, mb.cols]
    assert mb.cells == mb.tokens == sum(lengths)
    assert packing_keeps_samples_apart(model, 40)
    torch.testing.assert_close(lp, ref, atol=1e-5, rtol=0)


def test_pack_fills_rows_under_capacity():
    lengths = [9, 3, 7, 5, 12, 2, 2, 6]
    rows = pack(lengths, 12)
    assert sorted(i for r in rows for i in r) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in r) <= 12 for r in rows)
    assert len(rows) == 4  # 46 tokens in rows of 12
    assert pack([20, 3], 12) == [[0], [1]]  # an oversized sample gets its own row


@pytest.mark.parametrize("packed", [True, False])
def test_micro_batching_and_packing_do_not_change_the_update(packed):
    base = _model()
    samples = _samples(base, n=8)
    ref, _ = _step(base, samples, StepConfig(micro_batch_tokens=10_000, pack=False, max_grad_norm=1e9))
    delta, metrics = _step(base, samples, StepConfig(micro_batch_tokens=24, pack=packed, max_grad_norm=1e9))
    assert metrics["micro_batches"] > 1
    assert len(micro_batches([len(s.token_ids) for s in samples], 24)) > 1
    assert (metrics["pad_fraction"] == 0.0) if packed else (metrics["pad_fraction"] > 0.0)
    torch.testing.assert_close(delta, ref, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("tied", [False, True])
def test_the_chunked_lm_head_gives_the_plain_paths_update_and_the_policys_entropy(packed, tied):
    base = _model()
    if tied:
        base.lm_head.weight = base.model.embed_tokens.weight
    samples = _samples(base, n=6)
    plain_cfg = StepConfig(max_grad_norm=1e9, pack=packed, micro_batch_tokens=24, lm_head_chunk_bytes=0)
    ref, plain = _step(base, samples, plain_cfg)
    chunked_cfg = dataclasses.replace(plain_cfg, lm_head_chunk_bytes=4 * 40 * 3)  # 3 positions a chunk
    delta, chunked = _step(base, samples, chunked_cfg)
    assert float((delta - ref).norm() / ref.norm()) < 1e-5  # the gradient, to 1e-5 relative
    torch.testing.assert_close(delta, ref, atol=1e-6, rtol=1e-5)
    assert chunked["loss"] == pytest.approx(plain["loss"], rel=1e-5)
    # The entropy of the trained positions, from the logits of the full distribution.
    batch = collate(samples, 0)
    with torch.no_grad():
        logp = torch.log_softmax(
            base(input_ids=batch.input_ids, attention_mask=batch.attention).logits[:, :-1], -1
        )
    entropy = -(logp.exp() * logp).sum(-1)
    want = float((entropy * batch.mask).sum() / batch.mask.sum())
    assert chunked["entropy"] == pytest.approx(want, rel=1e-5) and plain["entropy"] == pytest.approx(
        want, rel=1e-5
    )
    assert chunked_head_matches(base, 40)


def test_a_model_that_rescales_its_logits_keeps_the_plain_path():
    model = _model()

    class Scaled(type(model)):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 0.5
            return out

    model.__class__ = Scaled
    assert not chunked_head_matches(model, 40)


def test_gradient_checkpointing_does_not_change_the_update():
    base = _model()
    samples = _samples(base, n=4)
    ref, _ = _step(base, samples, StepConfig(max_grad_norm=1e9))
    ckpt = copy.deepcopy(base)
    enable_activation_checkpointing(ckpt)
    delta, _ = _step(ckpt, samples, StepConfig(max_grad_norm=1e9))
    torch.testing.assert_close(delta, ref, atol=1e-6, rtol=1e-5)


def test_off_policy_correction_weights():
    train = torch.tensor([-1.0, -1.0, -1.0, -1.0])
    rollout = train - torch.tensor([0.0, 0.5, 1.0, -1.0])  # ratios 1, e^.5, e, e^-1
    old, w, counts = off_policy_correction(train, rollout, "tis", cap=2.0)
    torch.testing.assert_close(old, train)
    torch.testing.assert_close(w, torch.tensor([0.0, 0.5, 1.0, -1.0]).exp().clamp(max=2.0))
    assert counts["truncated"] == 1 and counts["masked"] == 2
    old, w, _ = off_policy_correction(train, rollout, "mask", low=0.5, high=2.0)
    torch.testing.assert_close(w, torch.tensor([1.0, 1.0, 0.0, 0.0]))
    old, w, _ = off_policy_correction(train, rollout, "ppo")
    torch.testing.assert_close(old, rollout)
    torch.testing.assert_close(w, torch.ones(4))


def test_off_policy_modes_in_a_step():
    base = _model()
    samples = _samples(base, n=6)
    on_policy, _ = _step(base, samples, StepConfig(max_grad_norm=1e9))
    # The engine gave every sampled token logprob 1 lower: train/rollout ratio e > cap 2.
    stale = _shifted(samples, -1.0)
    delta, m = _step(base, stale, StepConfig(off_policy="tis", max_grad_norm=1e9))
    torch.testing.assert_close(delta, 2.0 * on_policy, atol=1e-6, rtol=1e-5)  # every token weighs cap = 2
    assert m["truncated_fraction"] == 1.0 and m["is_weight_mean"] == pytest.approx(2.0)
    assert m["logprob_abs_diff"] == pytest.approx(1.0, abs=1e-5)
    delta, m = _step(base, stale, StepConfig(off_policy="mask", max_grad_norm=1e9))
    assert m["masked_fraction"] == 1.0 and float(delta.abs().max()) == 0.0
    delta, m = _step(base, _shifted(samples, -0.1), StepConfig(off_policy="mask", max_grad_norm=1e9))
    assert m["masked_fraction"] == 0.0
    torch.testing.assert_close(delta, on_policy, atol=1e-6, rtol=1e-5)
    _, m = _step(base, stale, StepConfig(off_policy="ppo"))
    assert m["clip_fraction"] == pytest.approx(0.5, abs=0.2)  # positive-advantage tokens sit above 1 + eps


def _sampled_apart(samples: list[SampleRecord]) -> list[SampleRecord]:
    """The engine's logprobs moved per sample (-1e-3, 0, +1e-3, ...): sequence ratios on both sides of
    GSPO's narrow range, token ratios inside PPO's and CISPO's."""
    return [_shifted([smp], 1e-3 * (i % 3 - 1))[0] for i, smp in enumerate(samples)]


@pytest.mark.parametrize(
    ("policy_loss", "clip"), [("gspo", (3e-4, 4e-4)), ("cispo", (1.0, 0.28)), ("ppo", (0.2, 0.2))]
)
@pytest.mark.parametrize("loss_mode", ["token-mean", "seq-mean-token-mean"])
def test_each_policy_loss_steps_as_its_formula_over_the_whole_batch(policy_loss, clip, loss_mode):
    """train_step's update, in packed micro-batches, equals one SGD step on the objective computed from
    the whole (B, T) batch by losses.py (GSPO: each sample one response, its ratio over all its tokens)."""
    from tether.algorithms.losses import aggregate, cispo_token_loss, gspo_token_loss, ppo_token_loss
    from tether.trainer.train import collate

    base = _model()
    samples = _sampled_apart(_samples(base, n=8))
    cfg = StepConfig(
        micro_batch_tokens=24,
        max_grad_norm=1e9,
        policy_loss=policy_loss,
        clip_low=clip[0],
        clip_high=clip[1],
        loss_mode=loss_mode,
    )
    delta, metrics = _step(base, samples, cfg)
    assert metrics["micro_batches"] > 1

    model = copy.deepcopy(base)
    batch = collate(samples, 0)
    lp = token_logprobs(model, batch.input_ids, batch.attention)
    args = (lp, batch.rollout_logprobs, batch.advantages, batch.mask, *clip)
    fn = {"gspo": gspo_token_loss, "cispo": cispo_token_loss, "ppo": ppo_token_loss}[policy_loss]
    token_loss, m = fn(*args)
    loss = aggregate(
        token_loss,
        batch.mask,
        loss_mode,
        rollout_ids=batch.rollout_ids,
        norm_constant=float(batch.mask.shape[1]),
    )
    loss.backward()
    ref = torch.cat([-0.1 * p.grad.flatten() for p in model.parameters()])
    torch.testing.assert_close(delta, ref, atol=1e-6, rtol=1e-5)
    assert metrics["clip_fraction"] == pytest.approx(m["clip_fraction"], abs=1e-6)
    if policy_loss == "gspo":
        assert 0.0 < metrics["clip_fraction"] < 1.0  # some samples' ratios left the range, some did not


def test_the_step_guard_undoes_an_update_that_moves_too_far_and_makes_it_again_at_a_lower_rate():
    from tether.trainer.train import collate

    base = _model()
    samples = _samples(base, n=6)

    def run(lr: float, **guard) -> tuple[torch.Tensor, dict, torch.nn.Module, torch.optim.Optimizer]:
        model = copy.deepcopy(base)
        opt = torch.optim.Adam(model.parameters(), lr=lr)
        metrics = train_step(model, opt, samples, StepConfig(max_grad_norm=1e9, **guard))
        return _flat(model) - _flat(base), metrics, model, opt

    plain, m_plain, _, _ = run(0.05)
    half, _, _, half_opt = run(0.025)
    assert m_plain["step_guard_retries"] == 0.0 and math.isnan(m_plain["step_kl"])  # no guard: not measured
    # A bound above what the update moves: the same step, its KL measured.
    kept, m_kept, kept_model, _ = run(0.05, max_step_kl=10.0)
    assert m_kept["step_guard_retries"] == 0.0
    torch.testing.assert_close(kept, plain, atol=0, rtol=0)
    batch = collate(samples, 0)
    with torch.no_grad():
        log_r = (
            token_logprobs(kept_model, batch.input_ids, batch.attention) - batch.rollout_logprobs
        ).double()
    k3 = (torch.expm1(log_r) - log_r)[batch.mask != 0].mean()
    assert m_kept["step_kl"] == pytest.approx(float(k3), rel=1e-4) and m_kept["step_kl"] > 0
    # A bound below it: undone (weights and Adam's state) and made again at half the rate.
    guarded, m, _, opt = run(0.05, max_step_kl=float(k3) / 2, step_guard_lr_scale=0.5)
    assert m["step_guard_retries"] == 1.0
    torch.testing.assert_close(guarded, half, atol=1e-7, rtol=1e-5)
    assert opt.param_groups[0]["lr"] == 0.05  # the run's learning rate is the settings' again
    for p_guard, p_half in zip(opt.state.values(), half_opt.state.values(), strict=True):
        assert p_guard["step"] == p_half["step"] == 1
        torch.testing.assert_close(p_guard["exp_avg_sq"], p_half["exp_avg_sq"])
    assert m["step_kl"] < m_kept["step_kl"]


def _regrouped(samples: list[SampleRecord], groups: int) -> list[SampleRecord]:
    """The same samples spread over `groups` groups (rollout i in group i mod groups)."""
    return [dataclasses.replace(s, group_id=f"g{int(s.rollout_id[1:]) % groups}") for s in samples]


@pytest.mark.parametrize("loss_mode", ["token-mean", "seq-mean-token-mean", "rollout-mean"])
def test_a_short_step_weighs_its_share_of_the_intended_groups(loss_mode):
    """loss_denominator = intended: a step of 3 groups meant to train 8 moves the weights 3/8 as far as
    the same step normalised by its own batch (SGD: the update is linear in the loss); `batch` and an
    unsaid intent leave it as it was; a step of as many groups as intended (or more) is not scaled."""
    base = _model()
    samples = _regrouped(_samples(base, n=6), 3)

    def run(denominator: str, intended: int) -> tuple[torch.Tensor, dict]:
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        cfg = StepConfig(loss_mode=loss_mode, loss_denominator=denominator, max_grad_norm=1e9)
        metrics = train_step(model, opt, samples, cfg, intended_groups=intended)
        return _flat(model) - _flat(base), metrics

    full, m_full = run("batch", 8)
    assert m_full["loss_scale"] == 1.0 and full.abs().max() > 0
    short, m_short = run("intended", 8)
    assert m_short["loss_scale"] == pytest.approx(3 / 8)
    torch.testing.assert_close(short, full * 3 / 8, atol=1e-7, rtol=1e-4)
    for intended in (0, 3, 2):  # not said, as many as trained, fewer than trained
        same, m = run("intended", intended)
        assert m["loss_scale"] == 1.0
        torch.testing.assert_close(same, full, atol=0, rtol=0)


def test_a_steps_learning_health_reaches_prometheus():
    """The figures of the step's own pass, exported as the trainer's learning-health gauges."""
    from prometheus_client import REGISTRY

    from tether.trainer.steps import export_learning_health

    base = _model()
    samples = _shifted(_samples(base, n=6), -0.5)  # off-policy: ratios e^0.5 > 1.2, some clipped
    _, m = _step(base, samples, StepConfig(max_grad_norm=1e9, max_step_kl=10.0))
    assert m["clip_high_fraction"] > 0 and m["clip_low_fraction"] == 0.0
    assert m["clip_fraction"] == pytest.approx(m["clip_low_fraction"] + m["clip_high_fraction"])
    assert m["ratio_min"] <= m["ratio_mean"] <= m["ratio_max"] and m["ratio_max"] == pytest.approx(
        math.exp(0.5), rel=1e-3
    )
    retries = REGISTRY.get_sample_value("tether_trainer_step_guard_retries_total", {"run": ""}) or 0.0
    export_learning_health(m)

    def value(name: str, **labels: str) -> float | None:
        return REGISTRY.get_sample_value(name, {"run": "", **labels})  # the single policy's

    assert value("tether_trainer_policy_entropy") == pytest.approx(m["entropy"])
    assert value("tether_trainer_policy_kl") == pytest.approx(m["policy_kl"])
    assert value("tether_trainer_update_kl") == pytest.approx(m["step_kl"])
    assert value("tether_trainer_grad_norm") == pytest.approx(m["grad_norm"])
    assert value("tether_trainer_clip_fraction", side="high") == pytest.approx(m["clip_high_fraction"])
    assert value("tether_trainer_clip_fraction", side="dual") == pytest.approx(m["dual_clip_fraction"])
    assert value("tether_trainer_importance_ratio", stat="max") == pytest.approx(m["ratio_max"])
    assert value("tether_trainer_step_guard_retries_total") == retries  # the guard kept the update


def test_staleness_metrics():
    base = _model()
    samples = [
        dataclasses.replace(s, weight_version=v)
        for s, v in zip(_samples(base, n=4), (1, 3, 3, 5), strict=True)
    ]
    _, m = _step(base, samples, StepConfig(), lr=0.0, version=5)
    assert m["staleness_max"] == 4.0 and m["staleness_mean"] == pytest.approx(2.0)
    # No spans: every trainable token counts at its sample's version.
    mask = [sum(s.loss_mask) for s in samples]
    assert m["token_staleness_mean"] == pytest.approx(
        sum(n * (5 - v) for n, v in zip(mask, (1, 3, 3, 5), strict=True)) / sum(mask)
    )
    assert m["token_staleness_max"] == 4.0 and m["mixed_version_fraction"] == 0.0


def test_token_staleness_counts_trainable_tokens_of_each_span():
    def sample(mask, version, spans=()):
        return SampleRecord(
            rollout_id="r",
            group_id="g",
            task_id="t",
            sequence_index=0,
            token_ids=[1] * len(mask),
            loss_mask=mask,
            rollout_logprobs=[0.0] * len(mask),
            advantages=[0.0] * len(mask),
            reward=0.0,
            weight_version=version,
            weight_spans=[list(x) for x in spans],
        )

    # Sampled across a push: 1 token by v3, 3 by v4; the other sample has no spans (all its 2 tokens v2).
    mixed = sample([0, 1, 1, 0, 1, 1], 3, [(3, 1, 2), (4, 2, 3), (4, 4, 6)])
    plain = sample([0, 0, 1, 1], 2)
    got = token_staleness_stats([mixed, plain], version=5)
    assert got == {
        "token_staleness_mean": pytest.approx((2 + 3 * 1 + 2 * 3) / 6),
        "token_staleness_max": 3.0,
        "mixed_version_fraction": 0.5,
    }
    assert token_staleness_stats([], 5)["token_staleness_mean"] == 0.0
    # An unknown off-policy mode: refused by the settings at start-up, and by the step's function.
    with pytest.raises(ValidationError, match="(?m)^off_policy$"):
        TrainerSettings(**SETTINGS, off_policy="is")
    with pytest.raises(ValueError, match="off-policy"):
        off_policy_correction(torch.zeros(2), torch.zeros(2), "is")


def test_a_batch_without_trainable_tokens_leaves_the_weights():
    model = _model()
    samples = _samples(model, n=3)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    train_step(model, opt, samples, StepConfig())  # Adam's momentum alone would move the weights again
    before = _flat(model)
    empty = [dataclasses.replace(s, loss_mask=[0] * len(s.loss_mask)) for s in samples]
    m = train_step(model, opt, empty, StepConfig())
    assert m["trainable_tokens"] == 0 and m["loss"] == 0 and m["grad_norm"] == 0
    torch.testing.assert_close(_flat(model), before, atol=0, rtol=0)


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(40)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", pad_token="w1")


def test_checkpoint_reloads_identically(tmp_path):
    tokenizer = _tokenizer()
    model = _model()
    path = save_checkpoint(model, tokenizer, tmp_path, version=3, trainer_state={"version": 3})
    assert (
        path.name == "v000003" and list(path.glob("*.safetensors")) and (path / "trainer_state.pt").exists()
    )
    for v in (4, 5, 6):
        save_checkpoint(model, tokenizer, tmp_path, version=v, keep=2)
    assert sorted(p.name for p in tmp_path.glob("v*")) == ["v000005", "v000006"]
    assert not list(tmp_path.glob(".tmp*"))
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "v000006")
    ids = torch.tensor([[1, 2, 3, 4]])
    torch.testing.assert_close(again(ids).logits, model(ids).logits)


def test_optimizer_shards_resume_the_run_and_gate_the_checkpoint(tmp_path):
    """The optimizer state goes to torch.distributed.checkpoint shards inside the version folder:
    loading them continues the run exactly; a checkpoint whose shards are incomplete is not resumed
    from; a format-1 checkpoint (the whole state inside trainer_state.pt) still is."""
    tokenizer = _tokenizer()
    base = _model()
    samples = _samples(base, n=4)
    model, cont = copy.deepcopy(base), copy.deepcopy(base)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train_step(model, opt, samples, StepConfig())
    staging = weights.optimizer_staging(tmp_path, 1)
    distributed.save_optimizer(model, opt, staging)
    path = save_checkpoint(
        model,
        tokenizer,
        tmp_path,
        version=1,
        optimizer_dir=staging,
        trainer_state={"version": 1, "optimizer_dir": weights.OPTIMIZER_DIR},
    )
    assert (path / "optimizer" / ".metadata").is_file() and not staging.exists()
    cont.load_state_dict(model.state_dict())
    train_step(model, opt, samples, StepConfig())  # the uninterrupted run's second step

    resume = weights.latest_resumable(tmp_path)
    assert resume is not None and resume.version == 1
    opt2 = torch.optim.Adam(cont.parameters(), lr=1e-2)
    distributed.load_optimizer(cont, opt2, resume.path / resume.state["optimizer_dir"])
    train_step(cont, opt2, samples, StepConfig())
    for (name, a), b in zip(model.named_parameters(), cont.parameters(), strict=True):
        torch.testing.assert_close(b, a, atol=0, rtol=0, msg=name)

    (path / "optimizer" / ".metadata").unlink()  # as if the shards were never finished
    assert weights.latest_resumable(tmp_path) is None
    # Format 1: the whole name-keyed state inside trainer_state.pt, as the trainer wrote it before.
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    old = copy.deepcopy(base)
    old_opt = torch.optim.Adam(old.parameters(), lr=1e-2)
    train_step(old, old_opt, samples, StepConfig())
    full = get_optimizer_state_dict(old, old_opt, options=StateDictOptions(full_state_dict=True))
    torch.save({"format": 1, "version": 1, "optimizer": full}, path / weights.STATE_FILE)
    resume = weights.latest_resumable(tmp_path)
    new = copy.deepcopy(old)
    new_opt = torch.optim.Adam(new.parameters(), lr=1e-2)
    distributed.load_optimizer_state(new, new_opt, resume.state["optimizer"], distributed.Dist())
    train_step(old, old_opt, samples, StepConfig())
    train_step(new, new_opt, samples, StepConfig())
    for (name, a), b in zip(old.named_parameters(), new.parameters(), strict=True):
        torch.testing.assert_close(b, a, atol=0, rtol=0, msg=name)


def test_lora_step_and_merged_checkpoint(tmp_path):
    pytest.importorskip("peft")
    from tether.trainer.weights import apply_lora, merged_lora_state_dict

    base = _model()
    samples = _samples(base, n=4)
    model = apply_lora(copy.deepcopy(base), rank=4, alpha=8.0, dropout=0.0, targets="all-linear")
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    metrics = train_step(model, opt, samples, StepConfig())
    assert metrics["logprob_abs_diff"] < 1e-5 and metrics["grad_norm"] > 0
    merged = merged_lora_state_dict(model)
    assert set(merged) == set(base.state_dict())
    path = save_checkpoint(model.get_base_model(), _tokenizer(), tmp_path, version=1, state_dict=merged)
    plain = AutoModelForCausalLM.from_pretrained(path)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        assert (plain(ids).logits - base(ids).logits).abs().max() > 1e-4  # the adapter did something
        torch.testing.assert_close(plain(ids).logits, model(input_ids=ids).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("bad", ["short", "lengths", "vocab", "mask", "nan"])
def test_invalid_samples_are_named(bad):
    from tether.trainer.steps import validate

    s = SampleRecord(
        rollout_id="r",
        group_id="g",
        task_id="t",
        sequence_index=0,
        token_ids=[1, 2, 3],
        loss_mask=[0, 1, 1],
        rollout_logprobs=[0, -1, -1],
        advantages=[0, 1, 1],
        reward=1.0,
        weight_version=0,
    )
    assert validate(s, 40) is None
    if bad == "short":
        s.token_ids, s.loss_mask, s.rollout_logprobs, s.advantages = [1], [1], [0.0], [0.0]
    elif bad == "lengths":
        s.loss_mask = [0, 1]
    elif bad == "vocab":
        s.token_ids = [1, 2, 99]
    elif bad == "mask":
        s.loss_mask = [0, 2, 1]
    else:
        s.rollout_logprobs = [0.0, float("nan"), -1.0]
    assert validate(s, 40)


def test_kl_to_reference_pulls_the_policy_back():
    """With zero advantages, a KL penalty alone moves the policy towards the frozen reference."""
    ref = _model(seed=0).requires_grad_(False).eval()
    model = _model(seed=0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    samples = [dataclasses.replace(s, advantages=[0.0] * len(s.advantages)) for s in _samples(model)]

    def kl() -> float:
        batch = collate(samples, 0)
        with torch.no_grad():
            lp = token_logprobs(model, batch.input_ids, batch.attention)
            ref_lp = token_logprobs(ref, batch.input_ids, batch.attention)
        return float(((lp - ref_lp) * batch.mask).abs().sum())

    before = kl()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(5):
        metrics = train_step(model, opt, samples, StepConfig(kl_coef=1.0, kl_estimator="k2"), ref_model=ref)
    assert metrics["ref_kl"] > 0
    assert kl() < 0.9 * before
    # An unknown estimator or a negative coefficient: refused by the settings at start-up; a step given
    # an unknown estimator anyway fails before it updates anything.
    with pytest.raises(ValidationError, match="(?m)^kl_estimator$"):
        TrainerSettings(**SETTINGS, kl_estimator="k7")
    with pytest.raises(ValidationError, match="(?m)^kl_coef$"):
        TrainerSettings(**SETTINGS, kl_coef=-1.0)
    w = _flat(model)
    with pytest.raises(ValueError, match="KL estimator"):
        train_step(model, opt, samples, StepConfig(kl_coef=1.0, kl_estimator="k7"), ref_model=ref)
    assert torch.equal(_flat(model), w)


@pytest.mark.parametrize("path", ["segments", "dense"])
def test_packed_attention_paths_give_the_padded_update(path):
    """Packed rows through Tether's attention (trainer/attention.py, no dense mask on `segments`) train
    exactly as padded rows through transformers' own sdpa; on CPU `auto` picks `segments`."""
    base = _model()
    samples = _samples(base, n=8)
    ref, _ = _step(base, samples, StepConfig(micro_batch_tokens=10_000, pack=False, max_grad_norm=1e9))
    model = copy.deepcopy(base)
    assert choose_attention(model, 40, path) == path and attention.implementation(model) == attention.NAME
    delta, metrics = _step(model, samples, StepConfig(micro_batch_tokens=30, pack=True, max_grad_norm=1e9))
    assert metrics["pad_fraction"] == 0.0 and metrics["micro_batches"] > 1
    torch.testing.assert_close(delta, ref, atol=1e-6, rtol=1e-5)
    assert choose_attention(copy.deepcopy(base), 40) == "segments"


def test_sample_boundaries_come_from_the_position_ids():
    assert attention.boundaries(torch.tensor([[0, 1, 2, 0, 1, 0]])) == [0, 3, 5, 6]
    assert attention.boundaries(torch.tensor([[5, 6, 7]])) == [0, 3]  # one sample, however it starts
    with pytest.raises(ValueError, match="attention path"):
        attention.use(_model(), "nope")
