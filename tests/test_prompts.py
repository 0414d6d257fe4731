"""Prompt sets: packaged pools from (fake, then real) wheels, local files, held-out splits."""

import dataclasses
import gzip
import json
import logging
import zipfile

import pytest

from specdec.assets import PackagedFile, sha256_of
from specdec.data.chat import prompt_messages
from specdec.data.prompts import PACKAGED, load_prompt_rows, read_records, split_heldout
from specdec.errors import DataError


def fake_wheel(cache, member: str, content: bytes, package="fake-pool", version="1.0"):
    """A wheel holding one file, placed where ``fetch_packaged_file`` looks before downloading."""
    folder = cache / "packages" / f"{package}-{version}"
    folder.mkdir(parents=True)
    wheel = folder / f"{package.replace('-', '_')}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(member, content)
    return PackagedFile(package, version, sha256_of(wheel), member)


def jsonl(rows) -> bytes:
    return "\n".join(json.dumps(r, ensure_ascii=False) for r in rows).encode() + b"\n"


def load_fake(tmp_path, name: str, member: str, content: bytes) -> list[dict]:
    asset = fake_wheel(tmp_path / "cache", member, content)
    return dataclasses.replace(PACKAGED[name], asset=asset).load(tmp_path / "cache")


def user_text(row) -> str:
    assert [m["role"] for m in row["messages"]] == ["user"]
    return row["messages"][0]["content"]


def test_packaged_names():
    names = {"alpaca_eval", "arena_hard", "ifeval", "writingbench_en", "healthbench"}
    assert set(PACKAGED) == names | {"mtbench", "humaneval"}


def test_alpaca_eval_keeps_the_reference_answer_as_an_assistant_turn(tmp_path):
    records = [{"dataset": "koala", "instruction": "Name a colour.", "output": "Blue."}]
    rows = load_fake(tmp_path, "alpaca_eval", "pkg/data/alpaca.json", json.dumps(records).encode())
    messages = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
    ]
    assert rows == [{"messages": messages, "category": "koala", "id": "0"}]
    assert prompt_messages(rows[0]["messages"]) == messages[:1]  # what is regenerated/scored


def test_arena_hard_reads_lines_with_unicode_separators(tmp_path):
    records = [
        {"uid": "a1", "category": "hard_prompt", "subcategory": "coding", "prompt": "x\u2028y"},
        {"uid": "b2", "category": "creative_writing", "prompt": "Write a poem."},
    ]
    rows = load_fake(tmp_path, "arena_hard", "pkg/question.jsonl", jsonl(records))
    assert [r["id"] for r in rows] == ["a1", "b2"]
    assert [r["category"] for r in rows] == ["coding", "creative_writing"]
    assert user_text(rows[0]) == "x\u2028y"


def test_ifeval(tmp_path):
    records = [{"key": "1000", "prompt": "Answer without commas.", "kwargs": [{}]}]
    rows = load_fake(tmp_path, "ifeval", "pkg/input_data.jsonl", jsonl(records))
    assert rows[0]["id"] == "1000" and rows[0]["category"] == "ifeval"
    assert user_text(rows[0]) == "Answer without commas."


def test_writingbench_keeps_english(tmp_path, caplog):
    records = [
        {"index": "1", "domain1": "Education", "lang": "zh", "query": "写一篇关于教育的文章"},
        {"index": "2", "domain1": "Finance & Business", "lang": "en", "query": "Draft a memo."},
        {"index": "3", "domain1": "Education", "lang": "EN", "query": "Plan a lesson."},
    ]
    with caplog.at_level(logging.INFO, logger="specdec.data.prompts"):
        rows = load_fake(tmp_path, "writingbench_en", "pkg/all.jsonl", jsonl(records))
    assert [r["id"] for r in rows] == ["2", "3"]
    assert rows[0]["category"] == "Finance & Business"
    assert "2 English queries of 3" in caplog.text


def test_writingbench_without_a_language_field_guesses(tmp_path):
    records = [{"index": "1", "query": "写一篇关于教育的文章"}, {"index": "2", "query": "Hello."}]
    rows = load_fake(tmp_path, "writingbench_en", "pkg/all.jsonl", jsonl(records))
    assert [r["id"] for r in rows] == ["2"]


def test_healthbench_keeps_english_chats_whose_first_user_turn_is_the_prompt(tmp_path):
    chat = [
        {"role": "user", "content": "My knee hurts after running."},
        {"role": "assistant", "content": "Since when?"},
        {"role": "user", "content": "Two days."},
    ]
    records = [
        {"prompt_id": "a", "prompt": chat, "example_tags": ["lang:en", "theme:context_seeking"]},
        {"prompt_id": "b", "prompt": [{"role": "user", "content": "我头痛，怎么办？"}]},
        {"prompt_id": "c", "prompt": [{"role": "user", "content": "Is 38.5 C a fever?"}]},
    ]  # fmt: skip
    rows = load_fake(tmp_path, "healthbench", "pkg/healthbench_eval.jsonl", jsonl(records))
    assert [(r["id"], r["category"]) for r in rows] == [
        ("a", "context_seeking"),
        ("c", "healthbench"),
    ]
    assert rows[0]["messages"] == chat  # the whole chat, for `responses: keep`
    assert prompt_messages(rows[0]["messages"]) == chat[:1]  # what is regenerated
    assert user_text(rows[1]) == "Is 38.5 C a fever?"


