#!/usr/bin/env bash
# Each extra installs alone into a fresh venv and its service starts, the way the per-service images
# are built: one wheel (what `pip install .` builds, non-editable), then per extra a new venv with
# `pip install "<wheel>[<extra>]"` and its full dependency resolution; the torch-free extras must not
# bring torch, transformers or matplotlib in; then `python -m tether.<service> --help` must exit 0
# with no TETHER_* variable set (it lists the settings), and `tether health` must run (the images'
# HEALTHCHECK, on the core alone).
# Usage: scripts/check_extras.sh [EXTRA ...]   (default: the core alone and every service extra, cli)
#   PYTHON (default python3), TETHER_EXTRAS_DIR (default a new /tmp folder, removed at the end).
# tests/test_extras.py runs it (marked slow: a few minutes, mostly installing torch twice).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
EXTRAS=("$@")
[ ${#EXTRAS[@]} -gt 0 ] || EXTRAS=(core gateway merger scheduler inference agents runhost trainer cli)
if [ -n "${TETHER_EXTRAS_DIR:-}" ]; then
  WORK=$TETHER_EXTRAS_DIR
  mkdir -p "$WORK"
else
  WORK=$(mktemp -d /tmp/tether-extras.XXXXXX)
  trap 'rm -rf "$WORK"' EXIT
fi
HEAVY="torch transformers matplotlib"
# No .pyc compilation at install: the services compile what they import on start; the check stays fast.
PIP_FLAGS=(-q --no-compile --disable-pip-version-check)

t0=$SECONDS
"$PYTHON" -m pip wheel -q --disable-pip-version-check --no-deps -w "$WORK/dist" . >"$WORK/wheel.log" 2>&1 ||
  { cat "$WORK/wheel.log"; exit 1; }
rm -rf build services/*.egg-info
wheel=$(ls "$WORK"/dist/tether_rl-*.whl)
echo "check_extras: built $(basename "$wheel") in $((SECONDS - t0))s"

failed=0
for extra in "${EXTRAS[@]}"; do
  t=$SECONDS
  venv="$WORK/venv-$extra"
  rm -rf "$venv"
  # A venv without its own pip: this pip installs into it (--python), the resolution is the same.
  "$PYTHON" -m venv --without-pip "$venv"
  py="$venv/bin/python"
  spec="$wheel"
  [ "$extra" = core ] || spec="$wheel[$extra]"
  if ! "$PYTHON" -m pip --python "$py" install "${PIP_FLAGS[@]}" "$spec" >"$venv.log" 2>&1; then
    echo "check_extras: FAIL [$extra]: pip install failed:"; grep -v "is ignored: it is neither" "$venv.log" | tail -20
    failed=1; continue
  fi
  case $extra in
    gateway | merger | scheduler | inference | agents | runhost | core)
      present=$("$py" -c "import importlib.util as u, sys; print(' '.join(m for m in sys.argv[1:] if u.find_spec(m)))" $HEAVY)
      if [ -n "$present" ]; then
        echo "check_extras: FAIL [$extra]: installs $present"; failed=1; continue
      fi ;;
  esac
  # What starts: the service's --help (it imports every module main wires), the tether command's, or
  # for the bare core the shared modules every service builds on.
  case $extra in
    core) cmd=("$py" -c "import tether.common.settings, tether.common.logs, tether.common.net, \
tether.common.grpc_server, tether.common.records, tether.common.broker, tether.common.usage, \
tether.v1.gateway_pb2_grpc, tether.v1.inference_pb2_grpc, tether.v1.merger_pb2_grpc, \
tether.v1.scheduler_pb2_grpc, tether.v1.trainer_pb2_grpc, tether.algorithms") ;;
    cli) cmd=("$venv/bin/tether" --help) ;;
    *) cmd=("$py" -m "tether.$extra" --help) ;;
  esac
  if ! out=$(cd "$WORK" && env -u PYTHONPATH $(env | grep -o '^TETHER_[A-Z0-9_]*' | sed 's/^/-u /') "${cmd[@]}" 2>&1); then
    echo "check_extras: FAIL [$extra]: ${cmd[*]##*/} exited non-zero:"; echo "$out" | tail -20; failed=1; continue
  fi
  if [ "$extra" != core ] && [ "$extra" != cli ] && ! grep -q "TETHER_LOG_LEVEL" <<<"$out"; then
    echo "check_extras: FAIL [$extra]: --help lists no settings:"; echo "$out" | tail -20; failed=1; continue
  fi
  # `tether health` (every image's HEALTHCHECK) runs on the core alone: against a closed port it must
  # report the service unhealthy (exit 1, one line), not fail to import.
  health=$(cd "$WORK" && env -u PYTHONPATH "$venv/bin/tether" health --grpc 127.0.0.1:1 --timeout 1 2>&1) && rc=0 || rc=$?
  if [ "$rc" != 1 ] || ! grep -q "^unhealthy: gRPC" <<<"$health"; then
    echo "check_extras: FAIL [$extra]: tether health exited $rc:"; echo "$health" | tail -20; failed=1; continue
  fi
  size=$(du -sm "$venv" | cut -f1)
  echo "check_extras: ok [$extra] in $((SECONDS - t))s (venv ${size} MB)"
  rm -rf "$venv"
done
echo "check_extras: $([ $failed = 0 ] && echo passed || echo FAILED) in $((SECONDS - t0))s"
exit $failed
