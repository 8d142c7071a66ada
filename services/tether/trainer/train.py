"""One policy-gradient step on a batch of samples: the trainer's math, run identically on every rank.

Named steps of `train_step`:

1. `collate` the GLOBAL batch and compute the loss weights over it (`token_weights`), before any
   split, so neither micro-batching nor the split over data-parallel ranks changes the gradient
   (docs/architecture.md, pitfall 4). Every rank holds the whole batch, so every rank knows its statistics.
2. `shard_rows` picks this rank's samples (balanced by tokens); `plan_micro_batches` packs them into
   rows without padding (`pack`: position ids restart at 0 for every sample, which HF models turn into
   block-diagonal causal attention, with whatever attention kernel the model loaded with: sdpa by default), or into length-sorted padded
   rows (`micro_batches`) when packing is off. With sequence parallelism (`StepConfig.sequence_parallel`
   P > 1, sequence_parallel.py) the samples are shared out over the world / P replicas, and each packed
   row is split over the P ranks of a group (`sequence_shard`): each forwards its shard of the row.
3. Forward each micro-batch; logprobs of the trainable target tokens only (`target_logprobs`).
4. Off-policy correction (`off_policy_correction`): "ppo" takes the PPO ratio against the rollout
   engine's logprobs; "tis" and "mask" take it against the trainer's own pre-update logprobs and weight
   each token by min(pi_train / pi_rollout, cap) ("tis") or drop tokens whose ratio leaves
   [mask_low, mask_high] ("mask"). IS weights multiply the token loss; normalisers are not changed.
5. PPO-clip loss, weighted by the global weights times the world size (gradient reduction averages),
   backward; gradients are synchronised on the last micro-batch only.
6. Clip, optimizer step; metrics summed over ranks.

One optimizer update per step, so the pre-update trainer logprobs are the detached logprobs of the very
forward that carries the gradient: no extra pass.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import logging
import math
import time
from dataclasses import dataclass

import torch

from tether.algorithms.losses import (
    cispo_token_loss,
    gspo_token_loss,
    kl_to_reference,
    logprob_mismatch,
    ppo_token_loss,
    short_step_scale,
    token_weights,
    truncated_is_weights,
)
from tether.algorithms.names import (
    OFF_POLICY_MODES,
    POLICY_LOSSES,
    KLEstimator,
    LossDenominator,
    LossMode,
    OffPolicyMode,
    PolicyLoss,
)
from tether.common.records import SampleRecord
from tether.trainer import attention, distributed, lm_head, memory_plan, sequence_parallel, throughput

_MAX_LOG_RATIO = 20.0

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepConfig:
    """One optimisation step's choices, built from TrainerSettings (main.step_config), which refuse a
    bad value at start-up; not checked again here."""

    loss_mode: LossMode = "token-mean"
    # intended: a step of fewer groups than its scheduler meant weighs that much less (short_step_scale).
    loss_denominator: LossDenominator = "batch"
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip_c: float | None = 3.0
    max_grad_norm: float = 1.0
    micro_batch_tokens: int = 4096
    pad_token_id: int = 0
    off_policy: OffPolicyMode = "ppo"
    tis_cap: float = 2.0
    mask_low: float = 0.5
    mask_high: float = 2.0
    policy_loss: PolicyLoss = "ppo"
    # The step guard (`guarded_step`): an update whose KL to the sampling policy exceeds this is undone
    # and made again once with the learning rate times `step_guard_lr_scale`; 0: no guard.
    max_step_kl: float = 0.0
    step_guard_lr_scale: float = 0.5
    pack: bool = True
    bf16: bool = False
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = "k3"
    # The LM head over the targets in chunks of this many bytes of fp32 logits (lm_head.py); 0: the
    # plain path (the (targets x vocab) logits materialised), also what a model whose head does not
    # match (chunked_head_matches) gets.
    lm_head_chunk_bytes: int = lm_head.DEFAULT_CHUNK_BYTES
    # FLOP/s one device reaches (throughput.py), for the step's MFU; 0: unknown, MFU reported as 0.
    peak_flops: float = 0.0
    # Micro-batches planned from memory (memory_plan.py): bytes a row's activations may take on one
    # device (0: rows of `micro_batch_tokens` tokens, as without a plan), what a row costs (measured at
    # start, `measure_activations`), which rows recompute their blocks in backward, and whether saved
    # activations live in CPU memory. With a budget, `micro_batch_tokens` caps a row (0: no cap).
    memory_budget: float = 0.0
    activation_cost: memory_plan.ActivationCost | None = None
    checkpointing: memory_plan.Mode = "off"
    offload: bool = False
    # Ranks that share each packed row (sequence_parallel.py); 1: every rank holds its rows whole.
    # Rows then hold up to `micro_batch_tokens` x this many tokens (each rank's forward: its shard).
    sequence_parallel: int = 1


@dataclass
class Batch:
    """Right-padded (B, T) tensors of the global batch. Row i predicts token t from tokens < t, so the
    per-token values below are aligned to targets: position t of `mask` refers to token_ids[t + 1]."""

    input_ids: torch.Tensor  # (B, T) long
    attention: torch.Tensor  # (B, T) long
    mask: torch.Tensor  # (B, T-1) float, 1 where the target token was sampled by the policy
    rollout_logprobs: torch.Tensor  # (B, T-1)
    advantages: torch.Tensor  # (B, T-1)
    rollout_ids: torch.Tensor  # (B,) long, index of the row's rollout


def collate(samples: list[SampleRecord], pad_token_id: int) -> Batch:
    width = max(len(s.token_ids) for s in samples)
    rollouts: dict[str, int] = {}
    B = len(samples)
    ids = torch.full((B, width), pad_token_id, dtype=torch.long)
    att = torch.zeros((B, width), dtype=torch.long)
    mask = torch.zeros((B, width), dtype=torch.float32)
    lp = torch.zeros((B, width), dtype=torch.float32)
    adv = torch.zeros((B, width), dtype=torch.float32)
    rid = torch.zeros(B, dtype=torch.long)
    for i, s in enumerate(samples):
        n = len(s.token_ids)
        ids[i, :n] = torch.tensor(s.token_ids, dtype=torch.long)
        att[i, :n] = 1
        mask[i, :n] = torch.tensor(s.loss_mask, dtype=torch.float32)
        lp[i, :n] = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
        adv[i, :n] = torch.tensor(s.advantages, dtype=torch.float32)
        rid[i] = rollouts.setdefault(s.rollout_id, len(rollouts))
    # The first token is never predicted; a mask-1 token at position 0 cannot be trained.
    return Batch(ids, att, mask[:, 1:], lp[:, 1:], adv[:, 1:], rid)


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """(B, T) ids -> (B, T-1) log p(token_{t+1} | tokens <= t) in fp32 (all positions; for tests and probes)."""
    logits = (
        model(input_ids=input_ids, attention_mask=attention, position_ids=position_ids, use_cache=False)
        .logits[:, :-1]
        .float()
    )
    return torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)


def packing_keeps_samples_apart(model: torch.nn.Module, vocab_size: int) -> bool:
    """Whether this model honours packed rows (restarting position ids and no attention mask => each
    sample attends only to itself). Transformers 5 models built on its masking utilities do; a model
    that does not would silently let samples see each other, so the trainer checks once at start.
    Compares a packed row with the samples alone and with the samples simply concatenated."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(0, vocab_size, (5,), generator=g), torch.randint(0, vocab_size, (7,), generator=g)
    device = next(model.parameters()).device
    ids = torch.cat([a, b])[None].to(device)
    positions = torch.cat([torch.arange(5), torch.arange(7)])[None].to(device)
    with torch.no_grad():
        alone = torch.cat(
            [model(input_ids=x[None].to(device), use_cache=False).logits[0] for x in (a, b)]
        ).float()
        packed = model(input_ids=ids, position_ids=positions, use_cache=False).logits[0].float()
        joined = model(input_ids=ids, use_cache=False).logits[0].float()
    return float((packed - alone).abs().max()) < 0.1 * float((joined - alone).abs().max())


