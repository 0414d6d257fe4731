"""Regeneration in several worker processes: the same rows as one process, failures named,
a rerun completing what a dead worker left, one writer per directory."""

import fcntl
import json
import os
from functools import partial

import pytest
import torch
from test_regenerate import make_prompts, sharpen
from tiny_models import save_tiny, tiny_llama
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdec.data.regenerate import load_regenerated, regenerate
from specdec.errors import DataError


def load_saved(path: str, die_after: int = 0) -> tuple:
    """A worker's ``load``: the saved model in float64; with ``die_after`` the process exits
    abruptly (as if killed) after that many ``generate`` calls (-1: at the first)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    if die_after:
        generate, calls = model.generate, []

        def dying(*args, **kwargs):
            calls.append(1)
            if len(calls) > max(die_after, 0):
                os._exit(9)
            return generate(*args, **kwargs)

        model.generate = dying
    return model, AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def sharp_dir(tmp_path_factory):
    model, tokenizer = tiny_llama()
    return str(save_tiny(sharpen(model), tokenizer, tmp_path_factory.mktemp("sharp")))


def run(path, out, workers=1, load=None, **kwargs) -> object:
    model, tokenizer = load_saved(path)
    settings = {"max_new_tokens": 10, "batch_size": 2, "shard_size": 2, "progress": False}
    load = load or partial(load_saved, path)
    return regenerate(
        model, tokenizer, make_prompts(11), out, workers=workers, load=load, **settings | kwargs
    )


def test_workers_write_the_rows_of_one_process(sharp_dir, tmp_path):
    one = run(sharp_dir, tmp_path / "one")
    three = run(sharp_dir, tmp_path / "three", workers=3)
    rows = load_regenerated(tmp_path / "one").to_list()
    assert load_regenerated(tmp_path / "three").to_list() == rows
    assert len({r["messages"][-1]["content"] for r in rows}) > 5  # the rows differ
    assert (three.workers, three.num_done, three.new_tokens) == (3, 11, one.new_tokens)
    assert three.truncated == one.truncated
    manifest = json.loads((tmp_path / "three" / "manifest.json").read_text())
    counts = manifest["counts"]
    assert (counts["num_rows"], counts["complete"], counts["num_shards"]) == (11, True, 6)
    assert counts["num_truncated"] == sum(not r["finished"] for r in rows)
    assert not list((tmp_path / "three").glob("*.tmp"))

    sampling = {"temperature": 1.0, "top_k": 50, "seed": 5}
    run(sharp_dir, tmp_path / "s1", **sampling)
    run(sharp_dir, tmp_path / "s2", workers=2, **sampling)
    sampled = load_regenerated(tmp_path / "s1").to_list()
    assert load_regenerated(tmp_path / "s2").to_list() == sampled != rows


def test_compact_backend_in_workers_writes_the_rows_of_generate(sharp_dir, tmp_path):
    run(sharp_dir, tmp_path / "one")
    # the workers decode through the compact backend: generate() would end them
    no_generate = partial(load_saved, sharp_dir, die_after=-1)
    run(sharp_dir, tmp_path / "two", workers=2, backend="compact", load=no_generate)
    rows = load_regenerated(tmp_path / "one").to_list()
    assert load_regenerated(tmp_path / "two").to_list() == rows
    manifest = json.loads((tmp_path / "two" / "manifest.json").read_text())
    assert manifest["settings"]["backend"] == "compact"


def test_dead_worker_is_named_and_the_rerun_completes(sharp_dir, tmp_path):
    run(sharp_dir, tmp_path / "whole")
    dying = partial(load_saved, sharp_dir, die_after=1)
    with pytest.raises(DataError, match=r"worker \d of 2 died \(exit code 9\)"):
        run(sharp_dir, tmp_path / "out", workers=2, load=dying)
    kept = len(load_regenerated(tmp_path / "out"))
    assert 2 <= kept <= 4  # one batch (one shard) per worker at most
    stats = run(sharp_dir, tmp_path / "out", workers=2)
    assert (stats.num_skipped, stats.num_done) == (kept, 11 - kept)
    whole = load_regenerated(tmp_path / "whole").to_list()
    assert load_regenerated(tmp_path / "out").to_list() == whole


def test_worker_errors_are_named(sharp_dir, tiny_llama_dir, tmp_path):
    other = partial(load_saved, str(tiny_llama_dir))
    with pytest.raises(DataError, match=r"worker \d of 2 failed: DataError: `load` gave model"):
        run(sharp_dir, tmp_path, workers=2, load=other)
    model, tokenizer = load_saved(sharp_dir)
    with pytest.raises(DataError, match="workers > 1 needs `load`"):
        regenerate(model, tokenizer, make_prompts(2), tmp_path, workers=2, progress=False)


def test_a_directory_being_written_is_refused(sharp_dir, tmp_path):
    tmp_path.mkdir(exist_ok=True)
    with (tmp_path / ".lock").open("a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(DataError, match="being written by another process"):
            run(sharp_dir, tmp_path)
    assert run(sharp_dir, tmp_path).num_done == 11  # free again once released
