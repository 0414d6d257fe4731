"""Nothing a user owns is lost: directory swaps a crash cut short are finished, a step killed
before its score is scored on resume, ``best`` follows the scores on disk, a run is never
overwritten unasked, a run directory can move, written files get normal modes, a torn metrics
line is dropped, and drafters with missing weights or unreadable tokenizers are refused."""

import json
import os
import shutil
from pathlib import Path

import pytest
import tiny_models
import torch
from safetensors.torch import load_file, save_file
from test_training import overrides, setup  # noqa: F401  (setup is a fixture)

from specdec import drafters
from specdec.config import load_recipe, save_recipe
from specdec.errors import ConfigError, ModelError
from specdec.files import atomic_dir, old_copy, recover_dir, replace_dir, write_json
from specdec.target import FrozenTarget
from specdec.training.checkpoint import update_best
from specdec.training.trackers import _lines

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "debug" / "tiny.yaml"


def run(files, run_dir, *extra):
    from specdec.training.loop import train

    args = overrides(files, run_dir, "train.save_every=2", "train.schedule=constant", *extra)
    return train(load_recipe(RECIPE, args))


def losses(run_dir: Path) -> dict[int, float]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {m["step"]: m["train/loss"] for m in lines if "train/loss" in m}


def same_weights(a: Path, b: Path) -> None:
    x, y = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert x.keys() == y.keys()
    for name in x:
        torch.testing.assert_close(x[name], y[name], atol=1e-6, rtol=1e-5)


def test_a_swap_cut_between_its_renames_is_finished(tmp_path):
    final, new = tmp_path / "state", tmp_path / "state.tmp"
    for path, text in ((final, "old"), (new, "new")):
        path.mkdir()
        (path / "f").write_text(text)
    os.replace(final, old_copy(final))  # the crash: the first rename only
    assert not final.exists()
    assert recover_dir(final, new)
    assert (final / "f").read_text() == "new" and not new.exists()
    assert not old_copy(final).exists()
    # without the new version, the old one comes back
    os.replace(final, old_copy(final))
    assert recover_dir(final) and (final / "f").read_text() == "new"
    assert not recover_dir(final)  # nothing to do
    # the next replace finishes an earlier cut swap first
    os.replace(final, old_copy(final))
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "f").write_text("newest")
    replace_dir(fresh, final)
    assert (final / "f").read_text() == "newest" and not old_copy(final).exists()


def test_training_resumes_after_a_crash_inside_its_state_swap(setup, tmp_path):  # noqa: F811
    run(setup, tmp_path / "whole", "train.max_steps=4")
    cut = tmp_path / "cut"
    run(setup, cut, "train.max_steps=2")
    os.replace(cut / "state", old_copy(cut / "state"))  # killed between the two renames
    run(setup, cut, "train.max_steps=4")
    assert losses(cut) == pytest.approx(losses(tmp_path / "whole"), rel=1e-6)
    assert sorted(losses(cut)) == [1, 2, 3, 4]
    same_weights(cut / "state", tmp_path / "whole" / "state")


def test_a_step_killed_before_its_score_is_scored_on_resume(setup, tmp_path):  # noqa: F811
    run_dir = tmp_path / "run"
    run(setup, run_dir, "train.max_steps=2")
    shutil.rmtree(run_dir / "checkpoints" / "step-000002")  # killed after the state was saved
    (run_dir / "best").unlink()
    (run_dir / "best.json").unlink()
    summary = run(setup, run_dir, "train.max_steps=4")
    assert [row["checkpoint"] for row in summary["scores"]] == ["step-000002", "step-000004"]
    best = json.loads((run_dir / "best.json").read_text())
    assert (run_dir / best["path"] / "score.json").is_file()
    assert (run_dir / "best").resolve() == (run_dir / best["path"]).resolve()


def test_resume_false_never_overwrites_a_run(setup, tmp_path):  # noqa: F811
    run_dir = tmp_path / "run"
    run(setup, run_dir, "train.max_steps=2")
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    with pytest.raises(ConfigError, match=r"train\.resume: false, but .* holds a run"):
        run(setup, run_dir, "train.max_steps=2", "train.resume=false")
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before


def test_a_copied_run_directory_resumes_where_it_lies(setup, tmp_path):  # noqa: F811
    run(setup, tmp_path / "whole", "train.max_steps=4")
    run(setup, tmp_path / "first", "train.max_steps=2")
    shutil.copytree(tmp_path / "first", tmp_path / "moved", symlinks=True)
    shutil.rmtree(tmp_path / "first")
    run(setup, tmp_path / "moved", "train.max_steps=4")
    assert losses(tmp_path / "moved") == pytest.approx(losses(tmp_path / "whole"), rel=1e-6)
    best = json.loads((tmp_path / "moved" / "best.json").read_text())
    assert not Path(best["path"]).is_absolute()