def choose_attention(
    model: torch.nn.Module, vocab_size: int, wanted: str = "auto", bf16: bool = False
) -> str:
    """Set the attention path of packed rows (attention.py) and return its name: `wanted`, or with
    "auto" the first of `attention.candidates` that gives the model's own logprobs on a packed sample
    of three and trains (a backward runs); "model" when none does (transformers' own, dense mask).
    Every path tried and why it was passed over is logged."""
    device = next(model.parameters()).device
    if wanted == "model":
        return "model"
    g = torch.Generator().manual_seed(2)
    lengths = [9, 14, 6]
    ids = torch.randint(0, vocab_size, (1, sum(lengths)), generator=g).to(device)
    positions = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
    own = attention.implementation(model)

    def logprobs(train: bool) -> torch.Tensor:
        with _autocast(device, bf16):
            logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits[0, :-1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
        if train:
            lp.sum().backward()
            model.zero_grad(set_to_none=True)
        return lp.detach()

    with torch.no_grad():
        reference = logprobs(False)
    tolerance = 5e-2 if bf16 and device.type == "cuda" else 1e-4
    for path in [wanted] if wanted != "auto" else attention.candidates(device):
        try:
            attention.use(model, path)
            err = float((logprobs(True) - reference).abs().max())
        except Exception as exc:  # a kernel this machine lacks: the next one
            log.info(
                "attention path %s unavailable: %s", path, str(exc).splitlines()[0] if str(exc) else repr(exc)
            )
            attention.restore(model, own)
            continue
        if err <= tolerance:
            return path
        log.warning("attention path %s differs from the model's own by %.3g: not used", path, err)
        attention.restore(model, own)
    if wanted != "auto":
        raise ValueError(f"attention path {wanted!r} does not work for this model on {device}")
    return "model"


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each block's activations in backward (HF's `activation_checkpointing_enable`, called
    `gradient_checkpointing_enable` before transformers 5.2x). Non-reentrant: works with DDP and LoRA."""
    core = distributed.hf_model(model)
    kwargs = {"use_reentrant": False}
    if hasattr(core, "activation_checkpointing_enable"):
        core.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        core.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def set_activation_checkpointing(model: torch.nn.Module, on: bool) -> None:
    """Turn the recomputation of every block on or off for the next forward (the memory plan decides per
    micro-batch); `enable_activation_checkpointing` must have run once."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    for module in distributed.unwrap(model).modules():
        if isinstance(module, GradientCheckpointingLayer) and hasattr(module, "_gradient_checkpointing_func"):
            module.gradient_checkpointing = on


