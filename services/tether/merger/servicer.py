"""gRPC Merger: the merger's counters as a status (operators, the tests). Read-only."""

from __future__ import annotations

import grpc

from tether.merger.consumer import Merger
from tether.v1 import merger_pb2, merger_pb2_grpc, types_pb2


class MergerStatusServicer(merger_pb2_grpc.MergerServicer):
    def __init__(self, merger: Merger) -> None:
        self.merger = merger

    async def GetStatus(
        self, request: types_pb2.Empty, context: grpc.aio.ServicerContext
    ) -> merger_pb2.MergerStatus:
        c = self.merger.counts
        return merger_pb2.MergerStatus(
            rollouts_merged=c.rollouts_merged,
            groups_emitted=c.groups_emitted,
            groups_pending=len(c.pending),
            groups_filtered=c.groups_filtered,
            sequences=c.sequences,
            forks=c.forks,
            calls_dropped=c.calls_dropped,
            calls_dropped_by_reason=dict(c.dropped_by_reason),
            groups_timed_out=c.groups_timed_out,
            late_rollouts=c.late_rollouts,
            rollouts_retried=c.rollouts_retried,
            single_sequence_rollouts=c.single_sequence_rollouts,
            realigns=c.realigns,
            mismatched_calls=c.mismatched_calls,
            truncated=c.truncated,
            call_rewards_applied=c.call_rewards_applied,
            untrainable_by_reason=dict(c.untrainable_by_reason),
            side_sequences_excluded=c.side_sequences_excluded,
            session_rewards_trained=c.session_rewards_trained,
        )
