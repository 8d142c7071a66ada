"""Secure by default locally: every stack the launcher starts writes a service token of its own
(`.tether/service-token`, mode 0600) and every process it starts requires it, so another local user's
process cannot call the stack's gRPC methods (health aside). A token the user exports is used instead,
and nothing is written. Real gateway processes started by the launcher, as `tether up` starts them,
in front of the vLLM look-alike; `tests/test_up.py` checks every service of a whole `tether up`."""

from __future__ import annotations

import json
import os
import stat
import subprocess

import grpc
import pytest
from gateway_helpers import ADMIN
from stack_helpers import TETHER, assert_every_method_needs_the_token, call_codes, service_methods

from tether.common.grpc_server import TOKEN_ENV, TOKEN_FILE_ENV, service_token, token_given, write_token_file
from tether.common.net import free_port
from tether.launcher import Stack, start_gateways, wait_gateways


def test_the_token_file_is_its_owners_alone_whatever_the_umask(tmp_path):
    old = os.umask(0)  # a umask that would leave a plain new file readable and writable by anyone
    try:
        first = write_token_file(tmp_path / ".tether" / "service-token")
        mode = stat.S_IMODE((tmp_path / ".tether" / "service-token").stat().st_mode)
        second = write_token_file(tmp_path / ".tether" / "service-token")  # replaced: a new stack
    finally:
        os.umask(old)
    assert mode == 0o600
    assert stat.S_IMODE((tmp_path / ".tether" / "service-token").stat().st_mode) == 0o600
    assert len(first) >= 43 and first != second  # 256 random bits each, URL-safe
    assert service_token({TOKEN_FILE_ENV: str(tmp_path / ".tether" / "service-token")}) == second
    assert sorted(p.name for p in (tmp_path / ".tether").iterdir()) == ["service-token"]  # no temporary left


def test_a_token_the_user_gave_is_theirs_even_when_the_other_variable_is_empty():
    assert not token_given({})
    assert not token_given({TOKEN_ENV: "", TOKEN_FILE_ENV: "  "})
    assert token_given({TOKEN_ENV: "mine"})
    assert token_given({TOKEN_FILE_ENV: "/run/secrets/token"})


def _gateway_stack(tmp_path, redis_port, vllm_url) -> Stack:
    """One gateway process, started by the launcher with the stack's state in tmp_path/.tether."""
    stack = Stack(
        run_dir=tmp_path / "run",
        namespace=f"tok{free_port()}",
        state_file=tmp_path / ".tether" / "stack.json",
    )
    stack.redis_url = f"redis://127.0.0.1:{redis_port}/0"
    env = {"TETHER_VLLM_URL": vllm_url, "TETHER_ADMIN_TOKEN": ADMIN, "TETHER_LOG_LEVEL": "WARNING"}
    controls = start_gateways(stack, 1, free_port(), env)
    wait_gateways(stack, controls, 120)
    return stack


def test_a_stack_requires_its_own_token_and_removes_it_when_stopped(tmp_path, redis_port, vllm, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.delenv(TOKEN_FILE_ENV, raising=False)
    stack = _gateway_stack(tmp_path, redis_port, vllm.url)
    token_file = tmp_path / ".tether" / "service-token"
    try:
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        token = token_file.read_text().strip()
        state_text = (tmp_path / ".tether" / "stack.json").read_text()
        assert json.loads(state_text)["service_token_file"] == str(token_file.resolve())
        assert token not in state_text  # the state names the file, never the token
        assert_every_method_needs_the_token({"gateway_grpc": stack.addresses["gateway_grpc"]}, token)
        # `tether health` needs no token (probes cannot send one), run from where the stack runs.
        health = subprocess.run(
            [*TETHER, "health", "--grpc", stack.addresses["gateway_grpc"]],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert health.returncode == 0, health.stderr
    finally:
        stack.stop(grace_s=10)
    assert not token_file.exists()


def test_a_token_the_user_exported_is_used_and_none_is_written(tmp_path, redis_port, vllm, monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "the-users-own-token-0123456789")
    stack = _gateway_stack(tmp_path, redis_port, vllm.url)
    try:
        assert not (tmp_path / ".tether" / "service-token").exists()
        assert json.loads((tmp_path / ".tether" / "stack.json").read_text())["service_token_file"] == ""
        address = stack.addresses["gateway_grpc"]
        methods = service_methods("gateway_pb2", "GatewayControl")
        assert set(call_codes(address, methods).values()) == {grpc.StatusCode.UNAUTHENTICATED}
        read = [m for m in methods if m[0].endswith("/GetAdmission")]
        assert call_codes(address, read, "the-users-own-token-0123456789") == {read[0][0]: grpc.StatusCode.OK}
    finally:
        stack.stop(grace_s=10)


@pytest.mark.parametrize("given", [False, True])
def test_tether_agent_serves_with_the_stacks_token(tmp_path, monkeypatch, given):
    """`tether agent` beside a stack: its worker's gRPC server takes the stack's token from the state
    (unless the user exported one), as the stack's own processes do."""
    from tether.cli.stack import use_stack_token

    monkeypatch.delenv(TOKEN_FILE_ENV, raising=False)
    if given:
        monkeypatch.setenv(TOKEN_ENV, "mine")
    else:
        monkeypatch.delenv(TOKEN_ENV, raising=False)
    path = tmp_path / "service-token"
    write_token_file(path)
    use_stack_token({"service_token_file": str(path)})
    assert service_token() == ("mine" if given else path.read_text().strip())
