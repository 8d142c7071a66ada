"""The tiny policy stack: word-level tokenizer, ChatML template, Llama build/save, warm start, and the
calculator agent's data and harness. These are the properties the token-exact pipeline relies on."""

from __future__ import annotations

import importlib.util
import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tether.demo import tiny
from tether.demo.warmstart import tokenize_conversation, warm_start

AGENT_PATH = (
    Path(__file__).resolve().parent.parent / "services" / "tether" / "examples" / "calculator" / "agent.py"
)


def _load_agent() -> ModuleType:
    # Loaded by path: the repo root is not on sys.path under a plain `pytest` run.
    spec = importlib.util.spec_from_file_location("calculator_agent_under_test", AGENT_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


agent = _load_agent()


def _ids(tokenizer, messages: list[dict], generation_prompt: bool) -> list[int]:
    return list(
        tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, return_dict=False)
    )


@pytest.fixture(scope="module")
def tokenizer():
    return tiny.build_tokenizer(agent.VOCAB)


def test_every_vocab_word_round_trips(tokenizer) -> None:
    unk = tokenizer.convert_tokens_to_ids(tiny.UNK)
    for word in agent.VOCAB:
        ids = tokenizer.encode(word, add_special_tokens=False)
        assert len(ids) == 1 and ids[0] != unk, word
        assert tokenizer.decode(ids) == word
    sentence = " ".join(agent.VOCAB)
    ids = tokenizer.encode(sentence, add_special_tokens=False)
    assert tokenizer.decode(ids) == sentence
    assert tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False) == ids
    assert len(set(ids)) == len(set(agent.VOCAB))


def test_special_tokens_split_without_spaces(tokenizer) -> None:
    ids = tokenizer.encode("<|im_start|>user\nwhat<|im_end|><|endoftext|>", add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens(ids) == [
        "<|im_start|>",
        "user",
        "what",
        "<|im_end|>",
        "<|endoftext|>",
    ]
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.decode(ids, skip_special_tokens=True) == "user what"
    for role in ("system", "user", "assistant", "tool"):
        assert tokenizer.convert_tokens_to_ids(role) != tokenizer.unk_token_id


def test_chat_template_is_prefix_stable(tokenizer) -> None:
    im_end = tokenizer.convert_tokens_to_ids(tiny.IM_END)
    first = [{"role": "user", "content": "what is 3 + 4 ?"}]
    prompt1 = _ids(tokenizer, first, True)
    assert tokenizer.convert_ids_to_tokens(prompt1) == [
        "<|im_start|>", "user", "what", "is", "3", "+", "4", "?", "<|im_end|>", "<|im_start|>", "assistant",
    ]  # fmt: skip
    reply = "calc 3 + 4"
    reply_ids = tokenizer.encode(reply, add_special_tokens=False)
    second = first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "= 7"}]
    prompt2 = _ids(tokenizer, second, True)
    assert prompt2[: len(prompt1) + len(reply_ids) + 1] == prompt1 + reply_ids + [im_end]
    # vLLM's detokenized text may carry a leading space; it must not change the next prompt.
    spaced = first + [{"role": "assistant", "content": " " + reply}, {"role": "user", "content": "= 7"}]
    assert _ids(tokenizer, spaced, True) == prompt2


CALC_TOOL = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "add two digits",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