def measure_activations(
    model: torch.nn.Module, vocab_size: int, cfg: StepConfig, n: int = 64
) -> memory_plan.ActivationCost:
    """What the model's forward keeps for backward, measured on it (memory_plan.ActivationCost): samples
    of n, 2n and 4n tokens (all trained) through the step's own path (attention, LM head, autocast),
    every tensor autograd saves counted once by its storage, the weights left out. Checkpointed blocks
    keep their input outside autograd's saved tensors: it is added, one hidden state per block and token.
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    core = distributed.unwrap(model)
    device = next(model.parameters()).device
    weights_ = {p.untyped_storage().data_ptr() for p in model.parameters()}
    keep_logits = _accepts(model, "logits_to_keep")
    head = lm_head.chunkable_head(model) if cfg.lm_head_chunk_bytes > 0 else None
    chunk = (
        lm_head.chunk_positions(head.weight.shape[0], cfg.lm_head_chunk_bytes) if head is not None else None
    )
    g = torch.Generator().manual_seed(2)
    # The blocks that recompute, counted once: the checkpointed inputs below and the plan's one block.
    layers = sum(1 for m in core.modules() if isinstance(m, GradientCheckpointingLayer))

    def saved(length: int, checkpointed: bool) -> float:
        set_activation_checkpointing(model, checkpointed)
        ids = torch.randint(0, vocab_size, (1, length), generator=g).to(device)
        targets = torch.arange(length - 1, device=device)
        mb = MicroBatch(
            ids,
            torch.arange(length, device=device)[None],
            None,
            torch.zeros_like(targets),
            targets,
            targets,
            targets,
            length,
            length,
        )
        seen: dict[int, int] = {}

        def keep(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage.data_ptr() not in weights_:
                seen[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t), _autocast(device, cfg.bf16):
            lp, _ = target_logprobs(model, mb, keep_logits, head, chunk)
        del lp
        return float(sum(seen.values()))

    was_training = model.training
    model.train()
    try:
        b1, b2, b4 = saved(n, False), saved(2 * n, False), saved(4 * n, False)
        per_pair = max(((b4 - b2) - 2 * (b2 - b1)) / (6 * n * n), 0.0)
        per_token = max((b2 - b1 - 3 * per_pair * n * n) / n, 0.0)
        checkpointed = per_token
        if cfg.checkpointing != "off":
            embeddings = distributed.hf_model(model).get_input_embeddings()
            hidden = int(embeddings.weight.shape[1])
            residual = embeddings.weight.element_size()
            checkpointed = max(saved(2 * n, True) - saved(n, True), 0.0) / n + layers * hidden * residual
    finally:
        set_activation_checkpointing(model, False)
        model.train(was_training)
    return memory_plan.ActivationCost(per_token, per_pair, checkpointed, max(layers, 1))


# --- planning: which rank and which micro-batch trains which sample -------------------------------------


def shard_rows(lengths: list[int], rank: int, world: int) -> list[int]:
    """Sample indices for `rank`: longest first to the least-loaded rank (ties: lowest rank). Deterministic."""
    if world == 1:
        return list(range(len(lengths)))
    load = [0] * world
    mine: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(world), key=lambda k: (load[k], k))
        load[r] += lengths[i]
        if r == rank:
            mine.append(i)
    return sorted(mine)


def micro_batches(lengths: list[int], budget_tokens: int) -> list[list[int]]:
    """Row indices grouped so that rows x padded width stays under the budget (length-sorted)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups: list[list[int]] = []
    current: list[int] = []
    for i in order:
        width = max([lengths[j] for j in current] + [lengths[i]])
        if current and width * (len(current) + 1) > budget_tokens:
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)
    return groups


