"""`tether gateway`: the gateway alone in front of any vLLM-compatible server (one process, or
supervised replicas sharing its port).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

from tether.cli.args import Subparsers
from tether.cli.stack import on_stack, replicas_flag


def cmd_gateway(args: argparse.Namespace) -> int:
    """The gateway alone in front of any vLLM-compatible server, recording to REDIS_URL or to an
    embedded Redis kept in .tether/gateway-redis. With --gateway-replicas N > 1, N supervised gateway
    processes share the port (tether.launcher.start_gateways)."""
    if args.gateway_replicas != 1:
        return _gateway_replicas(args)
    from pydantic import ValidationError

    from tether.common.logs import setup_logging
    from tether.common.net import free_port
    from tether.common.redis_server import start_embedded_redis
    from tether.gateway.main import GatewaySettings, amain

    redis_url = os.environ.get("REDIS_URL") or os.environ.get("TETHER_REDIS_URL")
    proc = None
    if not redis_url:
        port = free_port()
        proc = start_embedded_redis(
            Path(".tether") / "gateway-redis", port, Path(".tether") / "gateway-redis.log"
        )
        redis_url = f"redis://127.0.0.1:{port}/0"
    overrides = {
        "redis_url": redis_url,
        "vllm_url": args.upstream,
        "gateway_host": args.host,
        "gateway_port": args.port,
        "gateway_grpc_port": args.grpc_port,
    }
    if args.model:
        overrides["served_model"] = args.model
    try:
        s = GatewaySettings(**overrides)
    except ValidationError as exc:
        print(f"tether gateway: refusing to start, bad settings: {exc}", file=sys.stderr)
        if proc is not None:
            proc.terminate()
        return 2
    setup_logging("gateway", s.log_level)
    try:
        asyncio.run(amain(s))
    except KeyboardInterrupt:
        pass
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
    return 0


def _gateway_replicas(args: argparse.Namespace) -> int:
    from tether.common.net import free_port
    from tether.launcher import Stack, start_gateways, wait_gateways

    stack = Stack(run_dir=Path(".tether") / "gateway", namespace=os.environ.get("TETHER_NAMESPACE", "tether"))
    env = {"TETHER_VLLM_URL": args.upstream, "TETHER_GATEWAY_HOST": args.host}
    if args.model:
        env["TETHER_SERVED_MODEL"] = args.model

    def run() -> int:
        stack.start_redis()
        controls = start_gateways(stack, args.gateway_replicas, args.port or free_port(), env)
        wait_gateways(stack, controls, 120)
        print(
            f"{args.gateway_replicas} gateway replicas on {stack.addresses['gateway_url']}/v1; control "
            f"{stack.addresses['gateway_controls']}; metrics {stack.addresses['gateway_metrics']}",
            flush=True,
        )
        while True:
            stack.check_alive()
            time.sleep(1.0)

    return on_stack(stack, run, interrupted=0)


def add_gateway(sub: Subparsers) -> None:
    gateway = sub.add_parser("gateway", help="run the gateway alone in front of a vLLM-compatible server")
    gateway.add_argument(
        "--upstream", required=True, help="base URL of the vLLM server, e.g. http://127.0.0.1:8000"
    )
    gateway.add_argument("--host", default="127.0.0.1")
    gateway.add_argument("--port", type=int, default=8080)
    gateway.add_argument("--grpc-port", type=int, default=0)
    gateway.add_argument("--model", help="model name served to agents (default: tether-policy)")
    replicas_flag(gateway)
    gateway.set_defaults(fn=cmd_gateway)
