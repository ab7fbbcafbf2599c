"""Conversations (``data.kind chat``): ``messages`` rendered with the checkpoint's chat template, loss on chosen roles.

A record holds ``messages`` (the field or column ``data.column``), a list of ``{"role", "content"}`` with
``tool_calls`` on assistant messages and ``tool`` messages for their results where present, and an
optional ``tools`` list (the function schemas the template shows): the format transformers, TRL and
LLaMA-Factory read. Roles: system, developer, user, assistant, tool.

Rendering is the tokenizer's own ``apply_chat_template`` (transformers), so the ids are the ones the
checkpoint saw. Which tokens the loss counts (``data.loss_roles``, default assistant):

- a template with ``{% generation %}`` markers, loss on assistant turns only: transformers'
  ``return_assistant_tokens_mask`` (the spans the template marks);
- a known template that has a marked form (``chat_template.KNOWN_MARKED``: Qwen3's), loss on assistant turns
  only: the ids of the template itself, the mask of its marked form, which must render the same text;
- any other template or role set: by rendering. A message's span is the text that rendering it adds to
  the conversation before it (for an assistant turn, to that conversation with the generation prompt, so
  the ``<|im_start|>assistant`` header the user's side supplies is not a target); a token is a target when
  it starts inside a span. Each message is rendered after the first message and the one before it, which
  is linear in the conversation (a 17K-message trace of 230K tokens in about 30 s); the pieces must add up
  to exactly the whole rendering, else every prefix ``messages[:i]`` is rendered instead (quadratic, so
  only up to ``PREFIX_RENDER_MAX_MESSAGES``). A template that renders a turn differently once later turns
  follow (Qwen3's empty thinking block on the last turn) and has no known marked form is refused with the
  fix: add generation markers (``data.chat_template`` gives a template in place of the tokenizer's).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from megaseq.data.chat_template import marked_form, read_chat_template, write_chat_template

ROLES = ("system", "developer", "user", "assistant", "tool")
PREFIX_RENDER_MAX_MESSAGES = 256  # beyond this, rendering every prefix (quadratic) is refused
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


def load_chat_tokenizer(path: str, chat_template: str = "") -> Any:
    """The transformers tokenizer of a checkpoint directory (or the directory of a tokenizer.json), which
    must carry a chat template, or be given one (``data.chat_template``: ``chat_template.read_chat_template``)."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ImportError("data.kind chat renders with transformers: pip install 'megaseq[hf]'") from None
    p = Path(path).expanduser()
    folder = p if p.is_dir() else p.parent
    if path in ("dna", "protein") or not (folder / "tokenizer_config.json").is_file():
        raise ValueError(f"data.tokenizer {path!r}: data.kind chat needs the checkpoint's tokenizer directory "
                         "(tokenizer.json, tokenizer_config.json and its chat template); set --data.tokenizer DIR")
    tok = AutoTokenizer.from_pretrained(str(folder))
    if chat_template:
        tok.chat_template = read_chat_template(chat_template)
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"data.tokenizer {folder}: the tokenizer has no chat template (no 'chat_template' in "
                         "tokenizer_config.json, no chat_template.jinja); use the checkpoint's own tokenizer "
                         "directory, or give one with --data.chat_template FILE")
    return tok


def check_record(record: Any, column: str, where: str) -> tuple[list[dict[str, Any]], list[Any] | None]:
    """(messages, tools) of one record, or one ValueError naming ``where`` (file and line) and the fix."""
    messages = record.get(column) if isinstance(record, dict) else None
    if not isinstance(messages, list) or not messages:
        found = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ValueError(f"{where}: no {column!r} list of messages (found {found}); each record needs "
                         f"'{column}': [{{'role': ..., 'content': ...}}, ...] (set data.column to its field)")
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ROLES:
            raise ValueError(f"{where}: message {i} has role {role!r}; roles are {', '.join(ROLES)}: rename it "
                             "(e.g. human -> user, gpt -> assistant, function -> tool)")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise ValueError(f"{where}: message {i} content is {type(content).__name__}; give a string (or a "
                             "list of content parts)")
        if "tool_calls" in m and m["tool_calls"] is not None and not isinstance(m["tool_calls"], list):
            raise ValueError(f"{where}: message {i} tool_calls must be a list of calls")
    tools = record.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise ValueError(f"{where}: 'tools' must be a list of tool (function) schemas")
    return messages, tools or None


