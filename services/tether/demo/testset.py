"""A deterministic multi-turn tool-use test set for the merger, built locally (no model hub).

It simulates what a real harness does around a Qwen-style model, so that prompts break exactly the way
they do in practice (docs/architecture.md, pitfalls 1 and 2):

* A word-level tokenizer (``tokenizers`` ``WordLevel``) whose pre-tokenizer isolates words, single
  punctuation marks and whitespace runs, with a ``Fuse`` decoder: ``decode`` is exact, but
  ``encode(decode(ids))`` is not always ``ids`` -- the "model" sometimes samples a word as two pieces
  (``hav`` + ``ing``) that re-encode as one token (``having``), like BPE models do.
* A Qwen3-style Jinja chat template (``CHAT_TEMPLATE``): it drops the ``<think>`` block of assistant
  turns that precede the last user message, keeps it for turns after it (a tool loop), renders tool
  calls as ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`` from the parsed call, and
  with ``enable_thinking=False`` appends an empty ``<think>\\n\\n</think>\\n\\n`` to the generation
  prompt that history turns do not carry.
* An agent loop: every call's prompt is the template's re-render of the whole history
  (``apply_chat_template``); the response is a "sampled" token list with fake logprobs; the harness
  decodes it, parses reasoning, content and tool calls the way vLLM's parsers do (``json.loads`` then
  ``json.dumps`` of the arguments, stripped content) and appends the parsed message to the history.

What breaks a prefix here, per sampled response (rates in ``TestSetConfig``): trailing whitespace the
parser strips; a wrong end-of-turn token (``<|endoftext|>``); a dropped end-of-turn token (merges
anyway: the template's ``<|im_end|>`` lands in the observation); a non-canonical word split; tool-call
JSON the parser re-serialises (compact separators, key order, extra spaces); ``</think>\\n`` instead
of ``</think>\\n\\n``; in non-thinking mode the generation-prompt tail, on every turn; follow-up user
turns that make the template drop earlier ``<think>`` blocks. Plus retried calls (an errored attempt
or a discarded answer with the same prompt) and unrelated side calls (a title generator).

``generate(TestSetConfig(...))`` returns ``TestRollout``s whose ``calls`` are ``tether.merger.merge.Call``s;
``evaluate(rollouts, **merge_kwargs)`` merges them and reports the single-sequence share.
"""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, Any, cast

from tether.merger.merge import Call, merge_calls

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

IM_START, IM_END, EOT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
SPECIAL = (EOT, IM_START, IM_END)
MARKUP = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
UNK = "<unk>"
WHITESPACE = (" ", "  ", "\n", "\n\n")
PUNCT = tuple("{}[]\":,.!?()+-*/=#'<>_;")
WORDS = tuple(
    """
system user assistant tool Tools You are a helpful coding agent Use the tools to solve task type function
description parameters object properties string integer required name arguments path query line start end
read_file write_file run_tests search_code list_dir content pattern file files test tests passed failed
error errors traceback module function class method value values return returns import from def self
None True False if else for while with open print len range list dict set tuple int str bool float
I will first look at then check fix update change add remove rename move it this that these those now
next let me see here there found having working looking reading writing running testing because so and or
not but also all some any each every one two three four five six seven eight nine ten done finished
problem issue bug cause reason result results output input expected actual assertion line number column
repository project source code directory folder config settings option options default defaults case
edge cases should would could must can may might need needs want wants looks seems appears correct wrong
title summary conversation short write summarise read in search list dir run x
""".split()
)
NUMBERS = tuple(str(i) for i in range(200))
TOOL_NAMES = ("read_file", "write_file", "run_tests", "search_code", "list_dir")
ARG_KEYS = {
    "read_file": ("path", "start", "end"),
    "write_file": ("path", "content"),
    "run_tests": ("path",),
    "search_code": ("pattern", "path"),
    "list_dir": ("path",),
}

