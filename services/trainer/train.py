"""One policy-gradient step on a batch of samples.

Named steps: pad the samples into micro-batches, compute the loss weights over the GLOBAL batch
(so micro-batching never changes the gradient), forward each micro-batch, PPO-clip loss against the
rollout engine's logprobs, backward, clip, optimizer step. The logprobs of the sampled tokens under
the weights the rollouts were sampled with are compared with vLLM's before the update.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from tether.algorithms.losses import logprob_mismatch, ppo_token_loss, token_weights
from tether.common.records import SampleRecord


@dataclass(frozen=True)
class StepConfig:
    loss_mode: str = "token-mean"
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip_c: float | None = 3.0
    max_grad_norm: float = 1.0
    micro_batch_tokens: int = 4096
    pad_token_id: int = 0


@dataclass
class Batch:
    """Right-padded (B, T) tensors. Row i predicts token t from tokens < t, so the per-token values
    below are aligned to targets: position t of `mask` refers to token_ids[t + 1]."""

    input_ids: torch.Tensor  # (B, T) long
    attention: torch.Tensor  # (B, T) long
    mask: torch.Tensor  # (B, T-1) float, 1 where the target token was sampled by the policy
    rollout_logprobs: torch.Tensor  # (B, T-1)
    advantages: torch.Tensor  # (B, T-1)
    rollout_ids: torch.Tensor  # (B,) long, index of the row's rollout


def collate(samples: list[SampleRecord], pad_token_id: int) -> Batch:
    width = max(len(s.token_ids) for s in samples)
    rollouts: dict[str, int] = {}
    B = len(samples)
    ids = torch.full((B, width), pad_token_id, dtype=torch.long)
    att = torch.zeros((B, width), dtype=torch.long)
    mask = torch.zeros((B, width), dtype=torch.float32)
    lp = torch.zeros((B, width), dtype=torch.float32)
    adv = torch.zeros((B, width), dtype=torch.float32)
    rid = torch.zeros(B, dtype=torch.long)
    for i, s in enumerate(samples):
        n = len(s.token_ids)
        ids[i, :n] = torch.tensor(s.token_ids, dtype=torch.long)
        att[i, :n] = 1
        mask[i, :n] = torch.tensor(s.loss_mask, dtype=torch.float32)
        lp[i, :n] = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
        adv[i, :n] = torch.tensor(s.advantages, dtype=torch.float32)
        rid[i] = rollouts.setdefault(s.rollout_id, len(rollouts))
    # The first token is never predicted; a mask-1 token at position 0 cannot be trained.
    return Batch(ids, att, mask[:, 1:], lp[:, 1:], adv[:, 1:], rid)


def token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
    """(B, T) ids -> (B, T-1) log p(token_{t+1} | tokens <= t) in fp32."""
    logits = model(input_ids=input_ids, attention_mask=attention).logits[:, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)


def micro_batches(lengths: list[int], budget_tokens: int) -> list[list[int]]:
    """Row indices grouped so that rows x padded width stays under the budget (length-sorted)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups: list[list[int]] = []
    current: list[int] = []
    for i in order:
        width = max([lengths[j] for j in current] + [lengths[i]])
        if current and width * (len(current) + 1) > budget_tokens:
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)
    return groups


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, samples: list[SampleRecord],
               cfg: StepConfig) -> dict[str, float]:
    """Update `model` in place on `samples`; return the step's metrics."""
    start = time.perf_counter()
    batch = collate(samples, cfg.pad_token_id)
    weights = token_weights(batch.mask, cfg.loss_mode, rollout_ids=batch.rollout_ids,
                            norm_constant=float(batch.mask.shape[1]))
    model.train()
    optimizer.zero_grad(set_to_none=True)
    lengths = [len(s.token_ids) for s in samples]
    total_loss = 0.0
    train_lp_all = torch.zeros_like(batch.mask)
    clip_sum = 0.0
    for rows in micro_batches(lengths, cfg.micro_batch_tokens):
        idx = torch.tensor(rows)
        width = max(lengths[i] for i in rows)
        ids, att = batch.input_ids[idx, :width], batch.attention[idx, :width]
        m = batch.mask[idx, : width - 1]
        lp = token_logprobs(model, ids, att)
        loss_tok, metrics = ppo_token_loss(lp, batch.rollout_logprobs[idx, : width - 1],
                                           batch.advantages[idx, : width - 1], m,
                                           clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                                           dual_clip_c=cfg.dual_clip_c)
        loss = (weights[idx, : width - 1] * loss_tok).sum()
        loss.backward()
        total_loss += float(loss.detach())
        train_lp_all[idx, : width - 1] = lp.detach()
        clip_sum += float(metrics.get("clip_fraction", 0.0)) * float(m.sum())
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    n_tokens = float(batch.mask.sum())
    mismatch = logprob_mismatch(train_lp_all, batch.rollout_logprobs, batch.mask)
    elapsed = time.perf_counter() - start
    total_tokens = float(sum(lengths))
    return {
        "loss": total_loss,
        "grad_norm": float(grad_norm) if math.isfinite(float(grad_norm)) else float("nan"),
        "trainable_tokens": n_tokens,
        "tokens": total_tokens,
        "samples": float(len(samples)),
        "rollouts": float(int(batch.rollout_ids.max()) + 1),
        "clip_fraction": clip_sum / max(n_tokens, 1.0),
        "train_seconds": elapsed,
        "train_tokens_per_s": total_tokens / max(elapsed, 1e-9),
        "logprob_abs_diff": mismatch["mean_abs_logprob_diff"],
        "logprob_abs_diff_max": mismatch["max_abs_logprob_diff"],
        "logprob_k3_kl": mismatch["kl_k3"],
    }
