"""Checkpoints: HF directories (safetensors) plus the trainer's own state, written atomically.

Layout of the checkpoint folder (shared with inference, which loads `v<version>/` by path):

    v000007/                 model (*.safetensors, config.json) + tokenizer: what vLLM loads
    v000007/trainer_state.pt the trainer's position (version, steps done, groups trained, a record of
                             recent steps, RNG, the LoRA adapter): what a restarted trainer resumes from
    v000007/optimizer/       the optimizer state as torch.distributed.checkpoint shards, one file per
                             rank that holds a shard (FSDP2: every rank writes only its own; nothing is
                             gathered), keyed by parameter names and resharded on load
    buffer/                  groups accepted but not trained yet (see tether.trainer.steps.GroupSpool)

A version folder appears by one rename of a fully written (and fsynced) temporary folder, so every
`v<digits>` folder holding `trainer_state.pt` is complete. The ranks write the optimizer shards into
`.tmp-v000007-optimizer/` first, which rank 0 moves into the folder before the rename. vLLM reads only
the safetensors. Format 1 checkpoints (the whole optimizer state inside trainer_state.pt) still load.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

if TYPE_CHECKING:
    from peft import PeftMixedModel, PeftModel
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.pt"
STATE_FORMAT = 2
STATE_FORMATS_READ = (1, 2)
OPTIMIZER_DIR = "optimizer"
_VERSION_DIR = re.compile(r"^v(\d{6,})$")


def checkpoint_name(version: int) -> str:
    return f"v{version:06d}"


def fsync_tree(folder: Path) -> None:
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    fsync_dir(folder)


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def optimizer_staging(root: Path, version: int) -> Path:
    """Where the ranks write version `version`'s optimizer shards before save_checkpoint moves them in."""
    return root / f".tmp-{checkpoint_name(version)}-{OPTIMIZER_DIR}"


def save_checkpoint(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    root: Path,
    version: int,
    keep: int = 3,
    state_dict: dict[str, torch.Tensor] | None = None,
    trainer_state: dict[str, Any] | None = None,
    optimizer_dir: Path | None = None,
) -> Path:
    """Write `root/v<version>` (model + tokenizer [+ trainer_state.pt] [+ optimizer/]) via a temporary
    folder and a rename, so that neither inference nor a restarting trainer ever sees a half-written
    checkpoint.

    `state_dict` replaces the model's own tensors (the full state of a sharded model, merged LoRA
    weights). `optimizer_dir`: the optimizer shards the ranks wrote (optimizer_staging), moved in.
    Keeps the newest `keep` versions (0 = keep all)."""

    def write_model(folder: Path) -> None:
        model.save_pretrained(folder, safe_serialization=True, state_dict=state_dict)
        tokenizer.save_pretrained(folder)

    return write_checkpoint(write_model, root, version, keep, trainer_state, optimizer_dir)


