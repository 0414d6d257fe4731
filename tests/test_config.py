"""The recipe schema: strict loading, one-line errors that name the key, overrides, round trips."""

import dataclasses
import os
import re
import typing
from pathlib import Path

import pytest

from specdec.config import (
    DataConfig,
    PromptSource,
    Recipe,
    RegenerateConfig,
    describe,
    iter_recipes,
    load_recipe,
    recipe_from_dict,
    recipe_to_dict,
    save_recipe,
)
from specdec.errors import ConfigError, SpecdecError


@pytest.fixture
def write(tmp_path):
    def write(text: str, name: str = "r.yaml") -> Path:
        path = tmp_path / name
        path.write_text(text)
        return path

    return write


def error_of(*args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        load_recipe(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_defaults():
    r = load_recipe(None)
    assert r == Recipe()
    assert r.target.model == "smollm2-135m-instruct"
    assert [s.source for s in r.data.prompts] == [
        "alpaca_eval",
        "arena_hard",
        "ifeval",
        "writingbench_en",
    ]
    assert [s.source for s in r.eval.prompts] == ["mtbench", "humaneval"]
    assert r.train.lr == 3e-4 and r.eval.k == 4 and r.export.formats == ["hf"]
    assert r.run_dir == Path("runs") / "run"


def test_defaults_are_not_shared_between_instances():
    a, b = Recipe(), Recipe()
    a.data.prompts.append(PromptSource("x.jsonl"))
    a.train.trackers.append("wandb")
    assert len(b.data.prompts) == 4 and b.train.trackers == []
    assert len(DataConfig().prompts) == 4


def test_every_field_has_help():
    classes = [Recipe]
    for cls in classes:
        for f in dataclasses.fields(cls):
            assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no help"
            tp = typing.get_type_hints(cls)[f.name]
            for t in (tp, *typing.get_args(tp)):
                if dataclasses.is_dataclass(t) and t not in classes:
                    classes.append(t)
    assert {PromptSource, RegenerateConfig, DataConfig} <= set(classes)


def test_empty_yaml_is_refused_an_empty_section_gives_defaults(write):
    for text in ("", "# only a comment\n"):  # not silently the default recipe
        with pytest.raises(ConfigError, match=r"r\.yaml: empty; a recipe names at least"):
            load_recipe(write(text))
    assert load_recipe(write("train:\n")) == Recipe()


def test_values_are_read(write):
    r = load_recipe(
        write(
            "run: {name: x, output_dir: /tmp/out}\n"
            "train: {lr: 1e-3, max_steps: 5, mixed_precision: no}\n"
            "loss: {mix: {forward_kl: 1, ce: 0.5}}\n"
            "drafter: {init_layers: [0, -1], draft_vocab_size: 8192}\n"
        )
    )
    assert r.train.lr == 1e-3 and isinstance(r.train.lr, float)
    assert r.train.mixed_precision == "no"  # YAML 1.2: `no` stays a string
    assert r.loss.mix == {"forward_kl": 1.0, "ce": 0.5}
    assert r.drafter.init_layers == [0, -1]
    assert r.run_dir == Path("/tmp/out")


def test_int_accepted_for_float_but_not_bool(write):
    assert load_recipe(write("train: {lr: 1}")).train.lr == 1.0
    msg = error_of(write("train: {lr: true}", "b.yaml"))
    assert msg.endswith("b.yaml: train.lr: expected a float, got True")


def test_unknown_top_level_key(write):
    path = write("trian: {lr: 1.0}\n")
    assert error_of(path) == f"{path}: trian: unknown key (did you mean 'train'?)"


def test_unknown_nested_key(write):
    path = write("train:\n  lrr: 0.1\n")
    assert error_of(path) == f"{path}: train.lrr: unknown key (did you mean 'train.lr'?)"
    path = write("data:\n  regenerate:\n    max_new_token: 3\n")
    assert error_of(path) == (
        f"{path}: data.regenerate.max_new_token: unknown key "
        "(did you mean 'data.regenerate.max_new_tokens'?)"
    )
    path = write("train:\n  zzz: 1\n")
    assert error_of(path) == f"{path}: train.zzz: unknown key"


@pytest.mark.parametrize(
    "text, key, expected",
    [
        ("train: {lr: fast}", "train.lr", "expected a float, got 'fast'"),
        ("train: {max_steps: 1.5}", "train.max_steps", "expected an integer, got 1.5"),
        ("train: {resume: 1}", "train.resume", "expected a boolean (true/false), got 1"),
        ("train: {resume: yes}", "train.resume", "expected a boolean (true/false), got 'yes'"),
        ("run: {name: 12}", "run.name", "expected a string, got 12"),
        ("data: {max_prompts: many}", "data.max_prompts", "expected an integer or null"),
        ("train: {trackers: wandb}", "train.trackers", "expected a list, got 'wandb'"),
        ("loss: {mix: [jsd]}", "loss.mix", "expected a mapping, got ['jsd']"),
        ("train: 3", "train", "expected a mapping, got 3"),
        ("drafter: {init_layers: [0, a]}", "drafter.init_layers[1]", "expected an integer"),
    ],
)
def test_wrong_type(write, text, key, expected):
    path = write(text)
    assert error_of(path).startswith(f"{path}: {key}: {expected}")


def test_bad_literal_lists_allowed_values(write):
    path = write("train: {schedule: cosin}")
    assert error_of(path) == (
        f"{path}: train.schedule: expected one of 'cosine', 'linear', 'constant', "
        "got 'cosin' (did you mean 'cosine'?)"
    )


def test_bad_choice(write):
    path = write("drafter: {type: eagle}")
    msg = error_of(path)
    assert msg.startswith(f"{path}: drafter.type: expected one of 'draft_model', 'eagle3'")
    assert msg.endswith("got 'eagle' (did you mean 'eagle3'?)")
    path = write("export: {formats: [hf, vllm]}")
    assert error_of(path).startswith(f"{path}: export.formats[1]: expected one of 'hf'")
    path = write("loss: {mix: {jsd: 0.5, kl: 0.5}}")
    assert error_of(path).startswith(f"{path}: loss.mix.kl: expected one of 'forward_kl'")


def test_list_of_dataclasses_names_the_item(write):
    path = write(
        "data:\n  prompts:\n    - alpaca_eval\n    - {source: chats.jsonl, format: chatml}\n"
    )
    msg = error_of(path)
    assert msg.startswith(f"{path}: data.prompts[1].format: expected one of 'auto', 'openai'")
    assert msg.endswith("got 'chatml'")
    path = write("data:\n  prompts:\n    - {format: sharegpt}\n")
    assert error_of(path) == f"{path}: data.prompts[0].source: required"
    path = write("eval:\n  prompts:\n    - {source: x, limt: 3}\n")
    assert error_of(path) == (
        f"{path}: eval.prompts[0].limt: unknown key (did you mean 'eval.prompts[0].limit'?)"
    )


def test_prompt_source_shorthand(write):
    r = load_recipe(write("eval:\n  prompts: [mtbench, {source: ./mine.jsonl, limit: 3}]\n"))
    assert r.eval.prompts == [PromptSource("mtbench"), PromptSource("./mine.jsonl", limit=3)]


def test_local_paths_are_not_checked(write):
    r = load_recipe(write("data: {prompts: [/does/not/exist.jsonl, ./nor/this.parquet]}"))
    assert r.data.prompts[0].source == "/does/not/exist.jsonl"


@pytest.mark.parametrize(
    "override, message",
    [
        ("drafter.num_layers=0", "expected >= 1, got 0"),
        ("train.lr=0", "expected > 0, got 0.0"),
        ("train.lr=.nan", "expected > 0, got nan"),
        ("eval.k=0", "expected >= 1, got 0"),
        ("eval.draft_confidence=1.0", "expected < 1, got 1.0"),
        ("eval.top_p=0", "expected > 0, got 0.0"),
        ("eval.top_p=1.5", "expected <= 1, got 1.5"),
        ("eval.temperature=-0.1", "expected >= 0, got -0.1"),
        ("data.regenerate.top_p=2", "expected <= 1, got 2.0"),
        ("loss.beta=1.5", "expected <= 1, got 1.5"),
        ("loss.mix.jsd=-1", "expected >= 0, got -1.0"),
        ("train.max_steps=-1", "expected >= 0, got -1"),
        ("train.max_minutes=0", "expected > 0, got 0.0"),
        ("data.max_prompts=0", "expected >= 1, got 0"),
    ],
)
def test_range_checks(override, message):
    assert error_of(None, [override]) == f"--set {override}: {message}"


def test_range_checks_in_files(write):
    path = write("data:\n  prompts:\n    - {source: a, limit: 0}\n")
    assert error_of(path) == f"{path}: data.prompts[0].limit: expected >= 1, got 0"
    assert load_recipe(None, ["train.max_steps=0", "eval.temperature=0"]).train.max_steps == 0


def test_cross_field_checks(write):
    path = write("drafter: {type: prompt_lookup, min_ngram: 4, max_ngram: 2}")
    assert error_of(path) == f"{path}: drafter.max_ngram: expected >= drafter.min_ngram (4), got 2"
    path = write("drafter: {num_layers: 2, init_layers: [0, 1, 2]}")
    assert error_of(path) == (
        f"{path}: drafter.init_layers: expected drafter.num_layers (2) entries, got 3"
    )
    msg = error_of(None, ["loss.mix={jsd: 0}"])
    assert msg == "--set loss.mix={jsd: 0}: expected weights with a positive sum"
    msg = error_of(None, ["drafter={type: prompt_lookup}", "drafter.min_ngram=5"])
    assert (
        msg
        == "--set drafter.min_ngram=5: drafter.max_ngram: expected >= drafter.min_ngram (5), got 3"
    )
    # a family's keys belong to its section only
    path = write("drafter: {type: eagle3, max_ngram: 2}")
    assert error_of(path) == f"{path}: drafter.max_ngram: unknown key"


def test_overrides(write):
    path = write("train: {lr: 0.1, batch_size: 2}\ndata: {regenerate: {max_new_tokens: 9}}\n")
    r = load_recipe(
        path,
        [
            "train.lr=3e-4",
            "eval.prompts=[mtbench]",
            "loss.mix.jsd=0.5",
            "data.regenerate={enabled: false}",
            "run.output_dir=/tmp/x",
            "target.gguf_file=null",
            "drafter.init_layers=[0, -1]",
        ],
    )
    assert r.train.lr == 3e-4 and r.train.batch_size == 2
    assert r.eval.prompts == [PromptSource("mtbench")]
    assert r.loss.mix == {"jsd": 0.5}
    assert r.data.regenerate.enabled is False
    assert r.data.regenerate.max_new_tokens == 9  # a mapping merges into the section
    assert r.run_dir == Path("/tmp/x")
    assert r.drafter.init_layers == [0, -1]


def test_later_override_wins():
    assert load_recipe(None, ["eval.k=2", "eval.k=6"]).eval.k == 6


def test_override_errors(write):
    assert error_of(None, ["train.lr=abc"]) == "--set train.lr=abc: expected a float, got 'abc'"
    assert error_of(None, ["train.lrr=1"]) == (
        "--set train.lrr=1: unknown key (did you mean 'train.lr'?)"
    )
    assert error_of(None, ["trian.lr=1"]) == (
        "--set trian.lr=1: trian: unknown key (did you mean 'train'?)"
    )
    assert error_of(None, ["train.lr"]).startswith("--set train.lr: expected KEY=VALUE")
    assert error_of(None, ["=3"]).startswith("--set =3: expected KEY=VALUE")
    msg = error_of(None, ["eval.prompts=[{source: a, format: bad}]"])
    assert msg.startswith("--set eval.prompts=[{source: a, format: bad}]: eval.prompts[0].format:")
    msg = error_of(None, ["train.lr=[1"])
    assert msg.startswith("--set train.lr=[1: line 1, column 3: invalid YAML")
    # an error in the file is still blamed on the file
    path = write("train: {lr: fast}")
    assert error_of(path, ["eval.k=2"]) == f"{path}: train.lr: expected a float, got 'fast'"


def test_missing_file(tmp_path):
    path = tmp_path / "nope.yaml"
    assert error_of(path) == f"recipe not found: {path}"
    assert error_of(tmp_path) == f"recipe not found: {tmp_path}"


def test_invalid_yaml_names_file_and_line(write):
    path = write("train:\n  lr: 0.1\n  batch_size: [2\n  max_steps: 3\n")
    msg = error_of(path)
    assert msg.startswith(f"{path}: line 4, column ")
    assert "invalid YAML" in msg
    path = write("train:\n\tlr: 0.1\n")
    assert re.match(rf"{re.escape(str(path))}: line 2, column \d+: invalid YAML", error_of(path))


def test_not_a_mapping(write):
    path = write("- train\n- eval\n")
    assert error_of(path) == f"{path}: expected a mapping of sections, got ['train', 'eval']"


def test_accelerate_config_is_refused(write):
    path = write("compute_environment: LOCAL_MACHINE\ndistributed_type: 'NO'\n")
    assert "an accelerate config, not a recipe" in error_of(path)


def test_config_error_is_a_specdec_error():
    assert issubclass(ConfigError, SpecdecError)


def test_recipe_from_dict():
    r = recipe_from_dict({"eval": {"k": 2}})
    assert r.eval.k == 2
    with pytest.raises(ConfigError, match=r"^<dict>: eval.kk: unknown key"):
        recipe_from_dict({"eval": {"kk": 2}})
    with pytest.raises(ConfigError, match=r"^mine: eval.k: expected an integer"):
        recipe_from_dict({"eval": {"k": "2"}}, source="mine")


def test_round_trip_through_dict_and_yaml(tmp_path):
    r = load_recipe(
        None,
        [
            "run.name=rt",
            "train.lr=1e-5",
            "loss.mix={forward_kl: 0.7, tvd: 0.3}",
            "data.prompts=[a.jsonl, {source: org/set, split: test, limit: 5}]",
            "train.mixed_precision=no",
            "target.revision='1234'",
            "train.trackers=[wandb]",
        ],
    )
    d = recipe_to_dict(r)
    assert d["data"]["prompts"][1] == {
        "source": "org/set",
        "format": "auto",
        "split": "test",
        "offset": 0,
        "limit": 5,
        "category": None,
        "responses": "regenerate",
    }
    assert recipe_from_dict(d) == r
    path = tmp_path / "run" / "recipe.yaml"
    save_recipe(r, path)
    assert load_recipe(path) == r
    assert r.target.revision == "1234"
    assert [p.name for p in path.parent.iterdir()] == ["recipe.yaml"]  # no temporary left


def test_save_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "recipe.yaml"
    save_recipe(Recipe(), path)
    before = path.read_text()

    def fail(*args):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError):
        save_recipe(load_recipe(None, ["run.name=other"]), path)
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["recipe.yaml"]


def test_describe_lists_every_key():
    text = describe()
    for key in (
        "run.name: str = 'run'",
        "target.model: str = 'smollm2-135m-instruct'",
        "data.prompts: list[PromptSource] = [alpaca_eval, arena_hard, ifeval, writingbench_en]",
        "data.prompts[].source: str = (required)",
        "data.regenerate.top_p: float = 1.0",
        "train.schedule: 'cosine' | 'linear' | 'constant' = 'cosine'",
        "loss.mix: dict[str, float] = {}",
        "eval.k: int = 4",
        "export.formats: list[str] = ['hf']",
    ):
        assert key in text
    assert "Peak learning rate" in text and "[> 0]" in text
    families = "draft_model, eagle3, medusa, mtp, prompt_lookup"
    assert f"drafter.type: one of {families} = 'draft_model'" in text
    assert "drafter:  # when drafter.type is 'eagle3'" in text
    assert "drafter.ttt_steps: int = 3" in text and "drafter.max_ngram: int = 3" in text


def test_iter_recipes_skips_accelerate(tmp_path):
    for rel in ("a.yaml", "x/b.yaml", "accelerate/cpu.yaml"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    assert [p.relative_to(tmp_path).as_posix() for p in iter_recipes(tmp_path)] == [
        "a.yaml",
        "x/b.yaml",
    ]


def test_literal_choices_match_the_modules_that_read_them():
    """A recipe accepts exactly the prompt formats the chat module parses and the draft
    forwards the drafter knows."""
    from typing import get_args, get_type_hints

    from specdec.config import EvalConfig, PromptSource
    from specdec.data.chat import FORMATS
    from specdec.decoding.compact import TARGET_FORWARDS
    from specdec.drafters.draft_model import DRAFT_FORWARDS

    assert get_args(get_type_hints(PromptSource)["format"]) == FORMATS
    assert get_args(get_type_hints(EvalConfig)["draft_forward"]) == DRAFT_FORWARDS
    assert get_args(get_type_hints(EvalConfig)["target_forward"]) == TARGET_FORWARDS
