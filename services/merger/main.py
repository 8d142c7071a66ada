"""Merger service process. Run: python -m tether.merger"""

from __future__ import annotations

import asyncio
import logging

from tether.common import broker
from tether.common.grpc_server import channel, run_until_signal, start_server
from tether.common.logs import setup_logging
from tether.common.records import SampleRecord
from tether.common.settings import CommonSettings
from tether.merger.service import Merger, MergerConfig
from tether.v1 import merger_pb2, merger_pb2_grpc, trainer_pb2, trainer_pb2_grpc, types_pb2

log = logging.getLogger("tether.merger")


class MergerSettings(CommonSettings):
    merger_grpc_host: str = "127.0.0.1"
    merger_grpc_port: int
    trainer_address: str
    merge_mode: str = "merge"
    advantage_estimator: str = "grpo"
    filter_zero_variance: bool = True
    max_seq_len: int | None = None


def to_proto(s: SampleRecord) -> types_pb2.Sample:
    return types_pb2.Sample(
        rollout_id=s.rollout_id, group_id=s.group_id, task_id=s.task_id, sequence_index=s.sequence_index,
        token_ids=s.token_ids, loss_mask=s.loss_mask, rollout_logprobs=s.rollout_logprobs,
        advantages=s.advantages, reward=s.reward, weight_version=s.weight_version,
        rollout_sequences=s.rollout_sequences)


class MergerStatusServicer(merger_pb2_grpc.MergerServicer):
    def __init__(self, merger: Merger) -> None:
        self.merger = merger

    async def GetStatus(self, request, context):
        c = self.merger.counts
        return merger_pb2.MergerStatus(
            rollouts_merged=c.rollouts_merged, groups_emitted=c.groups_emitted, groups_pending=len(c.pending),
            groups_filtered=c.groups_filtered, sequences=c.sequences, forks=c.forks,
            calls_dropped=c.calls_dropped)


async def amain(s: MergerSettings) -> None:
    r = broker.connect(s.redis_url)
    trainer = trainer_pb2_grpc.TrainerStub(channel(s.trainer_address))

    async def submit(group_id: str, samples: list[SampleRecord], rollouts: int) -> None:
        await trainer.SubmitGroup(trainer_pb2.SubmitGroupRequest(
            group_id=group_id, samples=[to_proto(x) for x in samples], rollouts=rollouts), timeout=60,
            wait_for_ready=True)

    merger = Merger(r, broker.Keys(s.namespace),
                    MergerConfig(mode=s.merge_mode, estimator=s.advantage_estimator,
                                 filter_zero_variance=s.filter_zero_variance, max_seq_len=s.max_seq_len),
                    submit)

    def register(server):
        merger_pb2_grpc.add_MergerServicer_to_server(MergerStatusServicer(merger), server)
        return [merger_pb2.DESCRIPTOR.services_by_name["Merger"].full_name]

    server, health, port = await start_server(s.merger_grpc_port, register, s.merger_grpc_host, s.metrics_port)
    await r.ping()
    await health.set(True)
    log.info("merger on %s:%d", s.merger_grpc_host, port)
    try:
        await run_until_signal(server, health, [merger.run()])
    finally:
        await r.aclose()


def main() -> None:
    s = MergerSettings()
    setup_logging("merger", s.log_level)
    asyncio.run(amain(s))


if __name__ == "__main__":
    main()