def write_checkpoint(
    write_weights: Callable[[Path], None],
    root: Path,
    version: int,
    keep: int = 3,
    trainer_state: dict[str, Any] | None = None,
    optimizer_dir: Path | None = None,
) -> Path:
    """save_checkpoint with the weights written by `write_weights(folder)`: a model and its tokenizer,
    or a run's LoRA adapter (tether.trainer.runs)."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / checkpoint_name(version)
    tmp = root / f".tmp-{checkpoint_name(version)}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    write_weights(tmp)
    if optimizer_dir is not None:
        os.replace(optimizer_dir, tmp / OPTIMIZER_DIR)
    if trainer_state is not None:
        torch.save({"format": STATE_FORMAT, **trainer_state}, tmp / STATE_FILE)
    fsync_tree(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(root)
    if keep > 0:
        for _, old in list_checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(version, folder) of every `v<digits>` folder under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _VERSION_DIR.match(path.name)
        if match and path.is_dir():
            found.append((int(match.group(1)), path))
    return sorted(found)


def remove_partial(root: Path) -> None:
    """Delete temporary folders a killed trainer left behind."""
    if root.is_dir():
        for path in root.glob(".tmp-v*"):
            shutil.rmtree(path, ignore_errors=True)


@dataclass
class Resume:
    version: int
    path: Path
    state: dict[str, Any]


def load_trainer_state(path: Path) -> dict[str, Any]:
    state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
    if state.get("format") not in STATE_FORMATS_READ:
        raise ValueError(f"{path / STATE_FILE}: unknown trainer state format {state.get('format')!r}")
    return state


def latest_resumable(root: Path, weights_file: str = "config.json") -> Resume | None:
    """The newest complete checkpoint the trainer can resume from (one with a readable trainer state and
    its `weights_file`: a run's checkpoints hold adapter_config.json instead of a model's config.json).
    Folders without one (written by inference tools, or by a trainer that predates resuming) are skipped."""
    for version, path in reversed(list_checkpoints(root)):
        if not (path / STATE_FILE).is_file() or not (path / weights_file).is_file():
            log.warning("checkpoint %s has no trainer state; not resuming from it", path)
            continue
        try:
            state = load_trainer_state(path)
        except Exception as exc:  # a corrupt file must not stop the trainer from using an older one
            log.warning("cannot read %s: %r; trying an older checkpoint", path / STATE_FILE, exc)
            continue
        if int(state["version"]) != version:
            log.warning("%s records version %s; skipped", path, state["version"])
            continue
        if state.get("optimizer_dir") and not (path / state["optimizer_dir"] / ".metadata").is_file():
            log.warning("%s has no complete optimizer state; trying an older checkpoint", path)
            continue
        return Resume(version=version, path=path, state=state)
    return None


def as_peft(model: torch.nn.Module) -> PeftModel:
    """A LoRA model (apply_lora's) typed as the PeftModel it is."""
    return cast("PeftModel", model)


def merged_lora_state_dict(peft_model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The base model's state dict with every LoRA delta merged in, under the base model's own names,
    so inference loads a plain HF checkpoint. Out of place: the trained adapter is left untouched."""
    from peft.tuners.lora import LoraLayer

    base = as_peft(peft_model).get_base_model()
    deltas: dict[str, torch.Tensor] = {}
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            delta = None
            for adapter in module.active_adapters:
                # Declared by each kind of LoRA layer (Linear, Embedding, Conv...), not by their base class.
                d = module.get_delta_weight(adapter)  # type: ignore[attr-defined]
                delta = d if delta is None else delta + d
            if delta is not None:
                deltas[f"{name}.weight"] = delta.detach()
    out: dict[str, torch.Tensor] = {}
    for key, value in base.state_dict().items():
        if "lora_" in key:
            continue
        key = key.replace(".base_layer.", ".")
        out[key] = value.detach() + deltas[key].to(value.dtype) if key in deltas else value.detach()
    return out


def load_model(model_dir: str | Path, seed: int) -> tuple[torch.nn.Module, PreTrainedTokenizerBase]:
    """The HF causal LM (fp32) and its tokenizer from a local folder, with the seed set first. The model
    typed as the torch module it is (its HF attributes through `distributed.hf_model`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return model, tokenizer


def apply_lora(
    model: torch.nn.Module, rank: int, alpha: float, dropout: float, targets: str
) -> PeftModel | PeftMixedModel:
    """LoRA adapters (peft) on `targets`: "all-linear" or comma-separated module names."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:
        raise SystemExit(
            "TETHER_LORA_RANK > 0 needs the `peft` package (`pip install peft`; it keeps the installed torch)"
        ) from exc
    modules: str | list[str] = targets if targets == "all-linear" else [t.strip() for t in targets.split(",")]
    config = LoraConfig(
        r=rank,
        # Declared int; peft scales by lora_alpha / r, and a fractional alpha is a setting users make.
        lora_alpha=alpha,  # type: ignore[arg-type]
        lora_dropout=dropout,
        target_modules=modules,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)
