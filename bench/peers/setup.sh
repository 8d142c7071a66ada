#!/usr/bin/env bash
# Install the peers that bench/gateway_overhead measures beside Tether's gateway, each in its own venv
# outside the repository (installed from PyPI and run; none of their code is copied here):
#   agentlightning==1.0.2      (its gateway, `agl-server`; needs Python >= 3.12)
#   litellm[proxy]==1.108.7    (the LiteLLM proxy: `litellm --config ...`)
# Idempotent: a venv whose pinned package is already installed is left as it is.
# Usage: bench/peers/setup.sh [agentlightning|litellm ...]   (default: both)
# Venvs go under $TETHER_PEERS_DIR (default ~/.cache/tether/peers); bench/gateway_overhead looks there too.
set -euo pipefail

PEERS_DIR="${TETHER_PEERS_DIR:-$HOME/.cache/tether/peers}"
AL_VERSION=1.0.2
LITELLM_VERSION=1.108.7

pick_python() {  # the first interpreter that is at least $1 (e.g. 3.12): on PATH, then pyenv's, then uv's
    local want="$1" py
    local candidates=(python3 python3.12 python3.13 python3.14)
    if command -v pyenv >/dev/null 2>&1; then
        candidates+=("$(pyenv root)"/versions/3.1[2-9]*/bin/python3)
    fi
    if command -v uv >/dev/null 2>&1; then
        candidates+=("$(uv python find "$want" 2>/dev/null || true)")
    fi
    for py in "${candidates[@]}"; do
        [ -n "$py" ] || continue
        if command -v "$py" >/dev/null 2>&1 &&
            "$py" -c "import sys; sys.exit(sys.version_info < tuple(map(int, '$want'.split('.'))))" 2>/dev/null; then
            command -v "$py"
            return 0
        fi
    done
    return 1
}

install_peer() {  # name, minimum python, pinned requirement, distribution name, version
    local name="$1" minpy="$2" req="$3" dist="$4" version="$5" venv="$PEERS_DIR/$1" py
    if [ -x "$venv/bin/python" ] &&
        [ "$("$venv/bin/python" -c "import importlib.metadata as m; print(m.version('$dist'))" 2>/dev/null)" = "$version" ]; then
        echo "peers: $name $version already in $venv"
        return 0
    fi
    if ! py="$(pick_python "$minpy")"; then
        echo "peers: $name needs Python >= $minpy, none found on PATH; skipped" >&2
        return 1
    fi
    echo "peers: installing $req into $venv ($("$py" --version))"
    rm -rf "$venv"
    "$py" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
    # Neither peer needs torch; should a dependency ever pull it, take the pinned CPU build rather
    # than let pip fetch a multi-GB CUDA one.
    local pins="$venv/constraints.txt"
    echo "torch==2.13.0" >"$pins"
    "$venv/bin/python" -m pip install -q -c "$pins" "$req"
    "$venv/bin/python" -c "import importlib.metadata as m; print('peers: $name', m.version('$dist'))"
}

want=("$@")
[ ${#want[@]} -eq 0 ] && want=(agentlightning litellm)
status=0
for peer in "${want[@]}"; do
    case "$peer" in
        agentlightning) install_peer agentlightning 3.12 "agentlightning==$AL_VERSION" agentlightning "$AL_VERSION" || status=1 ;;
        litellm) install_peer litellm 3.11 "litellm[proxy]==$LITELLM_VERSION" litellm "$LITELLM_VERSION" || status=1 ;;
        *) echo "peers: unknown peer $peer (agentlightning, litellm)" >&2; status=2 ;;
    esac
done
exit $status
