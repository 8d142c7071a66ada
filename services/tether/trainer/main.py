"""Trainer service process. Run: python -m tether.trainer
(several data-parallel ranks: torchrun --nproc-per-node N -m tether.trainer; rank 0 serves gRPC).

Startup: join the process group (if torchrun started us), resume from the newest complete checkpoint
in TETHER_CHECKPOINT_DIR (model, optimizer, version, steps done) or load TETHER_MODEL_DIR, apply the
options (LoRA, gradient checkpointing, DDP/FSDP2), then serve (rank 0) or follow rank 0 (the others).
With TETHER_WEIGHT_PUSH=nccl rank 0 also serves PushWeights (path 2, docs/weight-push.md).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

import grpc
import torch
from pydantic import BeforeValidator, Field, ValidationError, model_validator

from tether.algorithms.names import KLEstimator, LossDenominator, LossMode, OffPolicyMode, PolicyLoss
from tether.common.grpc_server import Health, run_until_signal, start_server
from tether.common.logs import setup_logging
from tether.common.settings import CommonSettings, WeightPush, refused_settings_exit, section_problems
from tether.common.sharing import SharingPolicy
from tether.common.usage import exit_if_help
from tether.trainer import attention, distributed, memory_plan, sequence_parallel, throughput, weights
from tether.trainer.distributed import Dist, Offload
from tether.trainer.offload import CPUOffloadOptimizer
from tether.trainer.runs import RunPolicy, RunSet
from tether.trainer.servicer import TrainerServicer
from tether.trainer.steps import PATHS, RunRefused, StepRunner, Trainer, TrainerCore
from tether.trainer.train import (
    StepConfig,
    choose_attention,
    chunked_head_matches,
    enable_activation_checkpointing,
    measure_activations,
    packing_keeps_samples_apart,
)
from tether.trainer.weights import apply_lora, load_model
from tether.v1 import trainer_pb2, trainer_pb2_grpc

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from tether.trainer.nccl_push import WeightPusher

log = logging.getLogger("tether.trainer")


def _on_off(v: object) -> object:
    """true/false (and 1/0, yes/no) as on/off; anything else as given, for the Literal to judge."""
    if isinstance(v, bool):
        return "on" if v else "off"
    if isinstance(v, str) and v.strip().lower() in ("true", "false", "1", "0", "yes", "no"):
        return "on" if v.strip().lower() in ("true", "1", "yes") else "off"
    return v


# In the type, not a validator of the class: the run-config check validates each key by its type alone
# (tether.common.settings.section_problems), and must take what the service takes.
AutoOnOff = Annotated[Literal["auto", "on", "off"], BeforeValidator(_on_off)]


class TrainerSettings(CommonSettings):
    config_section: ClassVar[str | None] = "trainer"

    trainer_grpc_host: str = "127.0.0.1"
    trainer_grpc_port: int
    model_dir: str
    checkpoint_dir: str
    # Versions kept on disk (0 = all); resume from the newest complete one unless resume=false.
    checkpoint_keep: int = 3
    resume: bool = True
    lr: float = 1e-3
    kl_coef: float = Field(0.0, ge=0)  # > 0: add kl_coef x KL(policy || base model) per token
    kl_estimator: KLEstimator = "k3"
    adam_beta2: float = 0.99
    weight_decay: float = 0.0
    loss_mode: LossMode = "token-mean"
    # A step that trains fewer groups than its run's tasks_per_step (dynamic sampling near saturation):
    # batch = normalised by its own batch, as large an update as a full step; intended = weighs
    # groups / tasks_per_step of a full step (algorithms/losses.short_step_scale).
    loss_denominator: LossDenominator = "batch"
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip_c: float = 3.0  # 0 = no dual clip
    max_grad_norm: float = 1.0
    # Off-policy correction: ppo (ratio vs rollout logprobs), tis (truncated IS), mask (drop tokens).
    off_policy: OffPolicyMode = "ppo"
    # The policy objective (algorithms/losses.py): ppo (clipped token ratio, dual clip), gspo (clipped
    # sequence ratio: its paper uses clip_low 3e-4, clip_high 4e-4), cispo (clipped, held IS weight).
    policy_loss: PolicyLoss = "ppo"
    # The step guard: an update whose KL to the sampling policy (k3 over the trained tokens, one more
    # forward without gradient) exceeds max_step_kl is undone (weights and optimizer state) and made
    # again once at step_guard_lr_scale x the learning rate; counted (step_guard_retries). 0 = off.
    max_step_kl: float = Field(0.0, ge=0)
    step_guard_lr_scale: float = Field(0.5, gt=0, lt=1)
    tis_cap: float = 2.0
    mask_low: float = 0.5
    mask_high: float = 2.0
    # Tokens per forward: the longest packed row (the memory plan may make rows shorter), or rows x
    # padded width without packing.
    micro_batch_tokens: int = 16384
    # Bytes one device may hold for the step, in GiB (trainer/memory_plan.py): weights, gradients and
    # optimizer state, the LM head's chunk and each micro-batch's activations (measured at start). 0 =
    # 90% of the GPU's memory; on CPU half of the memory available at start.
    memory_budget_gb: float = Field(0.0, ge=0)
    pack_samples: bool = True
    # The LM head over the trained positions, a chunk of at most this many MiB of fp32 logits at a
    # time (trainer/lm_head.py): the (positions x vocab) logits never materialise. 0: the plain path.
    lm_head_chunk_mb: float = Field(256.0, ge=0)
    # Attention of packed rows (trainer/attention.py): auto = the best path that passes the start-up
    # check (CUDA: varlen, flex, segments, dense; CPU: segments, dense); model = transformers' own.
    attention: Literal["auto", "varlen", "flex", "segments", "dense", "model"] = "auto"
    # Peak FLOP/s of one device, in TFLOP/s, for the steps' MFU (trainer/throughput.py); 0 = measured at
    # start on a square matmul in the step's precision.
    peak_tflops: float = Field(0.0, ge=0)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    fsdp: bool = False  # FSDP2 fully_shard instead of DDP
    # With FSDP: what lives in CPU memory instead of the device. optimizer = Adam's moments and its step
    # (trainer/offload.py); params = FSDP2's CPUOffloadPolicy: parameters, gradients and optimizer state.
    fsdp_offload: Offload = "none"
    # Ranks that share each packed row (trainer/sequence_parallel.py, Ulysses): divides the world size
    # (torchrun); the world is then world / sequence_parallel data-parallel replicas.
    sequence_parallel: int = Field(1, ge=1)
    bf16: bool = False  # bf16 autocast (CUDA only)
    # Recompute the blocks' activations in backward: auto = only the micro-batches that would not fit
    # the budget otherwise; on = all; off = none (true/false read as on/off).
    gradient_checkpointing: AutoOnOff = "auto"
    # Hold what forward keeps for backward in CPU memory (pinned on a GPU): rows as long as one block's
    # recomputation fits, for samples one device cannot hold otherwise.
    activation_offload: bool = False
    lora_rank: int = 0  # > 0: train LoRA adapters (needs peft); checkpoints hold merged weights
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_target_modules: str = "all-linear"  # or comma-separated module names
    # Runs (OpenRun; trainer/runs.py) publish each version of their adapter to <adapters_dir>/<adapter>/
    # <version>, where inference loads it; "" = <checkpoint_dir>/adapters.
    adapters_dir: str = ""
    dist_heartbeat_s: float = 60.0
    dist_timeout_s: float = 1800.0
    seed: int = 0
    torch_threads: int = 1
    # Weight push: "checkpoint" (path 1: inference reloads the checkpoint) or "nccl" (path 2: PushWeights
    # streams the weights into vLLM's workers; needs vllm_url and vLLM started with
    # --weight-transfer-config '{"backend": "nccl"}'). "gloo" is the CPU transport the tests use.
    weight_push: WeightPush = "checkpoint"
    vllm_url: str = ""
    weight_push_backend: Literal["nccl", "gloo"] = "nccl"
    weight_push_master_address: str = "127.0.0.1"  # this trainer, as the vLLM workers reach it
    weight_push_bucket_mb: float = 256.0
    weight_push_attempts: int = 2
    weight_push_timeout_s: float = 600.0
    weight_push_dtype: Literal["", "bfloat16", "float16"] = ""  # cast floating-point weights on the wire
    # Several policies' steps waiting (runs, docs/runs.md "Sharing the trainer"; common/sharing.py):
    # round_robin = the policy that trained least recently goes next; weighted = steps shared in
    # proportion to each policy's run_weight (a run's from its own settings; this one the single
    # policy's). run_sharing_hold_s: how long the turn waits for the policy whose step just ended when
    # the sharing policy says it goes next (its scheduler calls again after its push); 0 = never.
    run_sharing: SharingPolicy = "round_robin"
    run_weight: float = Field(1.0, gt=0)
    run_sharing_hold_s: float = Field(5.0, ge=0)
    # SIGTERM: how long a step (or weight push) in hand may still run to its end -- trained,
    # checkpointed, answered -- before the process exits; the supervisor's grace must cover it.
    drain_s: float = Field(45.0, ge=0)
    # Tests only: seconds every step waits (in its worker thread) before it trains: a slow step.
    test_step_delay_s: float = Field(0.0, ge=0)

    @model_validator(mode="after")
    def _consistent(self) -> TrainerSettings:
        if not 0 < self.mask_low <= 1.0 <= self.mask_high:
            raise ValueError("need 0 < mask_low <= 1 <= mask_high")
        if self.tis_cap <= 0:
            raise ValueError("tis_cap must be positive")
        if self.dual_clip_c and self.dual_clip_c <= 1.0:
            raise ValueError("dual_clip_c must be > 1 (or 0 = off)")
        if self.lora_rank < 0:
            raise ValueError("lora_rank must be >= 0")
        if self.lora_rank and self.fsdp:
            raise ValueError("LoRA with FSDP is not supported; use DDP (fsdp=false) with LoRA")
        if self.fsdp_offload != "none" and not self.fsdp:
            raise ValueError(
                f"fsdp_offload={self.fsdp_offload} offloads FSDP2's shards: it needs fsdp=true "
                "(TETHER_FSDP); without FSDP use fsdp_offload=none"
            )
        if self.micro_batch_tokens < 2:
            raise ValueError("micro_batch_tokens must be at least 2")
        if self.sequence_parallel > 1:
            world = int(os.environ.get("WORLD_SIZE", "1"))
            if world == 1:
                raise ValueError(
                    f"sequence_parallel={self.sequence_parallel} needs that many ranks: start the trainer "
                    "with torchrun --nproc-per-node N (N a multiple of it)"
                )
            if world % self.sequence_parallel:
                raise ValueError(
                    f"sequence_parallel={self.sequence_parallel} does not divide the {world} ranks"
                )
            if not self.pack_samples or self.attention == "model":
                raise ValueError(
                    "sequence_parallel > 1 splits packed rows: it needs pack_samples and attention != model"
                )
            if self.fsdp:
                raise ValueError("sequence_parallel > 1 with FSDP is not tested here; use DDP (fsdp=false)")
        if self.weight_push == "nccl" and not self.vllm_url:
            raise ValueError("weight_push=nccl needs vllm_url (the vLLM server the weights are pushed into)")
        return self


def step_config(s: TrainerSettings, pad_token_id: int) -> StepConfig:
    return StepConfig(
        loss_mode=s.loss_mode,
        loss_denominator=s.loss_denominator,
        clip_low=s.clip_low,
        clip_high=s.clip_high,
        dual_clip_c=s.dual_clip_c or None,
        max_grad_norm=s.max_grad_norm,
        micro_batch_tokens=s.micro_batch_tokens,
        pad_token_id=pad_token_id,
        off_policy=s.off_policy,
        policy_loss=s.policy_loss,
        max_step_kl=s.max_step_kl,
        step_guard_lr_scale=s.step_guard_lr_scale,
        tis_cap=s.tis_cap,
        mask_low=s.mask_low,
        mask_high=s.mask_high,
        pack=s.pack_samples,
        bf16=s.bf16,
        kl_coef=s.kl_coef,
        kl_estimator=s.kl_estimator,
        lm_head_chunk_bytes=int(s.lm_head_chunk_mb * 1024 * 1024),
        sequence_parallel=s.sequence_parallel,
    )


# What a run may set for itself (OpenRun's settings, its run config's `trainer:` section): its policy's
# objective and optimizer. Each StepConfig field here bears its setting's name.
RUN_STEP_SETTINGS = frozenset(
    {
        "loss_mode",
        "loss_denominator",
        "clip_low",
        "clip_high",
        "dual_clip_c",
        "max_grad_norm",
        "off_policy",
        "policy_loss",
        "max_step_kl",
        "step_guard_lr_scale",
        "tis_cap",
        "mask_low",
        "mask_high",
        "kl_coef",
        "kl_estimator",
    }
)
RUN_SETTINGS = RUN_STEP_SETTINGS | {"lr", "adam_beta2", "weight_decay", "run_weight"}


def run_settings(
    s: TrainerSettings, given: dict[str, Any], has_reference: bool
) -> tuple[TrainerSettings, dict[str, Any]]:
    """The trainer's settings `s` with a run's own (`given`, values as the environment or the run
    config gives them) over them, validated as the trainer validates its own, and the run's values as
    parsed. RunRefused naming every setting that is unknown or badly valued, that shapes the shared
    model or the process (anything outside RUN_SETTINGS) with a value other than the trainer's, or a
    KL term the trainer holds no reference model for (`has_reference`)."""
    problems = section_problems(TrainerSettings, "trainer", given)
    if not problems:
        try:
            merged = TrainerSettings.model_validate({**s.model_dump(), **given})
        except ValidationError as exc:
            raise RunRefused(
                "; ".join(
                    f"trainer.{'.'.join(map(str, e['loc'])) or '(section)'}: {e['msg']}" for e in exc.errors()
                )
            ) from None
        problems = [
            f"trainer.{k}: cannot differ per run (it shapes the shared model or the trainer process): "
            f"the trainer has {getattr(s, k)!r}, the run asks {getattr(merged, k)!r}"
            for k in sorted(given)
            if k not in RUN_SETTINGS and getattr(merged, k) != getattr(s, k)
        ]
        if merged.kl_coef > 0 and not has_reference:
            problems.append(
                "trainer.kl_coef: > 0 needs the reference model, which this trainer loads only with "
                "TETHER_KL_COEF > 0 of its own"
            )
    if problems:
        raise RunRefused("; ".join(problems))
    return merged, {k: getattr(merged, k) for k in sorted(given) if k in RUN_SETTINGS}


def run_policy(s: TrainerSettings, d: Dist, runner: StepRunner, given: dict[str, Any]) -> RunPolicy:
    """A run's RunPolicy (trainer/runs.py) from its own settings: the trainer's step configuration with
    the run's objective over it, its Adam with the run's learning rate, its sharing weight."""
    rs, values = run_settings(s, given, has_reference=runner.ref_model is not None)
    own = step_config(rs, runner.cfg.pad_token_id)
    cfg = dataclasses.replace(runner.cfg, **{k: getattr(own, k) for k in RUN_STEP_SETTINGS})
    return RunPolicy(
        values,
        cfg,
        lambda resume: make_optimizer(rs, d, runner.model, resume, restore_rng=False),
        rs.run_weight,
    )


def build(s: TrainerSettings, d: Dist) -> tuple[StepRunner, PreTrainedTokenizerBase, weights.Resume | None]:
    """Model, optimizer and step runner for this rank, resumed from the newest complete checkpoint."""
    if s.bf16 and d.device.type != "cuda":
        raise SystemExit("TETHER_BF16=true needs a CUDA device (bf16 autocast is GPU-only here)")
    root = Path(s.checkpoint_dir)
    resume = resumable(s, d, root)
    # With LoRA the checkpoints hold merged weights: start from the base model and load the adapter.
    source = resume.path if resume is not None and not s.lora_rank else s.model_dir
    model, tokenizer = load_model(source, s.seed)
    if s.lora_rank:
        model = apply_lora(model, s.lora_rank, s.lora_alpha, s.lora_dropout, s.lora_target_modules)
        if resume is not None:
            from peft import set_peft_model_state_dict

            set_peft_model_state_dict(model, resume.state["adapter"])
    model.to(d.device)
    prepared = prepare_model(s, d, model)
    log_static_memory(model, d)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    cfg = step_plan(s, d, model, prepared, int(pad))  # before FSDP2 shards the model
    engine = distributed.wrap(model, d, bf16=s.bf16)
    optimizer = make_optimizer(s, d, model, resume)
    log.info(
        "MFU against %.1f TFLOP/s per device (%s)",
        cfg.peak_flops / 1e12,
        "TETHER_PEAK_TFLOPS" if s.peak_tflops else "measured on a matmul at start",
    )
    ref_model = None
    if s.kl_coef > 0:
        # The reference is the base model (never a resumed checkpoint), frozen.
        ref_model, _ = load_model(s.model_dir, s.seed)
        ref_model.requires_grad_(False).eval().to(d.device)
        if s.sequence_parallel > 1:  # its attention, too, runs over the whole row
            attention.use(ref_model, prepared.attention)
    return StepRunner(model, engine, optimizer, cfg, d, root, ref_model=ref_model), tokenizer, resume


def resumable(s: TrainerSettings, d: Dist, root: Path) -> weights.Resume | None:
    """The newest complete checkpoint under `root` to resume from (None: start from the model), partial
    ones removed (rank 0); one trained with another LoRA rank stops the trainer."""
    if d.rank == 0:
        weights.remove_partial(root)
    resume = weights.latest_resumable(root) if s.resume else None
    if resume is not None:
        trained_lora = int(resume.state.get("settings", {}).get("lora_rank", 0))
        if trained_lora != s.lora_rank:
            raise SystemExit(
                f"{resume.path} was trained with lora_rank={trained_lora}, settings say "
                f"{s.lora_rank}; use a fresh TETHER_CHECKPOINT_DIR or TETHER_RESUME=false"
            )
    elif s.resume and weights.list_checkpoints(root):
        log.warning("%s holds checkpoints but none to resume from; starting from %s", root, s.model_dir)
    return resume


@dataclasses.dataclass(frozen=True)
class Prepared:
    """What the trainer found out about a loaded model before its first step: whether packed rows keep
    its samples apart, the attention path of packed rows ("model": padded rows), whether its LM head
    runs in chunks, and the checkpointing it can do."""

    pack: bool
    attention: str
    chunked: bool
    checkpointing: memory_plan.Mode


def prepare_model(s: TrainerSettings, d: Dist, model: torch.nn.Module) -> Prepared:
    """Check and set up a loaded model for the step (bench/trainer_gpu does the same through here): the
    packing check, the attention path, the chunked LM head's check, sequence parallelism's checks and
    groups, activation checkpointing made available; each logged and in tether_trainer_path."""
    vocab = int(distributed.hf_model(model).config.vocab_size)
    pack = s.pack_samples
    if pack and not packing_keeps_samples_apart(model, vocab):
        log.warning(
            "%s does not keep packed samples apart; training on padded micro-batches instead",
            type(model).__name__,
        )
        pack = False
    path = choose_attention(model, vocab, s.attention, s.bf16) if pack else "model"
    log.info("attention of packed rows: %s", path if pack else "none (padded rows)")
    chunked = s.lm_head_chunk_mb > 0 and chunked_head_matches(model, vocab)
    if s.lm_head_chunk_mb > 0 and not chunked:
        log.warning(
            "%s's LM head is not a plain linear map of the hidden states (a LoRA head, a bias, scaled or "
            "capped logits): its logprobs come from the plain path, (positions x vocab) logits in fp32",
            type(model).__name__,
        )
    log.info(
        "LM head: %s", f"chunked ({s.lm_head_chunk_mb:g} MiB of logits at a time)" if chunked else "plain"
    )
    prepare_sequence_parallel(s, d, model, pack, path)
    PATHS.labels("attention", path).set(1)
    PATHS.labels("lm_head", "chunked" if chunked else "plain").set(1)
    checkpointing = s.gradient_checkpointing
    if checkpointing != "off":
        try:
            enable_activation_checkpointing(model)
        except (ValueError, AttributeError, NotImplementedError) as e:
            if checkpointing == "on":
                raise SystemExit(f"TETHER_GRADIENT_CHECKPOINTING=on: {type(model).__name__}: {e}") from e
            log.warning("%s cannot recompute its blocks (%s): checkpointing off", type(model).__name__, e)
            checkpointing = "off"
    return Prepared(pack, path, chunked, checkpointing)


def prepare_sequence_parallel(
    s: TrainerSettings, d: Dist, model: torch.nn.Module, pack: bool, path: str
) -> None:
    """Sequence parallelism's checks (packed rows through Tether's attention, heads that split) and
    groups (every rank creates every group, now); logged either way."""
    if s.sequence_parallel > 1:
        if not pack or path == "model":
            raise SystemExit(
                f"TETHER_SEQUENCE_PARALLEL={s.sequence_parallel} needs packed rows through Tether's attention, "
                f"and {type(model).__name__} trains on padded rows here (see the log above)"
            )
        try:
            sequence_parallel.check_heads(model, s.sequence_parallel)
        except ValueError as e:
            raise SystemExit(f"TETHER_SEQUENCE_PARALLEL: {e}") from e
        sequence_parallel.group(s.sequence_parallel)
    log.info(
        "sequence parallelism: %s",
        f"Ulysses, each packed row split over {s.sequence_parallel} ranks (all-to-all over the heads), "
        f"{d.world // s.sequence_parallel} data-parallel replica(s)"
        if s.sequence_parallel > 1
        else "off (each rank holds its rows whole)",
    )
    PATHS.labels(
        "sequence_parallel", f"ulysses-{s.sequence_parallel}" if s.sequence_parallel > 1 else "off"
    ).set(1)


def step_plan(
    s: TrainerSettings, d: Dist, model: torch.nn.Module, prepared: Prepared, pad: int
) -> StepConfig:
    """The step's configuration: the settings' (step_config), the model's paths, the MFU's peak, and the
    memory plan (plan_memory) measured on the model as it is (before FSDP2 shards it)."""
    cfg = dataclasses.replace(
        step_config(s, pad),
        pack=prepared.pack,
        lm_head_chunk_bytes=int(s.lm_head_chunk_mb * 2**20) if prepared.chunked else 0,
        peak_flops=s.peak_tflops * 1e12 or throughput.measure_peak_flops(d.device, s.bf16),
    )
    return plan_memory(s, d, model, cfg, prepared.checkpointing)


def make_optimizer(
    s: TrainerSettings,
    d: Dist,
    model: torch.nn.Module,
    resume: weights.Resume | None,
    restore_rng: bool = True,
) -> torch.optim.Optimizer:
    """Adam over the trainable parameters (in CPU memory with FSDP_OFFLOAD=optimizer), its moments and
    (`restore_rng`) the RNG resumed from `resume`; the hyper-parameters are always today's settings. A
    run's optimizer leaves the RNG alone: the process's one RNG is the single policy's to resume."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer: torch.optim.Optimizer
    betas = (0.9, s.adam_beta2)
    if d.offload == "optimizer":
        optimizer = CPUOffloadOptimizer(trainable, lr=s.lr, betas=betas, weight_decay=s.weight_decay)
    else:
        optimizer = torch.optim.Adam(trainable, lr=s.lr, betas=betas, weight_decay=s.weight_decay)
    if resume is None:
        return optimizer
    if resume.state.get("optimizer_dir"):
        distributed.load_optimizer(model, optimizer, resume.path / resume.state["optimizer_dir"])
    else:  # a format-1 checkpoint: the whole state inside trainer_state.pt
        distributed.load_optimizer_state(model, optimizer, resume.state["optimizer"], d)
    for group in optimizer.param_groups:  # the moments resume; the hyper-parameters are today's settings
        group.update(lr=s.lr, betas=betas, weight_decay=s.weight_decay)
    if restore_rng:
        torch.set_rng_state(resume.state["rng"])
    log.info(
        "resumed from %s (version %d, %d steps done)", resume.path, resume.version, resume.state["steps_done"]
    )
    return optimizer


