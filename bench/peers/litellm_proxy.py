#!/usr/bin/env python3
"""Run the LiteLLM proxy (`litellm --config`, litellm[proxy] 1.108.7 installed by bench/peers/setup.sh)
in front of an OpenAI-compatible upstream, as bench/gateway_overhead measures it.

One model entry, `hosted_vllm/<model>` with `api_base` the upstream's /v1, under the model name the
bench's callers send; a master key (LiteLLM 1.108 refuses to start without one) that the callers send
as their bearer key. No database, so LiteLLM keeps no per-call record (no spend logs); one uvicorn
worker, its defaults otherwise. LITELLM_LOCAL_MODEL_COST_MAP=True keeps it from fetching its price list
from the internet at start-up.

Usage: bench/peers/litellm_proxy.py --upstream http://127.0.0.1:8000/v1 [--port 4000]
Prints "ready <base URL> <key>" and runs until interrupted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from peers import Peer, run_alone, venv_python, wait_healthy  # noqa: E402

VERSION = "1.108.7"
MODEL = "tether-policy"
KEY = "sk-tether-bench-0123456789abcdef0123456789abcdef"


class LiteLLM(Peer):
    name = "litellm"
    version = VERSION

    def targets(self, n: int) -> list[tuple[str, str | None]]:
        return [(f"{self.url}/v1", KEY)] * n


def start(upstream: str, workdir: Path, port: int) -> LiteLLM:
    py = venv_python("litellm", "litellm", VERSION)
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "litellm.yaml"
    # JSON is YAML; no YAML writer needed in Tether's venv.
    config.write_text(
        json.dumps(
            {
                "model_list": [
                    {
                        "model_name": MODEL,
                        "litellm_params": {
                            "model": f"hosted_vllm/{MODEL}",
                            "api_base": upstream,
                            "api_key": "none",
                        },
                    }
                ],
                "general_settings": {"master_key": KEY},
            },
            indent=2,
        )
    )
    log_path = workdir / "litellm.log"
    log = open(log_path, "w")
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    proc = subprocess.Popen(
        [
            str(py.parent / "litellm"),
            "--config",
            str(config),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--num_workers",
            "1",
        ],
        cwd=workdir,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, f"{url}/health/liveliness", log_path, timeout=120)
    return LiteLLM(proc, url, log_path)


def main() -> None:
    run_alone(__doc__.splitlines()[0], start, 4000, lambda peer: f"{peer.url}/v1 {KEY}")


if __name__ == "__main__":
    main()
