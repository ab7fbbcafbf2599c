"""Conversations: ids equal transformers' apply_chat_template, the loss mask is exactly the assistant turns."""

import json
import warnings

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from chat_helpers import CONVERSATION, SHORT, TOOLS, make_chat_tokenizer, write_jsonl  # noqa: E402
from megaseq.config import DataConfig  # noqa: E402
from megaseq.data import build_data, make_batch  # noqa: E402
from megaseq.data.chat import ChatRenderer, load_chat_tokenizer  # noqa: E402
from megaseq.data.packing import pack_whole  # noqa: E402

IGN = -100
# written out: the target tokens of CONVERSATION, as runs of consecutive targets (the tool call, the answer
# after the tool result, the last answer), each ending with the end-of-turn token the model must produce
TARGET_RUNS = [
    '< tool_call > {" name ": " read_sensor ", " arguments ": {" sensor ": " t1 "}} </ tool_call > <|im_end|>',
    "It is 21 C . <|im_end|>",
    "Done . <|im_end|>",
]
SHORT_TOKENS = ["<|im_start|>", "user", "Hi", "<|im_end|>", "<|im_start|>", "assistant", "Hello", ".", "<|im_end|>"]
SHORT_TARGETS = [0, 0, 0, 0, 0, 0, 1, 1, 1]


@pytest.fixture(scope="module", params=[False, True], ids=["prefix", "generation"])
def renderer(request, tmp_path_factory):
    """The same tokenizer with a plain template (spans by prefixes) and a marked one (transformers' mask)."""
    folder = make_chat_tokenizer(tmp_path_factory.mktemp("tok"), marked=request.param)
    r = ChatRenderer(load_chat_tokenizer(str(folder)))
    assert r.method == ("generation" if request.param else "prefix")
    return r


def target_runs(tok, ids, targets) -> list[str]:
    names = tok.convert_ids_to_tokens([int(i) for i in ids])
    runs, current = [], []
    for name, t in zip(names, targets):
        if t:
            current.append(name)
        elif current:
            runs.append(" ".join(current))
            current = []
    return runs + ([" ".join(current)] if current else [])


def check_conversation(tok, ids, targets) -> None:
    assert target_runs(tok, ids, targets) == TARGET_RUNS


def test_ids_equal_transformers_and_mask_is_the_assistant_turns(renderer):
    ids, targets = renderer.render(CONVERSATION, TOOLS)
    expected = renderer.tok.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=True, return_dict=True)
    assert ids.tolist() == list(expected["input_ids"])
    check_conversation(renderer.tok, ids, targets)


def test_short_conversation_exact_ids(renderer):
    ids, targets = renderer.render(SHORT)
    vocab = renderer.tok.get_vocab()
    assert ids.tolist() == [vocab[t] for t in SHORT_TOKENS]
    assert vocab["<|im_start|>"] == 1 and vocab["<|im_end|>"] == 2
    assert targets.astype(int).tolist() == SHORT_TARGETS


def test_prefix_mask_equals_transformers_generation_mask(tmp_path):
    """The prefix spans of the plain template against transformers' own assistant mask of the marked one."""
    plain = ChatRenderer(load_chat_tokenizer(str(make_chat_tokenizer(tmp_path / "plain"))))
    marked = load_chat_tokenizer(str(make_chat_tokenizer(tmp_path / "marked", marked=True)))
    ids, targets = plain.render(CONVERSATION, TOOLS)
    ref = marked.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=True, return_dict=True,
                                     return_assistant_tokens_mask=True)
    assert ids.tolist() == list(ref["input_ids"])
    assert targets.astype(int).tolist() == list(ref["assistant_masks"])


def test_mask_that_includes_user_turns_fails(tmp_path):
    """Broken variant: the loss on user turns too (as raw text packing does) fails the check."""
    tok = load_chat_tokenizer(str(make_chat_tokenizer(tmp_path / "tok")))
    broken = ChatRenderer(tok, ("assistant", "user"))
    ids, targets = broken.render(CONVERSATION, TOOLS)
    with pytest.raises(AssertionError):
        check_conversation(tok, ids, targets)


