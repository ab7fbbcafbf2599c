"""Writes this recipe's tiny Qwen3-MoE checkpoint (random weights, a word-level tokenizer with a Qwen-style chat
template that shows tools, tool calls and tool results) and generated agent traces to train on.

Run: python make_checkpoint.py [DIR] [--long-tokens N] (DIR default: this directory). It writes DIR/checkpoint
(config.json, model.safetensors, tokenizer files with the chat template), DIR/traces.jsonl and
DIR/heldout_traces.jsonl; with --long-tokens also DIR/long_traces.jsonl and DIR/heldout_long_traces.jsonl,
one conversation of at least N tokens each (for a long run: the tokenizer, not the tiny model, is what a
large model needs from here).
A trace: a user asks for a lab reading, the assistant calls a sensor tool, the tool answers, the assistant
reports; several such rounds per conversation, so the later answers can copy from the earlier ones.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools><|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}<|im_start|>user\n{{ message.content }}<|im_end|>\n"
    "{%- elif message.role == 'assistant' %}<|im_start|>assistant\n"
    "{% if message.content %}{{ message.content }}{% endif %}"
    "{% for call in message.tool_calls or [] %}<tool_call>\n"
    "{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}\n</tool_call>{% endfor %}"
    "<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "read_sensor", "description": "read a lab sensor",
                                           "parameters": {"type": "object",
                                                          "properties": {"sensor": {"type": "string"}}}}}]
SENSORS = {"t1": "temperature", "h2": "humidity", "p3": "pressure", "c4": "co2"}


def trace(rng: random.Random, rounds: int) -> dict:
    messages = [{"role": "system", "content": "You run the lab ."}]
    for _ in range(rounds):
        sensor = rng.choice(sorted(SENSORS))
        value = str(rng.randint(10, 99))
        messages += [
            {"role": "user", "content": f"What is the {SENSORS[sensor]} ?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "read_sensor", "arguments": {"sensor": sensor}}}]},
            {"role": "tool", "content": f"{value} units"},
            {"role": "assistant", "content": f"The {SENSORS[sensor]} is {value} units ."},
        ]
    return {"messages": messages, "tools": TOOLS}


def tokenizer(words: set[str]):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {s: i for i, s in enumerate(SPECIALS)} | {w: len(SPECIALS) + i for i, w in enumerate(sorted(words))}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  additional_special_tokens=SPECIALS[1:])
    tok.chat_template = TEMPLATE
    return tok


def main(out: Path, long_tokens: int = 0) -> Path:
    import torch
    from tokenizers import pre_tokenizers
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    rng = random.Random(0)
    train = [trace(rng, rng.randint(2, 6)) for _ in range(64)]
    held = [trace(rng, 6) for _ in range(4)]
    probe = tokenizer(set())
    words: set[str] = set()
    for record in train + held:
        text = probe.apply_chat_template(record["messages"], tools=record["tools"], tokenize=False)
        for s in SPECIALS:
            text = text.replace(s, " ")
        words |= {w for w, _ in pre_tokenizers.Whitespace().pre_tokenize_str(text)}
    tok = tokenizer(words | {str(v) for v in range(10, 100)})
    ckpt = out / "checkpoint"
    tok.save_pretrained(str(ckpt))
    config = Qwen3MoeConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                            num_experts_per_tok=2, moe_intermediate_size=32, max_position_embeddings=4096,
                            pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).save_pretrained(str(ckpt))
    outputs = {"traces.jsonl": train, "heldout_traces.jsonl": held}
    if long_tokens:
        for name, seed in (("long_traces.jsonl", 1), ("heldout_long_traces.jsonl", 2)):
            outputs[name] = [long_trace(tok, random.Random(seed), long_tokens)]
    for name, records in outputs.items():
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in records))
    return ckpt


def long_trace(tok, rng: random.Random, min_tokens: int) -> dict:
    """One conversation of at least ``min_tokens`` tokens."""
    rounds = 8
    while True:
        record = trace(rng, rounds)
        text = tok.apply_chat_template(record["messages"], tools=TOOLS, tokenize=False)
        count = len(tok(text, add_special_tokens=False)["input_ids"])
        if count >= min_tokens:
            return record
        rounds = int(rounds * min_tokens / count * 1.05) + 1


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", nargs="?", default=str(Path(__file__).resolve().parent))
    parser.add_argument("--long-tokens", type=int, default=0)
    args = parser.parse_args()
    print(main(Path(args.dir), args.long_tokens))
