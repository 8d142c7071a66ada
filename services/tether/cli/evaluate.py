"""`tether eval`: a checkpoint scored on held-out tasks through an example's harness (pass@1), behind
a gateway that records and trains nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tether.cli.args import Subparsers
from tether.cli.examples import DEFAULT_EXAMPLE, example_module
from tether.cli.stack import on_stack


def eval_runs(
    gateway_url: str, fn: Callable[..., Any], tasks: list[dict], repeats: int, concurrency: int
) -> list[list[float]]:
    """Each task's rewards over `repeats` runs of the harness `fn`, every run a rollout of the gateway
    (recorded, never trained: no merger or trainer is running). A run that raises scores 0."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    def one(job: tuple[int, int]) -> tuple[int, float]:
        i, r = job
        task = tasks[i]
        with httpx.Client(base_url=gateway_url, timeout=60) as http:
            ro = (
                http.post(
                    "/v1/rollouts",
                    json={
                        "task_id": str(task.get("task_id", i)),
                        "group_id": f"eval-{i}-{r}",
                        "group_size": 1,
                    },
                )
                .raise_for_status()
                .json()
            )
            try:
                reward = float(fn(task, ro["base_url"], ro["api_key"], ro["model"]))
            except Exception as exc:  # scored as unsolved, and said
                print(f"eval: task {task.get('task_id', i)} run {r}: {exc!r}", file=sys.stderr, flush=True)
                reward = 0.0
            http.post(
                f"/v1/rollouts/{ro['rollout_id']}/complete",
                json={"reward": reward},
                headers={"Authorization": f"Bearer {ro['api_key']}"},
            )
        return i, reward

    out: list[list[float]] = [[] for _ in tasks]
    with ThreadPoolExecutor(max(1, concurrency)) as pool:
        for i, reward in pool.map(one, [(i, r) for i in range(len(tasks)) for r in range(repeats)]):
            out[i].append(reward)
    return out


def pass_at_1(rewards: list[list[float]]) -> float:
    """Mean over tasks of each task's mean reward over its runs (reward 1 = solved: pass@1)."""
    return sum(sum(r) / len(r) for r in rewards) / len(rewards) if rewards else 0.0


def cmd_eval(args: argparse.Namespace) -> int:
    """`tether eval`: vLLM on the checkpoint behind a gateway that records and does not train, the
    example's harness over the tasks, pass@1."""
    from tether.agents.worker import load_function
    from tether.launcher import Stack, inference_wiring

    try:
        fn = load_function(f"{example_module(args.example)}:rollout")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    model_dir = Path(args.model).resolve()
    if not (model_dir / "config.json").is_file():
        print(
            f"error: --model {args.model}: no config.json (a Hugging Face model directory)", file=sys.stderr
        )
        return 2
    tasks = [json.loads(line) for line in Path(args.tasks).read_text().splitlines() if line.strip()]
    if not tasks:
        print(f"error: --tasks {args.tasks}: no task", file=sys.stderr)
        return 2
    run_dir = Path(args.run_dir or f"runs/eval-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    stack = Stack(run_dir=run_dir, namespace=f"tether-{run_dir.name}")
    rewards: list[list[float]] = []

    def run() -> int:
        from tether.common.net import free_port

        stack.start_redis()
        ports = {name: free_port() for name in ("vllm", "inference", "gateway", "gateway_grpc")}
        gateway_url = f"http://127.0.0.1:{ports['gateway']}"
        stack.addresses = {"gateway_url": gateway_url, "vllm_url": f"http://127.0.0.1:{ports['vllm']}"}
        wiring = inference_wiring(stack, model_dir, ports["inference"], ports["vllm"])
        wiring.pop("TETHER_CHECKPOINT_DIR")  # serve this checkpoint, not a run's newest
        stack.start("inference", "tether.inference", wiring)
        stack.start(
            "gateway",
            "tether.gateway",
            {
                "TETHER_GATEWAY_PORT": str(ports["gateway"]),
                "TETHER_GATEWAY_GRPC_PORT": str(ports["gateway_grpc"]),
                "TETHER_VLLM_URL": stack.addresses["vllm_url"],
            },
        )
        stack.write_state()
        stack.wait_http("gateway", f"{gateway_url}/health", 120)
        stack.wait_grpc("inference", f"127.0.0.1:{ports['inference']}", 900)
        rewards.extend(eval_runs(gateway_url, fn, tasks, args.repeats, args.concurrency))
        return 0

    started = time.time()
    rc = on_stack(stack, run)
    if rc:
        return rc
    score = pass_at_1(rewards)
    result = {
        "pass_at_1": round(score, 4),
        "tasks": len(tasks),
        "repeats": args.repeats,
        "example": args.example,
        "model": str(model_dir),
        "seconds": round(time.time() - started, 1),
    }
    (run_dir / "eval.json").write_text(json.dumps({**result, "rewards": rewards}, indent=2))
    print(
        f"pass@1 {score:.3f} over {len(tasks)} tasks x {args.repeats} runs ({args.example}); run directory {run_dir}"
    )
    print(json.dumps(result))
    return 0


def add_eval(sub: Subparsers) -> None:
    ev = sub.add_parser(
        "eval",
        help="score a checkpoint on held-out tasks through the example's harness (pass@1); trains nothing",
    )
    ev.add_argument("--model", required=True, help="the checkpoint (a Hugging Face model directory)")
    ev.add_argument("--example", default=DEFAULT_EXAMPLE, help="the example whose harness runs the tasks")
    ev.add_argument("--tasks", required=True, help="JSON lines, one task each (the example's task format)")
    ev.add_argument("--repeats", type=int, default=1, help="runs per task, averaged")
    ev.add_argument("--concurrency", type=int, default=16)
    ev.add_argument("--run-dir")
    ev.set_defaults(fn=cmd_eval)
