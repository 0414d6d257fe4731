"""Run-directory bookkeeping: the train state, atomic saves, the recipe check and ``best``.

A run directory holds ``recipe.yaml`` (the resolved recipe), ``metrics.jsonl``, ``state/``
(accelerate's full training state, for resuming), ``checkpoints/step-N/`` (drafter weights,
``drafter.json``, ``score.json``) and ``best.json`` / ``best`` (the checkpoint with the
highest tau). Everything is written to a temporary name first and renamed into place, so a
run killed at any moment leaves either the old or the new version, never half of one.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from specdec.config import Recipe, load_recipe, recipe_to_dict
from specdec.errors import ConfigError
from specdec.files import recover_dir, write_json

logger = logging.getLogger(__name__)

# keys that may change between a run and its resumption without making it another run
# (run.output_dir: a run directory may be moved or copied and resumed where it lies)
RESUMABLE_CHANGES = (
    "train.max_steps", "train.max_minutes", "train.trackers", "train.log_every",
    "train.barrier_minutes", "eval.", "run.output_dir",
)  # fmt: skip


@dataclass
class TrainState:
    """What accelerate does not know about a run: where it is in the data.

    Registered with ``Accelerator.register_for_checkpointing`` so ``save_state`` /
    ``load_state`` carry it along with model, optimizer, scheduler and RNG states.
    """

    step: int = 0
    micro_batches: int = 0  # global micro-batches consumed: the data position
    tokens: int = 0  # input tokens trained on, all processes
    seconds: float = 0.0  # wall-clock spent training (train.max_minutes), the slowest process's

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)


def recover_run_dir(run_dir: Path) -> None:
    """Finish directory swaps a crash cut short (``state``, checkpoints); main process only.
    (A checkpoint a crash left half written is cleared when that step is saved again.)"""
    recover_dir(run_dir / "state", run_dir / "state.tmp")
    for old in (run_dir / "checkpoints").glob(".step-*.old"):
        recover_dir(old.with_name(old.name[1:].removesuffix(".old")))


def refresh_best(run_dir: Path) -> None:
    """``best`` from the scores on disk, compared under the latest checkpoint's settings (a
    run killed between a score and its ``best`` update)."""
    scores = sorted((run_dir / "checkpoints").glob("step-*/score.json"))
    for path in reversed(scores):
        try:
            score = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        update_best(run_dir, path.parent, score)
        return


def check_run_dir(run_dir: Path, recipe: Recipe) -> bool:
    """Whether the run resumes, checked before anything loads.

    Raises:
        ConfigError: ``run.output_dir`` is a file; the directory holds a run that
            ``train.resume: false`` would overwrite; or a run of another recipe.
    """
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"run.output_dir: {run_dir} is a file, not a directory")
    saved = (run_dir / "state").is_dir() or any((run_dir / "checkpoints").glob("step-*"))
    if not saved:
        return False
    if not recipe.train.resume:
        raise ConfigError(
            f"train.resume: false, but {run_dir} holds a run (its state and checkpoints) that "
            "this one would overwrite; resume it, choose another run.name or run.output_dir, "
            "or delete the directory"
        )
    check_same_recipe(run_dir, recipe)
    return (run_dir / "state").is_dir()


def check_same_recipe(run_dir: Path, recipe: Recipe) -> None:
    """Refuse to resume a run directory that was made by a different recipe."""
    import yaml

    saved_path = run_dir / "recipe.yaml"
    if not saved_path.exists():
        return
    saved = _flatten(yaml.safe_load(saved_path.read_text()) or {})
    now = _flatten(recipe_to_dict(recipe))
    if now.keys() - saved.keys():  # options added since the run began: it ran at their defaults
        try:
            filled = _flatten(recipe_to_dict(load_recipe(saved_path)))
        except ConfigError:  # a key since removed or renamed: compared as it is
            filled = {}
        saved = {**filled, **saved}  # what the file says wins
    for key in sorted(saved.keys() | now.keys()):
        if key.startswith(RESUMABLE_CHANGES) or saved.get(key) == now.get(key):
            continue
        raise ConfigError(
            f"{run_dir} holds a run of a different recipe ({key}: {saved.get(key)!r} there, "
            f"{now.get(key)!r} now); use another run.name or delete the directory"
        )


def _flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def update_best(run_dir: Path, checkpoint: Path, score: dict) -> bool:
    """Point ``best`` at the checkpoint with the highest τ (the earliest on a tie) among those
    scored with the same settings as ``score``, read from the score files on disk each time: a
    stale, corrupt or foreign ``best.json`` cannot mislead it, and τ measured under other
    ``eval`` settings is not compared. Returns whether ``checkpoint`` is the best."""
    settings = json.loads(json.dumps(score.get("settings"), default=str))  # as on disk
    scored = []
    for path in sorted((run_dir / "checkpoints").glob("step-*/score.json")):
        try:
            other = json.loads(path.read_text())
        except (OSError, ValueError):
            logger.warning("%s: unreadable, left out of the best checkpoint", path)
            continue
        if other.get("settings") == settings and "tau" in other:
            scored.append((-other["tau"], path.parent.name, other))
    if not scored:
        return False
    _, name, best = min(scored)
    write_json(
        run_dir / "best.json",
        {
            "checkpoint": name,
            "path": f"checkpoints/{name}",  # relative: the run directory may move
            "tau": best["tau"],
            "speedup": best["speedup"],
            "greedy_match_rate": best["greedy_match_rate"],
        },
    )
    link, tmp = run_dir / "best", run_dir / "best.tmp"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    tmp.symlink_to(Path("checkpoints") / name)
    os.replace(tmp, link)
    return name == checkpoint.name
