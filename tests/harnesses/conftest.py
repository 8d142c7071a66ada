"""One `tether up` stack for the whole harness session, serving a long-context copy of the tiny
calculator model, and the installed harnesses (scripts/harnesses.sh)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from harness_run import HARNESSES, MAX_MODEL_LEN, HarnessStack, long_context_model
from stack_helpers import TETHER


def pytest_collection_modifyitems(items):
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.harness)
            item.add_marker(pytest.mark.slow)


# The part of scripts/harnesses.sh each test needs (its stamp: HARNESSES/.installed-PART); `make test`
# installs node and npm-core, `make test-all` every part.
PARTS = {
    "test_claude_code": "npm-core",
    "test_codex": "npm-core",
    "test_gemini_cli": "npm-core",
    "test_opencode": "npm-more",
    "test_qwen_code": "npm-more",
    "test_aider": "aider",
}


@pytest.fixture(autouse=True)
def installed(request) -> None:
    """The test's harness is installed. Missing is a failure, not a skip: setup installs it."""
    part = PARTS.get(request.node.originalname, "py")
    for stamp in ("node", part):
        if not (HARNESSES / f".installed-{stamp}").exists():
            pytest.fail(
                f"harness part {stamp!r} is not installed in {HARNESSES}: run scripts/harnesses.sh all"
            )


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """`tether up` in a temporary directory, for the harness tests' module only (a session-scoped one
    idled beside every later test of the run). TETHER_HARNESS_STACK=DIR reuses a stack already started
    in DIR the same way (for working on one harness without waiting for vLLM)."""
    from tether.cli import prepare_calculator_model

    reuse = os.environ.get("TETHER_HARNESS_STACK")
    if reuse:
        root = Path(reuse).resolve()
        state = json.loads((root / ".tether" / "stack.json").read_text())
        run_dir = Path(state["run_dir"])
        yield HarnessStack(
            gateway=state["addresses"]["gateway_url"], cwd=root, run_dir=run_dir, log_dir=run_dir / "logs"
        )
        return
    root = tmp_path_factory.mktemp("harness-stack")
    model = long_context_model(prepare_calculator_model(0), root / "long-model", MAX_MODEL_LEN)
    run_dir = root / "run"
    log_path = root / "up.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [*TETHER, "up", "--model", str(model), "--max-model-len", str(MAX_MODEL_LEN), "--group-size", "2",
         "--run-dir", str(run_dir)],
        cwd=root, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    state_file = root / ".tether" / "stack.json"
    try:
        deadline = time.monotonic() + 900
        while True:
            if proc.poll() is not None:
                pytest.fail(f"tether up exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
            if "gateway:" in log_path.read_text() and state_file.exists():
                break
            if time.monotonic() > deadline:
                pytest.fail(f"the stack did not come up in 900 s:\n{log_path.read_text()[-4000:]}")
            time.sleep(1)
        state = json.loads(state_file.read_text())
        gw = state["addresses"]["gateway_url"]
        httpx.get(f"{gw}/health", timeout=10).raise_for_status()
        yield HarnessStack(gateway=gw, cwd=root, run_dir=run_dir, log_dir=run_dir / "logs")
    finally:
        down = subprocess.run([*TETHER, "down"], cwd=root, capture_output=True, text=True, timeout=120)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait(timeout=10)
        log.close()
        print(down.stdout, down.stderr, file=sys.stderr)
