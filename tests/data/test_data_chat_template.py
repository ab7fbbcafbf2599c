"""Chat templates: Qwen3's real template (ids of the template itself, the assistant mask of its marked form) and
data.chat_template (a file, directory or config in place of the tokenizer's; refused when missing or invalid;
written into the HF export)."""

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from chat_helpers import CONVERSATION, SHORT, TOOLS, make_chat_tokenizer, write_jsonl  # noqa: E402
from megaseq.config import DataConfig  # noqa: E402
from megaseq.data import build_data  # noqa: E402
from megaseq.data.chat import ChatRenderer, copy_tokenizer_files, load_chat_tokenizer  # noqa: E402
from megaseq.data.chat_template import marked_form, read_chat_template  # noqa: E402

QWEN3 = Path(__file__).resolve().parent.parent / "fixtures" / "qwen3_chat_template.jinja"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
            "<tool_response>", "</tool_response>"]
CALL = {"type": "function", "function": {"name": "read_sensor", "arguments": {"sensor": "t1"}}}
# an agent run after its last user turn: each assistant turn carries its reasoning
REASONING = [
    {"role": "user", "content": "What is the temperature ?"},
    {"role": "assistant", "content": "", "reasoning_content": "check t1", "tool_calls": [CALL]},
    {"role": "tool", "content": "21 C"},
    {"role": "assistant", "content": "It is 21 C .", "reasoning_content": "report it"},
]
CALL_RUN = '<tool_call> {" name ": " read_sensor ", " arguments ": {" sensor ": " t1 "}} </tool_call> <|im_end|>'
# written out: the target runs of each conversation under Qwen3's template
TARGET_RUNS = {
    "conversation": [CALL_RUN, "It is 21 C . <|im_end|>", "Done . <|im_end|>"],  # not the last turn's empty <think>
    "reasoning": ["<think> check t1 </think> " + CALL_RUN, "<think> report it </think> It is 21 C . <|im_end|>"],
    "short": ["Hello . <|im_end|>"],
}
CONVERSATIONS = {"conversation": (CONVERSATION, TOOLS), "reasoning": (REASONING, TOOLS), "short": (SHORT, None)}


