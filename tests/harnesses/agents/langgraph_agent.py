"""A LangGraph ReAct agent with one tool, configured as a user would for an OpenAI-compatible server:
OPENAI_BASE_URL and OPENAI_API_KEY in the environment (langchain-openai reads both), the model name
and a small output budget on ChatOpenAI. Usage: python langgraph_agent.py TASK"""

import os
import sys

from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.prebuilt import create_react_agent


@tool
def calc(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


llm = ChatOpenAI(model=os.environ["MODEL"], max_tokens=int(os.environ["MAX_TOKENS"]))
agent = create_react_agent(llm, [calc])
# A bounded loop: the tiny model may call the tool again and again.
result = agent.invoke({"messages": [("user", sys.argv[1])]}, {"recursion_limit": 8})
print(result["messages"][-1].content)
