"""Chat rows to messages, and assistant-only loss masks on both tiny chat templates."""

import logging

import pytest
import tiny_models
import torch

from specdec.data.chat import (
    assistant_spans,
    build_sft_dataset,
    prompt_messages,
    to_messages,
    tokenize_chat,
)
from specdec.errors import ConfigError, DataError

MULTI_TURN = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "Write a function that adds two numbers."},
    {"role": "assistant", "content": "def add(a, b):\n    return a + b"},
    {"role": "user", "content": "Thanks! 你好 and bonne journée."},
    {"role": "assistant", "content": "You're welcome: 😀 au revoir."},
]


def masked_runs(input_ids: list[int], loss_mask: list[int], tokenizer) -> list[str]:
    """Decoded text of each maximal run of masked tokens."""
    runs, current = [], []
    for token, flag in zip(input_ids, loss_mask, strict=True):
        if flag:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer.decode(run) for run in runs]


def assert_mask_is_assistant_only(
    messages: list[dict], encoded: dict, tokenizer, end_of_turn: str | None = None
) -> None:
    """Check a loss mask against a conversation, for any tokenizer and template.

    Each assistant turn must be exactly one masked run: its content (up to surrounding
    whitespace, which some templates trim or merge with the header) followed by the
    end-of-turn token, and nothing else may be masked.
    """
    end_of_turn = end_of_turn or tokenizer.eos_token
    assert len(encoded["input_ids"]) == len(encoded["loss_mask"])
    assert set(encoded["loss_mask"]) <= {0, 1}
    runs = masked_runs(encoded["input_ids"], encoded["loss_mask"], tokenizer)
    replies = [m["content"] for m in messages if m["role"] == "assistant"]
    assert len(runs) == len(replies), runs
    for run, reply in zip(runs, replies, strict=True):
        assert run.endswith(end_of_turn), run
        assert run.removesuffix(end_of_turn).strip() == reply.strip(), run


@pytest.mark.parametrize("turns", [3, 5, 7])
def test_mask_covers_assistant_turns_only(tiny_tokenizer, turns):
    messages = MULTI_TURN[:turns]
    encoded = tokenize_chat(messages, tiny_tokenizer, max_length=4096)
    assert_mask_is_assistant_only(messages, encoded, tiny_tokenizer)
    # Exact form on these templates: content then end-of-turn, no header, no trailing newline.
    runs = masked_runs(encoded["input_ids"], encoded["loss_mask"], tiny_tokenizer)
    eot = tiny_tokenizer.eos_token
    assert runs == [m["content"] + eot for m in messages if m["role"] == "assistant"]


def test_tokens_match_the_rendered_template(tiny_tokenizer):
    encoded = tokenize_chat(MULTI_TURN, tiny_tokenizer, max_length=4096)
    text = tiny_tokenizer.apply_chat_template(MULTI_TURN, tokenize=False)
    assert tiny_tokenizer.decode(encoded["input_ids"]) == text
    # The template carries its own BOS where it wants one; none is added twice.
    if tiny_tokenizer.bos_token and text.startswith(tiny_tokenizer.bos_token):
        assert encoded["input_ids"][1] != tiny_tokenizer.bos_token_id


def test_tiny_tokenizers_round_trip_any_text(tiny_tokenizer):
    text = "Tabs\tand  spaces, 你好, émoji 😀, code: x[0] += 1\n\n<|im_end|><end_of_turn>"
    ids = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tiny_tokenizer.decode(ids) == text
    assert 256 < len(tiny_tokenizer) <= 512


def test_tiny_models_are_seeded():
    (a, _), (b, _) = tiny_models.tiny_qwen2(), tiny_models.tiny_qwen2()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    c, _ = tiny_models.tiny_qwen2(seed=1)
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


def test_the_two_templates_differ(tiny_llama, tiny_qwen2):
    a = tiny_llama[1].apply_chat_template(MULTI_TURN, tokenize=False)
    b = tiny_qwen2[1].apply_chat_template(MULTI_TURN, tokenize=False)
    assert "<|im_start|>assistant\n" in a and "<start_of_turn>model\n" in b
    assert "<start_of_turn>" not in a and "<|im_start|>" not in b


