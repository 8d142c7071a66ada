"""The calculator agent: a harness that talks to any OpenAI-compatible endpoint and scores itself.

The task is a one-digit sum. The model may answer directly or call the tool by replying
``calc A + B``; the harness then sends back ``= RESULT`` and takes the next reply as the answer.
Demonstrations answer directly with a *random* digit, so a warm-started policy is right mostly when it
uses the tool: reward starts low and RL raises it by shifting probability mass onto ``calc``.
"""

from __future__ import annotations

import os
import random
import re
import time

import openai
from openai.types.chat import ChatCompletionMessageParam

from tether.examples import harness

QUESTION_WORDS: tuple[str, ...] = ("what", "is", "?")
TOOL_WORDS: tuple[str, ...] = ("calc", "+", "=")
ROLE_WORDS: tuple[str, ...] = ("system", "user", "assistant", "tool")
# Results of a mis-typed tool call can reach 18 (9 + 9), so the vocabulary covers 0..18.
NUMBERS: tuple[str, ...] = tuple(str(i) for i in range(19))
# The calculator as a function tool, calc(a, b), in the chat template's JSON (Hermes tool calls): its name
# and argument names as quoted words. The harness below does not use it; the SDK conformance tests do.
FUNCTION_WORDS: tuple[str, ...] = ('"calc", ', '"a"', '"b"')
VOCAB: list[str] = [*ROLE_WORDS, *QUESTION_WORDS, *TOOL_WORDS, *NUMBERS, *FUNCTION_WORDS]

MAX_SUM = 9
# Supervised warm start that lands the policy at mean reward ~0.3 when sampled at temperature 1
# (measured through vLLM-CPU, 220 rollouts, model seeds 0-2: 0.33-0.37); fewer steps leave the copy
# skills ("calc A + B", "= R" -> "R") unlearned and the reward near chance.
DEMONSTRATIONS = 2000
WARM_START: dict[str, float] = {"steps": 300, "lr": 3e-3}
_CALC = re.compile(r"^calc\s+(\d+)\s*\+\s*(\d+)$")


def tasks(n: int | None = None, seed: int = 0) -> list[dict]:
    """All sums a + b <= 9 with a, b >= 0 (55 tasks), or n of them sampled without replacement."""
    every = [
        {"task_id": f"{a}+{b}", "a": a, "b": b, "answer": a + b}
        for a in range(MAX_SUM + 1)
        for b in range(MAX_SUM + 1 - a)
    ]
    return harness.pick(every, n, seed)


def question(task: dict) -> str:
    """The user message the agent opens with."""
    return f"what is {task['a']} + {task['b']} ?"


def tool_call(task: dict) -> str:
    """The assistant message that calls the calculator for this task."""
    return f"calc {task['a']} + {task['b']}"


def demonstrations(n: int = DEMONSTRATIONS, seed: int = 0, tool_fraction: float = 0.3) -> list[list[dict]]:
    """n chat conversations shaped exactly like the agent's calls, round(n * tool_fraction) of them tool use.

    Direct demonstrations answer with a uniformly random digit (not the sum), so the SFT policy learns
    that answering directly is a guess and only the tool path is reliable.
    """
    rng = random.Random(seed)
    pool = tasks()
    kinds = harness.mix(n, tool_fraction, rng, "tool_fraction")
    conversations: list[list[dict]] = []
    for uses_tool in kinds:
        task = rng.choice(pool)
        user = {"role": "user", "content": question(task)}
        if uses_tool:
            conversations.append(
                [
                    user,
                    {"role": "assistant", "content": tool_call(task)},
                    {"role": "user", "content": f"= {task['answer']}"},
                    {"role": "assistant", "content": str(task["answer"])},
                ]
            )
        else:
            guess = str(rng.randint(0, MAX_SUM))
            conversations.append([user, {"role": "assistant", "content": guess}])
    return conversations


def _reply(client: openai.OpenAI, model: str, messages: list[ChatCompletionMessageParam]) -> str:
    completion = client.chat.completions.create(model=model, messages=messages, temperature=1.0, max_tokens=8)
    return completion.choices[0].message.content or ""


# Simulated latency of the calc tool, as real tools and environments have (seconds; exponential with this
# mean, so a few calls take several times longer; unset or 0 = none). bench/scheduling_modes sets it
# with --tool-latency-s to compare the scheduling modes on rollouts of uneven length.
TOOL_LATENCY_ENV = "CALCULATOR_TOOL_LATENCY_S"


def tool_latency() -> float:
    mean = float(os.environ.get(TOOL_LATENCY_ENV) or 0)
    return random.expovariate(1 / mean) if mean > 0 else 0.0


def rollout(task: dict, base_url: str, api_key: str, model: str) -> float:
    """Run one episode against an OpenAI-compatible endpoint and return its reward (1.0 or 0.0).

    A reply starting with ``calc`` is a tool call: a well-formed ``calc X + Y`` gets ``= X+Y`` back and
    the second reply is the answer; a malformed one ends the episode with reward 0.
    """
    client = harness.client(base_url, api_key)
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": question(task)}]
    reply = _reply(client, model, messages)
    if reply.strip().startswith("calc"):
        match = _CALC.match(reply.strip())
        if match is None:
            return 0.0
        result = int(match.group(1)) + int(match.group(2))
        time.sleep(tool_latency())
        messages.append({"role": "assistant", "content": reply})
        messages.append({"role": "user", "content": f"= {result}"})
        reply = _reply(client, model, messages)
    return 1.0 if reply.strip() == str(task["answer"]) else 0.0
