"""Crash injection: the trainer is killed (SIGKILL, no cleanup) at every phase of a save and
resumed; the resumed run must be the uninterrupted one.

Each phase is a function of the save path replaced, in a child process, by one that does part
of its work (or none) at the second save (or the last) and then kills its own process. After
the rerun: the same loss at every step, the same final weights, every checkpoint scored,
``best`` the highest τ on disk, each step logged once, and nothing temporary left behind.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_training import finish, launch, overrides, setup  # noqa: F401  (setup is a fixture)

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "debug" / "tiny.yaml"
ARGS = ("train.max_steps=6", "train.save_every=2", "train.schedule=constant")

#: phase -> (module, function, what the replacement does before it kills, at which call)
PHASES = {
    # accelerate wrote part of the new state (its weights file cut short)
    "inside_save_state": ("accelerate", "Accelerator.save_state", "partial_state", 2),
    # the old state moved aside, the new one not yet in place
    "between_state_renames": ("specdec.training.loop", "replace_dir", "first_rename", 2),
    # the state saved, the checkpoint not yet written
    "before_checkpoint": ("specdec.training.loop", "score_saved", "nothing", 2),
    # the checkpoint written, its score not yet
    "during_scoring": ("specdec.training.evaluate", "score", "nothing", 2),
    # the last score written, best not yet moved
    "before_best": ("specdec.training.evaluate", "update_best", "nothing", 3),
    # the last best.json written, the best link not yet
    "inside_best": ("specdec.training.checkpoint", "write_json", "call", 3),
}

CHILD = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    module_name, name, action, at = sys.argv[1:5]
    import importlib
    module = importlib.import_module(module_name)
    owner, attr = module, name
    if "." in name:
        cls, attr = name.split(".")
        owner = getattr(module, cls)
    real = getattr(owner, attr)
    calls = []

    def crash(*args, **kwargs):
        if action == "call" and "best" not in str(args[0]):
            return real(*args, **kwargs)  # only the writes of best.json count
        calls.append(1)
        if len(calls) < int(at):  # the earlier saves go through
            return real(*args, **kwargs)
        if action == "partial_state":
            real(*args, **kwargs)
            out = Path(args[1] if len(args) > 1 else kwargs["output_dir"])
            weights = out / "model.safetensors"
            weights.write_bytes(weights.read_bytes()[:100])
        elif action == "first_rename":
            tmp, final = args
            os.replace(final, final.with_name("." + final.name + ".old"))
        elif action == "call":
            real(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGKILL)

    setattr(owner, attr, crash)
    from specdec.cli import main
    sys.exit(main(sys.argv[5:]))
    """
)


def crash(tmp_path: Path, module, name, action, at: int, argv: list[str]):
    """Run ``specdec argv`` in a child whose ``module.name`` kills it at call ``at``."""
    script = tmp_path / "crash.py"
    script.write_text(CHILD)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, str(script), module, name, action, str(at), *argv],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def losses(run_dir: Path) -> dict[int, float]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m["step"] for m in lines if "train/loss" in m]
    assert len(steps) == len(set(steps)), f"a step logged twice: {steps}"
    return {m["step"]: m["train/loss"] for m in lines if "train/loss" in m}


@pytest.fixture(scope="module")
def whole(setup, tmp_path_factory):  # noqa: F811
    run_dir = tmp_path_factory.mktemp("whole") / "run"
    finish(launch(overrides(setup, run_dir, *ARGS)))
    return run_dir


@pytest.mark.parametrize("phase", list(PHASES))
def test_killed_at_a_save_phase_resumes_to_the_uninterrupted_run(setup, whole, tmp_path, phase):  # noqa: F811
    run_dir = tmp_path / "run"
    module, name, action, at = PHASES[phase]
    args = ["train", "--config", str(RECIPE), *overrides(setup, run_dir, *ARGS)]
    child = crash(tmp_path, module, name, action, at, args)
    assert child.returncode == -9, child.stdout[-2000:] + child.stderr[-2000:]
    out = finish(launch(overrides(setup, run_dir, *ARGS)))
    assert "resumed" in out

    assert losses(run_dir) == pytest.approx(losses(whole), rel=1e-6)
    final = load_file(run_dir / "state" / "model.safetensors")
    for key, value in load_file(whole / "state" / "model.safetensors").items():
        torch.testing.assert_close(final[key], value, atol=1e-6, rtol=1e-5)
    scores = {}
    for step in (2, 4, 6):
        path = run_dir / "checkpoints" / f"step-{step:06d}" / "score.json"
        assert path.is_file(), f"{path.parent.name} unscored"
        scores[path.parent.name] = json.loads(path.read_text())["tau"]
    best = json.loads((run_dir / "best.json").read_text())
    top = max(scores.values())
    assert best["checkpoint"] == min(k for k, t in scores.items() if t == top)
    assert (run_dir / "best").resolve() == (run_dir / best["path"]).resolve()
    left = [
        p.name for p in run_dir.rglob("*") if p.name.endswith((".old", ".tmp")) or ".tmp-" in p.name
    ]
    assert not left, f"left behind: {left}"


def test_export_killed_between_its_renames_keeps_the_old_export(whole, tmp_path):
    """An export replacing an older one (--force) is killed after moving the old one aside:
    the old one is there under its old-copy name, and the rerun completes the export."""
    out = tmp_path / "export"
    checkpoint = whole / "checkpoints" / "step-000006"
    argv = ["export", "--checkpoint", str(checkpoint), "--out", str(out), "--force"]
    first = subprocess.run(
        [sys.executable, "-m", "specdec.cli", *argv], cwd=ROOT, capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert first.returncode == 0, first.stderr[-2000:]
    before = (out / "model.safetensors").read_bytes()
    child = crash(tmp_path, "specdec.files", "replace_dir", "first_rename", 1, argv)
    assert child.returncode == -9, child.stderr[-2000:]
    assert (
        not out.exists() and (tmp_path / ".export.old" / "model.safetensors").read_bytes() == before
    )
    again = subprocess.run(
        [sys.executable, "-m", "specdec.cli", *argv], cwd=ROOT, capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert again.returncode == 0, again.stderr[-2000:]
    assert (out / "model.safetensors").read_bytes() == before
    assert not (tmp_path / ".export.old").exists()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
