"""A smolagents ToolCallingAgent with one tool against an OpenAI-compatible server
(OpenAIServerModel with api_base and api_key). Its every step sends tool_choice "required".
Usage: python smolagents_agent.py TASK"""

import os
import sys

from smolagents import OpenAIServerModel, ToolCallingAgent, tool


@tool
def calc(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


model = OpenAIServerModel(
    model_id=os.environ["MODEL"],
    api_base=os.environ["OPENAI_BASE_URL"],
    api_key=os.environ["OPENAI_API_KEY"],
    max_tokens=int(os.environ["MAX_TOKENS"]),
)
agent = ToolCallingAgent(tools=[calc], model=model, max_steps=3, verbosity_level=1)
print(agent.run(sys.argv[1]))
