"""A gateway that listens beyond loopback refuses to start without an admin token (anyone could
create rollouts and have the model trained on what they send), unless told an open gateway is meant."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from tether.common.net import is_loopback
from tether.common.settings import SETTINGS_REFUSED
from tether.gateway.main import GatewaySettings

BASE = {"redis_url": "redis://127.0.0.1:1/0", "vllm_url": "http://127.0.0.1:1"}


@pytest.mark.parametrize("host", ["127.0.0.1", "127.8.9.10", "localhost", "::1", "[::1]"])
def test_loopback_needs_no_admin_token(host):
    assert is_loopback(host)
    assert GatewaySettings(**BASE, gateway_host=host).admin_token is None


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "gateway.example.com"])
def test_beyond_loopback_without_a_token_is_refused(host):
    assert not is_loopback(host)
    with pytest.raises(ValidationError, match="beyond loopback without an admin token"):
        GatewaySettings(**BASE, gateway_host=host)
    assert GatewaySettings(**BASE, gateway_host=host, admin_token="t0ken").admin_token == "t0ken"
    assert GatewaySettings(**BASE, gateway_host=host, allow_open_admin=True).allow_open_admin


def test_the_process_refuses_with_the_settings_status_and_says_why():
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("TETHER_")},
        "PYTHONPATH": str(Path(__file__).resolve().parent.parent / "services"),
        "TETHER_REDIS_URL": BASE["redis_url"],
        "TETHER_VLLM_URL": BASE["vllm_url"],
        "TETHER_GATEWAY_HOST": "0.0.0.0",
    }
    res = subprocess.run(
        [sys.executable, "-m", "tether.gateway"], env=env, capture_output=True, text=True, timeout=60
    )
    assert res.returncode == SETTINGS_REFUSED, res.stderr
    assert "TETHER_ADMIN_TOKEN" in res.stderr
