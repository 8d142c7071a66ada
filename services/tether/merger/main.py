"""Merger service process. Run: python -m tether.merger

With TETHER_NAMESPACE a run's (`<base>.run.<id>`) it merges that run's rollouts and hands its groups to
the trainer's run `<id>` (docs/runs.md, "A run's services"); any other namespace: the single policy.
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any, ClassVar

import grpc
from pydantic import Field, field_validator, model_validator

from tether.algorithms.names import AdvantageEstimator, AdvantageLevel, TruncatedResponses
from tether.common import broker
from tether.common.grpc_server import channel, follow_health, run_until_signal, start_server
from tether.common.logs import setup_logging
from tether.common.records import SampleRecord
from tether.common.runs import trainer_run_id
from tether.common.settings import RedisSettings, refused_settings_exit
from tether.common.usage import exit_if_help
from tether.merger.consumer import Merger, Submit
from tether.merger.merge import MergeMode, OverlongPolicy, generation_prompt_tail
from tether.merger.score import MergerConfig
from tether.merger.servicer import MergerStatusServicer
from tether.merger.sidecalls import SideCallRule, compile_patterns
from tether.v1 import merger_pb2, merger_pb2_grpc, trainer_pb2, trainer_pb2_grpc

log = logging.getLogger("tether.merger")


class MergerSettings(RedisSettings):
    """TETHER_* environment of the merger (docs/merging.md)."""

    config_section: ClassVar[str | None] = "merger"

    merger_grpc_host: str = "127.0.0.1"
    merger_grpc_port: int
    trainer_address: str
    merge_mode: MergeMode = "merge"
    # Generation-prompt tail to strip before prefix matching: a JSON list of token ids. Unset: computed
    # from the tokenizer in model_dir (nothing to strip when model_dir is unset too); [] turns it off.
    strip_tail: list[int] | None = None
    model_dir: str | None = None
    chat_template_kwargs: dict[str, Any] = {}  # e.g. {"enable_thinking": false}, for the strip tail
    realign_max: int = Field(8, ge=0)
    max_prompt_len: int | None = Field(None, gt=0)
    max_seq_len: int | None = Field(None, gt=0)
    overlong: OverlongPolicy = "drop"
    advantage_estimator: AdvantageEstimator = "grpo"
    advantage_level: AdvantageLevel = "rollout"
    filter_zero_variance: bool = True
    group_timeout_s: float = Field(0.0, ge=0)  # 0 = wait for every rollout of a group
    call_rewards: bool = False
    turn_discount: float = Field(1.0, ge=0, le=1)
    side_calls: SideCallRule = "keep"
    # Regular expressions (a JSON list) over a sequence's system prompt: matching sequences are left out.
    side_call_patterns: list[str] = []
    baseline_alpha: float = Field(0.1, gt=0, le=1)  # running_baseline: EMA weight of a new reward
    session_training: bool = False  # rewarded record-only session calls become samples (running baseline)
    # Responses cut by the output limit (DAPO): keep, exclude (no samples; reward still in the
    # baseline) or penalty (the soft overlong punishment over the last overlong_buffer_tokens of each
    # call's limit, times overlong_penalty, added to the reward).
    truncated_responses: TruncatedResponses = "keep"
    overlong_buffer_tokens: int | None = Field(None, gt=0)
    overlong_penalty: float = Field(1.0, gt=0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _penalty_has_a_buffer(self) -> MergerSettings:
        if self.truncated_responses == "penalty" and self.overlong_buffer_tokens is None:
            raise ValueError(
                "truncated_responses=penalty needs overlong_buffer_tokens (L_cache: the last tokens of "
                "a call's output limit over which the penalty grows from 0 to overlong_penalty)"
            )
        return self

    @field_validator("side_call_patterns")
    @classmethod
    def _patterns_compile(cls, v: list[str]) -> list[str]:
        try:
            compile_patterns(v)
        except re.error as exc:
            raise ValueError(f"bad side-call pattern: {exc}") from None
        return v


def strip_tail_for(s: MergerSettings) -> tuple[int, ...]:
    """The configured strip tail, or the one computed from the model's chat template."""
    if s.strip_tail is not None:
        return tuple(s.strip_tail)
    if not s.model_dir:
        return ()
    try:  # only here: the merger never imports transformers otherwise (tests/test_import_contract.py)
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise SystemExit(
            "TETHER_MODEL_DIR: the merger renders its chat template with transformers, which the [merger] "
            "extra leaves out; install tether-rl[merger,chat-template], or set TETHER_STRIP_TAIL (a JSON "
            "list of token ids, [] for none) and leave TETHER_MODEL_DIR unset"
        ) from exc

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
        truncated_responses=s.truncated_responses,
        overlong_buffer_tokens=s.overlong_buffer_tokens or 1,
        overlong_penalty=s.overlong_penalty,
    )


def trainer_submitter(trainer: trainer_pb2_grpc.TrainerStub, run_id: str = "") -> Submit:
    """The merger's hand-over: one SubmitGroup per scored group (waiting for a restarting trainer), for
    the trainer's run `run_id` (a run's namespace's merger: common.runs.trainer_run_id; "" the single
    policy)."""

    async def submit(group_id: str, samples: list[SampleRecord], rollouts: int) -> None:
        await trainer.SubmitGroup(
            trainer_pb2.SubmitGroupRequest(
                group_id=group_id,
                samples=[x.to_proto() for x in samples],
                rollouts=rollouts,
                run_id=run_id,
            ),
            timeout=60,
            wait_for_ready=True,
        )

    return submit


async def reachable(r: Any, trainer_channel: grpc.aio.Channel, timeout_s: float = 2.0) -> bool:
    """The merger's health: Redis answers a ping and the trainer's channel connects, each within
    `timeout_s` (either one gone, no group can be merged or handed over)."""
    await asyncio.wait_for(r.ping(), timeout_s)
    await asyncio.wait_for(trainer_channel.channel_ready(), timeout_s)
    return True


async def amain(s: MergerSettings) -> None:
    r = broker.connect(s.redis_url)
    trainer_channel = channel(s.trainer_address)
    trainer = trainer_pb2_grpc.TrainerStub(trainer_channel)

    cfg = config_from_settings(s)
    log.info("merger config: %s", cfg)
    run_id = trainer_run_id(s.namespace)
    if run_id:
        log.info("namespace %s: groups go to the trainer's run %s", s.namespace, run_id)
    merger = Merger(r, s.keys(), cfg, trainer_submitter(trainer, run_id))

    def register(server: grpc.aio.Server) -> list[str]:
        merger_pb2_grpc.add_MergerServicer_to_server(MergerStatusServicer(merger), server)
        return [merger_pb2.DESCRIPTOR.services_by_name["Merger"].full_name]

    server, health, port = await start_server(
        s.merger_grpc_port, register, s.merger_grpc_host, s.metrics_port
    )
    await r.ping()
    await broker.agree_trace_partitions(r, s.keys())
    log.info("merger on %s:%d", s.merger_grpc_host, port)
    try:
        await run_until_signal(
            server,
            health,
            [merger.run(), follow_health(health, lambda: reachable(r, trainer_channel), what="merger")],
        )
    finally:
        await r.aclose()


def main() -> None:
    exit_if_help(MergerSettings, __doc__)
    with refused_settings_exit("merger"):
        s = MergerSettings()
    setup_logging("merger", s.log_level)
    with refused_settings_exit("merger"):
        asyncio.run(amain(s))


if __name__ == "__main__":
    main()
