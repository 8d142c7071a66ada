"""Claude Code and Codex as shipped: request bodies shaped like the captures in docs/harnesses.md ("As run
by the suite") go through the gateway against the vLLM look-alike. Each test checks the chat body
vLLM received, the trace's adjustments (what the gateway ignored or dropped), and that a field which
would change generation is still a 400 naming it. Real vLLM: test_sdk_harness_shapes.py.
"""

from __future__ import annotations

import copy
import json

import httpx
import orjson
import pytest
from fakes.vllm_openai import LOGPROBS, MODEL, PROMPT_IDS, TOKEN_IDS, TOOL_ARGS
from gateway_helpers import assert_openai_error, bearer, wait_traces

from tether.gateway.messages import parse_messages_request
from tether.gateway.responses import ResponsesStream, parse_responses_request

CLAUDE_CODE_BETA = (
    "claude-code-20250219,interleaved-thinking-2025-05-14,thinking-token-count-2026-05-13,"
    "context-management-2025-06-27,prompt-caching-scope-2026-01-05,"
    "mid-conversation-system-2026-04-07,effort-2025-11-24"
)
EPHEMERAL = {"type": "ephemeral"}


def _schema(**props: str) -> dict:
    return {
        "type": "object",
        "properties": {k: {"type": v} for k, v in props.items()},
        "required": list(props),
        "additionalProperties": False,
        "$schema": "http://json-schema.org/draft-07/schema#",
    }


CC_TOOLS = [
    {"name": "Bash", "description": "Executes a bash command", "input_schema": _schema(command="string")},
    {"name": "Read", "description": "Reads a file", "input_schema": _schema(file_path="string")},
    {
        "name": "Edit",
        "description": "Edits a file",
        "input_schema": _schema(file_path="string", old_string="string", new_string="string"),
    },
    {
        "name": "Glob",
        "description": "Finds files",
        "input_schema": _schema(pattern="string"),
        "cache_control": EPHEMERAL,
    },
    {"type": "web_search_20250305", "name": "web_search", "max_uses": 8},
]


def claude_code_body(last: str = "what is 3 + 4 ?") -> dict:
    """What Claude Code 2.1 sends (`claude -p`), abridged: its system blocks, tools, thinking and
    context-management settings, and a conversation with a thinking block and a mid-conversation
    system message."""
    return {
        "model": MODEL,
        "max_tokens": 32000,
        "stream": True,
        "metadata": {"user_id": "user_5e1f_account__session_0c3a"},
        "system": [
            {"type": "text", "text": "You are Claude Code.", "cache_control": EPHEMERAL},
            {"type": "text", "text": "Answer briefly.", "cache_control": EPHEMERAL},
        ],
        "tools": CC_TOOLS,
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "add"},
                    {"type": "text", "text": "3 and 4", "cache_control": EPHEMERAL},
                ],
            },
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "use Bash", "signature": "c2lnbmVk"},
                    {"type": "redacted_thinking", "data": "ZW5jcnlwdGVk"},
                    {"type": "text", "text": "adding"},
                    {"type": "tool_use", "id": "toolu_01", "name": "Bash", "input": {"command": "echo 7"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_01",
                        "cache_control": EPHEMERAL,
                        "content": [{"type": "text", "text": "7", "cache_control": EPHEMERAL}],
                    }
                ],
            },
            {"role": "system", "content": [{"type": "text", "text": "Available agents: none"}]},
            {"role": "user", "content": last},
        ],
    }


