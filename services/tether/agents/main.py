"""Agent worker process. Run: python -m tether.agents (or `tether agent FN`)."""

from __future__ import annotations

import asyncio
import signal

from tether.agents.worker import Worker, load_function
from tether.common import broker
from tether.common.logs import setup_logging
from tether.common.settings import RedisSettings
from tether.common.usage import exit_if_help


class AgentSettings(RedisSettings):
    agent_fn: str
    gateway_url: str
    agent_concurrency: int = 16
    agent_name: str = "agent-0"
    admin_token: str = ""
    rollout_timeout_s: float = 0.0  # per attempt; 0 = no limit


async def amain(s: AgentSettings) -> None:
    fn = load_function(s.agent_fn)
    r = broker.connect(s.redis_url)
    worker = Worker(
        r,
        broker.Keys(s.namespace),
        s.gateway_url,
        fn,
        s.agent_concurrency,
        s.admin_token,
        s.agent_name,
        s.rollout_timeout_s,
    )
    task = asyncio.create_task(worker.run())
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    try:
        await task
    except asyncio.CancelledError:
        pass
    finally:
        await r.aclose()


def main() -> None:
    exit_if_help(AgentSettings, __doc__)
    s = AgentSettings()
    setup_logging("agent", s.log_level)
    asyncio.run(amain(s))


if __name__ == "__main__":
    main()