CHAT_TEMPLATE = r"""
{%- set ns = namespace(last_query=-1) %}
{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}{%- endfor %}
{%- for m in messages %}
{%- if m.role == 'system' %}
{{- '<|im_start|>system\n' + m.content }}
{%- if tools %}
{{- '\n\n# Tools\n\n<tools>' }}
{%- for t in tools %}{{- '\n' + (t | tojson) }}{%- endfor %}
{{- '\n</tools>' }}
{%- endif %}
{{- '<|im_end|>\n' }}
{%- elif m.role == 'user' %}
{{- '<|im_start|>user\n' + m.content + '<|im_end|>\n' }}
{%- elif m.role == 'assistant' %}
{{- '<|im_start|>assistant\n' }}
{%- if loop.index0 > ns.last_query and m.reasoning_content %}
{{- '<think>\n' + m.reasoning_content.strip('\n') + '\n</think>\n\n' }}
{%- endif %}
{{- m.content or '' }}
{%- for tc in (m.tool_calls or []) %}
{%- if not loop.first or m.content %}{{- '\n' }}{%- endif %}
{{- '<tool_call>\n{"name": "' + tc.function.name + '", "arguments": ' }}
{%- if tc.function.arguments is string %}{{- tc.function.arguments }}{%- else %}{{- tc.function.arguments | tojson }}{%- endif %}
{{- '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif m.role == 'tool' %}
{{- '<|im_start|>user\n<tool_response>\n' + m.content + '\n</tool_response><|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}
""".strip()

_SPLIT = r"\n+|[ \t]+|\w+|[^\w\s]"


def _split_words() -> dict[str, tuple[str, str]]:
    """Words the model may sample as two pieces (both pieces are vocabulary entries)."""
    return {w: (w[:3], w[3:]) for w in WORDS if len(w) >= 6 and "_" not in w}


SPLITS = _split_words()


