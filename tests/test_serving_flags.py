"""`tether up`'s serving flags reach the vLLM command line, and the user's TETHER_* settings reach every
service while the launcher's wiring still wins. The inference service really runs (its own process,
started by the launcher as `tether up` starts it) in front of a stand-in for vLLM's python that writes
down the command line and environment it was started with, so no vLLM is needed."""

from __future__ import annotations

import json
import shlex
import sys
import time
from pathlib import Path

import pytest

from tether.cli import build_parser, serving_env
from tether.common.net import free_port
from tether.inference.launch import is_vllm_cpu, model_context_length
from tether.inference.main import InferenceSettings, command
from tether.launcher import Stack, default_vllm_python, inference_wiring

# Writes its argv and environment as JSON, then waits as a server would. Asked to run code (`-c`, the
# inference service's probe for vLLM's CPU build), it fails as a Python without that build does.
FAKE_PYTHON = f"""#!{sys.executable}
import json, os, sys, time
if sys.argv[1:2] == ["-c"]:
    sys.exit(1)
with open(os.environ["TETHER_TEST_ARGV_FILE"] + ".tmp", "w") as f:
    json.dump({{"argv": sys.argv[1:], "env": dict(os.environ)}}, f)
os.replace(os.environ["TETHER_TEST_ARGV_FILE"] + ".tmp", os.environ["TETHER_TEST_ARGV_FILE"])
time.sleep(60)
"""


def _model(tmp_path, **config) -> str:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", **config}))
    return str(model)


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def _launch_inference(tmp_path, monkeypatch, model_dir: str, up_args: list[str]) -> dict:
    """Start the inference service the way start_stack does for `tether up <up_args>`; return what
    the stand-in vLLM was started with."""
    fake = tmp_path / "fake-python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    out = tmp_path / "vllm-argv.json"
    monkeypatch.setenv("TETHER_VLLM_PYTHON", str(fake))
    monkeypatch.setenv("TETHER_TEST_ARGV_FILE", str(out))
    args = build_parser().parse_args(["up", *up_args])
    stack = Stack(run_dir=tmp_path / "run", namespace="tether-run")
    stack.redis_url = "redis://127.0.0.1:1/0"  # the inference adapter keeps nothing in Redis
    stack.start(
        "inference",
        "tether.inference",
        {**serving_env(args), **inference_wiring(stack, Path(model_dir), free_port(), free_port())},
    )
    try:
        deadline = time.monotonic() + 60
        while not out.exists():
            stack.check_alive()
            assert time.monotonic() < deadline, "the inference service never started vLLM"
            time.sleep(0.1)
        return json.loads(out.read_text())
    finally:
        stack.stop(grace_s=5)


def test_up_flags_reach_the_vllm_command(tmp_path, monkeypatch):
    model = _model(tmp_path, max_position_embeddings=4096)
    monkeypatch.setenv("TETHER_DEFAULT_MAX_TOKENS", "777")  # a user's setting of another service
    monkeypatch.setenv("TETHER_NAMESPACE", "the-users")  # wiring: the launcher's value wins
    started = _launch_inference(
        tmp_path,
        monkeypatch,
        model,
        [
            "--max-model-len",
            "2048",
            "--dtype",
            "bfloat16",
            "--tensor-parallel-size",
            "2",
            "--gpu-memory-utilization",
            "0.55",
            "--vllm-arg",
            "--max-num-seqs 8 --enable-prefix-caching",
            "--vllm-arg=--override-generation-config '{\"temperature\": 0.5}'",
        ],
    )
    argv, env = started["argv"], started["env"]
    assert _flag(argv, "--max-model-len") == "2048"
    assert _flag(argv, "--dtype") == "bfloat16"
    assert _flag(argv, "--tensor-parallel-size") == "2"
    assert _flag(argv, "--gpu-memory-utilization") == "0.55"
    # The pass-through comes last (its flags win), each quoted value one word.
    assert argv[-5:] == [
        "--max-num-seqs",
        "8",
        "--enable-prefix-caching",
        "--override-generation-config",
        '{"temperature": 0.5}',
    ]
    assert env["TETHER_DEFAULT_MAX_TOKENS"] == "777"
    assert env["TETHER_NAMESPACE"] == "tether-run"