class ChatRenderer:
    """Conversations -> (ids ``[n]`` int32, targets ``[n]`` bool) with a checkpoint's tokenizer and template."""

    kind = "chat"

    def __init__(self, tokenizer: Any, loss_roles: tuple[str, ...] = ("assistant",)) -> None:
        self.tok, self.loss_roles = tokenizer, tuple(loss_roles)
        self.num_ids = len(tokenizer)
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = next((i for i in (tokenizer.pad_token_id, self.eos_id) if i is not None), 0)
        marked = bool(_GENERATION.search(tokenizer.chat_template))
        self.marked = None if marked else marked_form(tokenizer.chat_template)
        assistant_only = self.loss_roles == ("assistant",)
        self.method = "prefix"
        if assistant_only and (marked or self.marked):
            self.method = "generation" if marked else "marked form"

    def check_vocab(self, model_vocab_size: int) -> None:
        if self.num_ids > model_vocab_size:
            raise ValueError(f"data.tokenizer has {self.num_ids} ids but the model's vocabulary has "
                             f"{model_vocab_size}: use the checkpoint's own tokenizer")

    def _text(self, messages: list[dict[str, Any]], tools: Any, prompt: bool = False) -> str:
        if not messages:
            return ""
        return self.tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=prompt)

    def render(self, messages: list[dict[str, Any]], tools: Any = None,
               where: str = "") -> tuple[np.ndarray, np.ndarray]:
        try:
            if self.method == "generation":
                out = self.tok.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True,
                                                   return_assistant_tokens_mask=True)
                return np.asarray(out["input_ids"], np.int32), np.asarray(out["assistant_masks"], bool)
            if self.method == "marked form":
                return self._by_marked_form(messages, tools, where)
            return self._by_prefixes(messages, tools, where)
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001  (jinja raises its own types for a template that refuses a message)
            raise ValueError(f"{where}: the chat template could not render this conversation "
                             f"({type(e).__name__}: {e}); check its roles and order against the template") from None

    def _by_marked_form(self, messages: list[dict[str, Any]], tools: Any,
                        where: str) -> tuple[np.ndarray, np.ndarray]:
        """The ids and assistant mask of the known template's marked form, which must render the original's text."""
        kw = {"tools": tools, "chat_template": self.marked}
        if self.tok.apply_chat_template(messages, tokenize=False, **kw) != self._text(messages, tools):
            raise ValueError(f"{where}: the generation-marked form of this chat template renders this conversation "
                             "differently from the template itself; give a template with {% generation %} markers "
                             "(--data.chat_template FILE) or set data.loss_roles")
        out = self.tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                                           **kw)
        return np.asarray(out["input_ids"], np.int32), np.asarray(out["assistant_masks"], bool)

    def _by_prefixes(self, messages: list[dict[str, Any]], tools: Any, where: str) -> tuple[np.ndarray, np.ndarray]:
        text = self._text(messages, tools)
        spans = self._local_spans(messages, tools, text)
        if spans is None:
            if len(messages) > PREFIX_RENDER_MAX_MESSAGES:
                raise ValueError(f"{where}: the chat template renders a turn differently depending on the turns "
                                 f"around it, and this conversation's {len(messages)} messages are too many to render "
                                 "every prefix; add {% generation %} markers around assistant content in the template")
            spans = self._prefix_spans(messages, tools, text, where)
        enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        starts = np.asarray([s for s, _ in enc["offset_mapping"]], np.int64)
        targets = np.zeros(len(starts), bool)
        for lo, hi in spans:
            targets |= (starts >= lo) & (starts < hi)
        return np.asarray(enc["input_ids"], np.int32), targets

    def _local_spans(self, messages: list[dict[str, Any]], tools: Any, text: str) -> list[tuple[int, int]] | None:
        """Spans from rendering each message after the first message and the one before it (linear in the
        conversation); None unless the pieces add up to exactly ``text``."""
        pieces, spans, offset = [self._text(messages[:1], tools)], [], 0
        if messages[0]["role"] in self.loss_roles:
            spans.append((len(self._text([], tools, prompt=messages[0]["role"] == "assistant")), len(pieces[0])))
        for i in range(1, len(messages)):
            offset += len(pieces[-1])
            context = messages[:1] + messages[max(i - 1, 1):i]
            before, upto = self._text(context, tools), self._text(context + [messages[i]], tools)
            if not upto.startswith(before):
                return None
            pieces.append(upto[len(before):])
            if messages[i]["role"] in self.loss_roles:
                start = self._text(context, tools, prompt=messages[i]["role"] == "assistant")
                if not (upto.startswith(start) and start.startswith(before)):
                    return None
                spans.append((offset + len(start) - len(before), offset + len(pieces[-1])))
        return spans if "".join(pieces) == text else None

    def _prefix_spans(self, messages: list[dict[str, Any]], tools: Any, text: str,
                      where: str) -> list[tuple[int, int]]:
        """Spans from rendering every prefix of the conversation (quadratic; for short conversations whose
        template looks further back than one message)."""
        spans = []
        for i, m in enumerate(messages):
            if m["role"] not in self.loss_roles:
                continue
            before = self._text(messages[:i], tools, prompt=m["role"] == "assistant")
            upto = self._text(messages[:i + 1], tools)
            if not (text.startswith(upto) and upto.startswith(before)):
                raise ValueError(f"{where}: the chat template renders message {i} differently once later messages "
                                 "follow (it rewrites earlier turns), so its span cannot be found by prefixes; "
                                 "add {% generation %} markers around assistant content in the template")
            spans.append((len(before), len(upto)))
        return spans

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model")


def copy_tokenizer_files(tokenizer: str, out_dir: str | Path, chat_template: str = "") -> list[str]:
    """Copy the tokenizer files (and chat template) of ``data.tokenizer`` when it is a directory or a
    tokenizer.json into an HF export, so the export loads with its tokenizer; ``chat_template``
    (``data.chat_template``) replaces the tokenizer's template there. Returns the names copied."""
    import shutil

    p = Path(tokenizer).expanduser()
    folder = p if p.is_dir() else p.parent
    if tokenizer in ("dna", "protein") or not folder.is_dir() or not Path(out_dir).is_dir():
        return []
    template = read_chat_template(chat_template) if chat_template else None  # a bad one: nothing copied
    copied = []
    for name in TOKENIZER_FILES:
        if (folder / name).is_file() and not (Path(out_dir) / name).exists():
            shutil.copyfile(folder / name, Path(out_dir) / name)
            copied.append(name)
    if template is not None:
        write_chat_template(template, out_dir)
        copied = sorted({*copied, "chat_template.jinja"} - {"chat_template.json"})
    return copied