def trainer_settings_record(s: TrainerSettings, d: Dist) -> dict[str, object]:
    """The settings every checkpoint records (a resume checks its lora_rank)."""
    return {
        "lora_rank": s.lora_rank,
        "loss_mode": s.loss_mode,
        "off_policy": s.off_policy,
        "world_size": d.world,
    }


def run_set(s: TrainerSettings, d: Dist, runner: StepRunner, tokenizer: PreTrainedTokenizerBase) -> RunSet:
    """The runs beside the single policy (trainer/runs.py), reopened from the checkpoint directory.
    Runs need LoRA (an adapter each on the one base model) and one rank (DDP registers the trainable
    parameters once; a run's step changes them)."""
    refusal = None
    if not s.lora_rank:
        refusal = "runs need LoRA adapters: this trainer has TETHER_LORA_RANK=0"
    elif d.world > 1:
        refusal = f"runs train on one rank only, and this trainer has {d.world}"
    runs = RunSet(
        runner,
        tokenizer,
        Path(s.adapters_dir or Path(s.checkpoint_dir) / "adapters"),
        lambda given: run_policy(s, d, runner, given),
        seed=s.seed,
        keep=s.checkpoint_keep,
        settings=trainer_settings_record(s, d),
        refusal=refusal,
    )
    runs.reopen()
    return runs


