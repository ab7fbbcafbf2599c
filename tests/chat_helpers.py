"""A tiny word-level tokenizer with a Qwen-style chat template (tools, tool calls, tool results), built locally."""

from __future__ import annotations

import json
from pathlib import Path

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_SYSTEM = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools><|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{%- endif %}"
)
_ASSISTANT = (
    "{% if message.content %}{{ message.content }}{% endif %}"
    "{% for call in message.tool_calls or [] %}<tool_call>\n"
    "{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}\n</tool_call>{% endfor %}"
    "<|im_end|>\n"
)


def chat_template(marked: bool) -> str:
    """Qwen2.5's layout; ``marked`` wraps each assistant turn's content in {% generation %} markers."""
    body = "{% generation %}" + _ASSISTANT + "{% endgeneration %}" if marked else _ASSISTANT
    return (
        _SYSTEM + "{%- for message in messages %}"
        "{%- if message.role == 'user' %}<|im_start|>user\n{{ message.content }}<|im_end|>\n"
        "{%- elif message.role == 'assistant' %}<|im_start|>assistant\n" + body +
        "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
        "</tool_response><|im_end|>\n"
        "{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


TOOLS = [{"type": "function", "function": {"name": "read_sensor", "description": "read a sensor",
                                           "parameters": {"type": "object",
                                                          "properties": {"sensor": {"type": "string"}}}}}]
CONVERSATION = [
    {"role": "system", "content": "You run the lab ."},
    {"role": "user", "content": "What is the temperature ?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "read_sensor", "arguments": {"sensor": "t1"}}}]},
    {"role": "tool", "content": "21 C"},
    {"role": "assistant", "content": "It is 21 C ."},
    {"role": "user", "content": "Thanks"},
    {"role": "assistant", "content": "Done ."},
]
SHORT = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello ."}]


def _word_tokenizer(vocab: dict[str, int], template: str):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  additional_special_tokens=SPECIALS[1:])
    tok.chat_template = template
    return tok


def make_chat_tokenizer(folder: Path, marked: bool = False, conversations: list | None = None,
                        extra_words: tuple[str, ...] = ()) -> Path:
    """Save a tokenizer whose vocabulary holds every word of ``conversations`` rendered (ids: the specials
    0-2, then the words sorted) into ``folder``; returns it."""
    from tokenizers import pre_tokenizers

    conversations = conversations or [(CONVERSATION, TOOLS), (SHORT, None)]
    template = chat_template(marked)
    probe = _word_tokenizer({s: i for i, s in enumerate(SPECIALS)}, template)
    words = set(extra_words)
    for messages, tools in conversations:
        text = probe.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=False)
        for s in SPECIALS:
            text = text.replace(s, " ")
        words |= {w for w, _ in pre_tokenizers.Whitespace().pre_tokenize_str(text)}
    vocab = {s: i for i, s in enumerate(SPECIALS)} | {w: len(SPECIALS) + i for i, w in enumerate(sorted(words))}
    tok = _word_tokenizer(vocab, template)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(folder))
    return folder


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path