CC_CHAT_MESSAGES = [
    {
        "role": "system",
        "content": [
            {"type": "text", "text": "You are Claude Code."},
            {"type": "text", "text": "Answer briefly."},
        ],
    },
    {"role": "user", "content": [{"type": "text", "text": "add"}, {"type": "text", "text": "3 and 4"}]},
    {
        "role": "assistant",
        "content": "adding",
        "tool_calls": [
            {
                "id": "toolu_01",
                "type": "function",
                "function": {"name": "Bash", "arguments": '{"command":"echo 7"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "toolu_01", "content": "7"},
    {"role": "system", "content": "Available agents: none"},
    {"role": "user", "content": "what is 3 + 4 ?"},
]
CC_ADJUSTMENTS = {
    "chat_template_kwargs": {"enable_thinking": True},
    "ignored": ["cache_control", "context_management", "metadata", "output_config.effort"],
    "dropped_tools": [{"type": "web_search_20250305", "name": "web_search"}],
    "dropped_blocks": {"thinking": 1, "redacted_thinking": 1},
}


def cc_headers(key: str) -> dict:
    return {
        "x-api-key": key,
        "anthropic-version": "2023-06-01",
        "anthropic-beta": CLAUDE_CODE_BETA,
        "x-app": "cli",
        "user-agent": "claude-cli/2.1.197 (external, cli)",
    }


def sse_events(text: str) -> list[tuple[str, dict]]:
    out = []
    for frame in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in frame.split("\n"))
        out.append((lines["event"], json.loads(lines["data"])))
    return out


def assert_exact(trace: dict, api: str) -> None:
    assert trace["status"] == "ok", trace["error"]
    assert trace["api"] == api and trace["prompt_token_ids"] == PROMPT_IDS
    assert trace["response_token_ids"] == TOKEN_IDS and trace["response_logprobs"] == LOGPROBS


# --- Claude Code ----------------------------------------------------------------------------------


def test_claude_code_request_translates():
    req = parse_messages_request(orjson.dumps(claude_code_body()), MODEL)
    assert req.chat["messages"] == CC_CHAT_MESSAGES
    assert [t["function"]["name"] for t in req.chat["tools"]] == ["Bash", "Read", "Edit", "Glob"]
    assert req.chat["max_tokens"] == 32000 and req.chat["chat_template_kwargs"] == {"enable_thinking": True}
    assert req.adjustments == CC_ADJUSTMENTS


@pytest.mark.parametrize(
    ("thinking", "enable", "ignored"),
    [
        ({"type": "enabled", "budget_tokens": 1024}, True, ["thinking.budget_tokens"]),
        ({"type": "adaptive"}, True, []),
        ({"type": "disabled"}, False, []),
        ({"type": "interleaved-2027"}, None, ["thinking"]),  # a type this gateway does not know yet
    ],
)
def test_every_thinking_type_is_accepted(thinking, enable, ignored):
    body = {"max_tokens": 8, "thinking": thinking, "messages": [{"role": "user", "content": "x"}]}
    req = parse_messages_request(orjson.dumps(body), MODEL)
    assert req.chat.get("chat_template_kwargs") == (None if enable is None else {"enable_thinking": enable})
    assert req.adjustments.get("ignored", []) == ignored


def test_claude_code_streamed_through_the_gateway(gw, rdb, vllm):
    assert gw.http.head("/").status_code == 200  # Claude Code's first probe
    rollout = gw.new_rollout()
    assert gw.http.head(f"/rollouts/{rollout['rollout_id']}").status_code == 200
    resp = gw.http.post("/v1/messages", json=claude_code_body(), headers=cc_headers(rollout["api_key"]))
    assert resp.status_code == 200, resp.text
    events = sse_events(resp.text)
    assert events[0][0] == "message_start" and events[-1][0] == "message_stop"
    assert events[-2][1]["delta"]["stop_reason"] == "end_turn"

    sent = vllm.requests[-1]
    # Claude Code asks for 32000 whatever the prompt: clamped to the served context (512 here).
    assert sent["messages"] == CC_CHAT_MESSAGES and sent["stream"] is True and sent["max_tokens"] == 512
    assert sent["chat_template_kwargs"] == {"enable_thinking": True}
    assert [t["function"]["name"] for t in sent["tools"]] == ["Bash", "Read", "Edit", "Glob"]
    assert not {"metadata", "thinking", "context_management", "output_config", "system"} & set(sent)
    [trace] = wait_traces(rdb, gw.keys, rollout["rollout_id"])
    assert_exact(trace, "anthropic.messages")
    limit = trace["adjustments"].pop("max_tokens")
    assert (limit["requested"], limit["reason"]) == (32000, "clamped_to_context")
    assert trace["adjustments"] == CC_ADJUSTMENTS and trace["request"] == claude_code_body()


def test_claude_code_tool_call_comes_back_as_tool_use(gw, rdb):
    rollout = gw.new_rollout()
    resp = gw.http.post(
        "/v1/messages", json=claude_code_body("use-tool"), headers=cc_headers(rollout["api_key"])
    )
    starts = [d["content_block"] for e, d in sse_events(resp.text) if e == "content_block_start"]
    assert starts == [{"type": "tool_use", "id": "chatcmpl-tool-fake1", "name": "Bash", "input": {}}]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"top_a": 0.2}, "top_a"),  # unknown to the gateway: it might change generation
        ({"output_config": {"effort": "high", "verbosity": "low"}}, "output_config.verbosity"),
        ({"container": "c_1"}, "container"),
    ],
)
def test_claude_code_unknown_generation_fields_are_400(gw, extra, param):
    rollout = gw.new_rollout()
    resp = gw.http.post(
        "/v1/messages", json={**claude_code_body(), **extra}, headers=cc_headers(rollout["api_key"])
    )
    assert resp.status_code == 400, resp.text
    body = resp.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert f"'{param}'" in body["error"]["message"]


