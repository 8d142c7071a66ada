"""Checkpoints: HF directories (safetensors) written atomically to the shared checkpoint folder."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch


def checkpoint_name(version: int) -> str:
    return f"v{version:06d}"


def save_checkpoint(model: torch.nn.Module, tokenizer, root: Path, version: int, keep: int = 3) -> Path:
    """Write `root/v<version>` (model + tokenizer) via a temporary folder and a rename, so that
    inference never sees a half-written checkpoint. Keeps the newest `keep` versions."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / checkpoint_name(version)
    tmp = root / f".tmp-{checkpoint_name(version)}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    versions = sorted(p for p in root.glob("v[0-9]*") if p.is_dir())
    for old in versions[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final
