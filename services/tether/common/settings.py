"""Settings shared by every service. Each service subclasses `CommonSettings` with its own prefix."""

from __future__ import annotations

from pydantic_settings import BaseSettings, SettingsConfigDict


class CommonSettings(BaseSettings):
    """Values every service reads from the environment (TETHER_*)."""

    model_config = SettingsConfigDict(env_prefix="TETHER_", extra="ignore")

    # Redis of the run. Required: the launcher starts an embedded one when the user gives none.
    redis_url: str
    # Prefix of every Redis key, so several runs (or tests) can share one Redis.
    namespace: str = "tether"
    log_level: str = "INFO"
    # Port for Prometheus /metrics (0 = do not expose; the gateway serves it on its HTTP port).
    metrics_port: int = 0