@lru_cache(maxsize=1)
def build_tokenizer() -> PreTrainedTokenizerFast:
    """The test set's tokenizer: ``PreTrainedTokenizerFast`` over a fixed word-level vocabulary."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab: dict[str, int] = {}
    pieces = [p for pair in SPLITS.values() for p in pair]
    for word in (*SPECIAL, UNK, *MARKUP, *WHITESPACE, *PUNCT, *WORDS, *NUMBERS, *TOOL_NAMES, *pieces):
        vocab.setdefault(word, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(_SPLIT), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=EOT,
        unk_token=UNK,
        model_max_length=1 << 20,
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


# Typed as apply_chat_template takes tools (JSON schemas or functions).
TOOLS: list[dict[Any, Any] | Callable[..., Any]] = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name.replace('_', ' ')} in the repository",
            "parameters": {
                "type": "object",
                "properties": {
                    k: {"type": "integer" if k in ("start", "end") else "string"} for k in ARG_KEYS[name]
                },
                "required": [ARG_KEYS[name][0]],
            },
        },
    }
    for name in TOOL_NAMES
]


@dataclass(frozen=True)
class TestSetConfig:
    """Sizes and breakage rates (per sampled response unless said otherwise)."""

    n_rollouts: int = 200
    seed: int = 0
    calls: tuple[int, int] = (8, 12)  # main-conversation calls per rollout (inclusive range)
    obs_words: tuple[int, int] = (15, 60)  # words per tool result
    reasoning_words: tuple[int, int] = (8, 30)
    content_words: tuple[int, int] = (0, 12)
    p_non_thinking: float = 0.08  # per rollout: enable_thinking=False (generation-prompt tail)
    p_followup: float = 0.10  # per rollout: 1-2 follow-up user turns (earlier <think> blocks dropped)
    p_trailing_ws: float = 0.04  # "\n" before the end-of-turn token; the parser strips it
    p_wrong_eos: float = 0.015  # <|endoftext|> instead of <|im_end|>
    p_no_eos: float = 0.04  # the recorded response lacks the end-of-turn token
    p_split: float = 0.01  # one word sampled as two pieces (re-encodes as one token)
    p_json: float = 0.01  # per tool call: JSON the parser re-serialises differently
    p_think_nl: float = 0.005  # "</think>\n" instead of "</think>\n\n"
    p_retry: float = 0.03  # per call: an earlier attempt with the same prompt (errored or discarded)
    p_side_call: float = 0.03  # per rollout: one unrelated call (a title generator)


@dataclass
class TestRollout:
    rollout_id: str
    calls: list[Call]
    thinking: bool
    reward: float
    # What was injected, for diagnostics (deviations only where a later call re-renders the response).
    events: Counter = field(default_factory=Counter)


class _Sim:
    def __init__(self, cfg: TestSetConfig, verify: bool = False):
        self.cfg = cfg
        self.verify = verify
        self._cache: tuple[str, list[int], list[tuple[int, int]]] = ("", [], [])
        self.rng = random.Random(cfg.seed)
        self.tok = build_tokenizer()
        self.ids = self.tok.get_vocab()
        self.unk = self.ids[UNK]
        self.content_words = [w for w in WORDS if w not in ("system", "user", "assistant", "tool")]

    # -------------------------------------------------------------- text

    def words(self, lo_hi: tuple[int, int]) -> str:
        n = self.rng.randint(*lo_hi)
        out = []
        for i in range(n):
            w = self.rng.choice(self.content_words) if self.rng.random() > 0.1 else self.rng.choice(NUMBERS)
            out.append(w)
            if i % 9 == 8:
                out.append(".")
        return " ".join(out).replace(" .", ".")

    def piece(self, token_id: int) -> str:
        """The vocabulary entry of one id (transformers types the list form's answer alongside)."""
        return cast(str, self.tok.convert_ids_to_tokens(token_id))

    def encode(self, text: str) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False)
        if self.unk in ids:
            raise AssertionError(f"test set text outside the vocabulary: {text[:200]!r}")
        return ids

    def render(self, messages: list[dict], thinking: bool) -> list[int]:
        """The template's re-render of the whole history, tokenised.

        Encoding is incremental (a pure speed-up, checked against a full encode when ``verify``): the
        ids of the longest common text prefix with the previous render that ends right after an
        ``<|im_end|>`` (special tokens are split off before pre-tokenisation, so the encoding of the
        text after such a point does not depend on the text before it) are reused.
        """
        kw: dict[str, Any] = {} if thinking else {"enable_thinking": False}
        # tokenize=False: the rendered text (transformers types every form the call can return).
        text = cast(
            str,
            self.tok.apply_chat_template(
                messages, tools=TOOLS, add_generation_prompt=True, tokenize=False, **kw
            ),
        )
        prev_text, prev_ids, prev_bounds = self._cache
        n = 0
        limit = min(len(text), len(prev_text))
        while n < limit and text[n] == prev_text[n]:
            n += 1
        start_char, start_tok = 0, 0
        bounds: list[tuple[int, int]] = []
        for c, t in prev_bounds:
            if c > n:
                break
            start_char, start_tok = c, t
            bounds.append((c, t))
        ids = prev_ids[:start_tok] + self.encode(text[start_char:])
        # New boundaries: after every <|im_end|> in the re-encoded part.
        end_id = self.ids[IM_END]
        for i in range(start_tok, len(ids)):
            if ids[i] == end_id:
                bounds.append((-1, i + 1))
        # Recover the character offset of each new boundary from the text.
        pos = start_char
        fixed = []
        for c, t in bounds:
            if c >= 0:
                fixed.append((c, t))
                continue
            pos = text.index(IM_END, pos) + len(IM_END)
            fixed.append((pos, t))
        self._cache = (text, ids, fixed)
        if self.verify and ids != self.encode(text):
            raise AssertionError("incremental encoding differs from a full encode")
        return ids

    def logprobs(self, n: int) -> list[float]:
        return [-round(self.rng.uniform(0.001, 3.0), 6) for _ in range(n)]

    # -------------------------------------------------------------- the "model"

    def tool_call(self, events: Counter) -> str:
        name = self.rng.choice(TOOL_NAMES)
        args: dict = {}
        for k in ARG_KEYS[name]:
            if k in ("start", "end"):
                args[k] = self.rng.randint(1, 199)
            elif k == "path" or self.rng.random() < 0.5 or k == ARG_KEYS[name][0]:
                args[k] = self.words((1, 4))
        if self.rng.random() < self.cfg.p_json:
            kind = self.rng.choice(["compact", "key_order", "spaces"])
            events[f"json_{kind}"] += 1
            if kind == "compact":
                return json.dumps({"name": name, "arguments": args}, separators=(",", ":"))
            if kind == "key_order":
                return json.dumps({"arguments": args, "name": name})
            return "{ " + json.dumps({"name": name, "arguments": args})[1:-1] + " }"
        return json.dumps({"name": name, "arguments": args})

    def respond(self, thinking: bool, want_tool: bool, events: Counter) -> list[int]:
        """Token ids the model 'samples' for one turn (canonical format plus injected deviations)."""
        cfg, rng = self.cfg, self.rng
        parts: list[str] = []
        if thinking:
            nl = "\n"
            if rng.random() < cfg.p_think_nl:
                events["think_newline"] += 1
            else:
                nl = "\n\n"
            parts.append("<think>\n" + self.words(cfg.reasoning_words) + "\n</think>" + nl)
        content = (
            self.words(cfg.content_words)
            if want_tool
            else self.words((max(cfg.content_words[0], 3), cfg.content_words[1] + 3))
        )
        body = content
        if want_tool:
            body += ("\n" if content else "") + "<tool_call>\n" + self.tool_call(events) + "\n</tool_call>"
        if rng.random() < cfg.p_trailing_ws:
            events["trailing_newline"] += 1
            body += "\n"
        parts.append(body)
        ids = self.encode("".join(parts))
        if rng.random() < cfg.p_split:
            where = [i for i, t in enumerate(ids) if self.piece(t) in SPLITS]
            if where:
                i = rng.choice(where)
                a, b = SPLITS[self.piece(ids[i])]
                ids[i : i + 1] = [self.ids[a], self.ids[b]]
                events["split_word"] += 1
        r = rng.random()
        if r < cfg.p_wrong_eos:
            events["wrong_eos"] += 1
            ids.append(self.ids[EOT])
        elif r < cfg.p_wrong_eos + cfg.p_no_eos:
            events["no_eos"] += 1
        else:
            ids.append(self.ids[IM_END])
        return ids

    # -------------------------------------------------------------- the harness

    def parse(self, ids: list[int]) -> dict:
        """What the API returns and the harness appends: vLLM-style reasoning and tool-call parsing."""
        text = cast(str, self.tok.decode(ids, skip_special_tokens=True))  # one sequence: one text
        msg: dict = {"role": "assistant"}
        if "</think>" in text:
            reasoning, _, text = text.partition("</think>")
            msg["reasoning_content"] = reasoning.replace("<think>", "", 1).strip("\n")
            text = text.lstrip("\n")
        calls = re.findall(r"<tool_call>(.*?)</tool_call>", text, re.S)
        if calls:
            msg["content"] = text[: text.find("<tool_call>")].strip()
            msg["tool_calls"] = []
            for i, raw in enumerate(calls):
                obj = json.loads(raw)
                msg["tool_calls"].append(
                    {
                        "id": f"call_{i}",
                        "type": "function",
                        "function": {
                            "name": obj["name"],
                            "arguments": json.dumps(obj["arguments"], ensure_ascii=False),
                        },
                    }
                )
        else:
            msg["content"] = text.strip()
        return msg

    def rollout(self, index: int) -> TestRollout:
        cfg, rng = self.cfg, self.rng
        rid = f"r{index:05d}"
        thinking = rng.random() >= cfg.p_non_thinking
        events: Counter = Counter()
        events["thinking" if thinking else "non_thinking"] += 1
        n = rng.randint(*cfg.calls)
        followups = set()
        if rng.random() < cfg.p_followup and n >= 4:
            followups = set(rng.sample(range(1, n - 1), rng.choice([1, 2])))
            events["followup_user_turns"] += len(followups)
        side_at = rng.randrange(n) if rng.random() < cfg.p_side_call else -1
        messages = [
            {"role": "system", "content": "You are a helpful coding agent. Use the tools to solve the task."},
            {"role": "user", "content": self.words((10, 30))},
        ]
        calls: list[Call] = []

        def record(prompt: list[int], resp: list[int], status: str = "ok") -> None:
            calls.append(
                Call(
                    call_id=f"{rid}-c{len(calls)}",
                    prompt_token_ids=prompt,
                    response_token_ids=resp,
                    response_logprobs=self.logprobs(len(resp)),
                    status=status,
                )
            )

        for turn in range(n):
            if turn == side_at:
                events["side_call"] += 1
                side = [
                    {"role": "system", "content": "write a short title for this conversation"},
                    {"role": "user", "content": self.words((5, 15))},
                ]
                record(self.render(side, True), self.encode(self.words((2, 6))) + [self.ids[IM_END]])
            prompt = self.render(messages, thinking)
            last = turn == n - 1
            want_tool = not last and turn not in followups
            if rng.random() < cfg.p_retry:
                if rng.random() < 0.5:
                    events["retry_error"] += 1
                    record(prompt, [], status="error")
                else:
                    events["retry_discarded"] += 1
                    record(prompt, self.respond(thinking, want_tool, Counter()))
            resp = self.respond(thinking, want_tool, Counter() if last else events)
            record(prompt, resp)
            messages.append(self.parse(resp))
            if want_tool:
                messages.append({"role": "tool", "content": self.words(cfg.obs_words)})
            elif not last:
                messages.append({"role": "user", "content": self.words((5, 20))})
        return TestRollout(rid, calls, thinking, float(rng.random() < 0.5), events)


