"""The instruction-following agent: a harness that talks to any OpenAI-compatible endpoint and scores itself.

A task asks for a short answer under verifiable constraints (a length, a word to include, one to avoid,
a format, a JSON shape), stated as plain sentences. The agent may test a draft by replying
``check <draft>``: the harness answers ``all met .`` or ``not met :`` followed by the sentences of the
constraints the draft fails, and the next reply is the answer (up to MAX_CHECKS checks). The reward is
the share of constraints the final answer meets (reward.py).

On CPU the tiny model is warm-started like the calculator's: most demonstrations answer at once and
sloppily (random words, some from the prompt, some capitalised), the rest check a draft first and then
answer to the letter. The warm-started policy mostly answers sloppily (reward ~0.3); RL raises it by
shifting probability onto checking first, the behaviour that earns reward.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from openai.types.chat import ChatCompletionMessageParam

from tether.examples import harness
from tether.examples.instruction.reward import CHECK, check_draft, failed, score

# Content words a constraint may name; capitalised forms appear in sloppy answers (so "lower case" can
# fail) and quoted forms are JSON string values.
CONTENT: tuple[str, ...] = (
    "sea", "sky", "sun", "moon", "tree", "cat", "dog", "bird",
    "red", "blue", "green", "gold", "rain", "snow", "fish", "star",
)  # fmt: skip
# Words a reference answer pads with; never named by a constraint.
FILLERS: tuple[str, ...] = ("so", "very", "calm", "day")
KEYS: tuple[str, ...] = ("name", "color", "place", "mood")
LENGTHS: tuple[int, ...] = (2, 3, 4, 5)
TOOL_HINT = "to test a draft , reply check and then the draft ."
TASK_OPENING = "write a short answer ."
ALL_MET = "all met ."
NOT_MET = "not met :"
MAX_CHECKS = 2


# Each constraint kind as the plain sentence the prompt (and the check tool's report) states it in.
SENTENCES = {
    "length_exact": "use exactly {n} words .",
    "length_at_most": "use at most {n} words .",
    "include": "include the word {word} .",
    "exclude": "do not use the word {word} .",
    "starts_with": "start with the word {word} .",
    "ends_with": "end with the word {word} .",
    "lower_case": "write only lower case .",
    "bullets": "write a list of {n} bullets .",
    "json_keys": "answer in json with keys {keys} .",
}


def sentence(c: dict) -> str:
    """Constraint `c` as its sentence (SENTENCES)."""
    if c["kind"] not in SENTENCES:
        raise ValueError(f"unknown constraint kind {c['kind']!r}")
    return SENTENCES[c["kind"]].format(**{**c, "keys": " and ".join(c.get("keys", ()))})


_SENTENCE_WORDS = (
    "use exactly words at most include the word do not start with end write only lower case "
    "a list of bullets answer in json keys and"
)
VOCAB: list[str] = list(
    dict.fromkeys(
        [
            *TASK_OPENING.split(),
            *TOOL_HINT.split(),
            *_SENTENCE_WORDS.split(),
            *ALL_MET.split(),
            *NOT_MET.split(),
            CHECK,
            *(str(n) for n in LENGTHS),
            *CONTENT,
            *(w.capitalize() for w in CONTENT),
            *(f'"{w}"' for w in (*CONTENT, *FILLERS, *KEYS)),
            *FILLERS,
            *KEYS,
        ]
    )
)

# Supervised warm start: enough steps to learn the exact answer after a check; direct answers stay sloppy.
DEMONSTRATIONS = 3000
# 1,500 steps: the checked answer meets 0.83 of its constraints sampled at temperature 1 (offline, 60
# tasks; 0.49 after 500 steps), so checking first is clearly the path that pays (README).
WARM_START: dict[str, float] = {"steps": 1500, "lr": 3e-3}
DEMO: dict[str, int | float] = {"steps": 60, "tasks_per_step": 8, "group_size": 8, "eval_repeats": 1}


def instructions(task: dict) -> list[str]:
    return [sentence(c) for c in task["constraints"]]


def prompt(task: dict) -> str:
    """The user message the agent opens with: the request, its constraints, how to use the check tool."""
    return " ".join([TASK_OPENING, *instructions(task), TOOL_HINT])


def report(draft: str, task: dict) -> str:
    """The check tool's answer: which constraints the draft fails, in the prompt's own sentences."""
    bad = failed(draft, task["constraints"])
    if not bad:
        return ALL_MET
    return " ".join([NOT_MET, *(sentence(task["constraints"][i]) for i in bad)])


def _make_task(rng: random.Random, index: int) -> dict:
    picked = rng.sample(CONTENT, 3)
    if rng.random() < 0.25:
        keys = rng.sample(KEYS, 2)
        constraints = [
            {"kind": "json_keys", "keys": keys},
            {"kind": "include", "word": picked[0]},
            {"kind": "exclude", "word": picked[1]},
        ]
    else:
        third = rng.choice(("exclude", "starts_with", "ends_with", "lower_case"))
        least = 2 if third in ("starts_with", "ends_with") else 1
        n = rng.choice([n for n in LENGTHS if n >= least])
        length = {"kind": rng.choice(("length_exact", "length_at_most")), "n": n}
        extra = {"kind": third} if third == "lower_case" else {"kind": third, "word": picked[1]}
        constraints = [length, {"kind": "include", "word": picked[0]}, extra]
    return {"task_id": f"i{index:03d}", "constraints": constraints}


TASKS = 240


def tasks(n: int | None = None, seed: int = 0) -> list[dict]:
    """The fixed pool of TASKS tasks (the same for every seed), or n of them sampled without replacement."""
    rng = random.Random(15)
    every = [_make_task(rng, i) for i in range(TASKS)]
    return harness.pick(every, n, seed)


def reference(task: dict) -> str:
    """An answer that meets every constraint, built the same way every time (what demonstrations end on)."""
    by_kind = {c["kind"]: c for c in task["constraints"]}
    required = by_kind["include"]["word"]
    if "json_keys" in by_kind:
        first, second = by_kind["json_keys"]["keys"]
        return f'{{ "{first}" : "{required}" , "{second}" : "{FILLERS[2]}" }}'
    head = [by_kind["starts_with"]["word"]] if "starts_with" in by_kind else []
    tail = [by_kind["ends_with"]["word"]] if "ends_with" in by_kind else []
    answer = [*head, required]
    if "length_exact" in by_kind:
        answer += list(FILLERS[: by_kind["length_exact"]["n"] - len(answer) - len(tail)])
    return " ".join([*answer, *tail])


def sloppy(task: dict, rng: random.Random) -> str:
    """An answer in the task's shape that ignores its details: what the warm start teaches direct answers."""
    named = [c["word"] for c in task["constraints"] if "word" in c]

    def word() -> str:
        w = rng.choice(named) if rng.random() < 0.1 else rng.choice(CONTENT + FILLERS)
        return w.capitalize() if w in CONTENT and rng.random() < 0.5 else w

    if any(c["kind"] == "json_keys" for c in task["constraints"]) and rng.random() < 0.7:
        pairs = [f'"{rng.choice(KEYS)}" : "{word().lower()}"' for _ in range(rng.randint(1, 2))]
        return "{ " + " , ".join(pairs) + " }"
    return " ".join(word() for _ in range(rng.randint(2, 7)))