def test_tool_role_as_target(tmp_path):
    tok = load_chat_tokenizer(str(make_chat_tokenizer(tmp_path / "tok")))
    ids, targets = ChatRenderer(tok, ("tool",)).render(CONVERSATION, TOOLS)
    assert target_runs(tok, ids, targets) == ["<|im_start|> user < tool_response > 21 C </ tool_response > <|im_end|>"]


def test_packed_windows_keep_conversations_whole_and_mask_labels(tmp_path):
    tok = load_chat_tokenizer(str(make_chat_tokenizer(tmp_path / "tok")))
    r = ChatRenderer(tok)
    short = r.render(SHORT)
    windows = list(pack_whole([short, short, short], seq_len=19, pad_id=r.pad_id))
    assert len(windows) == 2  # two conversations of 9 fit a window of 20; the third starts the next one
    tokens, doc_ids, targets = windows[0]
    assert doc_ids.tolist() == [0] * 9 + [1] * 9 + [2] * 2 and tokens[-2:].tolist() == [r.pad_id] * 2
    batch = make_batch([tokens], [doc_ids], targets=[targets])
    v = tok.get_vocab()
    body = [IGN] * 5 + [v["Hello"], v["."], v["<|im_end|>"]]
    assert batch["labels"][0].tolist() == body + [IGN] + body + [IGN] * 2  # boundary, then the padding


def chat_cfg(tmp_path, records, **kw) -> DataConfig:
    folder = make_chat_tokenizer(tmp_path / "tok")
    path = write_jsonl(tmp_path / "train.jsonl", records)
    return DataConfig(**{"kind": "chat", "tokenizer": str(folder), "train": [str(path)], "seq_len": 63, **kw})


def test_build_data_streams_windows_and_scores_assistant_tokens(tmp_path):
    records = [{"messages": CONVERSATION, "tools": TOOLS}, {"messages": SHORT}] * 3
    held = write_jsonl(tmp_path / "held.jsonl", [{"messages": SHORT}])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match="raise data.seq_len to at least"):
            build_data(chat_cfg(tmp_path, records, heldout=[str(held)]), vocab_size=64)
    data = build_data(chat_cfg(tmp_path, records, heldout=[str(held)], seq_len=127), vocab_size=64)
    batch = data.train.next_batch()
    assert batch["input_ids"].shape == (1, 127)
    scored = batch["labels"][0][batch["labels"][0] != IGN]
    assert len(scored) == 22 + 6 + 3 + 3  # the long conversation's three target runs, then the short one's
    (window,) = data.heldout["held.jsonl"]
    assert window.targets.astype(int).tolist()[:9] == SHORT_TARGETS and not window.targets[9:].any()
    assert "assistant turns only" in data.notes[0]
    state = data.train.state_dict()
    again = build_data(chat_cfg(tmp_path, records, seq_len=127), vocab_size=64).train
    again.load_state_dict(state)
    assert again.next_batch()["input_ids"].equal(data.train.next_batch()["input_ids"])


@pytest.mark.parametrize("line, words", [
    ('{"messages": [{"role": "human", "content": "hi"}]}', ["line 2", "role 'human'", "human -> user"]),
    ('{"messages": [{"role": "user"', ["line 2", "not valid JSON"]),
    ('{"text": "hi"}', ["line 2", "no 'messages' list", "data.column"]),
])
def test_bad_records_name_file_line_and_fix(tmp_path, line, words):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"messages": SHORT}) + "\n" + line + "\n")
    cfg = DataConfig(kind="chat", tokenizer=str(make_chat_tokenizer(tmp_path / "tok")), train=[str(path)], seq_len=31)
    with pytest.raises(ValueError) as e:
        build_data(cfg, vocab_size=64)
    for word in ["bad.jsonl", *words]:
        assert word in str(e.value)


