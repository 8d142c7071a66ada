"""How much one training step grows a process's memory: a Qwen2.5-vocabulary (151,936) model, tiny
otherwise, trains one sample of N tokens (all trainable). Run as a script (a process of its own, so
the peak is this step's): `python tests/lm_head_memory.py N CHUNK_BYTES` prints JSON with the
resident memory before the step and its peak during it (Linux: the peak is reset through
/proc/self/clear_refs first), in MiB. CHUNK_BYTES 0 = the plain path."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from tether.common.records import SampleRecord
from tether.trainer.train import StepConfig, train_step

VOCAB = 151_936


def status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def one_sample(n: int, vocab: int, logprob: float) -> SampleRecord:
    """One sample of n random tokens, all but the first trained, with a positive advantage."""
    return SampleRecord(
        rollout_id="r",
        group_id="g",
        task_id="t",
        sequence_index=0,
        token_ids=torch.randint(0, vocab, (n,)).tolist(),
        loss_mask=[0] + [1] * (n - 1),
        rollout_logprobs=[0.0] + [logprob] * (n - 1),
        advantages=[0.0] + [1.0] * (n - 1),
        reward=1.0,
        weight_version=0,
    )


def main(n: int, chunk_bytes: int) -> dict[str, float]:
    torch.manual_seed(0)
    torch.set_num_threads(2)
    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=n + 8,
    )
    model = Qwen2ForCausalLM(cfg).float()
    sample = one_sample(n, VOCAB, -12.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    step = StepConfig(micro_batch_tokens=n, lm_head_chunk_bytes=chunk_bytes)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = status_mib("VmRSS")
    metrics = train_step(model, opt, [sample], step)
    return {
        "tokens": n,
        "rss_before_mib": before,
        "peak_mib": status_mib("VmHWM"),
        "growth_mib": status_mib("VmHWM") - before,
        "trainable_tokens": metrics["trainable_tokens"],
    }


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]), int(sys.argv[2]))))
