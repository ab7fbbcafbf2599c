"""The chat template a run renders with: ``data.chat_template`` or the tokenizer's, and marked forms of known ones.

``data.chat_template`` overrides the checkpoint tokenizer's template. It names a Jinja file, a JSON file holding
a ``chat_template`` (tokenizer_config.json, chat_template.json), a tokenizer directory (its chat_template.jinja,
chat_template.json or tokenizer_config.json), or a hub id whose tokenizer's template to use (from the local
Hugging Face cache, or the hub when it can be reached). It is checked before any model is built (it must parse
as Jinja and read ``messages``), named with its sha256 in the run's report, and written into the HF export as
chat_template.jinja (and the export's tokenizer_config.json), so the export renders as training did.

Known templates (``KNOWN_MARKED``, by the sha256 of their text): a template whose rendering of a turn depends on
the turns after it cannot be split into turns by rendering prefixes. Qwen3's is one: the last assistant turn
gets an empty ``<think>\\n\\n</think>\\n\\n`` block that the same turn lacks once a later user turn follows. For
such a template megaseq ships a form with ``{% generation %}`` markers that renders exactly the same text
(``chat.ChatRenderer`` checks that on every conversation): the ids are the original template's, the mask is
transformers' assistant mask of the marked form.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

ASSETS = Path(__file__).resolve().parent.parent / "assets"
# sha256 of a template's text (stripped) -> the asset holding its generation-marked form
KNOWN_MARKED = {
    "a55ee1b1660128b7098723e0abcd92caa0788061051c62d51cbe87d9cf1974d8": "qwen3_chat_template_marked.jinja",  # Qwen3
}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json", "tokenizer_config.json")


def template_sha(text: str) -> str:
    return hashlib.sha256(text.strip().encode()).hexdigest()


def marked_form(text: str) -> str | None:
    """The generation-marked form of a known template (``KNOWN_MARKED``), else None."""
    name = KNOWN_MARKED.get(template_sha(text))
    return (ASSETS / name).read_text() if name else None


def _from_json(path: Path) -> str | None:
    try:
        value = json.loads(path.read_text()).get("chat_template")
    except (json.JSONDecodeError, AttributeError) as e:
        raise ValueError(f"data.chat_template {path}: not a JSON object with a 'chat_template' ({e}); give a Jinja "
                         "file, or the tokenizer_config.json / chat_template.json that holds the template") from None
    if isinstance(value, list):  # named templates: [{"name": "default", "template": ...}, ...]
        value = next((t.get("template") for t in value if isinstance(t, dict) and t.get("name") == "default"), None)
    return value if isinstance(value, str) else None


def _from_dir(folder: Path) -> str | None:
    for name in _TEMPLATE_FILES:
        path = folder / name
        if path.is_file():
            text = path.read_text() if path.suffix == ".jinja" else _from_json(path)
            if text:
                return text
    return None


def _from_hub(repo_id: str) -> str | None:
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(repo_id).chat_template
    except Exception as e:  # noqa: BLE001  (no network, no such repository, no cached copy: one message below)
        raise ValueError(f"data.chat_template {repo_id!r}: not a file or directory here, and the hub id could not be "
                         f"loaded ({type(e).__name__}); give a Jinja file or a tokenizer directory holding the "
                         "template, or download the tokenizer first (huggingface-cli download REPO)") from None


def read_chat_template(value: str) -> str:
    """The template text ``data.chat_template`` names, checked (see the module docstring); one ValueError naming
    the setting, the file and the fix otherwise."""
    path = Path(value).expanduser()
    if path.is_file():
        text = _from_json(path) if path.suffix == ".json" else path.read_text()
    elif path.is_dir():
        text = _from_dir(path)
    elif _HUB_ID.match(value) and path.suffix not in (".jinja", ".json", ".j2"):
        text = _from_hub(value)
    else:
        raise ValueError(f"data.chat_template {value}: no such file or directory; give a Jinja file (.jinja), a "
                         "tokenizer directory or tokenizer_config.json holding a chat template, or a hub id")
    if not text:
        raise ValueError(f"data.chat_template {value}: holds no chat template (no chat_template.jinja, and no "
                         "'chat_template' in chat_template.json or tokenizer_config.json); point it at the template")
    check_template(text, value)
    return text


def check_template(text: str, where: str) -> None:
    """Refuse text that does not parse as a Jinja chat template (naming the line) or never reads ``messages``."""
    import jinja2
    from jinja2.ext import Extension

    class _Generation(Extension):  # parses {% generation %} ... {% endgeneration %} as transformers does
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            next(parser.stream)
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body)

    env = jinja2.Environment(extensions=[_Generation, "jinja2.ext.loopcontrols"])
    try:
        env.parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"data.chat_template {where} line {e.lineno}: not a valid Jinja template ({e.message}); "
                         "fix the template") from None
    if "messages" not in text:
        raise ValueError(f"data.chat_template {where}: the template never reads 'messages', so it is not a chat "
                         "template; point data.chat_template at the template file")


def write_chat_template(text: str, out_dir: str | Path) -> None:
    """The template into an HF export: chat_template.jinja, and the 'chat_template' of its tokenizer_config.json
    (a chat_template.json, which would take precedence, is removed)."""
    out = Path(out_dir)
    (out / "chat_template.jinja").write_text(text)
    (out / "chat_template.json").unlink(missing_ok=True)
    config = out / "tokenizer_config.json"
    if config.is_file():
        data = json.loads(config.read_text())
        if "chat_template" in data:
            data["chat_template"] = text
            config.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
