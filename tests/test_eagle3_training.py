"""Training an EAGLE-3 head through the one training loop, on the tiny eagle3 recipe: what
changes and what stays frozen, DDP equivalence (weights, not only losses) and resuming after
SIGKILL."""

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_training import finish, launch, losses, setup

from specdec import drafters
from specdec.config import load_recipe

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "debug" / "tiny_eagle3.yaml"


# the tiny target and prompt files of the draft-model training tests
files = setup


def overrides(files: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        f"target.model={files / 'target'}",
        f"run.output_dir={run_dir}",
        f"data.prompts=[{files / 'train.jsonl'}]",
        f"eval.prompts=[{files / 'eval.jsonl'}]",
        "train.warmup_steps=0",  # the first update counts too
        *extra,
    ]


@pytest.mark.parametrize("freeze_lm_head", [False, True])
def test_head_trains_target_and_embedding_stay_frozen(
    files, tmp_path, loaded_targets, freeze_lm_head
):
    """Every weight of the head changes; with ``drafter.freeze_lm_head`` every one but the LM
    head, which stays the target's rows at the draft tokens, and is saved all the same."""
    from specdec.training.loop import train

    seen = loaded_targets  # the target instance the run trains against
    run_dir = tmp_path / "run"
    frozen = f"drafter.freeze_lm_head={str(freeze_lm_head).lower()}"
    recipe = load_recipe(RECIPE, overrides(files, run_dir, "train.save_every=100", frozen))
    summary = train(recipe)
    assert summary["steps"] == 4
    before = load_file(files / "target" / "model.safetensors")
    after = seen[0].model.state_dict()
    assert set(before) <= set(after)
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), f"target {name} changed"

    ckpt_dir = run_dir / "checkpoints" / "step-000004"
    ckpt = load_file(ckpt_dir / "model.safetensors")
    state = load_file(run_dir / "state" / "model.safetensors")
    torch.manual_seed(recipe.run.seed)  # the untrained head, rebuilt as the run built it
    from specdec.data.build import load_training_data
    from specdec.drafters.vocabulary import token_counts

    dataset, _ = load_training_data(recipe, seen[0].tokenizer)
    fresh = drafters.build(seen[0], recipe.drafter, token_counts(dataset, seen[0].vocab_size))
    trained = {k for k in ckpt if k not in ("d2t", "t2d")}
    assert trained == set(fresh.module.state_dict()) == set(state)
    for name, tensor in fresh.module.state_dict().items():
        if freeze_lm_head and name == "lm_head.weight":
            ids = ckpt["d2t"] + torch.arange(len(ckpt["d2t"]))  # the run's draft tokens
            head = seen[0].model.get_output_embeddings().weight[ids]
            assert torch.equal(ckpt[name], head), "the frozen LM head changed"
        else:
            assert not torch.equal(tensor, ckpt[name]), f"{name} did not change"
        assert torch.equal(state[name], ckpt[name])
    score = json.loads((ckpt_dir / "score.json").read_text())
    assert score["drafter"] == "eagle3" and score["greedy_match_rate"] == 1.0
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = metrics[0]
    for key in ("train/acc@1", "train/acc@3", "train/expected_accept@3", "train/out_of_vocab"):
        assert 0.0 <= logged[key] <= 1.0


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_two_processes_match_one_with_accumulation(files, tmp_path, fsdp):
    args = ["train.save_every=100"]
    one = launch(overrides(files, tmp_path / "one", "train.grad_accum=2", *args), recipe=RECIPE)
    finish(one)
    two = launch(
        overrides(files, tmp_path / "two", "train.grad_accum=1", *args),
        processes=2,
        recipe=RECIPE,
        fsdp=fsdp,
    )
    out = finish(two)
    assert ("FSDP: the drafter sharded across 2 processes" in out) == fsdp
    assert out.count("run directory:") == 1  # one report, from the main process
    a, b = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert [s for s, _ in a] == [s for s, _ in b] == [1, 2, 3, 4]
    for (_, x), (_, y) in zip(a, b, strict=True):
        assert x == pytest.approx(y, rel=1e-4, abs=1e-6)
    ckpt = Path("checkpoints") / "step-000004" / "model.safetensors"
    w1, w2 = load_file(tmp_path / "one" / ckpt), load_file(tmp_path / "two" / ckpt)
    assert set(w1) == set(w2)
    for name in w1:
        torch.testing.assert_close(w1[name], w2[name], atol=1e-6, rtol=1e-4)