def test_spans_start_after_the_generation_prompt(tiny_tokenizer):
    text, spans = assistant_spans(MULTI_TURN[:3], tiny_tokenizer)
    head = tiny_tokenizer.apply_chat_template(
        MULTI_TURN[:2], tokenize=False, add_generation_prompt=True
    )
    assert spans == [(len(head), len(head) + len("Paris.") + len(tiny_tokenizer.eos_token))]
    assert text[spans[0][0] : spans[0][1]] == "Paris." + tiny_tokenizer.eos_token


def test_template_that_is_not_prefix_stable_is_an_error(tiny_tokenizer):
    # Drops earlier assistant turns, like templates that strip past reasoning.
    tiny_tokenizer.chat_template = (
        "{%- for m in messages -%}"
        "{%- if m['role'] != 'assistant' or loop.last -%}"
        "[{{ m['role'] }}]{{ m['content'] }}[end]"
        "{%- endif -%}{%- endfor -%}"
        "{%- if add_generation_prompt -%}[assistant]{%- endif -%}"
    )
    with pytest.raises(DataError, match="prefix-stable"):
        tokenize_chat(MULTI_TURN[:5], tiny_tokenizer, max_length=512, where="chat.jsonl row 3")


def test_template_error_names_the_row(tiny_qwen2):
    tokenizer = tiny_qwen2[1]
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    bad.append({"role": "assistant", "content": "c"})
    with pytest.raises(DataError, match="data.jsonl row 4: the chat template rejected"):
        tokenize_chat(bad, tokenizer, max_length=64, where="data.jsonl row 4")


def test_truncate_and_drop(tiny_tokenizer):
    full = tokenize_chat(MULTI_TURN, tiny_tokenizer, max_length=4096)
    n = len(full["input_ids"])
    cut = tokenize_chat(MULTI_TURN, tiny_tokenizer, max_length=n - 5)
    assert cut["input_ids"] == full["input_ids"][: n - 5]
    assert cut["loss_mask"] == full["loss_mask"][: n - 5]
    assert tokenize_chat(MULTI_TURN, tiny_tokenizer, max_length=n - 5, overflow="drop") is None
    assert tokenize_chat(MULTI_TURN, tiny_tokenizer, max_length=n, overflow="drop") == full
    with pytest.raises(ConfigError, match="overflow"):
        tokenize_chat(MULTI_TURN, tiny_tokenizer, max_length=n, overflow="wrap")


ROW_SHAPES = [
    (
        {
            "conversations": [
                {"from": "system", "value": "S"},
                {"from": "human", "value": "Q"},
                {"from": "gpt", "value": "A"},
            ]
        },
        [("system", "S"), ("user", "Q"), ("assistant", "A")],
    ),
    (
        {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]},
        [("user", "Q"), ("assistant", "A")],
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "Q"}]}]},
        [("user", "Q")],
    ),
    ({"prompt": "Q"}, [("user", "Q")]),
    ({"prompt": "Q", "completion": "A"}, [("user", "Q"), ("assistant", "A")]),
    ({"instruction": "Q", "input": "X", "output": "A"}, [("user", "Q\n\nX"), ("assistant", "A")]),
    ({"instruction": "Q", "input": "", "response": "A"}, [("user", "Q"), ("assistant", "A")]),
    ({"instruction": "Q", "system": "S"}, [("system", "S"), ("user", "Q")]),
    (
        {
            "prompt": [{"role": "user", "content": "Q"}],
            "completion": [{"role": "assistant", "content": "A"}],
        },
        [("user", "Q"), ("assistant", "A")],
    ),
    ({"turns": ["Q1", "Q2"], "category": "writing"}, [("user", "Q1")]),
]


@pytest.mark.parametrize("row,expected", ROW_SHAPES)
def test_to_messages_reads_every_shape(row, expected):
    messages = to_messages(row)
    assert [(m["role"], m["content"]) for m in messages] == expected


def test_to_messages_explicit_format():
    row = {"turns": ["T"], "prompt": "P"}
    assert to_messages(row)[0]["content"] == "T"
    assert to_messages(row, "prompt")[0]["content"] == "P"
    with pytest.raises(DataError, match="rows.jsonl row 2: 'conversations'"):
        to_messages(row, "sharegpt", where="rows.jsonl row 2")
    with pytest.raises(ConfigError, match="unknown chat format"):
        to_messages(row, "alpacca")


