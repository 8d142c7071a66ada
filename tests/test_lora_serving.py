"""Several LoRA adapters served side by side by one real vLLM-CPU, every call attributed to the adapter
(and version) that served it (issue 28, docs/runs.md).

Two adapters of the calculator model (peft, different random weights), loaded at run time; a gateway
per adapter (its upstream model is the adapter's name) and one for the base model record the calls.
The traces must name the adapter that served each span; the logprobs must differ between adapters (the
adapter really ran); and loading a new version of one adapter must neither change the weights under a
call already running on the old one (its record stays true) nor touch the other adapter's calls."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest
import redis
import vllm_cpu
from gateway_helpers import InProcessGateway, bearer, gateway_settings, wait_traces

pytestmark = pytest.mark.slow

PROMPT = "12+7="
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_adapter(model_dir: Path, out: Path, seed: int) -> Path:
    """A rank-8 adapter with random A and B (peft's default B = 0 would change nothing)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=MODULES, init_lora_weights=False)
    get_peft_model(model, config).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def lora_vllm(tmp_path_factory):
    """vLLM-CPU with LoRA on and runtime loading, running this checkout's plugin."""
    from tether.cli import prepare_calculator_model

    if not vllm_cpu.VLLM_PYTHON.exists():
        pytest.skip(f"no vLLM-CPU virtualenv at {vllm_cpu.VLLM_PYTHON}")
    model_dir = prepare_calculator_model(0)
    root = tmp_path_factory.mktemp("adapters")
    adapters = {
        ("run-a", "1"): build_adapter(model_dir, root / "run-a" / "1", 1),
        ("run-a", "2"): build_adapter(model_dir, root / "run-a" / "2", 3),
        ("run-b", "1"): build_adapter(model_dir, root / "run-b" / "1", 2),
    }
    # Three adapter ids in one batch: the old and new versions of run-a while a call finishes on the old.
    log = tmp_path_factory.mktemp("vllm-lora") / "vllm.log"
    with vllm_cpu.lora_server(model_dir, log, max_loras=3, max_cpu_loras=4) as url:
        yield url, adapters


def load(url: str, name: str, path: Path, inplace: bool = False) -> httpx.Response:
    body = {"lora_name": name, "lora_path": str(path), "load_inplace": inplace}
    return httpx.post(f"{url}/v1/load_lora_adapter", json=body, timeout=60)


def call(gw: InProcessGateway, rdb: redis.Redis, max_tokens: int = 8) -> dict:
    """One completions call through the gateway, greedy; its trace."""
    rollout = gw.new_rollout()
    body = {
        "model": vllm_cpu.MODEL,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": 0,
        "ignore_eos": True,
    }
    resp = gw.http.post("/v1/completions", json=body, headers=bearer(rollout["api_key"]), timeout=120)
    assert resp.status_code == 200, resp.text
    [trace] = wait_traces(rdb, gw.keys, rollout["rollout_id"])
    assert trace["status"] == "ok", trace["error"]
    return trace


def served_by(trace: dict) -> list[tuple[str, str]]:
    n = len(trace["response_token_ids"])
    spans = trace["adapter_spans"]
    assert spans and spans[0]["start"] == 0 and spans[-1]["end"] == n, spans
    return [(s["adapter"], s["version"]) for s in spans]


def close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) < 1e-3 for x, y in zip(a, b, strict=True))


def test_adapters_served_side_by_side_are_attributed_per_call(lora_vllm, redis_port, rdb):
    url, adapters = lora_vllm
    assert httpx.get(f"{url}/tether/plugin").json()["adapters"] is True
    for name in ("run-a", "run-b"):
        resp = load(url, name, adapters[(name, "1")])
        assert resp.status_code == 200, resp.text
    gws = {
        name: InProcessGateway(gateway_settings(redis_port, url, upstream_model=upstream))
        for name, upstream in (("run-a", "run-a"), ("run-b", "run-b"), ("", vllm_cpu.MODEL))
    }
    try:
        for g in gws.values():
            g.__enter__()
        _check_attribution_and_reload(url, adapters, gws, rdb)
    finally:
        for g in gws.values():
            g.__exit__(None, None, None)


def _check_attribution_and_reload(url: str, adapters: dict, gws: dict, rdb: redis.Redis) -> None:
    first = {name: call(g, rdb) for name, g in gws.items()}
    assert served_by(first["run-a"]) == [("run-a", "1")]
    assert served_by(first["run-b"]) == [("run-b", "1")]
    assert served_by(first[""]) == [("", "")]
    lps = {name: t["response_logprobs"] for name, t in first.items()}
    assert not close(lps["run-a"], lps["run-b"]) and not close(lps["run-a"], lps[""])
    assert not close(lps["run-b"], lps[""]), "an adapter's call sampled the base model's distribution"

    long_a1 = call(gws["run-a"], rdb, max_tokens=400)  # what run-a version 1 answers, undisturbed
    b1 = first["run-b"]

    # A long run-a call is under way when run-a's version 2 arrives; a run-b call runs meanwhile.
    out: dict[str, dict] = {}
    times: dict[str, float] = {}

    def run(key: str, name: str, max_tokens: int) -> None:
        times[f"{key}.start"] = time.monotonic()
        out[key] = call(gws[name], rdb, max_tokens=max_tokens)
        times[f"{key}.end"] = time.monotonic()

    during = threading.Thread(target=run, args=("a", "run-a", 400))
    during.start()
    # The load goes in as soon as run-a's gateway has admitted the call (a fixed sleep let a busy box's
    # 400 tokens end before the load did: `make test-all`, Dec 8; vLLM's gauge of running requests is
    # refreshed too seldom to see a 2-second call, and the process-wide in-flight gauge reads the last
    # gateway started), then a moment for the call to reach vLLM.
    deadline = time.monotonic() + 60
    while gws["run-a"].server.admission.in_flight < 1:
        assert during.is_alive() and time.monotonic() < deadline, ("the call never showed as running", times)
        time.sleep(0.01)
    time.sleep(0.2)
    times["load.start"] = time.monotonic()
    resp = load(url, "run-a", adapters[("run-a", "2")], inplace=True)
    times["load.end"] = time.monotonic()
    assert resp.status_code == 200, resp.text
    run("b", "run-b", 8)
    during.join(120)
    assert times["a.start"] < times["load.start"] and times["load.end"] < times["a.end"], times

    # The call that was running finished on version 1, and says so.
    assert served_by(out["a"]) == [("run-a", "1")]
    assert out["a"]["response_token_ids"] == long_a1["response_token_ids"]
    assert close(out["a"]["response_logprobs"], long_a1["response_logprobs"])
    # run-b's call went on as before: same adapter, same answer.
    assert served_by(out["b"]) == [("run-b", "1")]
    assert close(out["b"]["response_logprobs"], b1["response_logprobs"])
    # Later run-a calls are version 2: recorded so, and sampled so.
    a2 = call(gws["run-a"], rdb)
    assert served_by(a2) == [("run-a", "2")]
    assert not close(a2["response_logprobs"], lps["run-a"])
    # A reload from the path already loaded is refused: its weights would hide under the old record.
    again = load(url, "run-a", adapters[("run-a", "2")], inplace=True)
    assert again.status_code == 400 and "new path" in again.text
