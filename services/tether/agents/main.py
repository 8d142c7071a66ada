"""Agent worker process. Run: python -m tether.agents (or `tether agent FN`).

Besides the worker it serves gRPC health (no other gRPC service) on TETHER_AGENT_GRPC_PORT: SERVING
while the run's Redis answers a ping, which is all a worker needs to take dispatched rollouts; and
Prometheus /metrics on TETHER_METRICS_PORT when set.
"""

from __future__ import annotations

import asyncio
from typing import ClassVar

import redis.asyncio as aioredis
from pydantic import Field

from tether.agents.worker import Worker, load_function
from tether.common import broker
from tether.common.grpc_server import follow_health, run_until_signal, start_server
from tether.common.logs import setup_logging
from tether.common.settings import RedisSettings, refused_settings_exit
from tether.common.usage import exit_if_help

# The agent worker's port in the containers' fixed interface (docker/, helm/).
DEFAULT_GRPC_PORT = 50056


class AgentSettings(RedisSettings):
    config_section: ClassVar[str | None] = "agent"

    agent_fn: str
    gateway_url: str
    agent_concurrency: int = 16
    agent_name: str = "agent-0"
    admin_token: str = ""
    # A run's workers (TETHER_NAMESPACE a run's, docs/runs.md): the run's API key (`trk-...`), with which
    # the gateway creates each rollout in the run's namespace, served by the run's adapter. Set by whoever
    # starts the run's services (the launcher); never logged.
    run_key: str = Field("", repr=False)
    rollout_timeout_s: float = 0.0  # per attempt; 0 = no limit
    agent_grpc_host: str = "127.0.0.1"
    agent_grpc_port: int = DEFAULT_GRPC_PORT  # gRPC health only; 0 = any free port


async def redis_answers(r: aioredis.Redis, timeout_s: float = 2.0) -> bool:
    await asyncio.wait_for(r.ping(), timeout_s)
    return True


async def amain(s: AgentSettings) -> None:
    fn = load_function(s.agent_fn)
    r = broker.connect(s.redis_url)
    worker = Worker(
        r,
        s.keys(),
        s.gateway_url,
        fn,
        s.agent_concurrency,
        s.run_key or s.admin_token,
        s.agent_name,
        s.rollout_timeout_s,
    )
    server, health, _ = await start_server(
        s.agent_grpc_port, lambda _server: [], s.agent_grpc_host, s.metrics_port
    )
    try:
        # SIGTERM/SIGINT cancel the worker (its rollouts in flight stay pending in the dispatch stream
        # for another worker to reclaim), then the health server stops.
        await run_until_signal(
            server,
            health,
            [worker.run(), follow_health(health, lambda: redis_answers(r), what="agent worker")],
        )
    finally:
        await r.aclose()


def main() -> None:
    exit_if_help(AgentSettings, __doc__)
    with refused_settings_exit("agents"):
        s = AgentSettings()
    setup_logging("agent", s.log_level)
    asyncio.run(amain(s))


if __name__ == "__main__":
    main()