def test_damaged_state_is_named_on_resume(setup, tmp_path):  # noqa: F811
    run_dir = tmp_path / "run"
    run(setup, run_dir, "train.max_steps=2")
    (run_dir / "state" / "model.safetensors").write_bytes(b"not weights")
    with pytest.raises(ConfigError, match=r"state: cannot resume from it \("):
        run(setup, run_dir, "train.max_steps=4")


def scored(run_dir: Path, step: int, tau, settings=None, raw: str | None = None) -> Path:
    path = run_dir / "checkpoints" / f"step-{step:06d}"
    path.mkdir(parents=True)
    if raw is not None:
        (path / "score.json").write_text(raw)
        return path
    score = {"tau": tau, "speedup": tau / 1.1, "greedy_match_rate": 1.0}
    write_json(path / "score.json", score | {"settings": settings or {"k": 4}})
    return path


def test_best_follows_the_scores_on_disk(tmp_path):
    run_dir = tmp_path
    a = scored(run_dir, 2, 1.2)
    assert update_best(run_dir, a, {"tau": 1.2, "settings": {"k": 4}})
    b = scored(run_dir, 4, 1.5)
    assert update_best(run_dir, b, {"tau": 1.5, "settings": {"k": 4}})
    (run_dir / "best.json").write_text("{torn")  # a damaged best.json misleads nothing
    scored(run_dir, 6, 9.0, settings={"k": 8})  # another k: not comparable
    scored(run_dir, 8, None, raw="{not json")
    c = scored(run_dir, 10, 1.5)  # a tie: the earlier checkpoint stays
    assert not update_best(run_dir, c, {"tau": 1.5, "settings": {"k": 4}})
    best = json.loads((run_dir / "best.json").read_text())
    assert best == {
        "checkpoint": "step-000004",
        "path": "checkpoints/step-000004",
        "tau": 1.5,
        "speedup": 1.5 / 1.1,
        "greedy_match_rate": 1.0,
    }
    assert os.readlink(run_dir / "best") == "checkpoints/step-000004"


def test_written_files_and_directories_have_normal_modes(tmp_path):
    old = os.umask(0o022)
    try:
        write_json(tmp_path / "a.json", {"x": 1})
        save_recipe(load_recipe(RECIPE), tmp_path / "recipe.yaml")
        with atomic_dir(tmp_path / "ckpt") as tmp:
            (tmp / "w").write_text("x")
    finally:
        os.umask(old)
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "recipe.yaml").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "ckpt").stat().st_mode & 0o777 == 0o755
    assert not list(tmp_path.glob(".*"))  # no temporary left behind


def test_metrics_log_drops_a_torn_last_line_and_names_a_damaged_one(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "x": 1}\n{"step": 2, "x": 2}\n{"step": 3, "x"')
    assert [line["step"] for line in _lines(path)] == [1, 2]
    assert "dropped its last line" in caplog.text
    path.write_text('{"step": 1}\n[1, 2]\n{"step": 3}\n')
    with pytest.raises(ConfigError, match=r"metrics\.jsonl: line 2 is not a metrics line"):
        _lines(path)


@pytest.fixture
def draft_dir(tmp_path):
    """A tiny causal LM sharing the tiny target's tokenizer, saved as transformers does."""
    model, tokenizer = tiny_models.tiny_llama()
    model.save_pretrained(tmp_path / "draft")
    tokenizer.save_pretrained(tmp_path / "draft")
    return tmp_path / "draft"


def test_draft_model_with_a_missing_weight_is_refused(draft_dir):
    target = FrozenTarget(*tiny_models.tiny_llama(), name="tiny")
    drafters.from_model(str(draft_dir), target)  # whole: loads
    weights = load_file(draft_dir / "model.safetensors")
    dropped = next(k for k in weights if "layers.0.mlp.up_proj" in k)
    save_file({k: v for k, v in weights.items() if k != dropped}, draft_dir / "model.safetensors")
    with pytest.raises(ModelError, match=r"1 weights missing or misshapen .*up_proj"):
        drafters.from_model(str(draft_dir), target)


def test_draft_model_with_an_unreadable_tokenizer_is_refused(draft_dir):
    target = FrozenTarget(*tiny_models.tiny_llama(), name="tiny")
    (draft_dir / "tokenizer.json").write_text("{ not a tokenizer")
    with pytest.raises(ModelError, match=r"tokenizer\.json: unreadable tokenizer"):
        drafters.from_model(str(draft_dir), target)


def test_best_is_rebuilt_on_resume(setup, tmp_path):  # noqa: F811
    """Killed between the last score and its ``best`` update: resuming puts ``best`` right."""
    run_dir = tmp_path / "run"
    run(setup, run_dir, "train.max_steps=2")
    (run_dir / "best").unlink()
    (run_dir / "best.json").unlink()
    run(setup, run_dir, "train.max_steps=2")  # nothing left to train
    best = json.loads((run_dir / "best.json").read_text())
    assert best["checkpoint"] == "step-000002"
    assert (run_dir / "best").resolve() == (run_dir / "checkpoints" / "step-000002").resolve()