def test_tokenizer_without_template_and_bad_roles(tmp_path):
    folder = make_chat_tokenizer(tmp_path / "tok")
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    path = write_jsonl(tmp_path / "t.jsonl", [{"messages": SHORT}])
    with pytest.raises(ValueError, match="has no chat template"):
        build_data(DataConfig(kind="chat", tokenizer=str(folder), train=[str(path)]), vocab_size=64)
    with pytest.raises(ValueError, match="data.loss_roles"):
        build_data(chat_cfg(tmp_path, [{"messages": SHORT}], loss_roles=["bot"]), vocab_size=64)
    with pytest.raises(ValueError, match="no token of roles"):
        build_data(chat_cfg(tmp_path, [{"messages": SHORT[:1]}]), vocab_size=64)
    with pytest.raises(ValueError, match="checkpoint's tokenizer directory"):
        build_data(DataConfig(kind="chat", train=[str(path)]), vocab_size=64)


def test_local_spans_equal_prefix_spans(tmp_path):
    """The linear method (each message after its neighbour) against rendering every prefix."""
    r = ChatRenderer(load_chat_tokenizer(str(make_chat_tokenizer(tmp_path / "tok"))), ("assistant", "tool"))
    text = r._text(CONVERSATION, TOOLS)
    local = r._local_spans(CONVERSATION, TOOLS, text)
    assert local is not None and local == r._prefix_spans(CONVERSATION, TOOLS, text, "here")


def test_template_that_rewrites_earlier_turns_is_refused(tmp_path):
    """A template whose last turn differs (as Qwen3's empty thinking block): no local pieces add up, prefixes do not
    either, and the error names the fix."""
    folder = make_chat_tokenizer(tmp_path / "tok")
    tok = load_chat_tokenizer(str(folder))
    tok.chat_template = tok.chat_template.replace("<|im_start|>assistant\n", "<|im_start|>assistant\n{% if loop.last %}"
                                                  "Done {% endif %}", 1)
    r = ChatRenderer(tok)
    assert r._local_spans(CONVERSATION, TOOLS, r._text(CONVERSATION, TOOLS)) is None
    with pytest.raises(ValueError, match="generation %} markers"):
        r.render(CONVERSATION, TOOLS, "t.jsonl line 1")
    with pytest.raises(ValueError, match="too many to render every prefix"):
        r.render(CONVERSATION[:1] + CONVERSATION[1:] * 50, TOOLS, "t.jsonl line 1")


def test_streamed_pass_equals_the_kept_one(tmp_path, monkeypatch):
    """A training set larger than the cache is rendered again on each pass: the same windows."""
    import megaseq.data.chat_build as chat_build

    records = [{"messages": CONVERSATION, "tools": TOOLS}, {"messages": SHORT}] * 3
    kept = build_data(chat_cfg(tmp_path, records), vocab_size=64).train
    monkeypatch.setattr(chat_build, "CACHE_TOKENS", 0)
    streamed = build_data(chat_cfg(tmp_path, records), vocab_size=64).train
    for _ in range(8):  # past the end of the first pass
        a, b = kept.next_batch(), streamed.next_batch()
        assert a["input_ids"].equal(b["input_ids"]) and a["labels"].equal(b["labels"])


def test_report_scores_only_the_assistant_tokens_of_held_out_conversations(tmp_path):
    import numpy as np

    from megaseq.eval.by_position import position_loss

    held = write_jsonl(tmp_path / "held.jsonl", [{"messages": SHORT}, {"messages": CONVERSATION, "tools": TOOLS}])
    data = build_data(chat_cfg(tmp_path, [{"messages": SHORT}], heldout=[str(held)], seq_len=127), vocab_size=64)
    batches = data.heldout_batches()
    result = position_loss(lambda b: np.ones(tuple(b["labels"].shape)), batches, 4)
    # SHORT: targets at tokens 6-8, labels 5-7 (bucket 1 and 2); CONVERSATION: 22 + 6 + 3 targets
    assert int(result.count.sum()) == 3 + 22 + 6 + 3
    first = next(iter(batches["held.jsonl"]))
    assert (first["labels"][0] != IGN).nonzero().flatten().tolist() == [5, 6, 7]