def test_mtbench_first_turn_and_all_turns(tmp_path):
    records = [{"question_id": 81, "category": "writing", "turns": ["Write.", "Rewrite."]}]
    rows = load_fake(tmp_path, "mtbench", "pkg/question.jsonl", jsonl(records))
    assert user_text(rows[0]) == "Write."
    assert rows[0]["turns"] == ["Write.", "Rewrite."]
    assert (rows[0]["category"], rows[0]["id"]) == ("writing", "81")


def test_humaneval_wraps_the_stub(tmp_path):
    stub = 'def add(a, b):\n    """Add two numbers."""\n'
    records = [{"task_id": "HumanEval/0", "prompt": stub, "canonical_solution": "    ..."}]
    rows = load_fake(tmp_path, "humaneval", "pkg/HumanEval.jsonl.gz", gzip.compress(jsonl(records)))
    assert rows[0]["category"] == "humaneval" and rows[0]["id"] == "HumanEval/0"
    text = user_text(rows[0])
    assert text == f"Complete the following Python function:\n```python\n{stub}```"


def test_pool_with_a_wrong_shape_names_the_file(tmp_path):
    with pytest.raises(DataError, match="question.jsonl: unexpected mtbench row shape"):
        load_fake(tmp_path, "mtbench", "pkg/question.jsonl", jsonl([{"prompt": "no turns"}]))


def test_load_prompt_rows_packaged_from_the_cache(tmp_path):
    asset = PACKAGED["mtbench"].asset
    member = tmp_path / "packages" / f"{asset.package}-{asset.version}" / asset.member
    member.parent.mkdir(parents=True)
    records = [{"question_id": i, "category": "math", "turns": [f"Q{i}"]} for i in range(5)]
    member.write_bytes(jsonl(records))
    rows = load_prompt_rows("mtbench", cache=tmp_path)
    assert [r["id"] for r in rows] == ["0", "1", "2", "3", "4"]
    assert len(load_prompt_rows("mtbench", limit=2, cache=tmp_path)) == 2


LOCAL_ROWS = [
    {"prompt": "First?", "category": "qa"},
    {"messages": [{"role": "user", "content": "Second?"}, {"role": "assistant", "content": "B"}]},
    {"instruction": "   "},
    {"conversations": [{"from": "human", "value": "Third?"}], "id": "t3"},
]


def test_local_jsonl(tmp_path, caplog):
    path = tmp_path / "mine.jsonl"
    path.write_bytes(jsonl(LOCAL_ROWS))
    with caplog.at_level(logging.WARNING, logger="specdec.data.prompts"):
        rows = load_prompt_rows(str(path))
    assert [r["messages"][0]["content"] for r in rows] == ["First?", "Second?", "Third?"]
    assert rows[1]["messages"][1] == {"role": "assistant", "content": "B"}
    assert [r["category"] for r in rows] == ["qa", "mine", "mine"]
    assert [r["id"] for r in rows] == ["1", "2", "t3"]
    assert "skipped 1 rows with an empty prompt" in caplog.text
    assert len(load_prompt_rows(str(path), limit=1)) == 1


def test_local_json_csv_parquet(tmp_path):
    from datasets import Dataset

    flat = [{"prompt": "Alpha?", "category": "a"}, {"prompt": "Beta?", "category": "b"}]
    (tmp_path / "p.json").write_text(json.dumps(flat))
    Dataset.from_list(flat).to_csv(tmp_path / "p.csv", index=False)
    Dataset.from_list(flat).to_parquet(tmp_path / "p.parquet")
    for name in ("p.json", "p.csv", "p.parquet"):
        rows = load_prompt_rows(str(tmp_path / name))
        assert [(user_text(r), r["category"]) for r in rows] == [("Alpha?", "a"), ("Beta?", "b")]