# --- Codex ----------------------------------------------------------------------------------------

EXEC = {
    "type": "function",
    "name": "exec_command",
    "description": "Runs a shell command",
    "strict": False,
    "parameters": _schema(cmd="string"),
}
PLAN = {
    "type": "function",
    "name": "update_plan",
    "description": "Updates the plan",
    "strict": False,
    "parameters": _schema(explanation="string"),
}
COLLABORATION = {
    "type": "namespace",
    "name": "collaboration",
    "description": "Tools in the collaboration namespace.",
    "tools": [
        {
            "type": "function",
            "name": "spawn_agent",
            "description": "Spawns an agent",
            "strict": False,
            "parameters": _schema(message="string"),
        },
        {
            "type": "function",
            "name": "wait",
            "description": "Waits for agents",
            "strict": False,
            "parameters": _schema(ids="array"),
        },
    ],
}
WEB_SEARCH = {"type": "web_search", "external_web_access": False}
APPLY_PATCH = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Edits files with a patch",
    "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "*** Begin Patch" /.+/'},
}


def codex_body(last: str = "what is 3 + 4 ?", tools: list | None = None) -> dict:
    """What Codex CLI 0.171 sends (`codex exec`, a custom model provider with wire_api = "responses")."""
    return {
        "model": MODEL,
        "instructions": "You are Codex.",
        "stream": True,
        "store": False,
        "input": [
            {
                "type": "message",
                "role": "developer",
                "content": [{"type": "input_text", "text": "sandbox: none"}],
            },
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "# AGENTS.md"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": last}]},
        ],
        "tools": [EXEC, PLAN, COLLABORATION, WEB_SEARCH] if tools is None else tools,
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "reasoning": {"summary": "auto"},
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "0199a6c1-5a1e-7c02-9d6e-3f1b2c4d5e6f",
        "client_metadata": {
            "session_id": "s-1",
            "thread_id": "t-1",
            "turn_id": "u-1",
            "installation_id": "i-1",
        },
    }


CODEX_IGNORED = ["client_metadata", "include", "prompt_cache_key", "reasoning.summary", "store"]


def test_codex_request_translates():
    req = parse_responses_request(orjson.dumps(codex_body()), MODEL)
    assert req.chat["messages"] == [
        {"role": "system", "content": "You are Codex."},
        {"role": "system", "content": "sandbox: none"},
        {"role": "user", "content": "# AGENTS.md"},
        {"role": "user", "content": "what is 3 + 4 ?"},
    ]
    assert req.chat["tools"] == [
        {
            "type": "function",
            "function": {
                "name": t["name"],
                "parameters": t["parameters"],
                "description": t["description"],
                "strict": False,
            },
        }
        for t in [EXEC, PLAN, *COLLABORATION["tools"]]
    ]
    assert req.chat["tool_choice"] == "auto" and req.chat["parallel_tool_calls"] is True
    assert "reasoning_effort" not in req.chat
    assert req.adjustments == {
        "ignored": CODEX_IGNORED,
        "dropped_tools": [{"type": "web_search", "name": None}],
    }


