"""Training heads on a frozen target (Medusa-1, MTP) through the one training loop on their
tiny recipes: the heads change, the target (its LM head included, which full-vocabulary heads
read out through) stays bit-identical, every checkpoint is scored, per-head metrics are
logged."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_eagle3_training import overrides
from test_training import finish, launch, losses, setup

from specdec import drafters
from specdec.config import load_recipe

ROOT = Path(__file__).resolve().parents[1]
RECIPES = {"medusa": ("tiny_medusa.yaml", 3), "mtp": ("tiny_mtp.yaml", 2)}

files = setup  # the tiny target and prompt files of the draft-model training tests


@pytest.mark.parametrize("family", list(RECIPES))
def test_heads_train_and_the_target_stays_frozen(files, tmp_path, loaded_targets, family):
    from specdec.training.loop import train

    seen = loaded_targets  # the target instance the run trains against
    run_dir = tmp_path / "run"
    # the target's own LM head, shared by the heads: its weights must not move either
    extra = ("train.save_every=100", "drafter.draft_vocab_size=null")
    name, steps = RECIPES[family]
    recipe = load_recipe(ROOT / "recipes" / "debug" / name, overrides(files, run_dir, *extra))
    summary = train(recipe)
    assert summary["steps"] == 4
    before = load_file(files / "target" / "model.safetensors")
    after = seen[0].model.state_dict()
    assert set(before) <= set(after)
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), f"target {name} changed"

    ckpt_dir = run_dir / "checkpoints" / "step-000004"
    ckpt = load_file(ckpt_dir / "model.safetensors")
    torch.manual_seed(recipe.run.seed)
    fresh = drafters.build(seen[0], recipe.drafter)
    assert set(ckpt) == set(fresh.module.state_dict())  # the heads only: no LM head saved
    for name, tensor in fresh.module.state_dict().items():
        assert not torch.equal(tensor, ckpt[name]), f"{name} did not change"
    score = json.loads((ckpt_dir / "score.json").read_text())
    assert score["drafter"] == family and score["greedy_match_rate"] == 1.0
    logged = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    for s in range(1, steps + 1):
        assert 0.0 <= logged[f"train/acc@{s}"] <= logged[f"train/top5@{s}"] <= 1.0


@pytest.mark.parametrize("family", list(RECIPES))
def test_two_sharded_processes_match_one(files, tmp_path, family):
    """FSDP over gloo: each head (Medusa) or module (MTP) is a unit of its own, and two
    processes train the weights one process trains with both processes' micro-batches."""
    recipe = ROOT / "recipes" / "debug" / RECIPES[family][0]
    args = ["train.save_every=100"]
    one = launch(overrides(files, tmp_path / "one", "train.grad_accum=2", *args), recipe=recipe)
    finish(one)
    run = overrides(files, tmp_path / "two", "train.grad_accum=1", *args)
    out = finish(launch(run, processes=2, recipe=recipe, fsdp=True))
    assert "FSDP: the drafter sharded across 2 processes" in out
    a, b = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert [s for s, _ in a] == [s for s, _ in b] == [1, 2, 3, 4]
    for (_, x), (_, y) in zip(a, b, strict=True):
        assert x == pytest.approx(y, rel=1e-4, abs=1e-6)
    ckpt = Path("checkpoints") / "step-000004" / "model.safetensors"
    w1, w2 = load_file(tmp_path / "one" / ckpt), load_file(tmp_path / "two" / ckpt)
    assert set(w1) == set(w2)
    for name in w1:
        torch.testing.assert_close(w1[name], w2[name], atol=1e-6, rtol=1e-4)
