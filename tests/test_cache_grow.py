"""The teacher cache grows with its data: rows appended (a prompt source added) keep the
cached rows' whole shards, the rest is written, and the result equals a cache built afresh."""

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_cache import ROOT, command_sets, files, make, rows, shards, target  # noqa: F401
from test_cache_derive import fp_of

from specdec.data import cache as cache_mod
from specdec.data.cache import shards_to_do
from specdec.data.cache_derive import derive_cache
from specdec.data.cache_read import TeacherCache
from specdec.errors import DataError


def assert_same_shards(a: Path, b: Path) -> None:
    left, right = shards(a), shards(b)
    assert left.keys() == right.keys()
    for name, tensors in left.items():
        assert tensors.keys() == right[name].keys()
        for key, value in tensors.items():
            assert torch.equal(value, right[name][key]), (name, key)


def test_a_cache_grows_with_the_rows_appended_to_its_data(target, tmp_path, monkeypatch):  # noqa: F811
    make(target, rows(n=7), tmp_path / "c", top_k=8)  # 3 rows a shard: the third holds 1
    make(target, rows(n=11), tmp_path / "whole", top_k=8)  # rows(11) begins with rows(7)
    encoded = []
    real_encode = cache_mod.encode_rows

    def encode(t, d, r, *a):
        encoded.append(r)
        if len(encoded) == 1 and interrupt:
            raise KeyboardInterrupt  # killed growing, before the third shard is rewritten
        return real_encode(t, d, r, *a)

    monkeypatch.setattr(cache_mod, "encode_rows", encode)
    interrupt = True
    with pytest.raises(KeyboardInterrupt):
        make(target, rows(n=11), tmp_path / "c", top_k=8)
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert (manifest["fingerprint"]["rows"], manifest["complete"]) == (11, False)
    assert load_file(tmp_path / "c" / "shard-00002.safetensors")["row_offsets"].numel() == 2

    interrupt, encoded[:] = False, []
    make(target, rows(n=11), tmp_path / "c", top_k=8)
    assert encoded == [range(6, 9), range(9, 11)]  # two whole shards kept, the short one redone
    assert_same_shards(tmp_path / "c", tmp_path / "whole")
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert manifest == json.loads((tmp_path / "whole" / "manifest.json").read_text())

    for changed in (rows(n=12, seed=1), rows(n=9), rows(n=13, vocab=100)):
        with pytest.raises(DataError, match="another data_sha256"):  # not the cached rows first
            make(target, changed, tmp_path / "c", top_k=8)
    with pytest.raises(DataError, match="another top_k"):  # more rows, and another top-k
        make(target, rows(n=13), tmp_path / "c", top_k=16)
    assert_same_shards(tmp_path / "c", tmp_path / "whole")


def test_adding_a_prompt_source_grows_the_cache_training_reads(files, tmp_path, caplog):  # noqa: F811
    """``data.loss_on: all`` (the held-out rows are drawn anew from grown data): the cache of 7
    rows keeps its two whole shards when 2 rows are appended, equals a cache built from
    scratch for the 9, and training reads it."""
    from specdec.cli import main
    from specdec.config import load_recipe
    from specdec.training.loop import train

    questions = [json.loads(x) for x in (files / "train.jsonl").read_text().splitlines()]
    first, more = tmp_path / "first.jsonl", tmp_path / "more.jsonl"
    first.write_text("".join(json.dumps(q) + "\n" for q in questions[:7]))
    more.write_text("".join(json.dumps(q) + "\n" for q in questions[7:9]))
    recipe = str(ROOT / "recipes" / "debug" / "tiny_eagle3.yaml")
    sets = [*command_sets(files, tmp_path), "data.loss_on=all", "data.teacher=cache"]
    sets += ["data.max_prompts=null", f"data.dataset_dir={tmp_path / 'data'}"]
    command = ["data", "cache", "--config", recipe, "--set"]
    assert main([*command, *sets, f"data.prompts=[{first}]"]) == 0
    cache = tmp_path / "run" / "teacher-cache"
    assert json.loads((cache / "manifest.json").read_text())["fingerprint"]["rows"] == 7
    kept = {p.name: p.stat().st_mtime_ns for p in cache.glob("shard-*")}

    grown = [*sets, f"data.prompts=[{first},{more}]"]
    with caplog.at_level(logging.INFO, logger="specdec.data.cache"):
        assert main([*command, *grown]) == 0
    assert "the data grew from 7 to 9 rows" in caplog.text
    now = {p.name: p.stat().st_mtime_ns for p in cache.glob("shard-*")}
    assert [name for name in kept if now[name] == kept[name]] == [
        "shard-00000.safetensors",
        "shard-00001.safetensors",
    ]  # the third, 1 row then, is written again with its 3
    fresh = [*grown, f"run.output_dir={tmp_path / 'fresh'}"]
    assert main([*command, *fresh]) == 0
    assert_same_shards(cache, tmp_path / "fresh" / "teacher-cache")
    built = json.loads((cache / "manifest.json").read_text())
    scratch = json.loads((tmp_path / "fresh" / "teacher-cache" / "manifest.json").read_text())
    assert built.pop("made_by") != scratch.pop("made_by")  # who started each: another recipe
    assert built == scratch
    built = json.loads((cache / "manifest.json").read_text())
    train(load_recipe(recipe, [*grown, "train.max_steps=1", "train.save_every=1"]))
    assert json.loads((cache / "manifest.json").read_text()) == built  # read as it is


