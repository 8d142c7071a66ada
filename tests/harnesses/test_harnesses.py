"""Issue 10's proof: real agent harnesses, installed unchanged (scripts/harnesses.sh), run through one
`tether up` stack exactly as a user points them at a self-hosted OpenAI / Anthropic / Gemini-compatible
endpoint. Telemetry, update checks and other non-essential traffic are switched off with each harness's
own switches; nothing else is changed to suit the gateway. Each test is one group of two rollouts that
trains a step (harness_run.exercise says what is checked).

Configuration per harness, as a user types it: docs/harnesses.md.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from harness_run import (
    AIDER,
    MAX_MODEL_LEN,
    MAX_TOKENS,
    NPM_BIN,
    PY,
    TASK,
    Run,
    exercise,
    harness_env,
    run_harness,
)

AGENTS = Path(__file__).parent / "agents"


def gateway_root(ro: dict) -> str:
    """The gateway's root URL (Anthropic and Gemini SDKs append their own /v1/... or /v1beta/...)."""
    return ro["base_url"].removesuffix("/v1")


def exit_zero(run: Run) -> bool:
    return run.returncode == 0


# --- chat-completions harnesses --------------------------------------------------------------------


def test_opencode(stack, tmp_path):
    def launch(ro, home, work):
        # A custom OpenAI-compatible provider in the project's opencode.json (opencode's documented way).
        (work / "opencode.json").write_text(json.dumps({
            "$schema": "https://opencode.ai/config.json",
            "provider": {"tether": {
                "npm": "@ai-sdk/openai-compatible", "name": "Tether",
                "options": {"baseURL": ro["base_url"], "apiKey": ro["api_key"]},
                "models": {ro["model"]: {"name": ro["model"],
                                         "limit": {"context": MAX_MODEL_LEN, "output": MAX_TOKENS}}}}},
            "model": f"tether/{ro['model']}", "small_model": f"tether/{ro['model']}",
            "autoupdate": False, "share": "disabled"}))  # fmt: skip
        # No update check, no models.dev catalogue fetch, no LSP downloads, no sharing.
        env = harness_env(
            home,
            OPENCODE_DISABLE_AUTOUPDATE="1",
            OPENCODE_DISABLE_MODELS_FETCH="1",
            OPENCODE_DISABLE_LSP_DOWNLOAD="1",
            OPENCODE_DISABLE_SHARE="1",
        )
        return run_harness([str(NPM_BIN / "opencode"), "run", TASK], env, work)

    # `opencode run` exits 0 once the model's turn ends (its title call is a side call in the rollout).
    exercise(stack, "opencode", launch, tmp_path, exit_zero)


def test_qwen_code(stack, tmp_path):
    def launch(ro, home, work):
        (home / ".qwen").mkdir()
        (home / ".qwen" / "settings.json").write_text(
            json.dumps(
                {
                    "security": {"auth": {"selectedType": "openai"}},
                    "model": {
                        "name": ro["model"],
                        "generationConfig": {"samplingParams": {"max_tokens": MAX_TOKENS}},
                    },
                    "general": {"enableAutoUpdate": False},
                    "privacy": {"usageStatisticsEnabled": False},
                }
            )
        )
        env = harness_env(
            home, OPENAI_BASE_URL=ro["base_url"], OPENAI_API_KEY=ro["api_key"], OPENAI_MODEL=ro["model"]
        )
        return run_harness([str(NPM_BIN / "qwen"), "-p", TASK], env, work)

    # `qwen -p` exits 0 when the turn ends without a tool call.
    exercise(stack, "qwen-code", launch, tmp_path, exit_zero)


def _litellm_env(home: Path, **extra: str) -> dict[str, str]:
    # litellm fetches its model price list from GitHub at import unless told to use the bundled copy.
    return harness_env(home, LITELLM_LOCAL_MODEL_COST_MAP="True", **extra)


def test_mini_swe_agent(stack, tmp_path):
    def launch(ro, home, work):
        env = _litellm_env(home, OPENAI_API_KEY=ro["api_key"], MSWEA_CONFIGURED="true")
        return run_harness(
            [
                str(PY.parent / "mini"),
                "-m",
                f"openai/{ro['model']}",
                "-t",
                TASK,
                "-y",
                "--exit-immediately",
                # The default config plus a custom endpoint, as the local-models guide writes it (a model with
                # no price in litellm's list needs cost_tracking: ignore_errors).
                "-c",
                "mini.yaml",
                "-c",
                f"model.model_kwargs.api_base={ro['base_url']}",
                "-c",
                f"model.model_kwargs.max_tokens={MAX_TOKENS}",
                "-c",
                "model.cost_tracking=ignore_errors",
                "-c",
                "agent.step_limit=3",
                "-o",
                str(work / "trajectory.json"),
            ],
            env,
            work,
        )

    # mini ends after its step limit (or when the model submits): exit 0 either way.
    exercise(stack, "mini-swe-agent", launch, tmp_path, exit_zero)


def test_aider(stack, tmp_path):
    def launch(ro, home, work):
        (work / "notes.txt").write_text("3 + 4\n")
        # aider downloads litellm's model price list from GitHub once a day, with no switch to turn it
        # off; a fresh copy of the list litellm ships in aider's cache makes it skip the download.
        caches = home / ".aider" / "caches"
        caches.mkdir(parents=True)
        shutil.copy(
            next(
                AIDER.parent.parent.glob(
                    "lib/python3*/site-packages/litellm/model_prices_and_context_window_backup.json"
                )
            ),
            caches / "model_prices_and_context_window.json",
        )
        env = _litellm_env(home)
        return run_harness(
            [
                str(AIDER),
                "--model",
                f"openai/{ro['model']}",
                "--openai-api-base",
                ro["base_url"],
                "--openai-api-key",
                ro["api_key"],
                "--message",
                TASK,
                "--yes-always",
                "--no-git",
                "--no-check-update",
                "--analytics-disable",
                "--no-show-release-notes",
                "--no-show-model-warnings",
                "--no-pretty",
                "--no-fancy-input",
                "notes.txt",
            ],
            env,
            work,
        )

    # `aider --message` exits 0 after one exchange (aider itself sends no max_tokens).
    exercise(stack, "aider", launch, tmp_path, exit_zero)


