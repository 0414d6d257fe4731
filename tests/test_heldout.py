"""Training metrics that predict decoding: held-out target-written rows never trained on and
evaluated every log interval, and first-step accuracy per data source."""

import json
import logging

import pytest
import torch
from datasets import Dataset
from test_training import RECIPE, overrides, setup  # noqa: F401  (setup is a fixture)

from specdec.config import load_recipe
from specdec.data.build import split_rows
from specdec.training.heldout import SourceAccuracy
from specdec.training.step import micro_batch


class OneProcess:
    device = torch.device("cpu")

    @staticmethod
    def reduce(tensor, op):
        return tensor


def rows(written: list[bool], sources: list[str] | None = None) -> Dataset:
    n = len(written)
    return Dataset.from_dict(
        {
            "input_ids": [[1, 2, 3 + i] for i in range(n)],
            "loss_mask": [[0, 1, 1]] * n,
            "source": sources or ["a"] * n,
            "target_written": written,
        }
    )


def test_heldout_rows_are_target_written_seeded_and_capped(caplog):
    written = [i % 3 != 0 for i in range(40)]  # 26 target-written rows
    data = rows(written)
    train, heldout = split_rows(data, 5, seed=1)
    assert len(heldout) == 5 and all(written[i] for i in heldout.tolist())
    assert sorted(train.tolist() + heldout.tolist()) == list(range(40))
    assert torch.equal(split_rows(data, 5, seed=1)[1], heldout)
    assert not torch.equal(split_rows(data, 5, seed=2)[1], heldout)
    with caplog.at_level(logging.WARNING):
        train, heldout = split_rows(data, 30, seed=1)
    assert len(heldout) == 26 // 4 and "30 asked, 6 held out" in caplog.text
    assert len(split_rows(data, 0, seed=1)[1]) == 0
    assert len(split_rows(rows([False] * 8), 4, seed=1)[1]) == 0  # nothing the target wrote


