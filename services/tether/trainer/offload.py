"""Adam with its state in CPU memory, for parameters and gradients that stay on the device
(`TETHER_FSDP_OFFLOAD=optimizer`). Built by tether.trainer.main; the trainer calls it as any
torch.optim.Optimizer (`step`, `zero_grad`, `param_groups`, `state_dict`, `load_state_dict`, and
torch.distributed.checkpoint's get/set_optimizer_state_dict through those).

Per trainable parameter this rank holds (under FSDP2: its own shard), CPU memory keeps an fp32 copy of
the values (the master the update is computed on), Adam's two moments and a buffer the gradient is
copied into. A step copies the gradients to CPU (pinned, asynchronous on CUDA), runs torch.optim.Adam
there with the same hyper-parameters, and copies the updated values back. The device thus holds the
weights and gradients only: 8 bytes per fp32 parameter instead of 16 (memory_plan.static_bytes).

The state dict is Adam's own (keyed by the device parameters, moments as DTensors over the same mesh
when the parameters are FSDP2 shards), so checkpoints are interchangeable with a plain Adam's and DCP
writes each rank's shard of the moments as it does for Adam.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def _dtensor(t: torch.Tensor) -> DTensor | None:
    """``t`` as a DTensor when it is one. torch.distributed.tensor is looked up, not imported: no tensor
    can be a DTensor before something imported it (FSDP2 does), and importing it costs a trainer's
    start-up seconds (it brings sympy)."""
    module = sys.modules.get("torch.distributed.tensor")
    return t if module is not None and isinstance(t, module.DTensor) else None


def _local(t: torch.Tensor) -> torch.Tensor:
    d = _dtensor(t)
    return d.to_local() if d is not None else t


def _like(local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """`local` (a CPU tensor) as the same kind of tensor as `param`: a DTensor shard when it is one."""
    d = _dtensor(param)
    if d is not None:
        return type(d).from_local(
            local,
            d.device_mesh,
            d.placements,
            run_check=False,
            shape=d.shape,
            stride=d.stride(),
        )
    return local


class CPUOffloadOptimizer(torch.optim.Optimizer):
    """torch.optim.Adam over fp32 CPU copies of `params`; `params` themselves only receive the result.

    `pin_memory`: page-locked CPU buffers, so the copies to and from a GPU run asynchronously (default:
    when the parameters are on CUDA).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        pin_memory: bool | None = None,
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        device_params = [p for g in self.param_groups for p in g["params"]]
        if pin_memory is None:
            pin_memory = any(_local(p).is_cuda for p in device_params)
        self._pin = pin_memory and torch.cuda.is_available()
        self._master: dict[torch.Tensor, torch.Tensor] = {}
        self._grad: dict[torch.Tensor, torch.Tensor] = {}
        inner_groups = []
        with torch.no_grad():
            for group in self.param_groups:
                masters = []
                for p in group["params"]:
                    local = _local(p.detach())
                    master = torch.empty(local.shape, dtype=torch.float32, pin_memory=self._pin)
                    master.copy_(local)
                    self._master[p] = _like(master, p)
                    self._grad[p] = torch.empty(local.shape, dtype=torch.float32, pin_memory=self._pin)
                    masters.append(self._master[p])
                inner_groups.append({**self._hyper(group), "params": masters})
        # foreach/fused off: the masters may be DTensors, whose per-op path is the one known to work.
        self.cpu_adam = torch.optim.Adam(inner_groups, foreach=False)

    @staticmethod
    def _hyper(group: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in group.items() if k != "params"}

    def _link_state(self) -> None:
        """Expose the CPU Adam's state under the device parameters (what state_dict and DCP read)."""
        self.state.clear()
        for p, master in self._master.items():
            if master in self.cpu_adam.state:
                self.state[p] = self.cpu_adam.state[master]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # The hyper-parameters are the device-side groups' (the trainer sets lr, betas after resume).
        for group, inner in zip(self.param_groups, self.cpu_adam.param_groups, strict=True):
            inner.update(self._hyper(group))
        copies = False
        for p, master in self._master.items():
            if p.grad is None:
                master.grad = None
                continue
            grad = _local(p.grad)
            buf = self._grad[p]
            buf.copy_(grad, non_blocking=self._pin)
            copies = copies or grad.is_cuda
            master.grad = _like(buf, p)
        if copies and self._pin:
            torch.cuda.current_stream().synchronize()  # the asynchronous copies have landed
        self.cpu_adam.step()
        for p, master in self._master.items():
            if master.grad is not None:
                # Asynchronous on CUDA: the next write to the master comes after the next step's gradient
                # copies, which the same stream runs after this one.
                _local(p.detach()).copy_(_local(master), non_blocking=self._pin)
                master.grad = None
        self._link_state()
        return loss

    def state_dict(self) -> dict[str, Any]:
        self._link_state()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Adam's state dict (this class's, or a plain Adam's): the moments go to the CPU copies in fp32,
        the hyper-parameters to the device-side groups."""
        self.cpu_adam.load_state_dict(state_dict)
        for group, saved in zip(self.param_groups, state_dict["param_groups"], strict=True):
            group.update({k: v for k, v in saved.items() if k not in ("params", "param_names")})
        self._link_state()