def _tool_conversation(arguments) -> list[dict]:
    call = {"id": "call_1", "type": "function", "function": {"name": "calc", "arguments": arguments}}
    return [
        {"role": "user", "content": "what is 3 + 4 ?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "= 7"},
        {"role": "assistant", "content": "7"},
    ]


def test_tool_calls_render_as_vllms_strict_hermes_grammar_writes_them(tokenizer) -> None:
    """vLLM's grammar for a forced Hermes call is the text `<tool_call>{"name": "calc", "arguments": ` ARGS
    `}</tool_call>`, matched against the tokens' strings put end to end; the template must render a call
    as tokens that do exactly that, and what the detokenizer makes of them (spaces between tokens) must
    still be a call vLLM's hermes parser reads back."""
    conversation = _tool_conversation({"a": 3, "b": 4})  # vLLM hands templates the arguments parsed
    before = _ids(tokenizer, conversation[:1], True)
    through = _ids(tokenizer, conversation[:2], False)
    assert through[: len(before)] == before
    call = through[len(before) :]
    assert call[-1] == tokenizer.convert_tokens_to_ids(tiny.IM_END)
    tokens = tokenizer.convert_ids_to_tokens(call[:-1])
    assert "".join(tokens) == '<tool_call>{"name": "calc", "arguments": {"a":3,"b":4}}</tool_call>'
    assert tokenizer.unk_token_id not in call
    text = tokenizer.decode(call[:-1])
    body = text.removeprefix(tiny.TOOL_CALL_START[: len("<tool_call>")]).removesuffix(tiny.TOOL_CALL_END)
    assert json.loads(body) == {"name": "calc", "arguments": {"a": 3, "b": 4}}
    assert tokenizer.encode(text, add_special_tokens=False) == call[:-1]  # decode -> encode is the identity


def test_tool_conversations_are_prefix_stable_and_maskable(tokenizer) -> None:
    conversation = _tool_conversation({"a": 3, "b": 4})
    ids, mask = tokenize_conversation(tokenizer, conversation)  # raises unless prefix-stable
    with_tools = list(tokenizer.apply_chat_template(conversation, tools=[CALC_TOOL], return_dict=False))
    offered = tokenizer.convert_ids_to_tokens(with_tools[: len(with_tools) - len(ids)])
    assert offered == ["<|im_start|>", "system", "<tools>", '"calc", ', "[", '"a"', ",", '"b"', "]", "</tools>",
                       "<|im_end|>"]  # fmt: skip
    assert with_tools[len(offered) :] == ids
    trained = [t for t, m in zip(tokenizer.convert_ids_to_tokens(ids), mask, strict=True) if m]
    assert trained[0] == tiny.TOOL_CALL_START and trained[-2:] == ["7", "<|im_end|>"]
    # Arguments as a JSON string (the OpenAI wire form) render as written; parsed, as the template spaces them.
    assert tokenize_conversation(tokenizer, _tool_conversation('{ "a" : 3 , "b" : 4 }'))[0] == ids


def test_words_with_spaces_are_added_tokens(tokenizer) -> None:
    ids = tokenizer.encode('<tool_call>{"name": "calc", "arguments": {', add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens(ids) == [
        tiny.TOOL_CALL_START,
        '"calc", ',
        tiny.TOOL_CALL_ARGUMENTS,
        "{",
    ]
    with pytest.raises(ValueError):
        tiny.build_tokenizer([" calc"])


def test_assistant_mask_covers_replies_and_their_end_token(tokenizer) -> None:
    conversation = agent.demonstrations(1, seed=0, tool_fraction=1.0)[0]
    ids, mask = tokenize_conversation(tokenizer, conversation)
    assert len(ids) == len(mask)
    assert ids == _ids(tokenizer, conversation, False)
    trained = [tok for tok, m in zip(tokenizer.convert_ids_to_tokens(ids), mask, strict=True) if m]
    task = conversation[1]["content"].split()
    assert trained == [*task, "<|im_end|>", conversation[3]["content"], "<|im_end|>"]


def test_same_seed_same_model(tokenizer) -> None:
    a = tiny.build_model(tokenizer, seed=7)
    b = tiny.build_model(tokenizer, seed=7)
    c = tiny.build_model(tokenizer, seed=8)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.embed_tokens.weight"], sc["model.embed_tokens.weight"])
    cfg = a.config
    assert cfg.head_dim == 64 and cfg.num_key_value_heads == 1 and not cfg.tie_word_embeddings
    assert next(a.parameters()).dtype == torch.float32
    assert a.generation_config.eos_token_id == tokenizer.convert_tokens_to_ids(tiny.IM_END)


def test_building_a_model_leaves_global_rng_alone(tokenizer) -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    tiny.build_model(tokenizer, seed=0)
    assert torch.equal(torch.rand(3), expected)


def test_save_and_reload_gives_same_logits(tokenizer, tmp_path: Path) -> None:
    model = tiny.build_model(tokenizer, seed=3)
    out = tiny.save(model, tokenizer, tmp_path / "tiny")
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]

    loaded_tok = AutoTokenizer.from_pretrained(out)
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    messages = [{"role": "user", "content": "what is 2 + 5 ?"}]
    ids = _ids(tokenizer, messages, True)
    assert _ids(loaded_tok, messages, True) == ids
    assert loaded_tok.eos_token_id == tokenizer.eos_token_id
    assert loaded_tok.pad_token_id == tokenizer.pad_token_id
    batch = torch.tensor([ids])
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(batch).logits, model(batch).logits, rtol=0, atol=1e-6)


