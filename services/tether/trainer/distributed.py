"""Data-parallel plumbing for the trainer: process group, model wrapping, collectives, full state dicts.

Launch several ranks with torchrun (``torchrun --nproc-per-node N -m tether.trainer``). Every rank
loads the model; rank 0 serves gRPC and broadcasts each command (train a step, heartbeat, stop) to the
others, which follow it (`tether.trainer.steps.StepRunner.follow`). Gloo on CPU, NCCL on GPUs; DDP
wraps the model, or FSDP2 ``fully_shard`` when asked (on GPUs, or on CPU with gloo, as the tests run
it), optionally with CPU offload (`Offload`: the optimizer's state, offload.py, or FSDP2's own
``CPUOffloadPolicy`` for parameters, gradients and optimizer state). A process started without torchrun is a
world of one: no process group, no wrapper, every helper here is then a no-op.

Gradient reduction averages over ranks; the trainer multiplies each rank's loss by the world size so
that the average becomes the sum of globally normalised per-token terms (tether.algorithms.losses).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

# What FSDP2 keeps in CPU memory instead of the device: nothing, Adam's state, or everything.
Offload = Literal["none", "optimizer", "params"]


@dataclass(frozen=True)
class Dist:
    """Where this process sits in the data-parallel world."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    fsdp: bool = False
    offload: Offload = "none"

    @property
    def active(self) -> bool:
        return self.world > 1


def resolve_device(setting: str, local_rank: int = 0) -> torch.device:
    """`auto` = this rank's GPU when CUDA is there, else CPU; `cpu`; `cuda` (fails without a GPU)."""
    if setting not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, got {setting!r}")
    if setting == "cpu" or (setting == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("device=cuda but no CUDA device is visible")
    return torch.device("cuda", local_rank)


def _backend(device: torch.device, offload: Offload) -> str:
    if device.type != "cuda":
        return "gloo"
    # Parameters offloaded by FSDP2 have their gradients, and so clip_grad_norm_'s per-rank norms, in CPU
    # memory: their all-reduce needs a backend for CPU tensors beside NCCL.
    return "cpu:gloo,cuda:nccl" if offload == "params" else "nccl"


def init(
    device_setting: str = "auto", fsdp: bool = False, timeout_s: float = 1800.0, offload: Offload = "none"
) -> Dist:
    """Join the process group torchrun describes (WORLD_SIZE, RANK, LOCAL_RANK, MASTER_*), if any."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(device_setting, local_rank)
    if offload != "none" and not fsdp:
        raise ValueError(f"offload={offload} is FSDP's: it needs fsdp")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = _backend(device, offload)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(
            backend, timeout=timedelta(seconds=timeout_s), device_id=device if device.type == "cuda" else None
        )
    elif fsdp and not dist.is_initialized() and "RANK" not in os.environ:
        # FSDP2 needs a process group even on one rank; started without torchrun, make a private one.
        dist.init_process_group(
            backend,
            store=dist.HashStore(),
            rank=0,
            world_size=1,
            device_id=device if device.type == "cuda" else None,
            timeout=timedelta(seconds=timeout_s),
        )
    return Dist(rank=rank, world=world, local_rank=local_rank, device=device, fsdp=fsdp, offload=offload)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def wrap(model: torch.nn.Module, d: Dist, bf16: bool = False) -> torch.nn.Module:
    """The module to run forward/backward on: the model itself (one rank), DDP, or FSDP2 in place.
    With `bf16`, FSDP2 gathers parameters in bf16 (half the traffic and memory of fp32) and reduces
    gradients in fp32; the sharded fp32 parameters stay the optimizer's master weights. With
    `d.offload == "params"` the shards (and their gradients, and so the optimizer) live in CPU memory,
    pinned on a GPU, and are copied to the device block by block for forward and backward."""
    if d.fsdp:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        kw: dict[str, Any] = {}
        if bf16:
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if d.offload == "params":
            kw["offload_policy"] = CPUOffloadPolicy(pin_memory=d.device.type == "cuda")
        # Shard every transformer block (HF names them in _no_split_modules), then the root.
        block_names = set(getattr(model, "_no_split_modules", None) or ())
        for module in model.modules():
            if type(module).__name__ in block_names:
                fully_shard(module, **kw)
        fully_shard(model, **kw)
        return model
    if d.active:
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[d.local_rank] if d.device.type == "cuda" else None)
    return model


def unwrap(engine: torch.nn.Module) -> torch.nn.Module:
    """The model inside a DDP wrapper (FSDP2 shards in place, so nothing to unwrap there)."""
    return getattr(engine, "module", engine) if type(engine).__name__ == "DistributedDataParallel" else engine


def hf_model(model: torch.nn.Module) -> Any:
    """The transformers model itself: inside DDP's wrapper, and inside peft's (its base model). Typed
    Any, as transformers types its models' configs (their fields are the checkpoint's)."""
    core: Any = unwrap(model)
    return core.get_base_model() if hasattr(core, "get_base_model") else core


@contextlib.contextmanager
def grad_sync(engine: torch.nn.Module, enabled: bool) -> Iterator[None]:
    """Reduce gradients across ranks in this backward only if `enabled` (accumulate locally otherwise)."""
    if enabled or not dist.is_initialized():
        yield
    elif hasattr(engine, "set_requires_gradient_sync"):  # FSDP2
        fsdp = cast("FSDPModule", engine)
        fsdp.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            fsdp.set_requires_gradient_sync(True)
    elif hasattr(engine, "no_sync"):  # DDP
        with cast("DistributedDataParallel", engine).no_sync():
            yield
    else:
        yield


def _device_for_collectives() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )


def all_reduce(values: list[float], op: str = "sum") -> list[float]:
    """Element-wise sum or max of a list of floats over all ranks (fp64, so counts stay exact)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=_device_for_collectives())
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t.tolist()


def broadcast(obj: Any, src: int = 0) -> Any:
    """Rank `src`'s picklable object, on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, device=_device_for_collectives())
    return box[0]


def model_state(model: torch.nn.Module, d: Dist) -> dict[str, torch.Tensor] | None:
    """Full (unsharded) model state dict on rank 0's CPU under FSDP (a collective); None otherwise,
    meaning "use the model's own tensors"."""
    if not d.fsdp:
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # A full state dict of a model holds plain tensors (the declared value type covers optimizer state).
    return cast(dict[str, torch.Tensor], sd) if d.rank == 0 else None


@contextlib.contextmanager
def _single_process_is_meant() -> Iterator[None]:
    # One process without a process group is a supported setup here, not a mistake to warn about.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def save_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """Write the optimizer state into `folder` with torch.distributed.checkpoint: every rank writes
    what it holds (FSDP2: its own shards; replicated state once), nothing is gathered. Keyed by
    parameter names, so it loads on another world size. A collective when several ranks run."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    with _single_process_is_meant():
        dcp.save(
            {"optimizer": get_optimizer_state_dict(model, optimizer)},
            checkpoint_id=str(folder),
            no_dist=not dist.is_initialized(),
        )


def load_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """Read `save_optimizer`'s folder into this rank's optimizer (each rank reads the shards it needs)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
    with _single_process_is_meant():
        dcp.load(state, checkpoint_id=str(folder), no_dist=not dist.is_initialized())
    set_optimizer_state_dict(model, optimizer, state["optimizer"])


def load_optimizer_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict, d: Dist
) -> None:
    """Load a whole, name-keyed optimizer state (format-1 checkpoints; every rank passes the same)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    # Unsharded models take the name-keyed state as is; FSDP2 shards the full state itself.
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=d.fsdp))
