"""A step's model FLOPs, MFU and peak memory (tether/trainer/throughput.py). The FLOP count is checked
against PyTorch's own FLOP counter (torch.utils.flop_counter) on real forwards and backwards of a model
with eager attention, whose matmuls that counter sees; the step's metrics against the same count."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import Qwen2Config, Qwen2ForCausalLM

from tether.common.records import SampleRecord
from tether.trainer import throughput
from tether.trainer.train import StepConfig, train_step


def _model(tied: bool = False) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
        attn_implementation="eager",
    )
    return Qwen2ForCausalLM(cfg).float()


def _counted(model: torch.nn.Module, lengths: list[int]) -> int:
    """FLOPs PyTorch's counter sees in forward + backward of each sample alone (eager attention computes
    every (query, key) pair, so the count to compare is the non-causal one)."""
    with FlopCounterMode(display=False) as counter:
        for n in lengths:
            ids = torch.randint(0, 300, (1, n))
            model(input_ids=ids).logits.float().log_softmax(-1).sum().backward()
    return int(counter.get_total_flops())


@pytest.mark.parametrize("tied", [False, True])
def test_the_count_is_what_pytorchs_flop_counter_sees(tied):
    model = _model(tied)
    lengths = [37, 5, 64]
    shape = throughput.shape_of(model)
    assert shape.layers == 2 and shape.attention_width == 64 and shape.head_params == 300 * 64
    assert throughput.step_flops(shape, lengths, sum(lengths), causal=False) == _counted(model, lengths)


def test_frozen_weights_count_no_weight_gradient():
    model = _model()
    for layer in model.model.layers:
        layer.mlp.requires_grad_(False)
    model.lm_head.requires_grad_(False)
    shape = throughput.shape_of(model)
    assert shape.body_trainable < shape.body_params and not shape.head_trains
    assert throughput.step_flops(shape, [29], 29, causal=False) == _counted(model, [29])


def test_causal_attention_counts_half_the_pairs_and_grows_with_the_square_of_a_sample():
    shape = throughput.Shape(
        layers=3, attention_width=8, body_params=0, body_trainable=0, head_params=0, head_trains=True
    )
    assert throughput.step_flops(shape, [10], 0) == 3 * 4 * 3 * 8 * 100 / 2
    # One 2n-token sample costs more attention than two n-token samples: packing must not hide it.
    assert throughput.step_flops(shape, [20], 0) == 2 * throughput.step_flops(shape, [10, 10], 0)


def test_mfu():
    assert throughput.mfu(6e12, 2.0, 2, 3e12) == pytest.approx(0.5)
    assert throughput.mfu(1.0, 1.0, 1, 0.0) == 0.0  # peak unknown


def test_the_peak_memory_sees_an_allocation_of_the_step():
    memory = throughput.PeakMemory(torch.device("cpu"))
    memory.reset()
    base = memory.read_bytes()
    big = torch.ones(64 * 2**20 // 4)  # 64 MiB, written
    del big
    assert memory.read_bytes() - base >= 60 * 2**20
    memory.reset()
    assert memory.read_bytes() - base < 32 * 2**20  # reset: the freed 64 MiB no longer counts


def test_a_step_reports_its_flops_mfu_and_peak_memory():
    model = _model()
    lengths = [40, 17, 9]
    samples = []
    for i, n in enumerate(lengths):
        samples.append(
            SampleRecord(
                rollout_id=f"r{i}",
                group_id="g",
                task_id="t",
                sequence_index=0,
                token_ids=torch.randint(0, 300, (n,)).tolist(),
                loss_mask=[0] * 3 + [1] * (n - 3),
                rollout_logprobs=[0.0] * 3 + [-5.0] * (n - 3),
                advantages=[0.0] * 3 + [1.0 - i] * (n - 3),
                reward=1.0,
                weight_version=0,
            )
        )
    peak = throughput.measure_peak_flops(torch.device("cpu"), bf16=False, size=128, repeats=2)
    assert peak > 1e6
    cfg = StepConfig(micro_batch_tokens=64, peak_flops=peak)
    metrics = train_step(model, torch.optim.Adam(model.parameters(), lr=1e-3), samples, cfg)
    trained = sum(n - 3 for n in lengths)  # tokens 3.. of each sample are trained
    want = throughput.step_flops(throughput.shape_of(model), lengths, int(metrics["trainable_tokens"]))
    assert metrics["trainable_tokens"] == trained
    assert metrics["model_flops"] == want
    assert metrics["model_tflops_per_s"] == pytest.approx(want / metrics["train_seconds"] / 1e12)
    assert metrics["mfu"] == pytest.approx(want / metrics["train_seconds"] / peak)
    assert 0 < metrics["mfu"] < 1
    assert metrics["peak_memory_gib"] > 0.05  # the process's resident set during the step