def log_static_memory(model: torch.nn.Module, d: Dist) -> float:
    """Log what one device holds whatever the batch (weights, gradients, Adam's moments: sharded over the
    ranks under FSDP, less what `d.offload` keeps in CPU memory) and what CPU memory holds for it; return
    the device's bytes."""
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    elem = params[0].element_size() if params else 4
    shards = d.world if d.fsdp else 1
    on_device = memory_plan.static_bytes(total, trainable, elem, shards, d.offload)
    cpu = memory_plan.static_bytes(total, trainable, elem, shards) - on_device
    if d.offload == "optimizer":  # beside the moments: the fp32 values Adam updates and a gradient buffer
        cpu += 2 * 4 * trainable / shards
    log.info(
        "weights, gradients and Adam's moments: %.2f GiB on each device, %.2f GiB of CPU memory per rank "
        "(%s, offload %s)",
        on_device / 2**30,
        cpu / 2**30,
        f"FSDP2 over {shards} rank(s)" if d.fsdp else f"{d.world} replica(s)",
        d.offload,
    )
    return on_device


def device_memory(device: torch.device) -> float:
    """Bytes the step may use on `device` when TETHER_MEMORY_BUDGET_GB is 0: 90% of the GPU; on CPU half
    of what the kernel reports available now (the weights are loaded: they are not counted again)."""
    if device.type == "cuda":
        return 0.9 * torch.cuda.get_device_properties(device).total_memory
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return 0.5 * int(line.split()[1]) * 1024
    return 8 * 2**30  # no /proc/meminfo (not Linux): a laptop's share