def test_resume_after_sigkill_continues_identically(files, tmp_path):
    args = ["train.max_steps=8", "train.save_every=2"]
    finish(launch(overrides(files, tmp_path / "whole", *args), recipe=RECIPE))
    run_dir = tmp_path / "killed"
    proc = launch(overrides(files, run_dir, *args), recipe=RECIPE, start_new_session=True)
    deadline = time.time() + 240
    while time.time() < deadline and not (run_dir / "checkpoints" / "step-000002").exists():
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    assert losses(run_dir)[-1][0] < 8  # killed mid-run
    out = finish(launch(overrides(files, run_dir, *args), recipe=RECIPE))
    assert "resumed" in out
    got, expected = losses(run_dir), losses(tmp_path / "whole")
    assert [s for s, _ in got] == [s for s, _ in expected] == list(range(1, 9))
    assert [x for _, x in got] == pytest.approx([x for _, x in expected], rel=1e-6)
    final = load_file(run_dir / "state" / "model.safetensors")
    whole = load_file(tmp_path / "whole" / "state" / "model.safetensors")
    for name in whole:
        torch.testing.assert_close(final[name], whole[name], atol=1e-6, rtol=1e-5)


DETAILED = (
    "train/acc@3",
    "train/top5@1",
    "train/expected_accept",
    "train/expected_accept@3",
    "train/out_of_vocab",
    "train/teacher_mass",
)


def test_steps_between_logs_skip_the_metrics_and_train_the_same(files, tmp_path, monkeypatch):
    """Logged every 4 steps (and at the end of a time budget the loop sees coming), a run
    computes every metric on the steps it may log only and trains exactly as one logged every
    step: the same losses and metrics at the logged steps, and the same weights. A clock that
    advances one second per reading makes every step cost one second: a budget of 0.1 minutes
    ends at step 6."""
    from itertools import count

    from specdec.training import loop

    computed = []
    drafter_loss = loop.drafter_loss

    def spy(*args):
        loss, metrics, rows = drafter_loss(*args)
        computed.append("train/expected_accept" in metrics)
        return loss, metrics, rows

    monkeypatch.setattr(loop, "drafter_loss", spy)
    ticks = count()
    monkeypatch.setattr(loop, "clock", lambda: float(next(ticks)))

    def run(name: str, *extra: str) -> list[dict]:
        args = ("train.save_every=100", "train.max_steps=20", "train.max_minutes=0.1", *extra)
        loop.train(load_recipe(RECIPE, overrides(files, tmp_path / name, *args)))
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return [m for m in map(json.loads, lines) if "train/loss" in m]

    every = run("every")  # log_every: 1
    assert computed == [True] * 6
    computed.clear()
    sparse = run("sparse", "train.log_every=4")
    # steps 4 and 6 (the budget's last) are logged; 1 (no step timed yet) and 5 (three steps'
    # seconds or less left) compute every metric too
    assert computed == [True, False, False, True, True, True]
    assert [m["step"] for m in sparse] == [4, 6]
    for logged in sparse:
        twin = next(m for m in every if m["step"] == logged["step"])
        for key in ("train/loss", *DETAILED):
            assert logged[key] == pytest.approx(twin[key], rel=1e-6), key
    a = load_file(tmp_path / "every" / "checkpoints" / "step-000006" / "model.safetensors")
    b = load_file(tmp_path / "sparse" / "checkpoints" / "step-000006" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
