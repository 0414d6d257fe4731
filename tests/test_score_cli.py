"""The scoring command end to end on a tiny target, and its one-line errors."""

import json

import pytest
import tiny_models
import torch

from specdec.cli import main
from specdec.errors import DataError

REQUIRED = {
    "tau",
    "speedup",
    "greedy_match_rate",
    "accept_rate_per_position",
    "tokens_per_second",
    "baseline_tokens_per_second",
    "bound_speedup",
    "efficiency",
    "num_prompts",
    "per_category",
    "environment",
    "cost_profile_seconds",
    "c",
    "v",
    "accepted_length_histogram",
    "conditional_accept_rate_per_position",
    "overhead_fraction",
}


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [
        {"prompt": "Say hello to the sea.", "category": "chat"},
        {"turns": ["Write a loop in Python.", "Now in C."], "category": "code"},
        {"messages": [{"role": "user", "content": "List three colors."}], "category": "chat"},
        {"prompt": "Repeat: one two three one two three.", "category": "code"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def score(*args):
    return main(["score", *map(str, args)])


def test_prompt_lookup_scores_and_writes_report(tiny_llama_dir, prompt_file, tmp_path, capsys):
    out = tmp_path / "result" / "score.json"
    code = score(
        "--drafter",
        "prompt_lookup",
        "--target",
        tiny_llama_dir,
        "--prompts",
        prompt_file,
        "--num-prompts",
        3,
        "--max-new-tokens",
        12,
        "--k",
        3,
        "--out",
        out,
    )
    assert code == 0
    result = json.loads(out.read_text())
    assert result.keys() >= REQUIRED
    assert result["num_prompts"] == 3
    assert result["greedy_match_rate"] == 1.0
    assert len(result["accept_rate_per_position"]) == 3
    assert set(result["per_category"]) == {"chat", "code"}
    assert out.with_suffix(".png").stat().st_size > 0
    assert "tau" in capsys.readouterr().out
    # the cost ratios from their parts: a table lookup costs far less than a target step
    step = result["target_step_seconds"]
    per_draft = result["draft_seconds_per_round"] / result["mean_depth"]
    assert result["c"] == pytest.approx(per_draft / step) and 0 <= result["c"] < 0.5
    assert result["v"] == pytest.approx(result["verify_seconds_per_round"] / step)


@pytest.mark.parametrize(
    ("forward", "target_forward"), [("transformers", "transformers"), ("float32", "compact")]
)
def test_draft_model_perfect_draft_scores_tau_k_plus_one(
    tiny_llama_dir, prompt_file, tmp_path, forward, target_forward
):
    """The target as its own draft accepts everything, through transformers' forward and
    through the compact one (float32: the same numbers up to rounding)."""
    out = tmp_path / "score.json"
    code = score(
        "--draft-model",
        tiny_llama_dir,
        "--target",
        tiny_llama_dir,
        "--prompts",
        prompt_file,
        "--num-prompts",
        2,
        "--max-new-tokens",
        9,
        "--k",
        3,
        "--draft-forward",
        forward,
        "--target-forward",
        target_forward,
        "--out",
        out,
    )
    assert code == 0
    result = json.loads(out.read_text())
    assert result["accept_rate_per_position"] == [1.0, 1.0, 1.0]
    assert result["greedy_match_rate"] == 1.0
    assert result["settings"]["draft_forward"] == forward
    # 9 tokens: the prefill's, then two rounds of 3 accepted + 1 of the target's own
    assert result["tau"] == 4.0
    assert result["settings"]["target_forward"] == target_forward
    greedy = result["certificate"]["greedy"]
    assert (greedy["prompts"], greedy["identical"], greedy["failures"]) == (2, 2, [])
    assert result["certificate"]["passed"] is True


def test_score_records_the_sampling_certificate(prompt_file, tmp_path):
    model, tokenizer = tiny_models.tiny_llama()
    with torch.no_grad():  # a random tiny model's law is too flat to test with 1,000 draws
        model.lm_head.weight.mul_(25.0)
    sharp = str(tiny_models.save_tiny(model, tokenizer, tmp_path / "sharp"))
    out = tmp_path / "score.json"
    args = ("--draft-model", sharp, "--target", sharp, "--prompts", prompt_file)
    code = score(*args, "--num-prompts", 2, "--temperature", 1, "--certify", 2000, "--out", out)
    assert code == 0
    cert = json.loads(out.read_text())["certificate"]
    assert "greedy" not in cert  # sampled outputs are not compared token for token
    assert cert["sampling"]["samples"] == 2000 and cert["sampling"]["p_value"] >= 1e-3
    assert cert["sampling"]["dof"] > 10
    assert cert["passed"] is True


def one_line_error(capsys, *args) -> str:
    assert score(*args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("specdec: error:")]
    assert len(errors) == 1
    return errors[0]


def test_unknown_drafter(tiny_llama_dir, prompt_file, capsys):
    err = one_line_error(
        capsys, "--drafter", "prompt_lookupp", "--target", tiny_llama_dir, "--prompts", prompt_file
    )
    assert "unknown drafter 'prompt_lookupp'" in err and "prompt_lookup" in err


def test_k_below_one(tiny_llama_dir, prompt_file, capsys):
    err = one_line_error(
        capsys,
        "--drafter",
        "prompt_lookup",
        "--target",
        tiny_llama_dir,
        "--prompts",
        prompt_file,
        "--k",
        0,
    )
    assert "k" in err and ">= 1" in err


def test_prompt_file_without_usable_rows(tiny_llama_dir, tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"text": "no prompt here"}) + "\n")
    err = one_line_error(
        capsys, "--drafter", "prompt_lookup", "--target", tiny_llama_dir, "--prompts", empty
    )
    assert "empty.jsonl" in err