def plan_memory(
    s: TrainerSettings, d: Dist, model: torch.nn.Module, cfg: StepConfig, checkpointing: memory_plan.Mode
) -> StepConfig:
    """The step's memory plan (memory_plan.py): the budget left for activations once the weights,
    gradients, optimizer state and the LM head's chunk are counted, and the activations' cost measured
    on the model. Logged; a budget the static state alone exceeds stops the trainer with what to change."""
    cfg = dataclasses.replace(cfg, checkpointing=checkpointing, offload=s.activation_offload)
    if not cfg.pack:
        log.info("memory plan: none (padded rows): rows of %d tokens", s.micro_batch_tokens)
        return cfg
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    elem = params[0].element_size() if params else 4
    shards = d.world if s.fsdp else 1
    if s.memory_budget_gb:
        budget = s.memory_budget_gb * 2**30
        static = memory_plan.static_bytes(total, trainable, elem, shards, d.offload)
    else:
        budget = device_memory(d.device)
        # On CPU the loaded weights are already outside what is available; on a GPU they are inside.
        static = memory_plan.static_bytes(
            total if d.device.type == "cuda" else 0, trainable, elem, shards, d.offload
        )
    if s.fsdp:  # the block FSDP2 has gathered whole, and the next one
        static += memory_plan.gathered_bytes(largest_block(model), 2 if s.bf16 else elem)
    vocab = int(getattr(model.config, "vocab_size", 0) or 0)
    head = 3 * min(
        cfg.lm_head_chunk_bytes or 4 * vocab * s.micro_batch_tokens, 4 * vocab * s.micro_batch_tokens
    )
    activations = budget - static - head
    if activations <= 0:
        raise SystemExit(
            f"the memory budget ({budget / 2**30:.1f} GiB) does not hold the weights, gradients and optimizer "
            f"state ({static / 2**30:.1f} GiB) and the LM head's chunk ({head / 2**30:.1f} GiB): raise "
            "TETHER_MEMORY_BUDGET_GB, train LoRA adapters (TETHER_LORA_RANK) or shard with TETHER_FSDP"
        )
    # Measured on this rank's whole model, before FSDP shards it; with sequence parallelism a row's
    # activations are shared by its ranks.
    cost = measure_activations(model, vocab, cfg).shared(s.sequence_parallel)
    cfg = dataclasses.replace(cfg, memory_budget=activations, activation_cost=cost)
    longest = memory_plan.row_tokens(cost, activations, checkpointed=False, offloaded=s.activation_offload)
    longest_ckpt = memory_plan.row_tokens(
        cost, activations, checkpointed=True, offloaded=s.activation_offload
    )
    log.info(
        "memory plan: %.2f GiB for activations (budget %.2f, static %.2f, LM head %.2f); "
        "%.1f KiB per token kept for backward (%.1f KiB recomputing), %.3g B per attention pair; "
        "one row holds %d tokens, %d recomputing; rows of at most %d tokens; checkpointing %s%s%s",
        activations / 2**30,
        budget / 2**30,
        static / 2**30,
        head / 2**30,
        cost.per_token / 1024,
        cost.per_token_checkpointed / 1024,
        cost.per_pair,
        longest,
        longest_ckpt,
        s.micro_batch_tokens,
        checkpointing,
        ", activations offloaded to CPU" if s.activation_offload else "",
        (f"; FSDP2 over {shards} ranks" if s.fsdp else "")
        + (f"; each row shared by {s.sequence_parallel} ranks" if s.sequence_parallel > 1 else ""),
    )
    return cfg