def test_a_short_shard_is_written_again_and_never_read(target, tmp_path):  # noqa: F811
    """A shard holding fewer rows than its place in the cache (the old last shard of a cache
    whose growth was killed) is redone by a build and a derivation, and a reader refuses it."""
    make(target, rows(n=7), tmp_path / "c7", top_k=8)
    make(target, rows(n=9), tmp_path / "c9", top_k=8)
    short = tmp_path / "c7" / "shard-00002.safetensors"  # 1 row, where the 9 rows' holds 3
    assert shards_to_do(tmp_path / "c9", 9, 3) == []
    shutil.copy(short, tmp_path / "c9" / "shard-00002.safetensors")
    assert shards_to_do(tmp_path / "c9", 9, 3) == [2]
    fp = fp_of(target, rows(n=9), top_k=8)
    with pytest.raises(DataError, match="1 rows where this cache's shard holds 3"):
        TeacherCache(tmp_path / "c9", fp)
    make(target, rows(n=9), tmp_path / "c9", top_k=8)  # the build redoes it
    make(target, rows(n=9), tmp_path / "whole", top_k=8)
    assert_same_shards(tmp_path / "c9", tmp_path / "whole")

    narrow = fp_of(target, rows(n=9), top_k=4)
    derive_cache(tmp_path / "whole", narrow, tmp_path / "d", progress=False)
    right = (tmp_path / "d" / "shard-00002.safetensors").read_bytes()
    derive_cache(tmp_path / "c7", fp_of(target, rows(n=7), top_k=4), tmp_path / "d7", False)
    last = "shard-00002.safetensors"
    shutil.copy(tmp_path / "d7" / last, tmp_path / "d" / last)
    derive_cache(tmp_path / "whole", narrow, tmp_path / "d", progress=False)  # redone
    assert (tmp_path / "d" / "shard-00002.safetensors").read_bytes() == right
    TeacherCache(tmp_path / "d", narrow).row(8)


def test_a_cache_of_more_layers_grows_and_keeps_them(target, tmp_path):  # noqa: F811
    make(target, rows(n=7), tmp_path / "c", layers=(0, 1), top_k=8)
    make(target, rows(n=9), tmp_path / "c", layers=(1,), top_k=8)  # reads fewer, grows it
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert manifest["fingerprint"]["layers"] == [0, 1] and manifest["fingerprint"]["rows"] == 9
    make(target, rows(n=9), tmp_path / "whole", layers=(0, 1), top_k=8)
    assert_same_shards(tmp_path / "c", tmp_path / "whole")


def test_a_source_added_after_a_kept_one_appends_its_rows(files, tmp_path):  # noqa: F811
    """Regenerated and kept rows stand in their sources' order, so a regenerated source added
    after a ``responses: keep`` one appends its rows too (the cache of the rest stays)."""
    from specdec.config import load_recipe
    from specdec.data.build import build_data, load_training_data
    from specdec.target import FrozenTarget

    questions = [json.loads(x)["prompt"] for x in (files / "train.jsonl").read_text().splitlines()]
    first, kept, more = (tmp_path / f"{name}.jsonl" for name in ("first", "kept", "more"))
    first.write_text("".join(json.dumps({"prompt": q}) + "\n" for q in questions[:4]))
    kept.write_text(
        "".join(json.dumps({"prompt": q, "response": f"Answer {i}."}) + "\n"
                for i, q in enumerate(questions[4:7]))
    )  # fmt: skip
    more.write_text("".join(json.dumps({"prompt": q}) + "\n" for q in questions[7:9]))
    sets = [*command_sets(files, tmp_path), "data.max_prompts=null"]
    sets.append(f"data.dataset_dir={tmp_path / 'data'}")
    loaded = {}

    def data(*sources: str) -> dict:
        recipe = ROOT / "recipes" / "debug" / "tiny_eagle3.yaml"
        recipe = load_recipe(recipe, [*sets, f"data.prompts=[{', '.join(sources)}]"])
        if not loaded:
            loaded["target"] = FrozenTarget.from_config(recipe.target)
        build_data(recipe, loaded["target"], progress=False)
        return load_training_data(recipe, loaded["target"].tokenizer)[0].to_dict()

    keep = f"{{source: {kept}, responses: keep}}"
    before, after = data(str(first), keep), data(str(first), keep, str(more))
    assert before["target_written"] == [True] * 4 + [False] * 3
    assert after["target_written"] == before["target_written"] + [True] * 2
    assert after["id"][:7] == before["id"] and after["id"][7:] == ["more:1", "more:2"]
    assert after["input_ids"][:7] == before["input_ids"]