def generate(cfg: TestSetConfig | None = None, verify: bool = False) -> list[TestRollout]:
    """The test set: identical for identical configs (``verify``: check the incremental encoding)."""
    sim = _Sim(cfg or TestSetConfig(), verify)
    return [sim.rollout(i) for i in range(sim.cfg.n_rollouts)]


def strip_tail() -> list[int]:
    """The strip tail of the test set's template (its non-thinking generation-prompt tail)."""
    from tether.merger.merge import generation_prompt_tail

    return generation_prompt_tail(build_tokenizer(), enable_thinking=False)


def evaluate(rollouts: list[TestRollout], **merge_kwargs: Any) -> dict[str, float]:
    """Merge every rollout; single-sequence share, sequences per rollout and what was kept."""
    n = len(rollouts)
    seqs_total = single = forks = realigns = mismatched = 0
    sampled = trainable = 0
    for ro in rollouts:
        seqs, stats = merge_calls(ro.calls, **merge_kwargs)
        seqs_total += len(seqs)
        single += len(seqs) == 1
        forks += stats.forks
        realigns += stats.realigns
        mismatched += stats.mismatched_calls
        trainable += sum(sum(s.loss_mask) for s in seqs)
        used = {cid for s in seqs for cid in s.call_ids}
        sampled += sum(len(c.response_token_ids) for c in ro.calls if c.call_id in used)
    return {
        "rollouts": n,
        "single_sequence_share": single / max(n, 1),
        "sequences_per_rollout": seqs_total / max(n, 1),
        "forks_per_rollout": forks / max(n, 1),
        "realigns_per_rollout": realigns / max(n, 1),
        "mismatched_calls_per_rollout": mismatched / max(n, 1),
        "trainable_token_share": trainable / max(sampled, 1),
    }