def test_codex_history_items_map_back():
    """A later turn: Codex replays reasoning (encrypted, OpenAI's), namespaced and freeform calls and
    their outputs. Names clash across namespaces, so the clashing member gets the namespace prefix."""
    body = codex_body(
        tools=[
            EXEC,
            COLLABORATION,
            APPLY_PATCH,
            WEB_SEARCH,
            {
                "type": "namespace",
                "name": "mcp__files",
                "tools": [
                    {"type": "function", "name": "wait", "parameters": _schema()},
                    {"type": "image_generation"},
                ],
            },
        ]
    )
    body["input"] += [
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAAA..."},
        {
            "type": "function_call",
            "namespace": "collaboration",
            "name": "spawn_agent",
            "call_id": "call_1",
            "arguments": '{"message":"go"}',
        },
        {
            "type": "function_call",
            "namespace": "mcp__files",
            "name": "wait",
            "call_id": "call_2",
            "arguments": "{}",
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "spawned"},
        {"type": "function_call_output", "call_id": "call_2", "output": "done"},
        {
            "type": "custom_tool_call",
            "call_id": "call_3",
            "name": "apply_patch",
            "input": "*** Begin Patch\n",
        },
        {"type": "custom_tool_call_output", "call_id": "call_3", "output": "Success"},
        {"type": "web_search_call", "id": "ws_1", "status": "completed", "action": {"type": "search"}},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "next"}]},
    ]
    req = parse_responses_request(orjson.dumps(body), MODEL)
    names = [t["function"]["name"] for t in req.chat["tools"]]
    assert names == ["exec_command", "spawn_agent", "collaboration__wait", "apply_patch", "mcp__files__wait"]
    patch = req.chat["tools"][3]["function"]
    assert patch["parameters"]["properties"] == {"input": {"type": "string"}}
    assert 'start: "*** Begin Patch"' in patch["description"] and patch["description"].startswith(
        "Edits files"
    )
    assert req.chat["messages"][4:] == [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "spawn_agent", "arguments": '{"message":"go"}'},
                },
                {
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "mcp__files__wait", "arguments": "{}"},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "spawned"},
        {"role": "tool", "tool_call_id": "call_2", "content": "done"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_3",
                    "type": "function",
                    "function": {"name": "apply_patch", "arguments": '{"input":"*** Begin Patch\\n"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_3", "content": "Success"},
        {"role": "user", "content": "next"},
    ]
    assert req.adjustments == {
        "ignored": CODEX_IGNORED,
        "dropped_tools": [
            {"type": "web_search", "name": None},
            {"type": "image_generation", "name": None, "namespace": "mcp__files"},
        ],
        "dropped_items": {"reasoning": 1, "web_search_call": 1},
        "renamed_tools": {"collaboration__wait": "collaboration.wait", "mcp__files__wait": "mcp__files.wait"},
        "custom_tools": ["apply_patch"],
    }


def _chunk(delta: dict, finish: str | None = None) -> dict:
    return {
        "choices": [
            {
                "index": 0,
                "delta": delta,
                "finish_reason": finish,
                "token_ids": [7],
                "logprobs": {"content": [{"token": "t", "logprob": -0.5}]},
            }
        ],
        "prompt_token_ids": [1, 2],
    }


def test_codex_custom_tool_call_streams_as_custom_tool_call():
    req = parse_responses_request(orjson.dumps(codex_body(tools=[APPLY_PATCH])), MODEL)
    s = ResponsesStream(req, MODEL)
    frames = s.chunk(
        b"",
        _chunk(
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "call_9",
                        "type": "function",
                        "function": {"name": "apply_patch", "arguments": '{"input": "*** '},
                    }
                ]
            }
        ),
    )
    frames += s.chunk(
        b"",
        _chunk(
            {"tool_calls": [{"index": 0, "function": {"arguments": 'Begin Patch"}'}}]}, finish="tool_calls"
        ),
    )
    events = sse_events(b"".join(frames + s.done()).decode())
    kinds = [e for e, _ in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.custom_tool_call_input.delta",
        "response.custom_tool_call_input.done",
        "response.output_item.done",
        "response.completed",
    ]
    done = events[5][1]["item"]
    assert {k: done[k] for k in ("type", "call_id", "name", "input", "status")} == {
        "type": "custom_tool_call",
        "call_id": "call_9",
        "name": "apply_patch",
        "input": "*** Begin Patch",
        "status": "completed",
    }
    assert events[-1][1]["response"]["output"] == [done]