@pytest.mark.parametrize(
    "row,match",
    [
        ({"text": "hi", "label": 1}, r"prompts.jsonl row 7: unrecognized .*\['label', 'text'\]"),
        ({"messages": []}, "non-empty list"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "unsupported role 'tool'"),
        ({"messages": [{"role": "user"}]}, "needs 'role' and 'content'"),
        ({"messages": [{"role": "user", "content": None}]}, "content must be text"),
        ({"turns": []}, "'turns' must be"),
        ({"prompt": 3}, "'prompt' must be"),
    ],
)
def test_to_messages_errors_name_the_row(row, match):
    with pytest.raises(DataError, match=match) as err:
        to_messages(row, where="prompts.jsonl row 7")
    assert "prompts.jsonl row 7" in str(err.value) and "\n" not in str(err.value)


def test_prompt_messages():
    assert prompt_messages(MULTI_TURN) == MULTI_TURN[:2]
    assert prompt_messages(MULTI_TURN[1:2]) == MULTI_TURN[1:2]
    two_users = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert prompt_messages(two_users) == two_users[:1]
    with pytest.raises(DataError, match="row 5: no user message"):
        prompt_messages([{"role": "assistant", "content": "x"}], where="row 5")


def _rows():
    return [
        {"messages": MULTI_TURN},
        {"instruction": "Say hi.", "output": "Hi!"},
        {"conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}]},
        {"prompt": "No answer here."},
        {"turns": ["Only a question."]},
    ]


def test_build_sft_dataset_counts(tiny_tokenizer, caplog):
    with caplog.at_level(logging.INFO, logger="specdec.data.chat"):
        ds, stats = build_sft_dataset(_rows(), tiny_tokenizer, max_length=4096, source="mix")
    assert stats.as_dict() == {"kept": 3, "truncated": 0, "dropped": 0, "no_assistant": 2}
    assert ds.column_names == ["input_ids", "loss_mask"] and len(ds) == 3
    assert ds[0] == tokenize_chat(MULTI_TURN, tiny_tokenizer, max_length=4096)
    assert "no_assistant 2" in caplog.text and "mix" in caplog.text


def test_build_sft_dataset_truncation_and_drop(tiny_tokenizer):
    long_len = len(tokenize_chat(MULTI_TURN, tiny_tokenizer, 4096)["input_ids"])
    short_len = len(tokenize_chat(to_messages(_rows()[1]), tiny_tokenizer, 4096)["input_ids"])
    limit = (long_len + short_len) // 2
    rows = _rows()[:3]
    ds, stats = build_sft_dataset(rows, tiny_tokenizer, max_length=limit)
    assert (stats.kept, stats.truncated, stats.dropped) == (3, 1, 0)
    assert max(len(ids) for ids in ds["input_ids"]) == limit
    ds, stats = build_sft_dataset(rows, tiny_tokenizer, max_length=limit, overflow="drop")
    assert (stats.kept, stats.truncated, stats.dropped) == (2, 0, 1)
    # Cut before the first reply: nothing left to learn, so the row is dropped, not kept.
    head = len(
        tiny_tokenizer.apply_chat_template(MULTI_TURN[:2], add_generation_prompt=True)["input_ids"]
    )
    _, stats = build_sft_dataset([{"messages": MULTI_TURN}, rows[1]], tiny_tokenizer, head)
    assert stats.dropped == 1


def test_build_sft_dataset_require_assistant(tiny_tokenizer):
    with pytest.raises(DataError, match="sft.jsonl row 4: no assistant turn"):
        build_sft_dataset(_rows(), tiny_tokenizer, 512, require_assistant=True, source="sft.jsonl")


def test_build_sft_dataset_with_no_usable_rows(tiny_tokenizer):
    with pytest.raises(DataError, match="prompts.jsonl: no usable rows"):
        build_sft_dataset(_rows()[3:], tiny_tokenizer, 512, source="prompts.jsonl")
    with pytest.raises(DataError, match="no usable rows"):
        build_sft_dataset([], tiny_tokenizer, 512)


def test_build_sft_dataset_from_a_dataset(tiny_tokenizer):
    from datasets import Dataset

    pairs = [{"prompt": "Q", "completion": "A"}, {"prompt": "R", "completion": "B"}]
    rows = Dataset.from_list(pairs)
    ds, stats = build_sft_dataset(rows, tiny_tokenizer, 64)
    assert stats.kept == 2
    runs = masked_runs(ds[1]["input_ids"], ds[1]["loss_mask"], tiny_tokenizer)
    assert runs == ["B" + tiny_tokenizer.eos_token]
