"""What a training step did with the chip: model FLOPs counted with attention, MFU, peak memory.

Model FLOPs are the useful work of a step, counted from the samples' own lengths whatever kernels ran
(padding, a recomputed block under activation checkpointing, a dense mask's masked half: none count), so
that a path that wastes the chip shows it as a lower MFU:

- the transformer body: 2 FLOPs per matrix weight and token forward, 2 more backward for the activations'
  gradients, 2 more for the weights' gradients where the weights train (6N for a full fine-tune, the
  common "6 x non-embedding parameters"; about 4N for LoRA, whose frozen weights get no gradient);
- causal attention: per layer and sample of L tokens, QK^T and AV over the L^2 / 2 pairs a causal
  kernel computes, 2 x 2 x (L^2 / 2) x (heads x head_dim) forward, three times that with backward
  (PaLM's appendix B counts the same terms without the causal half);
- the LM head over the positions it runs on (the trained targets): 6 x vocabulary x hidden each
  (4 x when it is frozen).

MFU = model FLOPs / (seconds x devices x peak FLOP/s of one device). The peak is a setting
(`TETHER_PEAK_TFLOPS`) or, by default, measured at start on a square matmul in the step's precision:
what this chip reaches, not its data sheet.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tether.trainer import distributed


@dataclass(frozen=True)
class Shape:
    """What the FLOP count needs from a model."""

    layers: int
    attention_width: int  # query heads x head_dim
    body_params: int  # matrices of the transformer body (not the embedding, the LM head, norms or biases)
    body_trainable: int  # those of them that train
    head_params: int  # vocabulary x hidden
    head_trains: bool


def shape_of(model: torch.nn.Module) -> Shape:
    """The Shape of an HF causal LM (or its peft wrapper)."""
    core = distributed.hf_model(model)
    cfg = core.config
    cfg = getattr(cfg, "text_config", None) or cfg
    heads = int(cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    embedding = core.get_input_embeddings().weight
    head = core.get_output_embeddings()
    head_weight = head.weight if head is not None else embedding
    outside = {id(embedding), id(head_weight)}
    body = [p for p in model.parameters() if id(p) not in outside and p.dim() >= 2]
    return Shape(
        layers=int(cfg.num_hidden_layers),
        attention_width=heads * head_dim,
        body_params=sum(p.numel() for p in body),
        body_trainable=sum(p.numel() for p in body if p.requires_grad),
        head_params=int(head_weight.numel()),
        head_trains=bool(head_weight.requires_grad),
    )


def step_flops(shape: Shape, lengths: list[int], head_positions: int, causal: bool = True) -> float:
    """Model FLOPs of forward + backward over samples of `lengths` tokens whose LM head runs on
    `head_positions` positions (module docstring). `causal=False` counts every (query, key) pair, as
    a FLOP counter of an unmasked kernel does."""
    tokens = sum(lengths)
    body = (4 * shape.body_params + 2 * shape.body_trainable) * tokens
    pairs = sum(n * n for n in lengths) / (2 if causal else 1)
    attention = 3 * 4 * shape.layers * shape.attention_width * pairs
    head = (6 if shape.head_trains else 4) * shape.head_params * head_positions
    return float(body + attention + head)


def mfu(flops: float, seconds: float, devices: int, peak_flops: float) -> float:
    """Model FLOPs utilisation: the share of `devices` chips' peak the step used; 0 when unknown."""
    if seconds <= 0 or peak_flops <= 0 or devices <= 0:
        return 0.0
    return flops / (seconds * devices * peak_flops)


def measure_peak_flops(device: torch.device, bf16: bool, size: int | None = None, repeats: int = 5) -> float:
    """FLOP/s this device reaches on a square matmul in the step's precision (bf16 on CUDA when the step
    autocasts, fp32 otherwise): the best of `repeats` after a warm-up."""
    cuda = device.type == "cuda"
    n = size or (8192 if cuda else 512)
    dtype = torch.bfloat16 if bf16 and cuda else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for k in range(repeats + 1):
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        (a @ b).sum().item()  # .item() waits for the result on any device
        if k:  # the first run warms up
            best = min(best, time.perf_counter() - start)
    return 2.0 * n**3 / best


class PeakMemory:
    """The most memory one step held: the CUDA allocator's peak on a GPU; on CPU the process's peak
    resident set (Linux: reset through /proc/self/clear_refs at the step's start, then VmHWM)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            try:
                Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
            except OSError:
                pass  # not Linux, or not allowed: the peak since the process started

    def read_bytes(self) -> float:
        if self.device.type == "cuda":
            return float(torch.cuda.max_memory_allocated(self.device))
        try:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return float(int(line.split()[1]) * 1024)
        except OSError:
            pass
        return 0.0