def test_codex_streamed_through_the_gateway(gw, rdb, vllm):
    rollout = gw.new_rollout()
    key = bearer(rollout["api_key"])
    resp = gw.http.post("/v1/responses", json=codex_body(), headers={**key, "originator": "codex_exec"})
    assert resp.status_code == 200, resp.text
    events = sse_events(resp.text)
    # What Codex's SSE reader needs: response.created, each item in output_item.done, and
    # response.completed with the response id and usage.
    assert events[0][0] == "response.created" and events[-1][0] == "response.completed"
    final = events[-1][1]["response"]
    assert final["id"] == events[0][1]["response"]["id"]
    assert final["usage"]["input_tokens"] == len(PROMPT_IDS) and final["usage"]["output_tokens"] == len(
        TOKEN_IDS
    )
    assert final["usage"]["total_tokens"] == len(PROMPT_IDS) + len(TOKEN_IDS)
    [message] = [d["item"] for e, d in events if e == "response.output_item.done"]
    assert message["role"] == "assistant" and message["content"][0]["type"] == "output_text"

    sent = vllm.requests[-1]
    assert [t["function"]["name"] for t in sent["tools"]] == [
        "exec_command",
        "update_plan",
        "spawn_agent",
        "wait",
    ]
    assert not {"store", "include", "prompt_cache_key", "client_metadata", "reasoning"} & set(sent)
    [trace] = wait_traces(rdb, gw.keys, rollout["rollout_id"])
    assert_exact(trace, "responses")
    assert trace["adjustments"].pop("max_tokens")["reason"] == "default"  # Codex sends no limit
    assert trace["adjustments"] == {
        "ignored": CODEX_IGNORED,
        "dropped_tools": [{"type": "web_search", "name": None}],
    }


@pytest.mark.parametrize("stream", [True, False])
def test_codex_namespaced_call_names_its_namespace(gw, rdb, stream):
    """The look-alike calls the first tool: here the namespace's spawn_agent; Codex dispatches on
    (namespace, name), so the item must carry both."""
    rollout = gw.new_rollout()
    body = {**codex_body("use-tool", tools=[COLLABORATION, EXEC, WEB_SEARCH]), "stream": stream}
    resp = gw.http.post("/v1/responses", json=body, headers=bearer(rollout["api_key"]))
    assert resp.status_code == 200, resp.text
    if stream:
        events = sse_events(resp.text)
        added = [d["item"] for e, d in events if e == "response.output_item.added"]
        assert added[0]["namespace"] == "collaboration" and added[0]["name"] == "spawn_agent"
        output = events[-1][1]["response"]["output"]
    else:
        output = resp.json()["output"]
    [call] = output
    assert {k: call[k] for k in ("type", "namespace", "name", "arguments", "call_id")} == {
        "type": "function_call",
        "namespace": "collaboration",
        "name": "spawn_agent",
        "arguments": "".join(TOOL_ARGS),
        "call_id": "chatcmpl-tool-fake1",
    }


def test_codex_custom_tool_call_through_the_gateway(gw, rdb):
    """The look-alike writes {"a": 3, "b": 4}, not the one `input` string: the call still goes back as
    a custom_tool_call, its input the raw arguments."""
    rollout = gw.new_rollout()
    body = {**codex_body("use-tool", tools=[APPLY_PATCH]), "stream": False}
    resp = gw.http.post("/v1/responses", json=body, headers=bearer(rollout["api_key"]))
    [call] = resp.json()["output"]
    assert call["type"] == "custom_tool_call" and call["name"] == "apply_patch"
    assert call["input"] == "".join(TOOL_ARGS) and call["id"].startswith("ctc_")


@pytest.mark.parametrize(
    ("change", "param"),
    [
        (lambda b: b.update(logit_bias={"1": 5}), "logit_bias"),
        (lambda b: b["input"].append({"type": "item_reference", "id": "msg_1"}), "input.3.type"),
        (lambda b: b.update(tool_choice={"type": "web_search"}), "tool_choice.type"),
    ],
)
def test_codex_unknown_generation_fields_are_400(gw, change, param):
    rollout = gw.new_rollout()
    body = copy.deepcopy(codex_body())
    change(body)
    resp = gw.http.post("/v1/responses", json=body, headers=bearer(rollout["api_key"]))
    err = assert_openai_error(resp, 400)
    assert err["param"] == param and param in err["message"]


def test_head_probe_is_not_an_api_call(gw):
    """HEAD / is only a liveness probe: no key needed, nothing recorded, no body."""
    resp = httpx.head(gw.url + "/")
    assert resp.status_code == 200 and resp.content == b""


def test_claude_code_count_tokens_renders_the_same_prompt():
    """count_tokens asks vLLM's /tokenize for the very prompt the call would get: the same messages,
    tools and template switch."""
    from tether.gateway.messages import parse_count_tokens_request

    body = claude_code_body()
    body.pop("stream")
    req = parse_messages_request(orjson.dumps(body), MODEL)
    assert parse_count_tokens_request(orjson.dumps(body), MODEL) == {
        "messages": req.chat["messages"],
        "add_generation_prompt": True,
        "tools": req.chat["tools"],
        "chat_template_kwargs": {"enable_thinking": True},
    }
