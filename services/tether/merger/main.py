"""Merger service process. Run: python -m tether.merger"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Literal

from tether.common import broker
from tether.common.grpc_server import channel, run_until_signal, start_server
from tether.common.logs import setup_logging
from tether.common.records import SampleRecord
from tether.common.settings import CommonSettings
from tether.merger.consumer import Merger, MergerConfig
from tether.merger.merge import generation_prompt_tail
from tether.merger.servicer import MergerStatusServicer
from tether.v1 import merger_pb2, merger_pb2_grpc, trainer_pb2, trainer_pb2_grpc, types_pb2

log = logging.getLogger("tether.merger")


class MergerSettings(CommonSettings):
    """TETHER_* environment of the merger (docs/merging.md)."""

    merger_grpc_host: str = "127.0.0.1"
    merger_grpc_port: int
    trainer_address: str
    merge_mode: Literal["merge", "per-call"] = "merge"
    # Generation-prompt tail to strip before prefix matching: a JSON list of token ids. Unset: computed
    # from the tokenizer in model_dir (nothing to strip when model_dir is unset too); [] turns it off.
    strip_tail: list[int] | None = None
    model_dir: str | None = None
    chat_template_kwargs: dict[str, Any] = {}  # e.g. {"enable_thinking": false}, for the strip tail
    realign_max: int = 8
    max_prompt_len: int | None = None
    max_seq_len: int | None = None
    overlong: Literal["drop", "truncate"] = "drop"
    advantage_estimator: Literal["grpo", "drgrpo", "rloo", "reinforce_pp_baseline", "running_baseline"] = (
        "grpo"
    )
    advantage_level: Literal["rollout", "sample"] = "rollout"
    filter_zero_variance: bool = True
    group_timeout_s: float = 0.0
    call_rewards: bool = False
    turn_discount: float = 1.0
    side_calls: Literal["keep", "last_chain"] = "keep"
    # Regular expressions (a JSON list) over a sequence's system prompt: matching sequences are left out.
    side_call_patterns: list[str] = []
    baseline_alpha: float = 0.1  # running_baseline: EMA weight of a new reward
    session_training: bool = False  # rewarded record-only session calls become samples (running baseline)


def strip_tail_for(s: MergerSettings) -> tuple[int, ...]:
    """The configured strip tail, or the one computed from the model's chat template."""
    if s.strip_tail is not None:
        return tuple(s.strip_tail)
    if not s.model_dir:
        return ()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(s.model_dir)
    if not getattr(tokenizer, "chat_template", None):
        log.warning("no chat template in %s: nothing to strip before prefix matching", s.model_dir)
        return ()
    tail = generation_prompt_tail(tokenizer, **s.chat_template_kwargs)
    log.info("strip tail from %s: %s %r", s.model_dir, tail, tokenizer.decode(tail) if tail else "")
    return tuple(tail)


def config_from_settings(s: MergerSettings) -> MergerConfig:
    return MergerConfig(
        mode=s.merge_mode,
        estimator=s.advantage_estimator,
        filter_zero_variance=s.filter_zero_variance,
        max_seq_len=s.max_seq_len,
        max_prompt_len=s.max_prompt_len,
        overlong=s.overlong,
        strip_tail=strip_tail_for(s),
        realign_max=s.realign_max,
        advantage_level=s.advantage_level,
        group_timeout_s=s.group_timeout_s,
        call_rewards=s.call_rewards,
        turn_discount=s.turn_discount,
        side_calls=s.side_calls,
        side_call_patterns=tuple(s.side_call_patterns),
        baseline_alpha=s.baseline_alpha,
        session_training=s.session_training,
    )


def to_proto(s: SampleRecord) -> types_pb2.Sample:
    return s.to_proto()  # written once, beside the record


async def amain(s: MergerSettings) -> None:
    r = broker.connect(s.redis_url)
    trainer = trainer_pb2_grpc.TrainerStub(channel(s.trainer_address))

    async def submit(group_id: str, samples: list[SampleRecord], rollouts: int) -> None:
        await trainer.SubmitGroup(
            trainer_pb2.SubmitGroupRequest(
                group_id=group_id, samples=[to_proto(x) for x in samples], rollouts=rollouts
            ),
            timeout=60,
            wait_for_ready=True,
        )

    cfg = config_from_settings(s)
    log.info("merger config: %s", cfg)
    merger = Merger(r, broker.Keys(s.namespace), cfg, submit)

    def register(server):
        merger_pb2_grpc.add_MergerServicer_to_server(MergerStatusServicer(merger), server)
        return [merger_pb2.DESCRIPTOR.services_by_name["Merger"].full_name]

    server, health, port = await start_server(
        s.merger_grpc_port, register, s.merger_grpc_host, s.metrics_port
    )
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
