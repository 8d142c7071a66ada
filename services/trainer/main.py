"""Trainer service process. Run: python -m tether.trainer"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import torch

from tether.common.grpc_server import run_until_signal, start_server
from tether.common.logs import setup_logging
from tether.common.settings import CommonSettings
from tether.trainer.service import TrainerServicer, load_model
from tether.trainer.train import StepConfig
from tether.v1 import trainer_pb2, trainer_pb2_grpc

log = logging.getLogger("tether.trainer")


class TrainerSettings(CommonSettings):
    redis_url: str = ""
    trainer_grpc_host: str = "127.0.0.1"
    trainer_grpc_port: int
    model_dir: str
    checkpoint_dir: str
    lr: float = 1e-3
    adam_beta2: float = 0.99
    weight_decay: float = 0.0
    loss_mode: str = "token-mean"
    clip_low: float = 0.2
    clip_high: float = 0.2
    micro_batch_tokens: int = 4096
    seed: int = 0
    torch_threads: int = 1


async def amain(s: TrainerSettings) -> None:
    torch.set_num_threads(s.torch_threads)
    model, tokenizer = load_model(s.model_dir, s.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=s.lr, betas=(0.9, s.adam_beta2),
                                 weight_decay=s.weight_decay)
    cfg = StepConfig(loss_mode=s.loss_mode, clip_low=s.clip_low, clip_high=s.clip_high,
                     micro_batch_tokens=s.micro_batch_tokens,
                     pad_token_id=int(tokenizer.pad_token_id or 0))
    servicer = TrainerServicer(model, tokenizer, optimizer, cfg, Path(s.checkpoint_dir))

    def register(server):
        trainer_pb2_grpc.add_TrainerServicer_to_server(servicer, server)
        return [trainer_pb2.DESCRIPTOR.services_by_name["Trainer"].full_name]

    server, health, port = await start_server(s.trainer_grpc_port, register, s.trainer_grpc_host,
                                              s.metrics_port)
    await health.set(True)
    log.info("trainer on %s:%d (model %s, lr %g)", s.trainer_grpc_host, port, s.model_dir, s.lr)
    await run_until_signal(server, health)


def main() -> None:
    s = TrainerSettings()
    setup_logging("trainer", s.log_level)
    asyncio.run(amain(s))


if __name__ == "__main__":
    main()
