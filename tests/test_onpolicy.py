"""On-policy data: the drafter's own continuations (their tokens checked against the drafter's
training forward and against transformers' generate, their law by a chi-square test), the
mixing schedule, and a training run that mixes them in and resumes on the same rows."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import tiny_models
import torch
from safetensors.torch import load_file
from scipy.stats import chisquare
from test_training import overrides as draft_model_overrides
from test_training import setup  # noqa: F401  (a fixture)

from specdec import drafters
from specdec.config import load_recipe
from specdec.config.schema import OnPolicyConfig
from specdec.data.onpolicy import PolicyPool, prompt_of, rollout
from specdec.decoding.compact import target_session
from specdec.decoding.sampling import SamplingParams
from specdec.drafters.draft_model import DraftModelConfig, build_draft_model
from specdec.drafters.eagle3 import Eagle3Config
from specdec.errors import ConfigError
from specdec.target import FrozenTarget

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def target(request):
    build = tiny_models.tiny_llama if request.param == "llama" else tiny_models.tiny_qwen2
    return FrozenTarget(*build(), name=f"tiny-{request.param}")


def eagle3_head(target, steps: int) -> drafters.Drafter:
    torch.manual_seed(0)
    counts = torch.arange(target.vocab_size, 0, -1).float()
    drafter = drafters.build(target, Eagle3Config(draft_vocab_size=64, ttt_steps=steps), counts)
    with torch.no_grad():  # away from the identity start, so every weight matters
        for p in drafter.module.parameters():
            p.add_(0.05 * torch.randn_like(p))
    drafter.module.eval()
    drafter.configure("float32")
    return drafter


@torch.no_grad()
def test_eagle3_greedy_rollout_is_its_unrolled_training_forward(target):
    """Round r drafts k tokens from the target's features up to its first token: token
    L + s of a round starting at L is the argmax of training step s at row L - 2, computed
    here from one target forward over the finished text."""
    k, rounds = 3, 4
    drafter = eagle3_head(target, k)
    prompt = torch.randint(3, target.vocab_size, (9,), generator=torch.Generator().manual_seed(2))
    session = target_session(target.model, "transformers", drafter.required_target_layers)
    new = rollout(
        session, drafter, prompt.tolist(), k=k, max_new_tokens=k * rounds,
        params=SamplingParams(0.0),
    )  # fmt: skip
    assert len(new) == k * rounds
    ids = torch.tensor([prompt.tolist() + new])
    out = target.forward(ids, hidden_layers=drafter.required_target_layers)
    feats = [out.hidden_states[i] for i in drafter.required_target_layers]
    unrolled = drafter.module(ids, torch.ones_like(ids), feats)  # [k, 1, T, 64]
    expected = []
    for r in range(rounds):
        start = len(prompt) + r * k
        expected += [int(drafter.draft_ids[unrolled[s, 0, start - 2].argmax()]) for s in range(k)]
    assert new == expected
    # the target's own greedy text differs: these are the drafter's tokens, not the target's
    assert (
        new
        != target.model.generate(
            prompt[None], max_new_tokens=k * rounds, do_sample=False, pad_token_id=0
        )[0, len(prompt) :].tolist()
    )


def test_draft_model_rollout_is_its_own_generation_and_law(target):
    torch.manual_seed(0)
    drafter = build_draft_model(target, DraftModelConfig(num_layers=1))
    drafter.configure("float32")
    model = drafter.transformers_model()
    session = target_session(target.model)
    prompt = target.tokenizer("The quick brown fox").input_ids
    greedy = rollout(session, drafter, prompt, k=3, max_new_tokens=10, params=SamplingParams(0))
    reference = model.generate(
        torch.tensor([prompt]), max_new_tokens=10, do_sample=False, pad_token_id=0
    )[0, len(prompt) :].tolist()
    assert greedy == reference
    # sampled at T = 0.7: the first token's law is softmax(logits / 0.7) of the draft model
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1].float()
    p = torch.softmax(logits.double() / 0.7, -1).numpy()
    n = 3000
    draws = [
        rollout(
            session, drafter, prompt, k=2, max_new_tokens=1, params=SamplingParams(0.7),
            generator=torch.Generator().manual_seed(i),
        )[0]
        for i in range(n)
    ]  # fmt: skip
    top = np.argsort(-p)[:12]  # the likeliest tokens, the rest pooled
    observed = [sum(d == t for d in draws) for t in top]
    expected = [n * p[t] for t in top]
    observed.append(n - sum(observed))
    expected.append(n * (1 - p[top].sum()))
    assert chisquare(observed, expected).pvalue > 1e-3


def test_rollout_stops_at_eos_inside_a_round(target):
    torch.manual_seed(0)
    drafter = build_draft_model(target, DraftModelConfig(num_layers=1))
    session = target_session(target.model)
    prompt = target.tokenizer("Count to five").input_ids
    free = rollout(session, drafter, prompt, k=4, max_new_tokens=12, params=SamplingParams(0))
    eos = free[5]  # pretend the sixth token (second round) ends the text
    cut = rollout(
        session, drafter, prompt, k=4, max_new_tokens=12, params=SamplingParams(0), eos=[eos]
    )
    assert cut == free[: free.index(eos) + 1]


def test_split_mixes_the_fraction_from_the_first_refresh():
    pool = PolicyPool(OnPolicyConfig(fraction=0.25, refresh_every=3), seed=0, max_length=64)
    assert pool.split(5, 2) == (0, 0)  # nothing rolled out yet
    assert [pool.due(s) for s in range(8)] == [False, False, False, True] + [False] * 2 + [
        True,
        False,
    ]
    pool.rows = {"input_ids": [[1, 2]], "loss_mask": [[0, 1]]}
    pool.step = 3
    assert not pool.due(3)  # rolled out at this step already (a resumed run does not repeat it)
    got = [pool.split(s, 2) for s in range(3, 11)]  # slots: 2 micro-batches a step
    # by hand: a quarter of 2 slots a step is one on-policy micro-batch every other step
    assert got == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0), (3, 1)]
    pool = PolicyPool(OnPolicyConfig(fraction=0.6, refresh_every=1), seed=0, max_length=64)
    pool.rows = {"input_ids": [[1, 2]], "loss_mask": [[0, 1]]}
    got = [pool.split(s, 5) for s in range(1, 5)]
    assert got == [(0, 3), (3, 3), (6, 3), (9, 3)]


def test_prompt_of_a_training_row():
    assert prompt_of([5, 6, 7, 8, 9], [0, 0, 1, 1, 0]) == [5, 6]


def policy_args(files, run_dir, *extra):
    return draft_model_overrides(
        files,
        run_dir,
        "data.on_policy.fraction=0.5",
        "data.on_policy.refresh_every=2",
        "data.on_policy.prompts=4",
        "data.on_policy.max_new_tokens=6",
        "train.grad_accum=2",
        "train.schedule=constant",
        "train.warmup_steps=0",
        "train.save_every=100",
        *extra,
    )


def test_training_mixes_continuations_and_resumes_on_the_same_rows(setup, tmp_path):  # noqa: F811
    from specdec.training.loop import train

    recipe_path = ROOT / "recipes" / "debug" / "tiny.yaml"
    whole = tmp_path / "whole"
    train(load_recipe(recipe_path, policy_args(setup, whole, "train.max_steps=5")))
    lines = [json.loads(x) for x in (whole / "metrics.jsonl").read_text().splitlines()]
    train_lines = {m["step"]: m for m in lines if "train/loss" in m}
    for step in (1, 2):
        assert "train/acc@1/drafter/on-policy" not in train_lines[step]
    assert train_lines[3]["train/rollout_length"] > 0  # the refresh before step 3
    assert "train/rollout_seconds" not in train_lines[4]
    # one on-policy micro-batch a step from step 3 on; the fixed data moves by the other one
    for step in (3, 4, 5):
        assert 0 <= train_lines[step]["train/acc@1/drafter/on-policy"] <= 1
    # fixed-data micro-batches: 2 a step up to step 2, then 1: 7 by step 5 against 4
    assert train_lines[5]["train/epoch"] / train_lines[2]["train/epoch"] == pytest.approx(7 / 4)

    pool = torch.load(whole / "state" / "custom_checkpoint_2.pkl", weights_only=True)
    assert pool["refreshes"] == 2 and pool["step"] == 4 and len(pool["rows"]["input_ids"]) == 4
    for ids, mask in zip(pool["rows"]["input_ids"], pool["rows"]["loss_mask"], strict=True):
        first = mask.index(1)
        assert 1 <= sum(mask) <= 6 and mask[first:] == [1] * (len(ids) - first)

    # stopped between two refreshes, then resumed: the same rows, the same weights
    part = tmp_path / "part"
    train(load_recipe(recipe_path, policy_args(setup, part, "train.max_steps=3")))
    train(load_recipe(recipe_path, policy_args(setup, part, "train.max_steps=5")))
    got = [json.loads(x) for x in (part / "metrics.jsonl").read_text().splitlines()]
    got = {m["step"]: m["train/loss"] for m in got if "train/loss" in m}
    assert got == pytest.approx({s: m["train/loss"] for s, m in train_lines.items()}, rel=1e-6)
    a = load_file(whole / "state" / "model.safetensors")
    b = load_file(part / "state" / "model.safetensors")
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=1e-5)


def test_on_policy_settings_are_checked(setup, tmp_path):  # noqa: F811
    recipe_path = ROOT / "recipes" / "debug" / "tiny.yaml"
    with pytest.raises(
        ConfigError, match=r"refresh_every=4: 4 is not below train\.max_steps \(4\)"
    ):
        load_recipe(recipe_path, policy_args(setup, tmp_path, "data.on_policy.refresh_every=4"))
    with pytest.raises(ConfigError, match=r"prompts=1: 1 continuations cannot fill"):
        load_recipe(recipe_path, policy_args(setup, tmp_path, "data.on_policy.prompts=1"))
    off = ("data.on_policy.fraction=0", "data.on_policy.refresh_every=9")
    load_recipe(recipe_path, policy_args(setup, tmp_path, *off))  # off: nothing to check


@pytest.mark.parametrize("teacher", ["online", "cache"])
def test_eagle3_trains_on_its_own_continuations(
    setup,  # noqa: F811
    tmp_path,
    teacher,
    monkeypatch,
):
    """From the target online, or from a teacher cache of the fixed rows beside the target's
    logits on the continuations (which no cache holds)."""
    import sys

    from test_eagle3_training import overrides as eagle3_overrides

    from specdec.training.loop import train

    taught = []  # the target's forwards that teach a training step
    real = FrozenTarget.forward

    def counted(self, *args, **kwargs):
        frame = sys._getframe()
        while frame is not None and frame.f_code.co_name != "drafter_loss":
            frame = frame.f_back
        if frame is not None:
            taught.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(FrozenTarget, "forward", counted)

    recipe = ROOT / "recipes" / "debug" / "tiny_eagle3.yaml"
    run_dir = tmp_path / "run"
    args = [
        "data.on_policy.fraction=0.5",
        "data.on_policy.refresh_every=2",
        "data.on_policy.prompts=2",
        "data.on_policy.max_new_tokens=6",
        "train.save_every=100",
        f"data.teacher={teacher}",
    ]
    train(load_recipe(recipe, eagle3_overrides(setup, run_dir, *args)))
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    by_step = {m["step"]: m for m in lines if "train/loss" in m}
    # rolled out before step 3; half of one micro-batch a step: the first at step 4
    assert 1 <= by_step[3]["train/rollout_length"] <= 6
    assert all("train/acc@1/drafter/on-policy" not in by_step[s] for s in (1, 2, 3))
    assert 0 <= by_step[4]["train/acc@1/drafter/on-policy"] <= 1
    assert all(math.isfinite(m["train/loss"]) for m in by_step.values())
    assert (run_dir / "teacher-cache" / "manifest.json").exists() == (teacher == "cache")
    # online every micro-batch runs the target; from the cache only the continuations' (the
    # first in step 4 of the 4), and the held-out rows read the cache
    assert len(taught) >= 4 if teacher == "online" else 1 <= len(taught) < 4
