#!/bin/sh
# pip.sh PYTHON ARGS...: `PYTHON -m pip ARGS...` in a builder stage of docker/Dockerfile.
# What lies in docker/local (copied to /opt/local in the builder stages only, never into an image) is
# used when present: its wheels as find-links, its ca-certificates.crt as pip's CA bundle (a network
# that re-signs TLS). torch comes from TORCH_INDEX_URL (PyTorch's index: the cpu or a cu12x build)
# unless a torch wheel lies in docker/local; empty, pip looks on PyPI only.
set -eu
python=$1
shift
export PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
export PIP_FIND_LINKS=/opt/local
if [ -f /opt/local/ca-certificates.crt ]; then
  export PIP_CERT=/opt/local/ca-certificates.crt
fi
if [ -n "${TORCH_INDEX_URL:-}" ] && ! ls /opt/local/torch-*.whl >/dev/null 2>&1; then
  export PIP_EXTRA_INDEX_URL="$TORCH_INDEX_URL"
fi
exec "$python" -m pip "$@"