def _python_agent(script: str):
    def launch(ro, home, work):
        env = _litellm_env(
            home,
            OPENAI_BASE_URL=ro["base_url"],
            OPENAI_API_KEY=ro["api_key"],
            MODEL=ro["model"],
            MAX_TOKENS=str(MAX_TOKENS),
        )
        return run_harness([str(PY), str(AGENTS / script), TASK], env, work)

    return launch


def test_langgraph(stack, tmp_path):
    exercise(stack, "langgraph", _python_agent("langgraph_agent.py"), tmp_path, exit_zero)


def test_pydantic_ai(stack, tmp_path):
    exercise(stack, "pydantic-ai", _python_agent("pydantic_ai_agent.py"), tmp_path, exit_zero)


def test_litellm(stack, tmp_path):
    exercise(stack, "litellm", _python_agent("litellm_agent.py"), tmp_path, exit_zero)


def test_smolagents_forced_tool_calls(stack, tmp_path):
    out = exercise(stack, "smolagents", _python_agent("smolagents_agent.py"), tmp_path, exit_zero)
    calls = [t for ts in out.traces.values() for t in ts]
    forced = [t for t in calls if t["request"].get("tool_choice") == "required"]
    # Every agent step forces a tool call; vLLM writes it under a grammar.
    assert forced, [t["request"].get("tool_choice") for t in calls]
    # Under the grammar vLLM reports the masked distribution's logprobs (forced tokens: 0.0), not the
    # policy's. The tokens the grammar constrained are found and kept out of the loss (counted), so
    # what the trainer does train on matches vLLM (docs/merging.md, "Constrained decoding"): before
    # that, this step's train/rollout mismatch was 7.7 nats per token.
    assert out.step is not None and out.step["constrained_tokens_masked"] > 0, out.step
    assert out.step["logprob_abs_diff"] <= 1e-3, out.step


# --- harnesses that need the gateway changes in flight (Messages extras, Responses extras, Gemini) --


def test_claude_code(stack, tmp_path):
    def launch(ro, home, work):
        env = harness_env(
            home,
            ANTHROPIC_BASE_URL=gateway_root(ro),
            ANTHROPIC_API_KEY=ro["api_key"],
            ANTHROPIC_MODEL=ro["model"],
            ANTHROPIC_SMALL_FAST_MODEL=ro["model"],
            ANTHROPIC_DEFAULT_HAIKU_MODEL=ro["model"],
            CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
            DISABLE_TELEMETRY="1",
            DISABLE_AUTOUPDATER="1",
        )
        return run_harness([str(NPM_BIN / "claude"), "-p", TASK, "--max-turns", "3"], env, work)

    # `claude -p` exits 0 when the turn ends, 1 with "max turns" when the model keeps calling tools.
    def exit_ok(run: Run) -> bool:
        return run.returncode == 0 or (
            run.returncode == 1 and "max turns" in (run.stdout + run.stderr).lower()
        )

    exercise(stack, "claude-code", launch, tmp_path, exit_ok)


def test_codex(stack, tmp_path):
    def launch(ro, home, work):
        codex_home = home / ".codex"
        codex_home.mkdir()
        # A custom model provider (Codex's config.toml), the Responses wire API (Codex refuses "chat").
        (codex_home / "config.toml").write_text(
            f'model = "{ro["model"]}"\nmodel_provider = "tether"\ncheck_for_update_on_startup = false\n'
            f'[model_providers.tether]\nname = "Tether"\nbase_url = "{ro["base_url"]}"\n'
            'env_key = "TETHER_API_KEY"\nwire_api = "responses"\n[analytics]\nenabled = false\n'
        )
        env = harness_env(home, CODEX_HOME=str(codex_home), TETHER_API_KEY=ro["api_key"])
        return run_harness(
            [str(NPM_BIN / "codex"), "exec", "--skip-git-repo-check", "--sandbox", "read-only", TASK],
            env,
            work,
        )

    # `codex exec` exits 0 when the turn completes.
    exercise(stack, "codex", launch, tmp_path, exit_zero)


def test_gemini_cli(stack, tmp_path):
    def launch(ro, home, work):
        (home / ".gemini").mkdir()
        (home / ".gemini" / "settings.json").write_text(
            json.dumps(
                {
                    "security": {"auth": {"selectedType": "gemini-api-key"}},
                    "model": {"name": ro["model"]},
                    "general": {"disableAutoUpdate": True, "disableUpdateNag": True},
                    "privacy": {"usageStatisticsEnabled": False},
                    "telemetry": {"enabled": False},
                }
            )
        )
        # Headless runs must trust the folder (Gemini CLI's documented switch for automation).
        env = harness_env(
            home,
            GOOGLE_GEMINI_BASE_URL=gateway_root(ro),
            GEMINI_API_KEY=ro["api_key"],
            GEMINI_CLI_TRUST_WORKSPACE="true",
        )
        return run_harness([str(NPM_BIN / "gemini"), "-p", TASK], env, work)

    # `gemini -p` exits 0 when the turn ends.
    exercise(stack, "gemini-cli", launch, tmp_path, exit_zero)