def test_micro_batches_cover_the_training_rows_only():
    data = rows([True] * 24)
    train, heldout = split_rows(data, 6, seed=0)
    for group in (1, 3):
        lengths = torch.arange(24) % 5
        seen = [
            r
            for i in range(len(train) // 3)  # one epoch of batches of 3
            for r in micro_batch(data, i, 3, 0, 0, lengths, group, rows=train)["rows"].tolist()
        ]
        assert sorted(seen) == train.tolist()
        second = micro_batch(data, len(train) // 3, 3, 0, 0, lengths, group, rows=train)
        assert not set(second["rows"].tolist()) & set(heldout.tolist())


def test_accuracy_per_source_by_hand():
    acc = SourceAccuracy(["web", "code", "web", "math", "code"])
    acc.add(torch.tensor([0, 1, 3]), torch.tensor([2, 1, 0]), torch.tensor([4, 5, 3]))
    acc.add(torch.tensor([2, 4]), torch.tensor([3, 5]), torch.tensor([4, 5]))
    got = acc.metrics(OneProcess())
    assert got == pytest.approx(
        {"train/acc@1/web": 5 / 8, "train/acc@1/code": 6 / 10, "train/acc@1/math": 0.0}
    )
    assert acc.metrics(OneProcess()) == {}  # a new window


def expected_heldout(run_dir, recipe, heldout_rows):
    """acc@1 and expected acceptance of the saved drafter on each held-out row alone, from
    the target's and the drafter's full forwards."""
    from specdec import drafters
    from specdec.data.build import load_training_data
    from specdec.target import FrozenTarget

    target = FrozenTarget.from_config(recipe.target)
    drafter = drafters.load(run_dir / "checkpoints" / "step-000004", target)
    dataset, _ = load_training_data(recipe, target.tokenizer)
    agree = overlap = mass = positions = 0.0
    for r in heldout_rows.tolist():
        ids = torch.tensor([dataset[r]["input_ids"]])
        mask = torch.tensor(dataset[r]["loss_mask"])
        with torch.no_grad():
            p = torch.softmax(target.model(ids).logits[0].double(), -1)  # [T, V]
            q_draft = torch.softmax(drafter.module(ids, torch.ones_like(ids), [])[0, 0], -1)
        q = torch.zeros_like(p)
        ids_out = drafter.draft_ids if drafter.draft_ids is not None else torch.arange(p.shape[1])
        q[:, ids_out] = q_draft.double()
        for t in range(ids.shape[1] - 1):
            if mask[t + 1]:  # token t + 1 is the assistant's: the draft at t is trained there
                positions += 1
                agree += float(q[t].argmax() == p[t].argmax())
                overlap += float(torch.minimum(p[t], q[t]).sum())
                mass += float(p[t, ids_out].sum())
    return agree / positions, overlap / positions, mass / positions


def test_heldout_metrics_every_log_interval(setup, tmp_path):  # noqa: F811
    from specdec.data.build import load_training_data
    from specdec.target import FrozenTarget
    from specdec.training.loop import train

    run_dir = tmp_path / "run"
    extra = ("data.heldout_rows=2", "train.log_every=1", "train.save_every=4")
    extra += ("drafter.init_from_target=true",)  # agreeing with the target often, not always
    extra += ("drafter.draft_vocab_size=96",)  # the target puts mass outside the draft's tokens
    recipe = load_recipe(RECIPE, overrides(setup, run_dir, *extra))
    train(recipe)
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [m for m in lines if "heldout/acc@1" in m]
    assert [m["step"] for m in logged] == [1, 2, 3, 4]
    target = FrozenTarget.from_config(recipe.target)
    dataset, _ = load_training_data(recipe, target.tokenizer)
    _, heldout = split_rows(dataset, 2, recipe.run.seed)
    acc, accept, mass = expected_heldout(run_dir, recipe, heldout)
    assert logged[-1]["heldout/acc@1"] == pytest.approx(acc, abs=1e-6)
    assert logged[-1]["heldout/expected_accept"] == pytest.approx(accept, rel=1e-4)
    assert 0 < mass < 0.99 and logged[-1]["heldout/teacher_mass"] == pytest.approx(mass, rel=1e-5)
    assert 0 < acc < 1 and 0 < accept < 1
    for m in logged:  # one source (the prompts file's name), a window of one step
        assert [k for k in m if k.startswith("train/acc@1/")] == ["train/acc@1/target/train"]
        assert m["train/acc@1/target/train"] == pytest.approx(m["train/acc@1"], abs=1e-6)


def test_loss_on_all_teaches_prompts_and_still_measures_heldout_on_answers(setup, tmp_path):  # noqa: F811
    """``data.loss_on: all``: the teacher cache holds the target's distribution at every
    position of every row (prompts too, held-out rows too: the cache does not depend on the
    split), and the held-out metrics are those of the held-out rows' answers alone."""
    from specdec.data.build import load_training_data
    from specdec.target import FrozenTarget
    from specdec.training.loop import train

    extra = ("data.heldout_rows=2", "train.log_every=1", "train.save_every=4")
    extra += ("drafter.init_from_target=true", "drafter.draft_vocab_size=96")
    extra += ("data.teacher=cache", "data.cache.dtype=float32", "data.cache.top_k=0")  # exact
    taught = {}
    for loss_on in ("assistant", "all"):
        run_dir = tmp_path / loss_on
        recipe = load_recipe(RECIPE, overrides(setup, run_dir, *extra, f"data.loss_on={loss_on}"))
        train(recipe)
        manifest = json.loads((run_dir / "teacher-cache" / "manifest.json").read_text())
        taught[loss_on] = manifest["teacher_positions"]

    target = FrozenTarget.from_config(recipe.target)
    dataset, _ = load_training_data(recipe, target.tokenizer)  # assistant-only masks
    _, heldout = split_rows(dataset, 2, recipe.run.seed)
    answers = [sum(m[1:]) for m in dataset["loss_mask"]]  # position t teaches token t + 1
    every = [len(ids) - 1 for ids in dataset["input_ids"]]
    held = set(heldout.tolist())
    assert taught["assistant"] == sum(answers)
    assert taught["all"] == sum(every) > taught["assistant"]
    assert held and all(answers[r] < every[r] for r in held)  # the held-out rows' prompts too

    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = [m for m in lines if "heldout/acc@1" in m][-1]
    acc, accept, _ = expected_heldout(run_dir, recipe, heldout)
    assert last["heldout/acc@1"] == pytest.approx(acc, abs=1e-6)
    assert last["heldout/expected_accept"] == pytest.approx(accept, rel=1e-4)


def test_a_held_out_prompt_is_not_trained_on_through_its_kept_twin():
    """A source both regenerated and kept gives each prompt two rows of one id: the target's
    answer and the source's own. When the target's is held out, the kept row trains neither:
    its prompt (and an answer often near the target's) would otherwise be learnt."""
    written = [True] * 20 + [False] * 20  # row 20 + i: the kept twin of row i
    data = rows(written).add_column("id", [f"src:{i % 20}" for i in range(40)])
    train, heldout = split_rows(data, 4, seed=3)
    assert len(heldout) == 4 and all(i < 20 for i in heldout.tolist())
    twins = {i + 20 for i in heldout.tolist()}
    assert set(train.tolist()) == set(range(40)) - set(heldout.tolist()) - twins
    # rows without ids (tokenized elsewhere) split as before: every row trains or is held out
    plain_train, plain_heldout = split_rows(rows(written), 4, seed=3)
    assert torch.equal(plain_heldout, heldout) and len(plain_train) == 36
