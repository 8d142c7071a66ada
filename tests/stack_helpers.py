"""Helpers for the tests that drive the `tether` command and its processes from outside."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

TETHER = [sys.executable, "-m", "tether.cli"]
# A demo may first warm-start its example's model (a cold cache) and then start vLLM: at load ~25 on a
# 2-core box a search demo's fixture ran past the suite's 15-minute default (Dec 3: vLLM alone took 5
# minutes to start). The demo's own timeout fails its test with the services' logs; `runs_a_demo`, on
# each test that starts one, leaves it the room to.
DEMO_TIMEOUT_S = 1500
runs_a_demo = pytest.mark.timeout(DEMO_TIMEOUT_S + 120)


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split()[2] == "Z")


def wait_for(cond, timeout: float, what: str, every_s: float = 0.5):
    """`cond()` once it is truthy; AssertionError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError(f"timed out waiting for {what}")


def jsonl(text: str) -> list[dict]:
    return [json.loads(x) for x in text.splitlines() if x.strip()]


@dataclass
class UpStack:
    """A `tether up` started by `tether_up`: its gateway, its directory and run directory."""

    gateway: str
    cwd: Path
    run_dir: Path

    def cli(self, *args: str) -> list[dict]:
        """`tether ARGS` in the stack's directory (as a user runs it there), its JSON lines."""
        out = subprocess.run([*TETHER, *args], cwd=self.cwd, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
        return jsonl(out.stdout)

    def steps(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        return jsonl(path.read_text()) if path.exists() else []


@contextlib.contextmanager
def tether_up(cwd: Path, *args: str, env: dict[str, str] | None = None) -> Iterator[UpStack]:
    """`tether up ARGS` in `cwd`, as a user runs it; yields once every service is up. On the way out
    `tether down`; when the body passed, also checks the stack stopped cleanly (both commands exit 0
    and no process of it is left)."""
    run_dir = cwd / "run"
    log_path = cwd / "up.log"
    state_file = cwd / ".tether" / "stack.json"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [*TETHER, "up", "--run-dir", str(run_dir), *args],
            cwd=cwd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        try:

            def ready():
                if proc.poll() is not None:
                    raise AssertionError(log_path.read_text())
                if not state_file.exists():
                    return None
                state = json.loads(state_file.read_text())
                return state if "scheduler" in state["addresses"] else None

            wait_for(lambda: ready() and "gateway:" in log_path.read_text(), 900, "the stack")
            yield UpStack(ready()["addresses"]["gateway_url"], cwd, run_dir)
        finally:
            down = subprocess.run([*TETHER, "down"], cwd=cwd, capture_output=True, text=True, timeout=120)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                raise
    assert down.returncode == 0, down.stdout + down.stderr
    assert proc.returncode == 0, log_path.read_text()[-3000:]
    state = json.loads(state_file.read_text())
    assert not [name for name, pid in state["pids"].items() if alive(pid)]


TRACE_KEYS = (
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
)


def _ok_calls_by_rollout(traces: list[dict]) -> dict[str, list[dict]]:
    by_rollout: dict[str, list[dict]] = {}
    for t in traces:
        if t["status"] == "ok":
            by_rollout.setdefault(t["rollout_id"], []).append(t)
    return by_rollout


def _trainable_spans(mask: list[int]) -> list[tuple[int, int]]:
    spans, i, n = [], 0, len(mask)
    while i < n:
        if not mask[i]:
            i += 1
            continue
        j = i
        while j < n and mask[j]:
            j += 1
        spans.append((i, j))
        i = j
    return spans


def assert_samples_are_vllm_tokens(traces: list[dict], samples: list[dict]) -> None:
    """`tether samples` against `tether traces` of the same run: every trainable run of a sample's tokens is
    one response vLLM returned in that rollout, with vLLM's own logprobs, and the rollout's advantage is
    broadcast to all its trainable tokens."""
    assert traces and samples
    for key in TRACE_KEYS:
        assert key in traces[0], key
    by_rollout = _ok_calls_by_rollout(traces)
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
        responses = [(t["response_token_ids"], t["response_logprobs"]) for t in by_rollout[s["rollout_id"]]]
        for i, j in _trainable_spans(s["loss_mask"]):
            span = (s["token_ids"][i:j], s["rollout_logprobs"][i:j])
            assert any(
                span[0] == ids and all(abs(a - b) < 1e-6 for a, b in zip(span[1], lps, strict=True))
                for ids, lps in responses
            ), "a trainable span is not a vLLM response"
        advs = {a for a, m in zip(s["advantages"], s["loss_mask"], strict=True) if m}
        assert len(advs) == 1


def assert_sequences_are_vllm_calls(traces: list[dict], samples: list[dict]) -> None:
    """Stricter, for harnesses whose turns merge on an exact prefix: before every trainable span, a
    sample's tokens are exactly the prompt ids vLLM reported for the call that answered with that span, and
    the whole sample is that rollout's last merged call, prompt then response, token for token."""
    by_rollout = _ok_calls_by_rollout(traces)
    for s in samples:
        ids = s["token_ids"]
        calls = by_rollout[s["rollout_id"]]
        spans = _trainable_spans(s["loss_mask"])
        assert spans, "a sample with nothing to train"
        for i, j in spans:
            assert any(
                t["prompt_token_ids"] == ids[:i] and t["response_token_ids"] == ids[i:j] for t in calls
            ), "a response's tokens do not follow its own prompt's ids"
        assert any(t["prompt_token_ids"] + t["response_token_ids"] == ids for t in calls)


def tether_demo(cwd: Path, *flags: str) -> tuple[Path, str]:
    """`tether demo FLAGS` run from `cwd` into `cwd/run`: (the run directory, what it printed). A demo
    that fails fails the test with its services' logs."""
    run_dir = cwd / "run"
    proc = subprocess.run(
        [*TETHER, "demo", *flags, "--run-dir", str(run_dir), "--quiet"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=DEMO_TIMEOUT_S,
    )
    if proc.returncode != 0:
        logs = "\n".join(
            f"--- {p.relative_to(run_dir)}\n{p.read_text()[-3000:]}"
            for p in (run_dir / "logs").rglob("*.log")
        )
        pytest.fail(f"demo failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n{logs}")
    return run_dir, proc.stdout


def small_demo(cwd: Path, example: str, tasks_per_step: int = 2) -> Path:
    """An example's demo from `cwd`: 2 steps of `tasks_per_step` groups of 4, no evaluation."""
    flags = [
        "--steps",
        "2",
        "--tasks-per-step",
        str(tasks_per_step),
        "--group-size",
        "4",
        "--eval-repeats",
        "0",
    ]
    return tether_demo(cwd, "--example", example, *flags)[0]


def tether_jsonl(cwd: Path, *args: str) -> list[dict]:
    """`tether ARGS` run in `cwd` (the stack's directory), its JSON-lines output parsed."""
    out = subprocess.run([*TETHER, *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=True)
    return jsonl(out.stdout)


# Each gRPC address `.tether/stack.json` lists -> the Tether service served there (tether/v1 protos).
STACK_SERVICES = {
    "gateway_grpc": ("gateway_pb2", "GatewayControl"),
    "merger": ("merger_pb2", "Merger"),
    "scheduler": ("scheduler_pb2", "Scheduler"),
    "trainer": ("trainer_pb2", "Trainer"),
    "inference": ("inference_pb2", "Inference"),
}
REFLECTION = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
HEALTH_CHECK = "/grpc.health.v1.Health/Check"


def service_methods(module: str, service: str) -> list[tuple[str, bool, bool]]:
    """(path, client streaming, server streaming) of every method of a tether.v1 service, and of the
    reflection every server also serves."""
    import importlib

    desc = importlib.import_module(f"tether.v1.{module}").DESCRIPTOR.services_by_name[service]
    methods = [(f"/{desc.full_name}/{m.name}", m.client_streaming, m.server_streaming) for m in desc.methods]
    return [*methods, (REFLECTION, True, True)]


def call_codes(address: str, methods: list[tuple[str, bool, bool]], token: str = "") -> dict[str, object]:
    """Each method called once on `address` with an empty request, with `authorization: Bearer
    token` (none when ""): the status code each got (grpc.StatusCode.OK when it answered). Without the
    token a server refuses before the method runs; never call a method that acts (Pause, LoadWeights,
    Stop ...) with it."""
    import grpc

    metadata = [("authorization", f"Bearer {token}")] if token else None
    out: dict[str, object] = {}
    with grpc.insecure_channel(address) as ch:
        for path, streams_in, streams_out in methods:
            kind = {
                (False, False): ch.unary_unary,
                (False, True): ch.unary_stream,
                (True, False): ch.stream_unary,
                (True, True): ch.stream_stream,
            }[(streams_in, streams_out)]
            request = iter([b""]) if streams_in else b""
            try:
                reply = kind(path)(request, timeout=30, metadata=metadata)
                if streams_out:
                    list(reply)
                out[path] = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                out[path] = exc.code()
    return out


def assert_every_method_needs_the_token(addresses: dict[str, str], token: str) -> set[str]:
    """Every gRPC method of every service of a stack that `addresses` lists (each gateway replica's
    control included), and reflection, refuses a call without the service token (UNAUTHENTICATED) or
    with another; health answers without it; a read-only method answers with it. Returns the services
    checked."""
    import grpc

    targets = [(addresses[name], *spec) for name, spec in STACK_SERVICES.items() if name in addresses]
    targets += [
        (a, *STACK_SERVICES["gateway_grpc"]) for a in addresses.get("gateway_controls", "").split(",") if a
    ]
    for address, module, service in targets:
        methods = service_methods(module, service)
        for token_sent in ("", "not-the-token"):
            codes = call_codes(address, methods, token_sent)
            assert set(codes.values()) == {grpc.StatusCode.UNAUTHENTICATED}, (address, service, codes)
        assert call_codes(address, [(HEALTH_CHECK, False, False)]) == {HEALTH_CHECK: grpc.StatusCode.OK}
        read = {"GatewayControl": "GetAdmission", "Scheduler": "GetRun", "Inference": "GetWeightVersion"}
        path = next(p for p, _, _ in methods if p.endswith(f"/{read.get(service, 'GetStatus')}"))
        assert call_codes(address, [(path, False, False)], token) == {path: grpc.StatusCode.OK}, address
    return {service for _, _, service in targets}
