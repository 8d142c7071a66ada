"""gRPC Trainer servicer: buffers complete groups handed over by the merger, trains on request."""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from pathlib import Path

import grpc
import torch
from prometheus_client import Counter, Gauge, Histogram

from tether.common.records import SampleRecord
from tether.trainer.train import StepConfig, train_step
from tether.trainer.weights import save_checkpoint
from tether.v1 import trainer_pb2, trainer_pb2_grpc

log = logging.getLogger(__name__)

STEPS = Counter("tether_trainer_steps_total", "Training steps done")
BUFFERED = Gauge("tether_trainer_buffered_groups", "Complete groups waiting to be trained on")
STEP_SECONDS = Histogram("tether_trainer_step_seconds", "Wall time of one training step",
                         buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300))
TOKENS = Counter("tether_trainer_tokens_total", "Tokens trained on")
VERSION = Gauge("tether_trainer_weight_version", "Version of the newest checkpoint")


def sample_from_proto(p) -> SampleRecord:
    return SampleRecord(
        rollout_id=p.rollout_id, group_id=p.group_id, task_id=p.task_id, sequence_index=p.sequence_index,
        token_ids=list(p.token_ids), loss_mask=list(p.loss_mask), rollout_logprobs=list(p.rollout_logprobs),
        advantages=list(p.advantages), reward=p.reward, weight_version=p.weight_version,
        rollout_sequences=p.rollout_sequences,
    )


def validate(sample: SampleRecord, vocab_size: int) -> str | None:
    n = len(sample.token_ids)
    if n < 2:
        return "a sample needs at least 2 tokens"
    if not (len(sample.loss_mask) == len(sample.rollout_logprobs) == len(sample.advantages) == n):
        return "token_ids, loss_mask, rollout_logprobs and advantages must have equal lengths"
    if any(t < 0 or t >= vocab_size for t in sample.token_ids):
        return f"token id outside the vocabulary (size {vocab_size})"
    if any(m not in (0, 1) for m in sample.loss_mask):
        return "loss_mask values must be 0 or 1"
    return None


class TrainerServicer(trainer_pb2_grpc.TrainerServicer):
    def __init__(self, model, tokenizer, optimizer, cfg: StepConfig, checkpoint_root: Path,
                 start_version: int = 0) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.optimizer = optimizer
        self.cfg = cfg
        self.checkpoint_root = checkpoint_root
        self.version = start_version
        self.steps_done = 0
        self.groups: OrderedDict[str, tuple[list[SampleRecord], int]] = OrderedDict()
        self.seen_groups: set[str] = set()
        self.lock = asyncio.Lock()
        self.vocab_size = int(model.config.vocab_size)

    async def SubmitGroup(self, request, context):
        if not request.group_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "group_id is required")
        if request.group_id in self.seen_groups:
            return trainer_pb2.SubmitGroupResponse(buffered_groups=len(self.groups), duplicate=True)
        samples = [sample_from_proto(p) for p in request.samples]
        for s in samples:
            problem = validate(s, self.vocab_size)
            if problem:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"rollout {s.rollout_id}: {problem}")
        self.seen_groups.add(request.group_id)
        self.groups[request.group_id] = (samples, request.rollouts)
        BUFFERED.set(len(self.groups))
        return trainer_pb2.SubmitGroupResponse(buffered_groups=len(self.groups), duplicate=False)

    async def TrainStep(self, request, context):
        async with self.lock:
            need = max(1, request.min_groups)
            if len(self.groups) < need:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"{len(self.groups)} groups buffered, step needs {need}")
            take = len(self.groups) if request.max_groups <= 0 else min(request.max_groups, len(self.groups))
            chosen = [self.groups.popitem(last=False) for _ in range(take)]
            BUFFERED.set(len(self.groups))
            samples = [s for _, (group, _) in chosen for s in group]
            with STEP_SECONDS.time():
                metrics = await asyncio.to_thread(train_step, self.model, self.optimizer, samples, self.cfg)
                new_version = self.version + 1
                path = await asyncio.to_thread(save_checkpoint, self.model, self.tokenizer,
                                               self.checkpoint_root, new_version)
            self.version = new_version
            self.steps_done += 1
            STEPS.inc()
            TOKENS.inc(metrics["tokens"])
            VERSION.set(new_version)
            metrics["groups"] = float(take)
            log.info("step %d -> version %d: %s", request.step, new_version,
                     {k: round(v, 4) for k, v in metrics.items()})
            return trainer_pb2.TrainStepResponse(step=request.step, weight_version=new_version,
                                                 checkpoint_dir=str(path), metrics=metrics)

    async def GetStatus(self, request, context):
        return trainer_pb2.TrainerStatus(
            buffered_groups=len(self.groups), buffered_samples=sum(len(g) for g, _ in self.groups.values()),
            weight_version=self.version, steps_done=self.steps_done)


def load_model(model_dir: str, seed: int):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return model, tokenizer
