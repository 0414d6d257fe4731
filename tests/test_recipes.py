"""Every shipped YAML: recipes load under the strict schema, accelerate topologies parse."""

import dataclasses
from pathlib import Path

import pytest
import yaml
from accelerate.commands.config.config_args import load_config_from_file

from specdec.config import iter_recipes, load_recipe, save_recipe

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
RECIPE_FILES = iter_recipes(RECIPES)
ACCELERATE_FILES = sorted((RECIPES / "accelerate").glob("*.yaml"))


def test_shipped_files_are_found():
    names = {p.relative_to(RECIPES).as_posix() for p in RECIPE_FILES}
    assert {
        "debug/tiny.yaml",
        "smollm2-135m/demo.yaml",
        "smollm2-135m/draft_model.yaml",
        "smollm2-135m/prompt_lookup.yaml",
        "smollm2-135m/medusa1.yaml",
        "smollm2-135m/mtp.yaml",
        "debug/tiny_medusa.yaml",
        "debug/tiny_mtp.yaml",
        "debug/tiny_medusa2.yaml",
        "smollm2-135m/medusa1_demo.yaml",
        "smollm2-135m/medusa2_demo.yaml",
        "smollm2-135m/medusa2.yaml",
        "smollm2-135m/mtp_demo.yaml",
        "qwen3-8b/draft_model.yaml",
        "qwen3-8b/medusa2.yaml",
    } <= names
    assert {p.name for p in ACCELERATE_FILES} == {
        "cpu.yaml",
        "single_gpu.yaml",
        "multi_gpu.yaml",
        "fsdp.yaml",
    }


@pytest.mark.parametrize("path", RECIPE_FILES, ids=lambda p: p.relative_to(RECIPES).as_posix())
def test_recipe_loads_and_round_trips(path, tmp_path):
    recipe = load_recipe(path)
    assert recipe.run.name != "run", "each shipped recipe names its run"
    save_recipe(recipe, tmp_path / "resolved.yaml")
    assert load_recipe(tmp_path / "resolved.yaml") == recipe


@pytest.mark.parametrize("path", RECIPE_FILES, ids=lambda p: p.relative_to(RECIPES).as_posix())
def test_recipe_header(path):
    header = path.read_text().split("\n\n", 1)[0]
    assert all(line.startswith("#") for line in header.splitlines())
    assert f"recipes/{path.relative_to(RECIPES).as_posix()}" in header
    for part in ("Prerequisites:", "Launch", "Expect:"):
        assert part in header, part


@pytest.mark.parametrize("path", ACCELERATE_FILES, ids=lambda p: p.name)
def test_accelerate_config(path):
    raw = yaml.safe_load(path.read_text())
    for key in ("compute_environment", "distributed_type", "num_processes", "mixed_precision"):
        assert key in raw, key
    config = load_config_from_file(str(path))
    assert config.compute_environment.value == "LOCAL_MACHINE"
    assert config.num_processes >= 1
    assert config.use_cpu == (path.name == "cpu.yaml")


def test_reference_recipe_matches_its_brief():
    r = load_recipe(RECIPES / "smollm2-135m" / "draft_model.yaml")
    assert r.drafter.type == "draft_model" and 2 <= r.drafter.num_layers <= 4
    assert r.drafter.init_from_target and r.drafter.draft_vocab_size == 8192
    assert r.eval.k == 4 and r.eval.temperature == 0
    # evaluation sources stay out of training, and slices of one source never overlap
    assert not {p.source for p in r.data.prompts} & {p.source for p in r.eval.prompts}
    spans = {}
    for p in r.data.prompts:
        end = float("inf") if p.limit is None else p.offset + p.limit
        for start, stop in spans.get(p.source, []):
            assert end <= start or p.offset >= stop, f"{p.source} slices overlap"
        spans.setdefault(p.source, []).append((p.offset, end))
    assert {p.responses for p in r.data.prompts} == {"regenerate"}  # every answer the target's
    # the EAGLE-3 reference's data (and seed: the same held-out rows): one regeneration serves
    # both (which positions teach is each recipe's own)
    e3 = load_recipe(RECIPES / "smollm2-135m" / "eagle3.yaml")
    assert dataclasses.replace(r.data, loss_on=e3.data.loss_on) == e3.data
    assert r.run.seed == e3.run.seed


def test_prompt_lookup_matches_the_reference_scoring():
    ref = load_recipe(RECIPES / "smollm2-135m" / "draft_model.yaml")
    pl = load_recipe(RECIPES / "smollm2-135m" / "prompt_lookup.yaml")
    assert pl.drafter.type == "prompt_lookup" and pl.train.max_steps == 0
    assert pl.eval == ref.eval
    assert pl.target == ref.target


def test_tiny_recipe_is_tiny(tmp_path):
    r = load_recipe(
        RECIPES / "debug" / "tiny.yaml", [f"target.model={tmp_path}", f"run.output_dir={tmp_path}"]
    )
    assert r.target.model == str(tmp_path) and r.run_dir == tmp_path
    assert r.train.max_steps <= 4 and r.train.save_every < r.train.max_steps
    assert r.train.batch_size <= 2 and r.eval.num_prompts <= 2
