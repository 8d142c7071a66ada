"""One rank of a CPU process group the tests spawn themselves (torch.multiprocessing): the environment
torchrun would give it, one torch thread, and the trainer's own `distributed.init` on gloo."""

from __future__ import annotations

import os

import torch

from tether.trainer import distributed


def join(rank: int, world: int, port: int, fsdp: bool = False) -> distributed.Dist:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    return distributed.init("cpu", fsdp=fsdp)