def test_warm_start_lowers_the_loss(tokenizer) -> None:
    model = tiny.build_model(tokenizer, seed=0)
    conversations = agent.demonstrations(256, seed=1)
    metrics = warm_start(model, tokenizer, conversations, steps=40, lr=3e-3, seed=0, progress=False)
    assert metrics["steps"] == 40 and metrics["examples"] == 256
    assert metrics["final_loss"] < 0.6 * metrics["initial_loss"], metrics
    assert not model.training


def test_tasks() -> None:
    every = agent.tasks()
    assert len(every) == 55
    assert len({t["task_id"] for t in every}) == 55
    assert all(t["a"] >= 0 and t["b"] >= 0 and t["answer"] == t["a"] + t["b"] < 10 for t in every)
    assert agent.tasks(8, seed=1) == agent.tasks(8, seed=1)
    assert agent.tasks(8, seed=1) != agent.tasks(8, seed=2)
    assert len({t["task_id"] for t in agent.tasks(8, seed=1)}) == 8


def _sum_asked(question: str) -> int:
    _what, _is, a, _plus, b, _mark = question.split()
    return int(a) + int(b)


@pytest.mark.parametrize("fraction", [0.2, 0.3])
def test_demonstrations_use_the_tool_at_the_requested_rate(tokenizer, fraction: float) -> None:
    demos = agent.demonstrations(1000, seed=0, tool_fraction=fraction)
    assert demos == agent.demonstrations(1000, seed=0, tool_fraction=fraction)
    tool = [d for d in demos if len(d) == 4]
    direct = [d for d in demos if len(d) == 2]
    assert len(tool) + len(direct) == 1000
    assert abs(len(tool) / 1000 - fraction) < 0.01
    unk = tokenizer.unk_token_id
    for conv in tool:
        user, call, result, answer = conv
        a, b = (int(w) for w in user["content"].split()[2:5:2])
        assert user == {"role": "user", "content": f"what is {a} + {b} ?"}
        assert call == {"role": "assistant", "content": f"calc {a} + {b}"}
        assert result == {"role": "user", "content": f"= {a + b}"}
        assert answer == {"role": "assistant", "content": str(a + b)}
    guesses = [d[1]["content"] for d in direct]
    assert all(g.isdigit() and int(g) <= 9 for g in guesses)
    correct = sum(d[1]["content"] == str(_sum_asked(d[0]["content"])) for d in direct)
    assert correct / len(direct) < 0.2  # direct answers are guesses, not sums
    for conv in demos[:50]:
        assert unk not in _ids(tokenizer, conv, False)


