"""Trainer step on a real (tiny) HF Llama: logprob agreement, direction of the update,
micro-batching that leaves the gradient unchanged, checkpoints that reload."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from tether.common.records import SampleRecord
from tether.trainer.train import StepConfig, collate, micro_batches, token_logprobs, train_step
from tether.trainer.weights import save_checkpoint


def _model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=40, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
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
            lp = token_logprobs(model, torch.tensor([ids]), torch.ones(1, length, dtype=torch.long))[0].tolist()
        logprobs = [0.0] + [lp[t - 1] if mask[t] else 0.0 for t in range(1, length)]
        adv = 1.0 if i % 2 == 0 else -1.0
        out.append(SampleRecord(rollout_id=f"r{i // 2}", group_id="g", task_id="t", sequence_index=i % 2,
                                token_ids=ids, loss_mask=mask, rollout_logprobs=logprobs,
                                advantages=[adv * m for m in mask], reward=float(adv > 0), weight_version=0))
    return out


def test_on_policy_logprobs_match_and_update_follows_advantage():
    model = _model()
    samples = _samples(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    metrics = train_step(model, opt, samples, StepConfig())
    assert metrics["logprob_abs_diff"] < 1e-5
    batch = collate(samples, 0)
    with torch.no_grad():
        after = token_logprobs(model, batch.input_ids, batch.attention)
    delta = ((after - batch.rollout_logprobs) * batch.mask).sum(dim=1)
    pos = torch.tensor([s.advantages[-1] > 0 for s in samples])
    assert (delta[pos] > 0).all() and (delta[~pos] < 0).all(), delta


def test_micro_batching_does_not_change_the_update():
    base = _model()
    samples = _samples(base, n=8)
    results = []
    for budget in (10_000, 12):
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        train_step(model, opt, samples, StepConfig(micro_batch_tokens=budget, max_grad_norm=1e9))
        results.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert len(micro_batches([len(s.token_ids) for s in samples], 12)) > 1
    torch.testing.assert_close(results[0], results[1], atol=1e-6, rtol=1e-5)


def test_checkpoint_reloads_identically(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(40)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", pad_token="w1")
    model = _model()
    path = save_checkpoint(model, tokenizer, tmp_path, version=3)
    assert path.name == "v000003" and list(path.glob("*.safetensors"))
    for v in (4, 5, 6):
        save_checkpoint(model, tokenizer, tmp_path, version=v, keep=2)
    assert sorted(p.name for p in tmp_path.glob("v*")) == ["v000005", "v000006"]
    again = AutoModelForCausalLM.from_pretrained(path if path.exists() else tmp_path / "v000006")
    ids = torch.tensor([[1, 2, 3, 4]])
    torch.testing.assert_close(again(ids).logits, model(ids).logits)


@pytest.mark.parametrize("bad", ["short", "lengths", "vocab", "mask"])
def test_invalid_samples_are_named(bad):
    from tether.trainer.service import validate

    s = SampleRecord(rollout_id="r", group_id="g", task_id="t", sequence_index=0, token_ids=[1, 2, 3],
                     loss_mask=[0, 1, 1], rollout_logprobs=[0, -1, -1], advantages=[0, 1, 1], reward=1.0,
                     weight_version=0)
    assert validate(s, 40) is None
    if bad == "short":
        s.token_ids, s.loss_mask, s.rollout_logprobs, s.advantages = [1], [1], [0.0], [0.0]
    elif bad == "lengths":
        s.loss_mask = [0, 1]
    elif bad == "vocab":
        s.token_ids = [1, 2, 99]
    else:
        s.loss_mask = [0, 2, 1]
    assert validate(s, 40)
