"""Settings shared by the services. Each service subclasses `CommonSettings`, or `RedisSettings` when it
uses the run's Redis (gateway, merger, scheduler, agent worker; the trainer and the inference adapter do
not), and declares its own fields with types that refuse a bad value at start-up (Literal names: see
tether.algorithms.names). Every setting is read from TETHER_<FIELD>; docs/settings.md lists them.
"""

from __future__ import annotations

from typing import Literal

from pydantic_settings import BaseSettings, SettingsConfigDict

# How new weights reach inference, set on the scheduler and the trainer alike: "checkpoint" (path 1,
# inference reloads the checkpoint) or "nccl" (path 2, the trainer streams them; docs/weight-push.md).
WeightPush = Literal["checkpoint", "nccl"]


class CommonSettings(BaseSettings):
    """Values every service reads from the environment (TETHER_*)."""

    model_config = SettingsConfigDict(env_prefix="TETHER_", extra="ignore")

    log_level: str = "INFO"
    # Port for Prometheus /metrics (0 = do not expose; the gateway serves it on its HTTP port).
    metrics_port: int = 0


class RedisSettings(CommonSettings):
    """The run's Redis, for the services that use it."""

    # Required: the launcher starts an embedded one when the user gives none.
    redis_url: str
    # Prefix of every Redis key, so several runs (or tests) can share one Redis.
    namespace: str = "tether"
