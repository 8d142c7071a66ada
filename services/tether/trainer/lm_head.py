"""The LM head over the trainable positions only, a chunk of positions at a time.

A policy-gradient step needs, per trainable token, log p(target) -- and, for the run's health, the
policy's entropy at that position. Computed the plain way (`logits.float()`, `log_softmax`, `gather`),
a step materialises (positions x vocab) fp32 logits three times over (the logits, log_softmax's output,
and backward's gradient): 4.6 GiB each for 8,192 positions of Qwen2.5's 151,936-token vocabulary.

`target_logprobs_and_entropy` computes both from the final hidden states in chunks of positions, never
holding more than one chunk's logits; its backward recomputes each chunk's logits from the saved hidden
states and the head's weight (a custom autograd function), so memory grows with the chunk, not with
the vocabulary times the positions. For logits z, p = softmax(z) and target y:

    log p_y = z_y - logsumexp(z)             d/dz_j = [j = y] - p_j
    H      = logsumexp(z) - sum_j p_j z_j    d/dz_j = -p_j (z_j - sum_i p_i z_i)

The matmul runs in the dtype autocast would use (bf16 under the trainer's bf16 autocast on CUDA), the
softmax algebra in fp32, as the plain path does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from tether.trainer import distributed

# Logits of one chunk at most this many bytes in fp32 (the backward holds ~3 such buffers at once).
DEFAULT_CHUNK_BYTES = 256 * 1024 * 1024


def chunk_positions(vocab_size: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Positions per chunk so that one chunk's fp32 logits take at most `chunk_bytes` (at least 1)."""
    return max(1, chunk_bytes // (4 * max(1, vocab_size)))


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return hidden.dtype


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 logits (fp64 for fp64 inputs: the oracle tests) of a chunk, the matmul run in `dtype`."""
    return (h.to(dtype) @ weight.to(dtype).t()).to(torch.promote_types(dtype, torch.float32))


class _TargetLogprobsAndEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = _compute_dtype(hidden)
        n = hidden.shape[0]
        logprobs = torch.empty(n, dtype=torch.promote_types(dtype, torch.float32), device=hidden.device)
        entropy = torch.empty_like(logprobs)
        lse = torch.empty_like(logprobs)
        with torch.autocast(hidden.device.type, enabled=False):
            for a in range(0, n, chunk):
                z = _chunk_logits(hidden[a : a + chunk], weight, dtype)
                m = torch.logsumexp(z, dim=-1)
                lse[a : a + chunk] = m
                logprobs[a : a + chunk] = z.gather(-1, targets[a : a + chunk, None]).squeeze(-1) - m
                p = torch.exp(z - m[:, None])
                entropy[a : a + chunk] = m - (p * z).sum(-1)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk, ctx.dtype = chunk, dtype
        ctx.set_materialize_grads(False)
        return logprobs, entropy

    @staticmethod
    def backward(
        ctx: Any, g_logprobs: torch.Tensor | None, g_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        hidden, weight, targets, lse = ctx.saved_tensors
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (g_logprobs is None and g_entropy is None) or not (want_h or want_w):
            return None, None, None, None
        dtype, chunk = ctx.dtype, ctx.chunk
        grad_h = torch.empty_like(hidden) if want_h else None
        acc = torch.promote_types(dtype, torch.float32)
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if want_w else None
        w = weight.to(dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            for a in range(0, hidden.shape[0], chunk):
                h = hidden[a : a + chunk]
                z = _chunk_logits(h, weight, dtype)
                p = torch.exp(z - lse[a : a + chunk, None])
                gz = torch.zeros_like(z)
                if g_logprobs is not None:
                    g = g_logprobs[a : a + chunk, None].to(acc)
                    gz -= p * g
                    gz.scatter_add_(-1, targets[a : a + chunk, None], g)
                if g_entropy is not None:
                    mean_z = (p * z).sum(-1, keepdim=True)
                    gz -= p * (z - mean_z) * g_entropy[a : a + chunk, None].to(acc)
                gz_c = gz.to(dtype)
                if grad_h is not None:
                    grad_h[a : a + chunk] = (gz_c @ w).to(hidden.dtype)
                if grad_w is not None:
                    grad_w += (gz_c.t() @ h.to(dtype)).to(acc)
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None


def target_logprobs_and_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, H) final hidden states, (V, H) LM-head weight, (N,) target ids -> (N,) fp32 log p(target)
    and (N,) fp32 entropy of the policy at each position, both differentiable; `chunk` positions at a
    time (default: `chunk_positions(V)`)."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden (N, H) and weight (V, H) expected, got {tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    step = chunk or chunk_positions(weight.shape[0])
    out: tuple[torch.Tensor, torch.Tensor] = _TargetLogprobsAndEntropy.apply(hidden, weight, targets, step)
    return out


def plain_logprobs_and_entropy(
    logits: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: (N, V) logits -> log p(target) and entropy, materialising everything in fp32."""
    logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    return logp.gather(-1, targets[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def chunkable_head(model: torch.nn.Module) -> torch.nn.Linear | None:
    """The model's LM head when it is a plain bias-free Linear the chunked path can stand in for (a
    LoRA-wrapped head, a bias, or a model that rescales its logits are not: the trainer checks the
    result once at start, `chunked_head_matches`)."""
    core = distributed.hf_model(model)
    head = core.get_output_embeddings() if hasattr(core, "get_output_embeddings") else None
    if type(head) is torch.nn.Linear and head.bias is None:
        return head
    return None


@contextlib.contextmanager
def head_over_targets(
    head: torch.nn.Linear, rows: torch.Tensor, cols: torch.Tensor, targets: torch.Tensor, chunk: int | None
) -> Iterator[None]:
    """While inside, `head` (the model's own module, so that DDP's and FSDP's hooks around the forward
    still run) answers the (b, K, H) hidden states the model hands it with a (1, N, 2) tensor: the
    log p(target) and entropy of the N positions hidden[rows, cols], from `target_logprobs_and_entropy`.
    The model's `.logits` output is then that tensor."""

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        lp, ent = target_logprobs_and_entropy(hidden[rows, cols], head.weight, targets, chunk)
        return torch.stack([lp, ent], dim=-1)[None]

    # On the instance, for the duration only: a method replaced on purpose (its argument named otherwise).
    head.forward = forward  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        del head.forward