def test_draft_model_with_another_vocabulary(tiny_llama_dir, tmp_path, prompt_file, capsys):
    other = tiny_models.save_tiny(*tiny_models.tiny_qwen2(), tmp_path / "qwen")
    err = one_line_error(
        capsys, "--draft-model", other, "--target", tiny_llama_dir, "--prompts", prompt_file
    )
    assert "different vocabulary" in err


def test_checkpoint_that_is_not_one(tiny_llama_dir, tmp_path, prompt_file, capsys):
    err = one_line_error(
        capsys, "--checkpoint", tmp_path, "--target", tiny_llama_dir, "--prompts", prompt_file
    )
    assert "not a specdec checkpoint" in err and str(tmp_path) in err


def test_cost_profile_spreads_a_drift_over_every_size():
    """A machine slowing down while the profile is measured (every forward 1 ms slower than
    the one before, whatever its size) must not make the later-measured sizes look dearer
    than the first: sizes are measured in interleaved rounds."""
    from specdec.scoring.run import cost_profile

    class Drifting:
        def __init__(self):
            self.now, self.calls, self.length = 0.0, 0, 0

        def clock(self):
            return self.now

        def reset(self):
            self.length = 0

        def extend(self, tokens, **kwargs):
            self.calls += 1
            self.now += 0.010 + 0.001 * self.calls  # every size costs the same, plus drift
            self.length += len(tokens)

        def rollback(self, length):
            self.length = length

    profile = cost_profile(Drifting(), [1, 2, 3], max_tokens=5, repeats=9)
    assert max(profile.values()) - min(profile.values()) <= 0.001 * 5  # one round's drift


def test_help_states_each_flag_default_as_the_recipe_has_it(capsys):
    """Every decoding flag's help ends with its recipe default, a list-valued one included
    (a default built by a factory once printed as dataclasses' MISSING sentinel)."""
    with pytest.raises(SystemExit) as stop:
        main(["score", "--help"])
    assert stop.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "MISSING" not in text
    assert "(eval.tree_choices; default [])" in text
    assert "(eval.k; default 4)" in text


def test_eval_prompts_offset_limit_and_category_choose_the_rows_scored(tmp_path):
    """A recipe's eval.prompts entry is scored as it reads: its category, then its offset and
    limit (a score once took every source's first rows whatever the recipe said)."""
    from specdec.config import PromptSource
    from specdec.scoring.command import load_prompts

    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps({"prompt": f"a{i}", "category": "x"}) + "\n" for i in range(6)))
    b.write_text(
        "".join(json.dumps({"prompt": f"b{i}", "category": "yz"[i % 2]}) + "\n" for i in range(8))
    )
    rows = load_prompts(
        (PromptSource(str(a), offset=3, limit=2), PromptSource(str(b), category="y", offset=1)), 10
    )
    texts = [r["messages"][-1]["content"] for r in rows]
    # round robin: a3, b2 (the second "y" row), a4, b4, b6; a's slice ends at its limit
    assert texts == ["a3", "b2", "a4", "b4", "b6"]
    with pytest.raises(DataError, match=r"a\.jsonl\[9:\]: no rows"):
        load_prompts((PromptSource(str(a), offset=9),), 2)


def test_score_with_a_recipe_scores_its_offset_rows(tiny_llama_dir, tmp_path):
    """End to end: the rows past a recipe's offset are the ones decoded (their category says
    so) and the result names the slice."""
    prompts = tmp_path / "p.jsonl"
    rows = [{"prompt": f"Say {w} twice.", "category": c} for w, c in
            [("one", "early"), ("two", "early"), ("three", "late"), ("four", "late")]]  # fmt: skip
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "score.json"
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"target: {{model: {tiny_llama_dir}}}\ndrafter: {{type: prompt_lookup}}\n")
    code = score(
        "--config", recipe, "--set", f"eval.prompts=[{{source: {prompts}, offset: 2}}]",
        "--num-prompts", 1, "--warmup", 1, "--max-new-tokens", 6, "--k", 2, "--out", out,
    )  # fmt: skip
    assert code == 0
    result = json.loads(out.read_text())
    assert set(result["per_category"]) == {"late"}
    assert result["prompts"] == [f"{prompts}[2:]"]
