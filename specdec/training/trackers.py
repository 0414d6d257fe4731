"""Metrics sinks: ``metrics.jsonl`` always (on the main process), plus accelerate's trackers
(wandb, tensorboard) when the recipe selects them. Other processes get a no-op log."""

from __future__ import annotations

import json
from pathlib import Path

from specdec.config import Recipe, recipe_to_dict


class MetricsLog:
    """Appends ``{"step": N, key: value, ...}`` lines; on resume, drops lines after the
    restored step so a killed-and-resumed run has each step once."""

    def __init__(self, path: Path, accelerator, recipe: Recipe, truncate_after: int = 0):
        self.accelerator = accelerator
        self.active = accelerator.is_main_process
        self.file = None
        if not self.active:
            return
        if path.exists():
            kept = [
                line
                for line in path.read_text().splitlines()
                if line and json.loads(line)["step"] <= truncate_after
            ]
            path.write_text("".join(line + "\n" for line in kept))
        self.file = open(path, "a")  # noqa: SIM115 - kept open for the run
        if accelerator.trackers is not None and recipe.train.trackers:
            accelerator.init_trackers(
                recipe.train.wandb_project,
                config=_flat(recipe),
                init_kwargs={"wandb": {"dir": str(path.parent), "name": recipe.run.name}},
            )

    def write(self, step: int, metrics: dict) -> None:
        if not self.active:
            return
        self.file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.file.flush()
        numeric = {k: v for k, v in metrics.items() if isinstance(v, int | float)}
        self.accelerator.log(numeric, step=step)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def _flat(recipe: Recipe) -> dict:
    out = {}
    for section, values in recipe_to_dict(recipe).items():
        for key, value in values.items():
            out[f"{section}.{key}"] = (
                value if isinstance(value, int | float | str | bool) else str(value)
            )
    return out
