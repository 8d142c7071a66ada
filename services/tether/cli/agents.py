"""`tether agent` (a worker for the rollouts the scheduler dispatches) and `tether agent-job` (one
rollout's harness inside its Kubernetes Job).
"""

from __future__ import annotations

import argparse
import asyncio
import os
from typing import Any

from tether.cli.args import Subparsers
from tether.cli.stack import stack_state, use_stack_token


def cmd_agent(args: argparse.Namespace) -> int:
    from tether.agents.main import AgentSettings, amain
    from tether.common.logs import setup_logging

    state = {} if (args.redis_url and args.gateway) else stack_state()
    use_stack_token(state)
    # Any free port for its gRPC health unless one is set: several workers may share a host.
    port: dict[str, Any] = {} if "TETHER_AGENT_GRPC_PORT" in os.environ else {"agent_grpc_port": 0}
    s = AgentSettings(
        redis_url=args.redis_url or state["redis_url"],
        namespace=args.namespace or state.get("namespace", "tether"),
        agent_fn=args.harness,
        gateway_url=args.gateway or state["addresses"]["gateway_url"],
        agent_concurrency=args.concurrency,
        **port,
    )
    setup_logging("agent", s.log_level)
    asyncio.run(amain(s))
    return 0


def cmd_agent_job(args: argparse.Namespace) -> int:
    """One rollout's harness inside its Kubernetes Job (tether.agents.job); settings from the env."""
    from tether.agents.job import run
    from tether.common.logs import setup_logging

    setup_logging("agent-job", os.environ.get("TETHER_LOG_LEVEL", "INFO"))
    return run(os.environ)


def add_agents(sub: Subparsers) -> None:
    agent = sub.add_parser("agent", help="run a worker for dispatched rollouts")
    # dest "harness": `fn` is the attribute every subcommand's handler is dispatched through.
    agent.add_argument(
        "harness",
        metavar="fn",
        help="MODULE:FUNCTION or FILE.py:FUNCTION, called as fn(task, base_url, api_key, model)",
    )
    agent.add_argument("--concurrency", type=int, default=16)
    agent.add_argument("--gateway")
    agent.add_argument("--redis-url")
    agent.add_argument("--namespace")
    agent.set_defaults(fn=cmd_agent)

    agent_job = sub.add_parser(
        "agent-job",
        help="run one rollout's harness inside its Kubernetes Job (the scheduler creates the Job)",
        description="Runs TETHER_AGENT_FN (MODULE:FUNCTION, called as fn(task, base_url, api_key, model)) "
        "once with TETHER_TASK (JSON), TETHER_BASE_URL, TETHER_API_KEY and TETHER_MODEL, and reports its "
        "reward (or its failure) for TETHER_ROLLOUT_ID to TETHER_GATEWAY_URL. Exit 0: a reward was reported.",
    )
    agent_job.set_defaults(fn=cmd_agent_job)
