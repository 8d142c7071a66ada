"""A tool loop on the litellm SDK against an OpenAI-compatible server: model "openai/<name>" with
api_base and api_key, as litellm's docs configure a self-hosted endpoint; the first call streams.
Usage: python litellm_agent.py TASK"""

import json
import os
import sys

import litellm

MODEL = "openai/" + os.environ["MODEL"]
KW = {
    "api_base": os.environ["OPENAI_BASE_URL"],
    "api_key": os.environ["OPENAI_API_KEY"],
    "max_tokens": int(os.environ["MAX_TOKENS"]),
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "Add two numbers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]

messages = [{"role": "user", "content": sys.argv[1]}]
chunks = list(litellm.completion(model=MODEL, messages=messages, tools=TOOLS, stream=True, **KW))
message = litellm.stream_chunk_builder(chunks, messages=messages).choices[0].message
for _ in range(3):
    if not message.tool_calls:
        break
    messages.append(message.model_dump(exclude_none=True))
    for call in message.tool_calls:
        try:
            args = json.loads(call.function.arguments)
            out = str(int(args["a"]) + int(args["b"]))
        except (ValueError, KeyError, TypeError) as exc:
            out = f"error: {exc}"
        messages.append({"role": "tool", "tool_call_id": call.id, "content": out})
    message = litellm.completion(model=MODEL, messages=messages, tools=TOOLS, **KW).choices[0].message
print(message.content)
