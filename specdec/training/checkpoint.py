"""Run-directory bookkeeping: the train state, atomic saves, the recipe check and ``best``.

A run directory holds ``recipe.yaml`` (the resolved recipe), ``metrics.jsonl``, ``state/``
(accelerate's full training state, for resuming), ``checkpoints/step-N/`` (drafter weights,
``drafter.json``, ``score.json``) and ``best.json`` / ``best`` (the checkpoint with the
highest tau). Everything is written to a temporary name first and renamed into place, so a
run killed at any moment leaves either the old or the new version, never half of one.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from specdec.config import Recipe, recipe_to_dict
from specdec.errors import ConfigError
from specdec.files import write_json

# keys that may change between a run and its resumption without making it another run
RESUMABLE_CHANGES = ("train.max_steps", "train.trackers", "train.log_every", "eval.")


@dataclass
class TrainState:
    """What accelerate does not know about a run: where it is in the data.

    Registered with ``Accelerator.register_for_checkpointing`` so ``save_state`` /
    ``load_state`` carry it along with model, optimizer, scheduler and RNG states.
    """

    step: int = 0
    micro_batches: int = 0  # global micro-batches consumed: the data position
    tokens: int = 0  # input tokens trained on, all processes

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)


def check_same_recipe(run_dir: Path, recipe: Recipe) -> None:
    """Refuse to resume a run directory that was made by a different recipe."""
    import yaml

    saved_path = run_dir / "recipe.yaml"
    if not saved_path.exists():
        return
    saved = _flatten(yaml.safe_load(saved_path.read_text()) or {})
    now = _flatten(recipe_to_dict(recipe))
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
    """Point ``best`` at ``checkpoint`` if its tau beats the best so far."""
    best_file = run_dir / "best.json"
    best = json.loads(best_file.read_text()) if best_file.exists() else None
    if best is not None and best["tau"] >= score["tau"]:
        return False
    write_json(
        best_file,
        {
            "checkpoint": checkpoint.name,
            "path": str(checkpoint),
            "tau": score["tau"],
            "speedup": score["speedup"],
            "greedy_match_rate": score["greedy_match_rate"],
        },
    )
    link = run_dir / "best"
    tmp = run_dir / "best.tmp"
    if tmp.is_symlink():
        tmp.unlink()
    tmp.symlink_to(Path("checkpoints") / checkpoint.name)
    os.replace(tmp, link)
    return True