def largest_block(model: torch.nn.Module) -> int:
    """Parameters of the model's largest transformer block (what FSDP2 shards and gathers as one unit:
    the modules HF names in _no_split_modules); the whole model when it names none."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [sum(p.numel() for p in m.parameters()) for m in model.modules() if type(m).__name__ in names]
    return max(blocks, default=sum(p.numel() for p in model.parameters()))


def weight_pusher(s: TrainerSettings, d: Dist) -> WeightPusher:
    """Path 2: the trainer (rank 0 of the transfer group) and vLLM's weight-transfer routes."""
    from tether.trainer.nccl_push import WeightPusher
    from tether.trainer.weight_transfer import WeightTransferClient

    client = WeightTransferClient(s.vllm_url, timeout_s=s.weight_push_timeout_s)
    return WeightPusher(
        client,
        master_address=s.weight_push_master_address,
        bucket_bytes=int(s.weight_push_bucket_mb * 2**20),
        backend=s.weight_push_backend,
        device=d.device if d.device.type == "cuda" else None,
        timeout_s=s.weight_push_timeout_s,
        attempts=s.weight_push_attempts,
        cast_floats_to=getattr(torch, s.weight_push_dtype) if s.weight_push_dtype else None,
    )


async def amain(
    s: TrainerSettings,
    d: Dist,
    runner: StepRunner,
    tokenizer: PreTrainedTokenizerBase,
    resume: weights.Resume | None,
) -> None:
    push = s.weight_push == "nccl"
    core = TrainerCore(
        runner,
        tokenizer,
        Path(s.checkpoint_dir),
        keep=s.checkpoint_keep,
        resumed=resume.state if resume else None,
        settings=trainer_settings_record(s, d),
        keep_push_state=push,
    )
    health_box: list[Health] = []

    async def not_serving() -> None:
        if health_box:
            await health_box[0].set(False)

    trainer = Trainer(
        core,
        pusher=weight_pusher(s, d) if push else None,
        step_delay_s=s.test_step_delay_s,
        runs=run_set(s, d, runner, tokenizer),
        sharing=s.run_sharing,
        hold_s=s.run_sharing_hold_s,
        weight=s.run_weight,
    )
    servicer = TrainerServicer(trainer, on_broken=not_serving)

    def register(server: grpc.aio.Server) -> list[str]:
        trainer_pb2_grpc.add_TrainerServicer_to_server(servicer, server)
        return [trainer_pb2.DESCRIPTOR.services_by_name["Trainer"].full_name]

    server, health, port = await start_server(
        s.trainer_grpc_port, register, s.trainer_grpc_host, s.metrics_port
    )
    health_box.append(health)
    await health.set(True)
    log.info(
        "trainer on %s:%d (model %s, version %d, %d buffered groups, %d rank(s), lr %g, %s, %s, "
        "policy loss %s, loss denominator %s, weight push %s)",
        s.trainer_grpc_host,
        port,
        s.model_dir,
        core.version,
        len(core.groups),
        d.world,
        s.lr,
        s.loss_mode,
        s.off_policy,
        s.policy_loss,
        s.loss_denominator,
        s.weight_push,
    )
    background = [trainer.keep_ranks_alive(s.dist_heartbeat_s)] if d.active else []

    async def on_stop() -> None:
        await trainer.close_pusher()
        if d.active:
            await trainer.stop_ranks()

    await run_until_signal(server, health, background, on_stop=on_stop, drain_s=s.drain_s)


def main() -> None:
    exit_if_help(TrainerSettings, __doc__)
    with refused_settings_exit("trainer"):
        s = TrainerSettings()
    setup_logging("trainer", s.log_level)
    torch.set_num_threads(s.torch_threads)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # per-checkpoint progress bars would flood the service log
    try:
        d = distributed.init(s.device, s.fsdp, s.dist_timeout_s, s.fsdp_offload)
    except ValueError as exc:
        raise SystemExit(f"trainer settings: {exc}") from exc
    try:
        runner, tokenizer, resume = build(s, d)
        if d.rank == 0:
            asyncio.run(amain(s, d, runner, tokenizer, resume))
        else:
            runner.follow()
    finally:
        distributed.shutdown()


if __name__ == "__main__":
    main()
