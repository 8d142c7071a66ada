"""bench/trainer_gpu is what a lent GPU machine runs (its figures are in docs/trainer.md). Its logic runs
here too, on tiny models, so that it still works when a GPU is next lent: every part passes or says
why it is CUDA-only, and a part that runs out of memory or past its guard is reported, not fatal."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench" / "trainer_gpu"
CUDA_ONLY = {"bf16", "packing_bf16"}
SCALE = {"scale_1p5b", "scale_3b", "long_3b_64k", "lora_8b_64k"}


def bench_module_run(code: str) -> dict:
    """Run `code` in a fresh interpreter with the bench loaded as module `b` (so that `import tether` is
    this checkout's, as in the bench itself); `code` sets `out`, printed as JSON."""
    program = (
        textwrap.dedent(
            f"""
        import importlib.machinery, importlib.util, json, sys, time
        loader = importlib.machinery.SourceFileLoader("trainer_gpu_bench", {str(BENCH)!r})
        b = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
        sys.modules[loader.name] = b
        loader.exec_module(b)
        import torch
        torch.set_num_threads(1)
        """
        )
        + textwrap.dedent(code)
        + "\nprint(json.dumps(out))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_trainer_gpu_bench_runs_on_cpu():
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--device", "cpu", "--small"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["ok"] is True and report["complete"] is True
    assert report["tether_package"] == str(ROOT / "services" / "tether")
    parts = report["parts"]
    assert {name for name, r in parts.items() if r["ok"] is None} == CUDA_ONLY
    assert all(r["ok"] is True for name, r in parts.items() if name not in CUDA_ONLY)
    # The checks really ran: the FSDP2 part compared weights and resumed from the optimizer shards.
    fsdp = parts["fsdp2"]
    assert fsdp["checks"]["resumed_vs_continuous_weights"] and fsdp["child_resume"]["optimizer_shard_files"]
    # Every scale part trained every run the service's way, on CPU without verdicts on the targets.
    assert SCALE <= set(parts)
    for name in SCALE:
        part = parts[name]
        assert part["targets"] == "checked on a GPU only"
        assert part["lm_head"] == "chunked" and part["attention"] == "segments"
        assert all(r["ok"] and r["steps_measured"] >= 1 for r in part["runs"].values()), name
    one = parts["scale_1p5b"]
    assert one["checks"]["packed_padded_loss_rel_diff<0.0001"]
    assert one["runs"]["packed"]["micro_batches"] > 1 and one["runs"]["padded"]["pad_fraction"] > 0
    # The long samples train alone and recomputed: the small budget holds a 64-token row, not them.
    for name, run in (
        ("long_3b_64k", "packed"),
        ("lora_8b_64k", "packed"),
        ("scale_1p5b", "one_32k_checkpointed"),
    ):
        r = parts[name]["runs"][run]
        assert r["micro_batches"] == 1 and r["recomputed_micro_batches"] == 1, (name, r)
    assert parts["long_3b_64k"]["runs"]["packed"]["tokens"] == 512
    assert parts["lora_8b_64k"]["trainable_params"] < parts["lora_8b_64k"]["params"] / 2
    assert parts["scale_3b"]["runs"]["packed_checkpointed"]["recomputed_micro_batches"] == 3


def test_scale_part_reports_out_of_memory_and_goes_on():
    """A run that runs out of device memory is that run's result; the part's other runs still train,
    and a part that raises it is that part's result."""
    out = bench_module_run(
        """
        real = b.scale_run

        def scale_run(model, batch, cfg, s, run, deadline, ctx):
            if run.name == "padded":
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            return real(model, batch, cfg, s, run, deadline, ctx)

        b.scale_run = scale_run
        ctx = b.Ctx(torch.device("cpu"), None, None, None, b.StepConfig(), None, 1, small=True)
        part = b.scale_part(ctx, "scale_1p5b")

        def boom(ctx):
            raise torch.OutOfMemoryError("simulated")

        b.PARTS["boom"] = boom
        out = {"part": part, "boom": b.run_part("boom", ctx)}
        """
    )
    runs = out["part"]["runs"]
    assert runs["padded"] == {
        "ok": False,
        "error": "out of memory",
        "peak_memory_gib": None,
        "seconds": runs["padded"]["seconds"],
    }
    assert runs["packed"]["ok"] and runs["one_32k_checkpointed"]["ok"]
    assert out["part"]["ok"] is False and out["part"]["checks"]["every_run_trained"] is False
    assert out["boom"]["ok"] is False and out["boom"]["error"] == "out of memory"


def test_scale_part_stops_at_its_wall_clock_guard():
    out = bench_module_run(
        """
        real = b.scale_run

        def slow(model, batch, cfg, s, run, deadline, ctx):
            if run.name == "padded":
                time.sleep(60)
            return real(model, batch, cfg, s, run, deadline, ctx)

        b.scale_run = slow
        ctx = b.Ctx(torch.device("cpu"), None, None, None, b.StepConfig(), None, 1, small=True)
        t0 = time.perf_counter()
        guard = 25
        b.SCALE["scale_1p5b"] = b.dataclasses.replace(b.SCALE["scale_1p5b"], guard_s=guard)
        part = b.scale_part(ctx, "scale_1p5b")
        out = {"part": part, "seconds": time.perf_counter() - t0, "guard": guard}
        """
    )
    part = out["part"]
    assert out["seconds"] < out["guard"] + 10
    assert "timed_out" in part and part["ok"] is False
    assert part["runs"]["packed"]["ok"] and part["runs"]["padded"]["ok"] is False
    assert "one_32k_checkpointed" not in part["runs"]


def test_rollout_logprobs_are_the_models_own_without_the_full_logits():
    """make_batch's logprobs come from the chunked LM head (train.target_logprobs): equal to the plain
    log_softmax over the whole vocabulary."""
    out = bench_module_run(
        """
        from tether.trainer.train import token_logprobs
        model = b.build_scale_model("qwen2.5-1.5b", True, torch.device("cpu"), 64)
        ids = torch.randint(0, model.config.vocab_size, (50,))
        with torch.no_grad():
            plain = token_logprobs(model, ids[None])[0]
        chunked = b.reference_logprobs(model, ids, torch.device("cpu"), bf16=False)
        out = {"max_abs_diff": float((plain - chunked).abs().max()), "n": chunked.numel()}
        """
    )
    assert out["n"] == 49 and out["max_abs_diff"] < 1e-5