def pack(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices grouped into packed rows of at most `capacity` tokens (first-fit decreasing); a sample
    longer than `capacity` gets a row of its own. Deterministic."""
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for r, space in enumerate(free):
            if lengths[i] <= space:
                rows[r].append(i)
                free[r] -= lengths[i]
                break
        else:
            rows.append([i])
            free.append(capacity - lengths[i])
    return rows


@dataclass
class MicroBatch:
    """One forward's input and where its trainable targets live.

    `src_row`, `src_pos` (N,): the logit (row, position) in this micro-batch that predicts each target;
    `rows`, `cols` (N,): the same target in the global batch's (B, T-1) tensors. `cells` counts the
    (b, W) positions the forward computes and `tokens` the sample tokens among them (pad = the rest).
    """

    input_ids: torch.Tensor  # (b, W)
    position_ids: torch.Tensor | None  # (b, W), packed rows: restarts at 0 for every sample
    attention: torch.Tensor | None  # (b, W), padded rows
    src_row: torch.Tensor
    src_pos: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    cells: int
    tokens: int
    checkpoint: bool = False  # recompute the blocks' activations in backward (memory plan)
    offload: bool = False  # hold what forward saves in CPU memory (memory plan)
    # Sequence parallelism (`sequence_shard`): the (N,) target tokens, which may lie in the next shard,
    # and the whole padded row's sample boundaries; None for a row held whole.
    targets: torch.Tensor | None = None
    sp_cuts: list[int] | None = None


def packed_micro_batch(batch: Batch, lengths: list[int], idx: list[int]) -> MicroBatch:
    """Samples `idx` concatenated into one row: no padding; position ids restart per sample."""
    ids, pos, src_pos, rows, cols = [], [], [], [], []
    offset = 0
    for i in idx:
        n = lengths[i]
        ids.append(batch.input_ids[i, :n])
        pos.append(torch.arange(n))
        t = torch.nonzero(batch.mask[i, : n - 1], as_tuple=True)[0]
        src_pos.append(offset + t)
        rows.append(torch.full_like(t, i))
        cols.append(t)
        offset += n
    src = torch.cat(src_pos)
    return MicroBatch(
        torch.cat(ids)[None],
        torch.cat(pos)[None],
        None,
        torch.zeros_like(src),
        src,
        torch.cat(rows),
        torch.cat(cols),
        cells=offset,
        tokens=offset,
    )


def padded_micro_batch(batch: Batch, lengths: list[int], idx: list[int]) -> MicroBatch:
    """Samples `idx` as right-padded rows of the longest one's width."""
    width = max(lengths[i] for i in idx)
    src_row, src_pos, rows, cols = [], [], [], []
    for k, i in enumerate(idx):
        t = torch.nonzero(batch.mask[i, : lengths[i] - 1], as_tuple=True)[0]
        src_row.append(torch.full_like(t, k))
        src_pos.append(t)
        rows.append(torch.full_like(t, i))
        cols.append(t)
    sel = torch.tensor(idx)
    return MicroBatch(
        batch.input_ids[sel, :width],
        None,
        batch.attention[sel, :width],
        torch.cat(src_row),
        torch.cat(src_pos),
        torch.cat(rows),
        torch.cat(cols),
        cells=width * len(idx),
        tokens=sum(lengths[i] for i in idx),
    )


def sequence_shard(mb: MicroBatch, rank: int, size: int, pad_token_id: int) -> MicroBatch:
    """This rank's contiguous shard of the packed row `mb` (sequence_parallel.py): the row padded to a
    multiple of `size` with a segment of its own (position ids from 0, after every sample: no sample
    attends to it; no target), its ids and position ids, and the targets whose logits it computes."""
    assert mb.position_ids is not None and mb.input_ids.shape[0] == 1, "sequence parallelism packs rows"
    ids, pos = mb.input_ids[0], mb.position_ids[0]
    length = int(ids.numel())
    lo, hi, padded = sequence_parallel.shard_bounds(length, size, rank)
    extra = padded - length
    ids_full = torch.cat([ids, torch.full((extra,), pad_token_id, dtype=ids.dtype)])
    pos_full = torch.cat([pos, torch.arange(extra, dtype=pos.dtype)])
    mine = (mb.src_pos >= lo) & (mb.src_pos < hi)
    return MicroBatch(
        ids_full[lo:hi][None],
        pos_full[lo:hi][None],
        None,
        mb.src_row[mine],
        mb.src_pos[mine] - lo,
        mb.rows[mine],
        mb.cols[mine],
        cells=hi - lo,
        tokens=max(min(hi, length) - lo, 0),
        checkpoint=mb.checkpoint,
        offload=mb.offload,
        targets=ids[mb.src_pos[mine] + 1],
        sp_cuts=attention.boundaries(pos_full),
    )


def empty_micro_batch(pad_token_id: int) -> MicroBatch:
    """A forward with no targets, for a rank that has fewer micro-batches than another: collectives
    (gradient reduction, FSDP all-gathers) need the same number of forwards/backwards on every rank."""
    none = torch.zeros(0, dtype=torch.long)
    return MicroBatch(
        torch.full((1, 2), pad_token_id, dtype=torch.long),
        None,
        torch.ones(1, 2, dtype=torch.long),
        none,
        none,
        none,
        none,
        cells=0,
        tokens=0,
    )


def plan_micro_batches(
    batch: Batch, lengths: list[int], rows: list[int], cfg: StepConfig
) -> list[MicroBatch]:
    local = [lengths[i] for i in rows]
    if cfg.pack and cfg.memory_budget > 0 and cfg.activation_cost is not None:
        plan = memory_plan.plan_rows(
            local,
            cfg.activation_cost,
            cfg.memory_budget,
            cfg.micro_batch_tokens,
            cfg.checkpointing,
            cfg.offload,
        )
        out = []
        for row in plan:
            mb = packed_micro_batch(batch, lengths, [rows[j] for j in row.samples])
            mb.checkpoint, mb.offload = row.checkpoint, row.offload
            out.append(mb)
        return out
    if cfg.pack:
        groups = pack(local, cfg.micro_batch_tokens)
        out = [packed_micro_batch(batch, lengths, [rows[j] for j in g]) for g in groups]
    else:
        groups = micro_batches(local, cfg.micro_batch_tokens)
        out = [padded_micro_batch(batch, lengths, [rows[j] for j in g]) for g in groups]
    for mb in out:  # without a plan, every micro-batch the same way
        mb.checkpoint, mb.offload = cfg.checkpointing == "on", cfg.offload
    return out


# --- forward and loss -----------------------------------------------------------------------------------


def _accepts(model: torch.nn.Module, name: str) -> bool:
    return name in inspect.signature(distributed.hf_model(model).forward).parameters


def target_logprobs(
    model: torch.nn.Module,
    mb: MicroBatch,
    keep_logits: bool = True,
    head: torch.nn.Linear | None = None,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(N,) fp32 logprobs of the micro-batch's trainable targets and (N,) the policy's entropy at the
    same positions (what the run's health reports; differentiable). With no target, a 0-valued (1,)
    tensor that still depends on every parameter (so gradient reduction sees them all), and no entropy.

    `keep_logits` asks the model for the logits of the needed positions only (HF `logits_to_keep`):
    the (W, vocab) logits of a long packed row never materialise. `head`: the model's LM head, which
    then computes the targets' logprobs and entropy in chunks of `chunk` positions from the hidden
    states (lm_head.py): not even the (N, vocab) logits of the targets materialise.
    """
    n = int(mb.src_pos.numel())
    positions = (
        torch.unique(mb.src_pos) if n else torch.zeros(1, dtype=torch.long, device=mb.input_ids.device)
    )
    kwargs: dict = {"input_ids": mb.input_ids, "use_cache": False}
    if mb.position_ids is not None:
        kwargs["position_ids"] = mb.position_ids  # and no attention mask: HF then keeps samples apart
    else:
        kwargs["attention_mask"] = mb.attention
    if keep_logits:
        kwargs["logits_to_keep"] = positions
    col = torch.searchsorted(positions, mb.src_pos) if keep_logits else mb.src_pos
    targets = mb.targets if mb.targets is not None else mb.input_ids[mb.src_row, mb.src_pos + 1]
    empty = torch.zeros(0, device=mb.input_ids.device)
    if head is not None and n:
        with lm_head.head_over_targets(head, mb.src_row, col, targets, chunk):
            out = model(**kwargs).logits
        return out[0, :, 0], out[0, :, 1]
    logits = model(**kwargs).logits
    if not keep_logits:
        logits = logits[:, positions]
    if n == 0:
        return logits.float().sum().reshape(1) * 0.0, empty
    col = torch.searchsorted(positions, mb.src_pos)
    return lm_head.plain_logprobs_and_entropy(logits[mb.src_row, col], targets)


def chunked_head_matches(model: torch.nn.Module, vocab_size: int) -> bool:
    """Whether the chunked LM head (lm_head.py) gives this model's own logprobs: a model that rescales
    or caps its logits after the head (Gemma's soft cap, Granite's scaling) does not. Checked once at
    start on a short random sample, as `packing_keeps_samples_apart` is."""
    head = lm_head.chunkable_head(model)
    if head is None:
        return False
    g = torch.Generator().manual_seed(1)
    device = next(model.parameters()).device
    ids = torch.randint(0, vocab_size, (1, 9), generator=g).to(device)
    n = ids.shape[1] - 1
    mb = MicroBatch(
        ids,
        None,
        torch.ones_like(ids),
        torch.zeros(n, dtype=torch.long, device=device),
        torch.arange(n, device=device),
        torch.zeros(n, dtype=torch.long),
        torch.arange(n),
        cells=n + 1,
        tokens=n + 1,
    )
    keep = _accepts(model, "logits_to_keep")
    with torch.no_grad():
        plain, _ = target_logprobs(model, mb, keep)
        chunked, _ = target_logprobs(model, mb, keep, head, chunk=3)
    return bool(torch.allclose(plain, chunked, rtol=1e-4, atol=1e-4))


def off_policy_correction(
    train_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mode: OffPolicyMode,
    cap: float = 2.0,
    low: float = 0.5,
    high: float = 2.0,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Behaviour logprobs for the PPO ratio and per-token importance weights, for (N,) trainable tokens.

    Args:
        train_logprobs: (N,) the trainer's logprobs of the tokens before the update (grad is ignored).
        rollout_logprobs: (N,) the rollout engine's logprobs of the same tokens.
        mode: "ppo" (old = rollout logprobs, weights 1), "tis" (old = train logprobs, weights
            min(exp(train - rollout), cap): token-level truncated IS, Yao et al. 2025) or "mask"
            (old = train logprobs, weight 0 where exp(train - rollout) is outside [low, high], else 1).

    Returns:
        ``(old_logprobs, is_weights, counts)``: (N,) fp32 tensors without grad, and
        ``counts = {"truncated": tokens whose ratio exceeds cap, "masked": tokens outside the band,
        "is_weight_sum": sum of the weights}``. The counts are the same in every mode (diagnostics);
        they act only in their own mode.
    """
    if mode not in OFF_POLICY_MODES:
        raise ValueError(f"unknown off-policy mode {mode!r}")
    with torch.no_grad():
        train = train_logprobs.detach().float()
        rollout = rollout_logprobs.detach().float().to(train.device)
        log_ratio = (train - rollout).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        truncated = log_ratio > math.log(cap)
        outside = (log_ratio < math.log(low)) | (log_ratio > math.log(high))
        if mode == "ppo":
            old, w = rollout, torch.ones_like(train)
        elif mode == "tis":
            old, w = train, truncated_is_weights(train, rollout, torch.ones_like(train), cap=cap)
        else:
            old, w = train, (~outside).float()
        counts = {
            "truncated": float(truncated.sum()),
            "masked": float(outside.sum()),
            "is_weight_sum": float(w.sum()),
        }
    return old, w, counts


# --- the step -------------------------------------------------------------------------------------------


def token_staleness_stats(samples: list[SampleRecord], version: int) -> dict[str, float]:
    """Staleness per trainable token (`version` minus the version that sampled it, from the samples'
    weight spans; a sample without spans counts all its trainable tokens at its `weight_version`), and
    the share of samples sampled by more than one version (weights that changed mid-rollout)."""
    total = weighted = 0
    worst = 0
    mixed = 0
    for s in samples:
        spans = s.weight_spans or [[s.weight_version, 0, len(s.loss_mask)]]
        mixed += len({v for v, _, _ in spans}) > 1
        for v, a, b in spans:
            n = sum(s.loss_mask[a:b])
            if n:
                total += n
                weighted += n * (version - v)
                worst = max(worst, version - v)
    return {
        "token_staleness_mean": weighted / total if total else 0.0,
        "token_staleness_max": float(worst),
        "mixed_version_fraction": mixed / len(samples) if samples else 0.0,
    }


# Per-step sums reduced over ranks, in this order (the last one is reduced with max).
# Summed over micro-batches and ranks; _PEAKS: their most (a minimum as the most of its negation).
_SUMS = (
    "loss",
    "tokens",
    "cells",
    "trainable",
    "clip",
    "clip_low",
    "clip_high",
    "dual_clip",
    "policy_kl",
    "ratio",
    "abs_diff",
    "k3",
    "truncated",
    "masked",
    "is_weight_sum",
    "micro_batches",
    "recomputed",
    "entropy",
    "ref_kl",
)
_PEAKS = ("abs_diff_max", "ratio_max", "ratio_min_neg")


def _autocast(device: torch.device, bf16: bool) -> contextlib.AbstractContextManager[object]:
    if bf16 and device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


@dataclass
class _Step:
    """What every micro-batch of one step shares: the global batch and its token weights, the step's
    choices, where it runs, the LM heads (the policy's and the reference's, answered in chunks of
    `chunk` positions; None: the plain path) and the sequence-parallel group of this rank's rows."""

    batch: Batch
    weights: torch.Tensor
    cfg: StepConfig
    world: int
    device: torch.device
    keep_logits: bool
    head: torch.nn.Linear | None
    chunk: int | None
    ref_model: torch.nn.Module | None
    ref_head: torch.nn.Linear | None
    sp_group: object | None


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    samples: list[SampleRecord],
    cfg: StepConfig,
    *,
    version: int = 0,
    rank: int = 0,
    world: int = 1,
    ref_model: torch.nn.Module | None = None,
    device: torch.device | None = None,
    intended_groups: int = 0,
) -> dict[str, float]:
    """Update `model` in place on the GLOBAL batch `samples`; return the step's metrics (same on all ranks).

    `intended_groups`: the groups the step was meant to train (0: not said); with
    `cfg.loss_denominator` = intended, a step of fewer groups has its token weights scaled by
    groups / intended (`loss_scale` in the metrics).

    `model` is the module to run (the HF model, or its DDP/FSDP2 form on `world` > 1 ranks, each of
    which calls this with the same `samples`); `version` is the weight version being trained, for the
    staleness metrics. With `cfg.sequence_parallel` P > 1, ranks r..r+P-1 (r a multiple of P) share each
    row of data-parallel replica r // P. `device`: where forward runs (default: where the parameters
    are; FSDP2 with parameters offloaded keeps them in CPU memory and computes on the GPU).
    """
    start = time.perf_counter()
    device = device or next(model.parameters()).device
    memory = throughput.PeakMemory(device)
    memory.reset()
    batch = collate(samples, cfg.pad_token_id)
    loss_scale = short_step_scale(len({s.group_id for s in samples}), intended_groups, cfg.loss_denominator)
    weights = loss_scale * token_weights(
        batch.mask, cfg.loss_mode, rollout_ids=batch.rollout_ids, norm_constant=float(batch.mask.shape[1])
    )
    lengths = [len(s.token_ids) for s in samples]
    plans = step_micro_batches(batch, lengths, cfg, rank, world)
    head = lm_head.chunkable_head(model) if cfg.lm_head_chunk_bytes > 0 else None
    size = cfg.sequence_parallel
    step = _Step(
        batch=batch,
        weights=weights,
        cfg=cfg,
        world=world,
        device=device,
        keep_logits=_accepts(model, "logits_to_keep"),
        head=head,
        chunk=lm_head.chunk_positions(head.weight.shape[0], cfg.lm_head_chunk_bytes)
        if head is not None
        else None,
        ref_model=ref_model,
        ref_head=lm_head.chunkable_head(ref_model) if ref_model is not None and head is not None else None,
        sp_group=sequence_parallel.group(size) if size > 1 else None,
    )

    model.train()
    optimizer.zero_grad(set_to_none=True)
    sums = dict.fromkeys(_SUMS, 0.0)
    peaks = dict.fromkeys(_PEAKS, -math.inf)
    for k, mb in enumerate(plans):
        _to_device(mb, device)
        # A shard's attention runs over the whole row, with the group's other ranks: in forward, in the
        # reference's forward and in backward (recomputed blocks run their attention again there).
        shared = (
            sequence_parallel.row(step.sp_group, size, mb.sp_cuts)
            if mb.sp_cuts is not None
            else contextlib.nullcontext()
        )
        with distributed.grad_sync(model, enabled=k == len(plans) - 1), shared:
            _micro_batch(model, mb, step, sums, peaks)
    for mb in plans:
        sums["tokens"] += mb.tokens
        sums["cells"] += mb.cells  # a shard's cells: the row's padding to a multiple of `size` counts
        counted = mb.cells and (mb.sp_cuts is None or rank % size == 0)  # a shared row once
        sums["micro_batches"] += 1.0 if counted else 0.0
        sums["recomputed"] += 1.0 if counted and mb.checkpoint else 0.0
    if world > 1:
        sums = dict(zip(_SUMS, distributed.all_reduce([sums[k] for k in _SUMS], "sum"), strict=True))
        *most, peak_bytes = distributed.all_reduce([*(peaks[k] for k in _PEAKS), memory.read_bytes()], "max")
        peaks = dict(zip(_PEAKS, most, strict=True))
    else:
        peak_bytes = memory.read_bytes()
    guard: dict[str, float] = {"step_kl": math.nan, "step_guard_retries": 0.0}
    if cfg.max_step_kl > 0 and sums["trainable"] > 0:
        grad_norm, guard = guarded_step(model, optimizer, step, plans)
    else:
        grad_norm = _optimizer_step(model, optimizer, cfg, sums["trainable"] > 0)
    elapsed = time.perf_counter() - start
    # Useful work from the samples' lengths (throughput.py): the LM head runs on the trained targets.
    flops = throughput.step_flops(
        throughput.shape_of(distributed.unwrap(model)), lengths, int(sums["trainable"])
    )
    return {
        **_step_metrics(sums, peaks, samples, batch, version, grad_norm),
        **guard,
        "loss_scale": loss_scale,
        "world_size": float(world),
        "sequence_parallel": float(size),
        "train_seconds": elapsed,
        "train_tokens_per_s": float(sum(lengths)) / max(elapsed, 1e-9),
        "model_flops": flops,
        "model_tflops_per_s": flops / max(elapsed, 1e-9) / 1e12,
        "mfu": throughput.mfu(flops, elapsed, world, cfg.peak_flops),
        "peak_memory_gib": peak_bytes / 2**30,
    }


def step_micro_batches(
    batch: Batch, lengths: list[int], cfg: StepConfig, rank: int, world: int
) -> list[MicroBatch]:
    """This rank's micro-batches of the step: its replica's rows (planned), a shard of each with sequence
    parallelism, and empty ones up to the most any rank has (collectives need the same count)."""
    size = cfg.sequence_parallel  # ranks per row: rank // size is the data-parallel replica
    if size > 1:
        if not cfg.pack:
            raise ValueError("sequence parallelism splits packed rows: it needs packing")
        row_cfg = dataclasses.replace(cfg, micro_batch_tokens=cfg.micro_batch_tokens * size)
        plans = plan_micro_batches(batch, lengths, shard_rows(lengths, rank // size, world // size), row_cfg)
        plans = [sequence_shard(mb, rank % size, size, cfg.pad_token_id) for mb in plans]
    else:
        plans = plan_micro_batches(batch, lengths, shard_rows(lengths, rank, world), cfg)
    n_micro = int(distributed.all_reduce([float(len(plans))], "max")[0]) if world > 1 else len(plans)
    return plans + [empty_micro_batch(cfg.pad_token_id) for _ in range(n_micro - len(plans))]


def _to_device(mb: MicroBatch, device: torch.device) -> None:
    mb.input_ids = mb.input_ids.to(device)
    mb.position_ids = None if mb.position_ids is None else mb.position_ids.to(device)
    mb.attention = None if mb.attention is None else mb.attention.to(device)
    mb.src_row, mb.src_pos = mb.src_row.to(device), mb.src_pos.to(device)
    mb.targets = None if mb.targets is None else mb.targets.to(device)


def _micro_batch(
    model: torch.nn.Module, mb: MicroBatch, step: _Step, sums: dict[str, float], peaks: dict[str, float]
) -> None:
    """Forward and backward of one micro-batch (its gradient accumulated), its figures added to `sums`
    and `peaks`."""
    cfg, device, batch = step.cfg, step.device, step.batch
    if cfg.checkpointing != "off":
        set_activation_checkpointing(model, mb.checkpoint)
    offload = (
        torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda")
        if mb.offload
        else contextlib.nullcontext()
    )
    with _autocast(device, cfg.bf16), offload:
        lp, entropy = target_logprobs(model, mb, step.keep_logits, step.head, step.chunk)
    n = int(mb.rows.numel())
    ref_lp = None
    if step.ref_model is not None and cfg.kl_coef > 0 and (n or mb.sp_cuts is not None):
        # A shard without targets still takes part in the reference's exchanges.
        with torch.no_grad(), _autocast(device, cfg.bf16):
            ref_lp, _ = target_logprobs(step.ref_model, mb, step.keep_logits, step.ref_head, step.chunk)
    rollout_lp = batch.rollout_logprobs[mb.rows, mb.cols].to(device)
    old, is_w, counts = off_policy_correction(
        lp, rollout_lp, cfg.off_policy, cfg.tis_cap, cfg.mask_low, cfg.mask_high
    )
    # GSPO's ratio is a whole sample's: its targets may lie in other shards of the row (a collective,
    # so every shard of the row takes part, one without targets too).
    seq_log_ratio = (
        sample_mean(lp.detach() - old, mb.rows, batch.mask.shape[0], step.sp_group if mb.sp_cuts else None)
        if cfg.policy_loss == "gspo"
        else None
    )
    if n == 0:
        (lp.sum() * float(step.world)).backward()
        return
    adv = batch.advantages[mb.rows, mb.cols].to(device)
    w = step.weights[mb.rows, mb.cols].to(device)
    loss_tok, m = policy_token_loss(cfg, lp, old, adv, seq_log_ratio)
    loss = (w * is_w * loss_tok).sum()
    if ref_lp is not None:
        kl_tok = kl_to_reference(lp, ref_lp, cfg.kl_estimator)
        loss = loss + cfg.kl_coef * (w * kl_tok).sum()
        sums["ref_kl"] += float(kl_tok.detach().sum())
    # DDP/FSDP average gradients over ranks; the weights are global, so scale the average to a sum.
    # With sequence parallelism each rank's gradient is its shard's partial sum: the same sum.
    (loss * float(step.world)).backward()
    ones = torch.ones_like(w)
    mismatch = logprob_mismatch(lp[None], rollout_lp[None], ones[None])
    sums["loss"] += float(loss.detach())
    sums["trainable"] += n
    sums["entropy"] += float(entropy.detach().sum())
    sums["clip"] += m["clip_fraction"] * n
    sums["clip_low"] += m["clip_low_fraction"] * n
    sums["clip_high"] += m["clip_high_fraction"] * n
    sums["dual_clip"] += m["dual_clip_fraction"] * n
    sums["policy_kl"] += m["approx_kl"] * n
    sums["ratio"] += m["ratio_mean"] * n
    sums["abs_diff"] += mismatch["mean_abs_logprob_diff"] * n
    sums["k3"] += mismatch["kl_k3"] * n
    for key in ("truncated", "masked", "is_weight_sum"):
        sums[key] += counts[key]
    peaks["abs_diff_max"] = max(peaks["abs_diff_max"], mismatch["max_abs_logprob_diff"])
    peaks["ratio_max"] = max(peaks["ratio_max"], m["ratio_max"])
    peaks["ratio_min_neg"] = max(peaks["ratio_min_neg"], -m["ratio_min"])


def policy_token_loss(
    cfg: StepConfig,
    lp: torch.Tensor,
    old: torch.Tensor,
    adv: torch.Tensor,
    seq_log_ratio: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The (N,) per-token loss of `cfg.policy_loss` over a micro-batch's targets (losses.py), and its
    metrics; `seq_log_ratio` (GSPO): each target's sample mean of lp - old."""
    ones = torch.ones_like(lp)
    if cfg.policy_loss == "gspo":
        loss, m = gspo_token_loss(
            lp[None],
            old[None],
            adv[None],
            ones[None],
            cfg.clip_low,
            cfg.clip_high,
            seq_log_ratio=None if seq_log_ratio is None else seq_log_ratio[None],
        )
    elif cfg.policy_loss == "cispo":
        loss, m = cispo_token_loss(lp[None], old[None], adv[None], ones[None], cfg.clip_low, cfg.clip_high)
    elif cfg.policy_loss == "ppo":
        loss, m = ppo_token_loss(
            lp[None],
            old[None],
            adv[None],
            ones[None],
            clip_low=cfg.clip_low,
            clip_high=cfg.clip_high,
            dual_clip_c=cfg.dual_clip_c,
        )
    else:
        raise ValueError(f"unknown policy loss {cfg.policy_loss!r}; expected one of {POLICY_LOSSES}")
    return loss[0], m


def sample_mean(
    values: torch.Tensor, rows: torch.Tensor, n_rows: int, group: object | None = None
) -> torch.Tensor:
    """Each target's mean of `values` (N,) over the targets of its sample (`rows`: each target's sample
    index, < n_rows), in fp64; with `group`, over the targets every rank of it holds (an all-reduce)."""
    sums = torch.zeros(2, n_rows, dtype=torch.float64, device=values.device)
    sums[0].index_add_(0, rows, values.detach().to(torch.float64))
    sums[1].index_add_(0, rows, torch.ones_like(rows, dtype=torch.float64))
    if group is not None:
        torch.distributed.all_reduce(sums, group=group)
    return (sums[0] / sums[1].clamp(min=1))[rows].to(values.dtype)


def guarded_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: _Step, plans: list[MicroBatch]
) -> tuple[float, dict[str, float]]:
    """The optimizer step under the step guard: after the update, the trained tokens go through the
    updated model again (no gradient) for the k3 estimate of KL(sampling policy || updated policy) from
    the tokens the engine sampled; above `max_step_kl` the weights and the optimizer's state are put
    back and the same (clipped) gradient is applied once more at `step_guard_lr_scale` times the
    learning rate. Every rank decides on the same all-reduced figure. Returns the gradient norm and
    `step_kl` (of the update kept), `step_guard_retries` (0 or 1)."""
    cfg = step.cfg
    trainable = [p for p in model.parameters() if p.requires_grad]
    saved = [p.detach().clone() for p in trainable]
    saved_state = copy.deepcopy(optimizer.state_dict())
    grad_norm = _clip(trainable, cfg)
    optimizer.step()
    kl = update_kl(model, step, plans)
    retries = 0.0
    if kl > cfg.max_step_kl:
        log.warning(
            "step guard: the update moved the policy %.4g from the sampling policy (KL, bound %.4g): "
            "undone, made again at %.3g x the learning rate",
            kl,
            cfg.max_step_kl,
            cfg.step_guard_lr_scale,
        )
        with torch.no_grad():
            for p, value in zip(trainable, saved, strict=True):
                p.copy_(value)
        optimizer.load_state_dict(saved_state)
        lrs = [group["lr"] for group in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["lr"] = group["lr"] * cfg.step_guard_lr_scale
        optimizer.step()
        for group, lr in zip(optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        kl, retries = update_kl(model, step, plans), 1.0
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, {"step_kl": kl, "step_guard_retries": retries}


def update_kl(model: torch.nn.Module, step: _Step, plans: list[MicroBatch]) -> float:
    """k3 estimate of KL(sampling policy || the model now) over the step's trained tokens (all ranks'),
    from a forward of each micro-batch without gradient: mean(r - 1 - log r), r = pi_now / pi_sampling."""
    cfg, batch = step.cfg, step.batch
    total = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for mb in plans:
            shared = (
                sequence_parallel.row(step.sp_group, cfg.sequence_parallel, mb.sp_cuts)
                if mb.sp_cuts is not None
                else contextlib.nullcontext()
            )
            with shared, _autocast(step.device, cfg.bf16):
                lp, _ = target_logprobs(model, mb, step.keep_logits, step.head, step.chunk)
            if mb.rows.numel() == 0:
                continue
            rollout = batch.rollout_logprobs[mb.rows, mb.cols].to(lp.device)
            log_r = (lp.double() - rollout.double()).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
            total[0] += float((torch.expm1(log_r) - log_r).sum())
            total[1] += mb.rows.numel()
    if step.world > 1:
        total = torch.tensor(distributed.all_reduce(total.tolist(), "sum"), dtype=torch.float64)
    return float(total[0] / total[1]) if total[1] > 0 else 0.0


def _clip(trainable: list[torch.nn.Parameter], cfg: StepConfig) -> float:
    """Clip the gradients to `max_grad_norm`; their norm before (NaN if not finite)."""
    grad_norm = torch.nn.utils.clip_grad_norm_(trainable, cfg.max_grad_norm)
    if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor
        grad_norm = grad_norm.full_tensor()
    return float(grad_norm) if math.isfinite(float(grad_norm)) else float("nan")


def _finite_or(value: float, default: float) -> float:
    """A peak no micro-batch set (no trainable token anywhere) is `default`, not infinite."""
    return value if math.isfinite(value) else default


def _optimizer_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, cfg: StepConfig, learns: bool
) -> float:
    """Clip and step when the batch had anything to learn from (else no step, so Adam's momentum does
    not move the weights); the gradients' norm before clipping (NaN if not finite), 0 without a step."""
    grad_norm = 0.0
    if learns:
        grad_norm = _clip([p for p in model.parameters() if p.requires_grad], cfg)
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def _step_metrics(
    sums: dict[str, float],
    peaks: dict[str, float],
    samples: list[SampleRecord],
    batch: Batch,
    version: int,
    grad_norm: float,
) -> dict[str, float]:
    """The step's learning and staleness figures from its summed micro-batch figures (all ranks')."""
    n_tok = max(sums["trainable"], 1.0)
    staleness = [version - s.weight_version for s in samples]
    return {
        "loss": sums["loss"],
        "grad_norm": grad_norm,
        "trainable_tokens": sums["trainable"],
        "tokens": float(sum(len(s.token_ids) for s in samples)),
        "samples": float(len(samples)),
        "rollouts": float(int(batch.rollout_ids.max()) + 1),
        "clip_fraction": sums["clip"] / n_tok,
        "clip_low_fraction": sums["clip_low"] / n_tok,
        "clip_high_fraction": sums["clip_high"] / n_tok,
        "dual_clip_fraction": sums["dual_clip"] / n_tok,
        # The importance ratio the objective clipped (PPO, CISPO: each token's; GSPO: its sample's).
        "ratio_mean": sums["ratio"] / n_tok,
        "ratio_max": _finite_or(peaks["ratio_max"], 0.0),
        "ratio_min": _finite_or(-peaks["ratio_min_neg"], 0.0),
        "policy_kl": sums["policy_kl"] / n_tok,
        # Mean entropy of the policy over the trained tokens, from the step's own forward.
        "entropy": sums["entropy"] / n_tok,
        "masked_fraction": sums["masked"] / n_tok,
        "truncated_fraction": sums["truncated"] / n_tok,
        "is_weight_mean": sums["is_weight_sum"] / n_tok,
        "staleness_max": float(max(staleness)),
        "staleness_mean": sum(staleness) / len(staleness),
        **token_staleness_stats(samples, version),
        "pad_fraction": 1.0 - sums["tokens"] / sums["cells"] if sums["cells"] else 0.0,
        "micro_batches": sums["micro_batches"],
        "recomputed_micro_batches": sums["recomputed"],
        "logprob_abs_diff": sums["abs_diff"] / n_tok,
        "logprob_abs_diff_max": _finite_or(peaks["abs_diff_max"], 0.0),
        "logprob_k3_kl": sums["k3"] / n_tok,
        "ref_kl": sums["ref_kl"] / n_tok,
        # Sampled tokens the merger kept out of the loss because a grammar constrained them (their vLLM
        # logprobs are the masked distribution's): counted, so that a run sees what it did not train on.
        "constrained_tokens_masked": float(sum(s.constrained_tokens for s in samples)),
    }
