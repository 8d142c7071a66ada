"""Sequence parallelism (Ulysses-style): one packed row's tokens split over the P ranks of a group.

For trajectories one device cannot hold, `train.train_step` with `StepConfig.sequence_parallel` P > 1
splits each packed row into P contiguous shards (the row padded to a multiple of P; the padding is its
own segment after every sample, so nothing attends to it and it has no target). Every block runs on the
local shard; only attention needs the whole row. In each attention layer one all-to-all turns this
rank's (shard, all heads) queries, keys and values into (whole row, heads / P), the row's attention runs
with the trainer's packed kernels (attention.py, the samples' boundaries given for the whole row), and a
second all-to-all returns (shard, all heads). An all-to-all with equal splits is its own adjoint, so
backward is the same exchange of the gradients (`_AllToAll`). Idea from DeepSpeed-Ulysses (Jacobs et
al. 2023); the code is ours.

Ranks r..r+P-1 (r a multiple of P) form a group; a world of W ranks is W / P data-parallel replicas of
such groups. Each rank's parameter gradient is a partial sum (its shard's tokens), so the data-parallel
reduction over all W ranks, scaled by W as without groups, gives the whole batch's gradient.

Called by attention.packed_attention (inside `row`) and train.train_step; the layout helpers are pure.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from tether.trainer import distributed

_state: dict[str, Any] = {"group": None, "size": 1, "cuts": None}
_groups: dict[tuple[int, int], Any] = {}


# --- layout: pure reshapes around the exchange -----------------------------------------------------------


def shard_bounds(length: int, size: int, rank: int) -> tuple[int, int, int]:
    """(start, end, padded length) of `rank`'s shard of a row of `length` tokens split over `size`
    ranks: the row is padded to a multiple of `size` and cut into equal contiguous shards."""
    per = -(-length // size)
    return rank * per, (rank + 1) * per, per * size


def scatter_heads(x: torch.Tensor, size: int) -> torch.Tensor:
    """(1, H, S, D) local shard, all heads -> (size, H / size, S, D): block j is heads
    [j H / size, (j + 1) H / size), for rank j."""
    _, heads, s, d = x.shape
    return x[0].reshape(size, heads // size, s, d).contiguous()


def gather_sequence(y: torch.Tensor) -> torch.Tensor:
    """(size, h, S, D) received (block i: rank i's shard of my h heads) -> (1, h, size x S, D)."""
    size, h, s, d = y.shape
    return y.permute(1, 0, 2, 3).reshape(h, size * s, d)[None]


def scatter_sequence(z: torch.Tensor, size: int) -> torch.Tensor:
    """(1, h, T, D) whole row, my h heads -> (size, h, T / size, D): block j is rank j's shard."""
    _, h, t, d = z.shape
    return z[0].reshape(h, size, t // size, d).permute(1, 0, 2, 3).contiguous()


def gather_heads(y: torch.Tensor) -> torch.Tensor:
    """(size, h, S, D) received (block j: heads of rank j for my shard) -> (1, size x h, S, D)."""
    size, h, s, d = y.shape
    return y.reshape(size * h, s, d)[None]


# --- the exchange ----------------------------------------------------------------------------------------


def _all_to_all(x: torch.Tensor, group: Any) -> torch.Tensor:
    # Both buffers contiguous: a gradient may arrive with any strides, and the exchange copies memory.
    x = x.contiguous()
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    dist.all_to_all_single(out, x, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """Block j of dim 0 goes to rank j; block i of the result came from rank i. The map is a
    permutation whose transpose is the same exchange, so backward exchanges the gradients alike."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _all_to_all(x, group)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_to_all(grads[0], ctx.group), None


def exchange(x: torch.Tensor, group: Any) -> torch.Tensor:
    out: torch.Tensor = _AllToAll.apply(x, group)
    return out


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float | None,
    kernel: Callable[..., torch.Tensor],
) -> torch.Tensor:
    """(1, H, S, D) queries and (1, Hkv, S, D) keys/values of this rank's shard -> (1, H, S, D)
    attention over the whole row (inside `row`), through `kernel` (attention.KERNELS' signature).
    Keys and values are repeated to H heads first when Hkv does not divide by the group's size."""
    size, group, cuts = _state["size"], _state["group"], _state["cuts"]
    heads, kv = query.shape[1], key.shape[1]
    if kv % size:
        key = key.repeat_interleave(heads // kv, dim=1)
        value = value.repeat_interleave(heads // kv, dim=1)
        kv = heads
    # One exchange for q, k and v: block j carries rank j's heads of all three.
    send = torch.cat([scatter_heads(query, size), scatter_heads(key, size), scatter_heads(value, size)], 1)
    got = exchange(send, group)
    hq, hkv = heads // size, kv // size
    q, k, v = (gather_sequence(part) for part in torch.split(got, [hq, hkv, hkv], dim=1))
    out = kernel(q, k, v, cuts, scale)
    return gather_heads(exchange(scatter_sequence(out, size), group))


# --- who runs with whom ----------------------------------------------------------------------------------


def check_heads(model: torch.nn.Module, size: int) -> None:
    """Refuse a model whose attention heads do not split over `size` ranks (ValueError)."""
    core = distributed.hf_model(model)
    cfg = getattr(core, "config", None)
    heads = int(getattr(cfg, "num_attention_heads", 0) or 0)
    if heads == 0 or heads % size:
        raise ValueError(
            f"sequence_parallel={size} splits the attention heads over {size} ranks, but "
            f"{type(core).__name__} has {heads or 'an unknown number of'} heads: choose a divisor of {heads}"
        )


def group(size: int) -> Any:
    """This rank's sequence-parallel group (ranks r..r+size-1, r a multiple of size). The first call
    creates every group: a collective, every rank calls it with the same size."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % size:
        raise ValueError(f"sequence_parallel={size} does not divide the world of {world} ranks")
    if (size, world) not in _groups:
        mine = None
        for start in range(0, world, size):
            g = dist.new_group(list(range(start, start + size)))
            if start <= rank < start + size:
                mine = g
        _groups[(size, world)] = mine
    return _groups[(size, world)]


@contextlib.contextmanager
def row(group_: Any, size: int, cuts: list[int]) -> Iterator[None]:
    """Within: the packed attention of a row without a mask runs sequence-parallel over `group_`,
    `cuts` being the whole (padded) row's sample boundaries (attention.boundaries)."""
    _state.update(group=group_, size=size, cuts=cuts)
    try:
        yield
    finally:
        _state.update(group=None, size=1, cuts=None)


def active() -> bool:
    return _state["cuts"] is not None
