#!/usr/bin/env bash
# Fills docker/local (docker/local/README.md) from this machine's pip settings, so that an image build
# here uses what pip on this machine uses: the CA bundle of PIP_CERT and the wheels in the PIP_FIND_LINKS
# folders. Hard links where possible (same filesystem), copies otherwise; idempotent.
# Usage: scripts/docker_local.sh [--clean]   (--clean empties docker/local first)
set -euo pipefail
cd "$(dirname "$0")/.."
dest=docker/local
if [ "${1:-}" = "--clean" ]; then
  find "$dest" -mindepth 1 ! -name README.md ! -name .gitignore -delete
fi
place() {  # place SRC NAME: hard link (or copy) SRC to docker/local/NAME unless it is there already
  if [ -e "$dest/$2" ] && cmp -s "$1" "$dest/$2"; then return; fi
  ln -f "$1" "$dest/$2" 2>/dev/null || cp -f "$1" "$dest/$2"
  echo "docker/local: $2"
}
cert=${PIP_CERT:-$(pip config get global.cert 2>/dev/null || true)}
if [ -n "$cert" ] && [ -f "$cert" ]; then
  place "$cert" ca-certificates.crt
fi
for dir in ${PIP_FIND_LINKS:-}; do
  dir=${dir#file://}
  [ -d "$dir" ] || continue
  for whl in "$dir"/*.whl; do
    [ -f "$whl" ] && place "$whl" "$(basename "$whl")"
  done
done