def demonstrations(n: int = DEMONSTRATIONS, seed: int = 0, check_fraction: float = 0.3) -> list[list[dict]]:
    """n conversations shaped like the agent's calls, round(n * check_fraction) of them checking a draft.

    Direct demonstrations answer sloppily; checked ones test a (mostly sloppy) draft, read the report
    and answer with the reference answer, so the policy learns that only the checked path is exact.
    """
    rng = random.Random(seed)
    pool = tasks()
    kinds = harness.mix(n, check_fraction, rng, "check_fraction")
    conversations: list[list[dict]] = []
    for checks in kinds:
        task = rng.choice(pool)
        user = {"role": "user", "content": prompt(task)}
        if checks:
            draft = reference(task) if rng.random() < 0.2 else sloppy(task, rng)
            conversations.append(
                [
                    user,
                    {"role": "assistant", "content": f"{CHECK} {draft}"},
                    {"role": "user", "content": report(draft, task)},
                    {"role": "assistant", "content": reference(task)},
                ]
            )
        else:
            conversations.append([user, {"role": "assistant", "content": sloppy(task, rng)}])
    return conversations


def episode(task: dict, reply: Callable[[list[ChatCompletionMessageParam]], str]) -> float:
    """One episode with `reply` as the model: the harness's loop, independent of any transport.

    A reply ``check <draft>`` gets the check tool's report back; any other reply is the answer. An
    episode whose last allowed reply (the MAX_CHECKS + 1st) is still a check has no answer: reward 0.
    """
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": prompt(task)}]
    for _ in range(MAX_CHECKS + 1):
        text = reply(messages)
        draft = check_draft(text)
        if draft is None:
            return score(text, task["constraints"], instructions(task))
        messages.append({"role": "assistant", "content": text})
        messages.append({"role": "user", "content": report(draft, task)})
    return score(None, task["constraints"], instructions(task))


def rollout(task: dict, base_url: str, api_key: str, model: str) -> float:
    """Run one episode against an OpenAI-compatible endpoint and return its reward in [0, 1]."""
    client = harness.client(base_url, api_key)

    def reply(messages: list[ChatCompletionMessageParam]) -> str:
        completion = client.chat.completions.create(
            model=model, messages=messages, temperature=1.0, max_tokens=16
        )
        return completion.choices[0].message.content or ""

    return episode(task, reply)