def word_tokenizer(folder: Path, template: str) -> Path:
    """A word-level tokenizer (Qwen3's added tokens whole) whose vocabulary holds every word of CONVERSATIONS
    rendered by ``template``; saved with it as its chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    def build(vocab: dict[str, int]) -> PreTrainedTokenizerFast:
        tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIALS[0]))
        tk.pre_tokenizer = pre_tokenizers.Whitespace()
        tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token=SPECIALS[0],
                                      additional_special_tokens=SPECIALS[1:])
        tok.chat_template = template
        return tok

    probe, words = build({s: i for i, s in enumerate(SPECIALS)}), set()
    for messages, tools in CONVERSATIONS.values():
        text = probe.apply_chat_template(messages, tools=tools, tokenize=False)
        for s in SPECIALS:
            text = text.replace(s, " ")
        words |= {w for w, _ in pre_tokenizers.Whitespace().pre_tokenize_str(text)}
    vocab = {s: i for i, s in enumerate(SPECIALS)} | {w: len(SPECIALS) + i for i, w in enumerate(sorted(words))}
    build(vocab).save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> ChatRenderer:
    return ChatRenderer(load_chat_tokenizer(str(word_tokenizer(tmp_path_factory.mktemp("q3"), QWEN3.read_text()))))


def target_runs(tok, ids, targets) -> list[str]:
    names, runs, current = tok.convert_ids_to_tokens([int(i) for i in ids]), [], []
    for name, t in zip(names + [""], list(targets) + [False]):
        if t:
            current.append(name)
        elif current:
            runs, current = runs + [" ".join(current)], []
    return runs


def check(renderer: ChatRenderer, name: str) -> None:
    messages, tools = CONVERSATIONS[name]
    ids, targets = renderer.render(messages, tools, name)
    expected = renderer.tok.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True)
    assert ids.tolist() == list(expected["input_ids"])  # the template's own ids
    assert target_runs(renderer.tok, ids, targets) == TARGET_RUNS[name]


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_qwen3_ids_are_the_templates_and_mask_is_the_assistant_turns(qwen3, name):
    assert qwen3.method == "marked form"
    check(qwen3, name)


def test_qwen3_rewrites_earlier_turns_so_rendering_by_prefixes_is_refused(qwen3):
    text = qwen3._text(CONVERSATION, TOOLS)
    assert "<|im_start|>assistant\nIt is 21 C .<|im_end|>" in text  # no thinking block once a user turn follows
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nDone .<|im_end|>\n")
    alone = qwen3._text(CONVERSATION[:5], TOOLS)
    assert alone.endswith("<think>\n\n</think>\n\nIt is 21 C .<|im_end|>\n") and not text.startswith(alone)
    with pytest.raises(ValueError, match="generation %} markers"):
        ChatRenderer(qwen3.tok, ("assistant", "tool")).render(CONVERSATION, TOOLS, "t.jsonl line 1")


MORE = [  # the marked form must render every one exactly as the original does
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "<think>\nx\n</think>\n\nb"}],
    [{"role": "system", "content": "s"}, {"role": "user", "content": "a"},
     {"role": "assistant", "content": "b", "reasoning_content": "r"}, {"role": "user", "content": "c"},
     {"role": "assistant", "content": "d", "reasoning_content": "\n"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "tool_calls": [CALL, CALL]},
     {"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}, {"role": "assistant", "content": "e"},
     {"role": "user", "content": "<tool_response>x</tool_response>"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}],
]


@pytest.mark.parametrize("prompt", [False, True])
def test_qwen3_marked_form_renders_the_same_text(qwen3, prompt):
    for messages in MORE + [m for m, _ in CONVERSATIONS.values()]:
        for tools in (None, TOOLS):
            kw = {"tools": tools, "tokenize": False, "add_generation_prompt": prompt}
            assert (qwen3.tok.apply_chat_template(messages, chat_template=qwen3.marked, **kw)
                    == qwen3.tok.apply_chat_template(messages, **kw))


@pytest.mark.parametrize("broken, fails", [
    # the empty thinking block inside the mask
    (lambda t: t.replace("        {%- if think and not reasoning_content.strip('\\n') %}", "        {%- generation %}"
                         "{%- if think and not reasoning_content.strip('\\n') %}", 1).replace(
        "{%- endif %}\n        {%- generation %}\n", "{%- endif %}\n", 1), "mask"),
    # user turns inside the mask
    (lambda t: t.replace("{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}",
                         "{% generation %}{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}"
                         "{% endgeneration %}", 1), "mask"),
    # a thinking block on every turn (a training variant that changes the text): refused, not trained on
    (lambda t: t.replace("{%- set think = loop.index0 > ns.last_query_index and", "{%- set think = true or", 1),
     "text"),
])
def test_broken_marked_forms_fail(qwen3, broken, fails):
    bad = ChatRenderer(qwen3.tok)
    bad.marked = broken(qwen3.marked)
    assert bad.marked != qwen3.marked
    if fails == "text":
        with pytest.raises(ValueError, match="renders this conversation differently"):
            bad.render(CONVERSATION, TOOLS, "t.jsonl line 1")
        return
    with pytest.raises(AssertionError):
        check(bad, "conversation")


def test_chat_template_setting_overrides_the_tokenizers(tmp_path, qwen3):
    folder = make_chat_tokenizer(tmp_path / "tok")  # its own template is Qwen2.5's layout
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"chat_template": QWEN3.read_text()}))
    other = word_tokenizer(tmp_path / "other", QWEN3.read_text())
    for source in (QWEN3, config, other):
        tok = load_chat_tokenizer(str(folder), str(source))
        assert tok.chat_template == QWEN3.read_text() and ChatRenderer(tok).method == "marked form"
    path = write_jsonl(tmp_path / "t.jsonl", [{"messages": SHORT}] * 2)
    cfg = DataConfig(kind="chat", tokenizer=str(other), train=[str(path)], seq_len=31, chat_template=str(QWEN3))
    data = build_data(cfg, vocab_size=256)
    assert f"data.chat_template {QWEN3}" in data.notes[0] and "known marked form;" in data.notes[0]


@pytest.mark.parametrize("text, words", [
    (None, ["no such file", "Jinja file"]),
    ("{% for message in messages %}{{ message.content }}", ["line 1", "not a valid Jinja template"]),
    ("{{ bos_token }}", ["never reads 'messages'"]),
])
def test_missing_or_invalid_template_is_one_clear_error(tmp_path, text, words):
    path = tmp_path / "template.jinja"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ValueError) as e:
        read_chat_template(str(path))
    for word in ["data.chat_template", str(path), *words]:
        assert word in str(e.value)
    with pytest.raises(ValueError, match="data.chat_template renders conversations"):
        DataConfig(kind="text", chat_template=str(QWEN3))


def test_export_carries_the_given_template(tmp_path):
    from transformers import AutoTokenizer

    folder, out = make_chat_tokenizer(tmp_path / "tok"), tmp_path / "hf"
    out.mkdir()
    copied = copy_tokenizer_files(str(folder), out, str(QWEN3))
    assert "chat_template.jinja" in copied
    assert AutoTokenizer.from_pretrained(str(out)).chat_template == QWEN3.read_text()
    assert marked_form(QWEN3.read_text()) is not None and marked_form(QWEN3.read_text() + "x") is None


def test_agent_recipe_trains_with_qwen3_template_and_exports_it(tmp_path):
    """Through the trainer: the tiny agent-trace recipe rendered by Qwen3's template; the export renders with it."""
    from test_data_recipes import QUIET
    from transformers import AutoTokenizer

    from conftest import agent_trace_checkpoint
    from megaseq.config import load_config
    from megaseq.train.trainer import run_training

    agent_trace_checkpoint(tmp_path)
    cfg = load_config(tmp_path / "recipe.yaml", [f"train.run_dir={tmp_path / 'run'}", f"data.chat_template={QWEN3}",
                                                 "train.eval_after=false", *QUIET])
    result = run_training(cfg)
    assert len(result.losses) == 2
    assert AutoTokenizer.from_pretrained(str(tmp_path / "run" / "hf")).chat_template == QWEN3.read_text()
    assert f"chat_template: {QWEN3}" in (tmp_path / "run" / "config.yaml").read_text()
