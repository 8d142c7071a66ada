"""What one training step's activations take, measured, against what the memory plan predicts for it.
Run as a script (a process of its own, so the peak is this step's):
`python tests/activation_memory.py N CHECKPOINTING` trains one sample of N tokens (all trainable) through
a small Qwen2-shaped model on the step's own packed path, recomputing its blocks or not
(CHECKPOINTING on|off), and prints JSON in MiB: the resident memory's growth over the step (Linux: the
peak is reset through /proc/self/clear_refs first) less the gradients' first allocation, and the plan's
prediction from `measure_activations` (ActivationCost.peak). Every tensor of 64 KiB or more is a mapping
of its own (common/malloc.py): otherwise glibc serves the measured step from the heap the step before it
left behind, unseen, and the growth varied by a third between runs (the same step, 444-496 MiB off and
230-304 MiB recomputing; with the mappings 647 and 326 MiB every time)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from lm_head_memory import one_sample, status_mib  # this script's folder, on sys.path when run
from transformers import Qwen2Config, Qwen2ForCausalLM

from tether.common.malloc import tune_malloc
from tether.trainer.train import (
    StepConfig,
    choose_attention,
    enable_activation_checkpointing,
    measure_activations,
    train_step,
)

VOCAB = 4000


def main(n: int, checkpointing: str) -> dict[str, float]:
    if not tune_malloc(64 * 1024):
        raise SystemExit("needs glibc's mallopt: the growth measured otherwise depends on the heap's history")
    torch.manual_seed(0)
    torch.set_num_threads(2)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=n + 8,
    )
    model = Qwen2ForCausalLM(config).float()
    path = choose_attention(model, VOCAB)
    on = checkpointing == "on"
    enable_activation_checkpointing(model)
    step = StepConfig(micro_batch_tokens=n, checkpointing="on" if on else "off")
    cost = measure_activations(model, VOCAB, step)
    predicted = cost.peak([n], checkpointed=on) / 2**20
    sample = one_sample(n, VOCAB, -8.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    # One row of the whole sample, recomputed or not: the plan's row, without a budget to pick it.
    train_step(model, opt, [sample], step)  # allocates the gradients; the next step's growth is the step's
    grads = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    opt.zero_grad(set_to_none=True)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = status_mib("VmRSS")
    metrics = train_step(model, opt, [sample], step)
    growth = status_mib("VmHWM") - before
    return {
        "tokens": n,
        "attention": path,
        "checkpointing": on,
        "measured_mib": growth - grads,
        "predicted_mib": predicted,
        "recomputed": metrics["recomputed_micro_batches"],
        "per_token": cost.per_token,
        "per_pair": cost.per_pair,
        "per_token_checkpointed": cost.per_token_checkpointed,
    }


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]), sys.argv[2])))
