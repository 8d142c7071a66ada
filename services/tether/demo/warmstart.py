"""Supervised warm start on chat demonstrations, so RL starts from a policy that speaks the task's format.

Conversations are rendered with the tokenizer's own chat template (the same one vLLM applies), and only
assistant-turn tokens (content plus the closing end-of-turn token) carry loss: the policy must learn
what to say and when to stop, never to predict the user's or the tool's words.
"""

from __future__ import annotations

import math
import random
import time

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase


def _render(tokenizer: PreTrainedTokenizerBase, messages: list[dict], generation_prompt: bool) -> list[int]:
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=generation_prompt, tokenize=True, return_dict=False
    )
    return list(ids)


def tokenize_conversation(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict]
) -> tuple[list[int], list[int]]:
    """Token ids of a whole conversation and a 0/1 mask that is 1 on assistant-turn tokens.

    Each assistant turn's tokens are the difference between the conversation rendered through that turn
    and the prompt rendered just before it, which needs a prefix-stable template (checked here).
    """
    ids: list[int] = []
    mask: list[int] = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = _render(tokenizer, messages[:i], generation_prompt=True)
        through = _render(tokenizer, messages[: i + 1], generation_prompt=False)
        if prompt[: len(ids)] != ids or through[: len(prompt)] != prompt:
            raise ValueError("chat template is not prefix-stable; cannot mask assistant turns")
        mask.extend([0] * (len(prompt) - len(ids)))
        mask.extend([1] * (len(through) - len(prompt)))
        ids = through
    return ids, mask


def _batch(rows: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and float loss mask (padding carries no loss)."""
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((len(rows), width), dtype=torch.float32)
    for r, (ids, mask) in enumerate(rows):
        input_ids[r, : len(ids)] = torch.tensor(ids)
        loss_mask[r, : len(mask)] = torch.tensor(mask, dtype=torch.float32)
    return input_ids, loss_mask


def masked_nll(model: PreTrainedModel, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood over the masked (assistant) target tokens.

    Rows are right-padded, so causal attention alone keeps real tokens from seeing padding and no
    attention mask is needed (building one is a large share of a tiny model's step time on CPU).
    """
    logits = model(input_ids=input_ids).logits[:, :-1].float()
    targets = input_ids[:, 1:]
    weights = loss_mask[:, 1:]
    nll = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="none")
    return (nll * weights.reshape(-1)).sum() / weights.sum().clamp_min(1.0)


def reply_probability(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, messages: list[dict]
) -> float:
    """The policy's probability of the conversation's last assistant turn (its tokens and end of turn),
    teacher-forced: the masked NLL above over that turn's tokens only."""
    ids, mask = tokenize_conversation(tokenizer, messages)
    turn = mask[::-1].index(0)  # the last turn: the final run of 1s in the mask
    last_turn = torch.tensor([[0.0] * (len(mask) - turn) + [1.0] * turn])
    model.eval()
    with torch.no_grad():
        nll = masked_nll(model, torch.tensor([ids]), last_turn)
    return math.exp(-float(nll) * turn)


def warm_start(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    conversations: list[list[dict]],
    steps: int,
    lr: float,
    seed: int,
    batch_size: int = 32,
    progress: bool = True,
    num_threads: int | None = 1,
) -> dict:
    """Fine-tune `model` in place on `conversations` with AdamW; returns loss figures and timing.

    Batches are drawn by a seeded sampler (epochs of shuffled conversations), so a run is reproducible.
    `num_threads` caps torch's intra-op threads while training (restored afterwards): a tiny model's
    matmuls gain nothing from threads, and on a busy 2-core host (vLLM alongside) two spinning OpenMP
    threads made a step ~10x slower than one. None leaves torch's setting alone.
    """
    previous_threads = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        return _train(model, tokenizer, conversations, steps, lr, seed, batch_size, progress)
    finally:
        torch.set_num_threads(previous_threads)


def _train(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    conversations: list[list[dict]],
    steps: int,
    lr: float,
    seed: int,
    batch_size: int,
    progress: bool,
) -> dict:
    if not conversations:
        raise ValueError("no conversations to train on")
    started = time.perf_counter()
    rows = [tokenize_conversation(tokenizer, messages) for messages in conversations]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    rng = random.Random(seed)
    order: list[int] = []

    def next_batch() -> list[tuple[list[int], list[int]]]:
        nonlocal order
        picked = []
        for _ in range(min(batch_size, len(rows))):
            if not order:
                order = list(range(len(rows)))
                rng.shuffle(order)
            picked.append(rows[order.pop()])
        return picked

    # A fixed slice of the data, scored before and after, so the two losses compare like for like.
    probe = _batch(rows[: 4 * batch_size], pad_id)

    def probe_loss() -> float:
        model.eval()
        with torch.no_grad():
            return masked_nll(model, *probe).item()

    initial = probe_loss()

    # Warm-up then cosine decay: stable from a random init, and the last steps settle the loss.
    warmup = max(1, steps // 20)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: (
            min(1.0, (s + 1) / warmup) * 0.5 * (1.0 + math.cos(math.pi * min(s, steps) / max(steps, 1)))
        ),
    )
    model.train()
    losses: list[float] = []
    bar = tqdm(range(steps), desc="warm start", disable=not progress, leave=False)
    for _ in bar:
        loss = masked_nll(model, *_batch(next_batch(), pad_id))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    bar.close()
    final = probe_loss()

    tail = losses[-max(1, steps // 10) :] or [initial]
    return {
        "initial_loss": initial,
        "final_loss": final,
        "train_loss_tail": sum(tail) / len(tail),
        "steps": steps,
        "examples": len(rows),
        "seconds": time.perf_counter() - started,
    }
