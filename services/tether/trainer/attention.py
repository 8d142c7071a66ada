"""Attention over packed rows without a dense mask.

A packed row holds several samples one after another, position ids restarting at 0 for each. Through
transformers' own path (sdpa) such a row gets a dense (T x T) block-diagonal mask, which rules out the
fused kernels: a 16k-token row costs 256 MiB of mask per forward and runs the slow masked kernel
(issue 25 measured packing 43% slower than padding on an H200 for that reason).

Tether registers its own attention implementation with transformers (`AttentionInterface`, name
`tether_packed`) and a mask function that builds no mask for rows without padding. The attention
function finds the samples' boundaries from the position ids (once per forward: the same tensor reaches
every layer) and runs one of these kernels, the best available chosen at start (`choose`):

- `varlen`: PyTorch's varlen FlashAttention (`torch.nn.attention.varlen.varlen_attn`, CUDA, bf16/fp16):
  the row as one varlen batch, the samples' boundaries as `cu_seqlens`;
- `flex`: compiled `flex_attention` with a block mask (causal within each sample); CUDA (PyTorch's
  flex_attention has no backward on CPU);
- `segments`: sdpa with `is_causal` over each sample in turn: exact, no mask, the fused kernels, a
  Python loop over the samples (the CPU's path);
- `dense`: sdpa with the dense block-diagonal mask (what transformers does), the last fallback.

With sequence parallelism (sequence_parallel.py) each rank holds a shard of the row: the same kernels run
over the whole row on a share of the heads, between two all-to-alls.

Rows with padding (padded micro-batches) go through transformers' sdpa with their mask as before. A
path is used only after a check at start: a packed sample through the model with it gives the model's
own logprobs and a gradient (`choose`); the trainer logs the path and exports it as a metric.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from tether.trainer import distributed, sequence_parallel

log = logging.getLogger(__name__)

NAME = "tether_packed"
PATHS = ("varlen", "flex", "segments", "dense")

_state: dict[str, Any] = {"path": "segments", "key": None, "value": None}


def boundaries(position_ids: torch.Tensor) -> list[int]:
    """Start offsets of the samples in a packed row (position id 0, or a non-consecutive id), and its
    length at the end: [0, 5, 12] for two samples of 5 and 7 tokens. Pure (a host copy of the ids)."""
    pos = position_ids.reshape(-1).tolist()
    starts = [i for i in range(len(pos)) if i == 0 or pos[i] != pos[i - 1] + 1]
    return [*starts, len(pos)]


def _segments_of(position_ids: torch.Tensor) -> list[int]:
    """`boundaries`, computed once per forward: every layer gets the same position-id tensor."""
    if _state["key"] is not position_ids:
        _state["key"], _state["value"] = position_ids, boundaries(position_ids)
    cuts: list[int] = _state["value"]
    return cuts


def _expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _segments(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cuts: list[int], scale: float | None
) -> torch.Tensor:
    k, v = _expand_kv(k, q.shape[1]), _expand_kv(v, q.shape[1])
    parts = [
        F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True, scale=scale)
        for a, b in zip(cuts[:-1], cuts[1:], strict=True)
    ]
    return torch.cat(parts, dim=2)


def _document_ids(cuts: list[int], device: torch.device) -> torch.Tensor:
    lengths = torch.tensor([b - a for a, b in zip(cuts[:-1], cuts[1:], strict=True)], device=device)
    return torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)


def _dense(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cuts: list[int], scale: float | None
) -> torch.Tensor:
    doc = _document_ids(cuts, q.device)
    t = doc.shape[0]
    mask = (doc[:, None] == doc[None, :]) & torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    k, v = _expand_kv(k, q.shape[1]), _expand_kv(v, q.shape[1])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None], scale=scale)


def _varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cuts: list[int], scale: float | None
) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    cu = torch.tensor(cuts, dtype=torch.int32, device=q.device)
    longest = max(b - a for a, b in zip(cuts[:-1], cuts[1:], strict=True))
    kw: dict[str, Any] = {"scale": scale}
    if "is_causal" in params:
        kw["is_causal"] = True
    else:
        kw["window_size"] = (-1, 0)  # causal
    if "enable_gqa" in params:
        kw["enable_gqa"] = q.shape[1] != k.shape[1]
    else:
        k, v = _expand_kv(k, q.shape[1]), _expand_kv(v, q.shape[1])
    # (1, H, T, D) -> (T, H, D)
    out = varlen_attn(
        q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu, cu, longest, longest, **kw
    )
    out = out[0] if isinstance(out, tuple) else out
    return out.transpose(0, 1)[None]


_flex: dict[str, Any] = {}


def _flex_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cuts: list[int], scale: float | None
) -> torch.Tensor:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if "fn" not in _flex:
        _flex["fn"] = torch.compile(flex_attention, dynamic=False)
    if _flex.get("cuts") != cuts:
        doc = _document_ids(cuts, q.device)

        def causal_in_sample(b: Any, h: Any, qi: Any, ki: Any) -> Any:
            return (doc[qi] == doc[ki]) & (qi >= ki)

        t = q.shape[2]
        _flex["cuts"], _flex["mask"] = (
            cuts,
            create_block_mask(causal_in_sample, None, None, t, t, device=q.device),
        )
    out = _flex["fn"](q, k, v, block_mask=_flex["mask"], scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out[0] if isinstance(out, tuple) else out


KERNELS: dict[str, Callable[..., torch.Tensor]] = {
    "varlen": _varlen,
    "flex": _flex_attention,
    "segments": _segments,
    "dense": _dense,
}


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: (B, H, T, D) in, (B, T, H, D) out. A padded batch, a batch
    of several rows or a row of one sample go through transformers' sdpa unchanged. Inside
    `sequence_parallel.row` a row without a mask is this rank's shard: its attention runs over the whole
    row, sequence-parallel."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_mask is None and sequence_parallel.active():
        out = sequence_parallel.attention(query, key, value, scaling, KERNELS[_state["path"]])
        return out.transpose(1, 2).contiguous(), None
    position_ids = kwargs.get("position_ids")
    cuts = _segments_of(position_ids) if position_ids is not None and query.shape[0] == 1 else None
    if attention_mask is not None or cuts is None or len(cuts) <= 2 or query.shape[2] != key.shape[2]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    out = KERNELS[_state["path"]](query, key, value, cuts, scaling)
    return out.transpose(1, 2).contiguous(), None


def packed_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable | None = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """transformers' mask interface: no mask for rows without padding (packed_attention finds the
    samples itself); sdpa's mask for padded rows."""
    from transformers.masking_utils import sdpa_mask

    if attention_mask is None:
        return None
    if mask_function is not None:  # else sdpa_mask's own default
        kwargs["mask_function"] = mask_function
    return sdpa_mask(
        batch_size, q_length, kv_length, q_offset, kv_offset, attention_mask=attention_mask, **kwargs
    )


def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, packed_attention)
    AttentionMaskInterface.register(NAME, packed_mask)


def candidates(device: torch.device) -> list[str]:
    """The paths worth trying on `device`, best first (varlen and flex train on CUDA only)."""
    return list(PATHS) if device.type == "cuda" else ["segments", "dense"]


def use(model: torch.nn.Module, path: str) -> None:
    """Run `model`'s attention through `path` (one of PATHS), or "model": its own implementation."""
    if path == "model":
        return
    if path not in PATHS:
        raise ValueError(f"unknown attention path {path!r}; choose one of {', '.join(PATHS)}")
    register()
    _state["path"] = path
    core = distributed.hf_model(model)
    core.set_attn_implementation(NAME)


def implementation(model: torch.nn.Module) -> str:
    core = distributed.hf_model(model)
    return str(core.config._attn_implementation)


def restore(model: torch.nn.Module, name: str) -> None:
    core = distributed.hf_model(model)
    if implementation(core) != name:
        core.set_attn_implementation(name)


def current() -> str:
    return str(_state["path"])