class _FakeChatServer:
    """A minimal OpenAI-compatible endpoint that answers from a script and records requests."""

    def __init__(self, replies: list[str]) -> None:
        self.replies = list(replies)
        self.requests: list[dict] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append(body)
                content = server.replies.pop(0)
                payload = json.dumps(
                    {
                        "id": "x",
                        "object": "chat.completion",
                        "created": 0,
                        "model": body["model"],
                        "choices": [
                            {
                                "index": 0,
                                "finish_reason": "stop",
                                "message": {"role": "assistant", "content": content},
                            }
                        ],
                    }
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fake_server() -> Iterator[Callable[[list[str]], _FakeChatServer]]:
    servers: list[_FakeChatServer] = []

    def make(replies: list[str]) -> _FakeChatServer:
        servers.append(_FakeChatServer(replies))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


TASK = {"task_id": "3+4", "a": 3, "b": 4, "answer": 7}


def test_rollout_with_the_tool(fake_server) -> None:
    server = fake_server([" calc 3 + 4", " 7"])
    assert agent.rollout(TASK, server.base_url, "key", "tether-policy") == 1.0
    first, second = server.requests
    assert first["messages"] == [{"role": "user", "content": "what is 3 + 4 ?"}]
    assert first["temperature"] == 1.0 and first["model"] == "tether-policy"
    assert second["messages"] == [
        {"role": "user", "content": "what is 3 + 4 ?"},
        {"role": "assistant", "content": " calc 3 + 4"},  # exactly as returned
        {"role": "user", "content": "= 7"},
    ]


def test_rollout_tool_result_comes_from_the_call_not_the_task(fake_server) -> None:
    server = fake_server(["calc 3 + 5", "8"])
    assert agent.rollout(TASK, server.base_url, "key", "m") == 0.0
    assert server.requests[1]["messages"][-1] == {"role": "user", "content": "= 8"}


@pytest.mark.parametrize(
    ("replies", "reward", "calls"), [(["7"], 1.0, 1), (["6"], 0.0, 1), (["calc 3 +"], 0.0, 1)]
)
def test_rollout_direct_and_malformed(fake_server, replies: list[str], reward: float, calls: int) -> None:
    server = fake_server(replies)
    assert agent.rollout(TASK, server.base_url, "key", "m") == reward
    assert len(server.requests) == calls


def _reply_probability_of(conversation: list[dict]) -> Callable:
    from tether.demo.warmstart import reply_probability

    return lambda model, tokenizer, seed: reply_probability(model, tokenizer, conversation)


@pytest.mark.parametrize("reached_at", ["start", "later", "never"])
def test_warm_start_trains_until_its_check_is_reached(tokenizer, reached_at) -> None:
    """cli.train_until: more rounds (each a real warm start) only while the example's check is short of
    its target, at most max_rounds; a model that has the property already is left bit for bit."""
    from tether.cli import train_until

    conversations = agent.demonstrations(64, seed=0)
    check = _reply_probability_of(conversations[0])
    model = tiny.build_model(tokenizer, seed=0)
    warm_start(model, tokenizer, conversations, steps=20, lr=3e-3, seed=0, progress=False)
    start = check(model, tokenizer, 0)
    target = {"start": start / 2, "later": min(0.99, start + 0.05), "never": 1.01}[reached_at]
    scores: list[float] = []
    example = {
        "WARM_START": {"steps": 20, "lr": 3e-3, "until": target, "more_steps": 10, "max_rounds": 8},
        "warm_start_check": lambda m, t, s: scores.append(check(m, t, s)) or scores[-1],
    }
    before = {k: v.clone() for k, v in model.state_dict().items()}
    train_until("calculator", example, model, tokenizer, conversations, seed=0)
    changed = any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    if reached_at == "start":
        assert scores == [start] and not changed
    elif reached_at == "later":
        assert 1 < len(scores) <= 9 and scores[-1] >= target > max(scores[:-1]) and changed
    else:
        assert len(scores) == 9 and changed  # the first check and one after each of the 8 rounds
