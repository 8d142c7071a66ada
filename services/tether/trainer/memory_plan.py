"""Micro-batches planned from a memory budget, not only a token count. Pure: numbers in, a plan out.

What a micro-batch costs is measured once at start on the model itself (`train.measure_activations`):
the bytes its forward keeps for backward per token, per (query, key) pair where the attention path
keeps a score matrix (the dense mask, eager attention; 0 for varlen, flex and per-sample sdpa), and
with activation checkpointing the bytes it still keeps (each block's input) plus one block's
recomputation at a time. What stays whatever the batch (weights, gradients, optimizer moments) is
counted from the parameters. The plan then packs samples into rows and gives each row its mode:

- `checkpointing="off"`: rows as long as fit without recomputation;
- `"on"`: every row recomputes its blocks in backward (rows as long as fit so);
- `"auto"` (the default): rows as long as fit without recomputation, so none recomputes, unless a
  longer row was asked for (`cap_tokens`, the `MICRO_BATCH_TOKENS` setting): then rows of that length
  (as far as they fit with recomputation), and only the rows that would not fit without it recompute.

A sample that fits in no row still trains, in a row of its own, recomputed (and offloaded when the
plan may offload). With `offload`, every row's saved activations are held in CPU memory (on a GPU:
pinned, copied back in backward) and rows are as long as one block's recomputation allows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Mode = Literal["auto", "on", "off"]
# Backward holds gradients of the activations beside what forward saved: a margin on top of the saved
# bytes, from the peaks measured against the saved bytes (tests/activation_memory.py, a small Qwen2 on
# the CPU's packed path: 1.80x, 1.85x and 1.87x what forward keeps at 2,048, 4,096 and 8,192 tokens).
BACKWARD_MARGIN = 1.9


@dataclass(frozen=True)
class ActivationCost:
    """Bytes a forward keeps for backward: `per_token` x tokens + `per_pair` x sum of each sample's
    length squared, checkpointing off; with it on, `per_token_checkpointed` x tokens (blocks' inputs and
    what lies outside the blocks) plus one block recomputed at a time (a `layers`-th of the rest).
    Offloaded, what forward keeps lies in CPU memory: on the device, one block's worth at a time."""

    per_token: float
    per_pair: float
    per_token_checkpointed: float
    layers: int

    def saved(self, lengths: list[int], checkpointed: bool, offloaded: bool = False) -> float:
        tokens = sum(lengths)
        full = self.per_token * tokens + self.per_pair * sum(n * n for n in lengths)
        block = full / max(self.layers, 1)
        if offloaded:
            return block
        if not checkpointed:
            return full
        return self.per_token_checkpointed * tokens + block

    def shared(self, ranks: int) -> ActivationCost:
        """One rank's cost when `ranks` ranks share each row (Ulysses sequence parallelism): each holds
        a `ranks`-th of the row's tokens, and over the all-to-all a `ranks`-th of its heads for the
        whole row, so a `ranks`-th of both terms."""
        return ActivationCost(
            self.per_token / ranks, self.per_pair / ranks, self.per_token_checkpointed / ranks, self.layers
        )

    def peak(self, lengths: list[int], checkpointed: bool, offloaded: bool = False) -> float:
        """The most a row's forward and backward hold beyond the static state."""
        return BACKWARD_MARGIN * self.saved(lengths, checkpointed, offloaded)


def static_bytes(
    params: int, trainable: int, param_bytes: int, shards: int = 1, offload: str = "none"
) -> float:
    """Weights, gradients and Adam's two fp32 moments on one device: sharded over `shards` ranks under
    FSDP; `offload` = "optimizer" keeps the moments in CPU memory, "params" everything."""
    weights = params * param_bytes / shards
    grads = trainable * param_bytes / shards
    moments = 2 * 4 * trainable / shards
    if offload == "params":
        return 0.0
    if offload == "optimizer":
        return weights + grads
    return weights + grads + moments


def gathered_bytes(block_params: int, param_bytes: int) -> float:
    """What FSDP adds while it computes: the block it has gathered whole and the next one it prefetches
    (`block_params` the largest block's parameter count, `param_bytes` each gathered element's size)."""
    return 2.0 * block_params * param_bytes


@dataclass(frozen=True)
class Row:
    """Sample indices of one packed row and how it trains."""

    samples: tuple[int, ...]
    checkpoint: bool
    offload: bool


def row_tokens(cost: ActivationCost, budget: float, checkpointed: bool, offloaded: bool = False) -> int:
    """The longest single sample whose row fits `budget` bytes (the pair term makes one long sample
    the costliest way to fill a row); 0 when not even one token fits."""
    lo, hi = 0, 1
    while cost.peak([hi], checkpointed, offloaded) <= budget and hi < 2**40:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if cost.peak([mid], checkpointed, offloaded) <= budget:
            lo = mid
        else:
            hi = mid
    return lo


def plan_rows(
    lengths: list[int],
    cost: ActivationCost,
    budget: float,
    cap_tokens: int = 0,
    checkpointing: Mode = "auto",
    offload: bool = False,
) -> list[Row]:
    """Samples packed into rows (first-fit decreasing, deterministic) that fit `budget` bytes of
    activations each, at most `cap_tokens` tokens (0: as many as fit), with each row's checkpointing."""
    if offload:  # what forward keeps lies in CPU memory: recomputing would only save host memory
        recompute = checkpointing == "on"
    else:
        recompute = checkpointing == "on" or (checkpointing == "auto" and cap_tokens > 0)
    limit = row_tokens(cost, budget, recompute, offload)
    capacity = max(min(limit, cap_tokens) if cap_tokens else limit, 1)
    rows: list[list[int]] = []
    sizes: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for r, row in enumerate(rows):
            lens = [lengths[j] for j in row] + [lengths[i]]
            if sizes[r] + lengths[i] <= capacity and cost.peak(lens, recompute, offload) <= budget:
                row.append(i)
                sizes[r] += lengths[i]
                break
        else:
            rows.append([i])
            sizes.append(lengths[i])
    out = []
    for row in rows:
        if checkpointing == "auto" and not offload:
            ckpt = cost.peak([lengths[j] for j in row], checkpointed=False) > budget
        else:
            ckpt = checkpointing == "on"
        out.append(Row(tuple(row), ckpt, offload))
    return out
