"""Inference service process: optionally launches vLLM, then serves the gRPC control adapter.

Health is NOT_SERVING until vLLM answers /health, again if it stops answering, and while generation
is held paused after a failed weight load (the weights may be half-loaded until a load succeeds).
Run: python -m tether.inference
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from tether.common.grpc_server import Health, run_until_signal, start_server
from tether.common.logs import setup_logging
from tether.common.settings import CommonSettings
from tether.common.vllm_client import VLLMControl
from tether.inference.control import WEIGHT_VERSION, InferenceServicer
from tether.inference.launch import start_vllm, vllm_command, vllm_env
from tether.v1 import inference_pb2, inference_pb2_grpc

log = logging.getLogger("tether.inference")


class InferenceSettings(CommonSettings):
    redis_url: str = ""  # the adapter itself keeps no state in Redis
    inference_grpc_host: str = "127.0.0.1"
    inference_grpc_port: int
    vllm_host: str = "127.0.0.1"
    vllm_port: int = 8000
    # Launch vLLM as a child process (local stack); otherwise attach to vllm_host:vllm_port.
    vllm_launch: bool = True
    vllm_python: str = "python"
    model_dir: str = ""
    served_model: str = "tether-policy"
    max_model_len: int = 512
    vllm_extra_args: str = ""
    vllm_log: str = "vllm.log"
    vllm_start_timeout_s: float = 600.0


async def watch_health(vllm: VLLMControl, health: Health, proc, servicer: InferenceServicer) -> None:
    serving = None
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"vLLM exited with code {proc.returncode}")
        answering = await vllm.healthy()
        ok = answering and not servicer.unsafe
        if ok != serving:
            await health.set(ok)
            serving = ok
            log.info("vLLM %s", "healthy" if ok else "not answering" if not answering
                     else f"held paused: {servicer.unsafe}")
        await asyncio.sleep(1.0 if ok else 0.5)


async def amain(s: InferenceSettings) -> None:
    proc = None
    if s.vllm_launch:
        if not s.model_dir:
            raise SystemExit("TETHER_MODEL_DIR is required when TETHER_VLLM_LAUNCH is true")
        cmd = vllm_command(s.vllm_python, s.model_dir, s.served_model, s.vllm_host, s.vllm_port,
                           s.max_model_len, extra=s.vllm_extra_args.split())
        log.info("starting vLLM: %s", " ".join(cmd))
        proc = start_vllm(cmd, vllm_env(), Path(s.vllm_log))
    vllm = VLLMControl(f"http://{s.vllm_host}:{s.vllm_port}")
    servicer = InferenceServicer(vllm, s.model_dir)

    def register(server):
        inference_pb2_grpc.add_InferenceServicer_to_server(servicer, server)
        return [inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name]

    server, health, port = await start_server(s.inference_grpc_port, register, s.inference_grpc_host,
                                              s.metrics_port)
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
        await run_until_signal(server, health, [watch_health(vllm, health, proc, servicer)], on_stop=stop_vllm)
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()


def main() -> None:
    s = InferenceSettings()
    setup_logging("inference", s.log_level)
    asyncio.run(amain(s))


if __name__ == "__main__":
    main()
