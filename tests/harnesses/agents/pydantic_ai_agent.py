"""A pydantic-ai agent with one tool against an OpenAI-compatible server (OpenAIProvider with the
server's base URL and key, as pydantic-ai's docs configure vLLM/Ollama). Usage: python pydantic_ai_agent.py TASK"""

import os
import sys

from pydantic_ai import Agent
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.usage import UsageLimits

model = OpenAIChatModel(
    os.environ["MODEL"],
    provider=OpenAIProvider(base_url=os.environ["OPENAI_BASE_URL"], api_key=os.environ["OPENAI_API_KEY"]),
)
agent = Agent(model, model_settings={"max_tokens": int(os.environ["MAX_TOKENS"])})


@agent.tool_plain
def calc(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


result = agent.run_sync(sys.argv[1], usage_limits=UsageLimits(request_limit=4))
print(result.output)