def test_local_file_errors(tmp_path):
    with pytest.raises(DataError, match="prompt file not found: .*nothere.jsonl"):
        load_prompt_rows(str(tmp_path / "nothere.jsonl"))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataError, match="empty.jsonl: no usable prompt rows"):
        load_prompt_rows(str(empty))
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(jsonl([{"prompt": "ok"}, {"text": "what"}]))
    with pytest.raises(DataError, match=r"bad.jsonl row 2: unrecognized chat row"):
        load_prompt_rows(str(bad))
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "ok"}\n{"prompt": \n')
    with pytest.raises(DataError, match="broken.jsonl line 2: invalid JSON"):
        read_records(broken)


def test_hub_source_offline_is_a_data_error():
    with pytest.raises(DataError, match="cannot load prompt dataset 'nobody/none-such'"):
        load_prompt_rows("nobody/none-such")


def test_split_heldout(caplog):
    train = [
        {"messages": [{"role": "user", "content": "What  is\n2+2?"}]},
        {"prompt": "Tell me a joke.", "completion": "No."},
        {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Other"}]},
    ]
    heldout = [{"messages": [{"role": "user", "content": " What is 2+2? "}]}, {"turns": ["Other"]}]
    with caplog.at_level(logging.INFO, logger="specdec.data.prompts"):
        kept = split_heldout(train, heldout)
    assert kept == [train[1]]
    assert "held out 2 of 3 training rows" in caplog.text
    assert split_heldout(train, []) == train


REAL_COUNTS = {
    "alpaca_eval": 805,
    "arena_hard": 750,
    "ifeval": 541,
    "writingbench_en": 555,
    "healthbench": 478,
    "mtbench": 80,
    "humaneval": 164,
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(REAL_COUNTS))
def test_real_pool(name):
    rows = load_prompt_rows(name)
    assert len(rows) == REAL_COUNTS[name]
    assert len({r["id"] for r in rows}) == len(rows)
    for row in rows:
        prompt = prompt_messages(row["messages"])
        assert [m["role"] for m in prompt] == ["user"] and prompt[0]["content"].strip()
        assert isinstance(row["category"], str) and row["category"]
    if name == "alpaca_eval":  # GPT-4's reference answers, for `responses: keep`
        assert all(r["messages"][-1]["role"] == "assistant" for r in rows)
    if name == "mtbench":
        assert len({r["category"] for r in rows}) == 8 and all(len(r["turns"]) == 2 for r in rows)
    if name == "humaneval":
        assert user_text(rows[0]).startswith("Complete the following Python function:\n```python")


def test_python_functions_and_methods_are_humaneval_shaped(tmp_path):
    from specdec.data.stdlib_code import humaneval_message, python_functions, python_methods

    doc = '    """Add one.\n\n    Twice documented.\n    """\n'
    body = doc + "    y = x + 1\n    z = y\n    return z\n"
    method = body.replace("    ", "        ")
    (tmp_path / "mod.py").write_text(
        "import os\n\n\ndef inc(x):\n" + body + "\n\ndef bare(x):\n    y = 1\n    z = 2\n"
        "    w = 3\n    return x\n\n\ndef short(x):\n    'Doc.'\n    return x\n\n\n"
        "class C(dict):\n    def method(self, x):\n" + method + "\n    @method.setter\n"
        "    def method(self, x):\n" + method + "\n    def bare(self):\n"
        "        y = 1\n        z = 2\n        w = 3\n        return y\n\n\n"
        "class Wrapped(\n    dict,\n):\n    def method(self, x):\n" + method
    )  # fmt: skip
    (tmp_path / "test").mkdir()
    (tmp_path / "test" / "test_mod.py").write_text("def t(x):\n" + body)
    (tmp_path / "broken.py").write_text("def (:\n")
    rows = python_functions(tmp_path)
    assert [r["id"] for r in rows] == ["mod.inc"]  # no docstring, too short, method, tests: out
    user, answer = rows[0]["messages"]
    assert user["content"] == humaneval_message("def inc(x):\n" + doc)
    assert answer == {"role": "assistant", "content": "```python\ndef inc(x):\n" + body + "```"}
    rows = python_methods(tmp_path)
    # undocumented, a wrapped class line, a second `method` (a property's setter): out
    assert [r["id"] for r in rows] == ["mod.C.method"]
    user, answer = rows[0]["messages"]
    head = "class C(dict):\n    def method(self, x):\n"
    assert user["content"] == humaneval_message(head + doc.replace("    ", "        "))
    assert answer == {"role": "assistant", "content": "```python\n" + head + method + "```"}


def test_training_prompts_keep_their_sources_order_and_a_sample_its_seeded_draw(tmp_path):
    import random

    from specdec.config import load_recipe
    from specdec.data.build import training_prompts

    first, more = tmp_path / "first.jsonl", tmp_path / "more.jsonl"
    first.write_text(jsonl([{"id": i, "prompt": f"Question {i}?"} for i in range(12)]).decode())
    more.write_text(jsonl([{"id": i, "prompt": f"Another {i}?"} for i in range(5)]).decode())
    recipe = "recipes/debug/tiny.yaml"

    def ids(*sets: str) -> list[str]:
        rows, _ = training_prompts(load_recipe(recipe, ["eval.prompts=[]", *sets]))
        return [r["id"] for r in rows]

    alone = ids(f"data.prompts=[{first}]", "data.max_prompts=null")
    assert alone == [f"first:{i}" for i in range(12)]
    grown = ids(f"data.prompts=[{first},{more}]", "data.max_prompts=null")
    assert grown == alone + [f"more:{i}" for i in range(5)]  # a source added appends its rows
    sample = ids(f"data.prompts=[{first},{more}]", "data.max_prompts=6")
    drawn = list(range(17))
    random.Random(0).shuffle(drawn)  # the run's seed draws which 6
    assert sample == [grown[i] for i in sorted(drawn[:6])]
