#!/usr/bin/env python3
"""Run Agent Lightning 1.0.2's gateway (its `agl-server`, installed by bench/peers/setup.sh) in front of
an OpenAI-compatible upstream, as bench/gateway_overhead measures it.

The gateway is the `agentlightning.server` FastAPI app (one uvicorn process, configured by Hydra). Its
LLM proxy route is `POST /proxy/rollout/{rollout_id}/attempt/{attempt_id}/mode/{train|val}/openai/v1/
chat/completions`; it forwards to a model server registered with `POST /api/models` (`{"model",
"endpoint": "<upstream>/v1"}`) after forcing `return_token_ids` and `logprobs`, and records each call as a
`model_request` event (request and full response) in the server's process memory, read back with
`GET /api/rollouts/{id}/events`; it keeps nothing on disk. Rollouts must exist first (`POST
/api/rollouts`). It refuses `"stream": true` (400). It runs as shipped: Hydra's INFO logging, uvicorn's
access log, no key.

Usage: bench/peers/agentlightning_proxy.py --upstream http://127.0.0.1:8000/v1 [--port 8080]
Prints "ready <proxy base URL for rollout r0>" and runs until interrupted.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from peers import Peer, http, run_alone, venv_python, wait_healthy  # noqa: E402

VERSION = "1.0.2"
MODEL = "tether-policy"


class AgentLightning(Peer):
    name = "agentlightning"
    version = VERSION
    stream_skip = (
        "Agent Lightning 1.0.2's gateway refuses stream=true (400 'Streaming responses are not supported')"
    )

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.rollouts: list[str] = []

    def targets(self, n: int) -> list[tuple[str, str | None]]:
        """One fresh rollout per caller (so a cell's events can be dropped after it)."""
        ids = [f"bench-{uuid.uuid4().hex[:12]}" for _ in range(n)]
        http("POST", f"{self.url}/api/rollouts", [{"input": {}, "rollout_id": r} for r in ids])
        self.rollouts += ids
        return [(f"{self.url}/proxy/rollout/{r}/attempt/0/mode/train/openai/v1", None) for r in ids]

    def end_cell(self) -> None:
        # The gateway holds every call's request and response in memory until a trainer reads them;
        # dropping each cell's rollouts keeps the cells alike (as the bench flushes Redis for Tether).
        for r in self.rollouts:
            http("DELETE", f"{self.url}/api/rollouts/{r}")
        self.rollouts = []


def start(upstream: str, workdir: Path, port: int) -> AgentLightning:
    py = venv_python("agentlightning", "agentlightning", VERSION)
    workdir.mkdir(parents=True, exist_ok=True)
    log_path = workdir / "agentlightning.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [
            str(py.parent / "agl-server"),
            "host=127.0.0.1",
            f"port={port}",
            f"default_proxy.model_name={MODEL}",
            f"hydra.run.dir={workdir / 'hydra'}",
        ],
        cwd=workdir,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, f"{url}/healthz", log_path, timeout=60)
    http("POST", f"{url}/api/models", [{"model": MODEL, "endpoint": upstream}])
    return AgentLightning(proc, url, log_path)


def main() -> None:
    run_alone(__doc__.splitlines()[0], start, 8080, lambda peer: peer.targets(1)[0][0])


if __name__ == "__main__":
    main()