def test_up_serves_the_models_own_context_length_by_default(tmp_path, monkeypatch):
    model = _model(tmp_path, max_position_embeddings=4096)
    argv = _launch_inference(tmp_path, monkeypatch, model, [])["argv"]
    assert _flag(argv, "--max-model-len") == "4096"
    assert _flag(argv, "--dtype") == "float32"
    assert "--tensor-parallel-size" not in argv and "--gpu-memory-utilization" not in argv


def test_a_users_tether_max_model_len_reaches_inference(tmp_path, monkeypatch):
    model = _model(tmp_path, max_position_embeddings=4096)
    monkeypatch.setenv("TETHER_MAX_MODEL_LEN", "1024")
    argv = _launch_inference(tmp_path, monkeypatch, model, [])["argv"]
    assert _flag(argv, "--max-model-len") == "1024"


def test_context_length_from_config(tmp_path):
    assert model_context_length(_model(tmp_path, text_config={"max_position_embeddings": 8192})) == 8192
    assert model_context_length(str(tmp_path / "missing")) is None
    # Without the field, vLLM derives the length itself: no flag.
    s = InferenceSettings(inference_grpc_port=1, model_dir=str(tmp_path / "missing"))
    assert "--max-model-len" not in command(s)


@pytest.mark.parametrize("bad", [["--vllm-arg", "--chat-template 'unclosed"], ["--max-model-len", "x"]])
def test_bad_serving_flags_fail_at_parse(bad):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", *bad])


def test_bad_serving_settings_fail_fast():
    with pytest.raises(ValueError):
        InferenceSettings(inference_grpc_port=1, gpu_memory_utilization=1.5)
    with pytest.raises(ValueError):
        InferenceSettings(inference_grpc_port=1, vllm_extra_args="--x 'open")
    s = InferenceSettings(inference_grpc_port=1, vllm_extra_args=shlex.join(["--a", "b c"]))
    assert command(s)[-2:] == ["--a", "b c"]


def test_a_setting_only_one_process_may_hold_is_not_passed_to_every_service(tmp_path, monkeypatch):
    """TETHER_METRICS_PORT would make every service of the local stack bind the same port."""
    monkeypatch.setenv("TETHER_METRICS_PORT", "9464")
    monkeypatch.setenv("TETHER_DEFAULT_MAX_TOKENS", "777")
    env = Stack(tmp_path).base_env()
    assert "TETHER_METRICS_PORT" not in env and env["TETHER_DEFAULT_MAX_TOKENS"] == "777"


def test_vllm_cpu_starts_eager_and_other_builds_compile(tmp_path):
    """Unset, --enforce-eager follows the vLLM build: the setup's vLLM-CPU venv starts eager (its
    compile warm-up costs ~30 s a start), a Python without vLLM-CPU keeps vLLM's default; set, it wins."""
    vllm_cpu = default_vllm_python()
    assert is_vllm_cpu(vllm_cpu)
    assert not is_vllm_cpu(sys.executable)
    assert not is_vllm_cpu(str(tmp_path / "no-such-python"))
    model = _model(tmp_path)
    assert "--enforce-eager" in command(
        InferenceSettings(inference_grpc_port=1, vllm_python=vllm_cpu, model_dir=model)
    )
    assert "--enforce-eager" not in command(InferenceSettings(inference_grpc_port=1, model_dir=model))
    forced = InferenceSettings(
        inference_grpc_port=1, vllm_python=vllm_cpu, model_dir=model, enforce_eager=False
    )
    assert "--enforce-eager" not in command(forced)
    assert "--enforce-eager" in command(
        InferenceSettings(inference_grpc_port=1, model_dir=model, enforce_eager=True)
    )
